//! Lease renewal: one watchdog per manager for every lease that asked for it.
//!
//! The watchdog is a single task on the manager's driver runtime. It wakes when the earliest
//! renewal is due and renews every lease due by then (and those nearly due) with a
//! token-checked script, up to 512 leases per call and several calls in flight at once, so N
//! held leases cost N/512 commands per tick, not N timers. The leases wait in a [`Schedule`]
//! ordered by when each must be looked at next: registering or dropping a lease costs
//! O(log n) at most, and a tick costs what is due, not what is held.
//! A lease is renewed at about a third of its TTL; a lease whose renewal finds another owner
//! or no key is marked lost and dropped, and one is dropped as soon as its guard is released.
//!
//! Renewal also requires the holder to be alive: each tick sends a tiny probe task to the
//! runtime that acquired the lease, and a lease whose holder's runtime has left a probe
//! unrun for half a lease (that runtime is blocked or gone) is not renewed, so it expires
//! instead of outliving a stuck holder. A watchdog that runs late itself is not taken for a
//! stuck holder. `max_hold` ends renewal for a body that never finishes.
//!
//! A watchdog that falls behind says so before leases are lost: a renewal that goes out with
//! less than half of its lease left is counted and warned of (see [`is_late`]), and so is a
//! lease that ran out before its renewal could go out.

use std::borrow::Cow;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tokio::runtime::Handle;
use tokio::sync::Notify;

use crate::backend::{Backend, HoldIds, Renewal};
use crate::context::Held;
use crate::driver::Driver;
use crate::lease::{LeaseState, saturating_add};

/// At most this many leases per renewal script call.
const BATCH: usize = 512;

/// At most this many renewal calls in flight at once.
const IN_FLIGHT: usize = 8;

/// At most this many leases taken out per look: the driver's thread, which carries the
/// manager's round trips too, never spends long on one.
const PER_LOOK: usize = BATCH * IN_FLIGHT;

/// The watchdog says it is falling behind at most once per this period.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// A registered lease; it stops being renewed when this handle is dropped.
#[derive(Debug)]
pub(crate) struct Registration {
    id: u64,
    watchdog: Weak<Renewals>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(shared) = self.watchdog.upgrade() {
            shared.lock().remove(self.id);
        }
    }
}

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

/// The base of the probe timestamps.
static EPOCH: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);

fn since_epoch(at: Instant) -> u64 {
    nanos(at.saturating_duration_since(*EPOCH))
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The holds one lease covers: one lock's, or every lock of a set, renewed together (the
/// set's lease goes on only if every one of its locks was renewed, or `remaining()` would
/// promise more than a lock that was not has left).
#[derive(Debug, Clone)]
pub(crate) enum Holds {
    /// One lock's hold.
    One(Arc<HoldIds>),
    /// The holds of a set's locks.
    Set(Arc<[Arc<HoldIds>]>),
    /// A hold nested in a set's lock, `held`: it shares the set's lease, so it renews every
    /// lock of the set still held (all of them while the set is, its own once the set gave
    /// the others back).
    InSet {
        /// Its own lock's hold, renewed alone once the hold is gone.
        ids: Arc<HoldIds>,
        /// Weak: a registration keeps no hold alive for the context to find.
        held: std::sync::Weak<Held>,
    },
}

impl Holds {
    /// The holds to renew now.
    fn all(&self) -> Cow<'_, [Arc<HoldIds>]> {
        match self {
            Self::One(hold) => Cow::Borrowed(std::slice::from_ref(hold)),
            Self::Set(holds) => Cow::Borrowed(holds),
            Self::InSet { ids, held } => {
                let sharers = held.upgrade().map(|held| held.lease_sharers());
                match sharers {
                    Some(sharers) if !sharers.is_empty() => Cow::Owned(sharers),
                    _ => Cow::Borrowed(std::slice::from_ref(ids)),
                }
            }
        }
    }

    /// The first lock, which names the lease in logs.
    fn lock(&self) -> String {
        self.all()
            .first()
            .map_or_else(String::new, |hold| hold.lock.clone())
    }
}

/// What a renewal extends: the lock, the share's lease key for shares, and the owner token.
#[derive(Debug)]
pub(crate) struct Renewable {
    /// The holds to renew: their locks, shares and owner tokens.
    pub(crate) holds: Holds,
    pub(crate) metrics: crate::metrics::Labels,
}

/// What renewals go through: the manager's driver, which runs the watchdog's task, and its
/// backend, which that task renews through.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Through<'a> {
    pub(crate) driver: &'a Driver,
    pub(crate) backend: &'a Backend,
}

/// Counters of the renewal work done by a manager.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) round_trips: AtomicU64,
    pub(crate) renewed: AtomicU64,
    pub(crate) lost: AtomicU64,
}

#[derive(Debug, Default)]
pub(crate) struct Watchdog {
    shared: Arc<Renewals>,
}

#[derive(Debug, Default)]
struct Renewals {
    leases: Mutex<Leases>,
    wake: Notify,
    counters: Counters,
}

#[derive(Debug, Default)]
struct Leases {
    by_id: HashMap<u64, Lease>,
    /// When to look at each lease next: its renewal, or its local deadline if sooner.
    schedule: Schedule,
    next_id: u64,
    running: bool,
    /// When the task will look next on its own, while it sleeps: a lease due earlier wakes it.
    sleeps_until: Option<Instant>,
    /// How far behind the renewals run, and when the watchdog last said so.
    behind: Behind,
}

impl Leases {
    /// Schedules the lease `id` for its next look.
    fn reschedule(&mut self, id: u64) {
        if let Some(lease) = self.by_id.get(&id) {
            let at = lease.next_renewal.min(lease.state.valid_until());
            self.schedule.set(id, at);
        }
    }

    fn remove(&mut self, id: u64) -> Option<Lease> {
        self.schedule.remove(id);
        self.by_id.remove(&id)
    }

    fn clear(&mut self) {
        self.by_id.clear();
        self.schedule = Schedule::default();
    }
}

#[derive(Debug)]
struct Lease {
    hold: Holds,
    ttl: Duration,
    state: Arc<LeaseState>,
    next_renewal: Instant,
    stop_at: Option<Instant>,
    holder: Option<Handle>,
    /// When the holder's runtime last ran a probe, in nanoseconds since `EPOCH`.
    alive: Arc<AtomicU64>,
    /// When the last probe was sent to it, likewise.
    probed: u64,
    metrics: crate::metrics::Labels,
}

impl Renewals {
    fn lock(&self) -> std::sync::MutexGuard<'_, Leases> {
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Watchdog {
    pub(crate) fn counters(&self) -> &Counters {
        &self.shared.counters
    }

    /// How many leases are registered for renewal.
    pub(crate) fn watched(&self) -> usize {
        self.shared.lock().by_id.len()
    }

    /// How many renewals went out late (see [`is_late`]) since the manager was built.
    pub(crate) fn late_renewals(&self) -> u64 {
        self.shared.lock().behind.total
    }

    /// Stops renewing every lease; the task ends at its next look.
    pub(crate) fn stop(&self) {
        self.shared.lock().clear();
        self.shared.wake.notify_one();
    }

    /// Starts renewing the hold `target` every ~`ttl`/3 until the registration is dropped or
    /// `max_hold` has passed since `acquired`, `through` the manager's driver and backend.
    pub(crate) fn register<'a>(
        &self,
        through: impl Into<Through<'a>>,
        target: Renewable,
        state: Arc<LeaseState>,
        acquired: Instant,
        max_hold: Option<Duration>,
    ) -> Registration {
        let ttl = state.ttl();
        let Renewable {
            holds: hold,
            metrics,
        } = target;
        let lease = Lease {
            hold,
            ttl,
            state,
            next_renewal: saturating_add(acquired, ttl / 3),
            // Too far away for the clock to count: renew for as long as the guard lives.
            stop_at: max_hold.and_then(|max| acquired.checked_add(max)),
            holder: Handle::try_current().ok(),
            alive: Arc::new(AtomicU64::new(since_epoch(acquired))),
            probed: since_epoch(acquired),
            metrics,
        };
        let (id, start, wake) = {
            let mut leases = self.shared.lock();
            let id = leases.next_id;
            leases.next_id += 1;
            let at = lease.next_renewal.min(lease.state.valid_until());
            leases.by_id.insert(id, lease);
            leases.schedule.set(id, at);
            // The task sleeps past this lease's first look: wake it. Otherwise it finds the
            // lease in the schedule in time, and a registration costs it nothing.
            let wake = leases.sleeps_until.is_some_and(|sleeps| at < sleeps);
            (id, !std::mem::replace(&mut leases.running, true), wake)
        };
        if start {
            let Through { driver, backend } = through.into();
            driver.spawn(run(self.shared.clone(), backend.clone()));
        } else if wake {
            self.shared.wake.notify_one();
        }
        Registration {
            id,
            watchdog: Arc::downgrade(&self.shared),
        }
    }
}

/// One lease of a batch: what to send, and where to put the answer.
struct Due {
    id: u64,
    hold: Holds,
    ttl: Duration,
    state: Arc<LeaseState>,
    metrics: crate::metrics::Labels,
}

/// The watchdog task: ends when no lease is left, or with the manager's runtime.
async fn run(shared: Arc<Renewals>, backend: Backend) {
    loop {
        // Registered before the look: a registration made after it wakes the sleep below.
        let wake = shared.wake.notified();
        tokio::pin!(wake);
        wake.as_mut().enable();
        let (due, next_wake) = {
            let mut leases = shared.lock();
            let due = collect_due(&mut leases, &shared.counters);
            if leases.by_id.is_empty() {
                leases.running = false;
                leases.sleeps_until = None;
                return;
            }
            let next_wake = leases
                .schedule
                .next()
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
            leases.sleeps_until = due.is_empty().then_some(next_wake);
            (due, next_wake)
        };
        if !due.is_empty() {
            renew(&shared, &backend, due).await;
            continue;
        }
        let sleep = tokio::time::sleep_until(next_wake.into());
        tokio::pin!(sleep);
        tokio::select! {
            () = &mut wake => {}
            () = &mut sleep => {}
        }
    }
}

/// Takes out the leases to renew now (at most [`PER_LOOK`]); drops the ones past
/// `max_hold`, lost, or whose holder did not answer its probe. Costs what is due, not what is
/// held.
fn collect_due(leases: &mut Leases, counters: &Counters) -> Vec<Due> {
    let now = Instant::now();
    let mut due = Vec::new();
    // Renew what falls due within half an interval of the first lease due: two groups of
    // leases taken at different times then merge within a round, and share round trips from
    // then on.
    let mut limit = now;
    while due.len() < PER_LOOK {
        let Some((id, _)) = leases.schedule.pop_due(limit) else {
            break;
        };
        let Some(lease) = leases.by_id.get_mut(&id) else {
            continue;
        };
        if lease.stop_at.is_some_and(|stop| now >= stop) {
            tracing::debug!(lock = %lease.hold.lock(), "max_hold reached: renewal stops");
            leases.by_id.remove(&id);
            continue;
        }
        if lease.state.is_lost() {
            if !lease.state.is_marked_lost() {
                // Its local deadline passed before its renewal could go out: the watchdog
                // fell behind by two thirds of the lease.
                leases.behind.ran_out(&lease.hold, lease.ttl);
                counters.lost.fetch_add(1, Ordering::Release);
                crate::metrics::renewal(lease.metrics, crate::metrics::RenewalOutcome::Lost);
            }
            lease.state.mark_lost();
            leases.by_id.remove(&id);
            continue;
        }
        if lease.next_renewal > saturating_add(now, lease.ttl / 6) {
            // Looked at for its local deadline, which a renewal moved on meanwhile.
            leases.reschedule(id);
            continue;
        }
        limit = limit.max(saturating_add(now, lease.ttl / 6));
        let holder_alive = lease.probe(now);
        lease.next_renewal = saturating_add(now, lease.ttl / 3);
        if holder_alive {
            let left = lease.state.valid_until().saturating_duration_since(now);
            if is_late(left, lease.ttl) {
                leases.behind.late(left, lease.ttl, &lease.hold.lock());
                crate::metrics::renewal_late(lease.metrics);
            }
            due.push(Due {
                id,
                hold: lease.hold.clone(),
                ttl: lease.ttl,
                state: lease.state.clone(),
                metrics: lease.metrics,
            });
        } else {
            tracing::warn!(lock = %lease.hold.lock(), "the holder's runtime did not answer: not renewing");
        }
        leases.reschedule(id);
    }
    warn_if_behind(leases, now, due.len() == PER_LOOK);
    due
}

impl Lease {
    /// Whether the holder's runtime is alive at `now`: it ran the last probe sent to it, or
    /// has not had half a lease to run it yet (how late this look is does not count against
    /// the holder). A new probe goes out once the last one ran: one left unrun keeps its age.
    fn probe(&mut self, now: Instant) -> bool {
        let waiting = self.alive.load(Ordering::Acquire) < self.probed;
        let alive = !waiting || since_epoch(now).saturating_sub(self.probed) <= nanos(self.ttl / 2);
        if !waiting {
            self.probed = since_epoch(now);
            match &self.holder {
                Some(holder) => {
                    let ran = self.alive.clone();
                    let probe =
                        async move { ran.store(since_epoch(Instant::now()), Ordering::Release) };
                    drop(holder.spawn(probe));
                }
                None => self.alive.store(self.probed, Ordering::Release),
            }
        }
        alive
    }
}

/// Logs the warning [`Behind`] has for `now`, if any (`more_due`: this look left leases due).
fn warn_if_behind(leases: &mut Leases, now: Instant, more_due: bool) {
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
fn is_late(left: Duration, ttl: Duration) -> bool {
    left < ttl / 2
}

/// Late renewals since the watchdog last said it was falling behind.
#[derive(Debug, Default)]
struct Behind {
    /// Late renewals not yet reported.
    late: u64,
    /// Leases that ran out before their renewal, not yet reported.
    ran_out: u64,
    /// Late renewals since the manager was built.
    total: u64,
    /// The least lease left of those, its ttl and its lock.
    least: Option<(Duration, Duration, String)>,
    /// When the last warning went out.
    warned: Option<Instant>,
}

/// What a warning reports: how many renewals went out late, and the latest of them; how
/// many leases ran out first.
#[derive(Debug, PartialEq, Eq)]
struct Warning {
    late: u64,
    ran_out: u64,
    least_left: Duration,
    ttl: Duration,
    lock: String,
}

impl Behind {
    /// A renewal of `lock` went out late, with `left` of its `ttl`.
    fn late(&mut self, left: Duration, ttl: Duration, lock: &str) {
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
    fn ran_out(&mut self, hold: &Holds, ttl: Duration) {
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

/// Renews `due`, [`BATCH`] leases per call, up to [`IN_FLIGHT`] calls at once (on Cluster,
/// each call goes to every node its leases are on, at once).
async fn renew(shared: &Renewals, backend: &Backend, due: Vec<Due>) {
    use futures_util::StreamExt;
    let mut batches = due.chunks(BATCH);
    let mut in_flight = futures_util::stream::FuturesUnordered::new();
    loop {
        while in_flight.len() < IN_FLIGHT {
            let Some(batch) = batches.next() else {
                break;
            };
            in_flight.push(renew_batch(shared, backend, batch));
        }
        if in_flight.next().await.is_none() {
            return;
        }
    }
}

/// Renews one batch of due leases in one call.
async fn renew_batch(shared: &Renewals, backend: &Backend, batch: &[Due]) {
    {
        let sent = Instant::now();
        // What each lease renews, taken once: a nested hold's set may change meanwhile.
        let holds: Vec<Cow<'_, [Arc<HoldIds>]>> = batch.iter().map(|d| d.hold.all()).collect();
        let items: Vec<Renewal<'_>> = batch
            .iter()
            .zip(&holds)
            .flat_map(|(d, holds)| {
                holds.iter().map(|hold| Renewal {
                    lock: &hold.lock,
                    token: &hold.token,
                    lease: d.ttl,
                })
            })
            .collect();
        shared.counters.round_trips.fetch_add(1, Ordering::Relaxed);
        match backend.renew(&items).await {
            Ok(results) => settle(shared, batch, &holds, results, sent),
            // Try again soon; the local deadline reports the loss if Redis stays away.
            Err(error) => {
                tracing::warn!(%error, leases = batch.len(), "lease renewal failed");
                let mut leases = shared.lock();
                for lease in batch {
                    retry_soon(&mut leases, lease);
                }
            }
        }
    }
}

/// Settles each lease of `batch` from the answers to its holds' renewals (`None`: that
/// hold's slot did not answer, its master cut off or frozen, while other slots did). A lease
/// whose every hold answered is renewed or lost on those answers alone; one with an
/// unanswered hold and none refused is tried again soon, as if the whole call had failed:
/// one master's trouble never costs a lease on another.
fn settle(
    shared: &Renewals,
    batch: &[Due],
    holds: &[Cow<'_, [Arc<HoldIds>]>],
    results: Vec<Option<bool>>,
    sent: Instant,
) {
    let mut leases = shared.lock();
    let mut results = results.into_iter();
    let mut unanswered = 0;
    for (lease, holds) in batch.iter().zip(holds) {
        // A set's lease is renewed only if every one of its locks was.
        let count = holds.len();
        // (Every answer of this lease is taken: the next lease's follow.)
        let (mut renewed, mut refused, mut answered) = (true, false, 0);
        for one in results.by_ref().take(count) {
            match one {
                Some(yes) => {
                    renewed &= yes;
                    refused |= !yes;
                    answered += 1;
                }
                None => renewed = false,
            }
        }
        if !refused && answered < count {
            unanswered += 1;
            retry_soon(&mut leases, lease);
            continue;
        }
        let renewed = renewed && answered == count;
        // An answer after the local deadline finds the lease already lost.
        if renewed && lease.state.renewed(sent, lease.ttl) {
            shared.counters.renewed.fetch_add(1, Ordering::Relaxed);
            crate::metrics::renewal(lease.metrics, crate::metrics::RenewalOutcome::Renewed);
        } else if leases.remove(lease.id).is_some() {
            // (A lease released while its renewal was in flight is not lost.)
            tracing::warn!(lock = %lease.hold.lock(), renewed, "lease lost: renewal found another owner or no key, or came too late");
            // Marked first: a loss that is counted is already seen by the guard.
            lease.state.mark_lost();
            shared.counters.lost.fetch_add(1, Ordering::Release);
            crate::metrics::renewal(lease.metrics, crate::metrics::RenewalOutcome::Lost);
        } else if !renewed {
            // Released while this renewal was in flight, but the key was gone or another
            // owner's already: a holder the lease was passed on to must know.
            lease.state.mark_lost();
        }
    }
    if unanswered > 0 {
        tracing::warn!(
            leases = unanswered,
            "lease renewal failed on part of the cluster"
        );
    }
}

/// Plans the next renewal of `lease` soon: its renewal was not answered.
fn retry_soon(leases: &mut Leases, lease: &Due) {
    crate::metrics::renewal(lease.metrics, crate::metrics::RenewalOutcome::Failed);
    if let Some(entry) = leases.by_id.get_mut(&lease.id) {
        let soon = (lease.ttl / 10).min(Duration::from_secs(1));
        entry.next_renewal = Instant::now() + soon;
        leases.reschedule(lease.id);
    }
}

#[cfg(test)]
mod tests {
    use super::{Behind, Schedule, WARN_EVERY, Warning, is_late};
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
        behind.ran_out(&super::Holds::Set(Arc::from(Vec::new())), ttl);
        let warning = behind.warning(now).expect("warned at once");
        assert_eq!((warning.late, warning.ran_out), (1, 1));
        assert_eq!(warning.least_left, Duration::ZERO);
    }

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
