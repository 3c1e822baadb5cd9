//! The folded lease state: every loaded lease, every closing record, and chain checks.
//!
//! Invariant: a lease is in the ledger only if its `granted` record passed schema, signature,
//! L1 and L2; the first grant of an id wins; closings only ever close (nothing reopens a
//! lease) and close when they are read, whatever their `at` says (fail closed: `at` is
//! reported, not waited for); a closing record that carries a signature applies only if it
//! verifies under its lease's own key (with `--require-record-signatures`, only signed ones
//! apply); and whether a lease opens anything is decided over its whole chain at a given `now`.
//! Its maps are persistent (`imbl`): a clone shares them in O(1), so the live registry can
//! publish a new ledger per journal refresh without copying every lease ever granted.

use crate::contract::lease::verify_signature;
use crate::contract::record::Record;
use crate::contract::rules::{self, Lifetime, RuleViolation};
use crate::contract::{Event, Keyring, Lease, LeaseError, RecordError, Timestamp};
use crate::policy::refusal::{Code, Refusal};
use imbl::Vector;
use std::sync::Arc;

/// A persistent map with a fast hasher (lease ids are not attacker-chosen keys here: a lease
/// is only folded once its signature verifies).
pub type PersistentMap<K, V> =
    imbl::GenericHashMap<K, V, foldhash::fast::RandomState, imbl::shared_ptr::DefaultSharedPtr>;

/// Chains deeper than this are treated as broken (it also stops parent-link cycles).
pub const MAX_CHAIN_DEPTH: usize = 32;

/// What closed a lease. `at` is what the record says, reported as is: the closure applies from
/// the moment it is read, never later.
#[derive(Debug, Clone, PartialEq)]
pub struct Closure {
    pub event: Event,
    pub at: Timestamp,
    pub by: Option<String>,
    pub reason: Option<String>,
}

/// Status of one lease at an instant (the values of DESIGN.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    Open,
    NotYetValid,
    Expired,
    Revoked,
    Stopped,
    Completed,
    AncestorClosed,
}

impl Status {
    pub const ALL: [Status; 7] = [
        Status::Open,
        Status::NotYetValid,
        Status::Expired,
        Status::Revoked,
        Status::Stopped,
        Status::Completed,
        Status::AncestorClosed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Status::Open => "open",
            Status::NotYetValid => "not-yet-valid",
            Status::Expired => "expired",
            Status::Revoked => "revoked",
            Status::Stopped => "stopped",
            Status::Completed => "completed",
            Status::AncestorClosed => "ancestor-closed",
        }
    }
}

/// Why a lease's chain opens nothing at an instant.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    #[error("lease {0} is not known")]
    Unknown(String),
    #[error("lease {0} is not valid yet")]
    NotYetValid(String),
    #[error("lease {0} has expired")]
    Expired(String),
    #[error("lease {0} is revoked")]
    Revoked(String),
    #[error("lease {0} is closed")]
    Closed(String),
    #[error("lease {lease}: ancestor {ancestor} opens nothing")]
    AncestorClosed { lease: String, ancestor: String },
}

/// Why one journal line was not applied.
#[derive(Debug, thiserror::Error)]
pub enum LineError {
    #[error("line is not UTF-8")]
    NotUtf8,
    #[error(transparent)]
    Record(#[from] RecordError),
    #[error("granted lease not loaded: {0}")]
    Lease(#[from] LeaseError),
    #[error(transparent)]
    Rule(#[from] RuleViolation),
    #[error("closing record for lease {lease}: {problem}")]
    Signature {
        lease: String,
        problem: SignatureProblem,
    },
}

/// Why a closing record's signature is not trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SignatureProblem {
    #[error("its signature does not verify under the lease's key")]
    Invalid,
    #[error("it is unsigned and record signatures are required")]
    Missing,
}

/// Why a line was skipped: the `reason` label of `leasegate_journal_invalid_lines_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InvalidReason {
    /// Not UTF-8, not JSON.
    Parse,
    /// JSON, but an unknown major version or not valid against the schema.
    Schema,
    /// A `granted` record whose lease did not load (schema, rules L1/L2, key, signature).
    Lease,
    /// A record-level rule (L3).
    Rule,
    /// A closing record whose signature is bad, or missing where required.
    Signature,
}

impl InvalidReason {
    pub const ALL: [InvalidReason; 5] = [
        InvalidReason::Parse,
        InvalidReason::Schema,
        InvalidReason::Lease,
        InvalidReason::Rule,
        InvalidReason::Signature,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            InvalidReason::Parse => "parse",
            InvalidReason::Schema => "schema",
            InvalidReason::Lease => "lease",
            InvalidReason::Rule => "rule",
            InvalidReason::Signature => "signature",
        }
    }
}

impl LineError {
    pub fn reason(&self) -> InvalidReason {
        match self {
            LineError::NotUtf8 | LineError::Record(RecordError::Json(_)) => InvalidReason::Parse,
            LineError::Record(_) => InvalidReason::Schema,
            LineError::Lease(_) => InvalidReason::Lease,
            LineError::Rule(_) => InvalidReason::Rule,
            LineError::Signature { .. } => InvalidReason::Signature,
        }
    }
}

/// What applying one record did.
#[derive(Debug, Clone, PartialEq)]
pub enum Applied {
    /// A new lease was loaded.
    Granted(String),
    /// A second grant of a known id: ignored, the first one stands.
    DuplicateGrant(String),
    /// A closing record (it may close nothing new if an earlier one already applies).
    Closed(String),
    /// A closing record whose signature must be checked, for a lease not granted yet: held
    /// until the grant arrives, then applied or skipped (and counted) as if read then.
    Held(String),
    /// A record that changes no status (refused, narrowed, heartbeat, attached).
    Noted(Event),
}

/// Counters over every line offered to the ledger.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FoldStats {
    pub lines: u64,
    pub invalid_lines: u64,
    /// `invalid_lines` by reason, indexed as [`InvalidReason::ALL`].
    pub invalid_by_reason: [u64; 5],
    pub rejected_grants: u64,
    pub duplicate_grants: u64,
    /// Applied lines per event, indexed as [`Event::ALL`].
    pub events: [u64; 9],
}

/// The folded journal. Cloning shares the maps (persistent, O(1)); a clone changed afterwards
/// copies only the paths it touches.
#[derive(Debug, Clone)]
pub struct Ledger {
    /// `None` only for `verify` without a key: grants are then checked for schema and rules
    /// but not signatures. Nothing that serves traffic builds such a ledger.
    keyring: Option<Keyring>,
    leases: PersistentMap<String, Arc<Lease>>,
    /// The earliest closing record of each lease id (known or not yet granted).
    closures: PersistentMap<String, Closure>,
    /// Closing records of leases not granted yet whose signature must be checked under the
    /// lease's key: checked when the grant arrives (a journal merged from several writers may
    /// hold a closing before its grant, and a closing must not be lost for that).
    held: PersistentMap<String, Vector<(Closure, Arc<serde_json::Value>)>>,
    /// Lease ids in the order they were granted.
    order: Vector<String>,
    stats: FoldStats,
}

impl Ledger {
    pub fn new(keyring: Keyring) -> Ledger {
        Ledger::with_trust(Some(keyring))
    }

    /// A ledger that loads grants without checking signatures (`verify` without a key).
    pub fn unverified() -> Ledger {
        Ledger::with_trust(None)
    }

    fn with_trust(keyring: Option<Keyring>) -> Ledger {
        Ledger {
            keyring,
            leases: PersistentMap::default(),
            closures: PersistentMap::default(),
            held: PersistentMap::default(),
            order: Vector::new(),
            stats: FoldStats::default(),
        }
    }

    pub fn keyring(&self) -> Option<&Keyring> {
        self.keyring.as_ref()
    }

    pub fn stats(&self) -> &FoldStats {
        &self.stats
    }

    /// Applies one journal line (without its newline). Invalid lines are counted.
    pub fn apply_line_bytes(&mut self, line: &[u8]) -> Result<Applied, LineError> {
        self.stats.lines += 1;
        let value = std::str::from_utf8(line)
            .map_err(|_| LineError::NotUtf8)
            .and_then(|text| {
                serde_json::from_str::<serde_json::Value>(text)
                    .map_err(|e| RecordError::from(e).into())
            });
        let is_grant = matches!(&value, Ok(v) if v["event"] == "granted");
        let outcome = value
            .and_then(|v| Record::from_value(v).map_err(LineError::from))
            .and_then(|record| self.apply(record));
        match &outcome {
            Ok(Applied::DuplicateGrant(_)) => self.stats.duplicate_grants += 1,
            Ok(_) => {}
            Err(error) => {
                self.count_invalid(error);
                if is_grant {
                    self.stats.rejected_grants += 1;
                }
            }
        }
        outcome
    }

    fn count_invalid(&mut self, error: &LineError) {
        self.stats.invalid_lines += 1;
        let reason = error.reason();
        if let Some(i) = InvalidReason::ALL.iter().position(|r| *r == reason) {
            self.stats.invalid_by_reason[i] += 1;
        }
    }

    /// Whether a closing record of `lease` may apply: a signature it carries must verify under
    /// the lease's own key; an unsigned one applies unless signatures are required. A ledger
    /// without a keyring (`verify` without a key) checks no signature.
    fn check_record_signature(
        &self,
        lease: &Lease,
        record: &serde_json::Value,
    ) -> Result<(), LineError> {
        let Some(keyring) = &self.keyring else {
            return Ok(());
        };
        let problem = match record.get("signature") {
            None if keyring.requires_record_signatures() => SignatureProblem::Missing,
            None => return Ok(()),
            Some(_) => {
                let verified = keyring
                    .get(&lease.key_fingerprint)
                    .map(|key| verify_signature(record, key))
                    .transpose()
                    .map_err(RecordError::from)?
                    .unwrap_or(false);
                if verified {
                    return Ok(());
                }
                SignatureProblem::Invalid
            }
        };
        Err(LineError::Signature {
            lease: lease.id.clone(),
            problem,
        })
    }

    /// Whether a closing record for a lease not granted yet must wait for the grant: only a
    /// grant's key can check its signature.
    fn must_hold(&self, record: &serde_json::Value) -> bool {
        self.keyring
            .as_ref()
            .is_some_and(|k| record.get("signature").is_some() || k.requires_record_signatures())
    }

    /// Applies (or skips, counted) the closing records held for a lease just granted.
    fn release_held(&mut self, lease: &Lease) {
        let Some(held) = self.held.remove(&lease.id) else {
            return;
        };
        for (closure, value) in held {
            match self.check_record_signature(lease, &value) {
                Ok(()) => {
                    self.stats.events[closure.event as usize] += 1;
                    self.close(&lease.id, closure);
                }
                Err(error) => {
                    tracing::warn!(%error, "held closing record skipped at its lease's grant");
                    self.count_invalid(&error);
                }
            }
        }
    }

    /// Applies one parsed record.
    pub fn apply(&mut self, mut record: Record) -> Result<Applied, LineError> {
        let applied = match record.event {
            Event::Granted => {
                let value = record.value["lease"].take();
                let lease = match &self.keyring {
                    Some(keyring) => Lease::load_from_record(value, keyring)?,
                    None => Lease::check(value)?,
                };
                if self.leases.contains_key(&lease.id) {
                    Applied::DuplicateGrant(lease.id)
                } else {
                    let id = lease.id.clone();
                    self.release_held(&lease);
                    self.order.push_back(id.clone());
                    self.leases.insert(id.clone(), Arc::new(lease));
                    Applied::Granted(id)
                }
            }
            event if event.is_closing() => {
                if event == Event::Revoked {
                    let by = record.by.as_deref().unwrap_or_default();
                    if by != "issuer" {
                        let ancestors: Vec<&str> = self
                            .ancestors(&record.lease_id)
                            .map(|l| l.id.as_str())
                            .collect();
                        rules::check_l3(&record.lease_id, by, ancestors.into_iter())?;
                    }
                }
                let closure = Closure {
                    event,
                    at: record.at,
                    by: record.by,
                    reason: record.reason,
                };
                match self.leases.get(&record.lease_id).cloned() {
                    Some(lease) => {
                        self.check_record_signature(&lease, &record.value)?;
                        self.close(&record.lease_id, closure);
                        Applied::Closed(record.lease_id)
                    }
                    None if self.must_hold(&record.value) => {
                        let entry = (closure, Arc::new(record.value));
                        let mut held = self.held.get(&record.lease_id).cloned().unwrap_or_default();
                        held.push_back(entry);
                        self.held.insert(record.lease_id.clone(), held);
                        Applied::Held(record.lease_id)
                    }
                    None => {
                        self.close(&record.lease_id, closure);
                        Applied::Closed(record.lease_id)
                    }
                }
            }
            event => Applied::Noted(event),
        };
        let event = match applied {
            Applied::Granted(_) | Applied::DuplicateGrant(_) => Event::Granted,
            Applied::Closed(_) => record.event,
            // Counted when it applies, at its lease's grant.
            Applied::Held(_) => return Ok(applied),
            Applied::Noted(event) => event,
        };
        self.stats.events[event as usize] += 1;
        Ok(applied)
    }

    /// Records a closing of `lease_id`, keeping the earliest one. Not a journal line: no counter
    /// moves. The live registry uses it to close a lease in memory before (or without) its
    /// record reaching the journal; the record, once read, closes nothing new.
    pub fn close(&mut self, lease_id: &str, closure: Closure) {
        match self.closures.get(lease_id) {
            Some(earliest) if earliest.at <= closure.at => {}
            _ => {
                self.closures.insert(lease_id.to_owned(), closure);
            }
        }
    }

    /// How many leases have been granted (the length of grant order).
    pub fn granted(&self) -> usize {
        self.order.len()
    }

    /// Leases granted after the first `count`, in grant order: what a fold added.
    pub fn granted_since(&self, count: usize) -> impl Iterator<Item = &Arc<Lease>> {
        (count..self.order.len())
            .filter_map(|i| self.order.get(i))
            .filter_map(|id| self.leases.get(id))
    }

    /// The lease granted `position`-th (from 0) in grant order.
    pub fn granted_at(&self, position: usize) -> Option<&Arc<Lease>> {
        self.leases.get(self.order.get(position)?)
    }

    pub fn lease(&self, id: &str) -> Option<&Arc<Lease>> {
        self.leases.get(id)
    }

    /// Every loaded lease, in grant order.
    pub fn leases(&self) -> impl Iterator<Item = &Arc<Lease>> {
        self.order.iter().filter_map(|id| self.leases.get(id))
    }

    /// The loaded ancestors of `id`, nearest first (stops at an unknown parent or a cycle).
    pub fn ancestors<'a>(&'a self, id: &str) -> impl Iterator<Item = &'a Arc<Lease>> + 'a {
        let mut next = self.leases.get(id).and_then(|l| l.parent.clone());
        let mut depth = 0;
        std::iter::from_fn(move || {
            depth += 1;
            if depth > MAX_CHAIN_DEPTH {
                return None;
            }
            let lease = self.leases.get(next.as_deref()?)?;
            next = lease.parent.clone();
            Some(lease)
        })
    }

    /// The lease's own status at `now`, before its ancestors are considered. A closure applies
    /// whatever its `at`: a record dated in the future closes now, not then.
    fn own_status(&self, lease: &Lease, now: Timestamp) -> Status {
        if let Some(closure) = self.closures.get(&lease.id) {
            return match closure.event {
                Event::Revoked => Status::Revoked,
                Event::Stopped => Status::Stopped,
                Event::Completed => Status::Completed,
                _ => Status::Expired,
            };
        }
        match lease.lifetime(now) {
            Lifetime::NotYetValid => Status::NotYetValid,
            Lifetime::Live => Status::Open,
            Lifetime::Expired => Status::Expired,
        }
    }

    /// Status at `now`, chain included; `None` for an unknown lease.
    pub fn status(&self, id: &str, now: Timestamp) -> Option<Status> {
        let own = self.own_status(self.leases.get(id)?, now);
        Some(match own {
            Status::Open if self.check_chain(id, now).is_err() => Status::AncestorClosed,
            own => own,
        })
    }

    /// Whether `id` opens anything at `now`: it and every ancestor are loaded, live and not
    /// closed. On success, the chain, the lease itself first.
    pub fn check_chain(&self, id: &str, now: Timestamp) -> Result<Vec<Arc<Lease>>, ChainError> {
        let lease = self
            .leases
            .get(id)
            .ok_or_else(|| ChainError::Unknown(id.to_owned()))?;
        match self.own_status(lease, now) {
            Status::Open => {}
            Status::NotYetValid => return Err(ChainError::NotYetValid(id.to_owned())),
            Status::Expired => return Err(ChainError::Expired(id.to_owned())),
            Status::Revoked => return Err(ChainError::Revoked(id.to_owned())),
            _ => return Err(ChainError::Closed(id.to_owned())),
        }
        let mut chain = vec![lease.clone()];
        let mut parent = lease.parent.as_deref();
        while let Some(parent_id) = parent {
            let closed = || ChainError::AncestorClosed {
                lease: id.to_owned(),
                ancestor: parent_id.to_owned(),
            };
            if chain.len() >= MAX_CHAIN_DEPTH {
                return Err(closed());
            }
            let ancestor = self.leases.get(parent_id).ok_or_else(closed)?;
            if self.own_status(ancestor, now) != Status::Open {
                return Err(closed());
            }
            chain.push(ancestor.clone());
            parent = ancestor.parent.as_deref();
        }
        Ok(chain)
    }
}

impl From<ChainError> for Refusal {
    /// A chain that opens nothing refuses with the code of the first reason found.
    fn from(error: ChainError) -> Refusal {
        let code = match &error {
            ChainError::Unknown(_) => Code::LeaseUnknown,
            ChainError::NotYetValid(_) => Code::LeaseNotYetValid,
            ChainError::Expired(_) => Code::LeaseExpired,
            ChainError::Revoked(_) => Code::LeaseRevoked,
            ChainError::Closed(_) => Code::LeaseClosed,
            ChainError::AncestorClosed { .. } => Code::AncestorClosed,
        };
        Refusal::new(code, error.to_string())
    }
}
