//! Replicas sharing a journal through NATS JetStream: scale-out, failover, quorum loss, catch-up,
//! bridges, usage, purge.

pub mod approvals;
pub mod bridges;
pub mod catch_up;
pub mod egress_forgery;
pub mod failover;
pub mod issuing;
pub mod missing_stream;
pub mod purge;
pub mod quorum_loss;
pub mod scale_out;
pub mod usage;
