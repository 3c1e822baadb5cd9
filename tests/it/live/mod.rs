//! Live leases: the proxy follows its journal, opens and closes leases and their ports by the
//! journal and the clock, and keeps revocations moving under load.

pub mod clock_step;
pub mod follow;
pub mod lease_ports;
pub mod starvation;
pub mod wall_clock;
