//! Per-lease metrics and latency histograms, exposed in the Prometheus text format.
//!
//! Invariant: a series exists only for a lease the registry knows (anything else is counted
//! under `lease_id="-"`, so unknown ids cannot grow the cardinality), and the series of a
//! lease that closed disappear [`GRACE`] after it closed — the set stays bounded by the open
//! leases.

use super::egress::{EgressEvent, Kind, LoggedVerdict};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long the series of a closed lease stay visible, by default.
pub const GRACE: Duration = Duration::from_secs(300);
/// Distinct hosts remembered per lease (further hosts are counted under "(other)").
const MAX_HOSTS: usize = 1000;

/// Requests, bytes and destinations of one host of one lease.
#[derive(Debug, Clone, Default, Serialize)]
pub struct HostCounters {
    pub requests: u64,
    pub bytes_up: u64,
    pub bytes_down: u64,
}

/// What one lease did.
#[derive(Debug, Clone, Default)]
pub struct LeaseCounters {
    /// Requests by (kind, verdict, code).
    pub requests: HashMap<(Kind, LoggedVerdict, &'static str), u64>,
    pub bytes_up: u64,
    pub bytes_down: u64,
    pub open_tunnels: u64,
    pub open_connections: u64,
    pub hosts: HashMap<String, HostCounters>,
    /// When the lease was first seen closed (series go after [`GRACE`]).
    closed_at: Option<Instant>,
}

impl LeaseCounters {
    /// The `n` hosts with the most requests.
    pub fn top_hosts(&self, n: usize) -> Vec<(String, HostCounters)> {
        let mut hosts: Vec<(String, HostCounters)> = self
            .hosts
            .iter()
            .map(|(h, c)| (h.clone(), c.clone()))
            .collect();
        hosts.sort_by(|a, b| b.1.requests.cmp(&a.1.requests).then(a.0.cmp(&b.0)));
        hosts.truncate(n);
        hosts
    }

    pub fn total_requests(&self) -> u64 {
        self.requests.values().sum()
    }
}

/// The label value for a request without a known lease.
pub const NO_LEASE: &str = "-";

/// Every metric leasegate exposes.
#[derive(Debug)]
pub struct Metrics {
    leases: Mutex<HashMap<String, LeaseCounters>>,
    /// How long the series of a closed lease stay after it closed.
    grace: Duration,
    /// Time from a request's arrival to its verdict (before any dial).
    pub decision: Histogram,
    /// Time to connect to an upstream.
    pub upstream_connect: Histogram,
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::with_grace(GRACE)
    }
}

impl Metrics {
    pub fn with_grace(grace: Duration) -> Metrics {
        Metrics {
            leases: Mutex::new(HashMap::new()),
            grace,
            decision: Histogram::new(exponential_buckets(0.000_01, 4.0, 10)),
            upstream_connect: Histogram::new(exponential_buckets(0.000_1, 4.0, 10)),
        }
    }
}

impl Metrics {
    fn with<R>(&self, lease: &str, f: impl FnOnce(&mut LeaseCounters) -> R) -> R {
        let mut leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        f(leases.entry(lease.to_owned()).or_default())
    }

    /// Counts one finished exchange. `lease_known` says whether its lease id is in the registry.
    pub fn record(&self, event: &EgressEvent, lease_known: bool) {
        let lease = match (&event.lease_id, lease_known) {
            (Some(id), true) => id.as_str(),
            _ => NO_LEASE,
        };
        self.with(lease, |c| {
            *c.requests
                .entry((event.kind, event.verdict, event.code.unwrap_or("")))
                .or_default() += 1;
            c.bytes_up += event.bytes_up;
            c.bytes_down += event.bytes_down;
            if let Some(host) = &event.host {
                let key = if c.hosts.len() < MAX_HOSTS || c.hosts.contains_key(host) {
                    host.as_str()
                } else {
                    "(other)"
                };
                // A key is built only for a host not seen before, not per request.
                if !c.hosts.contains_key(key) {
                    c.hosts.insert(key.to_owned(), HostCounters::default());
                }
                if let Some(h) = c.hosts.get_mut(key) {
                    h.requests += 1;
                    h.bytes_up += event.bytes_up;
                    h.bytes_down += event.bytes_down;
                }
            }
        });
    }

    pub fn tunnel_opened(&self, lease: &str) {
        self.with(lease, |c| c.open_tunnels += 1);
    }

    pub fn tunnel_closed(&self, lease: &str) {
        self.with(lease, |c| c.open_tunnels = c.open_tunnels.saturating_sub(1));
    }

    /// Counts a client connection of `lease` unless it already has `limit` open; returns
    /// whether it was counted.
    pub fn connection_opened_within(&self, lease: &str, limit: usize) -> bool {
        self.with(lease, |c| {
            let admitted = (c.open_connections as usize) < limit;
            if admitted {
                c.open_connections += 1;
            }
            admitted
        })
    }

    pub fn connection_closed(&self, lease: &str) {
        self.with(lease, |c| {
            c.open_connections = c.open_connections.saturating_sub(1)
        });
    }

    /// A copy of one lease's counters.
    pub fn lease(&self, lease: &str) -> Option<LeaseCounters> {
        let leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        leases.get(lease).cloned()
    }

    /// Forgets leases closed for longer than the grace period; `is_open` says which are open.
    pub fn prune(&self, is_open: impl Fn(&str) -> bool) {
        let mut leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        leases.retain(|id, c| {
            if id == NO_LEASE || is_open(id) {
                c.closed_at = None;
                return true;
            }
            let since = *c.closed_at.get_or_insert_with(Instant::now);
            since.elapsed() < self.grace || c.open_tunnels > 0 || c.open_connections > 0
        });
    }
}

/// Gauges computed from the registry at scrape time.
#[derive(Debug, Default, Clone)]
pub struct RegistryFigures {
    /// Leases by status.
    pub leases_by_status: Vec<(&'static str, u64)>,
    /// Journal lines applied, by event.
    pub journal_lines: Vec<(&'static str, u64)>,
    /// Journal lines skipped, by reason (`parse`, `schema`, `lease`, `rule`, `signature`).
    pub journal_invalid_lines: Vec<(&'static str, u64)>,
    /// Appends to the journal that failed or timed out.
    pub journal_append_failures: u64,
    /// Revocation records waiting for the journal to take them.
    pub journal_pending_revocations: u64,
    /// The store's following: lag and reconnections.
    pub store_lag_seconds: f64,
    pub store_reconnects: u64,
    pub egress_dropped: u64,
    /// `--egress-stream`'s publisher, when it is on.
    pub egress_stream: Option<super::egress_stream::StreamFigures>,
}

/// Renders everything as Prometheus text (version 0.0.4).
pub fn render(metrics: &Arc<Metrics>, figures: RegistryFigures) -> String {
    let mut registry = Registry::default();
    registry.register(
        "leasegate_decision_seconds",
        "Time from request to verdict",
        metrics.decision.clone(),
    );
    registry.register(
        "leasegate_upstream_connect_seconds",
        "Time to connect to an upstream",
        metrics.upstream_connect.clone(),
    );
    registry.register_collector(Box::new(Scrape {
        metrics: metrics.clone(),
        figures,
    }));
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &registry);
    out
}

#[derive(Debug)]
struct Scrape {
    metrics: Arc<Metrics>,
    figures: RegistryFigures,
}

fn kind_str(kind: Kind) -> &'static str {
    match kind {
        Kind::Connect => "connect",
        Kind::Http => "http",
    }
}

fn verdict_str(verdict: LoggedVerdict) -> &'static str {
    match verdict {
        LoggedVerdict::Allow => "allow",
        LoggedVerdict::Refuse => "refuse",
        LoggedVerdict::Report => "report",
    }
}

impl Collector for Scrape {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let leases = self
            .metrics
            .leases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut ids: Vec<&String> = leases.keys().collect();
        ids.sort();

        let mut family = encoder.encode_descriptor(
            "leasegate_requests",
            "Requests and tunnels by lease, kind, verdict and refusal code",
            None,
            MetricType::Counter,
        )?;
        for id in &ids {
            let mut rows: Vec<_> = leases[*id].requests.iter().collect();
            rows.sort_by_key(|((k, v, c), _)| (kind_str(*k), verdict_str(*v), *c));
            for ((kind, verdict, code), n) in rows {
                let labels = [
                    ("lease_id", id.as_str()),
                    ("kind", kind_str(*kind)),
                    ("verdict", verdict_str(*verdict)),
                    ("code", code),
                ];
                ConstCounter::new(*n).encode(family.encode_family(&labels)?)?;
            }
        }

        let mut family = encoder.encode_descriptor(
            "leasegate_bytes",
            "Bytes moved by lease and direction (up: client to upstream)",
            None,
            MetricType::Counter,
        )?;
        for id in &ids {
            let c = &leases[*id];
            for (direction, n) in [("up", c.bytes_up), ("down", c.bytes_down)] {
                ConstCounter::new(n).encode(
                    family.encode_family(&[("lease_id", id.as_str()), ("direction", direction)])?,
                )?;
            }
        }

        for (name, help, pick) in [
            (
                "leasegate_open_tunnels",
                "Open CONNECT tunnels and upgraded connections by lease",
                (|c: &LeaseCounters| c.open_tunnels) as fn(&LeaseCounters) -> u64,
            ),
            (
                "leasegate_open_connections",
                "Open client connections by lease",
                |c: &LeaseCounters| c.open_connections,
            ),
        ] {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for id in &ids {
                ConstGauge::new(pick(&leases[*id]) as i64)
                    .encode(family.encode_family(&[("lease_id", id.as_str())])?)?;
            }
        }

        let mut family = encoder.encode_descriptor(
            "leasegate_leases",
            "Known leases by status",
            None,
            MetricType::Gauge,
        )?;
        for (status, n) in &self.figures.leases_by_status {
            ConstGauge::new(*n as i64).encode(family.encode_family(&[("status", *status)])?)?;
        }
        let mut family = encoder.encode_descriptor(
            "leasegate_journal_lines",
            "Journal lines applied, by event",
            None,
            MetricType::Counter,
        )?;
        for (event, n) in &self.figures.journal_lines {
            ConstCounter::new(*n).encode(family.encode_family(&[("event", *event)])?)?;
        }
        let mut family = encoder.encode_descriptor(
            "leasegate_journal_invalid_lines",
            "Journal lines skipped because they did not parse or validate, by reason",
            None,
            MetricType::Counter,
        )?;
        for (reason, n) in &self.figures.journal_invalid_lines {
            ConstCounter::new(*n).encode(family.encode_family(&[("reason", *reason)])?)?;
        }
        let counter = ConstCounter::new(self.figures.journal_append_failures);
        counter.encode(encoder.encode_descriptor(
            "leasegate_journal_append_failures",
            "Appends to the journal that failed or timed out (the record is queued)",
            None,
            counter.metric_type(),
        )?)?;
        let gauge = ConstGauge::new(self.figures.journal_pending_revocations as i64);
        gauge.encode(encoder.encode_descriptor(
            "leasegate_journal_pending_revocations",
            "Revocation records waiting for the journal to take them",
            None,
            gauge.metric_type(),
        )?)?;
        let gauge = ConstGauge::new(self.figures.store_lag_seconds);
        gauge.encode(encoder.encode_descriptor(
            "leasegate_store_lag_seconds",
            "Time since the proxy last held everything the journal store held",
            None,
            gauge.metric_type(),
        )?)?;
        let counter = ConstCounter::new(self.figures.store_reconnects);
        counter.encode(encoder.encode_descriptor(
            "leasegate_store_reconnects",
            "Reconnections to the journal store",
            None,
            counter.metric_type(),
        )?)?;
        let gauge = ConstGauge::new(self.figures.journal_pending_revocations as i64);
        gauge.encode(encoder.encode_descriptor(
            "leasegate_store_pending_appends",
            "Records waiting for the journal store to take them (the same queue as leasegate_journal_pending_revocations)",
            None,
            gauge.metric_type(),
        )?)?;
        let counter = ConstCounter::new(self.figures.egress_dropped);
        counter.encode(encoder.encode_descriptor(
            "leasegate_egress_log_dropped",
            "Egress log lines dropped because the writer was behind",
            None,
            counter.metric_type(),
        )?)?;
        if let Some(stream) = self.figures.egress_stream {
            let counter = ConstCounter::new(stream.dropped);
            counter.encode(encoder.encode_descriptor(
                "leasegate_egress_stream_dropped",
                "Egress lines not published to --egress-stream: the backlog was full, or shutdown came first",
                None,
                counter.metric_type(),
            )?)?;
            let gauge = ConstGauge::new(stream.backlog as i64);
            gauge.encode(encoder.encode_descriptor(
                "leasegate_egress_stream_backlog",
                "Egress lines waiting for --egress-stream to acknowledge them",
                None,
                gauge.metric_type(),
            )?)?;
            let gauge = ConstGauge::new(i64::from(stream.up));
            gauge.encode(encoder.encode_descriptor(
                "leasegate_egress_stream_up",
                "1 when the last publish to --egress-stream was acknowledged",
                None,
                gauge.metric_type(),
            )?)?;
        }
        Ok(())
    }
}
