//! Our side toward upstreams: the idle connections kept for forwarded requests, and name
//! resolution (a layer below, in [`crate::resolve`]) re-exported for the proxy's callers.

pub mod pool;

pub use crate::resolve::{ResolveError, Resolver, SystemDns};
pub use pool::{Pool, PoolKey};
