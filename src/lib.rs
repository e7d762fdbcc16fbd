//! Distributed locks for async Rust, on Redis.
//!
//! Annotate an `async fn` with [`#[distributed_lock]`](distributed_lock), configure a
//! [`LockManager`] once at startup, and the function runs in at most one place at a time
//! across every process that shares the Redis:
//!
//! ```no_run
//! use std::time::Duration;
//! use distlock::{distributed_lock, LockError, LockManager};
//!
//! # #[derive(Debug)] struct AppError;
//! # impl From<LockError> for AppError { fn from(_: LockError) -> Self { AppError } }
//! struct Order { id: u64 }
//!
//! #[distributed_lock(key = "order:{order.id}", ttl = "10s", retries = 3)]
//! async fn ship(order: &Order) -> Result<(), AppError> {
//!     // at most one `ship` per order id runs at a time, everywhere
//!     Ok(())
//! }
//!
//! # async fn start() -> Result<(), LockError> {
//! let locks = LockManager::builder()
//!     .redis_url("redis://127.0.0.1:6379")
//!     .key_prefix("myapp:lock:")
//!     .default_ttl(Duration::from_secs(30))
//!     .build()
//!     .await?;
//! locks.install()?;
//! # Ok(())
//! # }
//! ```
//!
//! The same by hand, with a [`LockGuard`]:
//!
//! ```no_run
//! # async fn run(locks: distlock::LockManager) -> Result<(), distlock::LockError> {
//! use std::time::Duration;
//!
//! let guard = locks.lock("order:42").ttl(Duration::from_secs(10)).retries(3).acquire().await?;
//! // ... the critical section ...
//! guard.release().await?; // dropping the guard releases too, in the background
//!
//! if let Some(guard) = locks.lock("nightly-report").try_acquire().await? {
//!     // one attempt, `None` when someone else holds it
//!     guard.release().await?;
//! }
//! # Ok(())
//! # }
//! ```
//!
//! # What a lock here guarantees
//!
//! A lock is a *lease* with a random owner token. Release and extend check the token in a Lua
//! script, so a holder whose lease ran out never deletes or extends the next holder's lock;
//! it is told [`LockError::Lost`] instead. On one Redis server that is not failed over, two
//! owners never hold the same key at once as far as Redis can tell.
//!
//! What no lease can prevent is a holder that stalls (GC, swap, a blocked executor) past its
//! lease and then carries on. Where that would merely repeat work, the lock is enough. Where it
//! would corrupt data, make the storage check [fencing tokens](LockGuard::fencing_token).
//!
//! # The guide
//!
//! Everything beyond the API reference is in [the guide](guide), one chapter per module:
//! [getting started](guide::getting_started), [the macro](guide::attribute),
//! [long critical sections](guide::long_sections), [waiting](guide::waiting),
//! [what a lock guarantees](guide::guarantees), [topologies](guide::topologies), the
//! [`distlock` binary](guide::cli), [testing your own code](guide::testing), and more.
#![forbid(unsafe_code)]
#![warn(
    missing_docs,
    missing_debug_implementations,
    rust_2018_idioms,
    unreachable_pub
)]

pub use distlock_runtime::*;

pub mod guide;

/// Runs an `async fn` while holding a distributed lock.
///
/// The function's body runs only once the lock is taken; the lock is released (and the
/// release awaited) when the body returns, on `?` and early `return` too. On a panic, or when
/// the caller drops the future, the lock is released in the background. If the lock is not
/// taken, the body does not run and the function returns `Err(E::from(LockError::…))`, so the
/// function must return `Result<T, E>` with `E: From<LockError>`.
///
/// ```no_run
/// use distlock::{distributed_lock, LockError};
///
/// #[derive(Debug)]
/// enum AppError { Lock(LockError) }
/// impl From<LockError> for AppError {
///     fn from(e: LockError) -> Self { AppError::Lock(e) }
/// }
///
/// struct Order { id: u64 }
///
/// #[distributed_lock(key = "order:{order.id}", ttl = "10s", retries = 3, retry_delay = "50ms")]
/// async fn ship(order: &Order) -> Result<u64, AppError> {
///     Ok(order.id)
/// }
/// ```
///
/// Every argument below also exists on the request builder, by the same name.
///
/// # `key = "…"` (required, or `keys`)
///
/// The lock's name. `{param}`, `{param.field}`, `{param.0}` and `{self.field}` insert a
/// parameter (or a field of one) with `Display`; `{{` and `}}` are literal braces. A name
/// that is not a parameter is a compile error. The Redis key is `prefix{key}`.
///
/// The same without the macro: `locks.lock(format!("order:{}", order.id))`.
///
/// # `keys = ["…", "…"]`
///
/// Several exclusive locks taken together, all or none, for work that spans several
/// resources (a transfer between two accounts). Each template is checked as `key` is; two
/// identical templates are a compile error, and names that turn out equal at run time are
/// taken once. The order does not matter: two calls that list the same keys in opposite
/// orders never deadlock, since a call never holds part of its set while waiting for the
/// rest. Give either `key` or `keys`; `mode`, `permits` and `min_hold` do not apply to a set.
/// With `guard = name`, `name` is a `&MultiGuard`.
///
/// ```no_run
/// # use distlock::{distributed_lock, LockError};
/// #[distributed_lock(keys = ["account:{from}", "account:{to}"], ttl = "10s", retries = 5)]
/// async fn transfer(from: u64, to: u64, amount: u64) -> Result<(), LockError> {
///     Ok(())
/// }
/// ```
///
/// The same without the macro: [`LockManager::lock_all`], which returns a [`MultiGuard`].
///
/// # `ttl = "10s"`
///
/// The lease: how long the lock survives a holder that neither releases nor renews it. Units
/// `ms`, `s`, `m`, `h`, checked at compile time. Default: the manager's `default_ttl` (30 s).
///
/// The same without the macro: `.ttl(Duration::from_secs(10))`.
///
/// # `retries = N`
///
/// Extra attempts after the first when the lock is busy. Default: the manager's (0).
///
/// The same without the macro: `.retries(3)`.
///
/// # `retry_delay = "50ms"`
///
/// The base delay between attempts. It doubles with every attempt (up to 32 times the base),
/// is drawn uniformly below that ceiling (full jitter), and never runs past the remaining
/// lease of the current holder. Default: the manager's (50 ms).
///
/// The same without the macro: `.retry_delay(Duration::from_millis(50))`.
///
/// # `wait = "5s"`
///
/// An upper bound on the total time spent trying. Alone, it keeps retrying until the time is
/// up; with `retries`, whichever ends first. `wait` with `retries = 0` is a compile error.
///
/// The same without the macro: `.wait(Duration::from_secs(5))`.
///
/// # `watchdog`
///
/// Renews the lease while the body runs, so a body may take longer than `ttl` without losing
/// the lock; `ttl` then only bounds how long a crashed or stuck holder keeps it. One watchdog
/// per manager renews every due lease at about `ttl / 3` in one batched round trip, with a
/// script that checks the owner token, so it never extends a lock someone else now holds. It
/// stops the moment the body ends (or the future is dropped), when `max_hold` has passed, and
/// when the holder's runtime stops answering (a blocked executor loses its lease instead of
/// keeping it forever).
///
/// The same without the macro: `.watchdog(true)`.
///
/// # `max_hold = "10m"`
///
/// With `watchdog`: stop renewing after this long, whatever the body does, so a body that
/// never finishes cannot keep the lock forever. Default: the manager's `default_max_hold`
/// (1 hour). Without `watchdog` it is a compile error.
///
/// The same without the macro: `.max_hold(Duration::from_secs(600))`.
///
/// # `on_lost = "abort" | "error" | "continue"`
///
/// What happens when the lease is lost while the body runs (a renewal found the key gone or
/// taken, or the lease ran out without a renewal): `abort` drops the body future at its next
/// `.await` and returns `LockError::Lost`; `error` lets the body finish and then returns
/// `LockError::Lost` instead of its result; `continue` ignores it. The default is `abort` with
/// `watchdog` — a lost lease there means another owner may already be inside, and the body
/// should stop touching the resource — and `continue` without it (the lease is expected to
/// cover the body; a loss found at release is logged).
///
/// The same without the macro: race the work against [`LockGuard::lost`].
///
/// # `reentrant`
///
/// A nested call that takes the same key in the same task succeeds instead of waiting for
/// itself: it shares the outer hold's owner token, the hold count in Redis goes up, and the
/// lock is free once every hold is released. Ownership is the task's acquisition context, not
/// the thread: a task spawned from inside the body is another owner and waits. Without
/// `reentrant`, such a nested call fails at once with [`LockError::WouldDeadlock`].
///
/// The same without the macro: `.reentrant(true)` on both requests, inside [`scope`].
///
/// # `fair`
///
/// Strict arrival order across every process: waiters queue in Redis, and a release grants
/// the lock to the oldest of them in the same step. A waiter whose process dies drops out of
/// the queue within seconds; one that gives up or is cancelled leaves it at once. Use it for
/// every function (and request) that takes the key. Exclusive locks only; not with `fencing`,
/// `min_hold` or `keys`, nor on RedLock.
///
/// The same without the macro: `.fair(true)`.
///
/// # `min_hold = "30s"`
///
/// Keeps the key at least this long after acquisition, even if the body ends sooner: release
/// leaves the key (owned by nobody) to expire at acquisition + `min_hold`. With
/// `on_busy = "skip"`, a scheduled job then runs at most once per `min_hold` across nodes
/// whose clocks and schedules differ a little.
///
/// The same without the macro: `.min_hold(Duration::from_secs(30))`.
///
/// # `mode = "read" | "write"`
///
/// A read-write lock on the key: any number of readers at once, or one writer alone. A
/// waiting writer keeps new readers out, so readers cannot starve it. Inside a write-locked
/// body, a nested `mode = "read"` call on the same key is a downgrade and succeeds; the reverse
/// fails at once with [`LockError::Upgrade`].
///
/// The same without the macro: [`LockManager::read_lock`] and [`LockManager::write_lock`].
///
/// # `permits = N`
///
/// A counting semaphore: at most `N` holders of the key at any moment, each with its own
/// lease, so a holder that dies returns its permit when its lease ends. Not with `mode` or
/// `reentrant`.
///
/// The same without the macro: [`LockManager::semaphore`].
///
/// # `fencing`
///
/// Draws a fencing token, a per-key number that grows with every acquisition; read it from
/// the guard (see `guard`). The counter stays in Redis after release.
///
/// The same without the macro: `.fencing(true)` and [`LockGuard::fencing_token`].
///
/// # `on_busy = "error" | "skip"`
///
/// What to do when the lock was not taken because another owner holds it: return the error
/// (default), or skip the body and return `Ok(Default::default())`, as scheduled jobs that
/// run on every node want. Other failures (Redis unreachable) are always returned.
///
/// The same without the macro: `match locks.lock(key).try_acquire().await? { Some(g) => …,
/// None => return Ok(Default::default()) }`.
///
/// # `guard = name`
///
/// Binds `name: &LockGuard` inside the body, for its key, fencing token, remaining lease,
/// `extend`, and `is_held`.
///
/// ```no_run
/// # use distlock::{distributed_lock, LockError};
/// #[distributed_lock(key = "compaction", fencing, guard = lock)]
/// async fn compact() -> Result<Option<u64>, LockError> {
///     Ok(lock.fencing_token())
/// }
/// ```
///
/// # `manager = expr`
///
/// The manager to lock through: an expression of type `LockManager`, `&LockManager` or
/// `&Arc<LockManager>`, such as a parameter or `self.locks`. Default: the one installed with
/// [`LockManager::install`]; a call without one fails with [`LockError::NotInstalled`].
///
/// ```no_run
/// # use distlock::{distributed_lock, LockError, LockManager};
/// struct Billing { locks: LockManager, region: String }
///
/// impl Billing {
///     #[distributed_lock(key = "invoice:{self.region}:{id}", manager = self.locks)]
///     async fn invoice(&self, id: u64) -> Result<(), LockError> {
///         Ok(())
///     }
/// }
/// ```
///
/// # Misuse
///
/// Every mistake is a compile error that points at the offending token: a function that is
/// not `async`, an item that is not a function, a trait method without a body, a missing,
/// unknown or repeated argument, a duration without a unit, an unknown placeholder,
/// unbalanced braces, a return type that cannot carry `LockError`, and contradictory options
/// (`wait` or `retry_delay` with `retries = 0`, `max_hold` without `watchdog`, `min_hold`
/// longer than `ttl` or on a shared lock, `mode` with `permits`, `reentrant` permits, `key`
/// with `keys`, `mode`, `permits` or `min_hold` with `keys`, and `fair` with `keys`, `mode`,
/// `permits`, `fencing` or `min_hold`).
pub use distlock_macros::distributed_lock;
