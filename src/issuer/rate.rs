//! How fast each caller may issue: a token bucket per caller (the operator, each lease).
//!
//! Invariant: a caller over its rate is refused before anything is decided or written, and
//! the buckets kept are bounded: beyond [`MAX_CALLERS`], those that have refilled are dropped.

use governor::{DefaultKeyedRateLimiter, Quota};
use std::num::NonZeroU32;
use std::time::Duration;

/// Callers with a bucket at once before the full ones are dropped.
const MAX_CALLERS: usize = 10_000;

/// The per-caller issuance rate (`--max-issue-rate`).
pub struct IssueRate {
    limiter: DefaultKeyedRateLimiter<String>,
    per_second: NonZeroU32,
}

impl std::fmt::Debug for IssueRate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IssueRate")
            .field("per_second", &self.per_second)
            .finish()
    }
}

impl IssueRate {
    /// `per_second` issuances per caller, in bursts of as many.
    pub fn new(per_second: NonZeroU32) -> IssueRate {
        IssueRate {
            limiter: DefaultKeyedRateLimiter::keyed(Quota::per_second(per_second)),
            per_second,
        }
    }

    pub fn per_second(&self) -> u32 {
        self.per_second.get()
    }

    /// Takes one issuance of `caller`'s, or says how long until one is free.
    pub fn take(&self, caller: &str) -> Result<(), Duration> {
        if self.limiter.len() > MAX_CALLERS {
            self.limiter.retain_recent();
        }
        self.limiter
            .check_key(&caller.to_owned())
            .map_err(|not_until| {
                not_until.wait_time_from(governor::clock::Clock::now(
                    &governor::clock::DefaultClock::default(),
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_caller_has_its_own_bucket() {
        let rate = IssueRate::new(NonZeroU32::new(2).unwrap());
        assert!(rate.take("operator").is_ok());
        assert!(rate.take("operator").is_ok());
        let wait = rate.take("operator").unwrap_err();
        assert!(
            wait > Duration::ZERO && wait <= Duration::from_secs(1),
            "{wait:?}"
        );
        assert!(
            rate.take("lease:a").is_ok(),
            "another caller is not held up"
        );
    }
}
