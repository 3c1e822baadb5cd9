//! Brokered credentials' foundations: the secrets file, the values it names, the placeholders
//! that stand in for them under a lease, the route rules, and what the proxy's outputs show of
//! a request that may hold any of them.
//!
//! Invariant: a secret's value and a canary are held only in zeroised memory and never leave
//! through `Debug`, `Display` or an error message; a loaded set is whole or not there at all.

pub mod config;
pub mod placeholder;
pub mod redact;
pub mod route;
pub mod store;

pub use config::{Placement, Problem, SecretSpec, SecretsFile, Source};
pub use store::{Hit, Secret, SecretSet, Secrets, SecretsError};
