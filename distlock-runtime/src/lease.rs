//! A lease as this process sees it, shared by a guard and the watchdog.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// The longest lease a request or [`LockGuard::extend`](crate::LockGuard::extend) accepts: about 100 years, far below
/// what Redis can store (a millisecond count that must not overflow when added to the
/// server's clock).
pub const MAX_TTL: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// Checks a lease length: `Err` says why it is refused.
pub(crate) fn check_ttl(ttl: Duration) -> Result<(), String> {
    if ttl < Duration::from_millis(1) {
        Err(format!("must be at least 1ms, got {ttl:?}"))
    } else if ttl > MAX_TTL {
        Err(format!(
            "must be at most MAX_TTL ({MAX_TTL:?}), got {ttl:?}"
        ))
    } else {
        Ok(())
    }
}

/// Valid until a deadline on the monotonic clock, counted from when the request that set it
/// was *sent*, minus a margin for clock drift between client and server (1 % of the lease
/// plus 2 ms). Once lost, it stays lost.
#[derive(Debug)]
pub(crate) struct LeaseState {
    times: Mutex<Times>,
    /// Marked lost; final.
    lost: AtomicBool,
    /// Wakes those waiting for the mark (nothing to allocate until someone waits).
    marked: Notify,
}

#[derive(Debug, Clone, Copy)]
struct Times {
    ttl: Duration,
    valid_until: Instant,
}

impl LeaseState {
    pub(crate) fn new(sent: Instant, ttl: Duration) -> Self {
        Self {
            times: Mutex::new(Times {
                ttl,
                valid_until: deadline(sent, ttl),
            }),
            lost: AtomicBool::new(false),
            marked: Notify::new(),
        }
    }

    fn times(&self) -> Times {
        *self.times.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The server confirmed a lease of `ttl` from a request sent at `sent`. The deadline only
    /// moves forward. Lost is final: an answer that arrives once the deadline has passed
    /// marks the lease lost instead, since `is_lost` may already have said so. Returns whether
    /// the lease is still valid.
    pub(crate) fn renewed(&self, sent: Instant, ttl: Duration) -> bool {
        if self.is_marked_lost() {
            return false;
        }
        let mut times = self.times.lock().unwrap_or_else(|e| e.into_inner());
        if Instant::now() >= times.valid_until {
            drop(times);
            self.mark_lost();
            return false;
        }
        let until = deadline(sent, ttl);
        if until > times.valid_until {
            *times = Times {
                ttl,
                valid_until: until,
            };
        }
        true
    }

    /// The lease length last granted.
    pub(crate) fn ttl(&self) -> Duration {
        self.times().ttl
    }

    /// The local validity deadline.
    pub(crate) fn valid_until(&self) -> Instant {
        self.times().valid_until
    }

    /// What is left of the lease by the local clock; zero once lost.
    pub(crate) fn remaining(&self) -> Duration {
        if self.is_marked_lost() {
            return Duration::ZERO;
        }
        self.valid_until().saturating_duration_since(Instant::now())
    }

    /// Lost: marked so, or the local deadline has passed.
    pub(crate) fn is_lost(&self) -> bool {
        self.is_marked_lost() || Instant::now() >= self.valid_until()
    }

    pub(crate) fn is_marked_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    /// Records that the lease is gone for good and wakes everyone waiting for that.
    pub(crate) fn mark_lost(&self) {
        if !self.lost.swap(true, Ordering::AcqRel) {
            self.marked.notify_waiters();
        }
    }

    /// Completes once the lease is marked lost (not when its deadline passes: see
    /// [`is_lost`](Self::is_lost)).
    pub(crate) async fn until_marked_lost(&self) {
        let notified = self.marked.notified();
        tokio::pin!(notified);
        // Registered before looking, so a mark in between is not missed.
        notified.as_mut().enable();
        if self.is_marked_lost() {
            return;
        }
        notified.await;
    }
}

fn deadline(sent: Instant, ttl: Duration) -> Instant {
    let drift = (ttl / 100).saturating_add(Duration::from_millis(2));
    saturating_add(sent, ttl.saturating_sub(drift))
}

/// `at + by`, or the latest instant the clock can count past `at` when that overflows: a
/// time that far away never comes anyway.
pub(crate) fn saturating_add(at: Instant, by: Duration) -> Instant {
    let mut by = by;
    loop {
        if let Some(later) = at.checked_add(by) {
            return later;
        }
        by /= 2;
    }
}

/// Until when the key must live after release for a `min_hold`, counted from the acquisition.
pub(crate) fn keep_until(sent: Instant, min_hold: Option<Duration>) -> Option<Instant> {
    min_hold.map(|min| saturating_add(sent, min))
}

/// How much longer the key must live after a release sent now.
pub(crate) fn keep_from(until: Option<Instant>) -> Duration {
    until.map_or(Duration::ZERO, |until| {
        until.saturating_duration_since(Instant::now())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deadline_keeps_a_drift_margin() {
        let sent = Instant::now();
        let lease = LeaseState::new(sent, Duration::from_secs(10));
        assert_eq!(lease.valid_until(), sent + Duration::from_millis(9_898));
    }

    #[test]
    fn lost_is_final() {
        let lease = LeaseState::new(Instant::now(), Duration::from_secs(10));
        assert!(!lease.is_lost());
        lease.mark_lost();
        assert!(lease.is_lost() && lease.is_marked_lost());
        lease.renewed(Instant::now(), Duration::from_secs(60));
        assert!(lease.is_lost());
        assert_eq!(lease.remaining(), Duration::ZERO);
    }

    #[test]
    fn a_late_reply_never_moves_the_deadline_back() {
        let sent = Instant::now();
        let lease = LeaseState::new(sent, Duration::from_secs(10));
        lease.renewed(sent - Duration::from_secs(5), Duration::from_secs(10));
        assert_eq!(lease.valid_until(), sent + Duration::from_millis(9_898));
    }

    #[test]
    fn a_reply_after_the_deadline_does_not_revive_the_lease() {
        // Sent before the deadline, answered after it: the lease was already lost here.
        let acquired = Instant::now() - Duration::from_secs(11);
        let lease = LeaseState::new(acquired, Duration::from_secs(10));
        assert!(lease.is_lost());
        lease.renewed(acquired + Duration::from_secs(9), Duration::from_secs(10));
        assert!(lease.is_lost(), "a late renewal revived a lost lease");
        assert!(
            lease.is_marked_lost(),
            "a late renewal must mark the lease lost"
        );
        assert_eq!(lease.remaining(), Duration::ZERO);
    }

    #[test]
    fn a_shorter_lease_never_moves_the_deadline_back() {
        let sent = Instant::now();
        let lease = LeaseState::new(sent, Duration::from_secs(30));
        let before = lease.valid_until();
        lease.renewed(sent, Duration::from_secs(1));
        assert_eq!(lease.valid_until(), before);
        assert_eq!(lease.ttl(), Duration::from_secs(30));
    }

    #[tokio::test]
    async fn a_waiter_hears_the_mark_once() {
        let lease = std::sync::Arc::new(LeaseState::new(Instant::now(), Duration::from_secs(10)));
        let waiter = tokio::spawn({
            let lease = lease.clone();
            async move { lease.until_marked_lost().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        lease.mark_lost();
        waiter.await.unwrap();
        // Already marked: completes at once.
        lease.until_marked_lost().await;
    }

    #[test]
    fn huge_leases_do_not_overflow() {
        let lease = LeaseState::new(Instant::now(), Duration::MAX);
        lease.renewed(Instant::now(), Duration::MAX);
        assert!(!lease.is_lost());
    }
}
