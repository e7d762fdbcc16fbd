//! Lease renewal: one watchdog per manager for every lease that asked for it.
//!
//! The watchdog is a single task on the manager's driver runtime. It wakes when the earliest
//! renewal is due and renews every lease due by then (and those nearly due) in one round trip
//! with a token-checked script, so N held leases cost one command per tick, not N timers.
//! A lease is renewed at about a third of its TTL; a lease whose renewal finds another owner
//! or no key is marked lost and dropped, and one is dropped as soon as its guard is released.
//!
//! Renewal also requires the holder to be alive: each tick sends a tiny probe task to the
//! runtime that acquired the lease, and a lease whose holder's runtime has not run a probe
//! for half a lease (that runtime is blocked or gone) is not renewed, so it expires instead of
//! outliving a stuck holder. `max_hold` ends renewal for a body that never finishes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tokio::runtime::Handle;
use tokio::sync::Notify;

use crate::backend::{Backend, HoldIds, Renewal};
use crate::driver::Driver;
use crate::lease::{LeaseState, saturating_add};

/// At most this many leases per renewal script call.
const BATCH: usize = 512;

/// A registered lease; it stops being renewed when this handle is dropped.
#[derive(Debug)]
pub(crate) struct Registration {
    id: u64,
    watchdog: Weak<Renewals>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(shared) = self.watchdog.upgrade() {
            shared.lock().by_id.remove(&self.id);
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

/// What a renewal extends: the lock, the share's lease key for shares, and the owner token.
#[derive(Debug)]
pub(crate) struct Renewable {
    /// The hold to renew: its lock, share and owner token.
    pub(crate) hold: Arc<HoldIds>,
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
    next_id: u64,
    running: bool,
}

#[derive(Debug)]
struct Lease {
    hold: Arc<HoldIds>,
    ttl: Duration,
    state: Arc<LeaseState>,
    next_renewal: Instant,
    stop_at: Option<Instant>,
    holder: Option<Handle>,
    /// When the holder's runtime last ran a probe, in nanoseconds since `EPOCH`.
    alive: Arc<AtomicU64>,
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

    /// Stops renewing every lease; the task ends at its next look.
    pub(crate) fn stop(&self) {
        self.shared.lock().by_id.clear();
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
        let Renewable { hold, metrics } = target;
        let lease = Lease {
            hold,
            ttl,
            state,
            next_renewal: saturating_add(acquired, ttl / 3),
            // Too far away for the clock to count: renew for as long as the guard lives.
            stop_at: max_hold.and_then(|max| acquired.checked_add(max)),
            holder: Handle::try_current().ok(),
            alive: Arc::new(AtomicU64::new(since_epoch(Instant::now()))),
            metrics,
        };
        let (id, start) = {
            let mut leases = self.shared.lock();
            let id = leases.next_id;
            leases.next_id += 1;
            leases.by_id.insert(id, lease);
            (id, !std::mem::replace(&mut leases.running, true))
        };
        if start {
            let Through { driver, backend } = through.into();
            driver.spawn(run(self.shared.clone(), backend.clone()));
        } else {
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
    hold: Arc<HoldIds>,
    ttl: Duration,
    state: Arc<LeaseState>,
    metrics: crate::metrics::Labels,
}

/// The watchdog task: ends when no lease is left, or with the manager's runtime.
async fn run(shared: Arc<Renewals>, backend: Backend) {
    loop {
        let (due, next_wake) = {
            let mut leases = shared.lock();
            let (due, next_wake) = collect_due(&mut leases);
            if leases.by_id.is_empty() {
                leases.running = false;
                return;
            }
            (due, next_wake)
        };
        if !due.is_empty() {
            renew(&shared, &backend, due).await;
            continue;
        }
        let wake = shared.wake.notified();
        let sleep = tokio::time::sleep_until(next_wake.into());
        tokio::pin!(wake, sleep);
        tokio::select! {
            () = &mut wake => {}
            () = &mut sleep => {}
        }
    }
}

/// Takes out the leases to renew now; drops the ones past `max_hold`, lost, or whose holder
/// did not answer its probe. Returns the batch and when to look again.
fn collect_due(leases: &mut Leases) -> (Vec<Due>, Instant) {
    let now = Instant::now();
    let mut due = Vec::new();
    let mut next_wake = now + Duration::from_secs(3600);
    leases.by_id.retain(|&id, lease| {
        if lease.stop_at.is_some_and(|stop| now >= stop) {
            tracing::debug!(lock = %lease.hold.lock, "max_hold reached: renewal stops");
            return false;
        }
        if lease.state.is_lost() {
            lease.state.mark_lost();
            return false;
        }
        // Renew what falls due within half an interval: two groups of leases taken at
        // different times then merge within a round, and share round trips from then on.
        if lease.next_renewal <= saturating_add(now, lease.ttl / 6) {
            let probed = lease.alive.load(Ordering::Acquire);
            let holder_alive = since_epoch(now).saturating_sub(probed) <= nanos(lease.ttl / 2);
            match &lease.holder {
                Some(holder) => {
                    let alive = lease.alive.clone();
                    let probe = async move { alive.store(since_epoch(Instant::now()), Ordering::Release) };
                    drop(holder.spawn(probe));
                }
                None => lease.alive.store(since_epoch(now), Ordering::Release),
            }
            lease.next_renewal = saturating_add(now, lease.ttl / 3);
            if holder_alive {
                due.push(Due {
                    id,
                    hold: lease.hold.clone(),
                    ttl: lease.ttl,
                    state: lease.state.clone(),
                    metrics: lease.metrics,
                });
            } else {
                tracing::warn!(lock = %lease.hold.lock, "the holder's runtime did not answer: not renewing");
            }
        }
        // Wake for the next renewal, and at the local deadline to report an expiry.
        next_wake = next_wake.min(lease.next_renewal).min(lease.state.valid_until());
        true
    });
    (due, next_wake)
}

async fn renew(shared: &Renewals, backend: &Backend, due: Vec<Due>) {
    for batch in due.chunks(BATCH) {
        let sent = Instant::now();
        let items: Vec<Renewal<'_>> = batch
            .iter()
            .map(|d| Renewal {
                lock: &d.hold.lock,
                share: d.hold.share.as_deref(),
                token: &d.hold.token,
                lease: d.ttl,
            })
            .collect();
        shared.counters.round_trips.fetch_add(1, Ordering::Relaxed);
        match backend.renew(&items).await {
            Ok(results) => {
                let mut leases = shared.lock();
                for (lease, renewed) in batch.iter().zip(results) {
                    // An answer after the local deadline finds the lease already lost.
                    if renewed && lease.state.renewed(sent, lease.ttl) {
                        shared.counters.renewed.fetch_add(1, Ordering::Relaxed);
                        crate::metrics::renewal(
                            lease.metrics,
                            crate::metrics::RenewalOutcome::Renewed,
                        );
                    } else if leases.by_id.remove(&lease.id).is_some() {
                        // (A lease released while its renewal was in flight is not lost.)
                        tracing::warn!(lock = %lease.hold.lock, renewed, "lease lost: renewal found another owner or no key, or came too late");
                        // Marked first: a loss that is counted is already seen by the guard.
                        lease.state.mark_lost();
                        shared.counters.lost.fetch_add(1, Ordering::Release);
                        crate::metrics::renewal(
                            lease.metrics,
                            crate::metrics::RenewalOutcome::Lost,
                        );
                    } else if !renewed {
                        // Released while this renewal was in flight, but the key was gone or
                        // another owner's already: a holder the lease was passed on to must
                        // know.
                        lease.state.mark_lost();
                    }
                }
            }
            // Try again soon; the local deadline reports the loss if Redis stays away.
            Err(error) => {
                tracing::warn!(%error, leases = batch.len(), "lease renewal failed");
                let mut leases = shared.lock();
                for lease in batch {
                    crate::metrics::renewal(lease.metrics, crate::metrics::RenewalOutcome::Failed);
                    if let Some(entry) = leases.by_id.get_mut(&lease.id) {
                        let soon = (lease.ttl / 10).min(Duration::from_secs(1));
                        entry.next_renewal = Instant::now() + soon;
                    }
                }
            }
        }
    }
}
