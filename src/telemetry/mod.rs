//! What leasegate records about traffic: the egress log (and its copy on the egress stream),
//! metrics, recent refusals, each lease's last requests and the rates of the last minutes.
//!
//! Invariant: one finished exchange is recorded once, by [`Telemetry::record`], into all of them
//! (a challenge is not a refusal: it stays out of the recent refusals);
//! every exchange still open is counted in [`Telemetry::exchanges`], so a shutdown can wait
//! for its line before closing the egress log.

pub mod egress;
mod egress_line;
pub mod egress_stream;
pub mod lease_requests;
pub mod metrics;
pub mod rates;
pub mod recent_refusals;

pub use egress::{EgressEvent, EgressLog};
pub use egress_stream::EgressStream;
pub use metrics::Metrics;

use egress::LoggedVerdict;
use std::sync::Arc;

/// The sinks of finished exchanges.
#[derive(Debug)]
pub struct Telemetry {
    pub egress: EgressLog,
    /// `--egress-stream`: the same lines, published to NATS for cluster-wide usage.
    pub stream: EgressStream,
    pub metrics: Arc<Metrics>,
    pub refusals: recent_refusals::RefusalRing,
    /// Each known lease's last exchanges (`GET /leases/{id}/requests`).
    pub lease_requests: lease_requests::LeaseRequests,
    /// Requests per second of the last minutes (`GET /rates`).
    pub rates: rates::Rates,
    /// What each lease has spent on metered model calls (and its subtree): what budgets are
    /// checked against.
    pub spending: Arc<crate::budget::Spending>,
    /// One token per live exchange (released after its line is queued): what a shutdown waits
    /// for before it closes the egress log.
    pub exchanges: tokio_util::task::TaskTracker,
}

impl Telemetry {
    /// `series_grace`: how long a closed lease's metric series stay; `series_max_leases`: how
    /// many leases `/metrics` shows by name (the rest are summed).
    pub fn new(
        egress: EgressLog,
        series_grace: std::time::Duration,
        series_max_leases: usize,
    ) -> Telemetry {
        Telemetry {
            egress,
            stream: EgressStream::disabled(),
            metrics: Arc::new(Metrics::new(series_grace, series_max_leases)),
            refusals: recent_refusals::RefusalRing::default(),
            lease_requests: lease_requests::LeaseRequests::default(),
            rates: rates::Rates::default(),
            spending: Arc::default(),
            exchanges: tokio_util::task::TaskTracker::new(),
        }
    }

    /// Also publishes every line to `stream`.
    pub fn with_stream(self, stream: EgressStream) -> Telemetry {
        Telemetry { stream, ..self }
    }

    /// Records one finished request or tunnel; `open`: the ticket it was counted open under.
    /// The event is shared by the sinks that keep it (no copy per sink).
    pub fn record(&self, event: EgressEvent, lease_known: bool, open: Option<metrics::OpenTicket>) {
        let event = Arc::new(event);
        self.metrics.record(&event, lease_known, open);
        let lease = event.lease_id.as_deref().filter(|_| lease_known);
        self.rates.record(lease);
        if lease.is_some() {
            self.lease_requests.push(&event);
        }
        if event.verdict == LoggedVerdict::Refuse {
            self.refusals.push(Arc::clone(&event));
        }
        self.stream.record(&event);
        self.egress.record(event);
    }
}
