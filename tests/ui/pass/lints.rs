//! Annotated functions compile without warnings under strict lints.
#![deny(warnings, unused, rust_2018_idioms, unreachable_code)]

use distlock::{distributed_lock, LockError, LockGuard, LockManager};

#[derive(Debug)]
pub enum AppError {
    Lock(LockError),
    Io(std::io::Error),
}

impl From<LockError> for AppError {
    fn from(error: LockError) -> Self {
        AppError::Lock(error)
    }
}

impl From<std::io::Error> for AppError {
    fn from(error: std::io::Error) -> Self {
        AppError::Io(error)
    }
}

/// Every argument that this version supports, together.
#[distributed_lock(
    key = "report:{day}",
    ttl = "2m",
    retries = 5,
    retry_delay = "100ms",
    wait = "30s",
    fencing,
    watchdog,
    max_hold = "10m",
    reentrant,
    on_lost = "error",
    min_hold = "1m",
    on_busy = "error",
    guard = lock,
    manager = locks,
)]
pub async fn report(locks: &LockManager, day: u32) -> Result<Option<u64>, AppError> {
    let _: &LockGuard = lock;
    if day == 0 {
        return Err(std::io::Error::other("no day zero").into());
    }
    std::fs::metadata("/").map(|_| ())?;
    Ok(lock.fencing_token())
}

/// The annotated future is `Send` when the body is: it can be spawned on tokio.
pub fn spawnable(locks: LockManager) {
    drop(tokio::spawn(async move { report(&locks, 1).await }));
}

fn main() {}
