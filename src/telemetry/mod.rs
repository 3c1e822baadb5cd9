//! What leasegate records about traffic: the egress log, metrics and recent refusals.
//!
//! Invariant: one finished exchange is recorded once, by [`Telemetry::record`], into all three;
//! every exchange still open is counted in [`Telemetry::exchanges`], so a shutdown can wait
//! for its line before closing the egress log.

pub mod egress;
pub mod metrics;
pub mod refusals;

pub use egress::{EgressEvent, EgressLog};
pub use metrics::Metrics;

use egress::LoggedVerdict;
use std::sync::Arc;

/// The sinks of finished exchanges.
#[derive(Debug)]
pub struct Telemetry {
    pub egress: EgressLog,
    pub metrics: Arc<Metrics>,
    pub refusals: refusals::RefusalRing,
    /// One token per live exchange (released after its line is queued): what a shutdown waits
    /// for before it closes the egress log.
    pub exchanges: tokio_util::task::TaskTracker,
}

impl Telemetry {
    /// `series_grace`: how long a closed lease's metric series stay.
    pub fn new(egress: EgressLog, series_grace: std::time::Duration) -> Telemetry {
        Telemetry {
            egress,
            metrics: Arc::new(Metrics::with_grace(series_grace)),
            refusals: refusals::RefusalRing::default(),
            exchanges: tokio_util::task::TaskTracker::new(),
        }
    }

    /// Records one finished request or tunnel.
    pub fn record(&self, event: EgressEvent, lease_known: bool) {
        self.metrics.record(&event, lease_known);
        if event.verdict == LoggedVerdict::Refuse {
            self.refusals.push(event.clone());
        }
        self.egress.record(event);
    }
}
