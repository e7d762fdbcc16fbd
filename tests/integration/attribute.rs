//! `#[distributed_lock]` at run time: the lock is held exactly while the body runs, and is
//! released on every way out of it.
#![warn(clippy::pedantic)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use distlock::{LockError, LockManager, distributed_lock};
use tokio::sync::{Notify, oneshot};

use crate::support;
use crate::support::{keys, manager, shared_server, unique_prefix};

#[derive(Debug)]
enum AppError {
    Lock(LockError),
    Domain(&'static str),
}

impl From<LockError> for AppError {
    fn from(error: LockError) -> Self {
        Self::Lock(error)
    }
}

struct Order {
    id: u64,
}

/// Whether the lock named `key` is free right now (one attempt, released at once), asked
/// from another task: another owner.
async fn is_free(locks: &LockManager, key: &str) -> bool {
    let (locks, key) = (locks.clone(), key.to_owned());
    tokio::spawn(async move {
        match locks.lock(key).try_acquire().await.unwrap() {
            Some(guard) => {
                guard.release().await.unwrap();
                true
            }
            None => false,
        }
    })
    .await
    .unwrap()
}

#[distributed_lock(key = "order:{order.id}", ttl = "30s", manager = locks)]
async fn ship(locks: &LockManager, order: &Order, seen: &mut Vec<bool>) -> Result<u64, AppError> {
    seen.push(!is_free(locks, &format!("order:{}", order.id)).await);
    Ok(order.id * 2)
}

#[tokio::test]
async fn the_body_runs_under_the_lock_and_the_lock_is_released_after() {
    let server = shared_server();
    let prefix = unique_prefix("attr-basic");
    let locks = manager(&server, &prefix).await;
    let mut seen = Vec::new();
    let result = ship(&locks, &Order { id: 7 }, &mut seen).await.unwrap();
    assert_eq!(result, 14);
    assert_eq!(seen, vec![true], "the key was held while the body ran");
    assert!(is_free(&locks, "order:7").await);
    assert!(keys(&server, &prefix).is_empty());
}

#[distributed_lock(key = "job", ttl = "30s", manager = locks)]
async fn fails_with_question_mark(locks: &LockManager, fail: bool) -> Result<(), AppError> {
    let _ = locks;
    let outcome: Result<(), AppError> = if fail {
        Err(AppError::Domain("boom"))
    } else {
        Ok(())
    };
    outcome?;
    Ok(())
}

#[distributed_lock(key = "job", ttl = "30s", manager = locks)]
async fn returns_early(locks: &LockManager, early: bool) -> Result<u32, AppError> {
    let _ = locks;
    if early {
        return Ok(1);
    }
    Ok(2)
}

#[tokio::test]
async fn question_mark_and_early_return_release_the_lock() {
    let server = shared_server();
    let prefix = unique_prefix("attr-exits");
    let locks = manager(&server, &prefix).await;
    assert!(matches!(
        fails_with_question_mark(&locks, true).await,
        Err(AppError::Domain("boom"))
    ));
    assert!(is_free(&locks, "job").await, "released after `?`");
    assert_eq!(returns_early(&locks, true).await.unwrap(), 1);
    assert!(is_free(&locks, "job").await, "released after `return`");
    assert_eq!(returns_early(&locks, false).await.unwrap(), 2);
    assert!(is_free(&locks, "job").await);
}

#[distributed_lock(key = "panic", ttl = "30s", manager = locks)]
async fn panics(locks: LockManager, entered: oneshot::Sender<()>) -> Result<(), AppError> {
    let _ = locks;
    entered.send(()).unwrap();
    panic!("the body panics");
}

#[tokio::test]
async fn a_panic_in_a_spawned_task_releases_the_lock() {
    let server = shared_server();
    let prefix = unique_prefix("attr-panic");
    let locks = manager(&server, &prefix).await;
    let (entered, inside) = oneshot::channel();
    let task = tokio::spawn(panics(locks.clone(), entered));
    inside.await.unwrap();
    assert!(task.await.unwrap_err().is_panic());
    support::take_soon(&locks, "panic", "free long before the 30 s lease").await;
}

#[distributed_lock(key = "slow", ttl = "30s", manager = locks)]
async fn never_finishes(locks: &LockManager, entered: &Notify) -> Result<(), AppError> {
    let _ = locks;
    entered.notify_one();
    std::future::pending::<()>().await;
    Ok(())
}

#[tokio::test]
async fn cancelling_the_call_releases_the_lock() {
    let server = shared_server();
    let prefix = unique_prefix("attr-cancel");
    let locks = manager(&server, &prefix).await;
    let entered = Notify::new();
    let call = never_finishes(&locks, &entered);
    tokio::select! {
        _ = call => unreachable!("the body never finishes"),
        () = entered.notified() => {}
    }
    support::take_soon(&locks, "slow", "free long before the 30 s lease").await;
}

#[tokio::test]
async fn cancelling_with_a_timeout_releases_the_lock() {
    let server = shared_server();
    let prefix = unique_prefix("attr-timeout");
    let locks = manager(&server, &prefix).await;
    let entered = Notify::new();
    let outcome =
        tokio::time::timeout(Duration::from_millis(50), never_finishes(&locks, &entered)).await;
    assert!(outcome.is_err());
    support::take_soon(&locks, "slow", "free long before the 30 s lease").await;
}

#[derive(Default, Debug, PartialEq)]
struct Report {
    ran: bool,
}

#[distributed_lock(key = "nightly", on_busy = "skip", manager = locks)]
async fn nightly(locks: &LockManager) -> Result<Report, AppError> {
    let _ = locks;
    Ok(Report { ran: true })
}

#[distributed_lock(key = "nightly", retries = 2, retry_delay = "1ms", manager = locks)]
async fn nightly_strict(locks: &LockManager) -> Result<Report, AppError> {
    let _ = locks;
    Ok(Report { ran: true })
}

#[tokio::test]
async fn busy_locks_skip_or_fail() {
    let server = shared_server();
    let prefix = unique_prefix("attr-busy");
    let locks = manager(&server, &prefix).await;
    assert_eq!(nightly(&locks).await.unwrap(), Report { ran: true });
    let held = locks.lock("nightly").acquire().await.unwrap();
    assert_eq!(
        nightly(&locks).await.unwrap(),
        Report { ran: false },
        "skipped"
    );
    match nightly_strict(&locks).await {
        Err(AppError::Lock(LockError::Busy { key, attempts, .. })) => {
            assert_eq!(key, "nightly");
            assert_eq!(attempts, 3);
        }
        other => panic!("expected Busy, got {other:?}"),
    }
    held.release().await.unwrap();
}

struct Shard {
    locks: LockManager,
    name: String,
    runs: AtomicU32,
}

impl Shard {
    #[distributed_lock(key = "shard:{self.name}:{{literal}}", fencing, guard = lock, manager = self.locks)]
    async fn compact(&self) -> Result<(String, Option<u64>), AppError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        Ok((lock.key().to_owned(), lock.fencing_token()))
    }
}

#[tokio::test]
async fn self_fields_guard_binding_and_fencing() {
    let server = shared_server();
    let prefix = unique_prefix("attr-self");
    let shard = Shard {
        locks: manager(&server, &prefix).await,
        name: "eu-1".into(),
        runs: AtomicU32::new(0),
    };
    let (key, first) = shard.compact().await.unwrap();
    let (_, second) = shard.compact().await.unwrap();
    assert_eq!(key, "shard:eu-1:{literal}");
    assert!(second.unwrap() > first.unwrap());
    assert_eq!(shard.runs.load(Ordering::SeqCst), 2);
}

/// The same checker as the manual API's: tasks doing a read-modify-write through an
/// annotated function never overlap and lose no update.
#[distributed_lock(key = "counter", ttl = "10s", wait = "60s", retry_delay = "2ms", manager = locks)]
async fn increment(
    locks: &LockManager,
    inside: &AtomicBool,
    value: &AtomicU32,
) -> Result<(), AppError> {
    let _ = locks;
    assert!(
        !inside.swap(true, Ordering::SeqCst),
        "two holders inside at once"
    );
    let read = value.load(Ordering::SeqCst);
    tokio::task::yield_now().await;
    value.store(read + 1, Ordering::SeqCst);
    inside.store(false, Ordering::SeqCst);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn annotated_functions_exclude_each_other() {
    let server = shared_server();
    let prefix = unique_prefix("attr-mutex");
    let inside = Arc::new(AtomicBool::new(false));
    let value = Arc::new(AtomicU32::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..3 {
        let locks = manager(&server, &prefix).await;
        for _ in 0..10 {
            let (locks, inside, value) = (locks.clone(), inside.clone(), value.clone());
            tasks.spawn(async move {
                for _ in 0..3 {
                    increment(&locks, &inside, &value).await.unwrap();
                }
            });
        }
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    assert_eq!(value.load(Ordering::SeqCst), 90);
}

#[distributed_lock(key = "installed:{id}")]
async fn uses_the_installed_manager(id: u32) -> Result<u32, AppError> {
    Ok(id)
}

/// The only test in this binary that installs a manager.
#[tokio::test]
async fn the_installed_manager_is_the_default() {
    match uses_the_installed_manager(1).await {
        Err(AppError::Lock(LockError::NotInstalled)) => {}
        other => panic!("expected NotInstalled, got {other:?}"),
    }
    let server = shared_server();
    let prefix = unique_prefix("attr-installed");
    let locks = manager(&server, &prefix).await;
    locks.clone().install().unwrap();
    assert!(matches!(
        locks.clone().install(),
        Err(LockError::AlreadyInstalled)
    ));
    assert_eq!(uses_the_installed_manager(5).await.unwrap(), 5);
    assert!(keys(&server, &prefix).is_empty());
}
