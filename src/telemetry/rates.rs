//! Requests per second over the last [`WINDOW`] seconds, in total and per lease, kept by the
//! server so that the dashboard's first paint draws the rates of the minutes before it opened
//! (a page that only sampled counters itself would show flat lines for a busy proxy).
//!
//! Invariant: bounded — [`WINDOW`] counters for the total and for each of at most
//! [`MAX_LEASES`] leases (only leases the registry knows: a forged id is counted in the total
//! only). A lease idle for a whole window gives its place up; while every place is taken by a
//! lease with traffic in the window, a further lease is counted in the total only.

use crate::fast_hash::FastMap;
use std::sync::Mutex;
use std::time::Instant;

/// Seconds of history, one counter each.
pub const WINDOW: usize = 120;
/// Leases with a history of their own at once.
pub const MAX_LEASES: usize = 2000;

/// One counter per second of the last [`WINDOW`] seconds, in a ring.
#[derive(Debug, Clone)]
struct Series {
    counts: [u32; WINDOW],
    /// The latest second counted into `counts`.
    last: u64,
}

impl Series {
    fn new(second: u64) -> Series {
        Series {
            counts: [0; WINDOW],
            last: second,
        }
    }

    /// Counts one request in `second` (a second just before `last`, from a thread that lost a
    /// race, still counts where it belongs).
    fn add(&mut self, second: u64) {
        if second > self.last {
            let gap = (second - self.last).min(WINDOW as u64);
            for s in self.last + 1..=self.last + gap {
                self.counts[(s % WINDOW as u64) as usize] = 0;
            }
            self.last = second;
        }
        if second + (WINDOW as u64) > self.last {
            let slot = &mut self.counts[(second % WINDOW as u64) as usize];
            *slot = slot.saturating_add(1);
        }
    }

    /// The counts of the [`WINDOW`] seconds that end with `end`, oldest first.
    fn window(&self, end: u64) -> Vec<u32> {
        (0..WINDOW as u64)
            .map(|back| end.checked_sub(WINDOW as u64 - 1 - back))
            .map(|second| match second {
                Some(s) if s <= self.last && s + (WINDOW as u64) > self.last => {
                    self.counts[(s % WINDOW as u64) as usize]
                }
                _ => 0,
            })
            .collect()
    }

    /// Nothing counted in the window that ends with `now`.
    fn is_idle(&self, now: u64) -> bool {
        self.last + (WINDOW as u64) <= now
    }
}

#[derive(Debug)]
struct Inner {
    total: Series,
    leases: FastMap<String, Series>,
    /// When idle leases were last looked for (at most once a second when every place is taken).
    swept: u64,
}

/// The request counts of the last [`WINDOW`] seconds.
#[derive(Debug)]
pub struct Rates {
    start: Instant,
    inner: Mutex<Inner>,
}

impl Default for Rates {
    fn default() -> Rates {
        Rates {
            start: Instant::now(),
            inner: Mutex::new(Inner {
                total: Series::new(0),
                leases: FastMap::default(),
                swept: 0,
            }),
        }
    }
}

/// What [`Rates::history`] answers: per-second counts, oldest first, of the last [`WINDOW`]
/// whole seconds (the second under way is not in it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct History {
    pub total: Vec<u32>,
    /// One per lease asked for, in the order asked (zeros for one without requests).
    pub leases: Vec<(String, Vec<u32>)>,
}

impl Rates {
    fn second(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.start).as_secs()
    }

    /// Counts one request now, for `lease` if the registry knows it.
    pub fn record(&self, lease: Option<&str>) {
        self.record_at(lease, Instant::now());
    }

    fn record_at(&self, lease: Option<&str>, at: Instant) {
        let second = self.second(at);
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.total.add(second);
        let Some(lease) = lease else { return };
        if let Some(series) = inner.leases.get_mut(lease) {
            series.add(second);
            return;
        }
        if inner.leases.len() >= MAX_LEASES && inner.swept < second {
            inner.swept = second;
            inner.leases.retain(|_, s| !s.is_idle(second));
        }
        if inner.leases.len() < MAX_LEASES {
            let mut series = Series::new(second);
            series.add(second);
            inner.leases.insert(lease.to_owned(), series);
        }
    }

    /// The last [`WINDOW`] whole seconds before now, in total and for each of `leases`.
    pub fn history(&self, leases: &[&str]) -> History {
        self.history_at(leases, Instant::now())
    }

    fn history_at(&self, leases: &[&str], at: Instant) -> History {
        // The second under way is still counting: the window ends with the one before it.
        let end = self.second(at).saturating_sub(1);
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        History {
            total: inner.total.window(end),
            leases: leases
                .iter()
                .map(|id| {
                    let counts = match inner.leases.get(*id) {
                        Some(series) => series.window(end),
                        None => vec![0; WINDOW],
                    };
                    ((*id).to_owned(), counts)
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(rates: &Rates, seconds: u64) -> Instant {
        rates.start + Duration::from_millis(seconds * 1000 + 500)
    }

    #[test]
    fn counts_land_in_their_second_and_the_window_ends_before_the_current_one() {
        let rates = Rates::default();
        for _ in 0..3 {
            rates.record_at(Some("a"), at(&rates, 5));
        }
        rates.record_at(None, at(&rates, 6));
        rates.record_at(Some("a"), at(&rates, 7));
        let history = rates.history_at(&["a", "b"], at(&rates, 7));
        // Ends with second 6: second 7 is under way.
        assert_eq!(history.total.len(), WINDOW);
        assert_eq!(&history.total[WINDOW - 2..], &[3, 1]);
        assert_eq!(&history.leases[0].1[WINDOW - 2..], &[3, 0]);
        assert_eq!(history.leases[1], ("b".to_owned(), vec![0; WINDOW]));
        let later = rates.history_at(&["a"], at(&rates, 8));
        assert_eq!(&later.leases[0].1[WINDOW - 3..], &[3, 0, 1]);
    }

    #[test]
    fn seconds_older_than_the_window_are_forgotten_and_a_late_count_still_lands() {
        let rates = Rates::default();
        rates.record_at(Some("a"), at(&rates, 1));
        rates.record_at(Some("a"), at(&rates, 1 + WINDOW as u64));
        rates.record_at(Some("a"), at(&rates, WINDOW as u64));
        let history = rates.history_at(&["a"], at(&rates, 2 + WINDOW as u64));
        let counts = &history.leases[0].1;
        assert_eq!(counts.iter().sum::<u32>(), 2, "{counts:?}");
        assert_eq!(&counts[WINDOW - 2..], &[1, 1]);
        let idle = rates.history_at(&["a"], at(&rates, 10 * WINDOW as u64));
        assert_eq!(idle.leases[0].1, vec![0; WINDOW]);
        assert_eq!(idle.total, vec![0; WINDOW]);
    }

    #[test]
    fn a_full_table_takes_a_new_lease_only_in_place_of_an_idle_one() {
        let rates = Rates::default();
        for i in 0..MAX_LEASES {
            rates.record_at(Some(&format!("l{i}")), at(&rates, 1));
        }
        rates.record_at(Some("late"), at(&rates, 2));
        let history = rates.history_at(&["late"], at(&rates, 3));
        assert_eq!(history.leases[0].1.iter().sum::<u32>(), 0);
        assert_eq!(history.total.iter().sum::<u32>(), MAX_LEASES as u32 + 1);
        // A window later every old lease is idle: the new one gets a place.
        let later = 2 + WINDOW as u64;
        rates.record_at(Some("late"), at(&rates, later));
        let history = rates.history_at(&["late"], at(&rates, later + 1));
        assert_eq!(history.leases[0].1[WINDOW - 1], 1);
        assert_eq!(rates.inner.lock().unwrap().leases.len(), 1);
    }
}
