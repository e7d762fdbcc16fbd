//! `LockManager`: the configured connection to Redis that every lock goes through.
//!
//! One room per job: this file is the manager itself (install, stats, shutdown, running an
//! operation on the right runtime); `builder` its options and `build`; `topology` which
//! deployment it connects to and how; `checks` what `build` checks before connecting, which
//! `env` checks too so that its errors name the variable; `eviction` the `maxmemory-policy`
//! check made once connected; `redact` how a URL shows in logs and errors.

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::backend::Backend;
use crate::driver::Driver;
use crate::error::LockError;
use crate::holds::HoldList;
use crate::identity::HolderLookup;
use crate::key;
use crate::release::{Known, OneHold, Releaser};
use crate::waiters::Waiters;
use crate::watchdog::{RenewalPath, Watchdog};

mod builder;
mod checks;
mod env;
mod eviction;
mod redact;
mod topology;

pub use builder::LockManagerBuilder;
pub(crate) use checks::{check_masters, check_timeout, check_url};
pub(crate) use redact::redact_url;

static INSTALLED: OnceLock<LockManager> = OnceLock::new();

/// The entry point: a connection to Redis plus the defaults every lock request starts from.
///
/// Build one at startup with [`LockManager::builder`], then either pass it around (it is cheap
/// to clone: an `Arc` inside) or [`install`](Self::install) it as the default that
/// `#[distributed_lock]` uses.
///
/// A manager opens one connection per tokio runtime that uses it (so it works from any
/// runtime, not only the one that built it; the runtime needs its timer enabled, as
/// `#[tokio::main]` and `#[tokio::test]` do), and owns one background thread for the lease
/// watchdog, the pub/sub connection that wakes waiters, and releases made outside any runtime.
/// The thread stops when the last clone (and the last guard) is dropped. Guards dropped while
/// their own runtime shuts down are released from that thread, and
/// [`shutdown`](Self::shutdown) gives back everything the manager holds.
///
/// ```no_run
/// # async fn run() -> Result<(), distlock_runtime::LockError> {
/// use std::time::Duration;
/// use distlock_runtime::LockManager;
///
/// let locks = LockManager::builder()
///     .redis_url("redis://127.0.0.1:6379")
///     .key_prefix("myapp:lock:")
///     .default_ttl(Duration::from_secs(30))
///     .build()
///     .await?;
/// locks.clone().install()?;
///
/// let guard = locks.lock("order:42").ttl(Duration::from_secs(10)).retries(3).acquire().await?;
/// // ... the critical section ...
/// guard.release().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct LockManager {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) backend: Backend,
    pub(crate) driver: Arc<Driver>,
    pub(crate) watchdog: Watchdog,
    pub(crate) waiters: Waiters,
    pub(crate) holds: HoldList,
    pub(crate) prefix: String,
    pub(crate) defaults: Defaults,
    /// This manager's identity, and the identities of other holders it has read.
    pub(crate) registry: Arc<crate::identity::Registry>,
    pub(super) target: String,
    /// What gives this manager's holds back (see [`releaser`](Self::releaser)).
    pub(super) giver: Arc<Releaser>,
}

/// What a request uses for each option it does not set.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Defaults {
    pub(crate) ttl: Duration,
    pub(crate) retries: u32,
    pub(crate) retry_delay: Duration,
    pub(crate) wait: Option<Duration>,
    pub(crate) max_hold: Option<Duration>,
}

/// What a manager has done and what it is doing, for monitoring and tests: its watchdog's
/// renewals (round trips, leases renewed, lost, late, watched now), its waiting (keys and
/// requests waiting now, attempts answered) and its hand-offs (to its own waiting tasks,
/// those by local pass, tasks ready for one now).
///
/// The `u64` fields count since the manager was built; the `usize` fields are the state at
/// the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Renewal script calls sent by the watchdog (each renews a whole batch of leases).
    pub renewal_round_trips: u64,
    /// Leases renewed, counted once per lease per renewal.
    pub leases_renewed: u64,
    /// Leases the watchdog found lost (gone or taken by another owner).
    pub leases_lost: u64,
    /// Renewals the watchdog sent late, with less than half of their lease left: it is
    /// falling behind (the server, the network or this process cannot keep up), and leases
    /// will be lost if it goes on. The first late renewal logs a warning, then at most one
    /// every 10 s; `distlock_renewals_late_total` counts them with the `metrics` feature.
    pub renewals_late: u64,
    /// Keys that have local waiters right now (each with a pub/sub subscription).
    pub waiting_keys: usize,
    /// Leases the watchdog renews right now (0 once every watched guard is gone).
    pub watched_leases: usize,
    /// Locks this manager's releases handed straight to one of its own waiting tasks: in the
    /// release's round trip (see [`LockGuard::release`](crate::LockGuard::release)), or with
    /// no round trip at all by a local pass (counted in `local_passes` too).
    pub local_handoffs: u64,
    /// Waiting tasks ready to take such a hand-off right now (at most one per key: the head
    /// of its local queue, between its attempts).
    pub ready_for_handoff: usize,
    /// Requests queued behind a busy lock right now, over every key (the head of each local
    /// queue included; a first attempt not yet answered is not counted).
    pub waiting_requests: usize,
    /// Acquire attempts (of one key or a set) that the server has answered so far (a request
    /// that waits makes one, then one more per wake-up or timer).
    pub attempts: u64,
    /// Of the local hand-offs, those passed with no server command at all (a cohort's local
    /// passes: see [`LockManagerBuilder::cohort`]).
    pub local_passes: u64,
}

impl LockManager {
    /// Starts configuring a manager.
    pub fn builder() -> LockManagerBuilder {
        LockManagerBuilder::default()
    }

    /// Makes this manager the process-wide default used by `#[distributed_lock]` functions
    /// that name no `manager`. There is one such default per process; a second call fails
    /// with [`LockError::AlreadyInstalled`].
    pub fn install(self) -> Result<(), LockError> {
        INSTALLED.set(self).map_err(|_| LockError::AlreadyInstalled)
    }

    /// The installed manager, if [`install`](Self::install) was called.
    pub fn installed() -> Option<&'static LockManager> {
        INSTALLED.get()
    }

    /// The key prefix every lock of this manager is written under.
    pub fn key_prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The Redis key that holds the lock named `key`: `prefix{key}`, or `prefix{escaped}~`
    /// when `key` contains `}` (see the guide's
    /// [Redis data model](https://docs.rs/distlock/latest/distlock/guide/data_model/index.html)).
    pub fn redis_key(&self, key: &str) -> String {
        key::lock_key(&self.inner.prefix, key)
    }

    /// The manager's counters and current state (see [`Stats`]).
    pub fn stats(&self) -> Stats {
        let counters = self.inner.watchdog.counters();
        Stats {
            renewal_round_trips: counters.round_trips.load(Ordering::Relaxed),
            leases_renewed: counters.renewed.load(Ordering::Relaxed),
            leases_lost: counters.lost.load(Ordering::Acquire),
            renewals_late: self.inner.watchdog.late_renewals(),
            waiting_keys: self.inner.waiters.waiting_keys(),
            watched_leases: self.inner.watchdog.watched(),
            local_handoffs: self.inner.waiters.handoffs(),
            ready_for_handoff: self.inner.waiters.offers(),
            waiting_requests: self.inner.waiters.queued(),
            attempts: self.inner.waiters.attempts(),
            local_passes: self.inner.waiters.passes(),
        }
    }

    /// Gives back every lock this manager holds and stops taking new ones: for a clean exit
    /// (on SIGTERM, say) that frees the keys for other processes at once instead of leaving
    /// them to their leases.
    ///
    /// Every live guard of this manager and its clones is released (a `min_hold` is kept),
    /// and its lease is marked lost first, so [`LockGuard::lost`](crate::LockGuard::lost) completes with
    /// [`LockError::ShutDown`] and `#[distributed_lock]` bodies with `on_lost = "abort"` stop.
    /// The watchdog stops renewing, the pub/sub connection that wakes waiters is closed,
    /// waiting requests end with [`LockError::ShutDown`], and so does every later request.
    /// [`LockGuard::release`](crate::LockGuard::release) of a guard given back this way returns
    /// [`LockError::ShutDown`]; dropping it does nothing.
    ///
    /// Returns once Redis has answered every release (a failed one is logged and left to its
    /// lease). Calling it again does nothing. It works from any runtime, and outside one.
    pub async fn shutdown(&self) {
        let inner = &self.inner;
        if inner.holds.is_shut_down() {
            return;
        }
        let releaser = inner.releaser();
        let releases = inner.holds.shut_down().into_iter().map(|hold| {
            let given = OneHold::new(hold.ids, hold.keep_until.now());
            let known = Known::hold(hold.lease);
            releaser.driver.run(releaser.clone().logged(given, known))
        });
        futures_util::future::join_all(releases).await;
        inner.watchdog.stop();
        let registry = Arc::clone(&inner.registry);
        let _ = inner
            .on_runtime(move |backend| async move { registry.unregister(&backend).await })
            .await;
        let _ = inner.driver.run(inner.waiters.close()).await;
        tracing::debug!(target = %inner.target, "lock manager shut down");
    }

    pub(crate) fn defaults(&self) -> &Defaults {
        &self.inner.defaults
    }
}

impl Inner {
    /// Runs a Redis operation on the caller's runtime, or on the manager's own runtime when
    /// the caller is not in one.
    pub(crate) async fn on_runtime<T, F, Fut>(&self, op: F) -> Result<T, LockError>
    where
        F: FnOnce(Backend) -> Fut,
        Fut: Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        let backend = self.backend.clone();
        if tokio::runtime::Handle::try_current().is_ok() {
            Ok(op(backend).await)
        } else {
            self.driver.run(op(backend)).await
        }
    }

    /// Sleeps on the caller's runtime timer, or on the manager's own runtime.
    pub(crate) async fn sleep_until(&self, deadline: std::time::Instant) -> Result<(), LockError> {
        let deadline = tokio::time::Instant::from_std(deadline);
        if tokio::runtime::Handle::try_current().is_ok() {
            tokio::time::sleep_until(deadline).await;
            Ok(())
        } else {
            self.driver.run(tokio::time::sleep_until(deadline)).await
        }
    }

    /// This manager's address in the process: what tells the holds of two managers on one
    /// key apart in a task's acquisition context (see `context`). Not its manager id, which
    /// names it on the server (see `identity`).
    pub(crate) fn addr(&self) -> usize {
        std::ptr::from_ref(self) as usize
    }

    /// What gives this manager's holds back from its own runtime.
    pub(crate) fn releaser(&self) -> Releaser {
        (*self.giver).clone()
    }

    /// The same, shared: what a grant handed to a waiter of this manager gives itself back
    /// through if nobody takes it (no allocation per hand-off).
    pub(crate) fn giver(&self) -> Arc<Releaser> {
        Arc::clone(&self.giver)
    }
}

impl<'a> From<&'a Arc<Inner>> for RenewalPath<'a> {
    fn from(inner: &'a Arc<Inner>) -> Self {
        Self {
            driver: &inner.driver,
            backend: &inner.backend,
            waiters: &inner.waiters,
        }
    }
}

impl<'a> From<&'a LockManager> for HolderLookup<'a> {
    fn from(manager: &'a LockManager) -> Self {
        Self {
            registry: &manager.inner.registry,
            backend: &manager.inner.backend,
            driver: &manager.inner.driver,
        }
    }
}

impl fmt::Debug for LockManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockManager")
            .field("target", &self.inner.target)
            .field("key_prefix", &self.inner.prefix)
            .field("defaults", &self.inner.defaults)
            .finish_non_exhaustive()
    }
}
