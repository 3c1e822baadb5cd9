//! Revocations: the one builder of the issuer's `revoked` record of a loaded lease (for the CLI
//! and the live registry), and what a revoking refusal writes about itself.
//!
//! Invariant: a record is built only for a lease the ledger holds and that is not already
//! revoked at `now`; it says `by: "issuer"` and is signed under the key that signed the lease.
//! A refusal's record names method, target and code in its `reason` and carries the same facts
//! in an `egress` object, and goes through [`crate::registry::Registry::revoke`], the one revoke path.

use super::ledger::{Closure, Ledger, Status};
use crate::contract::record::{self, Revocation};
use crate::contract::{Event, Key, Lease, RecordError, Timestamp};
use crate::policy::codes::Refusal;
use crate::policy::Target;
use serde_json::{json, Map, Value};
use std::net::SocketAddr;

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

/// A loaded lease and the key its records are signed with; `None` when it is retired (closed
/// long ago: nothing should be written).
fn closable<'a>(
    ledger: &'a Ledger,
    lease_id: &str,
) -> Result<Option<(&'a Lease, &'a Key)>, RevocationError> {
    if ledger.retired(lease_id).is_some() {
        return Ok(None);
    }
    let lease = ledger
        .lease(lease_id)
        .ok_or_else(|| RevocationError::Unknown(lease_id.to_owned()))?;
    let key = ledger
        .keyring()
        .and_then(|k| k.get(&lease.key_fingerprint))
        .ok_or_else(|| RevocationError::NoKey(lease_id.to_owned()))?;
    Ok(Some((lease, key)))
}

/// The signed `revoked` record of `lease_id` at `now`, or `None` if the lease is already
/// revoked then, or retired (closed long ago): nothing should be written.
pub fn issuer_revocation(
    ledger: &Ledger,
    lease_id: &str,
    reason: &str,
    extra: Map<String, Value>,
    now: Timestamp,
) -> Result<Option<IssuerRevocation>, RevocationError> {
    let Some((lease, key)) = closable(ledger, lease_id)? else {
        return Ok(None);
    };
    if ledger.status(lease_id, now) == Some(Status::Revoked) {
        return Ok(None);
    }
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

/// The signed `stopped` or `completed` record of `lease_id` at `now` (see
/// [`record::ended`]), or `None` when a closing record already applies to it (or it is
/// retired): a lease ends once.
pub fn issuer_ending(
    ledger: &Ledger,
    lease_id: &str,
    event: Event,
    reason: Option<&str>,
    usage: Option<record::Usage>,
    now: Timestamp,
) -> Result<Option<IssuerRevocation>, RevocationError> {
    let Some((lease, key)) = closable(ledger, lease_id)? else {
        return Ok(None);
    };
    if ledger.closure(lease_id).is_some() {
        return Ok(None);
    }
    let record = record::ended(
        event,
        lease_id,
        lease.parent.as_deref(),
        reason,
        usage,
        key,
        now,
    )?;
    let closure = Closure {
        event,
        at: now,
        by: None,
        reason: record["reason"].as_str().map(str::to_owned),
    };
    Ok(Some(IssuerRevocation { record, closure }))
}

/// The facts of one refused request, as its revocation records them.
pub struct RefusedEgress<'a> {
    pub method: &'a str,
    /// The normalised target, when the request got that far.
    pub target: Option<&'a Target>,
    /// The target as the refusal names it (the raw authority when it did not parse).
    pub shown_target: String,
    pub refusal: &'a Refusal,
    pub client: SocketAddr,
    pub listener: SocketAddr,
}

impl RefusedEgress<'_> {
    /// The revocation's `reason` and its `egress` object, for [`crate::registry::Registry::revoke`].
    pub fn reason_and_extra(&self) -> (String, Map<String, Value>) {
        let refusal = self.refusal;
        let mut extra = Map::new();
        extra.insert(
            "egress".into(),
            json!({
                "method": self.method,
                "host": self.target.map(|t| t.host.as_text()),
                "port": self.target.map(|t| t.port),
                "code": refusal.code.as_str(),
                "detail": refusal.detail,
                "client": self.client.to_string(),
                "listener": self.listener.to_string(),
            }),
        );
        let reason = format!(
            "leasegate refused {} {}: {} ({})",
            self.method, self.shown_target, refusal.code, refusal.detail
        );
        (reason, extra)
    }
}
