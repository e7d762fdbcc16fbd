//! The acquire loop's decisions, as pure functions of what the server answered, the
//! request's bounds, the attempts so far and the time: what the loop does next. The loop
//! (`engine`) carries them out; these are tested here without a server.

use std::time::{Duration, Instant};

use crate::retry::Backoff;

/// An attempt's answer, as far as the decision goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    /// The server granted the lock.
    Granted,
    /// Another owner holds it, for about this much longer if the server said.
    Busy { holder_ttl: Option<Duration> },
    /// An answer that waiting cannot change (a semaphore's count disagrees; too few replicas
    /// acknowledged a grant that was given back).
    Refused,
    /// No answer, or one that says "not now" (a failover, a timeout): the next attempt may
    /// succeed.
    Transient,
    /// An error no retry can fix.
    Fatal,
}

/// The bounds a request waits within.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bounds {
    /// Attempts after the first.
    pub(crate) retries: u32,
    /// When its `wait` runs out, if it has one.
    pub(crate) deadline: Option<Instant>,
}

impl Bounds {
    fn spent(&self, attempts: u32, now: Instant) -> bool {
        attempts > self.retries || self.deadline.is_some_and(|deadline| deadline <= now)
    }
}

/// What the loop does after an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Take the lock: build the guard.
    Grant,
    /// Fail at once with the answer's own error.
    Refuse,
    /// The bounds are spent: give up (busy, unless the last word was a failure).
    GiveUp,
    /// Join the local queue behind this manager's other waiters, and ask again at once (a
    /// release between the answer and the subscription would publish unheard).
    Queue,
    /// Wait for a wake-up, a hand-off, or this fallback timer, then ask again.
    Sleep { until: Instant },
}

/// The next step after `answer`, the `attempts`-th answer: `queued` if the request is in its
/// manager's queue already, `queues` if it may join one (it may wait). `sitting_out`: until
/// when the local head lets other processes have their turns, if it does.
pub(crate) fn after(
    answer: Answer,
    bounds: Bounds,
    backoff: &Backoff,
    attempts: u32,
    queue: (bool, bool),
    sitting_out: Option<Instant>,
    now: Instant,
) -> Step {
    let (queued, queues) = queue;
    let holder_ttl = match answer {
        Answer::Granted => return Step::Grant,
        Answer::Refused | Answer::Fatal => return Step::Refuse,
        Answer::Busy { holder_ttl } => holder_ttl,
        Answer::Transient => None,
    };
    if bounds.spent(attempts, now) {
        return Step::GiveUp;
    }
    if !queued && queues {
        return Step::Queue;
    }
    let holder = Holder {
        lease: holder_ttl,
        announced: false,
    };
    sleep(bounds, backoff, attempts, holder, sitting_out, now)
}

/// What a waiter knows of the lock's holder when it goes to sleep.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Holder {
    /// How long the lock stays as it is at most, unless a release announces a change: the
    /// holder's remaining lease (for shares, the first share's), if the server said.
    pub(crate) lease: Option<Duration>,
    /// A release would reach this waiter: its manager follows the lock's wake channel now.
    pub(crate) announced: bool,
}

/// Until when to wait before asking again, bounded by the request's deadline and by the end
/// of a sit-out. `GiveUp` when the deadline has passed.
///
/// A waiter that a release would reach (`holder.announced`) and that waits by time, not by a
/// count of attempts, sleeps until the holder's lease ends: the lock cannot become free
/// before that without a release, and every release publishes its wake-up (a lost pub/sub
/// connection wakes every waiter too). Any other waiter (not subscribed, no lease known, or
/// spending a number of retries at the backoff's pace) takes the backoff with full jitter,
/// capped by the holder's lease, since an expiry is announced by nobody.
pub(crate) fn sleep(
    bounds: Bounds,
    backoff: &Backoff,
    attempts: u32,
    holder: Holder,
    sitting_out: Option<Instant>,
    now: Instant,
) -> Step {
    if bounds.deadline.is_some_and(|deadline| deadline <= now) {
        return Step::GiveUp;
    }
    let by_time = bounds.retries == u32::MAX;
    let delay = match holder.lease {
        Some(lease) if holder.announced && by_time => crate::retry::past_lease(lease),
        lease => backoff.delay(attempts, lease),
    };
    let mut until = crate::lease::saturating_add(now, delay);
    for bound in [bounds.deadline, sitting_out].into_iter().flatten() {
        until = until.min(bound);
    }
    Step::Sleep { until }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUSY: Answer = Answer::Busy { holder_ttl: None };

    fn bounds(retries: u32, wait: Option<Duration>, now: Instant) -> Bounds {
        Bounds {
            retries,
            deadline: wait.map(|wait| now + wait),
        }
    }

    fn backoff() -> Backoff {
        Backoff::new(Duration::from_millis(50))
    }

    #[test]
    fn a_grant_is_taken_whatever_the_bounds() {
        let now = Instant::now();
        let spent = bounds(0, Some(Duration::ZERO), now);
        let step = after(
            Answer::Granted,
            spent,
            &backoff(),
            9,
            (true, true),
            None,
            now,
        );
        assert_eq!(step, Step::Grant);
    }

    #[test]
    fn refusals_and_fatal_errors_end_the_request_at_once() {
        let now = Instant::now();
        let roomy = bounds(100, None, now);
        for answer in [Answer::Refused, Answer::Fatal] {
            let step = after(answer, roomy, &backoff(), 1, (false, true), None, now);
            assert_eq!(step, Step::Refuse, "{answer:?}");
        }
    }

    #[test]
    fn spent_bounds_give_up_busy_or_failing() {
        let now = Instant::now();
        // Retries spent: the first attempt of a request without retries.
        for answer in [BUSY, Answer::Transient] {
            let step = after(
                answer,
                bounds(0, None, now),
                &backoff(),
                1,
                (false, false),
                None,
                now,
            );
            assert_eq!(step, Step::GiveUp, "{answer:?}");
        }
        // Time spent, retries left.
        let late = bounds(100, Some(Duration::ZERO), now);
        assert_eq!(
            after(BUSY, late, &backoff(), 3, (true, true), None, now),
            Step::GiveUp
        );
        // A deadline passed while the loop was not asking.
        assert_eq!(
            sleep(late, &backoff(), 3, Holder::default(), None, now),
            Step::GiveUp
        );
    }

    #[test]
    fn the_first_busy_answer_queues_and_later_ones_sleep() {
        let now = Instant::now();
        let roomy = bounds(100, None, now);
        assert_eq!(
            after(BUSY, roomy, &backoff(), 1, (false, true), None, now),
            Step::Queue
        );
        assert!(matches!(
            after(BUSY, roomy, &backoff(), 2, (true, true), None, now),
            Step::Sleep { .. }
        ));
        // A request that may not queue (no retries) never does.
        let once = bounds(0, None, now);
        assert_eq!(
            after(BUSY, once, &backoff(), 1, (false, false), None, now),
            Step::GiveUp
        );
    }

    #[test]
    fn a_transient_failure_retries_like_a_busy_answer() {
        let now = Instant::now();
        let roomy = bounds(100, None, now);
        let step = after(
            Answer::Transient,
            roomy,
            &backoff(),
            2,
            (true, true),
            None,
            now,
        );
        assert!(matches!(step, Step::Sleep { .. }));
    }

    #[test]
    fn the_timer_is_bounded_by_the_holder_the_deadline_and_a_sit_out() {
        let now = Instant::now();
        let long = Backoff::new(Duration::from_secs(3600));
        let roomy = bounds(100, None, now);
        let until = |step| match step {
            Step::Sleep { until } => until,
            other => panic!("expected a sleep, got {other:?}"),
        };
        // The holder's lease ends in 30 ms: nobody announces an expiry.
        let holder = Holder {
            lease: Some(Duration::from_millis(30)),
            announced: false,
        };
        let by_holder = until(sleep(roomy, &long, 5, holder, None, now));
        assert!(by_holder <= now + Duration::from_millis(31));
        // The deadline comes first.
        let soon = bounds(100, Some(Duration::from_millis(10)), now);
        let none = Holder::default();
        assert!(until(sleep(soon, &long, 5, none, None, now)) <= now + Duration::from_millis(10));
        // A sit-out ends first.
        let sit = Some(now + Duration::from_millis(5));
        assert_eq!(
            until(sleep(roomy, &long, 5, none, sit, now)),
            now + Duration::from_millis(5)
        );
        // Otherwise the backoff, within its ceiling.
        let free = until(sleep(roomy, &backoff(), 1, none, None, now));
        assert!(free <= now + backoff().ceiling());
    }

    fn until(step: Step) -> Instant {
        match step {
            Step::Sleep { until } => until,
            other => panic!("expected a sleep, got {other:?}"),
        }
    }

    #[test]
    fn a_subscribed_waiter_bounded_by_time_sleeps_until_the_lease_ends() {
        let now = Instant::now();
        // A backoff of 50 ms would look again within 1.6 s; the holder has a minute left.
        let minute = Some(Duration::from_secs(60));
        let heard = Holder {
            lease: minute,
            announced: true,
        };
        let by_time = bounds(u32::MAX, None, now);
        let lease_end = now + Duration::from_secs(60) + Duration::from_millis(1);
        for attempts in [2, 3, 40] {
            assert_eq!(
                until(sleep(by_time, &backoff(), attempts, heard, None, now)),
                lease_end
            );
        }
        // A lease that ended as the answer came: look again at once (1 ms).
        let gone = Holder {
            lease: Some(Duration::ZERO),
            announced: true,
        };
        assert!(
            until(sleep(by_time, &backoff(), 2, gone, None, now)) <= now + Duration::from_millis(1)
        );
        // Still within the deadline and a sit-out.
        let soon = bounds(u32::MAX, Some(Duration::from_secs(2)), now);
        let by_deadline = until(sleep(soon, &backoff(), 2, heard, None, now));
        assert_eq!(by_deadline, now + Duration::from_secs(2));
        let sit = Some(now + Duration::from_millis(5));
        let by_sit_out = until(sleep(by_time, &backoff(), 2, heard, sit, now));
        assert_eq!(by_sit_out, now + Duration::from_millis(5));
    }

    #[test]
    fn other_waiters_keep_the_backoff() {
        let now = Instant::now();
        let minute = Some(Duration::from_secs(60));
        let ceiling = now + backoff().ceiling();
        let by_time = bounds(u32::MAX, None, now);
        // Not subscribed: nothing would tell it of a release.
        let unheard = Holder {
            lease: minute,
            announced: false,
        };
        // No lease known (a key without expiry, or a failed attempt).
        let unknown = Holder {
            lease: None,
            announced: true,
        };
        for holder in [unheard, unknown] {
            for _ in 0..20 {
                assert!(until(sleep(by_time, &backoff(), 9, holder, None, now)) <= ceiling);
            }
        }
        // A number of retries is spent at the backoff's pace, subscribed or not.
        let counted = bounds(5, None, now);
        let heard = Holder {
            lease: minute,
            announced: true,
        };
        for _ in 0..20 {
            assert!(until(sleep(counted, &backoff(), 3, heard, None, now)) <= ceiling);
        }
    }
}
