//! The request pipeline (pingora's fixed phases): [`Proxy::clear`] for every CONNECT and
//! forwarded request, then the dial and the relay, and the one rescue point that turns a
//! refusal into the client's answer.
//!
//! Invariant: phases 1–5 run in order, once, here only: identify the lease → [`decide`] (the
//! same function `check` calls) → tie the connection to the lease → resolve and guard. The
//! exchange is written from what they return, never read back. A refusal found before the
//! client heard anything is answered through [`Proxy::refuse`]; one found after the tunnel's
//! 200 (the SNI check) cannot change the status any more, so it is recorded through
//! [`Proxy::record_refusal`] and the tunnel is closed. Either way a revoking code revokes.

use super::answer;
use super::body;
use super::connection::ClientConn;
use super::decision::{
    decide, policy_failure, resolve_and_guard, Ask, Asked, Decision, Reached, Refused,
};
use super::dialer;
use super::exchange::Exchange;
use super::identify::{self, Identity};
use super::state::Proxy;
use super::Body;
use crate::config::{Mode, OnRefusal};
use crate::contract::Timestamp;
use crate::policy::codes::Refusal;
use crate::policy::UpstreamAddr;
use crate::registry::revocation::RefusedEgress;
use crate::telemetry::egress::LoggedVerdict;
use http::{HeaderMap, Response};
use std::future::Future;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// A proven credential makes the request the lease's traffic (its series, a revocation on its
/// account); an unproven one names no lease on the line.
fn name_lease(ex: &mut Exchange, identity: &Identity, lease_known: bool) {
    ex.lease_id = Some(identity.lease_id.clone());
    ex.label = identity.label.clone();
    ex.lease_known = lease_known;
}

/// A request cleared by phases 1–5: the decision, the lease the connection is now tied to, and
/// the checked addresses that may be dialled.
pub struct Cleared {
    pub decision: Decision,
    /// Cancelled when the lease (or an ancestor) closes.
    pub token: CancellationToken,
    /// Checked addresses in resolver order; empty only when names are not resolved.
    pub addrs: Vec<UpstreamAddr>,
    /// Who proved the lease (the lease the connection is tied to): what each request inside
    /// a terminated tunnel is decided for.
    pub identity: Identity,
}

impl Cleared {
    /// The lease the connection is now tied to.
    pub fn lease_id(&self) -> &str {
        &self.identity.lease_id
    }
}

impl Proxy {
    /// Phases 1–5 for one request: the admission gate, the lease the request names, [`decide`]
    /// over the registry's current snapshot, the connection tied to the lease, then
    /// [`resolve_and_guard`]. `authority` is what the client asked for (the CONNECT target, or
    /// the absolute URI's authority), `default_port` applies when it has none.
    pub async fn clear(
        &self,
        conn: &ClientConn,
        headers: &HeaderMap,
        asked: Asked<'_>,
        authority: &str,
        default_port: Option<u16>,
        ex: &mut Exchange,
    ) -> Result<Cleared, Refusal> {
        let ask = Ask::new(asked, authority, default_port);
        // An identification refusal's line names the target too, when the request names one.
        if let Ok(target) = &ask.target {
            ex.target = Some(target.clone());
        }
        // Nothing new is admitted on a state the process may have missed changes to while it
        // was not running (an atomic check unless it was).
        self.registry.admission(ex.started()).await;
        let identity = identify::identify(headers, conn.port_lease.as_deref())?;
        let snapshot = self.registry.snapshot();
        let lease_known = snapshot.ledger.lease(&identity.lease_id).is_some();
        let now = self.registry.now();
        let mut decision = match decide(snapshot, &self.config, &identity, ask, now) {
            Ok(decision) => decision,
            Err(Refused { refusal, reached }) => {
                // A challenge on a lease's own port is counted on that lease (the port says
                // which), though the credential it asks for is not proven.
                let challenged_on_port = identity.on_port && refusal.code.is_challenge();
                if reached >= Reached::Lease || challenged_on_port {
                    name_lease(ex, &identity, lease_known);
                }
                if reached == Reached::OpenChain {
                    self.tie(conn, &identity.lease_id, now, ex)?;
                }
                return Err(refusal);
            }
        };
        name_lease(ex, &identity, lease_known);
        ex.rule = decision.rule.take();
        let token = self.tie(conn, &identity.lease_id, now, ex)?;
        self.report(ex, &decision.reported);
        let before = decision.reported.len();
        let addrs = resolve_and_guard(&self.config, &mut decision).await;
        self.report(ex, &decision.reported[before..]);
        ex.observe_decision();
        let addrs = addrs?;
        ex.count_open();
        Ok(Cleared {
            decision,
            token,
            addrs,
            identity,
        })
    }

    /// Phases 1–4 for a request inside a terminated tunnel: the admission gate, then
    /// [`decide`] for the lease the tunnel proved, over the current snapshot (so a lease closed
    /// since the CONNECT is refused here). The connection is the tunnel's, already tied to the
    /// lease; the addresses are the tunnel's, already checked. `ask` names the tunnel's target
    /// (parsed once for the tunnel: [`Ask::new`] with default port 443).
    pub async fn clear_inside(
        &self,
        identity: &Identity,
        ask: Ask<'_>,
        token: &CancellationToken,
        ex: &mut Exchange,
    ) -> Result<Decision, Refusal> {
        if let Ok(target) = &ask.target {
            ex.target = Some(target.clone());
        }
        self.registry.admission(ex.started()).await;
        let snapshot = self.registry.snapshot();
        let lease_known = snapshot.ledger.lease(&identity.lease_id).is_some();
        name_lease(ex, identity, lease_known);
        ex.token = Some(token.clone());
        let now = self.registry.now();
        let mut decision = decide(snapshot, &self.config, identity, ask, now)
            .map_err(|refused| refused.refusal)?;
        ex.rule = decision.rule.take();
        self.report(ex, &decision.reported);
        ex.observe_decision();
        ex.count_open();
        Ok(decision)
    }

    /// Ties the connection to the lease of a chain that opens (its connection limit, its
    /// teardown), before anything else is answered.
    fn tie(
        &self,
        conn: &ClientConn,
        lease_id: &str,
        now: Timestamp,
        ex: &mut Exchange,
    ) -> Result<CancellationToken, Refusal> {
        let limit = self.config.max_connections_per_lease;
        let token = conn.link(&self.registry, limit, lease_id, now)?;
        ex.token = Some(token.clone());
        Ok(token)
    }

    /// Report mode: what enforce mode would have refused goes on the exchange's line (the
    /// first code) and in the log; the request goes on.
    fn report(&self, ex: &mut Exchange, reported: &[Refusal]) {
        for refusal in reported {
            tracing::info!(code = %refusal.code, detail = %refusal.detail, "report mode: would refuse");
            ex.verdict = LoggedVerdict::Report;
            if ex.code.is_none() {
                ex.code = Some(refusal.code);
                ex.rule = refusal.rule.clone();
            }
        }
    }

    /// A policy check after phases 1–5 (the tunnel's SNI): refused in enforce mode, reported
    /// and let through in report mode.
    pub fn policy_failure(&self, ex: &mut Exchange, refusal: Refusal) -> Result<(), Refusal> {
        let mut reported = Vec::new();
        policy_failure(self.config.mode, refusal, &mut reported)?;
        self.report(ex, &reported);
        Ok(())
    }

    /// Phase 6: connects to the first checked address that answers (timed).
    pub async fn dial(
        &self,
        addrs: &[UpstreamAddr],
        ex: &mut Exchange,
    ) -> Result<(TcpStream, UpstreamAddr), Refusal> {
        let started = std::time::Instant::now();
        let (stream, dialed) =
            dialer::dial_first(self.dialer.as_ref(), addrs, self.config.connect_timeout)
                .await
                .map_err(|e| e.refusal())?;
        self.telemetry
            .metrics
            .upstream_connect
            .observe(started.elapsed().as_secs_f64());
        ex.dialed = Some(dialed);
        Ok((stream, dialed))
    }

    /// Phase 7 for upgraded connections and tunnels behind the TLS listener: copies bytes
    /// both ways until either side ends, the lease closes, a drain runs out or the tunnel
    /// idles (see `Proxy::relay_counted`).
    pub async fn relay<C, U>(
        &self,
        client: C,
        upstream: U,
        token: &CancellationToken,
        ex: &mut Exchange,
    ) where
        C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
        U: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let copy = body::relay(client, upstream, self.watch(ex, token));
        self.relay_counted(ex, copy).await;
    }

    /// Phase 7 for a plain TCP tunnel: [`Proxy::relay`]'s contract, spliced on Linux.
    pub async fn relay_tcp(
        &self,
        client: TcpStream,
        upstream: TcpStream,
        token: &CancellationToken,
        ex: &mut Exchange,
    ) {
        #[cfg(target_os = "linux")]
        {
            let spliced = super::splice::relay(client, upstream, self.watch(ex, token));
            self.relay_counted(ex, spliced).await;
        }
        #[cfg(not(target_os = "linux"))]
        self.relay(client, upstream, token, ex).await;
    }

    /// What a relay of `ex` counts into and what ends it.
    fn watch<'a>(&'a self, ex: &Exchange, token: &'a CancellationToken) -> body::Watch<'a> {
        body::Watch {
            up: ex.bytes_up.clone(),
            down: ex.bytes_down.clone(),
            lease: token,
            hard_stop: &self.hard_stop,
            idle: self.config.tunnel_idle_timeout,
        }
    }

    /// Runs a relay counted as an open tunnel; the way it ended goes on the exchange's line.
    async fn relay_counted(&self, ex: &mut Exchange, relay: impl Future<Output = body::RelayEnd>) {
        let lease = ex.lease_id.clone().unwrap_or_default();
        self.telemetry.metrics.tunnel_opened(&lease);
        let end = relay.await;
        self.telemetry.metrics.tunnel_closed(&lease);
        ex.error = end.describe();
    }

    /// Records a refusal on the exchange and, for a revoking code under `--on-refusal
    /// revoke`, revokes the lease before answering — so the next request already sees it.
    pub async fn record_refusal(&self, ex: &mut Exchange, refusal: &Refusal) {
        ex.verdict = match refusal.code.is_challenge() {
            true => LoggedVerdict::Challenge,
            false => LoggedVerdict::Refuse,
        };
        ex.code = Some(refusal.code);
        ex.rule = refusal.rule.clone();
        let Some(lease_id) = ex.lease_id.clone() else {
            return;
        };
        let revokes = refusal.code.is_misuse()
            || (refusal.code.is_policy()
                && self.config.on_refusal == OnRefusal::Revoke
                && self.config.mode == Mode::Enforce);
        if !revokes {
            return;
        }
        let egress = RefusedEgress {
            method: ex.method.as_str(),
            target: ex.target.as_ref(),
            shown_target: ex.target_text("?"),
            refusal,
            client: ex.client,
            listener: ex.listener,
        };
        let (reason, extra) = egress.reason_and_extra();
        match self.registry.revoke(&lease_id, &reason, extra).await {
            Ok(revoked) => ex.revoked = Some(revoked),
            // Revoked in memory and torn down; its record waits in the durable queue.
            Err(error) if error.revoked_in_memory() => {
                tracing::warn!(%error, lease = %lease_id, "revoked after a refusal; the record is queued");
                ex.revoked = Some(true);
            }
            Err(error) => {
                tracing::error!(%error, lease = %lease_id, "could not revoke the lease after a refusal");
                ex.revoked = Some(false);
            }
        }
    }

    /// `refusal` with its detail scrubbed of every secret's value, canary and placeholder
    /// ([`SecretSet::scrubbed`](crate::secrets::SecretSet::scrubbed)): the journal, the egress
    /// line and the answer all take the detail from here.
    fn scrubbed(&self, mut refusal: Refusal) -> Refusal {
        if let Some(broker) = &self.broker {
            if let std::borrow::Cow::Owned(clean) =
                broker.secrets.current().scrubbed(&refusal.detail)
            {
                refusal.detail = clean;
            }
        }
        refusal
    }

    /// The one rescue point: a refusal becomes the client's response (and maybe a revocation).
    pub async fn refuse(
        &self,
        ex: &mut Exchange,
        refusal: Refusal,
        target_fallback: &str,
    ) -> Response<Body> {
        ex.observe_decision();
        let refusal = self.scrubbed(refusal);
        self.record_refusal(ex, &refusal).await;
        ex.status = Some(refusal.code.status().as_u16());
        // The line says why, in the words the client read (a closed lease: what closed it).
        ex.error.get_or_insert_with(|| refusal.detail.clone());
        tracing::info!(code = %refusal.code, lease = %ex.lease_id.as_deref().unwrap_or("(none)"), method = %ex.method, target = %ex.target_text(target_fallback), "refused");
        let answer = answer::response(
            &refusal,
            ex.method.as_str(),
            &ex.target_text(target_fallback),
            ex.lease_id.as_deref(),
        );
        // A read request to an MCP server is answered as the server would: a JSON-RPC error
        // its SDK raises, with the same status and refusal header; a model call as its API
        // would, so the SDK's exception says why.
        if let Some(tap) = ex.mcp.as_deref().filter(|tap| tap.answers_as_json_rpc()) {
            let body = tap.refusal_body(&refusal, ex.lease_id.as_deref());
            return answer::with_json(answer, body);
        }
        match ex.api {
            Some(api) => {
                let line = answer::line(
                    &refusal,
                    ex.method.as_str(),
                    &ex.target_text(target_fallback),
                    ex.lease_id.as_deref(),
                );
                let body = super::metering::error_json(api, refusal.code, &line);
                answer::with_json(answer, body.to_string().into_bytes())
            }
            None => answer,
        }
    }
}
