//! A journal line checked as far as it can be without the folded state: parsed, valid against
//! the schema, a grant's lease loaded (its signature verified) and its host lists compiled, a
//! closing record's signature checked under every key of the keyring.
//!
//! Invariant: preparing reads only the line and the keyring, never the ledger, so lines can be
//! prepared on any thread and in any order; applying the prepared lines in journal order
//! ([`super::Ledger::apply_prepared`]) gives exactly the ledger a line-by-line fold gives,
//! because the line-by-line fold is that same prepare-then-apply.

use super::ledger::LineError;
use crate::contract::canonical::{canonical_bytes_without, CanonError};
use crate::contract::record::Record;
use crate::contract::{Event, Keyring, Lease, RecordError, Timestamp};
use crate::policy::HostPolicy;
use serde_json::Value;
use std::sync::Arc;

/// One journal line, prepared.
#[derive(Debug)]
pub struct Prepared {
    /// A `granted` line (counted in `rejected_grants` if it does not apply).
    pub(super) is_grant: bool,
    pub(super) step: Result<Step, LineError>,
}

/// What applying a prepared line does.
#[derive(Debug)]
pub(super) enum Step {
    /// A loaded lease and its compiled host lists.
    Grant(Lease, Arc<HostPolicy>),
    /// A closing record.
    Closing(ClosingFacts),
    /// A record that changes no status.
    Noted(Event),
}

/// What a closing record says, without the JSON it came from.
#[derive(Debug, Clone)]
pub(super) struct ClosingFacts {
    pub event: Event,
    pub at: Timestamp,
    pub lease_id: String,
    pub by: Option<String>,
    pub reason: Option<String>,
    pub signature: RecordSignature,
}

/// A closing record's signature, checked against the keyring before the record's lease (and so
/// its key) is known.
#[derive(Debug, Clone)]
pub(super) enum RecordSignature {
    /// The record has no `signature` member.
    Unsigned,
    /// The fingerprints of the keyring's keys it verifies under (none: it verifies under no key
    /// we hold).
    VerifiesUnder(Vec<Arc<str>>),
    /// Its canonical bytes could not be made.
    Unreadable(CanonError),
    /// A ledger without a keyring checks no signature.
    Unchecked,
}

impl Prepared {
    /// [`Prepared::line`], unless the line is longer than `max` bytes: then it is not read.
    pub fn line_at_most(keyring: Option<&Keyring>, line: &[u8], max: usize) -> Prepared {
        if line.len() > max {
            return Prepared {
                is_grant: false,
                step: Err(LineError::TooLong {
                    len: line.len() as u64,
                    max,
                }),
            };
        }
        Prepared::line(keyring, line)
    }

    /// Parses and checks one journal line (without its newline).
    pub fn line(keyring: Option<&Keyring>, line: &[u8]) -> Prepared {
        let value = std::str::from_utf8(line)
            .map_err(|_| LineError::NotUtf8)
            .and_then(|text| {
                serde_json::from_str::<Value>(text).map_err(|e| RecordError::from(e).into())
            });
        let is_grant = matches!(&value, Ok(v) if v["event"] == "granted");
        let step = value
            .and_then(|v| Record::from_value(v).map_err(LineError::from))
            .and_then(|record| Step::of(keyring, record));
        Prepared { is_grant, step }
    }
}

impl Step {
    fn of(keyring: Option<&Keyring>, mut record: Record) -> Result<Step, LineError> {
        Ok(match record.event {
            Event::Granted => {
                let value = record.value["lease"].take();
                let lease = match keyring {
                    Some(keyring) => Lease::load_from_record(value, keyring)?,
                    None => Lease::check(value)?,
                };
                let policy =
                    HostPolicy::compile_lease(&lease.id, &lease.allow_hosts, &lease.deny_hosts);
                Step::Grant(lease, Arc::new(policy))
            }
            event if event.is_closing() => Step::Closing(ClosingFacts {
                event,
                at: record.at,
                signature: RecordSignature::of(keyring, &record.value),
                lease_id: record.lease_id,
                by: record.by,
                reason: record.reason,
            }),
            event => Step::Noted(event),
        })
    }
}

impl RecordSignature {
    fn of(keyring: Option<&Keyring>, record: &Value) -> RecordSignature {
        let Some(keyring) = keyring else {
            return RecordSignature::Unchecked;
        };
        let signature = match record.get("signature") {
            None => return RecordSignature::Unsigned,
            Some(Value::String(signature)) => signature,
            // As `verify_signature`: a signature that is not a string verifies under nothing.
            Some(_) => return RecordSignature::VerifiesUnder(Vec::new()),
        };
        match canonical_bytes_without(record, "signature") {
            Ok(bytes) => RecordSignature::VerifiesUnder(
                keyring
                    .keys()
                    .filter(|key| key.verify(&bytes, signature))
                    .map(|key| key.shared_fingerprint())
                    .collect(),
            ),
            Err(error) => RecordSignature::Unreadable(error),
        }
    }

    /// Whether it verifies under the key `fingerprint`.
    pub fn verifies_under(&self, fingerprint: &str) -> Result<bool, RecordError> {
        match self {
            RecordSignature::VerifiesUnder(keys) => Ok(keys.iter().any(|k| &**k == fingerprint)),
            RecordSignature::Unreadable(error) => Err(RecordError::Canonical(error.clone())),
            RecordSignature::Unsigned | RecordSignature::Unchecked => Ok(false),
        }
    }
}
