//! The live registry a running proxy reads: an immutable snapshot swapped atomically, the
//! journal [`Store`] it follows and appends to, one cancellation token per lease with traffic,
//! and the timer that closes leases when they reach `expires_at`.
//!
//! Invariants:
//! - Readers never lock: a request loads the current snapshot and decides on it.
//! - Every journal line, ours included, is folded exactly once, by the tail ([`Registry::refresh`],
//!   which the follower runs): a revocation is appended through the store and then read back by
//!   that same refresh until the store reaches the position the append returned.
//! - Fail closed: a revocation first closes the lease in memory (a closure in the published
//!   ledger, no journal counter moved: nothing new is admitted), then appends; when it ends —
//!   record folded, append failed or outlasted [`APPEND_TIMEOUT`], or its caller gone — its
//!   subtree's tokens are cancelled, after its last await, so the refusal that caused it is
//!   answered before its connection closes. A failed append is an error for the caller, never
//!   a lease left open.
//! - A snapshot is built from the current one and published under `publishing`, never across an
//!   await, so a refresh and an in-memory closure never drop each other's work. Reading the
//!   store (`reading`) and appending to it are not under one lock: a slow fsync does not stop
//!   the follower.
//! - Expiry is a timer ([`Registry::follow`]), not a poll: it sleeps until the earliest
//!   `expires_at` in the chains of leases with tokens and is re-armed whenever that may move.
//!   Nothing here depends on the store having a tick.

use super::journal;
use super::ledger::Ledger;
use super::revocation::{issuer_revocation, RevocationError};
use super::store::{FileStore, Position, Store};
use super::tokens::LeaseTokens;
use crate::contract::{Keyring, Timestamp};
use crate::policy::HostPolicy;
use arc_swap::ArcSwap;
use serde_json::{Map, Value};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// How long a revocation waits for the store to take its record (and then to read it back).
pub const APPEND_TIMEOUT: Duration = Duration::from_secs(2);

/// The expiry timer never sleeps longer than this: deadlines are wall-clock times and the
/// clock can step, so a long sleep is re-checked.
const MAX_EXPIRY_SLEEP: Duration = Duration::from_secs(1);

/// One published state of the registry.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub ledger: Ledger,
    /// Compiled host lists of every loaded lease (persistent: a clone shares it).
    pub policies: imbl::HashMap<String, Arc<HostPolicy>>,
}

impl Snapshot {
    fn new(ledger: Ledger) -> Snapshot {
        let mut snapshot = Snapshot {
            ledger,
            policies: imbl::HashMap::new(),
        };
        snapshot.compile_since(0);
        snapshot
    }

    /// Compiles the host lists of the leases granted after the first `granted`.
    fn compile_since(&mut self, granted: usize) {
        for lease in self.ledger.granted_since(granted) {
            if !self.policies.contains_key(&lease.id) {
                let policy =
                    HostPolicy::compile_lease(&lease.id, &lease.allow_hosts, &lease.deny_hosts);
                self.policies.insert(lease.id.clone(), Arc::new(policy));
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RevokeError {
    /// No record could be built (unknown lease, no key): nothing was revoked.
    #[error(transparent)]
    Revocation(#[from] RevocationError),
    #[error("appending to the journal (the lease is revoked in memory): {0}")]
    Journal(#[from] std::io::Error),
    #[error("the journal took no record within {0:?} (the lease is revoked in memory)")]
    Timeout(Duration),
}

/// The registry of a running proxy.
pub struct Registry {
    current: ArcSwap<Snapshot>,
    /// The journal we follow and append to.
    store: Box<dyn Store>,
    /// Held across one read and its fold, so batches apply in store order.
    reading: tokio::sync::Mutex<()>,
    /// Held while a snapshot is built from the current one and published (never across an
    /// await).
    publishing: Mutex<()>,
    tokens: LeaseTokens,
    /// Bumped whenever what opens may have changed (new snapshot, a deadline passed).
    changes: watch::Sender<u64>,
    /// How long a revocation waits for its append, and for reading it back.
    append_timeout: Duration,
}

impl Registry {
    /// Follows the journal file at `path`: reads what is there now (a partial last line waits).
    /// With `fsync`, our appends are on disk before a revocation returns.
    pub async fn load(path: PathBuf, keyring: Keyring, fsync: bool) -> std::io::Result<Registry> {
        Registry::open(Box::new(FileStore::new(path, fsync)), keyring).await
    }

    /// Follows `store`: folds what it holds now.
    pub async fn open(store: Box<dyn Store>, keyring: Keyring) -> std::io::Result<Registry> {
        let batch = store.read_new().await?;
        let mut ledger = Ledger::new(keyring);
        let skipped = journal::apply_lines(&mut ledger, batch.lines.iter().map(Vec::as_slice));
        if !skipped.is_empty() {
            tracing::warn!(skipped = skipped.len(), store = %store.describe(), "journal lines skipped");
        }
        Ok(Registry {
            current: ArcSwap::from_pointee(Snapshot::new(ledger)),
            store,
            reading: tokio::sync::Mutex::new(()),
            publishing: Mutex::new(()),
            tokens: LeaseTokens::default(),
            changes: watch::channel(0).0,
            append_timeout: APPEND_TIMEOUT,
        })
    }

    /// Replaces [`APPEND_TIMEOUT`].
    pub fn with_append_timeout(mut self, timeout: Duration) -> Registry {
        self.append_timeout = timeout;
        self
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
        self.tokens.token(&self.current, lease_id, now)
    }

    /// Builds the next snapshot from the current one and publishes it.
    fn publish<T>(&self, change: impl FnOnce(&mut Snapshot) -> T) -> T {
        let _publishing = self.publishing.lock().unwrap_or_else(|e| e.into_inner());
        // O(1): the ledger's and the policies' maps are persistent and shared.
        let mut next = Snapshot::clone(&self.current.load());
        let out = change(&mut next);
        self.current.store(Arc::new(next));
        out
    }

    /// Applies journal lines appended since the last read, publishes the result and closes
    /// what no longer opens. Returns how many lines were read.
    pub async fn refresh(&self) -> std::io::Result<usize> {
        Ok(self.refresh_reaching().await?.0)
    }

    /// [`Registry::refresh`], also returning the position the fold has reached. Cancel-safe:
    /// the only await is the store's read, which keeps the lines of a dropped read for the next.
    async fn refresh_reaching(&self) -> std::io::Result<(usize, Position)> {
        let _reading = self.reading.lock().await;
        let batch = self.store.read_new().await?;
        if batch.restarted && self.snapshot().ledger.stats().lines > 0 {
            tracing::info!(store = %self.store.describe(), "journal restarted: applying the new generation on top of the folded state");
        }
        if batch.lines.is_empty() {
            return Ok((0, batch.position));
        }
        self.publish(|next| {
            let granted = next.ledger.granted();
            journal::apply_lines(&mut next.ledger, batch.lines.iter().map(Vec::as_slice));
            next.compile_since(granted);
        });
        self.close_where_not_open(Timestamp::now());
        Ok((batch.lines.len(), batch.position))
    }

    /// Revokes a lease: closes it in memory at once (nothing new is admitted), appends a signed
    /// `revoked` record (`by: "issuer"`, under the lease's own key), reads the journal until the
    /// record has been folded, and tears down the lease's subtree as it returns. Returns
    /// `false`, writing nothing, if the lease is already revoked. On an append error or timeout
    /// the lease stays revoked in memory and its subtree is torn down all the same.
    pub async fn revoke(
        &self,
        lease_id: &str,
        reason: &str,
        extra: Map<String, Value>,
    ) -> Result<bool, RevokeError> {
        let now = Timestamp::now();
        // Check and close under one lock: of two concurrent revocations, the second sees the
        // first's closure and writes nothing.
        let revocation = self.publish(|next| {
            let revocation = issuer_revocation(&next.ledger, lease_id, reason, extra, now)?;
            if let Some(revocation) = &revocation {
                // Deferred before the closure is visible: no one else tears the subtree down
                // while we still answer on one of its connections.
                self.tokens.defer(lease_id);
                next.ledger.close(lease_id, revocation.closure.clone());
            }
            Ok::<_, RevocationError>(revocation)
        })?;
        let Some(revocation) = revocation else {
            return Ok(false);
        };
        // However this ends (done, failed, timed out, or our caller gone), the subtree is torn
        // down as it does, after the last await: the caller's answer goes out first.
        let _teardown = Teardown {
            registry: self,
            lease_id,
        };
        self.changes.send_modify(|v| *v += 1);
        // Polled right away, in the same poll as the closure above: once it is visible the
        // append is under way even if our caller stops waiting.
        let appended =
            tokio::time::timeout(self.append_timeout, self.store.append(&revocation.record)).await;
        let at = match appended {
            Ok(Ok(at)) => at,
            Ok(Err(error)) => {
                tracing::error!(%error, lease = lease_id, store = %self.store.describe(), "revoked in memory, but the journal did not take the record");
                return Err(RevokeError::Journal(error));
            }
            Err(_) => {
                tracing::error!(lease = lease_id, timeout = ?self.append_timeout, store = %self.store.describe(), "revoked in memory, but appending the record timed out");
                return Err(RevokeError::Timeout(self.append_timeout));
            }
        };
        self.read_until(at).await;
        Ok(true)
    }

    /// Refreshes until the fold reaches `at`, a read fails, or the append timeout passes. Either
    /// way the record is in the store and the follower folds it; the closure in memory holds
    /// till then.
    async fn read_until(&self, at: Position) {
        let deadline = tokio::time::Instant::now() + self.append_timeout;
        loop {
            let reached = match self.refresh_reaching().await {
                Ok((_, reached)) if reached >= at => return,
                Ok((_, reached)) => reached,
                Err(error) => {
                    tracing::warn!(%error, store = %self.store.describe(), "reading our revocation back failed; the follower will fold it");
                    return;
                }
            };
            if tokio::time::timeout_at(deadline, self.store.wait_for_more())
                .await
                .is_err()
            {
                tracing::warn!(%at, %reached, store = %self.store.describe(), "our revocation is not read back yet; the follower will fold it");
                return;
            }
        }
    }

    /// Cancels the tokens of every lease that opens nothing at `now`, and re-arms the expiry
    /// timer for the next remaining one.
    pub fn close_where_not_open(&self, now: Timestamp) {
        self.tokens.close_where_not_open(&self.current, now);
        self.changes.send_modify(|v| *v += 1);
    }

    /// Until `shutdown`: folds new journal lines as the store offers them (the file: within
    /// its poll interval), and closes each lease when it reaches `expires_at`, by a timer
    /// independent of journal activity.
    pub async fn follow(self: Arc<Registry>, shutdown: CancellationToken) {
        tokio::join!(self.tail(&shutdown), self.expire(&shutdown));
    }

    async fn tail(&self, shutdown: &CancellationToken) {
        loop {
            if let Err(error) = self.refresh().await {
                tracing::warn!(%error, store = %self.store.describe(), "reading the journal failed; retrying");
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = self.store.wait_for_more() => {}
            }
        }
    }

    async fn expire(&self, shutdown: &CancellationToken) {
        loop {
            let deadline = self.tokens.next_deadline();
            let left = deadline.saturating_sub(Timestamp::now().as_millis()).max(0);
            let sleep = Duration::from_millis(left as u64).min(MAX_EXPIRY_SLEEP);
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = self.tokens.rearmed() => {}
                _ = tokio::time::sleep(sleep) => {
                    let now = Timestamp::now();
                    if now.as_millis() >= deadline {
                        self.close_where_not_open(now);
                    }
                }
            }
        }
    }
}

/// Ends a revocation: the lease's subtree is no longer deferred and is torn down now.
struct Teardown<'a> {
    registry: &'a Registry,
    lease_id: &'a str,
}

impl Drop for Teardown<'_> {
    fn drop(&mut self) {
        self.registry.tokens.undefer(self.lease_id);
        self.registry.close_where_not_open(Timestamp::now());
    }
}

#[cfg(test)]
mod tests;
