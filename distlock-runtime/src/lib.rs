//! The runtime of [distlock](https://docs.rs/distlock): [`LockManager`], lock requests,
//! [`LockGuard`], the Lua scripts and the Redis backends.
//!
//! Applications depend on the `distlock` crate, which re-exports everything here together
//! with the `#[distributed_lock]` attribute.
//!
//! # Safety model
//!
//! A lock here is a *lease*: it is held until it is released or until its TTL runs out,
//! whichever comes first. Every hold the server grants carries an owner token that no other
//! owner has; release and extend compare it inside a Lua script, so a holder whose lease
//! expired can never delete or extend the lock of the next holder: it learns instead that it
//! had lost the lock.
//!
//! On a single Redis server that is not failed over, two holders never hold the same key at
//! the same time as far as Redis can tell. But a holder can pause (GC, swap, a blocked
//! executor) past its lease and keep working without knowing; no lock service can prevent
//! that. For efficiency (avoid doing work twice) this is enough. For correctness (never
//! corrupt data), have the protected storage check [fencing tokens](LockGuard::fencing_token).
//!
//! # Words the code uses
//!
//! The guide's layout chapter names, for each, the file that owns it.
//!
//! * **lock** — one name under the manager's prefix (`prefix{name}`), whatever kind it is
//!   taken as; its companion keys (wake channel, fencing counter, shares, intent, queue)
//!   share its hash tag.
//! * **manager id** — 64 random bits, in hex, drawn when a manager is built: they name it on
//!   the server (its registration, its connections, what its releases of plain locks
//!   publish) and begin every owner token it makes. Within the process, managers are told
//!   apart by their address instead.
//! * **owner token** — 32 hex digits that name one owner: the manager id, then 64 bits that
//!   count the tokens this process made, so that no two owners anywhere share one. Nested
//!   holds keep the token of the hold they nest in, and a cohort's run keeps the token of the
//!   server hold it passes along. Release, extend and renewal compare it on the server.
//! * **hold** — one acquisition by an owner. Nested acquisitions of the same owner are holds
//!   of one lock, counted in the process; the lock is given back with the last.
//! * **share** — the part of a read lock or semaphore one owner has: fields of the lock's own
//!   hash with a lease of its own (`s:<token>`, the server time it ends at), so that a reader
//!   that dies frees its share alone.
//! * **lease** — how long the server keeps a hold without a renewal (the key's `PX`); the
//!   guard's [`remaining`](LockGuard::remaining) is the client's conservative view of it.
//! * **grant** — what a request wins: the server's answer that it now holds the lock, or a
//!   lock handed off or passed to it by a release of its own manager.
//! * **waiter**, **head** — a request that found the lock busy and waits for it; waiters of
//!   one manager for one key form a local queue, and only its head asks the server.
//! * **wake channel** — `…:wake`: a release publishes on it; each manager follows the
//!   channels its waiters need.
//! * **offer**, **hand-off** — a plain waiter's standing offer to take the lock (its token and
//!   lease); a release by the same manager swaps the owner to it in its own round trip. Other
//!   processes are told to stand aside only for a hand-off that landed.
//! * **chain** — consecutive hand-offs (and passes) of one key within one manager; bounded in
//!   number and time, then the lock goes to everyone.
//! * **intent** — `…:wi`: a waiting writer's mark that keeps new readers out until it gets in,
//!   or stops waiting and takes the mark back.
//! * **fencing token** — a per-key counter drawn at each grant (with `fencing`), strictly
//!   increasing.
//! * **target**, **plan** — what a request is for (one lock, or a set taken together), and
//!   the request with every option resolved against the manager's defaults.
//! * **engine**, **attempt**, **cover** — what carries out every plan, for one lock or a set:
//!   one loop for plain, set and fair requests, carrying out one pure decision
//!   (`decide::step`); an attempt is one round trip asking for the lock; the cover gives back
//!   what an attempt whose answer never came may hold.
//! * **pass**, **cohort**, **run** — a pass gives the lock to the next task of the same
//!   manager with no command at all (unlike a hand-off, which swaps the owner on the server):
//!   that task takes the server hold over as it is. A cohort's
//!   run is the passes of one server hold, checked against the server and kept within the
//!   cohort's bounds.
#![warn(
    missing_docs,
    missing_debug_implementations,
    rust_2018_idioms,
    unreachable_pub
)]

mod acl;
mod backend;
mod cohort;
mod context;
mod decide;
mod driver;
mod duration;
mod election;
mod engine;
mod error;
pub mod fence;
mod guard;
mod guarded;
mod handed;
mod held;
mod holder;
mod holds;
mod id_map;
mod identity;
pub mod inspect;
mod key;
mod kind;
mod lease;
mod lock;
mod manager;
pub mod metrics;
mod release;
pub mod request;
mod retry;
mod scripts;
mod security;
mod set;
mod token;
mod trace;
mod waiters;
mod watchdog;

#[cfg(feature = "test-util")]
pub mod testing;

#[doc(hidden)]
pub mod __private;

pub use context::scope;
pub use duration::parse_duration;
pub use election::{Election, LeaderChange, LeaderInfo, Leadership, Observer};
pub use error::LockError;
pub use guard::LockGuard;
pub use guarded::{Batch, RECEIPT_TTL};
pub use holder::HolderIdentity;
pub use key::MAX_KEY_LEN;
pub use lease::MAX_TTL;
pub use manager::{LockManager, LockManagerBuilder, Stats};
pub use request::{LockRequest, MultiLockRequest};
pub use set::MultiGuard;
