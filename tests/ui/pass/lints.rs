//! Annotated functions compile without warnings under strict lints.
#![deny(warnings, unused, rust_2018_idioms, unreachable_code)]

use distlock::{LockError, LockGuard, LockManager, distributed_lock};

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

/// A fair lock, with the options it combines with.
#[distributed_lock(
    key = "ticket:{queue}",
    ttl = "10s",
    wait = "30s",
    fair,
    watchdog,
    reentrant,
    on_busy = "skip",
    manager = locks,
)]
pub async fn next_ticket(locks: &LockManager, queue: &str) -> Result<(), AppError> {
    Ok(())
}

/// The annotated future is `Send` when the body is: it can be spawned on tokio.
pub fn spawnable(locks: LockManager) {
    drop(tokio::spawn(async move {
        next_ticket(&locks, "a").await?;
        report(&locks, 1).await
    }));
}

fn main() {}
