//! What terminating TLS for selected hosts needs, apart from the request path: the
//! name-constrained interception CA (`ca`) and the leaves minted under it per SNI name
//! (`leaf`). The request path does not use it yet.
//!
//! Invariant: nothing here can produce a certificate a client would accept for a name outside
//! the CA's permitted DNS subtrees, or for any IP address.

pub mod broker;
pub mod ca;
pub mod inspect;
pub mod leaf;

pub use broker::{Broker, BrokerError, Placeholder};
pub use ca::{CaError, InterceptCa};
pub use leaf::{server_config, LeafMinter, LeafResolver};
