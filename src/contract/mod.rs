//! The lease contract: canonical bytes, keys, leases, records, schemas and rules.
//!
//! Invariant: pure. Nothing here reads a clock, a file or the network; `now` and data come in
//! as arguments, so the conformance vectors test it directly.

pub mod canonical;
pub mod keys;
pub mod lease;
pub mod narrow;
pub mod record;
pub mod rules;
pub mod schema;
pub mod timestamp;
pub mod token;

pub use keys::{Key, Keyring};
pub use lease::{Lease, LeaseError};
pub use record::{Event, Record, RecordError};
pub use timestamp::Timestamp;
