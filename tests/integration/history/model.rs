//! What every part of the checker shares: the keys, the kinds of hold, what a topology can
//! do, and the bounds the rules allow.

use std::time::Duration;

use distlock::{LockManager, LockRequest};

use crate::support;

/// The keys every program works on: few, so that programs meet; four, so that a set can
/// name every one.
pub(super) const KEYS: [&str; 4] = ["a", "b", "c", "d"];
/// The permits of every semaphore (all users of a key must agree).
pub(super) const PERMITS: u32 = 2;
/// No call may take longer than this: past it, the call counts as hung.
pub(super) const BOUND: Duration = Duration::from_secs(30);
/// A key free in Redis while a request sleeps waiting for it, and nobody enters it, for longer
/// than this (outside fault windows) is a liveness violation.
pub(super) const STARVED: Duration = Duration::from_millis(250);
/// The monitor's timer firing later than this past its time is a stall of the process: that
/// stretch is allowed to a waiter as a fault window is (a loaded machine starves everyone).
pub(super) const STALL: Duration = Duration::from_millis(10);
/// After an injected fault ends, connections and subscriptions take this long to recover: a
/// free stretch that overlaps a fault window may last the window and this much longer.
pub(super) const RECOVERY: Duration = Duration::from_millis(1_500);
/// How long past its `wait` an acquire may still run (an attempt in flight, a loaded
/// machine).
pub(super) const OVERSTAY: Duration = Duration::from_secs(2);
/// The same through faults: a `wait` does not cut an attempt in flight, which may open a
/// connection twice and wait for two answers, each bounded by the manager's timeouts
/// (500 ms here): about 2 s, plus a paused server's pause.
pub(super) const OVERSTAY_FAULTS: Duration = Duration::from_secs(4);
/// Without faults, how long a plain lock may stay owned by a token that no holder in the
/// history has (a release on its way; a fair grant to a waiter that left, 2 s at most).
pub(super) const ORPHANED: Duration = Duration::from_secs(3);
/// How long after its hold was taken away a cohort's run may still pass it on, past one
/// round trip (the steal's own, measured as it is made): the run learns of it from its next
/// check's answer, and passes made while that is out are seen entering a moment later.
/// Fault windows (and the recovery after them) the stretch overlaps are allowed on top.
pub(super) const RUN_AFTER_STEAL: Duration = Duration::from_millis(10);
/// How often the monitor samples each key.
pub(super) const SAMPLE: Duration = Duration::from_millis(15);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Exclusive,
    Read,
    Write,
    Permit,
}

impl Kind {
    pub(super) fn request<'m>(self, locks: &'m LockManager, key: &str) -> LockRequest<'m> {
        match self {
            Self::Exclusive => locks.lock(key),
            Self::Read => locks.read_lock(key),
            Self::Write => locks.write_lock(key),
            Self::Permit => locks.semaphore(key, PERMITS),
        }
    }

    /// Whether two different owners may hold `self` and `other` on one key at once.
    pub(super) fn overlaps(self, other: Self) -> bool {
        matches!(
            (self, other),
            (Self::Read, Self::Read) | (Self::Permit, Self::Permit)
        )
    }

    /// The command that answers what is left of this kind's lease (as `PTTL` does): the
    /// lock's, or, for shares, the holder's share's in the lock's hash.
    pub(super) fn lease_left(self, locks: &LockManager, key: &str, token: &str) -> redis::Cmd {
        support::lease_left(&locks.redis_key(key), token)
    }
}

/// What a topology can do: RedLock has neither shared kinds nor fencing.
#[derive(Debug, Clone, Copy)]
pub(super) struct Features {
    pub(super) shared_kinds: bool,
    pub(super) fencing: bool,
    /// Fair locks (one queue per key): not with RedLock.
    pub(super) fair: bool,
    /// Leases of at most 2 s (RedLock: a restarted master stays out for longer than that).
    pub(super) short_leases: bool,
}
