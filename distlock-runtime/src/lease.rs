//! A lease as this process sees it, shared by a guard and the watchdog.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::watch;

/// Valid until a deadline on the monotonic clock, counted from when the request that set it
/// was *sent*, minus a margin for clock drift between client and server (1 % of the lease
/// plus 2 ms). Once lost, it stays lost.
#[derive(Debug)]
pub(crate) struct LeaseState {
    times: Mutex<Times>,
    lost: watch::Sender<bool>,
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
            lost: watch::Sender::new(false),
        }
    }

    fn times(&self) -> Times {
        *self.times.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The server confirmed a lease of `ttl` from a request sent at `sent`.
    pub(crate) fn renewed(&self, sent: Instant, ttl: Duration) {
        if self.is_marked_lost() {
            return;
        }
        let mut times = self.times.lock().unwrap_or_else(|e| e.into_inner());
        times.ttl = ttl;
        times.valid_until = times.valid_until.max(deadline(sent, ttl));
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

    fn is_marked_lost(&self) -> bool {
        *self.lost.borrow()
    }

    /// Records that the lease is gone for good and wakes everyone waiting for that.
    pub(crate) fn mark_lost(&self) {
        self.lost
            .send_if_modified(|lost| !std::mem::replace(lost, true));
    }

    /// A receiver that sees `true` once the lease is marked lost.
    pub(crate) fn subscribe(&self) -> watch::Receiver<bool> {
        self.lost.subscribe()
    }
}

fn deadline(sent: Instant, ttl: Duration) -> Instant {
    let drift = ttl / 100 + Duration::from_millis(2);
    sent + ttl.saturating_sub(drift)
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
        let receiver = lease.subscribe();
        assert!(!lease.is_lost());
        lease.mark_lost();
        assert!(lease.is_lost() && *receiver.borrow());
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
}
