//! The acquire loop's decision: one pure function, [`step`], of what the request knows (its
//! [`State`]), what it heard (an attempt's answer, or nothing yet) and the time, answering
//! what the loop does next. The loop (`engine`) carries it out for one lock, a set and a
//! fair lock alike; where those differ, the difference is a branch here, with its reason.
//! Tested here without a server.

use std::time::{Duration, Instant};

use crate::backend::{AcquireAnswer, FAIR_REFRESH};
use crate::retry::Backoff;

/// What kind of request waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WaitKind {
    /// One lock, queued behind this manager's other waiters.
    Plain,
    /// Several locks taken together: the queue to follow is that of the lock found busy.
    Set,
    /// A fair lock: its place is kept in the server's queue, shared by every process.
    Fair,
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
        attempts > self.retries || self.past(now)
    }

    fn past(&self, now: Instant) -> bool {
        self.deadline.is_some_and(|deadline| deadline <= now)
    }

    /// A request bounded by time, not by a count of attempts.
    fn by_time(&self) -> bool {
        self.retries == u32::MAX
    }
}

/// What the request knows when it decides.
#[derive(Debug, Clone, Copy)]
pub(crate) struct State {
    pub(crate) mode: WaitKind,
    pub(crate) bounds: Bounds,
    /// Attempts answered (or sent and lost) so far.
    pub(crate) attempts: u32,
    /// The lock whose queue the request is in, if it is in one (a fair request: the one
    /// lock, once its attempts keep a place in the server's queue).
    pub(crate) queued_at: Option<usize>,
    /// The lock the last busy answer named (0 before any).
    pub(crate) busy_at: usize,
    /// A task of this manager holds the lock, and its release hands the lock to this
    /// manager's waiters: until when its lease runs, at most.
    pub(crate) held_here: Option<Instant>,
    /// Until when this manager's waiters let other processes have their turns, if they do.
    pub(crate) sitting_out: Option<Instant>,
    /// A release would reach this waiter: its manager follows the lock's wake channel now.
    pub(crate) announced: bool,
}

/// What the loop does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Send an attempt.
    Ask,
    /// Take the lock: build the guard.
    Grant,
    /// Fail at once with the answer's own error.
    Refuse,
    /// The bounds are spent: give up (busy, unless the last word was a failure).
    GiveUp,
    /// Join the queue of lock `at` (leaving any other), and ask again as soon as the request
    /// follows that lock's wake channel: a release between the answer and the subscription
    /// would publish unheard.
    Queue { at: usize },
    /// Wait for a wake-up, a hand-off, or this fallback timer; then look again.
    Sleep { until: Instant },
}

/// The next step: after `heard`, the last attempt's answer, or before an attempt (`None`).
pub(crate) fn step<F>(
    state: &State,
    heard: Option<&redis::RedisResult<AcquireAnswer<F>>>,
    backoff: &Backoff,
    now: Instant,
) -> Step {
    let Some(answer) = heard else {
        return before_asking(state, backoff, now);
    };
    let holder_ttl = match answer {
        Ok(AcquireAnswer::Held(_)) => return Step::Grant,
        // Waiting cannot change these: a grant too few replicas acknowledged was given back
        // already, and a semaphore used with another count is a mistake to report, not a
        // wait (the count's holders may come and go for ever). Fair locks are exclusive and
        // never hear of permits.
        Ok(AcquireAnswer::Unreplicated { .. } | AcquireAnswer::PermitsMismatch { .. }) => {
            return Step::Refuse;
        }
        Ok(AcquireAnswer::Busy { holder_ttl, .. }) => *holder_ttl,
        // A lost reply may hide a granted lock: the next attempt resends the same hold,
        // which the script recognises.
        Err(error) if is_transient(error) => None,
        Err(_) => return Step::Refuse,
    };
    if state.bounds.spent(state.attempts, now) {
        return Step::GiveUp;
    }
    // A request that may wait joins a queue the first time it is turned away. A set knows
    // which lock to wait for only from a busy answer; and a set found busy on another lock
    // than the one it queued for moves there (a release of that lock before its channel is
    // followed would leave the set asleep while every lock is free). That lock was free at
    // this look, so each such move follows a release and is no busy loop.
    let may_queue = state.bounds.retries > 0
        && (state.mode != WaitKind::Set || matches!(answer, Ok(AcquireAnswer::Busy { .. })));
    if may_queue && state.queued_at != Some(state.busy_at) {
        return Step::Queue { at: state.busy_at };
    }
    sleep(state, holder_ttl, backoff, now)
}

/// Before an attempt: ask, unless asking now could only hear "busy" or would jump the turn
/// of other processes.
fn before_asking(state: &State, backoff: &Backoff, now: Instant) -> Step {
    // No attempt starts past the deadline, but the first is always made.
    if state.attempts > 0 && state.bounds.past(now) {
        return Step::GiveUp;
    }
    // A task of this manager holds the lock: its release hands it over (or wakes this
    // head). Its lease bounds the wait, as the holder's PTTL would.
    if let Some(until) = state.held_here {
        return sleep(
            state,
            Some(until.saturating_duration_since(now)),
            backoff,
            now,
        );
    }
    // This manager just had a run of hand-offs: other processes' turns come first.
    if sit_out_until(state).is_some() {
        return sleep(state, None, backoff, now);
    }
    Step::Ask
}

/// Until when the request lets other processes have their turns, if it does.
fn sit_out_until(state: &State) -> Option<Instant> {
    match state.mode {
        WaitKind::Plain => state.sitting_out,
        // A set takes no turns in a cohort's sit-out: it never takes a hand-off, so the
        // turns it would give were never this manager's to give.
        WaitKind::Set => None,
        // A fair lock's turns are the server's queue, the same for every process.
        WaitKind::Fair => None,
    }
}

/// Until when to wait before asking again (`lease`: how long the lock stays as it is at
/// most, unless a release announces a change; the holder's remaining lease, if known),
/// bounded by the request's deadline and by the end of a sit-out. `GiveUp` when the
/// deadline has passed.
///
/// A waiter that a release would reach (`announced`) and that waits by time, not by a
/// count of attempts, sleeps until the holder's lease ends: the lock cannot become free
/// before that without a release, and every release publishes its wake-up (a lost pub/sub
/// connection wakes every waiter too). Any other waiter (not subscribed, no lease known, or
/// spending a number of retries at the backoff's pace) takes the backoff with full jitter,
/// capped by the holder's lease, since an expiry is announced by nobody.
fn sleep(state: &State, lease: Option<Duration>, backoff: &Backoff, now: Instant) -> Step {
    let (bounds, attempts) = (state.bounds, state.attempts);
    if bounds.past(now) {
        return Step::GiveUp;
    }
    let delay = match state.mode {
        // A fair waiter's place in the server's queue lapses unless its attempts renew it,
        // so it asks again at least every `FAIR_REFRESH`. A grant is published to it by name,
        // and a missed one is caught by that renewal, so by time it waits for the holder's
        // lease to end, subscribed or not, with no backoff.
        WaitKind::Fair => match lease {
            _ if !bounds.by_time() => backoff.delay(attempts, lease),
            Some(lease) => crate::retry::past_lease(lease),
            None => FAIR_REFRESH,
        }
        .min(FAIR_REFRESH),
        WaitKind::Plain | WaitKind::Set => match lease {
            Some(lease) if state.announced && bounds.by_time() => crate::retry::past_lease(lease),
            lease => backoff.delay(attempts, lease),
        },
    };
    let mut until = crate::lease::saturating_add(now, delay);
    for bound in [bounds.deadline, sit_out_until(state)]
        .into_iter()
        .flatten()
    {
        until = until.min(bound);
    }
    Step::Sleep { until }
}

/// Errors after which the same attempt may succeed if sent again.
/// Connection failures, and server answers that say "not now" (TRYAGAIN, CLUSTERDOWN,
/// MASTERDOWN, LOADING, READONLY during a failover, …): retried within the request's
/// bounds, and reported as the Redis error they are, never as busy, if the bounds run out.
pub(crate) fn is_transient(error: &redis::RedisError) -> bool {
    error.is_io_error()
        || error.is_timeout()
        || error.is_connection_dropped()
        || error.is_connection_refusal()
        || !matches!(error.retry_method(), redis::RetryMethod::NoRetry)
}

#[cfg(test)]
mod tests {
    use super::*;

    type Answer = redis::RedisResult<AcquireAnswer<()>>;

    const MODES: [WaitKind; 3] = [WaitKind::Plain, WaitKind::Set, WaitKind::Fair];

    fn busy(holder_ttl: Option<Duration>) -> Answer {
        Ok(AcquireAnswer::Busy {
            at: 0,
            holder_ttl,
            holder: None,
        })
    }

    fn lost_reply() -> Answer {
        Err(std::io::Error::other("reset").into())
    }

    fn fatal() -> Answer {
        Err((redis::ErrorKind::Client, "refused").into())
    }

    fn bounds(retries: u32, wait: Option<Duration>, now: Instant) -> Bounds {
        Bounds {
            retries,
            deadline: wait.map(|wait| now + wait),
        }
    }

    /// A request of `mode` within `bounds`, after `attempts`, in the queue of lock 0 or not.
    fn state(mode: WaitKind, bounds: Bounds, attempts: u32, queued: bool) -> State {
        State {
            mode,
            bounds,
            attempts,
            queued_at: queued.then_some(0),
            busy_at: 0,
            held_here: None,
            sitting_out: None,
            announced: false,
        }
    }

    fn backoff() -> Backoff {
        Backoff::new(Duration::from_millis(50))
    }

    fn after(state: &State, answer: &Answer, now: Instant) -> Step {
        step(state, Some(answer), &backoff(), now)
    }

    fn before(state: &State, now: Instant) -> Step {
        step::<()>(state, None, &backoff(), now)
    }

    fn until(step: Step) -> Instant {
        match step {
            Step::Sleep { until } => until,
            other => panic!("expected a sleep, got {other:?}"),
        }
    }

    #[test]
    fn a_grant_is_taken_whatever_the_bounds() {
        let now = Instant::now();
        let spent = bounds(0, Some(Duration::ZERO), now);
        for mode in MODES {
            let step = after(
                &state(mode, spent, 9, true),
                &Ok(AcquireAnswer::Held(())),
                now,
            );
            assert_eq!(step, Step::Grant, "{mode:?}");
        }
    }

    #[test]
    fn refusals_and_fatal_errors_end_the_request_at_once() {
        let now = Instant::now();
        let roomy = bounds(100, None, now);
        let refusals = [
            Ok(AcquireAnswer::Unreplicated {
                acked: 0,
                wanted: 1,
            }),
            Ok(AcquireAnswer::PermitsMismatch { stored: 3 }),
            fatal(),
        ];
        for mode in MODES {
            for answer in &refusals {
                let step = after(&state(mode, roomy, 1, false), answer, now);
                assert_eq!(step, Step::Refuse, "{mode:?} {answer:?}");
            }
        }
    }

    #[test]
    fn spent_bounds_give_up_busy_or_failing() {
        let now = Instant::now();
        for mode in MODES {
            // Retries spent: the first attempt of a request without retries.
            for answer in [busy(None), lost_reply()] {
                let once = state(mode, bounds(0, None, now), 1, false);
                assert_eq!(after(&once, &answer, now), Step::GiveUp, "{mode:?}");
            }
            // Time spent, retries left.
            let late = state(mode, bounds(100, Some(Duration::ZERO), now), 3, true);
            assert_eq!(after(&late, &busy(None), now), Step::GiveUp, "{mode:?}");
            // A deadline passed while the loop was not asking: no attempt after the first.
            assert_eq!(before(&late, now), Step::GiveUp, "{mode:?}");
        }
    }

    #[test]
    fn the_first_attempt_is_made_even_past_the_deadline() {
        let now = Instant::now();
        for mode in MODES {
            let late = state(mode, bounds(100, Some(Duration::ZERO), now), 0, false);
            assert_eq!(before(&late, now), Step::Ask, "{mode:?}");
        }
    }

    #[test]
    fn a_request_asks_when_nothing_holds_it_back() {
        let now = Instant::now();
        for mode in MODES {
            let waiting = state(mode, bounds(100, None, now), 4, true);
            assert_eq!(before(&waiting, now), Step::Ask, "{mode:?}");
        }
    }

    #[test]
    fn the_first_refusal_queues_and_later_ones_sleep() {
        let now = Instant::now();
        let roomy = bounds(100, None, now);
        for mode in MODES {
            for answer in [busy(None), lost_reply()] {
                let first = state(mode, roomy, 1, false);
                let step = after(&first, &answer, now);
                // A set knows which lock to wait for only from a busy answer.
                match (mode, answer.is_ok()) {
                    (WaitKind::Set, false) => assert!(matches!(step, Step::Sleep { .. })),
                    _ => assert_eq!(step, Step::Queue { at: 0 }, "{mode:?} {answer:?}"),
                }
                let queued = state(mode, roomy, 2, true);
                let step = after(&queued, &answer, now);
                assert!(matches!(step, Step::Sleep { .. }), "{mode:?} {step:?}");
            }
        }
    }

    #[test]
    fn a_set_busy_on_another_lock_moves_to_its_queue() {
        let now = Instant::now();
        let mut set = state(WaitKind::Set, bounds(100, None, now), 3, true);
        set.busy_at = 2;
        let answer = Ok(AcquireAnswer::Busy {
            at: 2,
            holder_ttl: None,
            holder: None,
        });
        assert_eq!(after(&set, &answer, now), Step::Queue { at: 2 });
        set.queued_at = Some(2);
        assert!(matches!(after(&set, &answer, now), Step::Sleep { .. }));
    }

    #[test]
    fn a_plain_request_waits_while_a_task_of_its_manager_holds_the_lock() {
        let now = Instant::now();
        let long = Backoff::new(Duration::from_secs(3600));
        let mut waiting = state(WaitKind::Plain, bounds(u32::MAX, None, now), 2, true);
        waiting.announced = true;
        waiting.held_here = Some(now + Duration::from_millis(30));
        let next = step::<()>(&waiting, None, &long, now);
        // Until just past the sibling's lease: its release hands the lock over before that.
        assert_eq!(until(next), now + Duration::from_millis(31));
        // Within the deadline.
        waiting.bounds.deadline = Some(now + Duration::from_millis(10));
        let next = step::<()>(&waiting, None, &long, now);
        assert_eq!(until(next), now + Duration::from_millis(10));
    }

    #[test]
    fn only_a_plain_request_sits_out_other_processes_turns() {
        let now = Instant::now();
        let sit = now + Duration::from_millis(5);
        let minute = busy(Some(Duration::from_secs(60)));
        for mode in MODES {
            let mut waiting = state(mode, bounds(u32::MAX, None, now), 2, true);
            waiting.sitting_out = Some(sit);
            waiting.announced = true;
            let asked = after(&waiting, &minute, now);
            match mode {
                WaitKind::Plain => {
                    // (A backoff long enough that its full jitter never ends before the sit.)
                    let long = Backoff::new(Duration::from_secs(3600));
                    assert_eq!(until(step::<()>(&waiting, None, &long, now)), sit);
                    assert_eq!(until(asked), sit);
                }
                // Sets and fair requests ask, and their sleeps are not cut short by it.
                WaitKind::Set => {
                    assert_eq!(before(&waiting, now), Step::Ask);
                    let lease_end = now + Duration::from_secs(60) + Duration::from_millis(1);
                    assert_eq!(until(asked), lease_end);
                }
                WaitKind::Fair => {
                    assert_eq!(before(&waiting, now), Step::Ask);
                    assert_eq!(until(asked), now + FAIR_REFRESH);
                }
            }
        }
    }

    #[test]
    fn the_timer_is_bounded_by_the_holder_the_deadline_and_a_sit_out() {
        let now = Instant::now();
        let long = Backoff::new(Duration::from_secs(3600));
        let sleep = |state: &State, answer: &Answer, backoff: &Backoff| {
            until(step(state, Some(answer), backoff, now))
        };
        let roomy = state(WaitKind::Plain, bounds(100, None, now), 5, true);
        // The holder's lease ends in 30 ms: nobody announces an expiry.
        let soon_free = busy(Some(Duration::from_millis(30)));
        assert!(sleep(&roomy, &soon_free, &long) <= now + Duration::from_millis(31));
        // The deadline comes first.
        let soon = state(
            WaitKind::Plain,
            bounds(100, Some(Duration::from_millis(10)), now),
            5,
            true,
        );
        assert!(sleep(&soon, &busy(None), &long) <= now + Duration::from_millis(10));
        // A sit-out ends first.
        let mut sitting = roomy;
        sitting.sitting_out = Some(now + Duration::from_millis(5));
        assert_eq!(
            sleep(&sitting, &busy(None), &long),
            now + Duration::from_millis(5)
        );
        // Otherwise the backoff, within its ceiling.
        let first = state(WaitKind::Plain, bounds(100, None, now), 1, true);
        assert!(sleep(&first, &busy(None), &backoff()) <= now + backoff().ceiling());
    }

    #[test]
    fn a_subscribed_waiter_bounded_by_time_sleeps_until_the_lease_ends() {
        let now = Instant::now();
        // A backoff of 50 ms would look again within 1.6 s; the holder has a minute left.
        let minute = busy(Some(Duration::from_secs(60)));
        let lease_end = now + Duration::from_secs(60) + Duration::from_millis(1);
        for mode in [WaitKind::Plain, WaitKind::Set] {
            for attempts in [2, 3, 40] {
                let mut heard = state(mode, bounds(u32::MAX, None, now), attempts, true);
                heard.announced = true;
                assert_eq!(until(after(&heard, &minute, now)), lease_end);
            }
            let mut heard = state(mode, bounds(u32::MAX, None, now), 2, true);
            heard.announced = true;
            // A lease that ended as the answer came: look again at once (1 ms).
            let gone = busy(Some(Duration::ZERO));
            assert!(until(after(&heard, &gone, now)) <= now + Duration::from_millis(1));
            // Still within the deadline.
            heard.bounds.deadline = Some(now + Duration::from_secs(2));
            assert_eq!(
                until(after(&heard, &minute, now)),
                now + Duration::from_secs(2)
            );
        }
    }

    #[test]
    fn other_plain_waiters_keep_the_backoff() {
        let now = Instant::now();
        let ceiling = now + backoff().ceiling();
        let by_time = bounds(u32::MAX, None, now);
        let minute = busy(Some(Duration::from_secs(60)));
        // Not subscribed: nothing would tell it of a release.
        let unheard = state(WaitKind::Plain, by_time, 9, true);
        // No lease known (a key without expiry, or a failed attempt).
        let mut unknown = unheard;
        unknown.announced = true;
        for _ in 0..20 {
            assert!(until(after(&unheard, &minute, now)) <= ceiling);
            assert!(until(after(&unknown, &busy(None), now)) <= ceiling);
            assert!(until(after(&unknown, &lost_reply(), now)) <= ceiling);
        }
        // A number of retries is spent at the backoff's pace, subscribed or not.
        let mut counted = state(WaitKind::Plain, bounds(5, None, now), 3, true);
        counted.announced = true;
        for _ in 0..20 {
            assert!(until(after(&counted, &minute, now)) <= ceiling);
        }
    }

    #[test]
    fn a_fair_waiter_asks_again_within_the_refresh_of_its_place() {
        let now = Instant::now();
        let refresh = now + FAIR_REFRESH;
        let by_time = bounds(u32::MAX, None, now);
        // Subscribed or not, by time it waits for the holder's lease to end...
        for announced in [false, true] {
            let mut fair = state(WaitKind::Fair, by_time, 3, true);
            fair.announced = announced;
            let short = busy(Some(Duration::from_millis(30)));
            assert_eq!(
                until(after(&fair, &short, now)),
                now + Duration::from_millis(31)
            );
            // ...but never past the renewal of its place, nor without a lease known.
            let minute = busy(Some(Duration::from_secs(60)));
            assert_eq!(until(after(&fair, &minute, now)), refresh);
            assert_eq!(until(after(&fair, &busy(None), now)), refresh);
            assert_eq!(until(after(&fair, &lost_reply(), now)), refresh);
        }
        // A number of retries is spent at the backoff's pace, within the refresh too.
        let long = Backoff::new(Duration::from_secs(3600));
        let counted = state(WaitKind::Fair, bounds(5, None, now), 3, true);
        for _ in 0..20 {
            let next = step(&counted, Some(&busy(None)), &long, now);
            assert!(until(next) <= refresh);
        }
        // And within the deadline.
        let soon = state(
            WaitKind::Fair,
            bounds(u32::MAX, Some(Duration::from_millis(10)), now),
            3,
            true,
        );
        assert_eq!(
            until(after(&soon, &busy(None), now)),
            now + Duration::from_millis(10)
        );
    }

    #[test]
    fn transient_failures_are_told_from_fatal_ones() {
        assert!(lost_reply().is_err_and(|error| is_transient(&error)));
        assert!(fatal().is_err_and(|error| !is_transient(&error)));
    }
}
