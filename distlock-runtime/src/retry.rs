//! When to try again: exponential backoff with full jitter, bounded by the holder's lease;
//! or, for a waiter that a release would reach, the end of that lease.

use std::time::Duration;

use crate::lease::MAX_TTL;

/// Backoff for one request: attempt `n` waits a random time in `[0, min(cap, base·2ⁿ⁻¹)]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Backoff {
    base: Duration,
    cap: Duration,
}

impl Backoff {
    /// The delays start from `base` and grow to at most 32 × `base`, and never beyond
    /// [`MAX_TTL`]: a longer delay could not be added to a clock, and no lease outlasts it.
    pub(crate) fn new(base: Duration) -> Self {
        let base = base.min(MAX_TTL);
        Self {
            base,
            cap: base.saturating_mul(32).min(MAX_TTL),
        }
    }

    /// The longest delay this backoff draws.
    pub(crate) fn ceiling(&self) -> Duration {
        self.cap
    }

    /// The delay after failed attempt number `attempt` (1-based). When the holder's remaining
    /// lease is known, the delay does not run past it, so an expiry is noticed promptly.
    pub(crate) fn delay(&self, attempt: u32, holder_ttl: Option<Duration>) -> Duration {
        let shift = attempt.saturating_sub(1).min(20);
        let ceiling = self.base.saturating_mul(1 << shift).min(self.cap);
        let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        let jittered = Duration::from_nanos(fastrand::u64(0..=nanos));
        match holder_ttl {
            Some(ttl) => jittered.min(ttl.saturating_add(Duration::from_millis(1))),
            None => jittered,
        }
    }
}

/// A wait that ends just after a lease of `lease` from now: the first moment its key may be
/// gone by expiry (the lease counted from the attempt that read it, sent before now).
pub(crate) fn past_lease(lease: Duration) -> Duration {
    lease.saturating_add(Duration::from_millis(1)).min(MAX_TTL)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_stay_within_the_growing_ceiling() {
        let backoff = Backoff::new(Duration::from_millis(10));
        for attempt in 1..40 {
            let ceiling = Duration::from_millis(10 * (1 << (attempt - 1).min(5)));
            for _ in 0..50 {
                assert!(backoff.delay(attempt, None) <= ceiling);
            }
        }
    }

    #[test]
    fn huge_delays_are_capped() {
        for base in [Duration::MAX, Duration::from_secs(u64::MAX / 2)] {
            let backoff = Backoff::new(base);
            assert_eq!(backoff.ceiling(), MAX_TTL);
            for attempt in [1, 2, 40, u32::MAX] {
                assert!(backoff.delay(attempt, None) <= MAX_TTL);
                assert!(backoff.delay(attempt, Some(Duration::MAX)) <= MAX_TTL);
            }
        }
    }

    #[test]
    fn a_wait_past_the_lease_ends_just_after_it() {
        let lease = Duration::from_secs(60);
        assert_eq!(past_lease(lease), lease + Duration::from_millis(1));
        assert_eq!(past_lease(Duration::ZERO), Duration::from_millis(1));
        assert_eq!(past_lease(Duration::MAX), MAX_TTL);
    }

    #[test]
    fn delays_do_not_outlast_the_holder() {
        let backoff = Backoff::new(Duration::from_secs(1));
        for _ in 0..100 {
            assert!(backoff.delay(6, Some(Duration::from_millis(3))) <= Duration::from_millis(4));
        }
    }
}
