//! Which line already in a store stands for a closing record we are appending: the record
//! itself, or another closing of the same lease that every replica's fold applies whatever
//! its configuration (schema-valid, a closing event, its `lease_id` the lease's and the
//! subject's, signed under the lease's own key; a `revoked` one by the issuer).
//!
//! Invariant: pure, and never more lenient than the fold: a line [`ClosingCheck::accepts`]
//! closes the lease when folded after its grant, with or without `--require-record-signatures`
//! (`fuzz/checks/stream_record.rs` checks it against the fold). Anything else in the store —
//! a forged line, another lease's record, an unsigned one — is not taken as our record, so an
//! append is never counted as done on its account.

use crate::contract::lease::verify_signature;
use crate::contract::record::Record;
use crate::contract::{Event, Key, Keyring};
use serde_json::Value;

/// What an append of one closing record accepts as already done.
#[derive(Debug, Clone)]
pub struct ClosingCheck {
    lease_id: String,
    /// The lease's key (the one our record is signed with); `None`: only our exact bytes count.
    key: Option<Key>,
    /// Our record's line.
    ours: Vec<u8>,
}

impl ClosingCheck {
    /// The check for appending `record` (serialised as `line`), when it closes its lease: its
    /// key is the keyring's key that signed it (`key_fingerprint`, the lease's key). `None`
    /// for a record that closes nothing.
    pub fn of(record: &Value, line: &[u8], keyring: Option<&Keyring>) -> Option<ClosingCheck> {
        let event = record.get("event").and_then(Value::as_str)?;
        if !Event::parse(event).is_some_and(Event::is_closing) {
            return None;
        }
        let lease_id = record.get("lease_id").and_then(Value::as_str)?.to_owned();
        let key = record
            .get("key_fingerprint")
            .and_then(Value::as_str)
            .and_then(|fingerprint| keyring?.get(fingerprint))
            .cloned();
        Some(ClosingCheck {
            lease_id,
            key,
            ours: line.to_vec(),
        })
    }

    /// The check for a closing of `lease_id` under `key` (tests and fuzzing).
    pub fn new(lease_id: &str, key: Option<Key>, ours: &[u8]) -> ClosingCheck {
        ClosingCheck {
            lease_id: lease_id.to_owned(),
            key,
            ours: ours.to_vec(),
        }
    }

    pub fn lease_id(&self) -> &str {
        &self.lease_id
    }

    /// Our record's line.
    pub fn ours(&self) -> &[u8] {
        &self.ours
    }

    /// Whether `payload`, stored under the lease subject token `subject_lease`, stands for our
    /// record (see the module invariant).
    pub fn accepts(&self, subject_lease: &str, payload: &[u8]) -> bool {
        if subject_lease != self.lease_id {
            return false;
        }
        if payload == self.ours.as_slice() {
            return true;
        }
        self.key
            .as_ref()
            .is_some_and(|key| signed_closing(&self.lease_id, key, payload).is_some())
    }
}

/// `payload` as a closing record of `lease_id` that every fold applies after its grant: it
/// parses and validates, it is a closing event naming `lease_id`, a `revoked` one is by the
/// issuer, and its signature verifies under `key` (the lease's). `None` for anything else.
pub fn signed_closing(lease_id: &str, key: &Key, payload: &[u8]) -> Option<Record> {
    let text = std::str::from_utf8(payload).ok()?;
    let record = Record::parse(text).ok()?;
    let by_issuer = record.by.as_deref() == Some("issuer");
    (record.event.is_closing()
        && record.lease_id == lease_id
        && (record.event != Event::Revoked || by_issuer)
        && verify_signature(&record.value, key).unwrap_or(false))
    .then_some(record)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::record::{self, Revocation};
    use crate::contract::Timestamp;
    use serde_json::Map;

    const LEASE: &str = "3e7a9c5d-1b2f-4a8e-9c6d-5b4a3f2e1d0c";
    const OTHER: &str = "4f8b0d6e-2c3a-4b9f-8d7e-6c5b4a3f2e1d";

    fn revoked(lease: &str, key: &Key, reason: &str) -> Value {
        record::revoked(
            &Revocation {
                lease_id: lease,
                parent_lease_id: None,
                by: "issuer",
                reason,
                extra: Map::new(),
            },
            key,
            Timestamp::parse("2026-11-29T10:00:00.000Z").unwrap(),
        )
        .unwrap()
    }

    fn check(key: &Key) -> (ClosingCheck, Vec<u8>) {
        let mut keyring = Keyring::new(false);
        keyring.insert(key.clone());
        let ours = revoked(LEASE, key, "ours");
        let line = serde_json::to_vec(&ours).unwrap();
        (
            ClosingCheck::of(&ours, &line, Some(&keyring)).unwrap(),
            line,
        )
    }

    #[test]
    fn our_record_and_another_signed_closing_of_the_lease_stand() {
        let key = Key::generate();
        let (check, line) = check(&key);
        assert!(check.accepts(LEASE, &line));
        let theirs = serde_json::to_vec(&revoked(LEASE, &key, "another replica's")).unwrap();
        assert!(check.accepts(LEASE, &theirs));
    }

    #[test]
    fn forged_misfiled_and_unsigned_lines_do_not() {
        let key = Key::generate();
        let (check, line) = check(&key);
        // The same record on another lease's subject.
        assert!(!check.accepts(OTHER, &line));
        // Another lease's record on ours.
        let other = serde_json::to_vec(&revoked(OTHER, &key, "x")).unwrap();
        assert!(!check.accepts(LEASE, &other));
        // Signed under another key.
        let forged = serde_json::to_vec(&revoked(LEASE, &Key::generate(), "x")).unwrap();
        assert!(!check.accepts(LEASE, &forged));
        // A bad signature, no signature, not a closing, not a record.
        let mut value = revoked(LEASE, &key, "x");
        value["reason"] = "changed after signing".into();
        assert!(!check.accepts(LEASE, &serde_json::to_vec(&value).unwrap()));
        value.as_object_mut().unwrap().remove("signature");
        assert!(!check.accepts(LEASE, &serde_json::to_vec(&value).unwrap()));
        let planted = br#"{"event":"revoked","lease_id":"3e7a9c5d-1b2f-4a8e-9c6d-5b4a3f2e1d0c"}"#;
        assert!(!check.accepts(LEASE, planted));
        assert!(!check.accepts(LEASE, b"\xff"));
        assert!(!check.accepts(LEASE, b""));
    }

    #[test]
    fn without_the_key_only_our_bytes_stand() {
        let key = Key::generate();
        let ours = revoked(LEASE, &key, "ours");
        let line = serde_json::to_vec(&ours).unwrap();
        let check = ClosingCheck::of(&ours, &line, None).unwrap();
        assert!(check.accepts(LEASE, &line));
        let theirs = serde_json::to_vec(&revoked(LEASE, &key, "theirs")).unwrap();
        assert!(!check.accepts(LEASE, &theirs));
    }

    #[test]
    fn records_that_close_nothing_get_no_check() {
        let value = serde_json::json!({"event": "heartbeat", "lease_id": LEASE});
        assert!(ClosingCheck::of(&value, b"{}", None).is_none());
        assert!(ClosingCheck::of(&serde_json::json!({"n": 1}), b"{}", None).is_none());
    }
}
