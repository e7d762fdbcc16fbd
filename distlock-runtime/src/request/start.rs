//! Where requests start: [`LockManager`]'s `lock`, `read_lock`, `write_lock`, `semaphore`
//! and `lock_all`.

use super::*;

impl LockManager {
    /// Starts a request for the exclusive lock named `key`.
    ///
    /// One name is one lock, whatever kinds it is used through: an exclusive lock waits while
    /// the key is held as a read or write lock, a semaphore, or kept by another holder's
    /// `min_hold`, and keeps all of them out while it is held.
    ///
    /// The key is checked when the request is sent: it must not be empty and may be at most
    /// [`MAX_KEY_LEN`](crate::MAX_KEY_LEN) bytes.
    pub fn lock(&self, key: impl Into<String>) -> LockRequest<'_> {
        self.single(RequestKind::Exclusive, key.into())
    }

    /// Starts a request for the read side of the read-write lock named `key`: any number of
    /// readers hold it together, each with its own owner token and lease, while no writer
    /// does. A writer that is waiting keeps new readers out, so readers cannot starve it.
    ///
    /// A task that holds the write lock may take the read lock too (downgrade); the lock stays
    /// exclusive until the write hold is released. Readers overlap only with readers: an
    /// exclusive lock, a semaphore permit or a `min_hold` on the same key makes them wait.
    pub fn read_lock(&self, key: impl Into<String>) -> LockRequest<'_> {
        self.single(RequestKind::Read, key.into())
    }

    /// Starts a request for the write side of the read-write lock named `key`: held by one
    /// owner, while no reader holds the read side. A task holding the read lock that asks for
    /// the write lock gets [`LockError::Upgrade`] at once. Like an exclusive lock, it waits
    /// for (and keeps out) every other kind of lock on the same key.
    pub fn write_lock(&self, key: impl Into<String>) -> LockRequest<'_> {
        self.single(RequestKind::Write, key.into())
    }

    /// Starts a request for one permit of the counting semaphore named `key`: at most
    /// `permits` holders at a time, each with its own owner token and lease, so the permit of
    /// a holder that dies returns by itself when its lease ends. Permit holders overlap only
    /// with each other: any other kind of lock on the key makes them wait.
    ///
    /// The key remembers the `permits` it is in use with: while any permit is held, a request
    /// with another number fails at once with [`LockError::PermitsMismatch`] (all users of one
    /// key must agree on it); once every permit has been returned, another number may be
    /// used. Zero is an error.
    pub fn semaphore(&self, key: impl Into<String>, permits: u32) -> LockRequest<'_> {
        self.single(RequestKind::Permits(permits), key.into())
    }

    /// Starts a request for the exclusive locks named `keys`, taken together: either every
    /// one is held or none is.
    ///
    /// The order of `keys` does not matter: two requests that list the same keys in opposite
    /// orders never deadlock, because a request never holds some of its keys while it waits
    /// for the others. Names that are equal are taken once. Each lock is the same lock that
    /// [`lock`](Self::lock) takes on that name, so a set waits for (and keeps out) single
    /// locks and every other kind of lock on any of its keys.
    ///
    /// ```no_run
    /// # async fn run(locks: distlock_runtime::LockManager) -> Result<(), distlock_runtime::LockError> {
    /// use std::time::Duration;
    ///
    /// let guard = locks
    ///     .lock_all(["account:1", "account:2"])
    ///     .ttl(Duration::from_secs(10))
    ///     .wait(Duration::from_secs(5))
    ///     .acquire()
    ///     .await?;
    /// // ... move the money ...
    /// guard.release().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn lock_all<I>(&self, keys: I) -> MultiLockRequest<'_>
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        let keys = keys.into_iter().map(Into::into).collect();
        LockRequest {
            manager: self,
            target: KeySet { keys },
            options: Options::default(),
        }
    }

    fn single(&self, kind: RequestKind, key: String) -> LockRequest<'_> {
        LockRequest {
            manager: self,
            target: Single { kind, key },
            options: Options::default(),
        }
    }
}
