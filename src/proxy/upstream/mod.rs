//! Our side toward upstreams: the idle connections kept for forwarded requests (and the one a
//! terminated tunnel keeps for its next request), and name
//! resolution (a layer below, in [`crate::resolve`]) re-exported for the proxy's callers.

pub mod held;
pub mod pool;

pub use crate::resolve::{ResolveError, Resolver, SystemDns};
pub use held::Held;
pub use pool::{Pool, PoolKey};
