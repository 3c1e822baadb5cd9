//! What leasegate records about traffic: the egress log, metrics and recent refusals.
//!
//! Invariant: one finished exchange is recorded once, by [`Telemetry::record`], into all three.

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
}

impl Telemetry {
    pub fn new(egress: EgressLog) -> Telemetry {
        Telemetry {
            egress,
            metrics: Arc::default(),
            refusals: refusals::RefusalRing::default(),
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
