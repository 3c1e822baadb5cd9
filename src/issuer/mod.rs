//! The lease authority's issuing half: one `POST /leases` decided, signed, appended and read
//! back, and the records the contract asks for (`granted`, `narrowed`, `refused`).
//!
//! Invariants: a grant is acknowledged only once the fold has admitted it (appended, read
//! back, and loaded by the ledger, whose lineage check sees every replica's children in
//! journal order), so a request right after the answer is served and a full parent's
//! `fan_out` holds across replicas; nothing is granted that [`narrow`] did not derive from the
//! chain as it stands; with an `Idempotency-Key` the lease id is derived from the caller and
//! the key under the signing key, so a retry on any replica finds (or writes, once) the same
//! lease, and a different request under the same key is refused, never granted; a caller
//! that is a lease issues only its own children.

mod rate;

pub use rate::IssueRate;

use crate::budget::{Ceilings, Spending};
use crate::contract::canonical::canonical_bytes;
use crate::contract::keys::sha256_hex;
use crate::contract::lease::{sign, ISSUE_REQUEST};
use crate::contract::narrow::{self, Ask, Grant, Parent, Refusal, Refused, Remaining, RootPolicy};
use crate::contract::record;
use crate::contract::schema::WRITTEN_VERSION;
use crate::contract::{Key, Lease, Timestamp};
use crate::registry::ledger::{ChainError, Lineage};
use crate::registry::{AppendError, Registry};
use serde_json::{json, Value};
use std::sync::Arc;

/// Leases whose first answer is kept for replays.
const ANSWERS_KEPT: u64 = 10_000;

/// `refused` records written a second, from every caller together, by default: beyond, a
/// refusal is answered (`"recorded": false`) without its record, so many leases' tokens refused
/// at their rates cannot flood the journal.
pub const REFUSALS_RECORDED_PER_SECOND: std::num::NonZeroU32 = match std::num::NonZeroU32::new(100)
{
    Some(n) => n,
    None => unreachable!(),
};

/// Who asks for a lease (the admin API's caller, as far as issuing goes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Issuer {
    /// The admin token (or, with no admin token configured, anyone who reaches the API).
    Operator,
    /// A lease's own proxy token: it may issue its own children only.
    Lease(String),
}

impl Issuer {
    /// How the caller is named where idempotency keys and rate limits are kept apart.
    fn scope(&self) -> String {
        match self {
            Issuer::Operator => "operator".to_owned(),
            Issuer::Lease(id) => format!("lease:{id}"),
        }
    }
}

/// When the lease ends, as asked.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Ends {
    /// This long after it is issued.
    After(std::time::Duration),
    At(Timestamp),
    /// Nothing asked: a child ends with its parent, a root this long after it is issued.
    Unasked(std::time::Duration),
}

/// One issuance, as the admin API parsed it.
#[derive(Debug, Clone)]
pub struct Request {
    /// The manifest as given (completed with the contract's empty values before it is read).
    pub manifest: Value,
    pub parent: Option<String>,
    pub ends: Ends,
    pub idempotency_key: Option<String>,
    pub issuer: Issuer,
}

/// A lease granted (or found again under its idempotency key).
#[derive(Debug, Clone)]
pub struct Issued {
    pub lease: Arc<Lease>,
    /// The granted manifest (what the lease carries); `Null` for a replay this process did
    /// not answer first.
    pub manifest: Value,
    /// What narrowing changed.
    pub narrowed: Vec<String>,
    /// Found under its idempotency key, not issued by this call.
    pub replayed: bool,
}

/// Why nothing was granted.
#[derive(Debug, thiserror::Error)]
pub enum IssueError {
    /// Not an issuance this server can read (400).
    #[error("{0}")]
    BadRequest(String),
    /// A lease token asking for anything but its own child (403).
    #[error("{0}")]
    Forbidden(String),
    /// The contract's refusal, recorded as a `refused` record named `refusal_id`.
    #[error("{}", .refused.reason)]
    Refused {
        refused: Refused,
        refusal_id: String,
        /// Whether the `refused` record reached the journal.
        recorded: bool,
    },
    /// The key was used before for a different request (422).
    #[error(
        "Idempotency-Key {0:?} was used for a different request: a retry must repeat the \
         request exactly (a new request needs a new key)"
    )]
    KeyReused(String),
    /// The lease issued under this key has closed since (409).
    #[error("the lease issued under Idempotency-Key {key:?} ({lease}) is no longer open")]
    KeyClosed { key: String, lease: String },
    /// The grant would not fit a journal record (413).
    #[error("the grant would be {0} bytes, more than the {max} a journal record may be", max = record::MAX_RECORD_BYTES)]
    TooLarge(usize),
    /// The journal did not take the grant, or did not give it back in time (503). With an
    /// idempotency key a retry is safe.
    #[error("the journal did not take the grant: {0}")]
    Journal(AppendError),
    /// No key to sign with (500).
    #[error("{0}")]
    NoKey(String),
}

/// The issuer's settings and its per-caller rate.
#[derive(Debug)]
pub struct Authority {
    pub root: RootPolicy,
    pub rate: IssueRate,
    /// The `issuer_session_id` of every lease this process signs.
    session: String,
    /// The granted manifest and narrowing of leases this process issued lately, by lease id:
    /// what a replay under an idempotency key answers again (a replay elsewhere, or after a
    /// restart, answers the lease without them).
    answered: moka::sync::Cache<String, Arc<(Value, Vec<String>)>>,
    /// Answers by outcome, indexed as [`Outcome::ALL`].
    counted: [std::sync::atomic::AtomicU64; Outcome::ALL.len()],
    /// How many `refused` records may be written now.
    refusals: governor::DefaultDirectRateLimiter,
    /// Refusals answered without their record, logged once per episode.
    unrecorded: std::sync::Mutex<crate::log_gate::Flood>,
}

/// How a `POST /leases` ended, as `leasegate_leases_issued_total` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Granted,
    Replayed,
    Refused,
    Rejected,
    RateLimited,
    Failed,
}

impl Outcome {
    pub const ALL: [Outcome; 6] = [
        Outcome::Granted,
        Outcome::Replayed,
        Outcome::Refused,
        Outcome::Rejected,
        Outcome::RateLimited,
        Outcome::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Granted => "granted",
            Outcome::Replayed => "replayed",
            Outcome::Refused => "refused",
            Outcome::Rejected => "rejected",
            Outcome::RateLimited => "rate-limited",
            Outcome::Failed => "failed",
        }
    }

    /// The outcome of an issuance that ended with `result`.
    pub fn of(result: &Result<Issued, IssueError>) -> Outcome {
        match result {
            Ok(issued) if issued.replayed => Outcome::Replayed,
            Ok(_) => Outcome::Granted,
            Err(IssueError::Refused { .. }) => Outcome::Refused,
            Err(IssueError::Journal(_) | IssueError::NoKey(_)) => Outcome::Failed,
            Err(_) => Outcome::Rejected,
        }
    }
}

impl Authority {
    /// An issuer under `root`, each caller at `rate`, at most `refusals` refused records a
    /// second in all.
    pub fn new(root: RootPolicy, rate: IssueRate, refusals: std::num::NonZeroU32) -> Authority {
        Authority {
            root,
            rate,
            session: format!("leasegate-{}", uuid::Uuid::new_v4()),
            answered: moka::sync::Cache::builder()
                .max_capacity(ANSWERS_KEPT)
                .time_to_live(std::time::Duration::from_secs(24 * 3600))
                .build(),
            counted: Default::default(),
            refusals: governor::RateLimiter::direct(governor::Quota::per_second(refusals)),
            unrecorded: Default::default(),
        }
    }

    /// Counts one answer.
    pub fn count(&self, outcome: Outcome) {
        self.counted[outcome as usize].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// The answers so far, by outcome.
    pub fn outcomes(&self) -> Vec<(&'static str, u64)> {
        Outcome::ALL
            .iter()
            .map(|o| {
                (
                    o.as_str(),
                    self.counted[*o as usize].load(std::sync::atomic::Ordering::Relaxed),
                )
            })
            .collect()
    }

    /// Decides `request`, and on a grant appends it (and its `narrowed` record) and waits
    /// until the fold has admitted it.
    pub async fn issue(
        &self,
        registry: &Registry,
        spending: &Spending,
        request: Request,
    ) -> Result<Issued, IssueError> {
        let now = registry.now();
        let declared = narrow::completed(&request.manifest, WRITTEN_VERSION);
        let parent = self.parent_of(&request, &declared)?;
        let snapshot = registry.snapshot();
        let ledger = &snapshot.ledger;
        let keyring = ledger
            .keyring()
            .ok_or_else(|| IssueError::NoKey("the proxy has no keyring".into()))?;
        // A child is signed with its parent's key (one key along a chain), a root with the
        // first key given.
        let key: &Key = match parent.as_deref().and_then(|p| ledger.signing_key(p)) {
            Some(key) => key,
            None => keyring.keys().next().ok_or_else(|| {
                IssueError::NoKey("no --key-file: nothing to sign a lease with".into())
            })?,
        };
        let digest = request_digest(&request, &declared, parent.as_deref())?;
        let lease_id = match &request.idempotency_key {
            Some(k) => idempotent_id(key, &request.issuer.scope(), k),
            None => uuid::Uuid::new_v4().to_string(),
        };
        if let Some(mut found) = replay(ledger, &lease_id, &digest, &request, now)? {
            if let Some(answer) = self.answered.get(&lease_id) {
                found.manifest = answer.0.clone();
                found.narrowed = answer.1.clone();
            }
            return Ok(found);
        }
        let declared_hash = sha256_hex(&canonical_bytes(&declared).map_err(bad)?);
        let after = |d: std::time::Duration| {
            now.saturating_add_millis(i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        };
        let ends = match request.ends {
            Ends::After(d) => after(d),
            Ends::At(at) => at,
            Ends::Unasked(d) => match parent.as_deref().and_then(|p| ledger.lease(p)) {
                Some(parent) => parent.expires_at,
                None => after(d),
            },
        };
        if ends <= now {
            return Err(IssueError::BadRequest(format!(
                "the lease would end at {ends}, not after now ({now})"
            )));
        }
        let refuse = |refused: Refused| (refused, declared_hash.clone());
        let decided = match parent.as_deref() {
            None => narrow::narrow(&Ask {
                declared: &declared,
                parent: None,
                root: self.root,
                ends,
                now,
                public_suffix_wildcards: false,
            }),
            Some(parent_id) => match self.parent(ledger, spending, parent_id, now) {
                Ok((lease, remaining)) => narrow::narrow(&Ask {
                    declared: &declared,
                    parent: Some(Parent {
                        lease: &lease,
                        remaining,
                        live_children: ledger.live_children(parent_id, now).count() as u64,
                    }),
                    root: self.root,
                    ends,
                    now,
                    public_suffix_wildcards: false,
                }),
                Err(refused) => Err(refused),
            },
        };
        let grant = match decided {
            Ok(grant) => grant,
            Err(refused) => {
                return Err(self
                    .refused(registry, refuse(refused), parent.as_deref(), now)
                    .await)
            }
        };
        let granted = self.signed(
            &grant,
            &lease_id,
            &declared,
            &declared_hash,
            &digest,
            parent.as_deref(),
            key,
            now,
        )?;
        // Its `narrowed` record goes right after it, read back in the same wait.
        let narrowed = match grant.narrowed.is_empty() {
            true => None,
            false => record::narrowed(&lease_id, parent.as_deref(), &grant.summary(), now)
                .map_err(|e| tracing::warn!(lease = %lease_id, error = %e, "the narrowed record would not validate"))
                .ok(),
        };
        registry
            .append_and_fold_with(&granted, narrowed.as_ref())
            .await
            .map_err(IssueError::Journal)?;
        let snapshot = registry.snapshot();
        let ledger = &snapshot.ledger;
        match ledger.lease(&lease_id) {
            Some(lease)
                if lease.terms.as_ref().and_then(|t| t.request.as_deref()) == Some(&digest) =>
            {
                let lease = lease.clone();
                self.answered.insert(
                    lease_id.clone(),
                    Arc::new((grant.manifest.clone(), grant.narrowed.clone())),
                );
                Ok(Issued {
                    lease,
                    manifest: grant.manifest,
                    narrowed: grant.narrowed,
                    replayed: false,
                })
            }
            // Another request under the same key won (on another replica, at the same time).
            Some(_) => Err(IssueError::KeyReused(
                request.idempotency_key.clone().unwrap_or_default(),
            )),
            // The fold's lineage check turned it away: a child issued elsewhere at the same
            // time took the parent's last place.
            None => {
                let why = parent
                    .as_deref()
                    .and_then(|p| ledger.lineage(p, now).err())
                    .map(|lineage| match &lineage {
                        Lineage::Depth { .. } => {
                            ("vendor:leasegate:depth-exhausted", lineage.to_string())
                        }
                        Lineage::FanOut { .. } => {
                            ("vendor:leasegate:fan-out-full", lineage.to_string())
                        }
                    })
                    .unwrap_or((
                        "runtime_error:not_admitted",
                        "the journal did not admit the grant".to_owned(),
                    ));
                let refused = Refused::lineage(why.0, why.1);
                Err(self
                    .refused(registry, refuse(refused), parent.as_deref(), now)
                    .await)
            }
        }
    }

    /// The parent asked for: the body's, the manifest's (they must agree) or, for a lease
    /// token, the caller's own lease; a lease token naming another is refused.
    fn parent_of(&self, request: &Request, declared: &Value) -> Result<Option<String>, IssueError> {
        let in_manifest = declared.get("parent_lease_id").and_then(Value::as_str);
        let given = match (request.parent.as_deref(), in_manifest) {
            (Some(a), Some(b)) if a != b => {
                return Err(IssueError::BadRequest(format!(
                    "parent_lease_id {a} differs from the manifest's {b}"
                )))
            }
            (a, b) => a.or(b).map(str::to_owned),
        };
        match (&request.issuer, given) {
            (Issuer::Operator, given) => Ok(given),
            (Issuer::Lease(own), None) => Ok(Some(own.clone())),
            (Issuer::Lease(own), Some(given)) if &given == own => Ok(Some(given)),
            (Issuer::Lease(own), Some(given)) => Err(IssueError::Forbidden(format!(
                "a lease's token issues children of that lease only: lease {own} may not issue \
                 under {given}"
            ))),
        }
    }

    /// The parent's lease and what its chain has left, or why it can have no child now.
    fn parent(
        &self,
        ledger: &crate::registry::Ledger,
        spending: &Spending,
        parent: &str,
        now: Timestamp,
    ) -> Result<(Arc<Lease>, Remaining), Refused> {
        let chain = match ledger.check_chain(parent, now) {
            Ok(chain) => chain,
            Err(ChainError::Unknown(_)) => return Err(Refused::parent_unknown(parent)),
            Err(e) => return Err(Refused::parent_closed(parent, &e.to_string())),
        };
        let left = spending
            .remaining(chain.iter().map(|l| (l.id.as_str(), Ceilings::of(l))))
            .map_err(|e| Refused::budget_unknown(&e.refusal().detail))?;
        Ok((
            chain[0].clone(),
            Remaining {
                tokens: left.tokens,
                cost_usd: left.cost_usd,
                steps: left.steps,
            },
        ))
    }

    /// The signed lease and its `granted` record.
    #[allow(clippy::too_many_arguments)]
    fn signed(
        &self,
        grant: &Grant,
        lease_id: &str,
        declared: &Value,
        declared_hash: &str,
        digest: &str,
        parent: Option<&str>,
        key: &Key,
        now: Timestamp,
    ) -> Result<Value, IssueError> {
        let mut lease = json!({
            "schema_version": WRITTEN_VERSION,
            "lease_id": lease_id,
            "manifest": grant.manifest,
            "declared_hash": declared_hash,
            "issued_at": now.to_string(),
            "expires_at": grant.expires_at.to_string(),
            "issuer_session_id": self.session,
            ISSUE_REQUEST: digest,
        });
        if let Some(parent) = parent {
            lease["parent_lease_id"] = parent.into();
        }
        sign(&mut lease, key).map_err(bad)?;
        let granted = record::granted(&lease, declared, now)
            .map_err(|e| IssueError::BadRequest(format!("the grant does not validate: {e}")))?;
        let size = serde_json::to_vec(&granted).map_or(usize::MAX, |line| line.len());
        if size > record::MAX_RECORD_BYTES {
            return Err(IssueError::TooLarge(size));
        }
        Ok(granted)
    }

    /// Appends the `refused` record of `refused` (a fresh id names it) and returns the error
    /// that answers the caller.
    async fn refused(
        &self,
        registry: &Registry,
        (refused, declared_hash): (Refused, String),
        parent: Option<&str>,
        now: Timestamp,
    ) -> IssueError {
        let refusal_id = uuid::Uuid::new_v4().to_string();
        let record = record::refused(
            &record::Refusal {
                refusal_id: &refusal_id,
                parent_lease_id: parent,
                reasons: &refused.reasons,
                reason: &refused.reason,
                declared_hash: &declared_hash,
            },
            now,
        );
        let recorded = match record {
            Ok(_) if self.refusals.check().is_err() => {
                let say = self
                    .unrecorded
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .occurred(1, std::time::Instant::now());
                match say {
                    crate::log_gate::Say::Start => tracing::warn!(
                        "issuance refusals come faster than they are recorded: more are answered without their refused record"
                    ),
                    crate::log_gate::Say::Summary(s) => tracing::warn!(
                        unrecorded = s.repeats,
                        since_first = s.total,
                        "issuance refusals are still answered without their refused record"
                    ),
                    crate::log_gate::Say::Quiet => {}
                }
                false
            }
            Ok(record) => match registry.append_and_fold(&record).await {
                Ok(()) => true,
                Err(error) => {
                    tracing::warn!(refusal = %refusal_id, %error, "an issuance was refused, but its refused record was not appended");
                    false
                }
            },
            Err(error) => {
                tracing::warn!(refusal = %refusal_id, %error, "an issuance was refused, but its refused record would not validate");
                false
            }
        };
        IssueError::Refused {
            refused,
            refusal_id,
            recorded,
        }
    }
}

impl IssueError {
    /// The kind of refusal, when it is one.
    pub fn refusal(&self) -> Option<Refusal> {
        match self {
            IssueError::Refused { refused, .. } => Some(refused.kind),
            _ => None,
        }
    }
}

fn bad(e: impl std::fmt::Display) -> IssueError {
    IssueError::BadRequest(e.to_string())
}

/// What the caller asked, as one digest: the completed manifest, the parent, the end as
/// asked, the caller. A retry under the same key must match it.
fn request_digest(
    request: &Request,
    declared: &Value,
    parent: Option<&str>,
) -> Result<String, IssueError> {
    let ends = match request.ends {
        Ends::After(d) => json!({"lifetime_ms": u64::try_from(d.as_millis()).unwrap_or(u64::MAX)}),
        Ends::At(at) => json!({"expires_at": at.to_string()}),
        Ends::Unasked(_) => Value::Null,
    };
    let asked = json!({
        "manifest": declared,
        "parent_lease_id": parent,
        "ends": ends,
        "caller": request.issuer.scope(),
    });
    Ok(sha256_hex(&canonical_bytes(&asked).map_err(bad)?))
}

/// The lease id an idempotency key names for `scope`: an HMAC under the signing key, in the
/// contract's UUID form (version 8, RFC 9562 variant), so every replica derives the same one
/// and no caller can aim at another's.
fn idempotent_id(key: &Key, scope: &str, idempotency_key: &str) -> String {
    let mac = key.hmac(format!("leasegate idempotency\0{scope}\0{idempotency_key}").as_bytes());
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&mac[..16]);
    uuid::Builder::from_custom_bytes(bytes)
        .into_uuid()
        .to_string()
}

/// The lease an earlier request under the same key issued, if any: the same request gets it
/// again; another is refused.
fn replay(
    ledger: &crate::registry::Ledger,
    lease_id: &str,
    digest: &str,
    request: &Request,
    now: Timestamp,
) -> Result<Option<Issued>, IssueError> {
    let Some(key) = &request.idempotency_key else {
        return Ok(None);
    };
    let Some(lease) = ledger.lease(lease_id) else {
        if ledger.retired(lease_id).is_some() {
            return Err(IssueError::KeyClosed {
                key: key.clone(),
                lease: lease_id.to_owned(),
            });
        }
        return Ok(None);
    };
    if lease.terms.as_ref().and_then(|t| t.request.as_deref()) != Some(digest) {
        return Err(IssueError::KeyReused(key.clone()));
    }
    if ledger.check_chain(lease_id, now).is_err() {
        return Err(IssueError::KeyClosed {
            key: key.clone(),
            lease: lease_id.to_owned(),
        });
    }
    Ok(Some(Issued {
        lease: lease.clone(),
        manifest: Value::Null,
        narrowed: Vec::new(),
        replayed: true,
    }))
}

#[cfg(test)]
mod tests;
