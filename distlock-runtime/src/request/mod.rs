//! Requests: what to lock ([`Single`] lock or a [`KeySet`]) and the options to take it with,
//! written once for both, resolved against the manager's defaults into a plan that the
//! acquire engine carries out.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use crate::error::LockError;
use crate::key::Keys;
use crate::kind::RequestKind;
use crate::lease::{MAX_TTL, check_ttl};
use crate::manager::LockManager;
use crate::metrics::Labels;
use crate::retry::Backoff;

pub(crate) mod plan;
mod start;

/// A request for a lock (or, as [`MultiLockRequest`], for a set of locks taken together),
/// built by [`LockManager::lock`] and its siblings; send it with `acquire` or `try_acquire`.
///
/// Options not set here come from the manager's defaults. They mirror the arguments of
/// `#[distributed_lock]`, by the same names, and apply to every lock of a set.
#[must_use = "a lock request does nothing until `acquire().await` or `try_acquire().await`"]
pub struct LockRequest<'m, T = Single> {
    pub(crate) manager: &'m LockManager,
    pub(crate) target: T,
    pub(crate) options: Options,
}

/// A request for several exclusive locks taken together, built by
/// [`LockManager::lock_all`]: either every one is held or none is.
pub type MultiLockRequest<'m> = LockRequest<'m, KeySet>;

/// What a [`LockRequest`] is for: one lock of one kind.
#[derive(Debug)]
pub struct Single {
    pub(crate) kind: RequestKind,
    pub(crate) key: String,
}

/// What a [`MultiLockRequest`] is for: the exclusive locks of several keys, as named.
#[derive(Debug)]
pub struct KeySet {
    pub(crate) keys: Vec<String>,
}

/// What a request can be for: one lock ([`Single`]) or a set of locks taken together
/// ([`KeySet`]). Implemented by those two only.
pub trait Target: sealed::Sealed + Send + Sized {
    /// What a granted request gives: a [`LockGuard`](crate::LockGuard) for one lock, a
    /// [`MultiGuard`](crate::MultiGuard) for a set.
    type Guard: Send;

    #[doc(hidden)]
    /// Takes what the request is for; see [`LockRequest::acquire`].
    fn acquire<'m>(
        request: LockRequest<'m, Self>,
    ) -> impl Future<Output = Result<Self::Guard, LockError>> + Send + 'm;
}

mod sealed {
    /// Keeps [`Target`](super::Target) to the targets of this crate.
    pub trait Sealed {}
    impl Sealed for super::Single {}
    impl Sealed for super::KeySet {}
}

impl<'m, T: Target> LockRequest<'m, T> {
    /// Takes the lock (every lock of a set), retrying within the request's bounds; a busy
    /// set waits for a release of the key it found busy.
    ///
    /// Errors: [`LockError::Busy`] when another owner kept it for all attempts (or for the
    /// whole `wait`), whatever kind of lock that owner holds on the key (for a set, naming
    /// the key found busy); [`LockError::Redis`] when the last attempt could not reach Redis;
    /// [`LockError::InvalidInput`] for a bad key, ttl or option (or an empty set), before
    /// anything is sent; [`LockError::PermitsMismatch`] at once, without retrying, for a
    /// semaphore in use with another number of permits.
    ///
    /// [`LockError::ShutDown`] once [`LockManager::shutdown`] was called, also for a request
    /// that was waiting then.
    ///
    /// Cancel-safe: if this future is dropped while an attempt is in flight, a release for
    /// that attempt's token (of the whole set) is sent right behind it, so no lock is left
    /// behind.
    pub fn acquire(self) -> impl Future<Output = Result<T::Guard, LockError>> + Send + 'm {
        T::acquire(self)
    }

    /// Makes exactly one attempt: `Ok(None)` when another owner holds the lock (of any kind;
    /// any lock of a set). Other errors are those of [`acquire`](Self::acquire).
    pub async fn try_acquire(mut self) -> Result<Option<T::Guard>, LockError> {
        // Nobody sees the busy error: no holder to name.
        self.options.skip_holder_lookup = true;
        match self.retries(0).wait(Duration::ZERO).acquire().await {
            Ok(guard) => Ok(Some(guard)),
            Err(LockError::Busy { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// The options of a request as the caller set them (`None` or `false`: not set).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Options {
    pub(crate) template: Option<&'static str>,
    pub(crate) ttl: Option<Duration>,
    pub(crate) retries: Option<u32>,
    pub(crate) retry_delay: Option<Duration>,
    pub(crate) wait: Option<Duration>,
    pub(crate) fencing: bool,
    pub(crate) watchdog: bool,
    pub(crate) max_hold: Option<Duration>,
    pub(crate) reentrant: bool,
    pub(crate) min_hold: Option<Duration>,
    pub(crate) fair: bool,
    /// Taken and given back on the server path only: never by or into a local pass (opted
    /// out of cohorts, or a set).
    pub(crate) server_path: bool,
    /// A busy error is returned without looking up who holds the lock (`try_acquire` drops
    /// the error).
    pub(crate) skip_holder_lookup: bool,
    /// The hold is recorded by the caller, not in the current frame: an annotated call
    /// records it in the frame it opens for its body.
    pub(crate) recorded_by_caller: bool,
}

impl<T: fmt::Debug> fmt::Debug for LockRequest<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockRequest")
            .field("target", &self.target)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<T> LockRequest<'_, T> {
    /// Leaves the hold to the caller to record: it runs the code the hold protects in a
    /// frame of its own that holds it.
    pub(crate) fn recorded_by_caller(mut self) -> Self {
        self.options.recorded_by_caller = true;
        self
    }

    /// The lease: how long the lock stays held if its holder stops renewing or releasing it.
    /// Must be at least 1 ms and at most [`MAX_TTL`].
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.options.ttl = Some(ttl);
        self
    }

    /// Extra attempts after the first when the lock (any lock of a set) is busy or Redis
    /// fails transiently.
    pub fn retries(mut self, retries: u32) -> Self {
        self.options.retries = Some(retries);
        self
    }

    /// The base delay between attempts; it doubles per attempt (up to 32×, and at most
    /// [`MAX_TTL`]) with full jitter.
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.options.retry_delay = Some(delay);
        self
    }

    /// An upper bound on the total time spent trying. Without `retries`, the request keeps
    /// trying until this much time has passed; with both, whichever ends first. A wait longer
    /// than [`MAX_TTL`] (such as `Duration::MAX`) sets no time bound.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.options.wait = Some(wait);
        self
    }

    /// Draw a fencing token: a per-key number that grows with every acquisition, for storage
    /// that must reject writes from a holder whose lease has ended. See
    /// [`LockGuard::fencing_token`](crate::LockGuard::fencing_token). The counter stays in
    /// Redis after release. A set draws one per key, from the counter single locks on that
    /// key draw from ([`MultiGuard::fencing_token`](crate::MultiGuard::fencing_token)).
    pub fn fencing(mut self, fencing: bool) -> Self {
        self.options.fencing = fencing;
        self
    }

    /// Renew the lease while the guard lives: the manager's watchdog extends it at about a
    /// third of the TTL, in one batched round trip for all leases due, and stops the moment
    /// the guard is released or dropped, or when `max_hold` has passed. A renewal that finds
    /// the lock gone or taken marks the lease lost
    /// ([`LockGuard::lost`](crate::LockGuard::lost)); a set is lost as soon as any one of
    /// its leases is.
    pub fn watchdog(mut self, watchdog: bool) -> Self {
        self.options.watchdog = watchdog;
        self
    }

    /// With `watchdog`: stop renewing after this long, whatever the holder does, so a body
    /// that never finishes cannot hold the lock forever. Default: the manager's (1 hour).
    /// `Duration::MAX` renews for as long as the guard lives.
    pub fn max_hold(mut self, max_hold: Duration) -> Self {
        self.options.max_hold = Some(max_hold);
        self
    }

    /// Allow a nested acquisition of the same key, by code running inside this hold (see
    /// [`scope`](crate::scope)), to succeed: it shares the outer hold's owner token and adds one
    /// to the hold count in Redis; the lock is free once every hold is released. Both the
    /// outer and the nested request must be reentrant. Without it, a nested acquisition fails
    /// at once with [`LockError::WouldDeadlock`]. A key of a set that is such a nested
    /// acquisition becomes a nested hold of that key; the other keys are taken as usual.
    pub fn reentrant(mut self, reentrant: bool) -> Self {
        self.options.reentrant = reentrant;
        self
    }

    /// Names this request in metrics and tracing (the `template` label), in place of
    /// `<manual>`. Give the shape of the key, such as `"order:{id}"` or
    /// `"transfer:{from}:{to}"`, never the key itself: one name per kind of lock keeps the
    /// number of series small. Annotated functions pass their key template. Keys of a set
    /// that are nested holds of this task's own locks carry it too.
    pub fn label(self, label: &'static str) -> Self {
        self.template(label)
    }

    #[doc(hidden)]
    /// The key template this request was formatted from, as a low-cardinality tracing label.
    pub fn template(mut self, template: &'static str) -> Self {
        self.options.template = Some(template);
        self
    }
}

/// The options of one lock that a set does not take: a set keeps no `min_hold`, waits in no
/// fair queue and never passes locally.
impl LockRequest<'_> {
    /// Keep the key at least this long after the acquisition, even when released sooner:
    /// release leaves it to expire at acquisition + `min_hold` (owned by nobody) instead of
    /// deleting it. For scheduled jobs that must run at most once per period across nodes
    /// whose clocks differ. It must not be longer than the lease.
    pub fn min_hold(mut self, min_hold: Duration) -> Self {
        self.options.min_hold = Some(min_hold);
        self
    }

    /// Take the lock in strict arrival order across every process: waiters queue in Redis
    /// (one queue per key, next to the lock), and a release grants the lock to the oldest
    /// waiter in the same step, then tells that waiter, which nobody can overtake meanwhile.
    ///
    /// Each queue entry has a short lease of its own, renewed while its waiter waits: a
    /// waiter whose process dies drops out of the queue within seconds instead of blocking
    /// it, and one that gives up (its `wait` or `retries` run out, or its future is dropped)
    /// takes its entry out at once. A lock granted to a waiter that died meanwhile is held for
    /// two seconds at most. `try_acquire` never queues: it takes the lock only when nobody
    /// is waiting.
    ///
    /// For exclusive locks on one Redis deployment (single node, Sentinel or Cluster), without
    /// `fencing` or `min_hold`; other requests get [`LockError::InvalidInput`]. The order binds fair requests: use `fair` for every
    /// request on the key, as a request without it may take the lock whenever it is free.
    pub fn fair(mut self, fair: bool) -> Self {
        self.options.fair = fair;
        self
    }

    /// Whether this lock may pass among this manager's own tasks without a server command
    /// (default: yes). When a holder releases while another task of the same manager waits
    /// for the same plain exclusive lock, the lock passes to that task as it is — the key in
    /// Redis keeps its owner token and lease, and the new holder gets a guard of its own on
    /// that server hold — up to the manager's [cohort bounds](crate::LockManagerBuilder::cohort),
    /// then goes back to Redis so that other processes get their turn. Both the releasing and
    /// the waiting request must allow it. `false`: every hand-over goes through the server.
    ///
    /// Only plain exclusive locks pass locally, and only to a waiter that asked for the same
    /// `ttl` as the holder, while at least half of the lease is left (otherwise the lock goes
    /// through the server, which gives the waiter a lease of its own). Fenced locks (each
    /// holder draws a new token from the server), `min_hold`, fair locks, read-write locks,
    /// semaphores and sets never pass locally, and neither does any lock on RedLock or with
    /// `sync_replicas`.
    ///
    /// A run checks its hold with the server while it goes on: each pass asks for a check
    /// (a `GET` of the key, one in flight at a time) that the pass itself does not wait for;
    /// the release that made the pass does, and answers [`LockError::Lost`]
    /// when the hold was taken away (then no pass is made any more, and `lost()` fires for
    /// the holder that has it).
    pub fn cohort(mut self, cohort: bool) -> Self {
        self.options.server_path = !cohort;
        self
    }
}
