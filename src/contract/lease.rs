//! A signed lease: loading (version, schema, rules, signature) and signing.
//!
//! Invariant: a [`Lease`] value exists only for JSON that passed the schema, L1, L2 and, for
//! [`Lease::load`], its signature under a trusted key. The signature is checked over the
//! parsed JSON value as received (every member but `signature`), never a re-serialised struct;
//! once checked, the JSON is dropped: a lease keeps only the facts leasegate acts on (a
//! journal of a million leases must not hold a million parsed JSON trees).
//! `expires_at` is the lease's effective end: the signed `expires_at`, or `issued_at` +
//! `budget.wall_clock_ms` when that is earlier (folded in once L1 has passed on the signed
//! values), so every check that reads the end honours the wall-clock budget.

use super::canonical::{canonical_bytes_without, CanonError};
use super::keys::{Key, Keyring, TEST_KEY_FINGERPRINT};
use super::rules::{self, Lifetime, RuleViolation};
use super::schema::{self, Schema, SchemaIssue};
use super::Timestamp;
use serde_json::Value;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("schema_version major {0} is not one this reader knows (1)")]
    UnknownMajor(u64),
    #[error("schema: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Schema(Vec<SchemaIssue>),
    #[error(transparent)]
    Rule(#[from] RuleViolation),
    #[error("signed with key {0}, which is not in the keyring")]
    UnknownKey(String),
    #[error("signed with the published TEST key ({TEST_KEY_FINGERPRINT}); refused without --allow-test-key")]
    TestKey,
    #[error("signature does not verify under key {0}")]
    BadSignature(String),
    #[error(transparent)]
    Canonical(#[from] CanonError),
}

/// A loaded lease: the facts leasegate acts on (not the JSON they came from, which holds the
/// signature and is dropped once checked).
#[derive(Debug, Clone)]
pub struct Lease {
    pub id: String,
    pub parent: Option<String>,
    pub issued_at: Timestamp,
    /// The effective end (see the module's invariant): never later than the signed
    /// `expires_at`, nor than `issued_at` + `budget.wall_clock_ms`.
    pub expires_at: Timestamp,
    pub agent_name: String,
    pub allow_hosts: Vec<String>,
    pub deny_hosts: Vec<String>,
    /// Shared with the keyring's key once the signature verified (one copy for every lease
    /// signed with it).
    pub key_fingerprint: Arc<str>,
    /// The manifest's budget ceilings leasegate reads; `None` when it sets none of them (the
    /// usual case: a million leases pay one pointer each, not the struct).
    pub budget: Option<Box<Budget>>,
    /// The rest of the granted manifest an issuer narrows against and the edge enforces (tool
    /// and path lists, commands, approvals) and the issuer's request digest; `None` when all
    /// are empty (a lease of hosts only pays one pointer).
    pub terms: Option<Box<Terms>>,
}

/// The granted manifest's lists beyond hosts, kept so a child can be narrowed against them,
/// and the digest of the request that issued the lease (`POST /leases` with an
/// `Idempotency-Key`), so a retry is told from a different request with the same key.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Terms {
    pub tools: Vec<String>,
    pub read_paths: Vec<String>,
    pub write_paths: Vec<String>,
    pub commands: Vec<String>,
    pub deny_commands: Vec<String>,
    pub deny_paths: Vec<String>,
    pub approvals: Vec<String>,
    /// The `issue_request` member of the lease (a SHA-256, hex): what its issuer was asked.
    pub request: Option<String>,
}

impl Terms {
    fn read(lease: &Value) -> Option<Box<Terms>> {
        let manifest = &lease["manifest"];
        let list = strings;
        let terms = Terms {
            tools: list(&manifest["allow"]["tools"]),
            read_paths: list(&manifest["allow"]["read_paths"]),
            write_paths: list(&manifest["allow"]["write_paths"]),
            commands: list(&manifest["allow"]["commands"]),
            deny_commands: list(&manifest["deny"]["commands"]),
            deny_paths: list(&manifest["deny"]["paths"]),
            approvals: list(&manifest["approvals"]),
            request: lease[ISSUE_REQUEST].as_str().map(str::to_owned),
        };
        (terms != Terms::default()).then(|| Box::new(terms))
    }
}

/// The lease member where leasegate's issuer keeps the digest of the request it answered
/// (inside the signed bytes: nobody can move it to another lease).
pub const ISSUE_REQUEST: &str = "issue_request";

/// How the views that show a lease's end name the wall-clock budget when it set that end.
pub const WALL_CLOCK_BUDGET: &str = "budget.wall_clock_ms";

/// The manifest's `budget` ceilings leasegate reads (each absent when the manifest leaves it
/// out). `steps` counts the model calls the meter sees (see `budget`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Budget {
    /// Model tokens, input plus output.
    pub tokens: Option<u64>,
    /// Spend in US dollars.
    pub cost_usd: Option<f64>,
    /// Lifetime in milliseconds from `issued_at`.
    pub wall_clock_ms: Option<u64>,
    /// Tool calls or turns.
    pub steps: Option<u64>,
    /// Generations of children that may be issued beneath this lease.
    pub depth: Option<u64>,
    /// Children that may be live under this lease at once.
    pub fan_out: Option<u64>,
}

impl Budget {
    /// The ceilings of a schema-valid `budget` object; `None` when it sets none.
    fn read(value: &Value) -> Option<Box<Budget>> {
        let budget = Budget {
            tokens: value["tokens"].as_u64(),
            cost_usd: value["cost_usd"].as_f64(),
            wall_clock_ms: value["wall_clock_ms"].as_u64(),
            steps: value["steps"].as_u64(),
            depth: value["depth"].as_u64(),
            fan_out: value["fan_out"].as_u64(),
        };
        (budget != Budget::default()).then(|| Box::new(budget))
    }
}

impl Lease {
    /// Version, schema, L1 and L2; no signature. For `verify` without a key.
    pub fn check(value: Value) -> Result<Lease, LeaseError> {
        Lease::checked(&value)
    }

    fn checked(value: &Value) -> Result<Lease, LeaseError> {
        check_major(value).map_err(LeaseError::UnknownMajor)?;
        Schema::Lease.validate(value).map_err(LeaseError::Schema)?;
        Lease::check_rules(value)
    }

    /// [`Lease::load`] for the lease of a schema-valid `granted` record: the record schema's
    /// `lease` definition carries the lease schema's constraints, so validating again would
    /// only repeat the work.
    pub fn load_from_record(value: Value, keyring: &Keyring) -> Result<Lease, LeaseError> {
        check_major(&value).map_err(LeaseError::UnknownMajor)?;
        Lease::check_rules(&value)?.verified(&value, keyring)
    }

    fn check_rules(value: &Value) -> Result<Lease, LeaseError> {
        let mut lease = Lease::from_valid(value);
        rules::check_l1(lease.issued_at, lease.expires_at)?;
        // After L1: a wall-clock budget of 0 ends the lease at once, it does not break L1.
        if let Some(end) = lease.wall_clock_end() {
            lease.expires_at = lease.expires_at.min(end);
        }
        rules::check_l2(&lease.id, lease.parent.as_deref())?;
        if let Some(manifest_parent) = value["manifest"]["parent_lease_id"].as_str() {
            rules::check_l2(&lease.id, Some(manifest_parent))?;
        }
        Ok(lease)
    }

    /// Everything [`Lease::check`] does, then the signature under the key the lease names.
    pub fn load(value: Value, keyring: &Keyring) -> Result<Lease, LeaseError> {
        Lease::checked(&value)?.verified(&value, keyring)
    }

    /// This lease, once `value` (the JSON it was read from) verifies under its key.
    fn verified(mut self, value: &Value, keyring: &Keyring) -> Result<Lease, LeaseError> {
        if &*self.key_fingerprint == TEST_KEY_FINGERPRINT && !keyring.allows_test_key() {
            return Err(LeaseError::TestKey);
        }
        let key = keyring
            .get(&self.key_fingerprint)
            .ok_or_else(|| LeaseError::UnknownKey(self.key_fingerprint.to_string()))?;
        if !verify_signature(value, key)? {
            return Err(LeaseError::BadSignature(self.key_fingerprint.to_string()));
        }
        self.key_fingerprint = key.shared_fingerprint();
        Ok(self)
    }

    /// Where `now` falls in this lease's own lifetime.
    pub fn lifetime(&self, now: Timestamp) -> Lifetime {
        rules::lifetime(self.issued_at, self.expires_at, now)
    }

    /// `issued_at` + `budget.wall_clock_ms`, when the manifest sets it.
    pub fn wall_clock_end(&self) -> Option<Timestamp> {
        let ms = self.budget.as_ref()?.wall_clock_ms?;
        Some(
            self.issued_at
                .saturating_add_millis(i64::try_from(ms).unwrap_or(i64::MAX)),
        )
    }

    /// Whether the wall-clock budget is what ends this lease (its end is
    /// `issued_at` + `budget.wall_clock_ms`, not a later signed `expires_at`).
    pub fn ends_by_wall_clock(&self) -> bool {
        self.wall_clock_end() == Some(self.expires_at)
    }

    /// What a detailed view says of the end when the wall-clock budget sets it:
    /// `budget.wall_clock_ms (1500 ms) spent`; `None` otherwise.
    pub fn wall_clock_note(&self) -> Option<String> {
        if !self.ends_by_wall_clock() {
            return None;
        }
        let ms = self.budget.as_ref()?.wall_clock_ms?;
        Some(format!("{WALL_CLOCK_BUDGET} ({ms} ms) spent"))
    }

    fn from_valid(value: &Value) -> Lease {
        // The schema has vouched for every member read here.
        let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
        let hosts = strings;
        let time = |v: &Value| {
            Timestamp::parse(v.as_str().unwrap_or_default()).unwrap_or(Timestamp::from_millis(0))
        };
        let manifest = &value["manifest"];
        Lease {
            id: text(&value["lease_id"]),
            parent: value["parent_lease_id"]
                .as_str()
                .or(manifest["parent_lease_id"].as_str())
                .map(str::to_owned),
            issued_at: time(&value["issued_at"]),
            expires_at: time(&value["expires_at"]),
            agent_name: text(&manifest["agent"]["name"]),
            allow_hosts: hosts(&manifest["allow"]["hosts"]),
            deny_hosts: hosts(&manifest["deny"]["hosts"]),
            key_fingerprint: value["key_fingerprint"].as_str().unwrap_or_default().into(),
            budget: Budget::read(&manifest["budget"]),
            terms: Terms::read(value),
        }
    }
}

/// The strings of a schema-valid array (anything else: none).
fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// Text given as a lease id that does not have its form: the one message every command's
/// `--lease`, `--parent` and the admin API give for it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a lease id (a lower-case UUID)")]
pub struct NotALeaseId(pub String);

/// `text` as a lease id, or [`NotALeaseId`] (also the value parser of every `--lease` flag).
pub fn lease_id(text: &str) -> Result<String, NotALeaseId> {
    match is_lease_id(text) {
        true => Ok(text.to_owned()),
        false => Err(NotALeaseId(text.to_owned())),
    }
}

/// A lease id as a person or a client may type it: any case, taken in the contract's lower case
/// (every view shows it so).
pub fn lease_id_any_case(text: &str) -> Result<String, NotALeaseId> {
    lease_id(&text.to_ascii_lowercase()).map_err(|_| NotALeaseId(text.to_owned()))
}

/// Whether `text` has the contract's lease id form (a lower-case UUID).
pub fn is_lease_id(text: &str) -> bool {
    text.len() == 36
        && text.bytes().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_digit() || (b'a'..=b'f').contains(&b),
        })
}

/// Refuses a readable `schema_version` whose major this reader does not know; an unreadable
/// one is left for the schema to explain.
pub fn check_major(value: &Value) -> Result<(), u64> {
    match schema::major_version(value) {
        Some(major) if major != schema::KNOWN_MAJOR => Err(major),
        _ => Ok(()),
    }
}

/// Whether `value["signature"]` is the HMAC of `value`'s canonical bytes without `signature`.
pub fn verify_signature(value: &Value, key: &Key) -> Result<bool, CanonError> {
    let Some(signature) = value.get("signature").and_then(Value::as_str) else {
        return Ok(false);
    };
    Ok(key.verify(&canonical_bytes_without(value, "signature")?, signature))
}

/// Sets `key_fingerprint` and `signature` on an unsigned JSON object.
pub fn sign(value: &mut Value, key: &Key) -> Result<(), CanonError> {
    if let Some(object) = value.as_object_mut() {
        object.remove("signature");
        object.insert("key_fingerprint".into(), key.fingerprint().into());
    }
    let signature = key.sign(&canonical_bytes_without(value, "signature")?);
    if let Some(object) = value.as_object_mut() {
        object.insert("signature".into(), signature.into());
    }
    Ok(())
}
