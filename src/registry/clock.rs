//! The proxy's clock: the wall clock, never read as earlier than a time it already gave.
//!
//! Invariant: [`Clock::now`] never returns less than an earlier `now` of the same clock, nor
//! than the floor it was opened with (the latest time an earlier run wrote down, at most
//! [`KEEP_EVERY`] behind the last it used), so a lease seen expired stays expired when the
//! wall clock steps back — an NTP step, a VM resumed from a snapshot, an operator's mistake —
//! across restarts too. While the wall clock is more than [`STEP_TOLERANCE`] behind, time
//! stands still at the latest reading (it never runs backwards); the step is logged once per
//! episode with its size, counted, and shown on `/readyz` and `/metrics` until the wall
//! clock catches up. Egress log lines keep the wall clock's own reading.

use crate::contract::Timestamp;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A wall clock behind the latest time by more than this has stepped back (less is two
/// readers racing, or the kernel's own jitter).
pub const STEP_TOLERANCE: Duration = Duration::from_secs(1);

/// How often the latest time is written down (and at shutdown).
pub const KEEP_EVERY: Duration = Duration::from_secs(1);

/// The wall clock — or, for tests, the wall clock shifted by an amount they set. Clones share
/// the shift.
#[derive(Debug, Clone, Default)]
pub struct WallClock {
    /// Milliseconds added to the system clock's reading; `None`: the system clock as it is.
    shift: Option<Arc<AtomicI64>>,
}

impl WallClock {
    /// The system clock.
    pub fn system() -> WallClock {
        WallClock::default()
    }

    /// The system clock, shifted by what [`WallClock::step`] sets (tests).
    pub fn adjustable() -> WallClock {
        WallClock {
            shift: Some(Arc::default()),
        }
    }

    /// Steps an adjustable clock by `by_ms` (negative: back); a system clock is not moved.
    pub fn step(&self, by_ms: i64) {
        if let Some(shift) = &self.shift {
            shift.fetch_add(by_ms, Ordering::SeqCst);
        }
    }

    fn read(&self) -> i64 {
        let now = Timestamp::now().as_millis();
        match &self.shift {
            Some(shift) => now.saturating_add(shift.load(Ordering::Relaxed)),
            None => now,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClockError {
    #[error(
        "the proxy's clock {path}: {reason} (it holds the latest time an earlier run used; \
         remove it only if this host's clock is right)"
    )]
    Unreadable { path: String, reason: String },
}

/// What `/readyz` and the metrics show of the clock.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClockHealth {
    /// How far the wall clock is behind the time in use while a step back lasts (else zero).
    pub behind: Duration,
    /// Steps back seen since start.
    pub steps_back: u64,
    /// Why the latest time could not be written down, while it cannot.
    pub not_kept: Option<String>,
}

/// The clock lifetime checks read. Shared by everything that decides.
#[derive(Debug)]
pub struct Clock {
    wall: WallClock,
    /// The latest time handed out, in ms since the epoch (never decreases).
    latest: AtomicI64,
    /// How far the wall clock was behind `latest` at its last reading, in ms, while a step
    /// back lasts; 0 otherwise (also the episode's flag: non-zero from its first reading).
    behind: AtomicI64,
    /// Step-back episodes since start.
    steps_back: AtomicU64,
    /// Where the latest time is written down; `None`: nowhere (`check`, tests).
    file: Option<PathBuf>,
    /// Why the last write failed (`None` once one succeeds).
    not_kept: Mutex<Option<String>>,
}

impl Clock {
    /// The wall clock, with no floor and nothing written down.
    pub fn unkept(wall: WallClock) -> Clock {
        Clock {
            wall,
            latest: AtomicI64::new(i64::MIN),
            behind: AtomicI64::new(0),
            steps_back: AtomicU64::new(0),
            file: None,
            not_kept: Mutex::new(None),
        }
    }

    /// The clock kept in `path`: its floor is the time written there (a missing file: none),
    /// and the latest time is written back now and by [`Clock::keep`]. An unreadable file is
    /// an error — the floor cannot be known — while a failed write is only reported (the
    /// floor is then as old as the last write that worked). Blocking.
    pub fn open(path: &Path, wall: WallClock) -> Result<Clock, ClockError> {
        let unreadable = |reason: String| ClockError::Unreadable {
            path: path.display().to_string(),
            reason,
        };
        let floor = match std::fs::read_to_string(path) {
            Ok(text) => Some(Timestamp::parse(text.trim()).map_err(|e| unreadable(e.to_string()))?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(unreadable(e.to_string())),
        };
        let clock = Clock {
            file: Some(path.to_owned()),
            ..Clock::unkept(wall)
        };
        if let Some(floor) = floor {
            clock.latest.store(floor.as_millis(), Ordering::SeqCst);
        }
        clock.keep();
        Ok(clock)
    }

    /// The time lifetime checks use: the wall clock, or the latest time already handed out if
    /// that is later.
    pub fn now(&self) -> Timestamp {
        let wall = self.wall.read();
        let latest = self.latest.load(Ordering::Relaxed);
        if wall > latest {
            let before = self.latest.fetch_max(wall, Ordering::Relaxed);
            if self.behind.load(Ordering::Relaxed) != 0 {
                self.caught_up();
            }
            return Timestamp::from_millis(before.max(wall));
        }
        let behind = latest - wall;
        if behind > STEP_TOLERANCE.as_millis() as i64 {
            self.stepped_back(behind);
        } else if behind > 0 && self.behind.load(Ordering::Relaxed) != 0 {
            self.behind.store(behind, Ordering::Relaxed);
        }
        Timestamp::from_millis(latest)
    }

    fn stepped_back(&self, behind: i64) {
        if self.behind.swap(behind, Ordering::Relaxed) == 0 {
            self.steps_back.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                behind = %humantime::format_duration(Duration::from_millis(behind as u64)),
                latest = %Timestamp::from_millis(self.latest.load(Ordering::Relaxed)),
                "the wall clock stepped back: lifetime checks keep the latest time already used \
                 until it catches up (no expired lease opens again)"
            );
        }
    }

    fn caught_up(&self) {
        if self.behind.swap(0, Ordering::Relaxed) != 0 {
            tracing::warn!("the wall clock caught up with the latest time used");
        }
    }

    /// Writes the latest time down (blocking: a write, an fsync, a rename). A failure is
    /// logged when it starts and when writes work again, and shown by [`Clock::health`].
    pub fn keep(&self) {
        let Some(path) = &self.file else {
            return;
        };
        let latest = self.now();
        let line = latest.to_string();
        let written = crate::durable::rewrite(path, [line.as_bytes()]);
        let mut not_kept = self.not_kept.lock().unwrap_or_else(|e| e.into_inner());
        match (written, not_kept.is_some()) {
            (Ok(()), false) => {}
            (Ok(()), true) => {
                tracing::warn!(path = %path.display(), "the proxy's clock is written down again");
                *not_kept = None;
            }
            (Err(error), was_failing) => {
                if !was_failing {
                    tracing::error!(%error, path = %path.display(), "the proxy's clock cannot be written down: after a restart with the wall clock stepped back, leases that expired since the last write could open again");
                }
                *not_kept = Some(error.to_string());
            }
        }
    }

    /// Whether the clock has stepped back, and whether its time is written down.
    pub fn health(&self) -> ClockHealth {
        // A reading first, so a step back shows even when nothing has read the clock since.
        self.now();
        ClockHealth {
            behind: Duration::from_millis(self.behind.load(Ordering::Relaxed).max(0) as u64),
            steps_back: self.steps_back.load(Ordering::Relaxed),
            not_kept: self
                .not_kept
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        }
    }
}

impl Default for Clock {
    fn default() -> Clock {
        Clock::unkept(WallClock::system())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: i64 = 3_600_000;

    #[test]
    fn time_never_runs_backwards_and_a_step_is_one_episode() {
        let wall = WallClock::adjustable();
        let clock = Clock::unkept(wall.clone());
        let before = clock.now();
        wall.step(-HOUR);
        let during = clock.now();
        assert!(during >= before);
        let health = clock.health();
        assert_eq!(health.steps_back, 1);
        assert!(health.behind >= Duration::from_secs(3599), "{health:?}");
        // Still behind: the same episode.
        wall.step(HOUR / 2);
        assert!(clock.now() >= during);
        assert_eq!(clock.health().steps_back, 1);
        // Caught up (and past): the wall clock again, the episode over.
        wall.step(HOUR);
        let after = clock.now();
        assert!(after.as_millis() >= during.as_millis() + HOUR / 2 - 1_000);
        assert_eq!(clock.health().behind, Duration::ZERO);
        wall.step(-HOUR);
        clock.now();
        assert_eq!(clock.health().steps_back, 2);
    }

    #[test]
    fn a_step_within_the_tolerance_is_not_one() {
        let wall = WallClock::adjustable();
        let clock = Clock::unkept(wall.clone());
        let before = clock.now();
        wall.step(-500);
        assert!(clock.now() >= before);
        assert_eq!(clock.health(), ClockHealth::default());
    }

    #[test]
    fn the_floor_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.jsonl.clock");
        let wall = WallClock::adjustable();
        let first = Clock::open(&path, wall.clone()).unwrap();
        let used = first.now();
        first.keep();
        drop(first);
        wall.step(-HOUR);
        let second = Clock::open(&path, wall.clone()).unwrap();
        assert!(second.now() >= used);
        assert_eq!(second.health().steps_back, 1);
        assert_eq!(
            std::fs::read_to_string(&path).unwrap().trim(),
            second.now().to_string()
        );
    }

    #[test]
    fn an_unreadable_floor_is_an_error_a_missing_one_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("clock");
        std::fs::write(&path, "yesterday\n").unwrap();
        let error = Clock::open(&path, WallClock::system()).unwrap_err();
        assert!(error.to_string().contains("remove it only if"), "{error}");
        std::fs::remove_file(&path).unwrap();
        Clock::open(&path, WallClock::system()).unwrap();
        assert!(path.exists(), "written at open");
    }

    #[test]
    fn a_write_that_fails_is_reported_until_one_works() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub").join("clock");
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        let clock = Clock::open(&path, WallClock::system()).unwrap();
        std::fs::remove_dir_all(dir.path().join("sub")).unwrap();
        clock.keep();
        assert!(clock.health().not_kept.is_some());
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        clock.keep();
        assert_eq!(clock.health().not_kept, None);
    }
}
