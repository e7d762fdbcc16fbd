//! Fencing enforced where the data lives, beyond Redis.
//!
//! A lease can end while its holder is paused; the holder then writes as if it still held the
//! lock. The store it writes to must refuse such a write. For data in Redis, a guarded write
//! ([`LockGuard::guarded_write`](crate::LockGuard::guarded_write)) runs only while the lock is
//! held. For other stores, the lock's fencing token goes with the write, and the store keeps,
//! per resource, the highest token it accepted and refuses a lower one:
//! [`postgres`] (feature `postgres`) does this inside the caller's own transaction.

#[cfg(feature = "postgres")]
pub mod postgres;
