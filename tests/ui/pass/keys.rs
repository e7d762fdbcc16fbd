//! A set of locks: templates with placeholders and fixed names, every option that applies to
//! a set, and the guard bound as `&MultiGuard`.
use std::time::Duration;

use distlock::{LockError, LockManager, MultiGuard, distributed_lock};

pub struct Account {
    pub id: u64,
}

#[distributed_lock(
    keys = ["account:{from.id}", "account:{to.id}", "ledger"],
    ttl = "10s",
    retries = 5,
    retry_delay = "20ms",
    wait = "5s",
    watchdog,
    max_hold = "1m",
    reentrant,
    fencing,
    on_busy = "error",
    on_lost = "error",
    guard = set,
    manager = locks
)]
pub async fn transfer(
    locks: &LockManager,
    from: &Account,
    to: &Account,
    amount: u64,
) -> Result<u64, LockError> {
    let set: &MultiGuard = set;
    let _: Option<u64> = set.fencing_token("ledger");
    let _: Duration = set.remaining();
    Ok(amount)
}

#[distributed_lock(keys = ["nightly:{day}"], on_busy = "skip", manager = locks)]
pub async fn nightly(locks: &LockManager, day: u32) -> Result<(), LockError> {
    let _ = day;
    Ok(())
}

fn assert_send<T: Send>(_: T) {}

pub fn spawnable(locks: &'static LockManager, from: &'static Account, to: &'static Account) {
    assert_send(transfer(locks, from, to, 1));
}

fn main() {}
