//! Our side toward upstreams: resolving a target's name, and the idle connections kept for
//! forwarded requests.

pub mod pool;
pub mod resolve;

pub use pool::{Pool, PoolKey};
pub use resolve::Resolver;
