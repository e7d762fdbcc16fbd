//! Sitting out other processes' turns after a run of hand-offs ended: how long, and when
//! the local head looks anyway.

use std::time::{Duration, Instant};

use super::choice::{CohortBounds, SLICE};

/// The local head's turn comes after one release by each of `others` other processes.
///
/// A free lock is not left untaken for long meanwhile: other processes that heard the
/// release but do not take the lock up (listeners on its channel, waiters sitting out turns
/// of their own) would otherwise keep it free for a turn each. So the head takes a look (one
/// attempt) once two turns have passed since the yield or since the last release heard from
/// another process: if the lock is free, it takes it; if another process has it, the head
/// waits for its release as any waiter does, and looks again two turns after it.
#[derive(Debug)]
pub(super) struct SittingOut {
    pub(super) others: usize,
    /// The tags of the processes heard releasing so far (each counts once: one that has its
    /// turn again before another had one does not end the wait early).
    pub(super) heard: std::collections::HashSet<Vec<u8>>,
    pub(super) until: Instant,
    /// One other process's turn: a run of its hand-offs, at most.
    pub(super) turn: Duration,
    /// When the head looks, unless a release is heard before.
    pub(super) look_at: Instant,
    /// Made as the release chose to yield, before its answer said how many others heard it
    /// (`Waiters::yielded` sets the count): releases heard meanwhile are kept for it, and
    /// never end it.
    pub(super) provisional: bool,
}

/// One other process's turn after a yield: a run of its hand-offs at most (of local passes,
/// `cohort`, bounded by the cohort's time; a tenth of the lease when that is shorter).
pub(super) fn turn_of(cohort: bool, bounds: CohortBounds, lease: Duration) -> Duration {
    match cohort && bounds.passes > 0 {
        true => bounds.time,
        false => SLICE,
    }
    .min(lease / 10)
}

impl SittingOut {
    /// A sit-out for `others` other processes' turns of `turn` each, from `now`.
    pub(super) fn new(others: usize, turn: Duration, now: Instant) -> Self {
        let rounds = u32::try_from(others).unwrap_or(u32::MAX).saturating_mul(2);
        Self {
            others,
            heard: std::collections::HashSet::new(),
            until: crate::lease::saturating_add(now, turn.saturating_mul(rounds)),
            turn,
            look_at: crate::lease::saturating_add(now, turn.saturating_mul(2)),
            provisional: false,
        }
    }

    /// The sit-out a release starts as it chooses to yield, for one other process's turns
    /// until its answer says how many others heard it.
    pub(super) fn provisional(turn: Duration, now: Instant) -> Self {
        Self {
            provisional: true,
            ..Self::new(1, turn, now)
        }
    }

    /// Another process, tagged `by`, released the lock at `now`: whether every other
    /// process has had its turn (the sit-out is over). Only a plain lock's release carries
    /// its process's tag, and only those take part in runs of hand-offs; a message without
    /// one (another kind's or a set's release, a writer taking back its intent, a forced
    /// release) neither counts nor puts the look off.
    pub(super) fn heard(&mut self, by: &[u8], now: Instant) -> bool {
        if by.is_empty() {
            return false;
        }
        self.heard.insert(by.to_vec());
        self.look_at = crate::lease::saturating_add(now, self.turn.saturating_mul(2));
        !self.provisional && self.heard.len() >= self.others
    }

    /// Until when the head waits before it asks: `None` when it may ask now (the sit-out is
    /// over, or a look is due).
    pub(super) fn waits_until(&self, now: Instant) -> Option<Instant> {
        let until = self.until.min(self.look_at);
        (now < until).then_some(until)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TURN: Duration = Duration::from_millis(50);

    #[test]
    fn a_sit_out_lasts_a_turn_for_each_other_process_and_ends_when_each_had_one() {
        let now = Instant::now();
        let mut sitting = SittingOut::new(3, TURN, now);
        assert_eq!(sitting.until, now + TURN * 6);
        assert!(!sitting.heard(b"b", now + TURN / 2));
        // The same process again does not count twice.
        assert!(!sitting.heard(b"b", now + TURN / 2));
        assert!(!sitting.heard(b"c", now + TURN));
        assert!(sitting.heard(b"d", now + TURN));
        // Made at the yield, before the count is known: what it hears is kept, and ends
        // nothing until the count comes.
        let mut early = SittingOut::provisional(TURN, now);
        assert!(!early.heard(b"b", now));
        assert!(!early.heard(b"c", now));
        assert_eq!(early.heard.len(), 2);
    }

    #[test]
    fn two_turns_gone_by_unused_let_the_head_look() {
        let now = Instant::now();
        let mut sitting = SittingOut::new(200, TURN, now);
        // Nobody took the lock up: a look after two turns, not four hundred.
        assert_eq!(sitting.waits_until(now), Some(now + TURN * 2));
        assert_eq!(sitting.waits_until(now + TURN * 2), None);
        // A release heard is another process's turn ending: the next look is two turns after.
        let later = now + TURN * 3;
        assert!(!sitting.heard(b"b", later));
        assert_eq!(sitting.waits_until(later), Some(later + TURN * 2));
        // A message without a tag (a writer taking back its intent) is no turn: it neither
        // counts nor puts the look off.
        assert!(!sitting.heard(b"", later + TURN));
        assert_eq!(sitting.heard.len(), 1);
        assert_eq!(sitting.waits_until(later + TURN), Some(later + TURN * 2));
        // Never past the end of the sit-out.
        let mut short = SittingOut::new(1, TURN, now);
        short.look_at = now + TURN * 5;
        assert_eq!(short.waits_until(now), Some(now + TURN * 2));
    }
}
