//! The proxy on the request path: the decision pipeline, forwarding and tunnels over real sockets,
//! real clients, descriptor limits.

pub mod brokered;
pub mod brokered_paths;
pub mod brokered_streams;
pub mod budget_bounds;
pub mod budget_cuts;
pub mod budgets;
pub mod clients;
pub mod counting;
pub mod descriptors;
pub mod end_to_end;
pub mod hardening;
pub mod pipeline;
pub mod plain_tunnels;
pub mod route_approvals;
pub mod tunnels;
