//! `LockGuard`: proof of holding a lock, and the way to give it back.

use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::LockError;
use crate::key::Keys;
use crate::manager::LockManager;

/// The lease as this process sees it: valid until a deadline measured on the monotonic clock
/// from the moment the request was *sent*, minus a margin for clock drift between client and
/// server (1 % of the lease plus 2 ms).
#[derive(Debug)]
pub(crate) struct Lease {
    ttl: Duration,
    valid_until: Mutex<Instant>,
}

impl Lease {
    pub(crate) fn new(sent: Instant, ttl: Duration) -> Self {
        Self {
            ttl,
            valid_until: Mutex::new(Self::deadline(sent, ttl)),
        }
    }

    fn deadline(sent: Instant, ttl: Duration) -> Instant {
        let drift = ttl / 100 + Duration::from_millis(2);
        sent + ttl.saturating_sub(drift)
    }

    fn renewed(&self, sent: Instant, ttl: Duration) {
        *self.valid_until.lock().unwrap_or_else(|e| e.into_inner()) = Self::deadline(sent, ttl);
    }

    fn remaining(&self) -> Duration {
        let until = *self.valid_until.lock().unwrap_or_else(|e| e.into_inner());
        until.saturating_duration_since(Instant::now())
    }
}

/// Proof that this owner holds a lock. Dropping it releases the lock.
///
/// Prefer [`release`](Self::release): it waits for Redis to confirm, so the next waiter can
/// enter at once, and reports a lease that was lost. Dropping the guard (on panic or when the
/// future holding it is cancelled) hands the release to the manager's background runtime
/// instead; if that fails, the lease simply expires.
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct LockGuard {
    manager: LockManager,
    keys: Keys,
    token: String,
    fence: Option<u64>,
    lease: Lease,
    acquired: Acquired,
    released: bool,
}

/// How an acquisition went: attempts made and time spent before the lock was held.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Acquired {
    pub(crate) attempts: u32,
    pub(crate) waited: Duration,
}

impl LockGuard {
    pub(crate) fn new(
        manager: LockManager,
        keys: Keys,
        token: String,
        fence: Option<u64>,
        lease: Lease,
        acquired: Acquired,
    ) -> Self {
        Self {
            manager,
            keys,
            token,
            fence,
            lease,
            acquired,
            released: false,
        }
    }

    /// How many attempts the acquisition took (1 when the lock was free at once).
    pub fn attempts(&self) -> u32 {
        self.acquired.attempts
    }

    /// How long the acquisition took, from the first attempt to holding the lock.
    pub fn waited(&self) -> Duration {
        self.acquired.waited
    }

    /// The key as it was requested (without the manager's prefix).
    pub fn key(&self) -> &str {
        &self.keys.name
    }

    /// This acquisition's owner token: 128 random bits, in hex.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The fencing token drawn for this acquisition, when the request asked for one.
    ///
    /// Tokens of one key grow strictly with every acquisition. Hand the token to the storage
    /// you write to and have it reject any write that carries a smaller token than the largest
    /// it has seen: that stops a holder whose lease ended (after a long GC pause, say) from
    /// overwriting the work of the next holder.
    pub fn fencing_token(&self) -> Option<u64> {
        self.fence
    }

    /// The lease length this guard was granted or last extended to.
    pub fn ttl(&self) -> Duration {
        self.lease.ttl
    }

    /// How long the lease is still valid by this process's monotonic clock, with a safety
    /// margin for drift. Zero means: assume the lock is no longer held.
    pub fn remaining(&self) -> Duration {
        self.lease.remaining()
    }

    /// Asks Redis whether this owner still holds the lock.
    pub async fn is_held(&self) -> Result<bool, LockError> {
        let inner = &self.manager.inner;
        let backend = inner.backend.clone();
        let (lock, token) = (self.keys.lock.clone(), self.token.clone());
        inner
            .driver
            .run(async move { backend.holds(&lock, &token).await })
            .await?
            .map_err(|e| LockError::redis(&self.keys.name, e))
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
        let inner = &self.manager.inner;
        let backend = inner.backend.clone();
        let (lock, token) = (self.keys.lock.clone(), self.token.clone());
        let sent = Instant::now();
        let extended = inner
            .driver
            .run(async move { backend.extend(&lock, &token, ttl).await })
            .await?
            .map_err(|e| LockError::redis(&self.keys.name, e))?;
        if !extended {
            return Err(self.lost());
        }
        self.lease.renewed(sent, ttl);
        Ok(())
    }

    /// Gives the lock back and waits for Redis to confirm.
    ///
    /// [`LockError::Lost`] means the lease had already ended: another owner may have held the
    /// key meanwhile (that owner's lock is left untouched). A release whose reply is lost is
    /// sent once more; if that second attempt finds the lock gone, it counts as released.
    pub async fn release(mut self) -> Result<(), LockError> {
        self.released = true;
        let inner = &self.manager.inner;
        let mut retried = false;
        loop {
            let backend = inner.backend.clone();
            let (lock, token) = (self.keys.lock.clone(), self.token.clone());
            let outcome = inner
                .driver
                .run(async move { backend.release(&lock, &token).await })
                .await?;
            return match outcome {
                Ok(true) => Ok(()),
                Ok(false) if retried => Ok(()),
                Ok(false) => Err(self.lost()),
                Err(error) if !retried && error.is_io_error() => {
                    retried = true;
                    continue;
                }
                Err(error) => Err(LockError::redis(&self.keys.name, error)),
            };
        }
    }

    fn lost(&self) -> LockError {
        LockError::Lost {
            key: self.keys.name.clone(),
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if !self.released {
            release_in_background(
                &self.manager,
                std::mem::take(&mut self.keys.lock),
                std::mem::take(&mut self.token),
            );
        }
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("key", &self.keys.name)
            .field("token", &self.token)
            .field("fencing_token", &self.fence)
            .field("remaining", &self.remaining())
            .finish_non_exhaustive()
    }
}

/// Sends a release for `token` without waiting for it; the outcome is only logged.
pub(crate) fn release_in_background(manager: &LockManager, lock: String, token: String) {
    let inner = manager.inner.clone();
    manager.inner.driver.spawn(async move {
        match inner.backend.release(&lock, &token).await {
            Ok(true) => tracing::debug!(%lock, "released in the background"),
            Ok(false) => tracing::debug!(%lock, "background release found the lock already gone"),
            Err(error) => {
                tracing::warn!(%lock, %error, "background release failed; the lease will expire")
            }
        }
    });
}
