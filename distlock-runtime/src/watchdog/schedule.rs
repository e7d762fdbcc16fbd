//! When each lease must be looked at next: a min-heap of (time, id) with lazy removal, so
//! that registering or dropping a lease costs O(log n) at most, and a tick costs what is due.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::Instant;

/// Ids ordered by when each must be looked at next: a min-heap of (time, id) with lazy
/// removal, beside each id's current time. Setting or removing an id costs O(log n) at most;
/// taking what is due costs O(log n) per id taken (and per stale entry skipped, each pushed
/// once).
#[derive(Debug, Default)]
pub(crate) struct Schedule {
    heap: BinaryHeap<Reverse<(Instant, u64)>>,
    at: HashMap<u64, Instant>,
}

impl Schedule {
    /// Schedules `id` at `at`, replacing its earlier time.
    pub(crate) fn set(&mut self, id: u64, at: Instant) {
        if self.at.insert(id, at) != Some(at) {
            self.heap.push(Reverse((at, id)));
        }
    }

    /// Unschedules `id`.
    pub(crate) fn remove(&mut self, id: u64) {
        self.at.remove(&id);
        // Its heap entry is dropped when it reaches the top; without any id left, at once.
        if self.at.is_empty() {
            self.heap.clear();
        }
    }

    /// The earliest time of any id.
    pub(crate) fn next(&mut self) -> Option<Instant> {
        self.skip_stale();
        self.heap.peek().map(|Reverse((at, _))| *at)
    }

    /// Takes out the earliest id if it is due by `limit`, with its time: the caller sets it
    /// again if it stays.
    pub(crate) fn pop_due(&mut self, limit: Instant) -> Option<(u64, Instant)> {
        self.skip_stale();
        let Reverse((at, id)) = *self.heap.peek()?;
        if at > limit {
            return None;
        }
        self.heap.pop();
        self.at.remove(&id);
        Some((id, at))
    }

    /// Drops the top entries that no longer hold their id's current time.
    fn skip_stale(&mut self) {
        while let Some(Reverse((at, id))) = self.heap.peek() {
            if self.at.get(id) == Some(at) {
                return;
            }
            self.heap.pop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Schedule;
    use std::time::{Duration, Instant};

    fn drain(schedule: &mut Schedule, limit: Instant) -> Vec<u64> {
        std::iter::from_fn(|| schedule.pop_due(limit).map(|(id, _)| id)).collect()
    }

    #[test]
    fn what_is_due_comes_out_in_order_and_nothing_else() {
        let now = Instant::now();
        let at = |ms| now + Duration::from_millis(ms);
        let mut schedule = Schedule::default();
        for (id, ms) in [(1, 30), (2, 10), (3, 50), (4, 20)] {
            schedule.set(id, at(ms));
        }
        assert_eq!(schedule.next(), Some(at(10)));
        assert_eq!(drain(&mut schedule, at(25)), [2, 4]);
        assert_eq!(schedule.next(), Some(at(30)));
        assert_eq!(drain(&mut schedule, at(100)), [1, 3]);
        assert_eq!(schedule.next(), None);
    }

    #[test]
    fn a_new_time_replaces_the_old_one() {
        let now = Instant::now();
        let at = |ms| now + Duration::from_millis(ms);
        let mut schedule = Schedule::default();
        schedule.set(1, at(10));
        schedule.set(2, at(20));
        // Moved later: not due at its old time.
        schedule.set(1, at(30));
        assert_eq!(drain(&mut schedule, at(25)), [2]);
        // Moved earlier: due at its new time, once.
        schedule.set(1, at(5));
        assert_eq!(drain(&mut schedule, at(100)), [1]);
        assert_eq!(schedule.next(), None);
    }

    #[test]
    fn a_removed_id_never_comes_out() {
        let now = Instant::now();
        let at = |ms| now + Duration::from_millis(ms);
        let mut schedule = Schedule::default();
        for id in 0..100 {
            schedule.set(id, at(id));
        }
        for id in (0..100).filter(|id| id % 3 != 0) {
            schedule.remove(id);
        }
        let due = drain(&mut schedule, at(1000));
        assert_eq!(due, (0..100).filter(|id| id % 3 == 0).collect::<Vec<_>>());
        // Removing everything leaves no stale entry behind.
        schedule.set(7, at(1));
        schedule.remove(7);
        assert_eq!(schedule.next(), None);
        assert!(schedule.heap.is_empty());
    }

    #[test]
    fn an_id_taken_out_and_set_again_comes_out_at_its_new_time() {
        let now = Instant::now();
        let at = |ms| now + Duration::from_millis(ms);
        let mut schedule = Schedule::default();
        schedule.set(1, at(10));
        assert_eq!(schedule.pop_due(at(10)), Some((1, at(10))));
        assert_eq!(schedule.pop_due(at(10)), None);
        schedule.set(1, at(40));
        assert_eq!(drain(&mut schedule, at(39)), Vec::<u64>::new());
        assert_eq!(drain(&mut schedule, at(40)), [1]);
    }
}
