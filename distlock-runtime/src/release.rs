//! Giving locks back on the server: one path for a hold and for a set.
//!
//! A release is sent once more if its reply is lost ([`send_again`]); a lock that the resent
//! release finds gone was given back by the first attempt, unless the lease had run out
//! meanwhile ([`found_lost`]); and a release whose future is dropped before Redis answered (a
//! `select!`, a timeout) is sent again from the manager's own runtime ([`Unanswered`]), as a
//! dropped guard's is. A release is idempotent per hold id, so sending it again never gives
//! back anything twice.

use crate::lease::LeaseState;

/// What a release sends again when its caller gave up on it before Redis answered.
pub(crate) trait Resend {
    /// Sends the release again from the manager's own runtime, without waiting for it.
    fn resend(&self);
}

/// A release on its way to Redis: dropped armed (its future dropped midway), it sends the
/// release again from the manager's runtime. Armed before the first command is sent, and
/// disarmed by [`answered`](Self::answered) once the release has settled.
pub(crate) struct Unanswered<'r, R: Resend>(Option<&'r R>);

impl<'r, R: Resend> Unanswered<'r, R> {
    /// Covers the release that `release` sends again.
    pub(crate) fn armed(release: &'r R) -> Self {
        Self(Some(release))
    }

    /// The release settled: nothing is sent again.
    pub(crate) fn answered(&mut self) {
        self.0 = None;
    }
}

impl<R: Resend> Drop for Unanswered<'_, R> {
    fn drop(&mut self) {
        if let Some(release) = self.0.take() {
            release.resend();
        }
    }
}

/// Whether a release answered with `error` is sent once more: once, when its reply was lost
/// (an I/O error), unless one was sent again already (`retried`).
pub(crate) fn send_again(error: &redis::RedisError, retried: bool) -> bool {
    !retried && error.is_io_error()
}

/// Whether a release that found a lock no longer this owner's means its lease was lost: not
/// when the release was sent more than once (`retried`) while the lease was still valid, as
/// an earlier attempt may have given the lock back before its reply was lost.
pub(crate) fn found_lost(retried: bool, lease: &LeaseState) -> bool {
    !retried || lease.is_lost()
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    #[test]
    fn a_lost_reply_is_sent_again_once() {
        let lost_reply = redis::RedisError::from(std::io::Error::other("reset"));
        assert!(send_again(&lost_reply, false));
        assert!(!send_again(&lost_reply, true));
        let refused = redis::RedisError::from((redis::ErrorKind::Client, "refused"));
        assert!(!send_again(&refused, false));
    }

    #[test]
    fn a_lock_found_gone_is_lost_unless_a_resent_release_finds_it_within_its_lease() {
        let lease = LeaseState::new(Instant::now(), Duration::from_secs(60));
        assert!(found_lost(false, &lease));
        assert!(!found_lost(true, &lease));
        lease.mark_lost();
        assert!(found_lost(true, &lease));
    }
}
