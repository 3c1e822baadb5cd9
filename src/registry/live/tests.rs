use super::*;
use crate::commands::issue::{issue, IssueRequest};
use crate::contract::{Event, Key};
use crate::registry::pending::{pending_path, Pending};
use crate::registry::store::{Batch, BoxFuture};
use crate::registry::{ChainError, Status};
use std::io::{self, Write};
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use tokio::sync::Semaphore;

/// A journal file with one lease of `ttl`, and the keyring that loads it.
fn journal_with_lease(path: &Path, key: &Key, ttl: Duration) -> String {
    issue(
        path,
        key,
        &IssueRequest {
            manifest: serde_json::json!({}),
            allow_hosts: vec!["origin.test".into()],
            deny_hosts: vec![],
            parent: None,
            ttl,
            name: "test".into(),
            purpose: "test".into(),
            now: Timestamp::now(),
        },
    )
    .unwrap()
    .lease_id
}

fn keyring(key: &Key) -> Keyring {
    let mut keyring = Keyring::new(false);
    keyring.insert(key.clone());
    keyring
}

/// The file store, with appends that fail, or that wait for a permit.
struct Faulty {
    file: FileStore,
    fail: Arc<AtomicBool>,
    gate: Arc<Semaphore>,
}

impl Store for Faulty {
    fn read_new(&self) -> BoxFuture<'_, io::Result<Batch>> {
        self.file.read_new()
    }

    fn append(&self, record: &Value) -> BoxFuture<'_, io::Result<Position>> {
        let append = self.file.append(record);
        let (fail, gate) = (self.fail.load(Ordering::SeqCst), self.gate.clone());
        Box::pin(async move {
            if fail {
                return Err(io::Error::other("disk full"));
            }
            let _permit = gate.acquire().await;
            append.await
        })
    }

    fn wait_for_more(&self) -> BoxFuture<'_, ()> {
        self.file.wait_for_more()
    }

    fn describe(&self) -> String {
        "faulty".into()
    }
}

struct Setup {
    _dir: tempfile::TempDir,
    path: PathBuf,
    key: Key,
    lease: String,
    gate: Arc<Semaphore>,
    fail: Arc<AtomicBool>,
}

impl Setup {
    fn new() -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.jsonl");
        let key = Key::generate();
        let lease = journal_with_lease(&path, &key, Duration::from_secs(600));
        Setup {
            _dir: dir,
            path,
            key,
            lease,
            gate: Arc::new(Semaphore::new(0)),
            fail: Arc::new(AtomicBool::new(false)),
        }
    }

    async fn registry(&self, fail: bool) -> Registry {
        self.fail.store(fail, Ordering::SeqCst);
        Registry::open(Box::new(self.store()), keyring(&self.key))
            .await
            .unwrap()
    }

    fn store(&self) -> Faulty {
        Faulty {
            file: FileStore::new(self.path.clone(), false),
            fail: self.fail.clone(),
            gate: self.gate.clone(),
        }
    }

    /// A registry whose queue lives in `<journal>.pending`.
    async fn durable_registry(&self) -> Registry {
        let pending = Pending::open(pending_path(&self.path)).unwrap();
        Registry::open_with(
            Box::new(self.store()),
            Ledger::new(keyring(&self.key)),
            pending,
        )
        .await
        .unwrap()
    }

    fn revoked_lines(&self) -> usize {
        std::fs::read_to_string(&self.path)
            .unwrap()
            .lines()
            .filter(|l| l.contains("\"event\":\"revoked\""))
            .count()
    }
}

fn revoked_folded(registry: &Registry) -> u64 {
    registry.snapshot().ledger.stats().events[Event::Revoked as usize]
}

#[tokio::test]
async fn a_revoke_whose_append_fails_still_closes_the_lease_in_memory() {
    let setup = Setup::new();
    let registry = setup.registry(true).await;
    let token = registry.token(&setup.lease, Timestamp::now());
    assert!(!token.is_cancelled());
    let error = registry
        .revoke(&setup.lease, "refused", Map::new())
        .await
        .unwrap_err();
    assert!(matches!(error, RevokeError::Journal(_)), "{error}");
    assert!(token.is_cancelled(), "the lease's traffic is torn down");
    let snapshot = registry.snapshot();
    let now = Timestamp::now();
    let error = snapshot.ledger.check_chain(&setup.lease, now).unwrap_err();
    assert!(
        matches!(&error, ChainError::Closed { lease, closure }
            if *lease == setup.lease && closure.event == Event::Revoked
                && closure.reason.as_deref() == Some("refused")),
        "{error:?}"
    );
    assert_eq!(
        snapshot.ledger.status(&setup.lease, now),
        Some(Status::Revoked)
    );
    assert!(registry.token(&setup.lease, now).is_cancelled());
    assert_eq!(setup.revoked_lines(), 0, "nothing reached the journal");
    assert_eq!(revoked_folded(&registry), 0, "no line was folded");
    assert!(
        !registry
            .revoke(&setup.lease, "again", Map::new())
            .await
            .unwrap(),
        "already revoked (in memory): nothing more to write"
    );
}

#[tokio::test]
async fn a_revoke_whose_append_times_out_still_closes_the_lease_in_memory() {
    let setup = Setup::new();
    let registry = setup
        .registry(false)
        .await
        .with_append_timeout(Duration::from_millis(50));
    let token = registry.token(&setup.lease, Timestamp::now());
    let error = registry
        .revoke(&setup.lease, "refused", Map::new())
        .await
        .unwrap_err();
    assert!(matches!(error, RevokeError::Timeout(_)), "{error}");
    assert!(token.is_cancelled());
    assert_eq!(
        registry
            .snapshot()
            .ledger
            .status(&setup.lease, Timestamp::now()),
        Some(Status::Revoked)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_follower_folds_other_lines_while_an_append_waits() {
    let setup = Setup::new();
    let registry = Arc::new(setup.registry(false).await);
    let traffic = registry.token(&setup.lease, Timestamp::now());
    let mut changes = registry.subscribe();
    let revoking = tokio::spawn({
        let (registry, lease) = (registry.clone(), setup.lease.clone());
        async move { registry.revoke(&lease, "refused", Map::new()).await }
    });
    // The in-memory closure is published (a change) before the append starts waiting.
    changes.changed().await.unwrap();
    assert_eq!(
        registry
            .snapshot()
            .ledger
            .status(&setup.lease, Timestamp::now()),
        Some(Status::Revoked)
    );
    let other = journal_with_lease(&setup.path, &setup.key, Duration::from_secs(600));
    assert_eq!(
        registry.refresh().await.unwrap(),
        1,
        "the new grant is read"
    );
    assert!(registry.snapshot().ledger.lease(&other).is_some());
    assert!(!revoking.is_finished(), "the append is still waiting");
    assert!(
        registry
            .token(&setup.lease, Timestamp::now())
            .is_cancelled(),
        "nothing new is admitted"
    );
    assert!(
        traffic.is_cancelled(),
        "torn down before the append, not when it ends"
    );

    setup.gate.add_permits(1);
    assert!(revoking.await.unwrap().unwrap());
    assert_eq!(setup.revoked_lines(), 1);
    assert_eq!(revoked_folded(&registry), 1, "read back by the tail, once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_revokes_of_one_lease_write_one_record() {
    let setup = Setup::new();
    setup.gate.add_permits(2);
    let registry = setup.registry(false).await;
    let (a, b) = tokio::join!(
        registry.revoke(&setup.lease, "first", Map::new()),
        registry.revoke(&setup.lease, "second", Map::new()),
    );
    let mut outcomes = [a.unwrap(), b.unwrap()];
    outcomes.sort();
    assert_eq!(outcomes, [false, true]);
    assert_eq!(setup.revoked_lines(), 1);
    assert_eq!(revoked_folded(&registry), 1);
    assert_eq!(registry.refresh().await.unwrap(), 0, "folded already, once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_expiry_timer_cancels_a_token_with_no_journal_activity() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.jsonl");
    let key = Key::generate();
    // Long enough that loading and following finish before expiry even on a loaded machine.
    let lease = journal_with_lease(&path, &key, Duration::from_millis(2_000));
    let registry = Arc::new(
        Registry::load(path, Ledger::new(keyring(&key)), false)
            .await
            .unwrap(),
    );
    let expires_at = registry.snapshot().ledger.lease(&lease).unwrap().expires_at;
    let shutdown = CancellationToken::new();
    tokio::spawn(registry.clone().follow(shutdown.clone()));
    let asked = Timestamp::now();
    let token = registry.token(&lease, asked);
    if asked.as_millis() + 100 < expires_at.as_millis() {
        assert!(!token.is_cancelled(), "cancelled before the lease expired");
    }
    tokio::time::timeout(Duration::from_secs(10), token.cancelled())
        .await
        .expect("the token was never cancelled");
    let late = Timestamp::now().as_millis() - expires_at.as_millis();
    // Not cancelled early; and by a timer, not by a periodic sweep (a slow machine can be late
    // by a scheduling delay, never by seconds).
    assert!(
        (0..1_500).contains(&late),
        "cancelled {late} ms after expiry"
    );
    shutdown.cancel();
}

/// The `reason` of each `revoked` line in the journal, in order.
fn revoked_reasons(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == "revoked")
        .map(|v| v["reason"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn revocations_the_journal_refuses_are_queued_then_flushed_once_in_order() {
    let setup = Setup::new();
    setup.gate.add_permits(100);
    let others: Vec<String> = (0..2)
        .map(|_| journal_with_lease(&setup.path, &setup.key, Duration::from_secs(600)))
        .collect();
    let registry = setup.durable_registry().await;
    assert_eq!(registry.journal_problem(), None);
    setup.fail.store(true, Ordering::SeqCst);
    let leases = [&setup.lease, &others[0], &others[1]];
    for (i, lease) in leases.iter().enumerate() {
        let error = registry
            .revoke(lease, &format!("refusal {i}"), Map::new())
            .await
            .unwrap_err();
        match i {
            0 => assert!(matches!(error, RevokeError::Journal(_)), "{error}"),
            _ => assert!(matches!(error, RevokeError::Queued(n) if n == i), "{error}"),
        }
        assert_eq!(
            registry.snapshot().ledger.status(lease, Timestamp::now()),
            Some(Status::Revoked)
        );
    }
    assert_eq!(registry.pending(), 3);
    assert_eq!(
        registry.append_failures(),
        1,
        "the later ones did not even try"
    );
    let problem = registry.journal_problem().unwrap();
    assert!(
        problem.contains("journal not writable: disk full") && problem.contains("3 revocation"),
        "{problem}"
    );
    assert_eq!(
        std::fs::read_to_string(pending_path(&setup.path))
            .unwrap()
            .lines()
            .count(),
        3,
        "durable before the journal takes them"
    );
    registry.flush_pending().await;
    assert_eq!(
        registry.append_failures(),
        2,
        "a retry that fails is counted"
    );
    assert_eq!(setup.revoked_lines(), 0);

    setup.fail.store(false, Ordering::SeqCst);
    registry.flush_pending().await;
    registry.flush_pending().await;
    assert_eq!(
        revoked_reasons(&setup.path),
        ["refusal 0", "refusal 1", "refusal 2"],
        "each once, in order"
    );
    assert_eq!(registry.pending(), 0);
    assert_eq!(registry.journal_problem(), None);
    assert!(
        !pending_path(&setup.path).exists(),
        "the queue file goes once empty"
    );
    assert_eq!(revoked_folded(&registry), 3, "read back, each once");
    registry.refresh().await.unwrap();
    assert_eq!(revoked_folded(&registry), 3);
}

#[tokio::test]
async fn a_restart_with_queued_revocations_keeps_their_leases_closed() {
    let setup = Setup::new();
    setup.fail.store(true, Ordering::SeqCst);
    {
        let registry = setup.durable_registry().await;
        registry
            .revoke(&setup.lease, "refused", Map::new())
            .await
            .unwrap_err();
        assert_eq!(registry.pending(), 1);
    }
    // Restarted while the journal still refuses: the queue file closes the lease.
    let registry = setup.durable_registry().await;
    assert_eq!(registry.pending(), 1);
    assert_eq!(
        registry
            .snapshot()
            .ledger
            .status(&setup.lease, Timestamp::now()),
        Some(Status::Revoked)
    );
    assert!(registry
        .token(&setup.lease, Timestamp::now())
        .is_cancelled());
    assert!(registry.journal_problem().unwrap().contains("1 revocation"));
    setup.gate.add_permits(10);
    setup.fail.store(false, Ordering::SeqCst);
    registry.flush_pending().await;
    assert_eq!(setup.revoked_lines(), 1);

    // The journal took it but the queue file was left (a crash between the two): a restart
    // finds the record in the journal and does not append it again.
    let record = std::fs::read_to_string(&setup.path)
        .unwrap()
        .lines()
        .find(|l| l.contains("\"event\":\"revoked\""))
        .unwrap()
        .to_owned();
    std::fs::write(pending_path(&setup.path), format!("{record}\n")).unwrap();
    let registry = setup.durable_registry().await;
    assert_eq!(registry.pending(), 0);
    registry.flush_pending().await;
    assert_eq!(setup.revoked_lines(), 1, "no duplicate");
}

/// The record is on disk in the queue before its append is tried: a process killed while the
/// append waits (a leaderless stream, a hung disk) restarts with the lease closed and the
/// record still to append; once the append lands, the record leaves the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revocation_is_queued_on_disk_while_its_append_waits() {
    let setup = Setup::new();
    let registry = Arc::new(
        setup
            .durable_registry()
            .await
            .with_append_timeout(Duration::from_secs(60)),
    );
    let revoking = tokio::spawn({
        let (registry, lease) = (registry.clone(), setup.lease.clone());
        async move { registry.revoke(&lease, "refused", Map::new()).await }
    });
    let queue = pending_path(&setup.path);
    let staged = async {
        while !std::fs::read_to_string(&queue).is_ok_and(|t| t.contains(&setup.lease)) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), staged)
        .await
        .expect("the record is not on disk while its append waits");
    assert!(!revoking.is_finished(), "the append is still waiting");
    assert_eq!(
        registry.pending(),
        0,
        "its own append is under way: not queued"
    );
    assert_eq!(registry.journal_problem(), None);

    // What a restart now (a kill while the append waits) finds: the lease closed, the record
    // queued for the journal.
    let restarted = setup.durable_registry().await;
    assert_eq!(restarted.pending(), 1);
    assert_eq!(
        restarted
            .snapshot()
            .ledger
            .status(&setup.lease, Timestamp::now()),
        Some(Status::Revoked)
    );
    drop(restarted);

    setup.gate.add_permits(10);
    assert!(revoking.await.unwrap().unwrap());
    assert_eq!(setup.revoked_lines(), 1);
    assert!(!queue.exists(), "the record left the queue once appended");
    assert_eq!(registry.pending(), 0);
}

/// A revocation whose caller stops waiting while its append waits leaves its record queued:
/// the retry appends it, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revocation_whose_caller_goes_away_is_still_appended_once() {
    let setup = Setup::new();
    let registry = Arc::new(
        setup
            .durable_registry()
            .await
            .with_append_timeout(Duration::from_secs(60)),
    );
    let queue = pending_path(&setup.path);
    let revoking = tokio::spawn({
        let (registry, lease) = (registry.clone(), setup.lease.clone());
        async move { registry.revoke(&lease, "refused", Map::new()).await }
    });
    let staged = async {
        while !queue.exists() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), staged)
        .await
        .unwrap();
    revoking.abort();
    assert!(revoking.await.unwrap_err().is_cancelled());
    // Queued once its own append is gone (the staging task may still be handing its guard
    // back to nobody).
    let queued = async {
        while registry.pending() != 1 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), queued)
        .await
        .expect("the record of an abandoned revocation is never queued");
    setup.gate.add_permits(10);
    registry.flush_pending().await;
    assert_eq!(setup.revoked_lines(), 1);
    assert_eq!(registry.pending(), 0);
    assert!(!queue.exists());
}

/// An append that times out but lands: the read that hands it out keeps it from being queued
/// (or takes it out of the queue), so the retry never writes it a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_append_that_lands_is_not_appended_again() {
    let setup = Setup::new();
    let registry = setup
        .durable_registry()
        .await
        .with_append_timeout(Duration::from_millis(50));
    let error = registry
        .revoke(&setup.lease, "refused", Map::new())
        .await
        .unwrap_err();
    assert!(matches!(error, RevokeError::Timeout(_)), "{error}");
    assert_eq!(registry.pending(), 1);
    setup.gate.add_permits(10);
    // The timed-out write lands after all (the double drops it, so land it by hand: the same
    // bytes the store would have written).
    let line = std::fs::read_to_string(pending_path(&setup.path)).unwrap();
    std::fs::OpenOptions::new()
        .append(true)
        .open(&setup.path)
        .unwrap()
        .write_all(line.as_bytes())
        .unwrap();
    registry.flush_pending().await;
    assert_eq!(setup.revoked_lines(), 1, "no duplicate");
    assert_eq!(registry.pending(), 0);
    assert_eq!(revoked_folded(&registry), 1);
}

/// The file store, naming the thread of every read, and holding reads while `stalled`.
#[derive(Clone)]
struct Watched {
    file: FileStore,
    /// The thread each read was asked on.
    readers: Arc<Mutex<Vec<Option<String>>>>,
    stalled: Arc<AtomicBool>,
    /// Wakes a stalled read to look again.
    unstall: Arc<tokio::sync::Notify>,
}

impl Watched {
    fn new(path: &Path) -> Watched {
        Watched {
            file: FileStore::new(path.to_owned(), false),
            readers: Arc::default(),
            stalled: Arc::default(),
            unstall: Arc::default(),
        }
    }
}

impl Store for Watched {
    fn read_new(&self) -> BoxFuture<'_, io::Result<Batch>> {
        let thread = std::thread::current().name().map(str::to_owned);
        self.readers.lock().unwrap().push(thread);
        Box::pin(async move {
            while self.stalled.load(Ordering::SeqCst) {
                let _ =
                    tokio::time::timeout(Duration::from_millis(20), self.unstall.notified()).await;
            }
            self.file.read_new().await
        })
    }

    fn append(&self, record: &Value) -> BoxFuture<'_, io::Result<Position>> {
        self.file.append(record)
    }

    fn wait_for_more(&self) -> BoxFuture<'_, ()> {
        self.file.wait_for_more()
    }

    fn describe(&self) -> String {
        "watched".into()
    }

    fn stalled_after(&self) -> Duration {
        Duration::from_millis(200)
    }
}

/// While a follower runs, a revocation's record is read back by the follower, on its thread:
/// the revoking caller (a connection worker, the admin API) never holds the read lock while
/// waiting for a blocking pool of its own that may be full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revocation_is_read_back_on_the_followers_thread() {
    let setup = Setup::new();
    let store = Watched::new(&setup.path);
    let readers = store.readers.clone();
    let follower = crate::registry::follower::Follower::start().unwrap();
    let opened = store.clone();
    let keyring = keyring(&setup.key);
    let registry = Arc::new(
        follower
            .run(async move { Registry::open(Box::new(opened), keyring).await })
            .await
            .unwrap()
            .unwrap(),
    );
    let shutdown = CancellationToken::new();
    follower.follow(registry.clone(), shutdown.clone());
    let token = registry.token(&setup.lease, Timestamp::now());
    assert!(registry
        .revoke(&setup.lease, "refused", Map::new())
        .await
        .unwrap());
    assert!(token.is_cancelled());
    assert_eq!(
        revoked_folded(&registry),
        1,
        "read back before revoke returned"
    );
    shutdown.cancel();
    let readers = readers.lock().unwrap().clone();
    assert!(readers.len() >= 2, "{readers:?}");
    assert!(
        readers
            .iter()
            .all(|thread| thread.as_deref() == Some("leasegate-journal")),
        "every read on the follower's thread: {readers:?}"
    );
}

/// A follower whose reads stop completing (a hung disk, a starved thread) is reported by
/// `/readyz` (through `journal_problem`) once it lags beyond the store's bound, and no longer
/// once it reads again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_follower_is_a_journal_problem() {
    let setup = Setup::new();
    let store = Watched::new(&setup.path);
    let (stalled, unstall) = (store.stalled.clone(), store.unstall.clone());
    let registry = Arc::new(
        Registry::open(Box::new(store), keyring(&setup.key))
            .await
            .unwrap(),
    );
    assert_eq!(registry.follow_lag(), None, "no follower yet");
    let shutdown = CancellationToken::new();
    tokio::spawn(registry.clone().follow(shutdown.clone()));
    let following = async {
        while registry.follow_lag().is_none() {
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), following)
        .await
        .unwrap();
    assert_eq!(registry.journal_problem(), None);

    stalled.store(true, Ordering::SeqCst);
    let problem = async {
        loop {
            if let Some(problem) = registry.journal_problem() {
                return problem;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let problem = tokio::time::timeout(Duration::from_secs(10), problem)
        .await
        .expect("a stalled follower is never reported");
    assert!(
        problem.contains("the journal follower has completed no read of the watched"),
        "{problem}"
    );
    assert!(registry.follow_lag().unwrap() > Duration::from_millis(200));

    stalled.store(false, Ordering::SeqCst);
    unstall.notify_waiters();
    let recovered = async {
        while registry.journal_problem().is_some() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), recovered)
        .await
        .expect("still reported once the follower reads again");
    shutdown.cancel();
    let stopped = async {
        while registry.follow_lag().is_some() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), stopped)
        .await
        .expect("a follower that ended is not following");
}

/// A store that hands out the lines given to it at once (no await in a read) and takes no
/// append.
#[derive(Clone, Default)]
struct Handing {
    lines: Arc<Mutex<Vec<Vec<u8>>>>,
    handed: Arc<AtomicU64>,
}

impl Handing {
    fn give(&self, path: &Path) {
        let text = std::fs::read_to_string(path).unwrap();
        let mut lines = self.lines.lock().unwrap();
        lines.extend(text.lines().map(|l| l.as_bytes().to_vec()));
    }
}

impl Store for Handing {
    fn read_new(&self) -> BoxFuture<'_, io::Result<Batch>> {
        let lines = std::mem::take(&mut *self.lines.lock().unwrap());
        let offset = self.handed.fetch_add(lines.len() as u64, Ordering::SeqCst);
        Box::pin(std::future::ready(Ok(Batch {
            restarted: false,
            replaced: false,
            position: Position {
                generation: 1,
                offset: offset + lines.len() as u64,
            },
            lines,
            too_long: 0,
        })))
    }

    fn append(&self, _record: &Value) -> BoxFuture<'_, io::Result<Position>> {
        Box::pin(std::future::ready(Err(io::Error::other("disk full"))))
    }

    fn wait_for_more(&self) -> BoxFuture<'_, ()> {
        Box::pin(tokio::time::sleep(Duration::from_millis(10)))
    }

    fn describe(&self) -> String {
        "handing".into()
    }
}

/// A read dropped once the store has handed its lines out (a catch-up's timeout ends it at any
/// await; with a revocation queued, a read then matches its lines against the queue) has
/// folded them: the store hands nothing out twice, so lines taken and not folded would be lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_dropped_after_the_store_handed_its_lines_out_has_folded_them() {
    let setup = Setup::new();
    let store = Handing::default();
    store.give(&setup.path);
    let registry = Registry::open(Box::new(store.clone()), keyring(&setup.key))
        .await
        .unwrap();
    // A revocation the store refuses: queued, so a read has the queue to match.
    assert!(registry
        .revoke(&setup.lease, "refused", Map::new())
        .await
        .is_err());
    assert_eq!(registry.pending(), 1);
    // Each read polled once, then dropped, until one is dropped while it waits (whether the
    // queue's matching on the blocking pool is done by the first poll is a race).
    for i in 0..50 {
        let other = setup.path.with_file_name(format!("other-{i}.jsonl"));
        let granted = journal_with_lease(&other, &setup.key, Duration::from_secs(600));
        store.give(&other);
        let dropped = match futures_util::FutureExt::now_or_never(registry.refresh()) {
            Some(read) => read.map(|_| false).unwrap(),
            None => registry.refresh().await.map(|_| true).unwrap(),
        };
        assert_eq!(
            registry
                .snapshot()
                .ledger
                .status(&granted, Timestamp::now()),
            Some(Status::Open),
            "the grant a read took is folded (read {i}, dropped: {dropped})"
        );
        if dropped {
            break;
        }
    }
}
