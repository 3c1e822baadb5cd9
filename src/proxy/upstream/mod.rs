//! Our side toward upstreams.

mod pool;
pub use pool::*;
