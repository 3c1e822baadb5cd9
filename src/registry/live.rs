//! The live registry a running proxy reads: an immutable snapshot swapped atomically, the
//! journal it follows and appends to, and one cancellation token per lease with traffic.
//!
//! Invariant: readers never lock — a request loads the current snapshot and decides on it.
//! Every journal line, ours included, is applied exactly once, by the tail: a revocation is
//! appended and then read back under the same lock before its snapshot is published.
//! Cancelling a lease's token cancels every descendant's (child tokens), which closes their
//! tunnels, requests and connections.

use super::journal;
use super::ledger::{Ledger, Status};
use super::tail::{Generation, JournalTail};
use crate::contract::record::{self, Revocation};
use crate::contract::{Keyring, RecordError, Timestamp};
use crate::policy::HostPolicy;
use arc_swap::ArcSwap;
use serde_json::{Map, Value};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// How often the journal is polled (new lines apply within this, well under 250 ms).
pub const POLL_EVERY: Duration = Duration::from_millis(50);

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
    /// The journal we follow and append to.
    tail: tokio::sync::Mutex<JournalTail>,
    /// fsync every append.
    fsync: bool,
    /// Cancellation tokens of leases that have had traffic, keyed by lease id.
    tokens: Mutex<HashMap<String, CancellationToken>>,
    /// When (ms since epoch) the next lease with a token reaches a lifetime boundary.
    next_deadline: AtomicI64,
    /// Bumped whenever what opens may have changed (new snapshot, a deadline passed).
    changes: watch::Sender<u64>,
}

impl Registry {
    /// Follows the journal at `path`: reads what is there now (a partial last line waits).
    pub fn load(path: PathBuf, keyring: Keyring, fsync: bool) -> std::io::Result<Registry> {
        let mut tail = JournalTail::new(path);
        let mut ledger = Ledger::new(keyring);
        let (_, lines) = tail.read_new()?;
        let skipped = journal::apply_lines(&mut ledger, lines.iter().map(Vec::as_slice)).len();
        if skipped > 0 {
            tracing::warn!(skipped, journal = %tail.path().display(), "journal lines skipped");
        }
        Ok(Registry {
            current: ArcSwap::from_pointee(Snapshot::new(ledger)),
            tail: tokio::sync::Mutex::new(tail),
            fsync,
            tokens: Mutex::new(HashMap::new()),
            next_deadline: AtomicI64::new(i64::MAX),
            changes: watch::channel(0).0,
        })
    }

    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.current.load_full()
    }

    /// Notified whenever what opens may have changed.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// The token of a lease: cancelled when it or any ancestor closes. Checked against the
    /// newest snapshot under the token lock, so a lease closed between a request's decision
    /// and this call gets an already-cancelled token.
    pub fn token(&self, lease_id: &str, now: Timestamp) -> CancellationToken {
        let mut tokens = self.tokens.lock().unwrap_or_else(|e| e.into_inner());
        let snapshot = self.snapshot();
        let Ok(chain) = snapshot.ledger.check_chain(lease_id, now) else {
            let token = CancellationToken::new();
            token.cancel();
            return token;
        };
        let deadline = chain
            .iter()
            .map(|l| l.expires_at.as_millis())
            .min()
            .unwrap_or(i64::MAX);
        self.next_deadline.fetch_min(deadline, Ordering::SeqCst);
        token_for(&mut tokens, &snapshot.ledger, lease_id, 0)
    }

    /// Applies journal lines appended since the last read, publishes the result and closes
    /// what no longer opens. Returns how many lines were read.
    pub async fn refresh(&self) -> std::io::Result<usize> {
        let mut tail = self.tail.lock().await;
        self.refresh_locked(&mut tail)
    }

    fn refresh_locked(&self, tail: &mut JournalTail) -> std::io::Result<usize> {
        let (generation, lines) = tail.read_new()?;
        if generation == Generation::Restarted && self.snapshot().ledger.stats().lines > 0 {
            tracing::info!("journal restarted: applying the new file on top of the folded state");
        }
        if lines.is_empty() {
            return Ok(0);
        }
        let mut next = (*self.snapshot()).clone();
        journal::apply_lines(&mut next.ledger, lines.iter().map(Vec::as_slice));
        next.compile_new();
        self.current.store(Arc::new(next));
        self.close_where_not_open(Timestamp::now());
        Ok(lines.len())
    }

    /// Appends a signed `revoked` record (`by: "issuer"`, under the lease's own key), reads it
    /// back through the tail (so it applies once), and closes the lease's subtree. Returns
    /// `false` without writing if the lease is already revoked.
    pub async fn revoke(
        &self,
        lease_id: &str,
        reason: &str,
        extra: Map<String, Value>,
    ) -> Result<bool, RevokeError> {
        let mut tail = self.tail.lock().await;
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
        let (path, fsync) = (tail.path().to_path_buf(), self.fsync);
        tokio::task::spawn_blocking(move || journal::append(&path, &value, fsync))
            .await
            .map_err(std::io::Error::other)??;
        self.refresh_locked(&mut tail)?;
        Ok(true)
    }

    /// Cancels the tokens of every lease that opens nothing at `now`, and notes when the next
    /// remaining one reaches its end.
    pub fn close_where_not_open(&self, now: Timestamp) {
        let snapshot = self.snapshot();
        let mut next_deadline = i64::MAX;
        {
            let mut tokens = self.tokens.lock().unwrap_or_else(|e| e.into_inner());
            tokens.retain(|id, token| match snapshot.ledger.check_chain(id, now) {
                Ok(chain) => {
                    for lease in &chain {
                        next_deadline = next_deadline.min(lease.expires_at.as_millis());
                    }
                    true
                }
                Err(_) => {
                    token.cancel();
                    false
                }
            });
        }
        self.next_deadline.store(next_deadline, Ordering::SeqCst);
        self.changes.send_modify(|v| *v += 1);
    }

    /// Follows the journal and lease lifetimes until `shutdown`: new lines apply within
    /// [`POLL_EVERY`], and a lease reaching `expires_at` is closed by this timer, not by the
    /// next request.
    pub async fn follow(self: Arc<Registry>, shutdown: CancellationToken) {
        let mut ticker = tokio::time::interval(POLL_EVERY);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = ticker.tick() => {}
            }
            match self.refresh().await {
                Ok(0) => {
                    let now = Timestamp::now();
                    if now.as_millis() >= self.next_deadline.load(Ordering::SeqCst) {
                        self.close_where_not_open(now);
                    }
                }
                Ok(_) => {}
                Err(error) => tracing::warn!(%error, "reading the journal failed; retrying"),
            }
        }
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
