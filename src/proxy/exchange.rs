//! The per-request context and the logging phase: one egress line per request or tunnel.
//!
//! Invariant: an [`Exchange`] writes its egress line exactly once, when it is dropped — so
//! every path (refusal, error, success, client gone, lease closed) logs, and none logs twice;
//! it is counted in `Telemetry::exchanges` until its line is queued. Once cleared it is counted
//! open with its lease's figures (its call, its bytes as they move), and its end moves it into
//! the totals in one step.

use crate::contract::Timestamp;
use crate::policy::codes::Code;
use crate::policy::{Rule, Target, UpstreamAddr};
use crate::telemetry::egress::{EgressEvent, Kind, LoggedVerdict};
use crate::telemetry::metrics::{Metrics, OpenExchange, OpenTicket};
use crate::telemetry::Telemetry;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tokio_util::sync::CancellationToken;

pub use crate::telemetry::metrics::Counter;

/// Everything the egress line of one request or tunnel says.
pub struct Exchange {
    telemetry: Arc<Telemetry>,
    /// The lease id names a lease the registry knows (metrics keep series only for those).
    pub lease_known: bool,
    /// The decision latency has been observed.
    pub decided: bool,
    started: Instant,
    time: Timestamp,
    pub kind: Kind,
    pub method: http::Method,
    pub client: SocketAddr,
    pub listener: SocketAddr,
    pub lease_id: Option<String>,
    pub label: Option<String>,
    pub target: Option<Target>,
    pub dialed: Option<UpstreamAddr>,
    pub verdict: LoggedVerdict,
    pub code: Option<Code>,
    /// The pattern, guard range or port list that decided, when one did.
    pub rule: Option<Rule>,
    pub status: Option<u16>,
    pub bytes_up: Counter,
    pub bytes_down: Counter,
    pub error: Option<String>,
    pub revoked: Option<bool>,
    /// Inside a terminated tunnel: the request's path, query values redacted.
    pub path: Option<String>,
    /// Inside a terminated tunnel: the secrets put into the request.
    pub secrets: Vec<String>,
    /// A metered model call: its response is read for its usage, charged when the exchange ends.
    pub model: Option<Box<super::metering::Tap>>,
    /// A request to an MCP server: what was read of it, the steps it holds.
    pub mcp: Option<Box<super::mcp::McpTap>>,
    /// A request a route of the lease's `approvals` held: the approval it went on with.
    pub approval: Option<String>,
    /// A model call: the API whose own error shape its refusal is answered in.
    pub api: Option<crate::meter::Api>,
    /// The lease's token: if it fired, the line says the lease closed the exchange.
    pub token: Option<CancellationToken>,
    /// Counted open with its lease's figures since it was cleared (see [`Exchange::count_open`]).
    open: Option<OpenTicket>,
    /// Counts this exchange as open until it is dropped (fields drop after `Drop::drop` has
    /// queued the line), so a shutdown waits for the line.
    _open: tokio_util::task::task_tracker::TaskTrackerToken,
}

impl Exchange {
    /// When the request was read: what the admission gate after a pause compares its
    /// heartbeat with.
    pub fn started(&self) -> Instant {
        self.started
    }

    pub fn new(
        telemetry: Arc<Telemetry>,
        kind: Kind,
        method: http::Method,
        client: SocketAddr,
        listener: SocketAddr,
    ) -> Exchange {
        Exchange {
            _open: telemetry.exchanges.token(),
            telemetry,
            lease_known: false,
            decided: false,
            started: Instant::now(),
            time: Timestamp::now(),
            kind,
            method,
            client,
            listener,
            lease_id: None,
            label: None,
            target: None,
            dialed: None,
            verdict: LoggedVerdict::Allow,
            code: None,
            rule: None,
            status: None,
            bytes_up: Counter::default(),
            bytes_down: Counter::default(),
            error: None,
            revoked: None,
            path: None,
            secrets: Vec::new(),
            model: None,
            mcp: None,
            approval: None,
            api: None,
            token: None,
            open: None,
        }
    }

    /// Counts the exchange as open in its lease's figures, once cleared: its call from now,
    /// its bytes as they move (read from the same counters the relay adds to, so a chunk
    /// costs nothing more). Ending it moves it into the totals once.
    pub fn count_open(&mut self) {
        if self.open.is_some() {
            return;
        }
        let lease = Metrics::lease_key(self.lease_id.as_deref(), self.lease_known);
        let open = OpenExchange {
            kind: self.kind,
            verdict: self.verdict,
            code: self.code.map_or("", Code::as_str),
            host: self.target.as_ref().map(|t| t.host.as_text()),
            port: self.target.as_ref().map(|t| t.port),
            started: self.time,
            up: self.bytes_up.clone(),
            down: self.bytes_down.clone(),
        };
        self.open = Some(self.telemetry.metrics.open(lease, open));
    }

    /// The client's side of a CONNECT once hyper hands it over; `None` (the failure on the
    /// line) when it does not.
    pub async fn upgraded(
        &mut self,
        req: http::Request<hyper::body::Incoming>,
    ) -> Option<hyper::upgrade::Upgraded> {
        match hyper::upgrade::on(req).await {
            Ok(upgraded) => Some(upgraded),
            Err(error) => {
                self.error = Some(format!("upgrade failed: {error}"));
                None
            }
        }
    }

    /// Time since the request arrived.
    pub fn elapsed(&self) -> std::time::Duration {
        self.started.elapsed()
    }

    /// Observes the decision latency of this exchange, once (a refusal before phase 5 is a
    /// decision too).
    pub fn observe_decision(&mut self) {
        if !std::mem::replace(&mut self.decided, true) {
            self.telemetry
                .metrics
                .decision
                .observe(self.started.elapsed().as_secs_f64());
        }
    }

    /// The target as the refusal line names it.
    pub fn target_text(&self, fallback: &str) -> String {
        self.target
            .as_ref()
            .map_or_else(|| fallback.to_owned(), ToString::to_string)
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        let closed_by_lease = self
            .token
            .as_ref()
            .is_some_and(CancellationToken::is_cancelled);
        if self.error.is_none() && self.verdict != LoggedVerdict::Refuse && closed_by_lease {
            self.error = Some("closed: the lease no longer opens anything".into());
        }
        // One clock read for both: the end is the start plus the monotonic time since.
        let elapsed = self.started.elapsed();
        let event = EgressEvent {
            time: self.time,
            ended: self
                .time
                .saturating_add_millis(i64::try_from(elapsed.as_millis()).unwrap_or(i64::MAX)),
            lease_id: self.lease_id.take(),
            label: self.label.take(),
            client: self.client,
            listener: self.listener,
            kind: self.kind,
            method: std::mem::take(&mut self.method),
            port: self.target.as_ref().map(|t| t.port),
            host: self.target.take().map(|t| t.host.into_text()),
            dialed: self.dialed.map(UpstreamAddr::socket_addr),
            verdict: self.verdict,
            code: self.code.map(Code::as_str),
            rule: self.rule.take(),
            status: self.status,
            bytes_up: self.bytes_up.load(Ordering::Relaxed),
            bytes_down: self.bytes_down.load(Ordering::Relaxed),
            duration_ms: elapsed.as_secs_f64() * 1000.0,
            path: self.path.take(),
            secrets: std::mem::take(&mut self.secrets),
            model: self.model.take().map(|tap| Box::new(tap.finish())),
            mcp: self.mcp.take().map(|tap| Box::new(tap.finish())),
            approval: self.approval.take(),
            error: self.error.take(),
            revoked: self.revoked,
        };
        self.telemetry
            .record(event, self.lease_known, self.open.take());
    }
}
