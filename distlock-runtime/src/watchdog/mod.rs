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
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tokio::runtime::Handle;
use tokio::sync::Notify;

use crate::backend::{Backend, HoldIds};
use crate::driver::Driver;
use crate::held::Held;
use crate::lease::{LeaseState, saturating_add};
use crate::waiters::Waiters;

mod behind;
mod renew;
mod schedule;

use behind::{Behind, is_late, warn_if_behind};
use renew::renew;
pub(crate) use schedule::Schedule;

/// At most this many leases per renewal script call.
const BATCH: usize = 512;

/// At most this many renewal calls in flight at once.
const IN_FLIGHT: usize = 8;

/// At most this many leases taken out per look: the driver's thread, which carries the
/// manager's round trips too, never spends long on one.
const PER_LOOK: usize = BATCH * IN_FLIGHT;

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
pub(crate) enum Leased {
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

impl Leased {
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
    pub(crate) holds: Leased,
    pub(crate) metrics: crate::metrics::Labels,
}

/// What renewals go through: the manager's driver, which runs the watchdog's task, its
/// backend, which that task renews through, and its waiters, woken when a lease is found
/// lost (a lock taken away without a word: nobody else tells them).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RenewalPath<'a> {
    pub(crate) driver: &'a Driver,
    pub(crate) backend: &'a Backend,
    pub(crate) waiters: &'a Waiters,
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
    hold: Leased,
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
        through: impl Into<RenewalPath<'a>>,
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
            let RenewalPath {
                driver,
                backend,
                waiters,
            } = through.into();
            driver.spawn(run(self.shared.clone(), backend.clone(), waiters.clone()));
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
    hold: Leased,
    ttl: Duration,
    state: Arc<LeaseState>,
    metrics: crate::metrics::Labels,
}

/// The watchdog task: ends when no lease is left, or with the manager's runtime.
async fn run(shared: Arc<Renewals>, backend: Backend, waiters: Waiters) {
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
            renew(&shared, &backend, &waiters, due).await;
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
