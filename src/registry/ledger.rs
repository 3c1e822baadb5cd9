//! The folded lease state: every loaded lease, every closing record, and chain checks.
//!
//! Invariant: a lease is in the ledger only if its `granted` record passed schema, signature,
//! L1 and L2; the first grant of an id wins; closings only ever close (nothing reopens a
//! lease) and close when they are read, whatever their `at` says (fail closed: `at` is
//! reported, not waited for); a closing record that carries a signature applies only if it
//! verifies under its lease's own key (with `--require-record-signatures`, only signed ones
//! apply); and whether a lease opens anything is decided over its whole chain at a given `now`.
//! Every loaded lease has its compiled host lists beside it (shared by leases with the same
//! lists).
//! With a retention ([`Ledger::retaining_closed`]), a lease closed (or expired) longer ago than
//! that is retired: only its id, parent, key and closing are kept ([`Retired`]), enough to
//! refuse it and its descendants with the right code; a retired lease never opens again.
//! Its maps are persistent (`imbl`): a clone shares them in O(1), so the live registry can
//! publish a new ledger per journal refresh without copying every lease ever granted.

use super::closed::{self, Ending};
use super::prepared::{ClosingFacts, Prepared, RecordSignature, Step};
use super::retired::{LeaseKey, Retired, RetiredMap};
use super::shared_policies::SharedPolicies;
use crate::contract::rules::{self, Lifetime, RuleViolation};
use crate::contract::{Event, Keyring, Lease, LeaseError, RecordError, Timestamp};
use crate::policy::codes::{Code, Refusal};
use crate::policy::HostPolicy;
use imbl::Vector;
use std::sync::Arc;
use std::time::Duration;

/// A persistent map with a fast hasher (lease ids are not attacker-chosen keys here: a lease
/// is only folded once its signature verifies).
pub type PersistentMap<K, V> =
    imbl::GenericHashMap<K, V, foldhash::fast::RandomState, imbl::shared_ptr::DefaultSharedPtr>;

/// Chains deeper than this are treated as broken (it also stops parent-link cycles).
pub const MAX_CHAIN_DEPTH: usize = 32;

/// What closed a lease. `at` is what the record says, reported as is: the closure applies from
/// the moment it is read, never later. (An expiry is shown as an `expired` closure at
/// `expires_at`, without `by` or `reason`.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Closure {
    pub event: Event,
    pub at: Timestamp,
    pub by: Option<String>,
    pub reason: Option<String>,
}

/// Status of one lease at an instant (the `status` values of docs/reference/admin-api.md).
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
    /// The status a closing record gives its lease.
    pub fn closed_by(event: Event) -> Status {
        match event {
            Event::Revoked => Status::Revoked,
            Event::Stopped => Status::Stopped,
            Event::Completed => Status::Completed,
            _ => Status::Expired,
        }
    }

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

/// Why a lease's chain opens nothing at an instant. A closed chain carries what closed it, so
/// its text (a refusal's detail) says what, when, by whom and why ([`closed`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    #[error("lease {0} is not known")]
    Unknown(String),
    #[error("lease {0} is not valid yet")]
    NotYetValid(String),
    /// The lease itself is closed (its earliest closing) or expired.
    #[error("lease {lease} {}", closure.said(closed::FULL))]
    Closed { lease: String, closure: Closure },
    /// The first ancestor, going up, that opens nothing.
    #[error("lease {lease} is closed: ancestor {ancestor} {}", ending.said(closed::FULL))]
    AncestorClosed {
        lease: String,
        ancestor: String,
        ending: Ending,
    },
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
    /// Longer than `--max-journal-line`: skipped unread (a store never holds it whole).
    #[error("line of {len} bytes or more is longer than --max-journal-line ({max} bytes)")]
    TooLong { len: u64, max: usize },
    /// A child grant its ancestors' `budget.depth` or its parent's `budget.fan_out` forbids.
    #[error("granted lease {lease} not loaded: {lineage}")]
    Lineage { lease: String, lineage: Lineage },
}

/// Why a new child of a lease may not be granted: an ancestor's `budget.depth` allows no
/// generation this far down, or the parent's `budget.fan_out` live children are all there.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Lineage {
    #[error(
        "lease {ancestor} has budget.depth {depth}: no lease {generation} generation(s) beneath \
         it may be issued"
    )]
    Depth {
        ancestor: String,
        depth: u64,
        generation: u64,
    },
    #[error("lease {parent} has budget.fan_out {fan_out} and {live} live children already")]
    FanOut {
        parent: String,
        fan_out: u64,
        live: u64,
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
    /// Longer than `--max-journal-line`.
    TooLong,
}

impl InvalidReason {
    pub const ALL: [InvalidReason; 6] = [
        InvalidReason::Parse,
        InvalidReason::Schema,
        InvalidReason::Lease,
        InvalidReason::Rule,
        InvalidReason::Signature,
        InvalidReason::TooLong,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            InvalidReason::Parse => "parse",
            InvalidReason::Schema => "schema",
            InvalidReason::Lease => "lease",
            InvalidReason::Rule => "rule",
            InvalidReason::Signature => "signature",
            InvalidReason::TooLong => "too-long",
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
            LineError::TooLong { .. } => InvalidReason::TooLong,
            LineError::Lineage { .. } => InvalidReason::Rule,
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
    pub invalid_by_reason: [u64; InvalidReason::ALL.len()],
    pub rejected_grants: u64,
    pub duplicate_grants: u64,
    /// Grants whose lifetime was longer than `--max-lease-lifetime`: they expire at
    /// `issued_at` + that ceiling.
    pub capped_grants: u64,
    /// Closing records held for a grant, then skipped when it came (their signature did not
    /// verify under its key): counted in `invalid_lines` when their grant is applied, so no
    /// fold call reports them as a problem of its own lines.
    pub held_skipped: u64,
    /// Applied lines per event, indexed as [`Event::ALL`].
    pub events: [u64; 9],
}

/// A loaded lease, where it is in grant order, and its compiled host lists.
#[derive(Debug, Clone)]
struct Granted {
    /// Its place in grant order (the key of `Ledger::order`).
    seq: u64,
    lease: Arc<Lease>,
    policy: Arc<HostPolicy>,
}

/// The folded journal. Cloning shares the maps (persistent, O(1)); a clone changed afterwards
/// copies only the paths it touches.
#[derive(Debug, Clone)]
pub struct Ledger {
    /// `None` only for `verify` without a key: grants are then checked for schema and rules
    /// but not signatures. Nothing that serves traffic builds such a ledger.
    keyring: Option<Keyring>,
    leases: PersistentMap<String, Granted>,
    /// The earliest closing record of each lease id (known or not yet granted; not retired).
    closures: PersistentMap<String, Closure>,
    /// Closing records of leases not granted yet whose signature must be checked under the
    /// lease's key: checked when the grant arrives (a journal merged from several writers may
    /// hold a closing before its grant, and a closing must not be lost for that).
    held: PersistentMap<String, Vector<(Closure, RecordSignature)>>,
    /// Loaded leases (not retired) in the order they were granted, by `Granted::seq`.
    order: imbl::OrdMap<u64, Arc<Lease>>,
    /// How many leases have been granted: the next `Granted::seq`.
    granted: u64,
    /// Leases retired after their retention, by id.
    retired: RetiredMap,
    /// Compiled host lists shared by leases with the same lists.
    shared: SharedPolicies,
    /// The children granted under each lease with a `budget.fan_out`, in grant order (those
    /// seen closed or expired are dropped as the next child is counted).
    children: PersistentMap<String, Vector<String>>,
    /// How long a closed or expired lease is kept whole; `None`: forever.
    retention: Option<Duration>,
    /// The longest line applied (`--max-journal-line`); a longer one is skipped as `too-long`.
    max_line: usize,
    /// `--max-lease-lifetime`: a lease lives at most this long after its `issued_at`;
    /// `None`: as long as it says.
    max_lifetime: Option<Duration>,
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
            order: imbl::OrdMap::new(),
            granted: 0,
            retired: RetiredMap::default(),
            shared: SharedPolicies::default(),
            children: PersistentMap::default(),
            retention: None,
            max_line: super::journal::MAX_LINE,
            max_lifetime: None,
            stats: FoldStats::default(),
        }
    }

    /// Treats a lease whose `expires_at` is more than `max` after its `issued_at` as expiring
    /// at `issued_at` + `max` (fail closed: a signed year-9999 expiry is not for ever).
    pub fn capping_lifetime(mut self, max: Duration) -> Ledger {
        self.max_lifetime = Some(max);
        self
    }

    /// `lease` with its expiry brought within `--max-lease-lifetime` (counted when it was).
    fn capped(&mut self, mut lease: Lease) -> Lease {
        let Some(max) = self.max_lifetime else {
            return lease;
        };
        let max = i64::try_from(max.as_millis()).unwrap_or(i64::MAX);
        let ceiling = lease.issued_at.saturating_add_millis(max);
        if lease.expires_at > ceiling {
            tracing::debug!(lease = %lease.id, expires_at = %lease.expires_at, %ceiling, "lease lifetime capped by --max-lease-lifetime");
            lease.expires_at = ceiling;
            self.stats.capped_grants += 1;
        }
        lease
    }

    /// Retires leases closed or expired longer than `retention` ago (see [`Retired`]): when a
    /// line closes them, and at [`Ledger::retire_closed`].
    pub fn retaining_closed(mut self, retention: Duration) -> Ledger {
        self.retention = Some(retention);
        self
    }

    /// Skips lines longer than `max` bytes (counted as `too-long`) instead of the default
    /// [`super::journal::MAX_LINE`].
    pub fn limiting_lines(mut self, max: usize) -> Ledger {
        self.max_line = max;
        self
    }

    /// The longest line applied; a store following the journal skips longer ones unread.
    pub fn max_line(&self) -> usize {
        self.max_line
    }

    /// Counts `n` lines a store skipped unread as longer than [`Ledger::max_line`].
    pub fn count_too_long(&mut self, n: u64) {
        self.stats.lines += n;
        self.count_skipped(InvalidReason::TooLong, n);
    }

    pub fn keyring(&self) -> Option<&Keyring> {
        self.keyring.as_ref()
    }

    pub fn stats(&self) -> &FoldStats {
        &self.stats
    }

    /// Applies one journal line (without its newline). Invalid lines are counted.
    pub fn apply_line_bytes(&mut self, line: &[u8]) -> Result<Applied, LineError> {
        self.apply_prepared(Prepared::line_at_most(
            self.keyring.as_ref(),
            line,
            self.max_line,
        ))
    }

    /// Applies one line prepared (under this ledger's keyring) by [`Prepared::line`]. Invalid
    /// lines are counted.
    pub fn apply_prepared(&mut self, prepared: Prepared) -> Result<Applied, LineError> {
        self.stats.lines += 1;
        let outcome = prepared.step.and_then(|step| self.apply(step));
        match &outcome {
            Ok(Applied::DuplicateGrant(_)) => self.stats.duplicate_grants += 1,
            Ok(_) => {}
            Err(error) => {
                self.count_invalid(error);
                if prepared.is_grant {
                    self.stats.rejected_grants += 1;
                }
            }
        }
        outcome
    }

    fn count_invalid(&mut self, error: &LineError) {
        self.count_skipped(error.reason(), 1);
    }

    fn count_skipped(&mut self, reason: InvalidReason, n: u64) {
        self.stats.invalid_lines += n;
        if let Some(i) = InvalidReason::ALL.iter().position(|r| *r == reason) {
            self.stats.invalid_by_reason[i] += n;
        }
    }

    /// Whether a closing record of `lease` may apply: a signature it carries must verify under
    /// the lease's own key; an unsigned one applies unless signatures are required. A ledger
    /// without a keyring (`verify` without a key) checks no signature.
    fn check_record_signature(
        &self,
        (lease_id, key_fingerprint): (&str, &str),
        signature: &RecordSignature,
    ) -> Result<(), LineError> {
        let Some(keyring) = &self.keyring else {
            return Ok(());
        };
        let problem = match signature {
            RecordSignature::Unchecked => return Ok(()),
            RecordSignature::Unsigned if keyring.requires_record_signatures() => {
                SignatureProblem::Missing
            }
            RecordSignature::Unsigned => return Ok(()),
            signed => {
                if signed.verifies_under(key_fingerprint)? {
                    return Ok(());
                }
                SignatureProblem::Invalid
            }
        };
        Err(LineError::Signature {
            lease: lease_id.to_owned(),
            problem,
        })
    }

    /// Whether a closing record for a lease not granted yet must wait for the grant: only a
    /// grant's key can check its signature.
    fn must_hold(&self, signature: &RecordSignature) -> bool {
        self.keyring.as_ref().is_some_and(|k| {
            !matches!(signature, RecordSignature::Unsigned) || k.requires_record_signatures()
        })
    }

    /// Applies (or skips, counted) the closing records held for a lease just granted.
    fn release_held(&mut self, lease: &Lease) {
        let Some(held) = self.held.remove(&lease.id) else {
            return;
        };
        for (closure, signature) in held {
            match self.check_record_signature((&lease.id, &lease.key_fingerprint), &signature) {
                Ok(()) => {
                    self.stats.events[closure.event as usize] += 1;
                    self.close(&lease.id, closure);
                }
                Err(error) => {
                    tracing::warn!(%error, "held closing record skipped at its lease's grant");
                    self.count_invalid(&error);
                    self.stats.held_skipped += 1;
                }
            }
        }
    }

    /// Applies one prepared record.
    fn apply(&mut self, step: Step) -> Result<Applied, LineError> {
        let (applied, event) = match step {
            Step::Grant(lease, policy) => {
                let id = lease.id.clone();
                let known = self.leases.contains_key(&id)
                    || LeaseKey::of(&id).is_some_and(|key| self.retired.contains(&key));
                if known {
                    (Applied::DuplicateGrant(id), Event::Granted)
                } else {
                    if let Some(parent) = lease.parent.as_deref() {
                        self.lineage(parent, lease.issued_at).map_err(|lineage| {
                            LineError::Lineage {
                                lease: id.clone(),
                                lineage,
                            }
                        })?;
                    }
                    let lease = self.capped(lease);
                    self.count_child(&lease);
                    self.release_held(&lease);
                    let lease = Arc::new(lease);
                    let policy = self.shared.share(&lease, policy);
                    let seq = self.granted;
                    self.granted += 1;
                    self.order.insert(seq, lease.clone());
                    self.leases
                        .insert(id.clone(), Granted { seq, lease, policy });
                    self.retire_if_due(&id, Timestamp::now());
                    (Applied::Granted(id), Event::Granted)
                }
            }
            Step::Closing(facts) => match self.apply_closing(facts)? {
                // Counted when it applies, at its lease's grant.
                (applied @ Applied::Held(_), _) => return Ok(applied),
                closed => closed,
            },
            Step::Noted(event) => (Applied::Noted(event), event),
        };
        self.stats.events[event as usize] += 1;
        Ok(applied)
    }

    fn apply_closing(&mut self, facts: ClosingFacts) -> Result<(Applied, Event), LineError> {
        let ClosingFacts {
            event,
            at,
            lease_id,
            by,
            reason,
            signature,
        } = facts;
        if event == Event::Revoked {
            let by = by.as_deref().unwrap_or_default();
            if by != "issuer" {
                let ancestors = self.ancestor_ids(&lease_id);
                rules::check_l3(&lease_id, by, ancestors.iter().map(String::as_str))?;
            }
        }
        let closure = Closure {
            event,
            at,
            by,
            reason,
        };
        if let Some((key, retired)) =
            LeaseKey::of(&lease_id).and_then(|key| Some((key, self.retired.get(&key)?)))
        {
            // Retired: closed long ago. The earliest closing stands; a later one closes
            // nothing new.
            let fingerprint = self.retired.fingerprint(retired).clone();
            self.check_record_signature((&lease_id, &fingerprint), &signature)?;
            self.retired.close(&key, event, at);
            return Ok((Applied::Closed(lease_id), event));
        }
        Ok(match self.leases.get(&lease_id).map(|g| g.lease.clone()) {
            Some(lease) => {
                self.check_record_signature((&lease.id, &lease.key_fingerprint), &signature)?;
                self.close(&lease_id, closure);
                self.retire_if_due(&lease_id, Timestamp::now());
                (Applied::Closed(lease_id), event)
            }
            None if self.must_hold(&signature) => {
                let mut held = self.held.get(&lease_id).cloned().unwrap_or_default();
                held.push_back((closure, signature));
                self.held.insert(lease_id.clone(), held);
                (Applied::Held(lease_id), event)
            }
            None => {
                self.close(&lease_id, closure);
                (Applied::Closed(lease_id), event)
            }
        })
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

    /// The closing that applies to `lease_id` itself (not retired), if any.
    pub fn closure(&self, lease_id: &str) -> Option<&Closure> {
        self.closures.get(lease_id)
    }

    /// The ledger a fold of a replaced journal (a stream deleted and created again) starts
    /// from: the same settings, counters and grant numbering, every closure and retired lease
    /// kept (a revocation is never undone by a journal's replacement), and no lease loaded: a
    /// grant opens again only once the new journal holds it. Returns the leases dropped.
    pub fn refolded(&self) -> (Ledger, usize) {
        let mut next = self.clone();
        next.leases = PersistentMap::default();
        next.order = imbl::OrdMap::new();
        next.shared = SharedPolicies::default();
        (next, self.order.len())
    }

    /// How many leases have been granted (retired ones included).
    pub fn granted(&self) -> usize {
        self.granted as usize
    }

    /// Leases granted after the first `count` and not retired, in grant order: what a fold
    /// added.
    pub fn granted_since(&self, count: usize) -> impl Iterator<Item = &Arc<Lease>> {
        self.order.range(count as u64..).map(|(_, lease)| lease)
    }

    /// The lease granted `position`-th (from 0) in grant order; `None` once it is retired.
    pub fn granted_at(&self, position: usize) -> Option<&Arc<Lease>> {
        self.order.get(&(position as u64))
    }

    /// A loaded lease (not retired).
    pub fn lease(&self, id: &str) -> Option<&Arc<Lease>> {
        self.leases.get(id).map(|g| &g.lease)
    }

    /// The compiled host lists of a loaded lease.
    pub fn policy(&self, id: &str) -> Option<&Arc<HostPolicy>> {
        self.leases.get(id).map(|g| &g.policy)
    }

    /// What is left of a retired lease.
    pub fn retired(&self, id: &str) -> Option<&Retired> {
        self.retired.get(&LeaseKey::of(id)?)
    }

    /// How many leases are retired.
    pub fn retired_count(&self) -> usize {
        self.retired.len()
    }

    /// The fingerprint of the key a known lease (loaded or retired) was signed with.
    pub fn key_fingerprint(&self, id: &str) -> Option<&str> {
        match self.leases.get(id) {
            Some(granted) => Some(&granted.lease.key_fingerprint),
            None => self.retired(id).map(|r| &**self.retired.fingerprint(r)),
        }
    }

    /// The key a known lease was signed with, when the keyring holds it: what checks its
    /// tokens and derives its placeholders.
    pub fn signing_key(&self, id: &str) -> Option<&crate::contract::Key> {
        self.keyring()?.get(self.key_fingerprint(id)?)
    }

    /// Every loaded lease (not retired), in grant order.
    pub fn leases(&self) -> impl Iterator<Item = &Arc<Lease>> {
        self.order.values()
    }

    /// The loaded ancestors of `id`, nearest first (stops at an unknown or retired parent, or
    /// a cycle).
    pub fn ancestors<'a>(&'a self, id: &str) -> impl Iterator<Item = &'a Arc<Lease>> + 'a {
        let mut next = self.lease(id).and_then(|l| l.parent.clone());
        let mut depth = 0;
        std::iter::from_fn(move || {
            depth += 1;
            if depth > MAX_CHAIN_DEPTH {
                return None;
            }
            let lease = self.lease(next.as_deref()?)?;
            next = lease.parent.clone();
            Some(lease)
        })
    }

    /// Whether a new child of `parent`, issued at `at`, keeps the chain's lineage: every
    /// ancestor with a `budget.depth` (the parent being one generation up) allows a
    /// generation this far down, and the parent's `budget.fan_out` has room for one more live
    /// child. A lease whose parent is not loaded is left to the chain check (it opens nothing).
    /// Folded in journal order, so every replica admits the same children of a full parent.
    pub fn lineage(&self, parent: &str, at: Timestamp) -> Result<(), Lineage> {
        let Some(parent_lease) = self.lease(parent) else {
            return Ok(());
        };
        let up = std::iter::once(parent_lease).chain(self.ancestors(parent));
        for (i, ancestor) in up.enumerate() {
            let generation = i as u64 + 1;
            if let Some(depth) = ancestor.budget.as_ref().and_then(|b| b.depth) {
                if generation > depth {
                    return Err(Lineage::Depth {
                        ancestor: ancestor.id.clone(),
                        depth,
                        generation,
                    });
                }
            }
        }
        if let Some(fan_out) = parent_lease.budget.as_ref().and_then(|b| b.fan_out) {
            let live = self.live_children(parent, at).count() as u64;
            if live >= fan_out {
                return Err(Lineage::FanOut {
                    parent: parent.to_owned(),
                    fan_out,
                    live,
                });
            }
        }
        Ok(())
    }

    /// The children of `parent` (a lease with a `budget.fan_out`) that are live at `at`:
    /// loaded, not closed, not expired.
    pub fn live_children<'a>(
        &'a self,
        parent: &str,
        at: Timestamp,
    ) -> impl Iterator<Item = &'a String> + 'a {
        self.children
            .get(parent)
            .into_iter()
            .flatten()
            .filter(move |child| self.is_live(child, at))
    }

    fn is_live(&self, id: &str, at: Timestamp) -> bool {
        self.lease(id).is_some_and(|lease| {
            !self.closures.contains_key(id) && lease.lifetime(at) != Lifetime::Expired
        })
    }

    /// Counts `lease` among its parent's children when the parent has a `budget.fan_out`,
    /// dropping those no longer live.
    fn count_child(&mut self, lease: &Lease) {
        let Some(parent) = lease.parent.as_deref() else {
            return;
        };
        let limited = self
            .lease(parent)
            .is_some_and(|p| p.budget.as_ref().is_some_and(|b| b.fan_out.is_some()));
        if !limited {
            return;
        }
        let mut kept: Vector<String> = self
            .live_children(parent, lease.issued_at)
            .cloned()
            .collect();
        kept.push_back(lease.id.clone());
        self.children.insert(parent.to_owned(), kept);
    }

    /// The ids of the known ancestors of `id` (loaded or retired), nearest first.
    pub fn ancestor_ids(&self, id: &str) -> Vec<String> {
        let parent_of = |id: &str| match self.lease(id) {
            Some(lease) => lease.parent.clone(),
            None => self.retired(id).and_then(Retired::parent),
        };
        let mut ids: Vec<String> = Vec::new();
        let mut next = parent_of(id);
        while let Some(parent) = next.take() {
            let known = self.lease(&parent).is_some() || self.retired(&parent).is_some();
            if !known || ids.len() >= MAX_CHAIN_DEPTH {
                break;
            }
            next = parent_of(&parent);
            ids.push(parent);
        }
        ids
    }

    /// The lease's own status at `now`, before its ancestors are considered. A closure applies
    /// whatever its `at`: a record dated in the future closes now, not then.
    fn own_status(&self, lease: &Lease, now: Timestamp) -> Status {
        if let Some(closure) = self.closures.get(&lease.id) {
            return Status::closed_by(closure.event);
        }
        match lease.lifetime(now) {
            Lifetime::NotYetValid => Status::NotYetValid,
            Lifetime::Live => Status::Open,
            Lifetime::Expired => Status::Expired,
        }
    }

    /// Status at `now`, chain included; `None` for an unknown lease.
    pub fn status(&self, id: &str, now: Timestamp) -> Option<Status> {
        let Some(lease) = self.lease(id) else {
            return self.retired(id).map(Retired::status);
        };
        Some(match self.own_status(lease, now) {
            Status::Open if self.check_chain(id, now).is_err() => Status::AncestorClosed,
            own => own,
        })
    }

    /// What keeps `lease` itself from opening at `now`, before its ancestors are considered
    /// (`None`: nothing): its closing, its expiry, or its start still to come.
    fn own_ending(&self, lease: &Lease, now: Timestamp) -> Option<Ending> {
        if let Some(closure) = self.closures.get(&lease.id) {
            return Some(Ending::Closed(closure.clone()));
        }
        match lease.lifetime(now) {
            Lifetime::NotYetValid => Some(Ending::NotYetValid),
            Lifetime::Live => None,
            Lifetime::Expired => Some(Ending::Closed(Closure {
                event: Event::Expired,
                at: lease.expires_at,
                by: None,
                // No record says why; the wall-clock budget is named when it set the end.
                reason: lease.wall_clock_note(),
            })),
        }
    }

    /// What closed a lease that is no longer loaded: its retired closing, or `Unknown`.
    fn unloaded_ending(&self, id: &str) -> Ending {
        match self.retired(id) {
            Some(retired) => Ending::Closed(retired.closure()),
            None => Ending::Unknown,
        }
    }

    /// Whether `id` opens anything at `now`: it and every ancestor are loaded, live and not
    /// closed. On success, the chain, the lease itself first; otherwise what closed it.
    pub fn check_chain(&self, id: &str, now: Timestamp) -> Result<Vec<Arc<Lease>>, ChainError> {
        let closed = |closure| ChainError::Closed {
            lease: id.to_owned(),
            closure,
        };
        let Some(lease) = self.lease(id) else {
            return Err(match self.unloaded_ending(id) {
                Ending::Closed(closure) => closed(closure),
                _ => ChainError::Unknown(id.to_owned()),
            });
        };
        match self.own_ending(lease, now) {
            None => {}
            Some(Ending::Closed(closure)) => return Err(closed(closure)),
            // The only other ending of a loaded lease's own.
            Some(_) => return Err(ChainError::NotYetValid(id.to_owned())),
        }
        let mut chain = vec![lease.clone()];
        let mut parent = lease.parent.as_deref();
        while let Some(parent_id) = parent {
            let closed = |ending| ChainError::AncestorClosed {
                lease: id.to_owned(),
                ancestor: parent_id.to_owned(),
                ending,
            };
            if chain.len() >= MAX_CHAIN_DEPTH {
                return Err(closed(Ending::TooDeep));
            }
            let Some(ancestor) = self.lease(parent_id) else {
                return Err(closed(self.unloaded_ending(parent_id)));
            };
            if let Some(ending) = self.own_ending(ancestor, now) {
                return Err(closed(ending));
            }
            chain.push(ancestor.clone());
            parent = ancestor.parent.as_deref();
        }
        Ok(chain)
    }

    /// Retires `id` if it closed (or expired) longer than the retention ago at `now`.
    fn retire_if_due(&mut self, id: &str, now: Timestamp) {
        let Some(retention) = self.retention else {
            return;
        };
        let Some(granted) = self.leases.get(id) else {
            return;
        };
        let lease = &granted.lease;
        let closing = self.closures.get(id).map(|c| c.event);
        let closed_at = match self.closures.get(id) {
            Some(closure) => closure.at,
            None if lease.lifetime(now) == Lifetime::Expired => lease.expires_at,
            None => return,
        };
        let retention = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
        if closed_at.as_millis().saturating_add(retention) > now.as_millis() {
            return;
        }
        let Some(key) = LeaseKey::of(id) else {
            return;
        };
        let parent = match lease.parent.as_deref().map(LeaseKey::of) {
            None => None,
            Some(Some(parent)) if !parent.is_nil() => Some(parent),
            Some(_) => return,
        };
        self.retired
            .insert(key, parent, (closing, closed_at), &lease.key_fingerprint);
        let seq = granted.seq;
        self.shared.forget(&granted.lease.clone());
        self.order.remove(&seq);
        self.leases.remove(id);
        self.closures.remove(id);
        self.children.remove(id);
    }

    /// Retires every lease closed (or expired) longer than the retention ago at `now`; returns
    /// how many. The follower runs it from time to time; nothing on the request path does.
    pub fn retire_closed(&mut self, now: Timestamp) -> usize {
        if self.retention.is_none() {
            return 0;
        }
        let due: Vec<String> = self
            .order
            .values()
            .filter(|lease| {
                self.closures.contains_key(&lease.id) || lease.lifetime(now) == Lifetime::Expired
            })
            .map(|lease| lease.id.clone())
            .collect();
        let before = self.retired.len();
        for id in due {
            self.retire_if_due(&id, now);
        }
        self.retired.len() - before
    }
}

impl From<ChainError> for Refusal {
    /// A chain that opens nothing refuses with the code of the first reason found.
    fn from(error: ChainError) -> Refusal {
        let code = match &error {
            ChainError::Unknown(_) => Code::LeaseUnknown,
            ChainError::NotYetValid(_) => Code::LeaseNotYetValid,
            ChainError::Closed { closure, .. } => match closure.event {
                Event::Expired => Code::LeaseExpired,
                Event::Revoked => Code::LeaseRevoked,
                _ => Code::LeaseClosed,
            },
            ChainError::AncestorClosed { .. } => Code::AncestorClosed,
        };
        Refusal::new(code, error.to_string())
    }
}
