//! `LockGuard`: proof of holding a lock, and the way to give it back.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::HoldIds;
use crate::error::LockError;
use crate::held::Held;
use crate::holds::{KeepUntil, ListedHold, Listing};
use crate::lease::{LeaseState, check_ttl};
use crate::manager::LockManager;
use crate::release::{Resend, Unanswered};
use crate::watchdog::Registration;

mod give_back;

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
    /// The key as it was requested (without the manager's prefix).
    pub(crate) name: String,
    pub(crate) fence: Option<u64>,
    /// The lease of the hold on the server (shared with nested holds).
    pub(crate) lease: Arc<LeaseState>,
    pub(crate) acquired: Acquired,
    pub(crate) renewal: Option<Registration>,
    /// The hold on the server, shared with the other guards of this owner that nest in it.
    pub(crate) held: Arc<Held>,
    pub(crate) metrics: crate::metrics::Labels,
    /// The `lock.hold` span, from the grant to the release.
    pub(crate) span: crate::trace::HoldSpan,
}

/// Proof that this owner holds a lock. Dropping it releases the lock.
///
/// Prefer [`release`](Self::release): it waits for Redis to confirm, so the next waiter can
/// enter at once, and reports a lease that was lost. Dropping the guard (on panic, when the
/// future holding it is cancelled, or when its runtime shuts down) hands the release to the
/// manager's background runtime instead; if that fails, the lease simply expires.
/// [`LockManager::shutdown`] gives back every guard of the manager; dropping such a guard
/// then does nothing.
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct LockGuard {
    pub(crate) parts: Parts,
    listing: Listing,
}

impl LockGuard {
    pub(crate) fn new(parts: Parts) -> Self {
        let held = Arc::downgrade(&parts.held);
        let live = ListedHold {
            ids: parts.held.ids.clone(),
            keep_until: KeepUntil::new(move || held.upgrade().and_then(|held| held.keep_until())),
            lease: parts.lease.clone(),
        };
        let listing = parts.manager.inner.holds.list([live]);
        Self { parts, listing }
    }

    /// Opens the hold's `lock.hold` span, under the caller's current span.
    pub(crate) fn start_span(&mut self, labels: crate::metrics::Labels) {
        let held = &self.parts.held;
        self.parts.span = crate::trace::HoldSpan::start(&crate::trace::HoldFields {
            labels,
            key: &self.parts.name,
            token: &held.ids.token,
            fence: self.parts.fence,
            passes: held.passes,
        });
    }

    /// Whether the manager shut down before this guard could be listed with it.
    pub(crate) fn came_after_shutdown(&self) -> bool {
        self.listing == Listing::Unlisted
    }

    /// Whether [`LockManager::shutdown`] gave this hold back.
    fn given_back_by_shutdown(&self) -> bool {
        self.parts.manager.inner.holds.given_back(&self.listing)
    }

    /// Takes the hold off the manager's list: `true` when giving it back is up to the caller,
    /// `false` when it was already given back (by shutdown, or before).
    fn unlist(&mut self) -> bool {
        self.parts.manager.inner.holds.unlist(&mut self.listing)
    }

    /// The key as it was requested (without the manager's prefix).
    pub fn key(&self) -> &str {
        &self.parts.name
    }

    /// This acquisition's owner token: 128 bits in hex, unique to it: the manager's id (its
    /// first 16 hex digits, drawn at random when the manager was built, which the inspector
    /// reads its [`HolderIdentity`](crate::HolderIdentity) by) and 64 bits counting. Nested
    /// reentrant holds share the outer hold's token, and so do the holders of a cohort's run
    /// (see [`local_passes`](Self::local_passes)): the token names the hold on the server.
    pub fn token(&self) -> &str {
        &self.parts.held.ids.token
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

    /// How many local passes this hold is from the server's grant: 0 when Redis granted it to
    /// this request; `n` when it came by the `n`-th pass of a run among this manager's own
    /// tasks (see [`LockRequest::cohort`](crate::LockRequest::cohort)), holding the server
    /// hold of the first holder of the run, its [`token`](Self::token) and lease included.
    pub fn local_passes(&self) -> u32 {
        self.parts.held.passes
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

    /// Completes when the lease is lost, with the [`LockError::Lost`] to report
    /// ([`LockError::ShutDown`] when [`LockManager::shutdown`] gave the lock back).
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
        loop {
            if lease.is_lost() {
                lease.mark_lost();
                return self.lost_error();
            }
            let timer = self.parts.manager.inner.sleep_until(lease.valid_until());
            tokio::select! {
                () = lease.until_marked_lost() => {}
                _ = timer => {}
            }
        }
    }

    /// Asks Redis whether this owner still holds the lock.
    pub async fn is_held(&self) -> Result<bool, LockError> {
        let hold = self.ids();
        self.parts
            .manager
            .inner
            .on_runtime(move |backend| async move {
                match hold.plain {
                    true => backend.is_held_plain(&hold).await,
                    false => backend.is_held(&hold.lock, hold.shared, &hold.token).await,
                }
            })
            .await?
            .map_err(|e| LockError::redis(self.key(), e))
    }

    /// Makes the lease last at least `ttl` from now, if this owner still holds the lock;
    /// otherwise [`LockError::Lost`], and nothing is changed.
    ///
    /// Extending never shortens a lease, in Redis or in [`remaining`](Self::remaining): a
    /// `ttl` shorter than what is left changes nothing. To give the lock back early, release
    /// it. `ttl` must be at least 1 ms and at most [`MAX_TTL`](crate::MAX_TTL).
    pub async fn extend(&self, ttl: Duration) -> Result<(), LockError> {
        check_ttl(ttl).map_err(|reason| LockError::invalid("ttl", format!("a lease {reason}")))?;
        if self.given_back_by_shutdown() {
            return Err(LockError::ShutDown);
        }
        // A nested hold of a set's lock shares the set's lease: every lock of the set still
        // held is extended, or the lease would promise more than the others have.
        let holds = self.parts.held.lease_sharers();
        let sent = Instant::now();
        let extended = self
            .parts
            .manager
            .inner
            .on_runtime(move |backend| async move {
                let mut all = true;
                for hold in &holds {
                    all &= backend
                        .extend(&hold.lock, hold.shared, &hold.token, ttl)
                        .await?;
                }
                Ok::<bool, redis::RedisError>(all)
            })
            .await?
            .map_err(|e| LockError::redis(self.key(), e))?;
        // An answer after the local deadline finds the lease already lost.
        if !extended || !self.parts.lease.renewed(sent, ttl) {
            self.parts.lease.mark_lost();
            return Err(self.lost_error());
        }
        Ok(())
    }

    /// Gives the lock back and waits for Redis to confirm. Renewal stops at once.
    ///
    /// [`LockError::Lost`] means the lease had already ended: another owner may have held the
    /// key meanwhile (that owner's lock is left untouched). A release whose reply is lost is
    /// sent once more; if that second attempt finds the lock gone while the lease was still
    /// valid, it counts as released.
    /// With `min_hold`, the key stays (owned by nobody) until `min_hold` after the acquisition.
    ///
    /// Nested holds are counted in this process: releasing one while others of the same owner
    /// remain (in any order) asks nothing of Redis, and the lock is given back with the last.
    ///
    /// If this future is dropped before Redis answers, the release is still sent, from the
    /// manager's background runtime. After [`LockManager::shutdown`] gave the lock back, this
    /// returns [`LockError::ShutDown`].
    pub async fn release(mut self) -> Result<(), LockError> {
        self.parts.span.releasing();
        self.parts.renewal = None;
        if !self.unlist() {
            return Err(LockError::ShutDown);
        }
        if !self.parts.held.leave() {
            // Other holds of this owner keep the lock.
            if self.parts.lease.is_lost() {
                self.parts.lease.mark_lost();
                return Err(self.lost_error());
            }
            return Ok(());
        }
        let keep_until = self.parts.held.keep_until();
        // Sends the release again from the background if this future is dropped midway.
        let mut unanswered = Unanswered::armed(&self);
        let outcome = self.give_back(keep_until, &mut unanswered).await?;
        unanswered.answered();
        outcome
    }

    pub(crate) fn ids(&self) -> Arc<HoldIds> {
        self.parts.held.ids.clone()
    }

    pub(crate) fn lost_error(&self) -> LockError {
        if self.given_back_by_shutdown() {
            return LockError::ShutDown;
        }
        LockError::Lost {
            key: self.parts.name.clone(),
        }
    }

    pub(crate) fn held(&self) -> &Arc<Held> {
        &self.parts.held
    }

    /// The manager this guard's hold belongs to (for guarded writes).
    pub(crate) fn manager(&self) -> &LockManager {
        &self.parts.manager
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        let shutdown = self.given_back_by_shutdown();
        let lost = self.is_lost() && !shutdown;
        crate::metrics::hold_ended(self.parts.metrics, self.parts.acquired.sent, lost);
        self.parts.span.end(shutdown, lost);
        self.parts.renewal = None;
        if self.unlist() && self.parts.held.leave() {
            self.give_back_in_background(self.parts.held.keep_until(), false);
        }
    }
}

impl Resend for LockGuard {
    fn resend(&self) {
        // Its answer settles the run's checks; the release dropped may have landed.
        self.give_back_in_background(self.parts.held.keep_until(), true);
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("key", &self.parts.name)
            .field("token", &self.parts.held.ids.token)
            .field("fencing_token", &self.parts.fence)
            .field("remaining", &self.remaining())
            .field("watchdog", &self.parts.renewal.is_some())
            .finish_non_exhaustive()
    }
}
