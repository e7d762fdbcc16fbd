//! `LockGuard`: proof of holding a lock, and the way to give it back.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Waker};
use std::time::{Duration, Instant};

use crate::LockError;
use crate::backend::HoldIds;
use crate::context::Held;
use crate::key::Keys;
use crate::lease::LeaseState;
use crate::manager::LockManager;
use crate::watchdog::Registration;

/// How an acquisition went: attempts made and time spent before the lock was held.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Acquired {
    pub(crate) attempts: u32,
    pub(crate) waited: Duration,
    /// When the successful attempt was sent: the start of the lease.
    pub(crate) sent: Instant,
}

/// Everything a guard is made of, assembled by the acquire loop.
#[derive(Debug)]
pub(crate) struct Parts {
    pub(crate) manager: LockManager,
    pub(crate) keys: Keys,
    pub(crate) token: String,
    pub(crate) hold: String,
    pub(crate) share: Option<String>,
    pub(crate) fence: Option<u64>,
    pub(crate) lease: Arc<LeaseState>,
    pub(crate) acquired: Acquired,
    pub(crate) min_hold: Option<Duration>,
    pub(crate) renewal: Option<Registration>,
    pub(crate) held: Arc<Held>,
    pub(crate) metrics: crate::metrics::Labels,
}

/// Proof that this owner holds a lock. Dropping it releases the lock.
///
/// Prefer [`release`](Self::release): it waits for Redis to confirm, so the next waiter can
/// enter at once, and reports a lease that was lost. Dropping the guard (on panic or when the
/// future holding it is cancelled) hands the release to the manager's background runtime
/// instead; if that fails, the lease simply expires.
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct LockGuard {
    parts: Parts,
    released: bool,
}

impl LockGuard {
    pub(crate) fn new(parts: Parts) -> Self {
        Self {
            parts,
            released: false,
        }
    }

    /// The key as it was requested (without the manager's prefix).
    pub fn key(&self) -> &str {
        &self.parts.keys.name
    }

    /// This acquisition's owner token: 128 random bits, in hex. Nested reentrant holds share
    /// the outer hold's token.
    pub fn token(&self) -> &str {
        &self.parts.token
    }

    /// The fencing token drawn for this acquisition, when the request asked for one.
    ///
    /// Tokens of one key grow strictly with every acquisition. Hand the token to the storage
    /// you write to and have it reject any write that carries a smaller token than the largest
    /// it has seen: that stops a holder whose lease ended (after a long GC pause, say) from
    /// overwriting the work of the next holder. A nested reentrant hold carries the outer
    /// hold's token.
    pub fn fencing_token(&self) -> Option<u64> {
        self.parts.fence
    }

    /// The lease length this guard was granted or last extended to.
    pub fn ttl(&self) -> Duration {
        self.parts.lease.ttl()
    }

    /// How many attempts the acquisition took (1 when the lock was free at once).
    pub fn attempts(&self) -> u32 {
        self.parts.acquired.attempts
    }

    /// How long the acquisition took, from the first attempt to holding the lock.
    pub fn waited(&self) -> Duration {
        self.parts.acquired.waited
    }

    /// How long the lease is still valid by this process's monotonic clock, with a safety
    /// margin for drift; zero once the lease is known lost. The watchdog moves it forward.
    pub fn remaining(&self) -> Duration {
        self.parts.lease.remaining()
    }

    /// Whether the lease is known to be lost: a renewal found another owner or no key, or the
    /// local validity deadline passed without a renewal. Asks nothing of Redis.
    pub fn is_lost(&self) -> bool {
        self.parts.lease.is_lost()
    }

    /// Completes when the lease is lost, with the [`LockError::Lost`] to report.
    ///
    /// With the watchdog on, that is when a renewal finds the lock gone or taken, or when
    /// renewals have failed until the local deadline; without it, when the lease runs out.
    /// Race it against the work the lock protects to stop that work in time:
    ///
    /// ```no_run
    /// # async fn run(guard: distlock_runtime::LockGuard) -> Result<(), distlock_runtime::LockError> {
    /// # async fn work() {}
    /// tokio::select! {
    ///     () = work() => guard.release().await?,
    ///     lost = guard.lost() => return Err(lost),
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn lost(&self) -> LockError {
        let lease = &self.parts.lease;
        let mut marked = lease.subscribe();
        loop {
            if lease.is_lost() {
                lease.mark_lost();
                return self.lost_error();
            }
            let timer = self.parts.manager.inner.sleep_until(lease.valid_until());
            tokio::select! {
                _ = marked.wait_for(|lost| *lost) => {}
                _ = timer => {}
            }
        }
    }

    /// Asks Redis whether this owner still holds the lock.
    pub async fn is_held(&self) -> Result<bool, LockError> {
        let (lock, token) = (self.parts.keys.lock.clone(), self.parts.token.clone());
        let share = self.parts.share.clone();
        self.parts
            .manager
            .inner
            .exec(
                move |backend| async move { backend.holds(&lock, share.as_deref(), &token).await },
            )
            .await?
            .map_err(|e| LockError::redis(self.key(), e))
    }

    /// Sets the lease to `ttl` from now, if this owner still holds the lock; otherwise
    /// [`LockError::Lost`], and nothing is changed.
    pub async fn extend(&self, ttl: Duration) -> Result<(), LockError> {
        if ttl < Duration::from_millis(1) {
            return Err(LockError::invalid(
                "ttl",
                format!("a lease must be at least 1ms, got {ttl:?}"),
            ));
        }
        let (lock, token) = (self.parts.keys.lock.clone(), self.parts.token.clone());
        let share = self.parts.share.clone();
        let sent = Instant::now();
        let extended = self
            .parts
            .manager
            .inner
            .exec(move |backend| async move {
                backend.extend(&lock, share.as_deref(), &token, ttl).await
            })
            .await?
            .map_err(|e| LockError::redis(self.key(), e))?;
        if !extended {
            self.parts.lease.mark_lost();
            return Err(self.lost_error());
        }
        self.parts.lease.renewed(sent, ttl);
        Ok(())
    }

    /// Gives the lock back and waits for Redis to confirm. Renewal stops at once.
    ///
    /// [`LockError::Lost`] means the lease had already ended: another owner may have held the
    /// key meanwhile (that owner's lock is left untouched). A release whose reply is lost is
    /// sent once more; if that second attempt finds the lock gone while the lease was still
    /// valid, it counts as released.
    /// With `min_hold`, the key stays (owned by nobody) until `min_hold` after the acquisition.
    pub async fn release(mut self) -> Result<(), LockError> {
        self.released = true;
        self.parts.renewal = None;
        let inner = &self.parts.manager.inner;
        let keep = self.keep();
        let mut retried = false;
        loop {
            let ids = self.ids();
            let outcome = inner
                .exec(move |backend| async move { backend.release(&ids, keep).await })
                .await?;
            return match outcome {
                Ok(true) => {
                    inner.waiters.released(&self.parts.keys.companion("wake"));
                    tracing::debug!(key = %self.key(), held_for = ?self.parts.acquired.sent.elapsed(), "released");
                    Ok(())
                }
                // The first attempt may have released it before its reply was lost.
                Ok(false) if retried && !self.parts.lease.is_lost() => Ok(()),
                Ok(false) => {
                    self.parts.lease.mark_lost();
                    Err(self.lost_error())
                }
                Err(error) if !retried && error.is_io_error() => {
                    retried = true;
                    continue;
                }
                Err(error) => Err(LockError::redis(self.key(), error)),
            };
        }
    }

    /// How much longer the key must live after release (min_hold), from the acquisition.
    fn keep(&self) -> Duration {
        self.parts.min_hold.map_or(Duration::ZERO, |min| {
            (self.parts.acquired.sent + min).saturating_duration_since(Instant::now())
        })
    }

    fn ids(&self) -> HoldIds {
        let p = &self.parts;
        HoldIds {
            lock: p.keys.lock.clone(),
            wake: p.keys.companion("wake"),
            token: p.token.clone(),
            hold: p.hold.clone(),
            share: p.share.clone(),
        }
    }

    fn lost_error(&self) -> LockError {
        LockError::Lost {
            key: self.parts.keys.name.clone(),
        }
    }

    pub(crate) fn held(&self) -> &Arc<Held> {
        &self.parts.held
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        crate::metrics::hold_ended(self.parts.metrics, self.parts.acquired.sent, self.is_lost());
        if !self.released {
            self.parts.renewal = None;
            release_in_background(&self.parts.manager, self.ids(), self.keep());
        }
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("key", &self.parts.keys.name)
            .field("token", &self.parts.token)
            .field("fencing_token", &self.parts.fence)
            .field("remaining", &self.remaining())
            .field("watchdog", &self.parts.renewal.is_some())
            .finish_non_exhaustive()
    }
}

/// Sends a release for one hold without waiting for it; the outcome is only logged.
///
/// In a tokio runtime, the request is handed to that runtime's connection before this returns,
/// so it goes out right behind any request of the same owner already on that connection (an
/// acquire whose caller gave up). Outside any runtime, the manager's own runtime sends it.
pub(crate) fn release_in_background(manager: &LockManager, ids: HoldIds, keep: Duration) {
    let inner = manager.inner.clone();
    let release = async move {
        match inner.backend.release(&ids, keep).await {
            Ok(true) => {
                inner.waiters.released(&ids.wake);
                tracing::debug!(lock = %ids.lock, "released in the background");
            }
            Ok(false) => {
                tracing::debug!(lock = %ids.lock, "background release found the lock already gone");
            }
            Err(error) => tracing::warn!(
                lock = %ids.lock, %error,
                "background release failed; the lease will expire"
            ),
        }
    };
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            // One poll queues the request on the connection; the task finishes the rest.
            let mut release = Box::pin(release);
            let mut cx = Context::from_waker(Waker::noop());
            if release.as_mut().poll(&mut cx).is_pending() {
                drop(runtime.spawn(release));
            }
        }
        Err(_) => manager.inner.driver.spawn(release),
    }
}
