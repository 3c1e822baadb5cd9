//! What leasegate records about traffic: the egress log.

pub mod egress;

pub use egress::{EgressEvent, EgressLog};
