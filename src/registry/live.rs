//! The live registry a running proxy reads: an immutable snapshot swapped atomically, the
//! journal we append revocations to, and one cancellation token per open lease.
//!
//! Invariant: readers never lock — a request loads the current snapshot and decides on it.
//! Writers are serialised: a revocation is appended to the journal before the snapshot that
//! shows it is published, and cancelling a lease's token cancels every descendant's
//! (child tokens), which closes their tunnels and requests.

use super::journal;
use super::ledger::{Ledger, Status};
use crate::contract::record::{self, Record, Revocation};
use crate::contract::{Keyring, RecordError, Timestamp};
use crate::policy::HostPolicy;
use arc_swap::ArcSwap;
use serde_json::{Map, Value};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio_util::sync::CancellationToken;

/// One published state of the registry.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub ledger: Ledger,
    /// Compiled host lists of every loaded lease.
    pub policies: HashMap<String, Arc<HostPolicy>>,
}

impl Snapshot {
    fn new(ledger: Ledger) -> Snapshot {
        let mut snapshot = Snapshot {
            ledger,
            policies: HashMap::new(),
        };
        snapshot.compile_new();
        snapshot
    }

    /// Compiles the host lists of leases that have none yet.
    fn compile_new(&mut self) {
        for lease in self.ledger.leases() {
            self.policies.entry(lease.id.clone()).or_insert_with(|| {
                Arc::new(HostPolicy::compile(&lease.allow_hosts, &lease.deny_hosts))
            });
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RevokeError {
    #[error("lease {0} is not loaded")]
    Unknown(String),
    #[error("no key in the keyring signs lease {0}'s records")]
    NoKey(String),
    #[error("building the revoked record: {0}")]
    Record(#[from] RecordError),
    #[error("appending to the journal: {0}")]
    Journal(#[from] std::io::Error),
}

/// The registry of a running proxy.
pub struct Registry {
    current: ArcSwap<Snapshot>,
    /// Where revocations are appended; `None` keeps them in memory only.
    journal: Option<PathBuf>,
    /// fsync every append.
    fsync: bool,
    /// Serialises writers (our appends and, later, the tail).
    writer: tokio::sync::Mutex<()>,
    /// Cancellation tokens of leases that have had traffic, keyed by lease id.
    tokens: Mutex<HashMap<String, CancellationToken>>,
}

impl Registry {
    pub fn new(ledger: Ledger, journal: Option<PathBuf>, fsync: bool) -> Registry {
        Registry {
            current: ArcSwap::from_pointee(Snapshot::new(ledger)),
            journal,
            fsync,
            writer: tokio::sync::Mutex::new(()),
            tokens: Mutex::new(HashMap::new()),
        }
    }

    /// Reads and folds the journal file.
    pub fn load(path: PathBuf, keyring: Keyring, fsync: bool) -> std::io::Result<Registry> {
        let (ledger, problems) = journal::load(&path, Ledger::new(keyring))?;
        if !problems.is_empty() {
            tracing::warn!(skipped = problems.len(), journal = %path.display(), "journal lines skipped");
        }
        Ok(Registry::new(ledger, Some(path), fsync))
    }

    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.current.load_full()
    }

    /// The token of a lease: cancelled when it or any ancestor closes. Checked against the
    /// newest snapshot under the token lock, so a lease closed between a request's decision
    /// and this call gets an already-cancelled token.
    pub fn token(&self, lease_id: &str, now: Timestamp) -> CancellationToken {
        let mut tokens = self.tokens.lock().unwrap_or_else(|e| e.into_inner());
        let snapshot = self.snapshot();
        if snapshot.ledger.check_chain(lease_id, now).is_err() {
            let token = CancellationToken::new();
            token.cancel();
            return token;
        }
        token_for(&mut tokens, &snapshot.ledger, lease_id, 0)
    }

    /// Appends a signed `revoked` record (`by: "issuer"`, under the lease's own key), publishes
    /// a snapshot that shows it, and cancels the lease's subtree. Returns `false` without
    /// writing if the lease is already revoked.
    pub async fn revoke(
        &self,
        lease_id: &str,
        reason: &str,
        extra: Map<String, Value>,
    ) -> Result<bool, RevokeError> {
        let _writer = self.writer.lock().await;
        let now = Timestamp::now();
        let snapshot = self.snapshot();
        let lease = snapshot
            .ledger
            .lease(lease_id)
            .ok_or_else(|| RevokeError::Unknown(lease_id.to_owned()))?;
        if snapshot.ledger.status(lease_id, now) == Some(Status::Revoked) {
            return Ok(false);
        }
        let key = snapshot
            .ledger
            .keyring()
            .and_then(|k| k.get(&lease.key_fingerprint))
            .ok_or_else(|| RevokeError::NoKey(lease_id.to_owned()))?;
        let value = record::revoked(
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
        if let Some(path) = &self.journal {
            let path = path.clone();
            let line = value.clone();
            let fsync = self.fsync;
            tokio::task::spawn_blocking(move || journal::append(&path, &line, fsync))
                .await
                .map_err(std::io::Error::other)??;
        }
        let mut next = (*snapshot).clone();
        next.ledger.apply(Record::from_value(value)?).ok();
        self.current.store(Arc::new(next));
        self.close_where_not_open(now);
        Ok(true)
    }

    /// Cancels the tokens of every lease that opens nothing at `now`.
    pub fn close_where_not_open(&self, now: Timestamp) {
        let snapshot = self.snapshot();
        let mut tokens = self.tokens.lock().unwrap_or_else(|e| e.into_inner());
        tokens.retain(|id, token| {
            let open = snapshot.ledger.check_chain(id, now).is_ok();
            if !open {
                token.cancel();
            }
            open
        });
    }
}

fn token_for(
    tokens: &mut HashMap<String, CancellationToken>,
    ledger: &Ledger,
    lease_id: &str,
    depth: usize,
) -> CancellationToken {
    if let Some(token) = tokens.get(lease_id) {
        return token.clone();
    }
    let parent = ledger.lease(lease_id).and_then(|l| l.parent.clone());
    let token = match parent {
        Some(parent) if depth < super::ledger::MAX_CHAIN_DEPTH => {
            token_for(tokens, ledger, &parent, depth + 1).child_token()
        }
        _ => CancellationToken::new(),
    };
    tokens.insert(lease_id.to_owned(), token.clone());
    token
}
