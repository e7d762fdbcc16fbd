//! Whether the watchdog is falling behind: renewals that go out late and leases that ran
//! out first, counted, and a warning at most once a period.

use std::time::{Duration, Instant};

use super::{Leased, Leases};

/// The watchdog says it is falling behind at most once per this period.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// Logs the warning [`Behind`] has for `now`, if any (`more_due`: this look left leases due).
pub(super) fn warn_if_behind(leases: &mut Leases, now: Instant, more_due: bool) {
    if let Some(warning) = leases.behind.warning(now) {
        tracing::warn!(
            late = warning.late,
            ran_out = warning.ran_out,
            lock = %warning.lock,
            watched = leases.by_id.len(),
            more_due,
            least_left = ?warning.least_left,
            ttl = ?warning.ttl,
            "lease renewals are falling behind: {} renewals went out with less than half of \
             their lease left (the latest {:?} of {:?}) and {} leases ran out before their \
             renewal; leases will be lost if this goes on. Hold fewer watched locks per \
             manager, use a longer ttl, or give Redis and this process more CPU",
            warning.late,
            warning.least_left,
            warning.ttl,
            warning.ran_out,
        );
    }
}

/// Whether a renewal that finds `left` of a `ttl` lease is late. Renewals are planned when a
/// third of the lease has passed (two thirds left): one sent with less than half left comes a
/// sixth of the lease behind its plan, and a watchdog that keeps slipping loses leases next.
pub(super) fn is_late(left: Duration, ttl: Duration) -> bool {
    left < ttl / 2
}

/// Late renewals since the watchdog last said it was falling behind.
#[derive(Debug, Default)]
pub(super) struct Behind {
    /// Late renewals not yet reported.
    late: u64,
    /// Leases that ran out before their renewal, not yet reported.
    ran_out: u64,
    /// Late renewals since the manager was built.
    pub(super) total: u64,
    /// The least lease left of those, its ttl and its lock.
    least: Option<(Duration, Duration, String)>,
    /// When the last warning went out.
    warned: Option<Instant>,
}

/// What a warning reports: how many renewals went out late, and the latest of them; how
/// many leases ran out first.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Warning {
    late: u64,
    ran_out: u64,
    least_left: Duration,
    ttl: Duration,
    lock: String,
}

impl Behind {
    /// A renewal of `lock` went out late, with `left` of its `ttl`.
    pub(super) fn late(&mut self, left: Duration, ttl: Duration, lock: &str) {
        self.late += 1;
        self.total += 1;
        self.note(left, ttl, lock);
    }

    /// Keeps the latest renewal so far: the one with the least lease left.
    fn note(&mut self, left: Duration, ttl: Duration, lock: &str) {
        if self.least.as_ref().is_none_or(|(least, ..)| left < *least) {
            self.least = Some((left, ttl, lock.to_owned()));
        }
    }

    /// A lease of `hold` ran out before its renewal went out: as late as a renewal can be.
    pub(super) fn ran_out(&mut self, hold: &Leased, ttl: Duration) {
        self.ran_out += 1;
        self.note(Duration::ZERO, ttl, &hold.lock());
    }

    /// The warning to give at `now`, if renewals went out late (or leases ran out) since the
    /// last one and it was at least [`WARN_EVERY`] ago (the first one at once).
    fn warning(&mut self, now: Instant) -> Option<Warning> {
        self.least.as_ref()?;
        if self
            .warned
            .is_some_and(|warned| now.saturating_duration_since(warned) < WARN_EVERY)
        {
            return None;
        }
        let (least_left, ttl, lock) = self.least.take()?;
        self.warned = Some(now);
        Some(Warning {
            late: std::mem::take(&mut self.late),
            ran_out: std::mem::take(&mut self.ran_out),
            least_left,
            ttl,
            lock,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{Behind, WARN_EVERY, Warning, is_late};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    #[test]
    fn a_renewal_is_late_with_less_than_half_of_its_lease_left() {
        let ttl = Duration::from_secs(3);
        // Planned at a third of the lease: two thirds left.
        assert!(!is_late(Duration::from_secs(2), ttl));
        assert!(!is_late(Duration::from_millis(1_500), ttl));
        assert!(is_late(Duration::from_millis(1_499), ttl));
        assert!(is_late(Duration::ZERO, ttl));
    }

    #[test]
    fn the_first_late_renewal_warns_at_once_then_at_most_once_a_period() {
        let now = Instant::now();
        let ttl = Duration::from_secs(3);
        let mut behind = Behind::default();
        assert_eq!(behind.warning(now), None, "nothing late: no warning");
        behind.late(Duration::from_millis(900), ttl, "a");
        behind.late(Duration::from_millis(700), ttl, "b");
        behind.late(Duration::from_millis(800), ttl, "c");
        assert_eq!(
            behind.warning(now),
            Some(Warning {
                late: 3,
                ran_out: 0,
                least_left: Duration::from_millis(700),
                ttl,
                lock: "b".to_owned(),
            })
        );
        // More late renewals within the period are counted, not told at once.
        behind.late(Duration::from_millis(600), ttl, "d");
        assert_eq!(behind.warning(now + WARN_EVERY / 2), None);
        behind.late(Duration::from_millis(650), ttl, "e");
        let next = behind.warning(now + WARN_EVERY).expect("a period later");
        assert_eq!((next.late, next.lock.as_str()), (2, "d"));
        // Caught up: nothing more to say.
        assert_eq!(behind.warning(now + WARN_EVERY * 3), None);
        assert_eq!(behind.total, 5);
    }

    #[test]
    fn a_lease_that_ran_out_before_its_renewal_is_warned_of() {
        let now = Instant::now();
        let ttl = Duration::from_secs(3);
        let mut behind = Behind::default();
        behind.late(Duration::from_millis(900), ttl, "a");
        behind.ran_out(&super::Leased::Set(Arc::from(Vec::new())), ttl);
        let warning = behind.warning(now).expect("warned at once");
        assert_eq!((warning.late, warning.ran_out), (1, 1));
        assert_eq!(warning.least_left, Duration::ZERO);
    }
}
