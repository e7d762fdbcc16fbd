//! Cohorts: a plain lock passes among one manager's own tasks with no server command, within
//! bounds, then goes back to Redis so that other processes get their turn.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::support::{keys, manager, raw, shared_server, unique_prefix};
use distlock::testing::RedisServer;
use distlock::{LockError, LockGuard, LockManager, LockRequest};
use redis::AsyncCommands;

/// A lease only a release ends within a test.
const LONG: Duration = Duration::from_secs(600);

/// Commands a lock's take, release or hand-off would run that the server ran since the last
/// `CONFIG RESETSTAT`, and its `SET`s apart (the manager's registration refresh may run one).
fn lock_commands(server: &RedisServer) -> (u64, u64) {
    let info = server.command(&["INFO", "commandstats"]).unwrap();
    let mut counts = (0, 0);
    for (name, rest) in info
        .lines()
        .filter_map(|line| line.strip_prefix("cmdstat_"))
        .filter_map(|line| line.split_once(":calls="))
    {
        let calls: u64 = rest.split(',').next().unwrap().parse().unwrap();
        match name {
            "set" => counts.1 += calls,
            "get" | "del" | "delifeq" | "delex" | "evalsha" | "eval" | "publish" | "pttl"
            | "exists" | "pexpire" => counts.0 += calls,
            _ => {}
        }
    }
    counts
}

/// Waits until `locks` has a task ready to take the lock as it is released.
async fn ready(locks: &LockManager) {
    let started = Instant::now();
    while locks.stats().ready_for_handoff == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no waiter got ready"
        );
        tokio::task::yield_now().await;
    }
}

/// A task of `locks` that waits for `key` (its timer alone would take an hour).
fn waiter(locks: &LockManager, key: &str, ttl: Duration) -> tokio::task::JoinHandle<LockGuard> {
    waiter_with(locks, key, ttl, |request| request)
}

/// The same, with more options on its request.
fn waiter_with(
    locks: &LockManager,
    key: &str,
    ttl: Duration,
    options: impl for<'m> FnOnce(LockRequest<'m>) -> LockRequest<'m> + Send + 'static,
) -> tokio::task::JoinHandle<LockGuard> {
    let (locks, key) = (locks.clone(), key.to_owned());
    tokio::spawn(async move {
        let request = locks
            .lock(key)
            .ttl(ttl)
            .retry_delay(Duration::from_secs(3600))
            .wait(Duration::from_secs(30));
        options(request).acquire().await.unwrap()
    })
}

#[tokio::test]
async fn a_local_pass_sends_no_server_command_and_shares_the_server_hold() {
    // Its own server: the command counts are server-wide.
    let server = RedisServer::start().unwrap();
    let locks = manager(&server, "c:").await;
    let first = locks.lock("k").ttl(LONG).acquire().await.unwrap();
    let waiting = waiter(&locks, "k", LONG);
    ready(&locks).await;

    server.command(&["CONFIG", "RESETSTAT"]).unwrap();
    let (token, remaining) = (first.token().to_owned(), first.remaining());
    first.release().await.unwrap();
    let second = waiting.await.unwrap();
    // No command of a lock's; at most the registration refresh's SET (every 3 s).
    let (lock, set) = lock_commands(&server);
    let stats = server.command(&["INFO", "commandstats"]).unwrap();
    assert!(lock == 0 && set <= 1, "{stats}");
    assert_eq!(locks.stats().local_passes, 1);
    assert_eq!(second.local_passes(), 1);
    // The same server hold: its token and its lease.
    assert_eq!(second.token(), token);
    assert!(second.remaining() <= remaining);
    let mut conn = raw(&server).await;
    let owner: String = conn.get("c:{k}").await.unwrap();
    assert_eq!(owner, second.token());
    assert!(second.is_held().await.unwrap());
    // The inspector shows the server hold.
    let info = locks.inspect("k").await.unwrap().unwrap();
    assert_eq!(info.holders[0].token, token);
    second.release().await.unwrap();
    assert!(keys(&server, "c:").is_empty());
}

#[tokio::test]
async fn cohort_false_and_fencing_go_through_the_server() {
    let server = shared_server();
    let prefix = unique_prefix("no-cohort");
    let locks = manager(&server, &prefix).await;
    // The holder says no.
    let first = locks
        .lock("k")
        .ttl(LONG)
        .cohort(false)
        .acquire()
        .await
        .unwrap();
    let waiting = waiter(&locks, "k", LONG);
    ready(&locks).await;
    let token = first.token().to_owned();
    first.release().await.unwrap();
    let second = waiting.await.unwrap();
    assert_eq!(second.local_passes(), 0);
    assert_ne!(second.token(), token);
    // The waiter says no.
    let waiting = waiter_with(&locks, "k", LONG, |request| request.cohort(false));
    ready(&locks).await;
    let token = second.token().to_owned();
    second.release().await.unwrap();
    let third = waiting.await.unwrap();
    assert_eq!(third.local_passes(), 0);
    assert_ne!(third.token(), token);
    third.release().await.unwrap();
    assert_eq!(locks.stats().local_passes, 0);

    // Fenced locks: every holder draws a larger token from the server.
    let mut last = 0;
    let inside = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (locks, inside) = (locks.clone(), inside.clone());
        tasks.push(tokio::spawn(async move {
            let mut fences = Vec::new();
            for _ in 0..10 {
                let guard = locks
                    .lock("fenced")
                    .fencing(true)
                    .wait(Duration::from_secs(30))
                    .acquire()
                    .await
                    .unwrap();
                assert!(!inside.swap(true, Ordering::SeqCst));
                assert_eq!(guard.local_passes(), 0);
                fences.push((Instant::now(), guard.fencing_token().unwrap()));
                inside.store(false, Ordering::SeqCst);
                guard.release().await.unwrap();
            }
            fences
        }));
    }
    let mut fences = Vec::new();
    for task in tasks {
        fences.extend(task.await.unwrap());
    }
    fences.sort();
    for (_, fence) in fences {
        assert!(fence > last, "fencing tokens grow with every holder");
        last = fence;
    }
    assert_eq!(locks.stats().local_passes, 0);
}

#[tokio::test]
async fn a_lease_lost_during_a_run_is_lost_for_the_holder_it_reached() {
    let server = shared_server();
    let prefix = unique_prefix("lost-run");
    let locks = manager(&server, &prefix).await;
    let lease = Duration::from_millis(600);
    let first = locks.lock("k").ttl(lease).acquire().await.unwrap();
    let waiting = waiter(&locks, "k", lease);
    ready(&locks).await;
    first.release().await.unwrap();
    let second = waiting.await.unwrap();
    assert_eq!(second.local_passes(), 1);
    // Nobody renews the shared lease: it runs out for the holder that has it now.
    let lost = tokio::time::timeout(Duration::from_secs(5), second.lost())
        .await
        .expect("the shared lease runs out");
    assert!(matches!(lost, LockError::Lost { .. }), "{lost:?}");
    // The local deadline keeps a margin: the key ends on the server a moment later.
    let mut conn = raw(&server).await;
    let started = Instant::now();
    while conn
        .exists::<_, bool>(format!("{prefix}{{k}}"))
        .await
        .unwrap()
    {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the key never expired"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let released = second.release().await;
    assert!(
        matches!(released, Err(LockError::Lost { .. })),
        "{released:?}"
    );
}

#[tokio::test]
async fn a_passed_lock_is_renewed_by_its_new_holders_watchdog() {
    let server = shared_server();
    let prefix = unique_prefix("renewed-run");
    let locks = manager(&server, &prefix).await;
    let lease = Duration::from_millis(300);
    let first = locks.lock("k").ttl(lease).acquire().await.unwrap();
    let waiting = waiter_with(&locks, "k", lease, |request| request.watchdog(true));
    ready(&locks).await;
    first.release().await.unwrap();
    let second = waiting.await.unwrap();
    assert_eq!(second.local_passes(), 1);
    // Three leases long: only renewals keep it, at the lease the holder asked for.
    tokio::time::sleep(lease * 3).await;
    assert!(!second.is_lost());
    assert!(second.is_held().await.unwrap());
    let mut conn = raw(&server).await;
    let pttl: u64 = conn.pttl(format!("{prefix}{{k}}")).await.unwrap();
    assert!(
        pttl <= 300,
        "renewed to {pttl} ms, more than the 300 ms asked for"
    );
    second.release().await.unwrap();
    assert!(keys(&server, &prefix).is_empty());
}

#[tokio::test]
async fn a_waiter_that_asked_for_a_shorter_lease_gets_its_own_through_the_server() {
    let server = shared_server();
    let prefix = unique_prefix("short-lease");
    let locks = manager(&server, &prefix).await;
    let first = locks.lock("k").ttl(LONG).acquire().await.unwrap();
    let waiting = waiter(&locks, "k", Duration::from_millis(300));
    ready(&locks).await;
    first.release().await.unwrap();
    let second = waiting.await.unwrap();
    // Passed as it is, the lock would outlive this holder by ten minutes if it stopped.
    assert_eq!(second.local_passes(), 0);
    assert!(second.remaining() <= Duration::from_millis(300));
    second.release().await.unwrap();
}

#[tokio::test]
async fn shutdown_during_a_run_gives_the_lock_back() {
    let server = shared_server();
    let prefix = unique_prefix("shutdown-run");
    let locks = manager(&server, &prefix).await;
    let first = locks.lock("k").ttl(LONG).acquire().await.unwrap();
    let waiting = waiter(&locks, "k", LONG);
    ready(&locks).await;
    first.release().await.unwrap();
    let second = waiting.await.unwrap();
    assert_eq!(second.local_passes(), 1);
    locks.shutdown().await;
    assert!(matches!(second.lost().await, LockError::ShutDown));
    assert!(matches!(second.release().await, Err(LockError::ShutDown)));
    assert!(keys(&server, &prefix).is_empty());
}

/// Tasks of several managers take one hot lock in turn: nobody is ever inside with another,
/// runs stop at their bounds, and every manager gets a share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_stop_at_their_bounds_and_every_manager_gets_its_turns() {
    let server = shared_server();
    let prefix = unique_prefix("shares");
    let mut managers = Vec::new();
    for _ in 0..3 {
        let locks = LockManager::builder()
            .redis_url(server.url())
            .key_prefix(&prefix)
            .cohort(5, Duration::from_secs(1))
            .build()
            .await
            .unwrap();
        managers.push(locks);
    }
    let inside = Arc::new(AtomicBool::new(false));
    let longest = Arc::new(AtomicU32::new(0));
    let entries: Vec<Arc<AtomicU64>> = (0..3).map(|_| Arc::new(AtomicU64::new(0))).collect();
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut tasks = Vec::new();
    for (at, locks) in managers.iter().enumerate() {
        for _ in 0..6 {
            let (locks, inside, longest, entries) = (
                locks.clone(),
                inside.clone(),
                longest.clone(),
                entries[at].clone(),
            );
            tasks.push(tokio::spawn(async move {
                while Instant::now() < deadline {
                    let guard = locks
                        .lock("hot")
                        .wait(Duration::from_secs(10))
                        .acquire()
                        .await
                        .unwrap();
                    assert!(!inside.swap(true, Ordering::SeqCst), "two holders at once");
                    longest.fetch_max(guard.local_passes(), Ordering::SeqCst);
                    entries.fetch_add(1, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    inside.store(false, Ordering::SeqCst);
                    guard.release().await.unwrap();
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    let counts: Vec<u64> = entries.iter().map(|e| e.load(Ordering::SeqCst)).collect();
    let passes: u64 = managers.iter().map(|m| m.stats().local_passes).sum();
    assert!(passes > 0, "no local pass in {counts:?}");
    assert!(
        longest.load(Ordering::SeqCst) <= 5,
        "a run went past its bound"
    );
    let total: u64 = counts.iter().sum();
    for count in &counts {
        assert!(
            *count * 10 >= total,
            "a manager had less than a tenth of the entries: {counts:?}"
        );
    }
    assert!(keys(&server, &prefix).is_empty());
}
