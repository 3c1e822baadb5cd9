//! Per-lease metrics and latency histograms, exposed in the Prometheus text format.
//!
//! Invariant: a series exists only for a lease the registry knows (anything else is counted
//! under `lease_id="-"`, so unknown ids cannot grow the cardinality), and the series of a
//! lease that closed disappear [`GRACE`] after it closed — the set stays bounded by the open
//! leases. A scrape shows at most `max_leases` leases by name (the busiest by calls, chosen at
//! scrape time, not per request); the others are summed under `lease_id="other"`, so every
//! total is kept and `/metrics` stays small whatever the number of open leases.

use super::egress::{EgressEvent, Kind, LoggedVerdict};
use crate::budget::{Charge, Spent};
use crate::fast_hash::FastMap;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use serde::Serialize;
use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long the series of a closed lease stay visible, by default.
pub const GRACE: Duration = Duration::from_secs(300);
/// Leases shown by name on `/metrics`, by default (`--metrics-max-leases`).
pub const MAX_LEASES: usize = 1000;
/// Distinct hosts remembered per lease (further hosts are counted under "(other)").
const MAX_HOSTS: usize = 1000;
/// Distinct routes of terminated hosts remembered per lease (further ones under "(other)").
const MAX_ROUTES: usize = 200;

/// Bytes moved in one direction, shared with the tasks that move them: each chunk is one
/// relaxed add, read live by [`Metrics`] while the exchange is open.
pub type Counter = Arc<AtomicU64>;

/// An exchange still open, as its lease's figures count it: the call from its start, its
/// bytes as they move.
#[derive(Debug, Clone)]
pub struct OpenExchange {
    pub kind: Kind,
    /// The verdict it was cleared with (allow, or report).
    pub verdict: LoggedVerdict,
    pub code: &'static str,
    pub host: Option<String>,
    pub port: Option<u16>,
    pub started: crate::contract::Timestamp,
    pub up: Counter,
    pub down: Counter,
}

impl OpenExchange {
    /// Bytes moved so far (up, down).
    pub fn moved(&self) -> (u64, u64) {
        (
            self.up.load(Ordering::Relaxed),
            self.down.load(Ordering::Relaxed),
        )
    }
}

/// Which open exchange of which lease: what an exchange hands back when it ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenTicket(u64);

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
    pub requests: FastMap<(Kind, LoggedVerdict, &'static str), u64>,
    pub bytes_up: u64,
    pub bytes_down: u64,
    pub open_tunnels: u64,
    pub open_connections: u64,
    pub hosts: FastMap<String, HostCounters>,
    /// Requests inside terminated tunnels by route (`GET api.example.com/repos/a`, the query
    /// left out), once ended.
    pub routes: FastMap<String, HostCounters>,
    /// Model calls that ended on this replica, summed as budgets sum them.
    pub model: Spent,
    /// Exchanges still open, oldest first (by ticket): added to the figures above only by
    /// [`LeaseCounters::live`] and a render, so ending one moves it into them once.
    pub open: BTreeMap<u64, OpenExchange>,
    /// When the lease was first seen closed (series go after [`GRACE`]).
    closed_at: Option<Instant>,
}

/// The `n` entries of `counted` with the most requests, most first, ties by name.
fn most_requests(counted: &FastMap<String, HostCounters>, n: usize) -> Vec<(String, HostCounters)> {
    let mut most: Vec<(String, HostCounters)> = counted
        .iter()
        .map(|(k, c)| (k.clone(), c.clone()))
        .collect();
    most.sort_by(|a, b| b.1.requests.cmp(&a.1.requests).then(a.0.cmp(&b.0)));
    most.truncate(n);
    most
}

/// Counts `event` under `key` in `counted`, or under "(other)" once it holds `limit` keys.
fn count_in(
    counted: &mut FastMap<String, HostCounters>,
    limit: usize,
    key: &str,
    event: &EgressEvent,
) {
    let key = if counted.len() < limit || counted.contains_key(key) {
        key
    } else {
        "(other)"
    };
    // A key is built only for one not seen before, not per request.
    if !counted.contains_key(key) {
        counted.insert(key.to_owned(), HostCounters::default());
    }
    if let Some(h) = counted.get_mut(key) {
        h.requests += 1;
        h.bytes_up += event.bytes_up;
        h.bytes_down += event.bytes_down;
    }
}

impl LeaseCounters {
    /// The `n` hosts with the most requests.
    pub fn top_hosts(&self, n: usize) -> Vec<(String, HostCounters)> {
        most_requests(&self.hosts, n)
    }

    /// The `n` routes of terminated hosts with the most requests.
    pub fn top_routes(&self, n: usize) -> Vec<(String, HostCounters)> {
        most_requests(&self.routes, n)
    }

    pub fn total_requests(&self) -> u64 {
        self.requests.values().sum()
    }

    /// Challenges answered (407 asking for credentials), apart from refusals.
    pub fn challenges(&self) -> u64 {
        self.requests
            .iter()
            .filter(|((_, v, _), _)| *v == LoggedVerdict::Challenge)
            .map(|(_, n)| n)
            .sum()
    }

    /// A copy of these figures with the open exchanges added (and not copied): each counted
    /// as a call under the verdict it was cleared with, its bytes as moved so far (hosts
    /// included).
    pub fn live(&self) -> LeaseCounters {
        let mut live = LeaseCounters {
            requests: self.requests.clone(),
            bytes_up: self.bytes_up,
            bytes_down: self.bytes_down,
            open_tunnels: self.open_tunnels,
            open_connections: self.open_connections,
            hosts: self.hosts.clone(),
            routes: self.routes.clone(),
            model: self.model,
            open: BTreeMap::new(),
            closed_at: self.closed_at,
        };
        for open in self.open.values() {
            let (up, down) = open.moved();
            *live
                .requests
                .entry((open.kind, open.verdict, open.code))
                .or_default() += 1;
            live.bytes_up += up;
            live.bytes_down += down;
            if let Some(host) = &open.host {
                if !live.hosts.contains_key(host) {
                    live.hosts.insert(host.clone(), HostCounters::default());
                }
                if let Some(h) = live.hosts.get_mut(host) {
                    h.requests += 1;
                    h.bytes_up += up;
                    h.bytes_down += down;
                }
            }
        }
        live
    }
}

/// The label value for a request without a known lease.
pub const NO_LEASE: &str = "-";
/// The label value of the leases beyond `max_leases`, summed.
pub const OTHER_LEASES: &str = "other";

/// Every metric leasegate exposes.
#[derive(Debug)]
pub struct Metrics {
    leases: Mutex<FastMap<String, LeaseCounters>>,
    /// The next [`OpenTicket`]: increasing, so a lease's open exchanges sort oldest first.
    tickets: AtomicU64,
    /// How long the series of a closed lease stay after it closed.
    grace: Duration,
    /// Leases a scrape shows by name; the rest are summed under [`OTHER_LEASES`].
    max_leases: usize,
    /// Time from a request's arrival to its verdict (before any dial).
    pub decision: Histogram,
    /// Time to connect to an upstream.
    pub upstream_connect: Histogram,
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new(GRACE, MAX_LEASES)
    }
}

impl Metrics {
    pub fn new(grace: Duration, max_leases: usize) -> Metrics {
        Metrics {
            leases: Mutex::new(FastMap::default()),
            tickets: AtomicU64::new(0),
            grace,
            max_leases,
            decision: Histogram::new(exponential_buckets(0.000_01, 4.0, 10)),
            upstream_connect: Histogram::new(exponential_buckets(0.000_1, 4.0, 10)),
        }
    }
}

impl Metrics {
    fn with<R>(&self, lease: &str, f: impl FnOnce(&mut LeaseCounters) -> R) -> R {
        let mut leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        // No allocation for a lease already counted (every request but its lease's first).
        if let Some(counters) = leases.get_mut(lease) {
            return f(counters);
        }
        f(leases.entry(lease.to_owned()).or_default())
    }

    /// Counts an exchange as open from now (its call, and its bytes as they move) until
    /// [`Metrics::record`] is given the ticket. `lease`: the id of a lease the registry
    /// knows, or [`NO_LEASE`].
    pub fn open(&self, lease: &str, open: OpenExchange) -> OpenTicket {
        let ticket = self.tickets.fetch_add(1, Ordering::Relaxed);
        self.with(lease, |c| c.open.insert(ticket, open));
        OpenTicket(ticket)
    }

    /// The label a line's lease is counted under.
    pub fn lease_key(lease_id: Option<&str>, lease_known: bool) -> &str {
        match (lease_id, lease_known) {
            (Some(id), true) => id,
            _ => NO_LEASE,
        }
    }

    /// Counts one finished exchange. `lease_known` says whether its lease id is in the
    /// registry; `open`, the ticket it was counted open under, if it was (taken out in the
    /// same step, so its bytes are never counted twice nor missing from a read).
    pub fn record(&self, event: &EgressEvent, lease_known: bool, open: Option<OpenTicket>) {
        let lease = Metrics::lease_key(event.lease_id.as_deref(), lease_known);
        self.with(lease, |c| {
            if let Some(OpenTicket(ticket)) = open {
                c.open.remove(&ticket);
            }
            *c.requests
                .entry((event.kind, event.verdict, event.code.unwrap_or("")))
                .or_default() += 1;
            c.bytes_up += event.bytes_up;
            c.bytes_down += event.bytes_down;
            if let Some(host) = &event.host {
                count_in(&mut c.hosts, MAX_HOSTS, host, event);
            }
            if let (Kind::Https, Some(host), Some(path)) = (event.kind, &event.host, &event.path) {
                let route = super::egress::route(event.method.as_str(), host, path);
                count_in(&mut c.routes, MAX_ROUTES, &route, event);
            }
            if let Some(call) = &event.model {
                c.model.add(&Charge::of_call(call));
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

    /// A copy of one lease's counters, open exchanges added in (see [`LeaseCounters::live`];
    /// [`Metrics::open_of`] lists them).
    pub fn lease(&self, lease: &str) -> Option<LeaseCounters> {
        let leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        leases.get(lease).map(LeaseCounters::live)
    }

    /// The `limit` oldest open exchanges of one lease, and how many are open.
    pub fn open_of(&self, lease: &str, limit: usize) -> (Vec<OpenExchange>, usize) {
        let leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        leases.get(lease).map_or((Vec::new(), 0), |c| {
            (c.open.values().take(limit).cloned().collect(), c.open.len())
        })
    }

    /// Forgets leases closed for longer than the grace period; `is_open` says which are open.
    /// `is_open` (a walk up each chain) runs outside the lock: requests wait only for the ids
    /// to be copied and for the removal.
    pub fn prune(&self, is_open: impl Fn(&str) -> bool) {
        let ids: Vec<String> = {
            let leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
            leases
                .keys()
                .filter(|id| *id != NO_LEASE)
                .cloned()
                .collect()
        };
        let closed: HashSet<String> = ids.into_iter().filter(|id| !is_open(id)).collect();
        let mut leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        leases.retain(|id, c| {
            // Open, or counted since the ids were read: decided at the next prune.
            if !closed.contains(id) {
                c.closed_at = None;
                return true;
            }
            let since = *c.closed_at.get_or_insert_with(Instant::now);
            since.elapsed() < self.grace
                || c.open_tunnels > 0
                || c.open_connections > 0
                || !c.open.is_empty()
        });
    }
}

/// What one `lease_id` label value shows: one lease's counters, or several summed.
#[derive(Debug, Default)]
struct Series {
    requests: FastMap<(Kind, LoggedVerdict, &'static str), u64>,
    bytes_up: u64,
    bytes_down: u64,
    open_tunnels: u64,
    open_connections: u64,
    open_requests: u64,
    model: Spent,
}

impl Series {
    /// Adds `c`: its finished calls by verdict (a counter only ever moves up, so an open
    /// call enters `requests` when it ends, under its final verdict, and is an open request
    /// until then), its bytes with the open exchanges' bytes so far.
    fn add(&mut self, c: &LeaseCounters) {
        for (key, n) in &c.requests {
            *self.requests.entry(*key).or_default() += n;
        }
        self.bytes_up += c.bytes_up;
        self.bytes_down += c.bytes_down;
        for open in c.open.values() {
            let (up, down) = open.moved();
            self.bytes_up += up;
            self.bytes_down += down;
        }
        self.open_tunnels += c.open_tunnels;
        self.open_connections += c.open_connections;
        self.model.merge(&c.model);
        self.open_requests += c.open.len() as u64;
    }

    fn challenges(&self) -> u64 {
        self.requests
            .iter()
            .filter(|((_, v, _), _)| *v == LoggedVerdict::Challenge)
            .map(|(_, n)| n)
            .sum()
    }
}

impl Metrics {
    /// The series a scrape shows, sorted by label: [`NO_LEASE`], the `max_leases` busiest
    /// leases by calls (ties by id), and the rest summed under [`OTHER_LEASES`]. One pass
    /// under the lock, copying only what is shown.
    fn series(&self) -> Vec<(String, Series)> {
        let leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        let mut ranked: Vec<(&String, &LeaseCounters, u64)> = leases
            .iter()
            .filter(|(id, _)| id.as_str() != NO_LEASE)
            .map(|(id, c)| (id, c, c.total_requests() + c.open.len() as u64))
            .collect();
        let busiest_first = |a: &(&String, &LeaseCounters, u64),
                             b: &(&String, &LeaseCounters, u64)| {
            b.2.cmp(&a.2).then_with(|| a.0.cmp(b.0))
        };
        if ranked.len() > self.max_leases {
            ranked.select_nth_unstable_by(self.max_leases, busiest_first);
        }
        let shown = ranked.len().min(self.max_leases);
        let mut out: Vec<(String, Series)> = ranked[..shown]
            .iter()
            .map(|(id, c, _)| {
                let mut series = Series::default();
                series.add(c);
                ((*id).clone(), series)
            })
            .collect();
        if let Some(c) = leases.get(NO_LEASE) {
            let mut series = Series::default();
            series.add(c);
            out.push((NO_LEASE.to_owned(), series));
        }
        if shown < ranked.len() {
            let mut other = Series::default();
            for (_, c, _) in &ranked[shown..] {
                other.add(c);
            }
            out.push((OTHER_LEASES.to_owned(), other));
        }
        drop(leases);
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
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
    /// Closing records broadcast by other replicas, by outcome.
    pub revoke_broadcasts: Vec<(&'static str, u64)>,
    /// Revocation records waiting for the journal to take them.
    pub journal_pending_revocations: u64,
    /// The store's following: lag and reconnections.
    pub store_lag_seconds: f64,
    pub store_reconnects: u64,
    /// Times the journal store was found replaced (a stream deleted and created again).
    pub store_replaced: u64,
    /// Time since the journal follower last completed a read.
    pub journal_follow_lag_seconds: f64,
    /// Admin requests answered 503 at a limit, by limit (`connections`, `walks`).
    pub admin_busy: Vec<(&'static str, u64)>,
    /// `POST /leases` answers by outcome (`granted`, `replayed`, `refused`, `rejected`,
    /// `rate-limited`, `failed`).
    pub leases_issued: Vec<(&'static str, u64)>,
    /// Grants whose expiry `--max-lease-lifetime` brought forward.
    pub capped_grants: u64,
    /// The proxy's clock: how far the wall clock is behind it, and its steps back.
    pub clock: crate::registry::ClockHealth,
    pub egress_dropped: u64,
    /// `--egress-stream`'s publisher, when it is on.
    pub egress_stream: Option<super::egress_stream::StreamFigures>,
    /// Failed accepts by listener (`proxy`, `lease-port`, `admin`).
    pub accept_errors: Vec<(&'static str, u64)>,
    /// Connections refused because descriptors ran short.
    pub descriptor_refusals: u64,
    /// Descriptors the process holds (`None`: unknown) and may hold.
    pub open_fds: Option<u64>,
    pub max_fds: u64,
    /// Tool calls this replica holds for a human now, and the approval store's lines set aside
    /// (unreadable, or not verifying).
    pub approvals_waiting: u64,
    pub approval_lines_set_aside: u64,
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

impl Collector for Scrape {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let series = self.metrics.series();

        let mut family = encoder.encode_descriptor(
            "leasegate_requests",
            "Requests and tunnels by lease, kind, verdict and refusal code",
            None,
            MetricType::Counter,
        )?;
        for (id, c) in &series {
            let mut rows: Vec<_> = c.requests.iter().collect();
            rows.sort_by_key(|((k, v, c), _)| (k.as_str(), v.as_str(), *c));
            for ((kind, verdict, code), n) in rows {
                let labels = [
                    ("lease_id", id.as_str()),
                    ("kind", kind.as_str()),
                    ("verdict", verdict.as_str()),
                    ("code", code),
                ];
                ConstCounter::new(*n).encode(family.encode_family(&labels)?)?;
            }
        }

        let mut family = encoder.encode_descriptor(
            "leasegate_challenges",
            "407 answers asking for credentials not sent yet (lease-missing), by lease; not refusals",
            None,
            MetricType::Counter,
        )?;
        for (id, c) in &series {
            ConstCounter::new(c.challenges())
                .encode(family.encode_family(&[("lease_id", id.as_str())])?)?;
        }

        let mut family = encoder.encode_descriptor(
            "leasegate_bytes",
            "Bytes moved by lease and direction (up: client to upstream), open tunnels and streams included as their bytes move",
            None,
            MetricType::Counter,
        )?;
        for (id, c) in &series {
            for (direction, n) in [("up", c.bytes_up), ("down", c.bytes_down)] {
                ConstCounter::new(n).encode(
                    family.encode_family(&[("lease_id", id.as_str()), ("direction", direction)])?,
                )?;
            }
        }

        // Model families: series only for leases that made a model call.
        let callers: Vec<&(String, Series)> =
            series.iter().filter(|(_, c)| c.model.calls > 0).collect();
        type Split = fn(&Spent) -> Vec<(&'static str, u64)>;
        for (name, help, label, split) in [
            (
                "leasegate_model_calls",
                "Calls to metered model APIs by lease and whether their usage was read (unmetered: it could not be)",
                "usage",
                (|m: &Spent| vec![("metered", m.calls - m.unmetered), ("unmetered", m.unmetered)]) as Split,
            ),
            (
                "leasegate_model_tokens",
                "Tokens metered model calls reported, by lease and kind (cached: the cached part of input)",
                "kind",
                |m: &Spent| {
                    vec![
                        ("input", m.input_tokens),
                        ("output", m.output_tokens),
                        ("cached", m.cached_tokens),
                    ]
                },
            ),
        ] {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (id, c) in &callers {
                for (value, n) in split(&c.model) {
                    ConstCounter::new(n)
                        .encode(family.encode_family(&[("lease_id", id.as_str()), (label, value)])?)?;
                }
            }
        }
        let mut family = encoder.encode_descriptor(
            "leasegate_model_cost_usd",
            "What the priced model calls cost, by lease (calls of models not in --prices add nothing)",
            None,
            MetricType::Counter,
        )?;
        for (id, c) in &callers {
            ConstCounter::new(c.model.cost_usd)
                .encode(family.encode_family(&[("lease_id", id.as_str())])?)?;
        }

        for (name, help, pick) in [
            (
                "leasegate_open_tunnels",
                "Open CONNECT tunnels and upgraded connections by lease",
                (|c: &Series| c.open_tunnels) as fn(&Series) -> u64,
            ),
            (
                "leasegate_open_connections",
                "Open client connections by lease",
                |c: &Series| c.open_connections,
            ),
            (
                "leasegate_open_requests",
                "Calls started and not yet ended (tunnels, streams, requests awaiting an answer) by lease; leasegate_requests_total counts each when it ends",
                |c: &Series| c.open_requests,
            ),
        ] {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (id, c) in &series {
                ConstGauge::new(pick(c) as i64)
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
        let mut family = encoder.encode_descriptor(
            "leasegate_revoke_broadcasts",
            "Closing records other replicas broadcast ahead of the journal, by what they did here",
            None,
            MetricType::Counter,
        )?;
        for (outcome, n) in &self.figures.revoke_broadcasts {
            ConstCounter::new(*n).encode(family.encode_family(&[("outcome", *outcome)])?)?;
        }
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
        let counter = ConstCounter::new(self.figures.store_replaced);
        counter.encode(encoder.encode_descriptor(
            "leasegate_store_replaced",
            "Times the journal store was found replaced (a stream deleted and created again) and folded afresh",
            None,
            counter.metric_type(),
        )?)?;
        let gauge = ConstGauge::new(self.figures.journal_follow_lag_seconds);
        gauge.encode(encoder.encode_descriptor(
            "leasegate_journal_follow_lag_seconds",
            "Time since the journal follower last completed a read of the journal",
            None,
            gauge.metric_type(),
        )?)?;
        let mut family = encoder.encode_descriptor(
            "leasegate_admin_busy",
            "Admin API requests answered 503 at a limit: connections held, or lease-walking requests running",
            None,
            MetricType::Counter,
        )?;
        for (limit, n) in &self.figures.admin_busy {
            ConstCounter::new(*n).encode(family.encode_family(&[("limit", *limit)])?)?;
        }
        let mut family = encoder.encode_descriptor(
            "leasegate_leases_issued",
            "POST /leases answers by outcome: granted, replayed (an idempotency key's lease again), refused (by the issuer's rules, recorded), rejected (a request it could not read, or a caller it does not serve), rate-limited, failed (the journal did not take the grant)",
            None,
            MetricType::Counter,
        )?;
        for (outcome, n) in &self.figures.leases_issued {
            ConstCounter::new(*n).encode(family.encode_family(&[("outcome", *outcome)])?)?;
        }
        let gauge = ConstGauge::new(self.figures.journal_pending_revocations as i64);
        gauge.encode(encoder.encode_descriptor(
            "leasegate_store_pending_appends",
            "Records waiting for the journal store to take them (the same queue as leasegate_journal_pending_revocations)",
            None,
            gauge.metric_type(),
        )?)?;
        let counter = ConstCounter::new(self.figures.capped_grants);
        counter.encode(encoder.encode_descriptor(
            "leasegate_journal_capped_grants",
            "Grants whose lifetime was longer than --max-lease-lifetime (they expire at issued_at plus the ceiling)",
            None,
            counter.metric_type(),
        )?)?;
        let gauge = ConstGauge::new(self.figures.clock.behind.as_secs_f64());
        gauge.encode(encoder.encode_descriptor(
            "leasegate_clock_behind_seconds",
            "How far the wall clock is behind the latest time lifetime checks used (a step back; 0 without one)",
            None,
            gauge.metric_type(),
        )?)?;
        let counter = ConstCounter::new(self.figures.clock.steps_back);
        counter.encode(encoder.encode_descriptor(
            "leasegate_clock_steps_back",
            "Times the wall clock stepped back behind the latest time used",
            None,
            counter.metric_type(),
        )?)?;
        let counter = ConstCounter::new(self.figures.egress_dropped);
        counter.encode(encoder.encode_descriptor(
            "leasegate_egress_log_dropped",
            "Egress log lines dropped because the writer was behind",
            None,
            counter.metric_type(),
        )?)?;
        let mut family = encoder.encode_descriptor(
            "leasegate_accept_errors",
            "Accepts that failed, by listener (out of file descriptors, mostly)",
            None,
            MetricType::Counter,
        )?;
        for (listener, n) in &self.figures.accept_errors {
            ConstCounter::new(*n).encode(family.encode_family(&[("listener", *listener)])?)?;
        }
        let gauge =
            ConstGauge::new(i64::try_from(self.figures.approvals_waiting).unwrap_or(i64::MAX));
        gauge.encode(encoder.encode_descriptor(
            "leasegate_approvals_waiting",
            "Tool calls this replica holds for a human's approval now",
            None,
            gauge.metric_type(),
        )?)?;
        let counter = ConstCounter::new(self.figures.approval_lines_set_aside);
        counter.encode(encoder.encode_descriptor(
            "leasegate_approval_lines_set_aside",
            "Lines of the approval store set aside: unreadable, or not verifying under their lease's key",
            None,
            counter.metric_type(),
        )?)?;
        let counter = ConstCounter::new(self.figures.descriptor_refusals);
        counter.encode(encoder.encode_descriptor(
            "leasegate_descriptor_refusals",
            "Connections refused (429) because file descriptors nearly ran out",
            None,
            counter.metric_type(),
        )?)?;
        if let Some(open) = self.figures.open_fds {
            let gauge = ConstGauge::new(i64::try_from(open).unwrap_or(i64::MAX));
            gauge.encode(encoder.encode_descriptor(
                "process_open_fds",
                "Open file descriptors",
                None,
                gauge.metric_type(),
            )?)?;
        }
        let gauge = ConstGauge::new(i64::try_from(self.figures.max_fds).unwrap_or(i64::MAX));
        gauge.encode(encoder.encode_descriptor(
            "process_max_fds",
            "The file descriptor limit (soft)",
            None,
            gauge.metric_type(),
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
            let counter = ConstCounter::new(stream.duplicates);
            counter.encode(encoder.encode_descriptor(
                "leasegate_egress_stream_duplicates",
                "Egress lines NATS called duplicates on their first send: a message not this replica's held their id",
                None,
                counter.metric_type(),
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

#[cfg(test)]
mod tests {
    use super::{render, Metrics, RegistryFigures, GRACE, NO_LEASE, OTHER_LEASES};
    use crate::contract::Timestamp;
    use crate::telemetry::egress::{EgressEvent, Kind, LoggedVerdict};
    use std::sync::Arc;

    fn event(lease: &str, verdict: LoggedVerdict, code: Option<&'static str>) -> EgressEvent {
        EgressEvent {
            time: Timestamp::now(),
            ended: Timestamp::now(),
            lease_id: Some(lease.to_owned()),
            label: None,
            client: "127.0.0.1:1".parse().unwrap(),
            listener: "127.0.0.1:2".parse().unwrap(),
            kind: Kind::Connect,
            method: http::Method::CONNECT,
            host: Some("api.example.com".into()),
            port: Some(443),
            dialed: None,
            verdict,
            code,
            rule: None,
            status: Some(200),
            bytes_up: 10,
            bytes_down: 100,
            duration_ms: 1.0,
            path: None,
            secrets: Vec::new(),
            model: None,
            mcp: None,
            approval: None,
            error: None,
            revoked: None,
        }
    }

    fn lease_id(n: u64) -> String {
        format!("00000000-0000-4000-8000-{n:012x}")
    }

    /// Every sample of `family` as (lease_id label, value).
    fn samples<'a>(text: &'a str, family: &str) -> Vec<(&'a str, u64)> {
        text.lines()
            .filter(|l| l.starts_with(&format!("{family}{{")))
            .map(|l| {
                let lease = l
                    .split("lease_id=\"")
                    .nth(1)
                    .unwrap()
                    .split('"')
                    .next()
                    .unwrap();
                (lease, l.rsplit(' ').next().unwrap().parse().unwrap())
            })
            .collect()
    }

    #[test]
    fn a_hundred_thousand_open_leases_scrape_under_a_megabyte_with_every_total_kept() {
        const LEASES: u64 = 100_000;
        let metrics = Arc::new(Metrics::new(GRACE, 1000));
        let mut calls = 0;
        for n in 0..LEASES {
            let id = lease_id(n);
            // Lease n makes 1 + n % 7 calls; every tenth is also refused once.
            for _ in 0..1 + n % 7 {
                metrics.record(&event(&id, LoggedVerdict::Allow, None), true, None);
                calls += 1;
            }
            if n % 10 == 0 {
                metrics.record(
                    &event(&id, LoggedVerdict::Refuse, Some("host-not-allowed")),
                    true,
                    None,
                );
                calls += 1;
            }
            metrics.tunnel_opened(&id);
        }
        metrics.record(
            &event("unknown", LoggedVerdict::Refuse, Some("lease-unknown")),
            false,
            None,
        );
        calls += 1;

        let text = render(&metrics, RegistryFigures::default());
        eprintln!("/metrics at {LEASES} open leases: {} bytes", text.len());
        assert!(text.len() < 1 << 20, "/metrics is {} bytes", text.len());

        let requests = samples(&text, "leasegate_requests_total");
        let named: std::collections::BTreeSet<&str> = requests.iter().map(|(l, _)| *l).collect();
        // 1000 leases by name, plus "-" and "other".
        assert_eq!(named.len(), 1002, "{}", named.len());
        assert!(named.contains(NO_LEASE) && named.contains(OTHER_LEASES));
        // The busiest are shown: 8 calls (n % 70 == 20; 1429 of them, the lowest ids win the
        // tie), not 7 (n % 7 == 6).
        assert!(named.contains(lease_id(20).as_str()));
        assert!(named.contains(lease_id(20 + 70 * 999).as_str()));
        assert!(!named.contains(lease_id(20 + 70 * 1000).as_str()));
        assert!(!named.contains(lease_id(6).as_str()));
        assert_eq!(requests.iter().map(|(_, n)| n).sum::<u64>(), calls);
        let bytes = samples(&text, "leasegate_bytes_total");
        assert_eq!(
            bytes.iter().map(|(_, n)| n).sum::<u64>(),
            110 * calls,
            "every call moved 10 bytes up and 100 down"
        );
        let tunnels = samples(&text, "leasegate_open_tunnels");
        assert_eq!(tunnels.iter().map(|(_, n)| n).sum::<u64>(), LEASES);
    }

    #[test]
    fn a_prune_forgets_closed_leases_past_their_grace_and_keeps_the_rest() {
        let metrics = Metrics::new(std::time::Duration::ZERO, 10);
        for n in 0..4 {
            metrics.record(&event(&lease_id(n), LoggedVerdict::Allow, None), true, None);
        }
        metrics.record(
            &event("x", LoggedVerdict::Refuse, Some("lease-unknown")),
            false,
            None,
        );
        // Lease 3 closed, but a tunnel of it is still open.
        metrics.tunnel_opened(&lease_id(3));
        let open = [lease_id(0), lease_id(1)];
        metrics.prune(|id| open.iter().any(|o| o == id));
        for (id, kept) in [
            (lease_id(0), true),
            (lease_id(1), true),
            (lease_id(2), false),
            (lease_id(3), true),
            (NO_LEASE.to_owned(), true),
        ] {
            assert_eq!(metrics.lease(&id).is_some(), kept, "{id}");
        }
    }

    #[test]
    fn an_open_exchange_counts_as_it_moves_and_once_when_it_ends() {
        let metrics = Arc::new(Metrics::new(GRACE, 10));
        let id = lease_id(1);
        let open = super::OpenExchange {
            kind: Kind::Connect,
            verdict: LoggedVerdict::Allow,
            code: "",
            host: Some("api.example.com".into()),
            port: Some(443),
            started: Timestamp::now(),
            up: super::Counter::default(),
            down: super::Counter::default(),
        };
        let (up, down) = (open.up.clone(), open.down.clone());
        let ticket = metrics.open(&id, open);
        up.fetch_add(10, std::sync::atomic::Ordering::Relaxed);
        down.fetch_add(60, std::sync::atomic::Ordering::Relaxed);
        let live = metrics.lease(&id).unwrap();
        assert_eq!(
            (live.total_requests(), live.bytes_up, live.bytes_down),
            (1, 10, 60)
        );
        assert_eq!(live.hosts["api.example.com"].bytes_down, 60);
        let text = render(&metrics, RegistryFigures::default());
        assert_eq!(
            samples(&text, "leasegate_open_requests"),
            [(id.as_str(), 1)]
        );
        assert!(samples(&text, "leasegate_requests_total").is_empty());

        // Its line carries the totals (10 up, 100 down: 40 more since the read).
        down.fetch_add(40, std::sync::atomic::Ordering::Relaxed);
        metrics.record(&event(&id, LoggedVerdict::Allow, None), true, Some(ticket));
        let ended = metrics.lease(&id).unwrap();
        assert_eq!(
            (ended.total_requests(), ended.bytes_up, ended.bytes_down),
            (1, 10, 100)
        );
        assert!(ended.open.is_empty() && metrics.open_of(&id, 50).1 == 0);
        let text = render(&metrics, RegistryFigures::default());
        assert_eq!(
            samples(&text, "leasegate_open_requests"),
            [(id.as_str(), 0)]
        );
        assert_eq!(
            samples(&text, "leasegate_requests_total"),
            [(id.as_str(), 1)]
        );
    }

    #[test]
    fn leases_within_the_limit_are_all_shown_by_name() {
        let metrics = Arc::new(Metrics::new(GRACE, 3));
        for n in 0..3 {
            metrics.record(&event(&lease_id(n), LoggedVerdict::Allow, None), true, None);
        }
        let text = render(&metrics, RegistryFigures::default());
        let requests = samples(&text, "leasegate_requests_total");
        assert_eq!(requests.len(), 3, "{text}");
        assert!(
            !text.contains(&format!("lease_id=\"{OTHER_LEASES}\"")),
            "{text}"
        );
    }
}
