//! The admission gate after a pause: a process that was not running (stopped, its VM paused,
//! starved), or that had no contact with its store for longer than the store's
//! `stalled_after`, missed what the journal took meanwhile, so it catches up with the store
//! before it admits anything new.
//!
//! Invariants:
//! - A pause is read off the monotonic clock, not off a timer having fired: a heartbeat on the
//!   follower's thread writes the time every [`BEAT_EVERY`]; an admission that finds the last
//!   beat older than [`PAUSED_AFTER`], or a beat that finds the one before it that old, begins
//!   a catch-up. A request read the instant the process resumes is gated even though no
//!   timer has run yet.
//! - A gap in contact is read off the store's last answer: a beat that finds it older than
//!   the store's `stalled_after` closes the gate's fast path; while the store stays silent an
//!   admission goes on at once with the last folded state (the store's own problem is on
//!   `/readyz`); an admission or a beat that finds a newer answer begins the wait, so no
//!   request read after contact is back is decided before the fold has caught up.
//! - While nothing is wrong an admission costs two atomic loads (the request's start instant
//!   is already taken).
//! - Bounded: an admission waits for the catch-up at most its limit after the catch-up began
//!   (after contact came back, for a gap; `--store-stale-after` for a stream), then goes on
//!   with the last folded state; `/readyz` names the catch-up and its cause until it ends, and
//!   the log says when admissions stopped waiting.
//! - Disarmed (no follower runs: the commands, tests of the registry alone), nothing waits.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::sync::{watch, Notify};

/// How often the heartbeat writes the time.
pub const BEAT_EVERY: Duration = Duration::from_millis(100);

/// A beat this old means the process (or its follower's thread) was not running.
pub const PAUSED_AFTER: Duration = Duration::from_secs(1);

/// The gate; one per registry.
pub struct Pause {
    /// What the beats are counted from.
    base: Instant,
    /// Milliseconds after `base` of the last beat, plus one; 0: disarmed.
    beat: AtomicU64,
    /// A catch-up has begun and not ended (the fast path reads this).
    catching_up: AtomicBool,
    /// The same, for admissions to wait on.
    waiting: watch::Sender<bool>,
    /// When the current catch-up began and why.
    episode: Mutex<Option<Episode>>,
    /// Wakes the catch-up task.
    begun: Notify,
}

#[derive(Debug, Clone, Copy)]
struct Episode {
    /// When admissions began to wait for it (`None`: not yet, the store is silent and no
    /// pause came first).
    since: Option<Instant>,
    cause: Cause,
    /// Admissions stopped waiting for it (said once in the log).
    overdue: bool,
}

/// Why a catch-up is needed.
#[derive(Debug, Clone, Copy)]
enum Cause {
    /// The process was not running for this long.
    Paused(Duration),
    /// The store's last answer before a gap in contact, and the first one after it.
    Contact {
        lost: Instant,
        back: Option<Instant>,
    },
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Cause::Paused(paused) => write!(f, "a pause of {:.1} s", paused.as_secs_f64()),
            Cause::Contact {
                lost,
                back: Some(back),
            } => write!(
                f,
                "contact with the journal was lost for {:.1} s",
                back.saturating_duration_since(lost).as_secs_f64()
            ),
            Cause::Contact { lost, back: None } => write!(
                f,
                "no contact with the journal for {:.1} s",
                lost.elapsed().as_secs_f64()
            ),
        }
    }
}

impl Default for Pause {
    fn default() -> Self {
        Pause {
            base: Instant::now(),
            beat: AtomicU64::new(0),
            catching_up: AtomicBool::new(false),
            waiting: watch::channel(false).0,
            episode: Mutex::new(None),
            begun: Notify::new(),
        }
    }
}

impl Pause {
    fn millis(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.base).as_millis() as u64 + 1
    }

    fn episode(&self) -> std::sync::MutexGuard<'_, Option<Episode>> {
        self.episode.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A follower runs from now: beats are expected.
    pub fn arm(&self) {
        self.beat
            .store(self.millis(Instant::now()), Ordering::Release);
    }

    /// No follower runs any more: nothing waits.
    pub fn disarm(&self) {
        self.beat.store(0, Ordering::Release);
        self.end();
    }

    /// How long before `at` the last beat was; `None` when disarmed.
    fn silent(&self, at: Instant) -> Option<Duration> {
        match self.beat.load(Ordering::Acquire) {
            0 => None,
            beat => Some(Duration::from_millis(self.millis(at).saturating_sub(beat))),
        }
    }

    /// The heartbeat: notices a pause since the last beat, then writes the time (after the
    /// catch-up has begun, so an admission that reads this beat also sees the catch-up); then
    /// notices a gap in contact: `contact`, the store's last answer (`None`: a store always at
    /// hand), older than `stale_after`, or a first answer after one.
    pub fn beat(&self, contact: Option<Instant>, stale_after: Duration) {
        let now = Instant::now();
        if let Some(silent) = self.silent(now).filter(|s| *s > PAUSED_AFTER) {
            self.begin(silent);
        }
        self.beat.store(self.millis(now), Ordering::Release);
        self.contact(contact, stale_after, now);
    }

    /// Follows the store's contact (see [`Pause::beat`]): a gap closes the fast path, the
    /// first answer after it starts the wait for the catch-up.
    fn contact(&self, contact: Option<Instant>, stale_after: Duration, now: Instant) {
        let Some(contact) = contact else { return };
        let mut episode = self.episode();
        let gap = now.saturating_duration_since(contact) > stale_after;
        match episode.as_mut() {
            // A catch-up after a pause cannot end while the store is silent either: it waits
            // for the answer after the gap, and its bound counts from there.
            Some(Episode { cause, .. }) if gap && matches!(cause, Cause::Paused(_)) => {
                *cause = Cause::Contact {
                    lost: contact,
                    back: None,
                };
                return;
            }
            None if gap => {
                *episode = Some(Episode {
                    since: None,
                    cause: Cause::Contact {
                        lost: contact,
                        back: None,
                    },
                    overdue: false,
                });
                self.catching_up.store(true, Ordering::Release);
                self.waiting.send_replace(true);
            }
            Some(Episode {
                since,
                cause: Cause::Contact { lost, back },
                overdue,
            }) if back.is_none() && contact > *lost => {
                *back = Some(contact);
                *since = Some(now);
                *overdue = false;
                let cause = Cause::Contact {
                    lost: *lost,
                    back: *back,
                };
                tracing::warn!(
                    "{cause}: catching up with the journal before admitting new connections"
                );
            }
            _ => return,
        }
        drop(episode);
        self.begun.notify_one();
    }

    /// Whether a request that started at `at` may be admitted without waiting: the hot path.
    pub fn is_open(&self, at: Instant) -> bool {
        let beat = self.beat.load(Ordering::Acquire);
        beat == 0
            || (self.millis(at).saturating_sub(beat) <= PAUSED_AFTER.as_millis() as u64
                && !self.catching_up.load(Ordering::Acquire))
    }

    /// Begins a catch-up (unless one runs) after the process did not run for `paused`.
    fn begin(&self, paused: Duration) {
        let mut episode = self.episode();
        if episode.is_none() {
            tracing::warn!(paused = ?paused, "the process was not running: catching up with the journal before admitting new connections");
            *episode = Some(Episode {
                since: Some(Instant::now()),
                cause: Cause::Paused(paused),
                overdue: false,
            });
            self.catching_up.store(true, Ordering::Release);
            self.waiting.send_replace(true);
        }
        drop(episode);
        self.begun.notify_one();
    }

    /// Whether a catch-up has begun and not ended.
    pub fn is_catching_up(&self) -> bool {
        self.catching_up.load(Ordering::Acquire)
    }

    /// Resolves when a catch-up may have begun.
    pub async fn begun(&self) {
        self.begun.notified().await
    }

    /// The catch-up reached what the store held: admissions go on.
    pub fn end(&self) {
        if let Some(episode) = self.episode().take() {
            let took = episode
                .since
                .map(|since| since.elapsed())
                .unwrap_or_default();
            tracing::info!(took = ?took, "caught up with the journal after {}", episode.cause);
        }
        self.catching_up.store(false, Ordering::Release);
        self.waiting.send_replace(false);
    }

    /// Lets a request that started at `at` through once the catch-up it needs has ended, or
    /// `limit` after that catch-up began (then on the last folded state, said once). `contact`:
    /// the store's last answer, as for [`Pause::beat`]; while the store stays silent after a
    /// gap, at once on the last folded state.
    pub async fn admit(&self, at: Instant, limit: Duration, contact: Option<Instant>) {
        if self.is_open(at) {
            return;
        }
        if let Some(silent) = self.silent(at).filter(|s| *s > PAUSED_AFTER) {
            self.begin(silent);
        }
        self.contact(contact, limit, Instant::now());
        let Some(since) = self.episode().and_then(|e| e.since) else {
            return;
        };
        let mut waiting = self.waiting.subscribe();
        let deadline = tokio::time::Instant::from_std(since + limit);
        if tokio::time::timeout_at(deadline, waiting.wait_for(|w| !*w))
            .await
            .is_err()
        {
            let mut episode = self.episode();
            if let Some(episode) = episode.as_mut().filter(|e| !e.overdue) {
                episode.overdue = true;
                tracing::warn!(limit = ?limit, "not caught up with the journal within the limit after {}: admitting on the last known lease state", episode.cause);
            }
        }
    }

    /// Why `/readyz` says not ready, or `None`.
    pub fn problem(&self, limit: Duration) -> Option<String> {
        if let Some(Episode { since, cause, .. }) = *self.episode() {
            let Some(since) = since else {
                return Some(format!("{cause}: new connections are admitted on the last known lease state until it is back, then wait for the catch-up"));
            };
            let took = since.elapsed().as_secs_f64();
            return Some(if took > limit.as_secs_f64() {
                format!("not caught up with the journal {took:.1} s after {cause} (limit {limit:?}): new connections are admitted on the last known lease state")
            } else {
                format!("catching up with the journal after {cause}: new connections wait for it (at most {limit:?})")
            });
        }
        let silent = self.silent(Instant::now())?;
        (silent > PAUSED_AFTER).then(|| {
            format!(
                "the journal follower's heartbeat is {:.1} s old: catching up with the journal before admitting new connections",
                silent.as_secs_f64()
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = false)]
    async fn a_stale_beat_gates_admissions_until_the_catch_up_ends() {
        let pause = Pause::default();
        assert!(pause.is_open(Instant::now()), "disarmed: open");
        pause.arm();
        assert!(pause.is_open(Instant::now()));
        let later = Instant::now() + PAUSED_AFTER + Duration::from_millis(500);
        assert!(
            !pause.is_open(later),
            "a beat older than PAUSED_AFTER gates"
        );
        let waited = tokio::time::timeout(
            Duration::from_millis(200),
            pause.admit(later, Duration::from_secs(30), None),
        )
        .await;
        assert!(waited.is_err(), "the admission waited for the catch-up");
        assert!(pause.is_catching_up());
        assert!(pause
            .problem(Duration::from_secs(30))
            .unwrap()
            .contains("catching up"));
        pause.beat(None, Duration::from_secs(30));
        assert!(
            !pause.is_open(Instant::now()),
            "a fresh beat does not end it"
        );
        pause.end();
        assert!(pause.is_open(Instant::now()));
        assert_eq!(pause.problem(Duration::from_secs(30)), None);
    }

    #[tokio::test]
    async fn past_its_limit_an_admission_goes_on_and_readiness_says_so() {
        let pause = Pause::default();
        pause.arm();
        let later = Instant::now() + PAUSED_AFTER * 2;
        let limit = Duration::from_millis(50);
        tokio::time::timeout(Duration::from_secs(5), pause.admit(later, limit, None))
            .await
            .expect("bounded by its limit");
        tokio::time::sleep(limit * 2).await;
        assert!(pause
            .problem(limit)
            .unwrap()
            .contains("admitted on the last known"));
    }

    #[tokio::test]
    async fn contact_back_after_a_gap_gates_admissions_until_the_catch_up_ends() {
        let pause = Pause::default();
        pause.arm();
        let stale_after = Duration::from_millis(100);
        let lost = Instant::now();
        pause.beat(Some(lost), stale_after);
        assert!(pause.is_open(Instant::now()), "in contact: open");
        tokio::time::sleep(stale_after * 2).await;
        pause.beat(Some(lost), stale_after);
        assert!(!pause.is_open(Instant::now()), "a gap closes the fast path");
        tokio::time::timeout(
            Duration::from_secs(5),
            pause.admit(Instant::now(), Duration::from_secs(30), Some(lost)),
        )
        .await
        .expect("while the store is silent, admitted at once on the last state");
        assert!(pause
            .problem(Duration::from_secs(30))
            .unwrap()
            .contains("no contact with the journal"));

        // The store answers again: an admission waits for the catch-up, whoever saw it first.
        let back = Instant::now();
        let waited = tokio::time::timeout(
            Duration::from_millis(200),
            pause.admit(Instant::now(), Duration::from_secs(30), Some(back)),
        )
        .await;
        assert!(waited.is_err(), "the admission waited for the catch-up");
        let problem = pause.problem(Duration::from_secs(30)).unwrap();
        assert!(
            problem.contains(
                "catching up with the journal after contact with the journal was lost for"
            ),
            "{problem}"
        );
        pause.beat(Some(back), stale_after);
        assert!(
            !pause.is_open(Instant::now()),
            "a fresh answer does not end it"
        );
        pause.end();
        assert!(pause.is_open(Instant::now()));
        assert_eq!(pause.problem(Duration::from_secs(30)), None);
    }

    #[tokio::test]
    async fn a_pause_overdue_while_the_store_is_silent_waits_again_once_contact_is_back() {
        let pause = Pause::default();
        pause.arm();
        let lost = Instant::now();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let later = Instant::now() + PAUSED_AFTER * 2;
        let limit = Duration::from_millis(50);
        tokio::time::timeout(
            Duration::from_secs(5),
            pause.admit(later, limit, Some(lost)),
        )
        .await
        .expect("bounded by its limit");
        tokio::time::sleep(limit * 2).await;
        tokio::time::timeout(
            Duration::from_secs(5),
            pause.admit(Instant::now(), limit, Some(lost)),
        )
        .await
        .expect("overdue while the store is silent: at once");
        let waited = tokio::time::timeout(
            Duration::from_millis(200),
            pause.admit(
                Instant::now(),
                Duration::from_secs(30),
                Some(Instant::now()),
            ),
        )
        .await;
        assert!(waited.is_err(), "contact back: the admission waits again");
    }
}
