//! How a release ended, as a pure function of what the server said: [`settle`].

/// What the server said of one lock a release gave back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reply {
    /// The lock was this owner's, and is given back (or kept for nobody until `min_hold`'s
    /// end, or granted to the next in a fair queue).
    Given,
    /// The lock was not this owner's any more.
    NotHeld,
    /// No reply came: the connection failed after the release may have been sent.
    Silence,
    /// Nothing was sent: no connection could be made (refused, or not found).
    Unsent,
    /// The server refused the release, or could not be reached at all.
    Refused,
}

/// What a release does next, or how it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// The reply was lost: the release is sent once more (it is idempotent per token).
    SendAgain,
    /// The lock is given back.
    Released,
    /// The lease had ended before the release: another owner may have held the key.
    Lost,
    /// Whether the lock was given back is not known: its lease ends it.
    Unknown,
}

/// How a release goes on after `reply`: `resent` when a release sent before this one may
/// have reached the server (its reply was lost), and `lease_lost` when the lease was known to
/// have ended before.
///
/// A release that was lost on its way, or never sent, is sent once more. A resent release
/// that finds the lock gone cannot tell whether the first one gave it back or whether it was
/// gone before (taken by an operator, lost in a failover, run out): unknown, never released,
/// unless the lease had ended anyway.
pub(crate) fn settle(reply: Reply, resent: bool, lease_lost: bool) -> Step {
    match reply {
        Reply::Given => Step::Released,
        Reply::NotHeld if resent && !lease_lost => Step::Unknown,
        Reply::NotHeld => Step::Lost,
        Reply::Silence | Reply::Unsent if !resent => Step::SendAgain,
        Reply::Unsent => Step::SendAgain,
        Reply::Silence | Reply::Refused => Step::Unknown,
    }
}

impl Reply {
    /// The reply of a release that failed with `error`.
    pub(crate) fn of_error(error: &redis::RedisError) -> Self {
        if error.is_connection_refusal() {
            Self::Unsent
        } else if error.is_io_error() {
            Self::Silence
        } else {
            Self::Refused
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reply_settles_as_its_table_says() {
        use Reply::*;
        use Step::*;
        // (reply, resent, lease lost) → step
        let table = [
            (Given, false, false, Released),
            (Given, true, false, Released),
            // A release that arrives after the lease ended may still find it: it gave it back.
            (Given, false, true, Released),
            (NotHeld, false, false, Lost),
            (NotHeld, false, true, Lost),
            // The first release gave it back before its reply was lost, or the lock was gone
            // before (an operator, a failover): nobody can tell the two apart.
            (NotHeld, true, false, Unknown),
            // The lease had ended before: lost either way.
            (NotHeld, true, true, Lost),
            (Silence, false, false, SendAgain),
            (Silence, false, true, SendAgain),
            (Silence, true, false, Unknown),
            (Silence, true, true, Unknown),
            // Never sent: sent again, as the first (the loop sends twice at most).
            (Unsent, false, false, SendAgain),
            (Unsent, true, false, SendAgain),
            (Refused, false, false, Unknown),
            (Refused, true, true, Unknown),
        ];
        for (reply, resent, lost, step) in table {
            assert_eq!(
                settle(reply, resent, lost),
                step,
                "{reply:?}, resent {resent}, lease lost {lost}"
            );
        }
    }

    #[test]
    fn a_lost_connection_is_a_lost_reply_and_a_refusal_is_not() {
        let reset = redis::RedisError::from(std::io::Error::other("reset"));
        assert_eq!(Reply::of_error(&reset), Reply::Silence);
        let refused = redis::RedisError::from((redis::ErrorKind::Client, "refused"));
        assert_eq!(Reply::of_error(&refused), Reply::Refused);
        let unreachable =
            redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert_eq!(Reply::of_error(&unreachable), Reply::Unsent);
    }
}
