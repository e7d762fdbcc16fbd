//! What a release does about the local waiters of its key, as a pure function of the
//! local head's standing offer, the run of hand-offs so far, what the releasing holder may
//! pass, and the time ([`choose`]); [`Waiters::next`](super::Waiters::next) carries it out.

use std::time::{Duration, Instant};

/// Local hand-offs in a row, at most, before a release goes to everyone.
pub(super) const CHAIN: u32 = 4;
/// The longest run of local hand-offs; a tenth of the holder's lease when that is shorter.
pub(super) const SLICE: Duration = Duration::from_millis(50);

/// The bounds of a cohort's run: local passes in a row, at most, and for how long (see
/// [`LockManagerBuilder::cohort`](crate::LockManagerBuilder::cohort)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CohortBounds {
    pub(crate) passes: u32,
    pub(crate) time: Duration,
}

impl Default for CohortBounds {
    fn default() -> Self {
        Self {
            passes: 64,
            time: Duration::from_millis(10),
        }
    }
}

/// What a releasing holder may pass locally: its request allows cohorts, and what is left
/// of its server lease.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Passable {
    /// What is left of the server hold's lease, by the local clock.
    pub(crate) remaining: Duration,
    /// How many passes the hold is from the server's grant.
    pub(crate) passes: u32,
    /// When its run's first pass was made (none yet: this one would be).
    pub(crate) run_began: Option<Instant>,
}

/// What a standing offer asks for: the lease its waiter would take the lock with, and
/// whether the waiter may take it by a local pass.
#[derive(Debug, Clone, Copy)]
pub(super) struct Terms {
    pub(super) lease: Duration,
    pub(super) cohort: bool,
}

/// What a release does about the local waiters of its key (see [`Next`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Choice {
    Release,
    HandOff,
    Pass,
    Yield,
}

/// What a release of a lock whose lease is `lease` does, given the local head's standing
/// `offer` (none: nobody here stands ready), the run of hand-offs so far (`chain`: how many,
/// since when), what the releasing holder may pass (`passable`) and the cohort's bounds;
/// and the run of hand-offs after it.
///
/// Only an offer stands aside other processes, and only once its hand-off has landed: a
/// head that cannot take a hand-off (another kind, a set, a fair or fenced request) or is
/// asking the server itself leaves the release to everyone, with its wake-up. A release to
/// everyone ends any run of hand-offs.
pub(super) fn choose(
    offer: Option<Terms>,
    chain: Option<(u32, Instant)>,
    lease: Duration,
    passable: Option<Passable>,
    bounds: CohortBounds,
    now: Instant,
) -> (Choice, Option<(u32, Instant)>) {
    let Some(offer) = offer else {
        return (Choice::Release, None);
    };
    // Passed as it is only to a waiter that asked for the very lease the hold has (so the
    // watchdog renews it to what the waiter asked, and it never outlives what the waiter
    // agreed to), while at least half of it is left; otherwise the server hand-off gives
    // the waiter a lease of its own. A run is bounded by what its hand-offs are.
    let pass = passable.is_some_and(|passable| {
        offer.cohort && bounds.passes > 0 && offer.lease == lease && passable.remaining >= lease / 2
    });
    let (most, longest) = match pass {
        true => (bounds.passes, bounds.time.min(lease / 10)),
        false => (CHAIN, SLICE.min(lease / 10)),
    };
    // The run's own count and age bound it too: the queue's chain starts afresh when its
    // last waiter leaves (the holders of a run may all be inside or releasing), while
    // the run it counted goes on.
    let run_over = pass
        && passable.is_some_and(|passable| {
            passable.passes >= most
                || passable
                    .run_began
                    .is_some_and(|began| now.duration_since(began) >= longest)
        });
    let (count, since) = chain.unwrap_or((0, now));
    if run_over || count >= most || now.duration_since(since) >= longest {
        // The run of hand-offs is over: other processes' turns come.
        return (Choice::Yield, None);
    }
    let chain = Some((count + 1, since));
    match pass {
        true => (Choice::Pass, chain),
        false => (Choice::HandOff, chain),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(10);

    fn offer(lease: Duration, cohort: bool) -> Option<Terms> {
        Some(Terms { lease, cohort })
    }

    /// A holder with `remaining` of its lease left, `passes` from the server's grant, whose
    /// run began at `run_began`.
    fn holder(remaining: Duration, passes: u32, run_began: Option<Instant>) -> Option<Passable> {
        Some(Passable {
            remaining,
            passes,
            run_began,
        })
    }

    fn bounds() -> CohortBounds {
        CohortBounds::default()
    }

    #[test]
    fn a_release_with_nobody_ready_goes_to_everyone_and_ends_the_run() {
        let now = Instant::now();
        for passable in [None, holder(LEASE, 0, None)] {
            let chosen = choose(None, Some((2, now)), LEASE, passable, bounds(), now);
            assert_eq!(chosen, (Choice::Release, None));
        }
    }

    #[test]
    fn a_ready_head_is_handed_the_lock_through_the_server() {
        let now = Instant::now();
        // The holder may not pass (fenced, min_hold, opted out), or the waiter may not take
        // a pass, or asked for another lease, or too little of the lease is left.
        let cases = [
            (offer(LEASE, true), None),
            (offer(LEASE, false), holder(LEASE, 0, None)),
            (offer(LEASE * 2, true), holder(LEASE, 0, None)),
            (
                offer(LEASE, true),
                holder(LEASE / 2 - Duration::from_millis(1), 0, None),
            ),
        ];
        for (terms, passable) in cases {
            let chosen = choose(terms, None, LEASE, passable, bounds(), now);
            assert_eq!(
                chosen,
                (Choice::HandOff, Some((1, now))),
                "{terms:?} {passable:?}"
            );
        }
        // Nor when the manager passes nothing.
        let none = CohortBounds {
            passes: 0,
            ..bounds()
        };
        let chosen = choose(
            offer(LEASE, true),
            None,
            LEASE,
            holder(LEASE, 0, None),
            none,
            now,
        );
        assert_eq!(chosen.0, Choice::HandOff);
    }

    #[test]
    fn a_ready_head_that_asked_for_the_same_lease_is_passed_the_hold() {
        let now = Instant::now();
        let chosen = choose(
            offer(LEASE, true),
            Some((3, now)),
            LEASE,
            holder(LEASE / 2, 3, Some(now)),
            bounds(),
            now,
        );
        assert_eq!(chosen, (Choice::Pass, Some((4, now))));
    }

    #[test]
    fn a_run_of_hand_offs_yields_at_its_count_or_its_age() {
        let now = Instant::now();
        let terms = offer(LEASE, false);
        let last = choose(terms, Some((CHAIN - 1, now)), LEASE, None, bounds(), now);
        assert_eq!(last.0, Choice::HandOff);
        let over = choose(terms, Some((CHAIN, now)), LEASE, None, bounds(), now);
        assert_eq!(over, (Choice::Yield, None));
        let old = now - SLICE;
        let aged = choose(terms, Some((1, old)), LEASE, None, bounds(), now);
        assert_eq!(aged, (Choice::Yield, None));
        // A short lease makes the slice a tenth of it.
        let short = Duration::from_millis(100);
        let since = now - Duration::from_millis(10);
        let chosen = choose(
            offer(short, false),
            Some((1, since)),
            short,
            None,
            bounds(),
            now,
        );
        assert_eq!(chosen.0, Choice::Yield);
    }

    #[test]
    fn a_run_of_passes_yields_at_the_cohort_bounds_or_the_runs_own() {
        let now = Instant::now();
        let terms = offer(LEASE, true);
        let bounds = bounds();
        let fresh = holder(LEASE, 0, None);
        // The queue's count and age.
        let counted = choose(terms, Some((bounds.passes, now)), LEASE, fresh, bounds, now);
        assert_eq!(counted, (Choice::Yield, None));
        let aged = choose(
            terms,
            Some((1, now - bounds.time)),
            LEASE,
            fresh,
            bounds,
            now,
        );
        assert_eq!(aged, (Choice::Yield, None));
        // The run's own, when the queue's chain started afresh.
        let many = holder(LEASE, bounds.passes, Some(now));
        assert_eq!(
            choose(terms, None, LEASE, many, bounds, now).0,
            Choice::Yield
        );
        let long = holder(LEASE, 1, Some(now - bounds.time));
        assert_eq!(
            choose(terms, None, LEASE, long, bounds, now).0,
            Choice::Yield
        );
        // Within them, it passes; past the hand-offs' own count, still.
        let within = choose(terms, Some((CHAIN, now)), LEASE, fresh, bounds, now);
        assert_eq!(within.0, Choice::Pass);
    }
}
