//! Lease records: one journal line each. Parsing what others wrote, building what we write.
//!
//! Invariant: a [`Record`] exists only for a line that is JSON, of a known major version and
//! valid against the lease-record schema; every record we build validates before it is
//! returned, so nothing we append can be a line another reader skips.

use super::canonical::{canonical_bytes, CanonError};
use super::keys::{sha256_hex, Key};
use super::lease::{check_major, sign};
use super::schema::{Schema, SchemaIssue, WRITTEN_VERSION};
use super::Timestamp;
use serde_json::{json, Map, Value};

/// The nine lease-record events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Event {
    Granted,
    Refused,
    Narrowed,
    Heartbeat,
    Attached,
    Revoked,
    Stopped,
    Completed,
    Expired,
}

impl Event {
    pub const ALL: [Event; 9] = [
        Event::Granted,
        Event::Refused,
        Event::Narrowed,
        Event::Heartbeat,
        Event::Attached,
        Event::Revoked,
        Event::Stopped,
        Event::Completed,
        Event::Expired,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Event::Granted => "granted",
            Event::Refused => "refused",
            Event::Narrowed => "narrowed",
            Event::Heartbeat => "heartbeat",
            Event::Attached => "attached",
            Event::Revoked => "revoked",
            Event::Stopped => "stopped",
            Event::Completed => "completed",
            Event::Expired => "expired",
        }
    }

    pub fn parse(text: &str) -> Option<Event> {
        Event::ALL.into_iter().find(|e| e.as_str() == text)
    }

    /// Whether a record of this event closes its lease (when it is read, whatever its `at`).
    pub fn is_closing(self) -> bool {
        matches!(
            self,
            Event::Revoked | Event::Stopped | Event::Completed | Event::Expired
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("not JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("schema_version major {0} is not one this reader knows (1)")]
    UnknownMajor(u64),
    #[error("schema: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Schema(Vec<SchemaIssue>),
    #[error("granted record's lease_id {record} differs from its lease's {lease}")]
    LeaseIdMismatch { record: String, lease: String },
    #[error(transparent)]
    Canonical(#[from] CanonError),
}

/// A schema-valid lease record.
#[derive(Debug, Clone)]
pub struct Record {
    pub event: Event,
    pub at: Timestamp,
    pub lease_id: String,
    pub parent_lease_id: Option<String>,
    pub by: Option<String>,
    pub reason: Option<String>,
    /// The record as parsed (the lease of a `granted` is `value["lease"]`).
    pub value: Value,
}

impl Record {
    /// Parses one journal line (without its newline).
    pub fn parse(line: &str) -> Result<Record, RecordError> {
        Record::from_value(serde_json::from_str(line)?)
    }

    pub fn from_value(value: Value) -> Result<Record, RecordError> {
        check_major(&value).map_err(RecordError::UnknownMajor)?;
        Schema::Record
            .validate(&value)
            .map_err(RecordError::Schema)?;
        let text = |k: &str| value.get(k).and_then(Value::as_str).map(str::to_owned);
        let record = Record {
            // The schema has vouched for event, at and lease_id.
            event: text("event")
                .as_deref()
                .and_then(Event::parse)
                .unwrap_or(Event::Heartbeat),
            at: Timestamp::parse(&text("at").unwrap_or_default())
                .unwrap_or(Timestamp::from_millis(0)),
            lease_id: text("lease_id").unwrap_or_default(),
            parent_lease_id: text("parent_lease_id"),
            by: text("by"),
            reason: text("reason"),
            value,
        };
        if record.event == Event::Granted {
            let lease_id = record.value["lease"]["lease_id"]
                .as_str()
                .unwrap_or_default();
            if lease_id != record.lease_id {
                return Err(RecordError::LeaseIdMismatch {
                    record: record.lease_id.clone(),
                    lease: lease_id.to_owned(),
                });
            }
        }
        Ok(record)
    }
}

/// Builds a `granted` record for a signed lease and the manifest it was declared from.
/// `granted_hash` is the SHA-256 of the granted manifest's canonical bytes.
pub fn granted(lease: &Value, declared: &Value, at: Timestamp) -> Result<Value, RecordError> {
    let granted_hash = sha256_hex(&canonical_bytes(&lease["manifest"])?);
    let mut record = json!({
        "schema_version": WRITTEN_VERSION,
        "at": at.to_string(),
        "event": "granted",
        "lease_id": lease["lease_id"],
        "lease": lease,
        "declared": declared,
        "declared_hash": lease["declared_hash"],
        "granted_hash": granted_hash,
    });
    if let Some(parent) = lease.get("parent_lease_id") {
        record["parent_lease_id"] = parent.clone();
    }
    validated(record)
}

/// What a `revoked` record says.
#[derive(Debug, Clone)]
pub struct Revocation<'a> {
    pub lease_id: &'a str,
    pub parent_lease_id: Option<&'a str>,
    /// `"issuer"` or an ancestor's lease id (rule L3).
    pub by: &'a str,
    /// Cut to the schema's 500 characters.
    pub reason: &'a str,
    /// Extra members (e.g. `egress`), carried as-is.
    pub extra: Map<String, Value>,
}

/// The largest record leasegate writes, and the largest grant it promises to carry end to end:
/// a NATS message with the server's default `max_payload` (1 MiB) less room for headers. A
/// file journal's fold takes longer lines (up to `--max-journal-line`) from issuers of its own;
/// a bridge reports a line the stream's server cannot take as one it can never publish.
pub const MAX_RECORD_BYTES: usize = 1024 * 1024 - 256;

/// The schema's limit on `reason`, in characters.
pub const REASON_MAX_CHARS: usize = 500;

/// Builds a signed `revoked` record: `signature` is the HMAC of the record's canonical bytes
/// without `signature`, under `key` (the lease's own key).
pub fn revoked(
    revocation: &Revocation<'_>,
    key: &Key,
    at: Timestamp,
) -> Result<Value, RecordError> {
    let reason: String = revocation.reason.chars().take(REASON_MAX_CHARS).collect();
    let mut record = json!({
        "schema_version": WRITTEN_VERSION,
        "at": at.to_string(),
        "event": "revoked",
        "lease_id": revocation.lease_id,
        "by": revocation.by,
        "reason": reason,
    });
    if let Some(parent) = revocation.parent_lease_id {
        record["parent_lease_id"] = parent.into();
    }
    if let Some(object) = record.as_object_mut() {
        for (k, v) in &revocation.extra {
            object.entry(k.clone()).or_insert_with(|| v.clone());
        }
    }
    sign(&mut record, key)?;
    validated(record)
}

/// Builds a `narrowed` record: what the issuer changed between the declared manifest and the
/// grant, `summary` cut to the schema's 500 characters.
pub fn narrowed(
    lease_id: &str,
    parent_lease_id: Option<&str>,
    summary: &str,
    at: Timestamp,
) -> Result<Value, RecordError> {
    let mut record = json!({
        "schema_version": WRITTEN_VERSION,
        "at": at.to_string(),
        "event": "narrowed",
        "lease_id": lease_id,
        "reason": summary.chars().take(REASON_MAX_CHARS).collect::<String>(),
    });
    with_parent(&mut record, parent_lease_id);
    validated(record)
}

/// What a `refused` record says: a fresh id naming the refusal, the reserved codes, their
/// reading and the declared manifest's hash.
#[derive(Debug, Clone)]
pub struct Refusal<'a> {
    pub refusal_id: &'a str,
    pub parent_lease_id: Option<&'a str>,
    pub reasons: &'a [String],
    pub reason: &'a str,
    pub declared_hash: &'a str,
}

/// Builds a `refused` record.
pub fn refused(refusal: &Refusal<'_>, at: Timestamp) -> Result<Value, RecordError> {
    let mut record = json!({
        "schema_version": WRITTEN_VERSION,
        "at": at.to_string(),
        "event": "refused",
        "lease_id": refusal.refusal_id,
        "reasons": refusal.reasons,
        "reason": refusal.reason.chars().take(REASON_MAX_CHARS).collect::<String>(),
        "declared_hash": refusal.declared_hash,
    });
    with_parent(&mut record, refusal.parent_lease_id);
    validated(record)
}

/// What a lease consumed, as a `completed` record's `usage` says it: an absent field is
/// unmeasured, not zero.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Usage {
    pub tokens: Option<u64>,
    pub cost_usd: Option<f64>,
}

/// Builds a signed `stopped` (with `reason`) or `completed` (with `usage`, and a `reason` when
/// given) record under `key`, the lease's own.
pub fn ended(
    event: Event,
    lease_id: &str,
    parent_lease_id: Option<&str>,
    reason: Option<&str>,
    usage: Option<Usage>,
    key: &Key,
    at: Timestamp,
) -> Result<Value, RecordError> {
    let mut record = json!({
        "schema_version": WRITTEN_VERSION,
        "at": at.to_string(),
        "event": event.as_str(),
        "lease_id": lease_id,
    });
    with_parent(&mut record, parent_lease_id);
    if let Some(reason) = reason {
        record["reason"] = reason
            .chars()
            .take(REASON_MAX_CHARS)
            .collect::<String>()
            .into();
    }
    // A completed record says what was measured: nothing measured is an empty `usage`.
    let usage = match event {
        Event::Completed => Some(usage.unwrap_or_default()),
        _ => usage,
    };
    if let Some(usage) = usage {
        let mut measured = Map::new();
        if let Some(tokens) = usage.tokens {
            measured.insert("tokens".into(), tokens.into());
        }
        if let Some(cost) = usage.cost_usd.filter(|c| c.is_finite() && *c >= 0.0) {
            measured.insert("cost_usd".into(), json!(cost));
        }
        record["usage"] = Value::Object(measured);
    }
    sign(&mut record, key)?;
    validated(record)
}

fn with_parent(record: &mut Value, parent_lease_id: Option<&str>) {
    if let Some(parent) = parent_lease_id {
        record["parent_lease_id"] = parent.into();
    }
}

fn validated(record: Value) -> Result<Value, RecordError> {
    Schema::Record
        .validate(&record)
        .map_err(RecordError::Schema)?;
    Ok(record)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::lease::verify_signature;

    #[test]
    fn revoked_records_are_signed_valid_and_bounded() {
        let key = Key::generate();
        let long = "x".repeat(900);
        let mut extra = Map::new();
        extra.insert(
            "egress".into(),
            json!({"method": "CONNECT", "code": "host-denied"}),
        );
        let value = revoked(
            &Revocation {
                lease_id: "3e7a9c5d-1b2f-4a8e-9c6d-5b4a3f2e1d0c",
                parent_lease_id: None,
                by: "issuer",
                reason: &long,
                extra,
            },
            &key,
            Timestamp::parse("2026-11-29T10:00:00.000Z").unwrap(),
        )
        .unwrap();
        assert_eq!(
            value["reason"].as_str().unwrap().chars().count(),
            REASON_MAX_CHARS
        );
        assert_eq!(value["egress"]["code"], "host-denied");
        assert_eq!(value["at"], "2026-11-29T10:00:00.000Z");
        assert_eq!(value["key_fingerprint"], key.fingerprint());
        assert!(verify_signature(&value, &key).unwrap());
        let record = Record::from_value(value).unwrap();
        assert_eq!(record.event, Event::Revoked);
        assert_eq!(record.by.as_deref(), Some("issuer"));
    }

    #[test]
    fn unknown_majors_and_events_are_refused() {
        let line = r#"{"schema_version":"2.0","at":"2026-09-15T10:05:00.000Z","event":"stopped","lease_id":"3e7a9c5d-1b2f-4a8e-9c6d-5b4a3f2e1d0c","reason":"r"}"#;
        assert!(matches!(
            Record::parse(line),
            Err(RecordError::UnknownMajor(2))
        ));
        let line = line.replace("2.0", "1.7");
        assert_eq!(Record::parse(&line).unwrap().event, Event::Stopped);
        let line = line.replace("stopped", "paused");
        assert!(matches!(Record::parse(&line), Err(RecordError::Schema(_))));
        assert!(matches!(Record::parse("{"), Err(RecordError::Json(_))));
    }
}
