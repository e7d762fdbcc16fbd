//! The runtime of [distlock](https://docs.rs/distlock): [`LockManager`], lock requests,
//! [`LockGuard`], the Lua scripts and the Redis backends.
//!
//! Applications depend on the `distlock` crate, which re-exports everything here together
//! with the `#[distributed_lock]` attribute.
//!
//! # Safety model
//!
//! A lock here is a *lease*: it is held until it is released or until its TTL runs out,
//! whichever comes first. Every acquisition gets a fresh random owner token; release and
//! extend compare it inside a Lua script, so a holder whose lease expired can never delete or
//! extend the lock of the next holder: it learns instead that it had lost the lock.
//!
//! On a single Redis server that is not failed over, two holders never hold the same key at
//! the same time as far as Redis can tell. But a holder can pause (GC, swap, a blocked
//! executor) past its lease and keep working without knowing; no lock service can prevent
//! that. For efficiency (avoid doing work twice) this is enough. For correctness (never
//! corrupt data), have the protected storage check [fencing tokens](LockGuard::fencing_token).
#![warn(
    missing_docs,
    missing_debug_implementations,
    rust_2018_idioms,
    unreachable_pub
)]

mod acl;
mod backend;
mod context;
mod driver;
mod env;
mod error;
mod guard;
mod id_map;
pub mod inspect;
mod key;
mod lease;
mod lock;
mod manager;
pub mod metrics;
mod multi;
mod retry;
mod scripts;
mod security;
mod waiters;
mod watchdog;

#[cfg(feature = "test-util")]
pub mod testing;

#[doc(hidden)]
pub mod __private;

pub use context::scope;
pub use error::LockError;
pub use guard::LockGuard;
pub use key::MAX_KEY_LEN;
pub use lock::{LockRequest, MAX_TTL};
pub use manager::{LockManager, LockManagerBuilder, Stats};
pub use multi::{MultiGuard, MultiLockRequest};
