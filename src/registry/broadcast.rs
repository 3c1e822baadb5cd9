//! Closing records broadcast between replicas ahead of the journal: what a replica does with
//! one it hears (a core NATS message on `leasegate.revoke.<stream>.<lease_id>`, published by
//! the replica that wrote it before its append).
//!
//! Invariant: pure, and never more lenient than the fold: a broadcast closes a lease only if it
//! names a lease granted in the ledger (the subject's token and the record's `lease_id` both),
//! is a closing record the fold applies after that grant whatever its configuration
//! ([`signed_closing`]: schema-valid, a closing event, a `revoked` one by the issuer) and is
//! signed under that lease's own key — an unsigned one never applies here. It closes the lease
//! in memory only (no journal counter moves): the journal line that follows is the one event the
//! fold counts, and it closes nothing new. Anything else is dropped, and said why.

use super::closing::signed_closing;
use super::ledger::{Closure, Ledger};

/// The longest broadcast looked at: a closing record is a few hundred bytes.
pub const MAX_BROADCAST: usize = 64 << 10;

/// What a broadcast does here.
#[derive(Debug, Clone, PartialEq)]
pub enum Heard {
    /// Closes a lease that is not closed here yet.
    Closes(Closure),
    /// Valid, for a lease closed here already (by this very record folded or broadcast before, by
    /// our own refusal, or retired): nothing to do.
    AlreadyClosed,
    /// For a lease not granted here (yet): dropped; the journal line closes it once folded.
    UnknownLease,
    /// Not a closing record of that lease signed under its key: dropped.
    Invalid(&'static str),
}

/// Outcomes of broadcasts, as labelled in `leasegate_revoke_broadcasts_total`.
pub const OUTCOMES: [&str; 4] = ["applied", "already-closed", "unknown-lease", "invalid"];

impl Heard {
    /// Its index in [`OUTCOMES`].
    pub fn outcome(&self) -> usize {
        match self {
            Heard::Closes(_) => 0,
            Heard::AlreadyClosed => 1,
            Heard::UnknownLease => 2,
            Heard::Invalid(_) => 3,
        }
    }
}

/// What the broadcast `payload`, heard on the subject of `subject_lease`, does to `ledger`.
pub fn check(ledger: &Ledger, subject_lease: &str, payload: &[u8]) -> Heard {
    if payload.len() > MAX_BROADCAST {
        return Heard::Invalid("longer than any closing record");
    }
    let Some(lease) = ledger.lease(subject_lease) else {
        return match ledger.retired(subject_lease) {
            Some(_) => Heard::AlreadyClosed,
            None => Heard::UnknownLease,
        };
    };
    let Some(key) = ledger
        .keyring()
        .and_then(|keyring| keyring.get(&lease.key_fingerprint))
    else {
        return Heard::Invalid("no key for the lease in the keyring");
    };
    let Some(record) = signed_closing(&lease.id, key, payload) else {
        return Heard::Invalid(
            "not a closing record of the subject's lease signed under the lease's key",
        );
    };
    if ledger.closure(&lease.id).is_some() {
        return Heard::AlreadyClosed;
    }
    Heard::Closes(Closure {
        event: record.event,
        at: record.at,
        by: record.by,
        reason: record.reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commands::issue::{issue, IssueRequest};
    use crate::contract::record::{self, Revocation};
    use crate::contract::{Event, Key, Keyring, Timestamp};
    use crate::registry::journal;
    use serde_json::Map;
    use std::time::Duration;

    /// A ledger with two leases granted under `key`, and their ids.
    fn ledger(key: &Key) -> (Ledger, String, String) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        let grant = || {
            issue(
                &path,
                key,
                &IssueRequest {
                    manifest: serde_json::json!({}),
                    allow_hosts: vec!["origin.test".into()],
                    deny_hosts: vec![],
                    parent: None,
                    ttl: Duration::from_secs(600),
                    name: "test".into(),
                    purpose: "test".into(),
                    now: Timestamp::now(),
                },
            )
            .unwrap()
            .lease_id
        };
        let (a, b) = (grant(), grant());
        let mut keyring = Keyring::new(false);
        keyring.insert(key.clone());
        let (ledger, problems) = journal::load(&path, Ledger::new(keyring)).unwrap();
        assert!(problems.is_empty());
        (ledger, a, b)
    }

    fn revoked(lease: &str, key: &Key, by: &str) -> Vec<u8> {
        let value = record::revoked(
            &Revocation {
                lease_id: lease,
                parent_lease_id: None,
                by,
                reason: "refused",
                extra: Map::new(),
            },
            key,
            Timestamp::now(),
        )
        .unwrap();
        serde_json::to_vec(&value).unwrap()
    }

    #[test]
    fn a_signed_closing_of_the_subjects_lease_closes_it_once() {
        let key = Key::generate();
        let (mut ledger, lease, _) = ledger(&key);
        let line = revoked(&lease, &key, "issuer");
        let Heard::Closes(closure) = check(&ledger, &lease, &line) else {
            panic!("not applied");
        };
        assert_eq!(closure.event, Event::Revoked);
        let before = ledger.stats().clone();
        ledger.close(&lease, closure);
        assert_eq!(ledger.stats(), &before, "no journal counter moves");
        // Heard again (a replay, our own echo): nothing more.
        assert_eq!(check(&ledger, &lease, &line), Heard::AlreadyClosed);
        // The journal line that follows is the one event the fold counts.
        ledger.apply_line_bytes(&line).unwrap();
        assert_eq!(ledger.stats().events[Event::Revoked as usize], 1);
        assert_eq!(ledger.stats().lines, before.lines + 1);
    }

    #[test]
    fn forged_misfiled_and_unknown_broadcasts_close_nothing() {
        let key = Key::generate();
        let (ledger, lease, other) = ledger(&key);
        let invalid = |payload: &[u8], subject: &str| {
            assert!(
                matches!(check(&ledger, subject, payload), Heard::Invalid(_)),
                "{}",
                String::from_utf8_lossy(payload)
            );
        };
        // Another lease's valid record on this lease's subject (a replay aimed elsewhere).
        invalid(&revoked(&other, &key, "issuer"), &lease);
        // Signed under another key, by another lease rather than the issuer, tampered, unsigned.
        invalid(&revoked(&lease, &Key::generate(), "issuer"), &lease);
        invalid(&revoked(&lease, &key, &other), &lease);
        let mut value: serde_json::Value =
            serde_json::from_slice(&revoked(&lease, &key, "issuer")).unwrap();
        value["reason"] = "changed after signing".into();
        invalid(&serde_json::to_vec(&value).unwrap(), &lease);
        value.as_object_mut().unwrap().remove("signature");
        invalid(&serde_json::to_vec(&value).unwrap(), &lease);
        invalid(b"\xff", &lease);
        invalid(b"", &lease);
        invalid(&vec![b' '; MAX_BROADCAST + 1], &lease);
        // A lease not granted here.
        let unknown = "4f8b0d6e-2c3a-4b9f-8d7e-6c5b4a3f2e1d";
        assert_eq!(
            check(&ledger, unknown, &revoked(unknown, &key, "issuer")),
            Heard::UnknownLease
        );
        assert_eq!(
            ledger.status(&lease, Timestamp::now()),
            Some(crate::registry::Status::Open)
        );
    }
}
