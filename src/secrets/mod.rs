//! Brokered credentials' foundations: the secrets file, the values it names, and the
//! placeholders that stand in for them under a lease. Nothing on the request path reads this
//! module yet; `serve --secrets` loads it at start so a bad file stops the start.
//!
//! Invariant: a secret's value and a canary are held only in zeroised memory and never leave
//! through `Debug`, `Display` or an error message; a loaded set is whole or not there at all.

pub mod config;
pub mod placeholder;
pub mod route;
pub mod store;

pub use config::{Placement, Problem, SecretSpec, SecretsFile, Source};
pub use store::{Hit, Secret, SecretSet, Secrets, SecretsError};
