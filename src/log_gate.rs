//! Keeps a repeating condition (a lease without a port, a skipped journal line, a failing
//! store) from flooding the log: it is said once when it starts, then at most one summary with
//! a count per interval, and once when it ends.
//!
//! Invariant: during an episode, at most one line per interval follows the first, and every
//! occurrence is counted in exactly one line (the first, a summary or the end). The gate only
//! decides and counts — the caller writes the words, with its own fields and level — and it
//! owns no task and reads no clock: callers pass `now`, so a summary falls due on the next
//! occurrence or [`Flood::due`] call after the interval, and tests drive time.

use std::time::{Duration, Instant};

/// How often an ongoing condition is summarised, at most.
pub const SUMMARY_EVERY: Duration = Duration::from_secs(60);

/// One repeating condition: idle, or an episode in progress.
#[derive(Debug)]
pub struct Flood {
    /// The least time between two lines of one episode.
    every: Duration,
    episode: Option<Episode>,
}

#[derive(Debug, Clone, Copy)]
struct Episode {
    started: Instant,
    /// When the last line (the first or a summary) was said.
    said_at: Instant,
    /// When the condition last occurred (for [`Flood::end_if_quiet`]).
    seen_at: Instant,
    total: u64,
    /// Occurrences since the last line.
    unsaid: u64,
}

/// What the caller logs now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Say {
    /// The condition started: say it in full (the line covers this call's occurrences).
    Start,
    /// It goes on: say the count.
    Summary(Summary),
    /// Nothing: counted for the next summary.
    Quiet,
}

/// The count of an ongoing episode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Summary {
    /// Occurrences since the previous line.
    pub repeats: u64,
    /// Occurrences since the episode started.
    pub total: u64,
    /// Time since the episode started.
    pub lasted: Duration,
}

impl Default for Flood {
    fn default() -> Flood {
        Flood::every(SUMMARY_EVERY)
    }
}

impl Flood {
    /// A gate whose summaries come at most once per `every`.
    pub fn every(every: Duration) -> Flood {
        Flood {
            every,
            episode: None,
        }
    }

    pub fn is_active(&self) -> bool {
        self.episode.is_some()
    }

    /// The condition occurred `n` times (a batch counts as one line).
    pub fn occurred(&mut self, n: u64, now: Instant) -> Say {
        let Some(episode) = &mut self.episode else {
            self.episode = Some(Episode {
                started: now,
                said_at: now,
                seen_at: now,
                total: n,
                unsaid: 0,
            });
            return Say::Start;
        };
        episode.total += n;
        episode.unsaid += n;
        episode.seen_at = now;
        self.due(now).map_or(Say::Quiet, Say::Summary)
    }

    /// A summary, if occurrences wait to be said and the interval has passed since the last
    /// line. For callers that run periodically anyway, so that a count is said even when the
    /// occurrences stop without the condition ending.
    pub fn due(&mut self, now: Instant) -> Option<Summary> {
        let episode = self.episode.as_mut()?;
        if episode.unsaid == 0 || now.saturating_duration_since(episode.said_at) < self.every {
            return None;
        }
        let summary = Summary {
            repeats: episode.unsaid,
            total: episode.total,
            lasted: now.saturating_duration_since(episode.started),
        };
        episode.said_at = now;
        episode.unsaid = 0;
        Some(summary)
    }

    /// The condition ended: the episode's count if one was in progress (say it), else `None`.
    pub fn end(&mut self, now: Instant) -> Option<Summary> {
        let episode = self.episode.take()?;
        Some(Summary {
            repeats: episode.unsaid,
            total: episode.total,
            lasted: now.saturating_duration_since(episode.started),
        })
    }

    /// Ends the episode if the condition has not occurred for an interval: for conditions with
    /// no event of their own that says they are over (skipped lines stop arriving).
    pub fn end_if_quiet(&mut self, now: Instant) -> Option<Summary> {
        let seen_at = self.episode.as_ref()?.seen_at;
        match now.saturating_duration_since(seen_at) >= self.every {
            true => self.end(now),
            false => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Flood, Say, Summary};
    use std::time::{Duration, Instant};

    const MINUTE: Duration = Duration::from_secs(60);

    #[test]
    fn ten_thousand_repeats_make_a_start_one_summary_a_minute_and_an_end() {
        let t0 = Instant::now();
        let mut flood = Flood::every(MINUTE);
        let mut said = Vec::new();
        // 10,000 occurrences over 150 s, one every 15 ms.
        for i in 0..10_000u64 {
            let now = t0 + Duration::from_millis(15 * i);
            match flood.occurred(1, now) {
                Say::Quiet => {}
                say => said.push((now - t0, say)),
            }
        }
        assert_eq!(said.len(), 3, "{said:?}");
        assert_eq!(said[0], (Duration::ZERO, Say::Start));
        // The first summary at the first occurrence a minute after the start.
        assert_eq!(
            said[1],
            (
                MINUTE,
                Say::Summary(Summary {
                    repeats: 4000,
                    total: 4001,
                    lasted: MINUTE
                })
            )
        );
        assert_eq!(
            said[2].1,
            Say::Summary(Summary {
                repeats: 4000,
                total: 8001,
                lasted: 2 * MINUTE
            })
        );
        // Nothing due before the interval; the end carries the rest and the total.
        let last = t0 + Duration::from_millis(15 * 9_999);
        assert_eq!(flood.due(last), None);
        let end = flood.end(last).unwrap();
        assert_eq!((end.repeats, end.total), (1999, 10_000));
        assert!(!flood.is_active());
        assert_eq!(flood.end(last), None, "an end is said once");
        // The next occurrence starts a new episode.
        assert_eq!(flood.occurred(1, last), Say::Start);
    }

    #[test]
    fn a_summary_falls_due_without_a_new_occurrence_and_only_with_a_count() {
        let t0 = Instant::now();
        let mut flood = Flood::every(MINUTE);
        assert_eq!(flood.due(t0), None, "idle");
        assert_eq!(flood.occurred(3, t0), Say::Start);
        assert_eq!(flood.due(t0 + 2 * MINUTE), None, "the start said all three");
        assert_eq!(flood.occurred(2, t0 + Duration::from_secs(1)), Say::Quiet);
        assert_eq!(flood.due(t0 + Duration::from_secs(59)), None);
        let summary = flood.due(t0 + MINUTE).unwrap();
        assert_eq!((summary.repeats, summary.total), (2, 5));
        assert_eq!(flood.due(t0 + 3 * MINUTE), None, "nothing new to say");
    }

    #[test]
    fn a_quiet_interval_ends_an_episode() {
        let t0 = Instant::now();
        let mut flood = Flood::every(MINUTE);
        assert_eq!(flood.end_if_quiet(t0), None, "idle");
        flood.occurred(1, t0);
        flood.occurred(1, t0 + Duration::from_secs(30));
        assert_eq!(flood.end_if_quiet(t0 + Duration::from_secs(89)), None);
        let end = flood.end_if_quiet(t0 + Duration::from_secs(90)).unwrap();
        assert_eq!((end.repeats, end.total), (1, 2));
        assert_eq!(end.lasted, Duration::from_secs(90));
    }
}
