//! The live registry a running proxy reads: an immutable snapshot swapped atomically, the
//! journal [`Store`] it follows and appends to, one cancellation token per lease with traffic,
//! and the timer that closes leases when they reach `expires_at`.
//!
//! Invariants:
//! - Readers never lock: a request loads the current snapshot and decides on it.
//! - Every journal line, ours included, is folded exactly once per generation of the store (a
//!   store found replaced is folded afresh), by the tail ([`Registry::refresh`], which the
//!   follower runs), even when a read is dropped: a revocation is appended through the store
//!   and then read back until the fold reaches the position the append returned — by the
//!   follower when one runs (woken to read at once), so that no caller on another runtime
//!   holds the read lock while its own blocking pool is busy.
//! - While a follower runs, the time since it last completed a read is known: longer than the
//!   store's [`Store::stalled_after`] and `/readyz` names it.
//! - Fail closed: a revocation first closes the lease in memory (a closure in the published
//!   ledger, no journal counter moved: nothing new is admitted) and cancels its subtree's
//!   tokens (nothing open goes on; a client connection closes gracefully, so the refusal that
//!   caused it is still answered), then stages its record in the durable [`Pending`] queue
//!   (fsynced) and only then appends: a process killed while the append waits still has the
//!   record. It leaves the queue once the store holds it. A failed append is an error for the
//!   caller, never a lease left open: the record stays queued (in order), and a retry task
//!   appends it once the store takes it again, each record once; a record of the queue that a
//!   read shows already in the store leaves it unappended. The queue's closures are applied at
//!   open, before anything is served.
//! - The journal's health (writable or failing, readable or not, and why) changes state on an
//!   append's or a read's outcome; an error is logged once per change, not per failed attempt,
//!   and `/readyz` names the cause while either fails.
//! - A snapshot is built from the current one and published under `publishing`, never across an
//!   await, so a refresh and an in-memory closure never drop each other's work. Reading the
//!   store (`reading`) and appending to it are not under one lock: a slow fsync does not stop
//!   the follower.
//! - Expiry is a timer ([`Registry::follow`]), not a poll: it sleeps until the earliest
//!   `expires_at` in the chains of leases with tokens and is re-armed whenever that may move.
//!   Nothing here depends on the store having a tick.
//! - A closing record we write is broadcast to the other replicas ([`Store::broadcast`]) right
//!   after the lease is torn down here, before the append; one they broadcast is verified
//!   ([`broadcast::check`]) and closes its lease in memory at once, as the fold of its journal
//!   line will (which then closes nothing new: one event). Forged ones are dropped and counted.
//! - A store found replaced (a stream deleted and created again) is folded afresh: its lines
//!   on a [`Ledger::refolded`] ledger, so every closure already seen stays (a revocation is
//!   never undone) and a grant only the old store held opens nothing.
//! - After a pause of the process, or once contact with the store is back after a gap longer
//!   than its [`Store::stalled_after`] ([`Pause`]), nothing new is admitted until the fold has
//!   reached what the store held when the catch-up began, or that bound has passed since.
//! - Every lifetime decision reads one [`Clock`] ([`Registry::now`]): never a time earlier than
//!   one already used, so nothing seen expired opens again when the wall clock steps back; the
//!   follower writes its latest time down every [`KEEP_EVERY`].

use super::broadcast::{self, Heard};
use super::catch_up::{Pause, BEAT_EVERY};
use super::clock::{Clock, KEEP_EVERY};
use super::journal;
use super::ledger::Ledger;
use super::pending::{pending_path, Pending, Staged};
use super::revocation::{issuer_ending, issuer_revocation, IssuerRevocation, RevocationError};
use super::store::{FileStore, Position, Store};
use super::tokens::LeaseTokens;
use crate::contract::record::Record;
use crate::contract::{Event, Keyring, Timestamp};
use crate::log_gate::{Flood, Say};
use arc_swap::ArcSwap;
use serde_json::{Map, Value};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// How long a revocation waits for the store to take its record (and then to read it back).
pub const APPEND_TIMEOUT: Duration = Duration::from_secs(2);

/// The expiry timer never sleeps longer than this: deadlines are wall-clock times and the
/// clock can step, so a long sleep is re-checked.
const MAX_EXPIRY_SLEEP: Duration = Duration::from_secs(1);

/// Retiring at least this many leases at once gives the freed heap back to the OS.
const TRIM_AFTER_RETIRING: usize = 1_000;

/// How often queued revocations are offered to the store again.
pub const RETRY_EVERY: Duration = Duration::from_secs(1);

/// How often leases past their retention are looked for (a retention is hours; a lease
/// retired this much later costs a little memory for a little longer, nothing else).
pub const RETIRE_EVERY: Duration = Duration::from_secs(60);

/// One published state of the registry.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Every lease and its compiled host lists (persistent: a clone shares them).
    pub ledger: Ledger,
}

impl Snapshot {
    fn new(ledger: Ledger) -> Snapshot {
        Snapshot { ledger }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RevokeError {
    /// No record could be built (unknown lease, no key): nothing was revoked.
    #[error(transparent)]
    Revocation(#[from] RevocationError),
    #[error("appending to the journal (the lease is revoked in memory, its record queued): {0}")]
    Journal(#[from] std::io::Error),
    #[error("the journal took no record within {0:?} (the lease is revoked in memory, its record queued)")]
    Timeout(Duration),
    #[error("the journal is not taking records (the lease is revoked in memory, its record queued behind {0} other(s))")]
    Queued(usize),
}

/// Why a record was not appended and folded (see [`Registry::append_and_fold`]).
#[derive(Debug, thiserror::Error)]
pub enum AppendError {
    #[error("appending to the journal: {0}")]
    Journal(std::io::Error),
    #[error("the journal took no record within {0:?}")]
    Timeout(Duration),
    #[error("the record is in the journal but not folded within {0:?}")]
    NotFolded(Duration),
}

impl RevokeError {
    /// The lease is revoked in memory and torn down; only its record waits (in the durable
    /// queue). `false`: nothing was revoked.
    pub fn revoked_in_memory(&self) -> bool {
        !matches!(self, RevokeError::Revocation(_))
    }
}

/// Whether the store takes our appends: what `/readyz` and the metrics report.
#[derive(Debug, Default)]
struct JournalHealth {
    /// Why the last append failed; `None` once one succeeds.
    failing: Option<String>,
    /// Why the last read failed; `None` once one succeeds. Meanwhile decisions use the last
    /// state read: closing records written by others are not seen.
    unreadable: Option<String>,
    /// The episodes of failed appends, failed reads and skipped lines, for the log.
    append_errors: Flood,
    read_errors: Flood,
    skipped_lines: Flood,
    invalid_broadcasts: Flood,
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
    /// Revocation records the store has not taken yet.
    pending: Pending,
    /// Held while queued records are offered to the store, so no record is offered twice at
    /// once and the queue drains in order.
    flushing: tokio::sync::Mutex<()>,
    health: Mutex<JournalHealth>,
    /// Appends that failed or timed out (`leasegate_journal_append_failures_total`).
    append_failures: AtomicU64,
    /// Broadcasts heard, by [`broadcast::OUTCOMES`] (`leasegate_revoke_broadcasts_total`).
    broadcasts: [AtomicU64; broadcast::OUTCOMES.len()],
    /// Lines read since the store's generation began (counted under `reading`).
    lines_read: Mutex<journal::LineCount>,
    /// When the follower last completed a read of the store; `None` while no follower runs.
    last_read: Mutex<Option<Instant>>,
    /// The position the fold has reached, after each read.
    folded: watch::Sender<Position>,
    /// Wakes the tail to read now rather than after its wait (a revocation waits for its
    /// record to be read back).
    wake_tail: tokio::sync::Notify,
    /// The time every lifetime check uses.
    clock: Arc<Clock>,
    /// The admission gate after a pause of the process.
    pause: Pause,
}

impl Registry {
    /// Follows the journal file at `path`: reads what is there now (a partial last line waits).
    /// With `fsync`, our appends are on disk before a revocation returns.
    /// Revocations the journal did not take wait in `<path>.pending` (read now, its closures
    /// applied).
    /// The fold starts from `ledger` (empty: its keyring and retention).
    pub async fn load(path: PathBuf, ledger: Ledger, fsync: bool) -> std::io::Result<Registry> {
        let queue = pending_path(&path);
        let pending = tokio::task::spawn_blocking(move || Pending::open(queue))
            .await
            .map_err(std::io::Error::other)??;
        let store = FileStore::limited(path, fsync, ledger.max_line());
        Registry::open_with(Box::new(store), ledger, pending).await
    }

    /// Follows `store`: folds what it holds now. Revocations it does not take wait in memory.
    pub async fn open(store: Box<dyn Store>, keyring: Keyring) -> std::io::Result<Registry> {
        Registry::open_with(store, Ledger::new(keyring), Pending::in_memory()).await
    }

    /// Follows `store` with `pending` as the queue of revocations it has not taken: folds what
    /// the store holds now into `ledger` (empty: its keyring and retention), drops from the
    /// queue what it already holds, and closes in memory what the rest of the queue closes.
    pub async fn open_with(
        store: Box<dyn Store>,
        mut ledger: Ledger,
        pending: Pending,
    ) -> std::io::Result<Registry> {
        let mut skipped = 0;
        let (mut unverified, mut keys) = (0, Vec::new());
        let mut skipping = Flood::default();
        // Batch by batch until the store settles, so a stream's delivery and the fold overlap.
        let mut lines_read = journal::LineCount::default();
        let reached = loop {
            let batch = store.read_new().await?;
            let position = batch.position;
            if batch.replaced {
                ledger = ledger.refolded().0;
            }
            let mut problems =
                journal::apply_lines(&mut ledger, batch.lines.iter().map(Vec::as_slice));
            ledger.count_too_long(batch.too_long);
            lines_read.count(batch.restarted, batch.len(), &mut problems);
            journal::warn_skipped_gated(&mut skipping, &problems, Instant::now());
            skipped += problems.len();
            let (n, named) = journal::unverified(&problems);
            unverified += n;
            for key in named {
                if !keys.contains(&key) {
                    keys.push(key);
                }
            }
            if !pending.is_empty() {
                let queue = pending.clone();
                let lines = batch.lines;
                tokio::task::spawn_blocking(move || queue.remove_seen(&lines))
                    .await
                    .map_err(std::io::Error::other)??;
            }
            if store.settled() {
                break position;
            }
        };
        if skipped > 0 {
            tracing::warn!(skipped, store = %store.describe(), "journal lines skipped");
        }
        // Nothing to serve but grants no key verifies: the wrong key, never a quiet start.
        if unverified > 0 && ledger.leases().next().is_none() {
            keys.truncate(3);
            return Err(std::io::Error::other(journal::nothing_verified(
                unverified, &keys,
            )));
        }
        for value in pending.records() {
            // Our own signed records: closing more is the only thing they can do.
            match Record::from_value(value) {
                Ok(record) if record.event.is_closing() => ledger.close(
                    &record.lease_id,
                    super::ledger::Closure {
                        event: record.event,
                        at: record.at,
                        by: record.by,
                        reason: record.reason,
                    },
                ),
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(%error, "a queued revocation does not parse; it is still offered to the journal")
                }
            }
        }
        if !pending.is_empty() {
            tracing::warn!(pending = pending.len(), store = %store.describe(), "revocations from before the restart wait for the journal; their leases stay closed");
        }
        let clock = Arc::new(Clock::default());
        ledger.retire_closed(clock.now());
        // The fold's read buffers, parsed lines and worker arenas are free now.
        crate::memory::release_freed();
        Ok(Registry {
            current: ArcSwap::from_pointee(Snapshot::new(ledger)),
            store,
            reading: tokio::sync::Mutex::new(()),
            publishing: Mutex::new(()),
            tokens: LeaseTokens::default(),
            changes: watch::channel(0).0,
            append_timeout: APPEND_TIMEOUT,
            pending,
            flushing: tokio::sync::Mutex::new(()),
            health: Mutex::new(JournalHealth::default()),
            append_failures: AtomicU64::new(0),
            broadcasts: Default::default(),
            lines_read: Mutex::new(lines_read),
            last_read: Mutex::new(None),
            folded: watch::channel(reached).0,
            wake_tail: tokio::sync::Notify::new(),
            clock,
            pause: Pause::default(),
        })
    }

    /// Reads time from `clock` (the one a server opened over its floor) instead of the wall
    /// clock as it is.
    pub fn with_clock(mut self, clock: Arc<Clock>) -> Registry {
        self.clock = clock;
        self
    }

    /// The time lifetime checks use: never earlier than one already used.
    pub fn now(&self) -> Timestamp {
        self.clock.now()
    }

    pub fn clock(&self) -> &Arc<Clock> {
        &self.clock
    }

    /// How many revocation records wait for the store.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Appends that failed or timed out since start.
    pub fn append_failures(&self) -> u64 {
        self.append_failures.load(Ordering::Relaxed)
    }

    /// Broadcasts heard since start, by outcome ([`broadcast::OUTCOMES`]).
    pub fn broadcasts(&self) -> Vec<(&'static str, u64)> {
        broadcast::OUTCOMES
            .iter()
            .zip(&self.broadcasts)
            .map(|(outcome, n)| (*outcome, n.load(Ordering::Relaxed)))
            .collect()
    }

    /// Applies a closing record another replica broadcast for `lease` (its subject's token):
    /// verified against the current state, it closes the lease in memory and tears it down,
    /// as the fold of its journal line will; anything else is dropped, counted and logged.
    pub fn hear(&self, lease: &str, payload: &[u8]) -> Heard {
        let heard = broadcast::check(&self.snapshot().ledger, lease, payload);
        self.broadcasts[heard.outcome()].fetch_add(1, Ordering::Relaxed);
        match &heard {
            Heard::Closes(closure) => {
                self.publish(|next| next.ledger.close(lease, closure.clone()));
                self.close_where_not_open(self.now());
                tracing::debug!(
                    lease,
                    event = closure.event.as_str(),
                    "closed by another replica's broadcast, ahead of the journal"
                );
            }
            Heard::Invalid(why) => {
                let mut health = self.health();
                match health.invalid_broadcasts.occurred(1, Instant::now()) {
                    Say::Start => {
                        tracing::warn!(lease, why, store = %self.store.describe(), "a closing broadcast that does not verify: dropped (leasegate_revoke_broadcasts_total{{outcome=\"invalid\"}} counts them)")
                    }
                    Say::Summary(s) => {
                        tracing::warn!(dropped = s.repeats, since_first = s.total, store = %self.store.describe(), "more closing broadcasts that do not verify")
                    }
                    Say::Quiet => {}
                }
            }
            Heard::AlreadyClosed | Heard::UnknownLease => {}
        }
        heard
    }

    /// How following the store stands (lag, reconnections, a problem).
    pub fn store_health(&self) -> super::store::StoreHealth {
        self.store.health()
    }

    /// How long since the follower last completed a read of the store (`None`: no follower
    /// runs).
    pub fn follow_lag(&self) -> Option<Duration> {
        self.last_read().map(|at| at.elapsed())
    }

    fn last_read(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.last_read.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Why the journal is not in a state to serve from (`/readyz`), or `None`.
    pub fn journal_problem(&self) -> Option<String> {
        if let Some(problem) = self.store.health().problem {
            return Some(problem);
        }
        if let Some(problem) = self.pause.problem(self.store.stalled_after()) {
            return Some(problem);
        }
        let bound = self.store.stalled_after();
        if let Some(lag) = self.follow_lag().filter(|lag| *lag > bound) {
            return Some(format!(
                "the journal follower has completed no read of the {} for {:.1} s (more than \
                 {bound:?}): closing records written elsewhere are not seen; decisions use the \
                 last state read",
                self.store.describe(),
                lag.as_secs_f64()
            ));
        }
        let (failing, unreadable) = {
            let health = self.health();
            (health.failing.clone(), health.unreadable.clone())
        };
        let pending = self.pending.len();
        let writing = match (failing, pending) {
            (None, 0) => None,
            (Some(cause), n) => Some(format!(
                "journal not writable: {cause}; {n} revocation(s) pending"
            )),
            (None, n) => Some(format!("{n} revocation(s) pending for the journal")),
        };
        let reading = unreadable.map(|cause| {
            format!("journal not readable: {cause}; decisions use the last state read")
        });
        match (reading, writing) {
            (Some(reading), Some(writing)) => Some(format!("{reading}; {writing}")),
            (reading, writing) => reading.or(writing),
        }
    }

    /// A read of the store failed: logged as an error when it was readable, then counted
    /// (a summary at most once a minute).
    fn read_failed(&self, error: &std::io::Error) {
        let mut health = self.health();
        match health.read_errors.occurred(1, Instant::now()) {
            Say::Start => {
                tracing::error!(%error, store = %self.store.describe(), "the journal cannot be read: closing records written elsewhere are not seen until it can")
            }
            Say::Summary(s) => {
                tracing::error!(%error, failed_reads = s.repeats, since_first = s.total, store = %self.store.describe(), "the journal still cannot be read")
            }
            Say::Quiet => {}
        }
        health.unreadable = Some(error.to_string());
    }

    /// A read of the store succeeded: logged only when it was failing.
    fn read_succeeded(&self) {
        let mut health = self.health();
        if let Some(cause) = health.unreadable.take() {
            let failed_reads = health
                .read_errors
                .end(Instant::now())
                .map_or(1, |s| s.total);
            tracing::error!(was = %cause, failed_reads, store = %self.store.describe(), "the journal can be read again");
        }
    }

    fn health(&self) -> std::sync::MutexGuard<'_, JournalHealth> {
        self.health.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An append failed: counted; logged as an error when the journal was writable, then
    /// summarised at most once a minute.
    fn append_failed(&self, cause: String) {
        self.append_failures.fetch_add(1, Ordering::Relaxed);
        let mut health = self.health();
        match health.append_errors.occurred(1, Instant::now()) {
            Say::Start => {
                tracing::error!(%cause, store = %self.store.describe(), pending = self.pending.len(), "the journal stopped taking records: revocations are queued and retried")
            }
            Say::Summary(s) => {
                tracing::error!(%cause, failed_appends = s.repeats, since_first = s.total, store = %self.store.describe(), pending = self.pending.len(), "the journal still takes no records")
            }
            Say::Quiet => {}
        }
        health.failing = Some(cause);
    }

    /// An append succeeded: logged only when the journal was failing.
    fn append_succeeded(&self) {
        let mut health = self.health();
        if let Some(cause) = health.failing.take() {
            let failed_appends = health
                .append_errors
                .end(Instant::now())
                .map_or(1, |s| s.total);
            tracing::error!(was = %cause, failed_appends, store = %self.store.describe(), pending = self.pending.len(), "the journal takes records again");
        }
    }

    /// Queues a record behind those already queued (blocking file I/O off the runtime).
    async fn enqueue(&self, record: &Value) {
        let (queue, record) = (self.pending.clone(), record.clone());
        let queued = tokio::task::spawn_blocking(move || queue.push(&record))
            .await
            .map_err(std::io::Error::other)
            .and_then(|r| r);
        if let Err(error) = queued {
            tracing::error!(%error, "queued a revocation in memory only: its queue file cannot be written");
        }
    }

    /// Stages a record whose append is about to be tried: on disk in the queue before this
    /// returns (blocking file I/O off the runtime). Dropped without [`Staged::landed`], the
    /// record stays queued; the retry task offers it.
    async fn stage(&self, record: &Value) -> Option<Staged> {
        let (queue, record) = (self.pending.clone(), record.clone());
        match tokio::task::spawn_blocking(move || queue.stage(&record)).await {
            Ok((staged, Ok(()))) => Some(staged),
            Ok((staged, Err(error))) => {
                tracing::error!(%error, "a revocation is staged in memory only: its queue file cannot be written");
                Some(staged)
            }
            // The blocking task panicked: nothing staged; the append goes on without it.
            Err(error) => {
                tracing::error!(%error, "staging a revocation in its queue");
                None
            }
        }
    }

    /// The store holds a staged record: it leaves the queue (off the runtime; the rewrite goes
    /// through even if our caller stops waiting).
    async fn landed(&self, staged: Option<Staged>) {
        let Some(staged) = staged else { return };
        let removed = tokio::task::spawn_blocking(move || staged.landed())
            .await
            .map_err(std::io::Error::other)
            .and_then(|r| r);
        if let Err(error) = removed {
            tracing::error!(%error, "a revocation reached the journal but its queue file was not rewritten");
        }
    }

    /// Offers the queued records to the store, oldest first, until one fails or the queue is
    /// empty. The journal is read first: a record a read hands out leaves the queue unappended
    /// (an append that timed out may have landed after all).
    pub async fn flush_pending(&self) {
        let _flushing = self.flushing.lock().await;
        if self.pending.is_empty() {
            return;
        }
        if let Err(error) = self.refresh().await {
            tracing::debug!(%error, "reading the journal before offering queued revocations");
        }
        while let Some(record) = self.pending.front() {
            match tokio::time::timeout(self.append_timeout, self.store.append(&record)).await {
                Ok(Ok(_)) => {
                    let queue = self.pending.clone();
                    let removed = tokio::task::spawn_blocking(move || queue.remove(&record))
                        .await
                        .map_err(std::io::Error::other)
                        .and_then(|r| r);
                    if let Err(error) = removed {
                        tracing::error!(%error, "a queued revocation reached the journal but its queue file was not rewritten");
                    }
                    self.append_succeeded();
                }
                Ok(Err(error)) => return self.append_failed(error.to_string()),
                Err(_) => {
                    return self
                        .append_failed(format!("no append within {:?}", self.append_timeout))
                }
            }
        }
        // Fold what we appended now rather than a poll later.
        if let Err(error) = self.refresh().await {
            tracing::debug!(%error, "reading back flushed revocations; the follower will");
        }
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
    /// the store's read keeps the lines of a dropped read for the next, and the lines it hands
    /// out are folded before anything else is awaited (a catch-up's timeout may drop this
    /// future at any await: lines taken and not folded would never be folded).
    async fn refresh_reaching(&self) -> std::io::Result<(usize, Position)> {
        let _reading = self.reading.lock().await;
        let read = self.store.read_new().await;
        if let Some(last) = self.last_read().as_mut() {
            *last = Instant::now();
        }
        let batch = match read {
            Ok(batch) => {
                self.read_succeeded();
                batch
            }
            Err(error) => {
                self.read_failed(&error);
                return Err(error);
            }
        };
        if batch.restarted && !batch.replaced && self.snapshot().ledger.stats().lines > 0 {
            tracing::info!(store = %self.store.describe(), "journal restarted: applying the new generation on top of the folded state");
        }
        let mut problems = match (batch.len(), batch.replaced) {
            (0, false) => Vec::new(),
            _ => self.publish(|next| {
                if batch.replaced {
                    let (ledger, dropped) = next.ledger.refolded();
                    tracing::warn!(store = %self.store.describe(), leases_dropped = dropped, "the journal was replaced: folding it afresh; its closures already seen stay in force, leases it no longer grants are refused");
                    next.ledger = ledger;
                }
                next.ledger.count_too_long(batch.too_long);
                journal::apply_lines(&mut next.ledger, batch.lines.iter().map(Vec::as_slice))
            }),
        };
        self.lines_read
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .count(batch.restarted, batch.len(), &mut problems);
        journal::warn_skipped_gated(&mut self.health().skipped_lines, &problems, Instant::now());
        if !batch.lines.is_empty() || batch.replaced {
            self.close_where_not_open(self.now());
        }
        self.folded.send_replace(batch.position);
        let read = batch.lines.len();
        if read > 0 && !self.pending.is_idle() {
            let (queue, lines) = (self.pending.clone(), batch.lines);
            // Dropped while it waits, the rewrite still runs on the blocking pool.
            match tokio::task::spawn_blocking(move || queue.remove_seen(&lines)).await {
                Ok(Ok(0)) => {}
                Ok(Ok(seen)) => tracing::info!(seen, "queued revocations found in the journal"),
                Ok(Err(error)) => tracing::error!(%error, "rewriting the queue of revocations"),
                Err(error) => tracing::error!(%error, "rewriting the queue of revocations"),
            }
        }
        Ok((read, batch.position))
    }

    /// Revokes a lease: closes it in memory and tears down its subtree at once (nothing new is
    /// admitted, nothing open goes on), then stages a signed `revoked` record (`by: "issuer"`,
    /// under the lease's own key) in the durable queue, appends it and reads the journal until
    /// the record has been folded. Returns `false`, writing nothing, if the lease is already
    /// revoked. On an append error or timeout the lease stays revoked in memory and its record
    /// stays queued.
    pub async fn revoke(
        &self,
        lease_id: &str,
        reason: &str,
        extra: Map<String, Value>,
    ) -> Result<bool, RevokeError> {
        self.close_by(lease_id, |ledger, now| {
            issuer_revocation(ledger, lease_id, reason, extra, now)
        })
        .await
    }

    /// Ends `lease_id` with a signed `stopped` or `completed` record (`usage` on the latter),
    /// through the same path as [`Registry::revoke`]: closed in memory and torn down first, the
    /// record staged, appended and read back. `Ok(false)`: a closing record already applies.
    pub async fn end(
        &self,
        lease_id: &str,
        event: Event,
        reason: Option<&str>,
        usage: Option<crate::contract::record::Usage>,
    ) -> Result<bool, RevokeError> {
        self.close_by(lease_id, |ledger, now| {
            issuer_ending(ledger, lease_id, event, reason, usage, now)
        })
        .await
    }

    async fn close_by(
        &self,
        lease_id: &str,
        build: impl FnOnce(&Ledger, Timestamp) -> Result<Option<IssuerRevocation>, RevocationError>,
    ) -> Result<bool, RevokeError> {
        let now = self.now();
        // Check and close under one lock: of two concurrent closings, the second sees the
        // first's closure and writes nothing.
        let revocation = self.publish(|next| {
            let revocation = build(&next.ledger, now)?;
            if let Some(revocation) = &revocation {
                next.ledger.close(lease_id, revocation.closure.clone());
            }
            Ok::<_, RevocationError>(revocation)
        })?;
        let Some(revocation) = revocation else {
            return Ok(false);
        };
        // Torn down first, whatever the journal does next. A connection of the subtree that is
        // answering (this refusal's, say) closes gracefully: its answer goes out first.
        self.close_where_not_open(now);
        self.changes.send_modify(|v| *v += 1);
        // The other replicas close it now too, whether or not the journal takes the record.
        self.store.broadcast(&revocation.record);
        let queued = self.pending.len();
        if queued > 0 {
            // Behind the others: the store gets records in the order they were made.
            self.enqueue(&revocation.record).await;
            tracing::warn!(
                lease = lease_id,
                queued,
                "revoked in memory; its record waits behind the queued ones"
            );
            return Err(RevokeError::Queued(queued));
        }
        // On disk before the append is tried: a kill while it waits loses nothing. If our
        // caller stops waiting from here on, the guard's drop leaves the record queued.
        let staged = self.stage(&revocation.record).await;
        let appended =
            tokio::time::timeout(self.append_timeout, self.store.append(&revocation.record)).await;
        let at = match appended {
            Ok(Ok(at)) => at,
            Ok(Err(error)) => {
                tracing::warn!(%error, lease = lease_id, store = %self.store.describe(), "revoked in memory, but the journal did not take the record: queued");
                drop(staged);
                self.append_failed(error.to_string());
                return Err(RevokeError::Journal(error));
            }
            Err(_) => {
                tracing::warn!(lease = lease_id, timeout = ?self.append_timeout, store = %self.store.describe(), "revoked in memory, but appending the record timed out: queued");
                drop(staged);
                self.append_failed(format!("no append within {:?}", self.append_timeout));
                return Err(RevokeError::Timeout(self.append_timeout));
            }
        };
        self.landed(staged).await;
        self.append_succeeded();
        self.read_until(at).await;
        Ok(true)
    }

    /// Waits until the fold reaches `at` (a read fails, or the append timeout passes); whether
    /// it did. Either way the record is in the store and the follower folds it; the closure
    /// in memory holds till then. While a follower runs, it does the reading, woken to read
    /// now; otherwise (the commands, tests) this refreshes.
    async fn read_until(&self, at: Position) -> bool {
        if self.last_read().is_some() {
            let mut folded = self.folded.subscribe();
            self.wake_tail.notify_one();
            if tokio::time::timeout(
                self.append_timeout,
                folded.wait_for(|reached| *reached >= at),
            )
            .await
            .is_err()
            {
                tracing::warn!(%at, reached = %*folded.borrow(), store = %self.store.describe(), "our record is not read back yet; the follower will fold it");
                return false;
            }
            return true;
        }
        let deadline = tokio::time::Instant::now() + self.append_timeout;
        loop {
            let reached = match self.refresh_reaching().await {
                Ok((_, reached)) if reached >= at => return true,
                Ok((_, reached)) => reached,
                Err(error) => {
                    tracing::warn!(%error, store = %self.store.describe(), "reading our record back failed; the follower will fold it");
                    return false;
                }
            };
            if tokio::time::timeout_at(deadline, self.store.wait_for_more())
                .await
                .is_err()
            {
                tracing::warn!(%at, %reached, store = %self.store.describe(), "our record is not read back yet; the follower will fold it");
                return false;
            }
        }
    }

    /// Appends one record that closes nothing (a grant, `narrowed`, `refused`) through the
    /// store and waits until the fold has read it back: once this returns `Ok`, every
    /// snapshot published from then on holds it. Nothing is queued: a record the store did
    /// not take is the caller's to report (a grant not appended was never given).
    pub async fn append_and_fold(&self, record: &Value) -> Result<(), AppendError> {
        self.append_and_fold_with(record, None).await
    }

    /// [`Registry::append_and_fold`] for `record`, with `note` (a record about it, such as its
    /// `narrowed`) appended right after it and read back in the same wait. A `note` the store
    /// does not take is logged, never an error: only `record` is acknowledged.
    pub async fn append_and_fold_with(
        &self,
        record: &Value,
        note: Option<&Value>,
    ) -> Result<(), AppendError> {
        let appended = tokio::time::timeout(self.append_timeout, self.store.append(record)).await;
        let mut at = match appended {
            Ok(Ok(at)) => at,
            Ok(Err(error)) => {
                self.append_failed(error.to_string());
                return Err(AppendError::Journal(error));
            }
            Err(_) => {
                self.append_failed(format!("no append within {:?}", self.append_timeout));
                return Err(AppendError::Timeout(self.append_timeout));
            }
        };
        self.append_succeeded();
        if let Some(note) = note {
            match tokio::time::timeout(self.append_timeout, self.store.append(note)).await {
                Ok(Ok(position)) => at = at.max(position),
                Ok(Err(error)) => {
                    tracing::warn!(%error, event = %note["event"], lease = %note["lease_id"], "a record about an appended one was not appended")
                }
                Err(_) => {
                    tracing::warn!(event = %note["event"], lease = %note["lease_id"], timeout = ?self.append_timeout, "a record about an appended one was not appended in time")
                }
            }
        }
        match self.read_until(at).await {
            true => Ok(()),
            false => Err(AppendError::NotFolded(self.append_timeout)),
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
    /// The registry counts as followed from this call until the future ends or is dropped.
    pub fn follow(
        self: Arc<Registry>,
        shutdown: CancellationToken,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        /// Says no follower runs once this one ends (or its runtime drops it).
        struct Following(Arc<Registry>);
        impl Drop for Following {
            fn drop(&mut self) {
                *self.0.last_read() = None;
                self.0.pause.disarm();
            }
        }
        *self.last_read() = Some(Instant::now());
        self.pause.arm();
        let following = Following(self);
        async move {
            let this = &following.0;
            tokio::join!(
                this.tail(&shutdown),
                this.expire(&shutdown),
                this.retry(&shutdown),
                this.retire(&shutdown),
                this.keep_time(&shutdown),
                this.listen(&shutdown),
                this.heartbeat(&shutdown),
                this.catch_up(&shutdown)
            );
        }
    }

    /// Lets a request that started at `at` through: at once unless the process was paused or
    /// contact with the store is back after a gap (see [`Pause`]); then once the fold has
    /// caught up with the store, or its [`Store::stalled_after`] has passed.
    pub async fn admission(&self, at: Instant) {
        if !self.pause.is_open(at) {
            let contact = self.store.last_contact();
            self.pause
                .admit(at, self.store.stalled_after(), contact)
                .await;
        }
    }

    /// The heartbeat of [`Pause`]: every [`BEAT_EVERY`] on the follower's thread.
    async fn heartbeat(&self, shutdown: &CancellationToken) {
        let mut ticker = tokio::time::interval(BEAT_EVERY);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = ticker.tick() => self.pause.beat(self.store.last_contact(), self.store.stalled_after()),
            }
        }
    }

    /// Once a pause is noticed: asks the store what it holds now and reads until the fold has
    /// reached it (a store that does not answer is asked again), then opens the gate.
    async fn catch_up(&self, shutdown: &CancellationToken) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = self.pause.begun() => {}
            }
            while self.pause.is_catching_up() {
                let caught_up = tokio::time::timeout(self.append_timeout, async {
                    let head = self.store.head().await?;
                    let mut folded = self.folded.subscribe();
                    // Reads what the store delivered (a file: reads it) now, not at a poll.
                    self.refresh().await?;
                    folded
                        .wait_for(|at| *at >= head)
                        .await
                        .map_err(std::io::Error::other)?;
                    Ok::<_, std::io::Error>(())
                });
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    caught_up = caught_up => match caught_up {
                        Ok(Ok(())) => self.pause.end(),
                        Ok(Err(error)) => {
                            tracing::debug!(%error, store = %self.store.describe(), "catching up with the journal; retrying");
                            tokio::time::sleep(BEAT_EVERY).await;
                        }
                        Err(_) => {}
                    },
                }
            }
        }
    }

    /// Writes the clock's latest time down every [`KEEP_EVERY`] (off the runtime's threads), so
    /// a restart starts from it.
    async fn keep_time(&self, shutdown: &CancellationToken) {
        let mut ticker = tokio::time::interval(KEEP_EVERY);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = ticker.tick() => self.keep_clock().await,
            }
        }
    }

    /// Writes the clock's latest time down now (off the runtime's threads).
    pub async fn keep_clock(&self) {
        let clock = self.clock.clone();
        let _ = tokio::task::spawn_blocking(move || clock.keep()).await;
    }

    /// Every [`RETIRE_EVERY`], retires the leases whose retention has passed since they closed
    /// or expired (those a journal line closed long ago are retired as it is read).
    async fn retire(&self, shutdown: &CancellationToken) {
        let mut ticker = tokio::time::interval(RETIRE_EVERY);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = ticker.tick() => {
                    let now = self.now();
                    let retired = self.publish(|next| next.ledger.retire_closed(now));
                    if retired > 0 {
                        tracing::debug!(retired, "closed leases past their retention retired");
                    }
                    if retired >= TRIM_AFTER_RETIRING {
                        // Off the runtime's threads: trimming a large heap takes milliseconds.
                        let _ = tokio::task::spawn_blocking(crate::memory::release_freed).await;
                    }
                }
            }
        }
    }

    /// Offers queued revocations to the store every [`RETRY_EVERY`] (at once at start: a
    /// restart may have left some).
    async fn retry(&self, shutdown: &CancellationToken) {
        let mut ticker = tokio::time::interval(RETRY_EVERY);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = ticker.tick() => self.flush_pending().await,
            }
        }
    }

    /// Applies the other replicas' closing broadcasts as they are heard.
    async fn listen(&self, shutdown: &CancellationToken) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                heard = self.store.heard() => {
                    self.hear(&heard.lease, &heard.payload);
                }
            }
        }
    }

    async fn tail(&self, shutdown: &CancellationToken) {
        loop {
            // A failure is logged once per change of state by the read itself.
            if let Err(error) = self.refresh().await {
                tracing::debug!(%error, store = %self.store.describe(), "reading the journal failed; retrying");
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = self.store.wait_for_more() => {}
                _ = self.wake_tail.notified() => {}
            }
        }
    }

    async fn expire(&self, shutdown: &CancellationToken) {
        loop {
            let deadline = self.tokens.next_deadline();
            let left = deadline.saturating_sub(self.now().as_millis()).max(0);
            let sleep = Duration::from_millis(left as u64).min(MAX_EXPIRY_SLEEP);
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = self.tokens.rearmed() => {}
                _ = tokio::time::sleep(sleep) => {
                    let now = self.now();
                    if now.as_millis() >= deadline {
                        self.close_where_not_open(now);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
