//! Building the issuer's `revoked` record of a loaded lease: one builder for the CLI and the
//! live registry.
//!
//! Invariant: a record is built only for a lease the ledger holds and that is not already
//! revoked at `now`; it says `by: "issuer"` and is signed under the key that signed the lease.

use super::ledger::{Closure, Ledger, Status};
use crate::contract::record::{self, Revocation};
use crate::contract::{Event, RecordError, Timestamp};
use serde_json::{Map, Value};

#[derive(Debug, thiserror::Error)]
pub enum RevocationError {
    #[error("lease {0} is not loaded")]
    Unknown(String),
    #[error("no key in the keyring signs lease {0}'s records")]
    NoKey(String),
    #[error("building the revoked record: {0}")]
    Record(#[from] RecordError),
}

/// A signed `revoked` record and the closure it applies once folded.
#[derive(Debug, Clone)]
pub struct IssuerRevocation {
    pub record: Value,
    /// What the record closes: lets a caller close the lease before the record is read back.
    pub closure: Closure,
}

/// The signed `revoked` record of `lease_id` at `now`, or `None` if the lease is already
/// revoked then (nothing should be written).
pub fn issuer_revocation(
    ledger: &Ledger,
    lease_id: &str,
    reason: &str,
    extra: Map<String, Value>,
    now: Timestamp,
) -> Result<Option<IssuerRevocation>, RevocationError> {
    let lease = ledger
        .lease(lease_id)
        .ok_or_else(|| RevocationError::Unknown(lease_id.to_owned()))?;
    if ledger.status(lease_id, now) == Some(Status::Revoked) {
        return Ok(None);
    }
    let key = ledger
        .keyring()
        .and_then(|k| k.get(&lease.key_fingerprint))
        .ok_or_else(|| RevocationError::NoKey(lease_id.to_owned()))?;
    let record = record::revoked(
        &Revocation {
            lease_id,
            parent_lease_id: lease.parent.as_deref(),
            by: "issuer",
            reason,
            extra,
        },
        key,
        now,
    )?;
    let closure = Closure {
        event: Event::Revoked,
        at: now,
        by: Some("issuer".to_owned()),
        reason: record["reason"].as_str().map(str::to_owned),
    };
    Ok(Some(IssuerRevocation { record, closure }))
}
