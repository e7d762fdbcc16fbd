//! Distributed locks for async Rust, on Redis.
#![warn(
    missing_docs,
    missing_debug_implementations,
    rust_2018_idioms,
    unreachable_pub
)]

pub use distlock_macros::distributed_lock;
pub use distlock_runtime::*;
