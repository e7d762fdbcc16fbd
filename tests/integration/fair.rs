//! Fair locks: waiters queue in Redis, across processes, and enter in arrival order; a waiter
//! that dies, gives up or is cancelled leaves the queue, and nothing is left behind.

use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distlock::testing::RedisServer;
use distlock::{LockError, LockManager, distributed_lock};
use redis::AsyncCommands;

use crate::support;
use crate::support::{keys, manager, raw, shared_server, unique_prefix};

/// Far longer than any test: a lock with this lease is only ever freed by a release.
const LONG: Duration = Duration::from_secs(600);

/// Set in the child process that `a_waiter_whose_process_dies_drops_out_of_the_queue` starts:
/// the server's URL and the key prefix, separated by a space.
const CHILD: &str = "DISTLOCK_TEST_FAIR_CHILD";

/// The queue of fair lock `key` under `prefix`, as the data model names it.
fn queue(prefix: &str, key: &str) -> String {
    format!("{prefix}{{{key}}}:queue")
}

/// Waits until `key`'s queue holds `len` waiters.
async fn queued(server: &RedisServer, prefix: &str, key: &str, len: usize) {
    queued_within(server, prefix, key, len, Duration::from_secs(10)).await;
}

/// Waits until `key`'s queue holds `len` waiters, for `limit` at most.
async fn queued_within(server: &RedisServer, prefix: &str, key: &str, len: usize, limit: Duration) {
    let mut conn = raw(server).await;
    let started = Instant::now();
    loop {
        let now: usize = conn.llen(queue(prefix, key)).await.unwrap();
        if now == len {
            return;
        }
        assert!(
            started.elapsed() < limit,
            "the queue never held {len} waiters within {limit:?} (it holds {now})"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Two managers on `server` under `prefix`, as two processes would have.
async fn two_managers(server: &RedisServer, prefix: &str) -> (LockManager, LockManager) {
    (manager(server, prefix).await, manager(server, prefix).await)
}

/// A fair waiter on `key` that notes its name in `entered` once inside, then releases.
fn waiter(
    locks: &LockManager,
    key: &'static str,
    name: usize,
    entered: &Arc<Mutex<Vec<usize>>>,
) -> tokio::task::JoinHandle<()> {
    let (locks, entered) = (locks.clone(), entered.clone());
    tokio::spawn(async move {
        let guard = locks
            .lock(key)
            .fair(true)
            .ttl(Duration::from_secs(10))
            .wait(Duration::from_secs(30))
            .acquire()
            .await
            .unwrap();
        entered.lock().unwrap().push(name);
        guard.release().await.unwrap();
    })
}

#[tokio::test]
async fn waiters_enter_in_arrival_order_across_managers() {
    let server = shared_server();
    let prefix = unique_prefix("fair-order");
    let managers = [
        manager(&server, &prefix).await,
        manager(&server, &prefix).await,
        manager(&server, &prefix).await,
    ];
    let holder = managers[0]
        .lock("k")
        .fair(true)
        .ttl(LONG)
        .acquire()
        .await
        .unwrap();
    // Each waiter arrives once the one before it is queued; the managers take turns, and one
    // of them holds the lock, so hand-offs inside one process and grants across processes mix.
    let entered = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for name in 0..12 {
        let locks = &managers[(name * 7 + name / 3) % 3];
        tasks.push(waiter(locks, "k", name, &entered));
        queued(&server, &prefix, "k", name + 1).await;
    }
    holder.release().await.unwrap();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(*entered.lock().unwrap(), (0..12).collect::<Vec<_>>());
    assert_eq!(keys(&server, &prefix), Vec::<String>::new());
}

#[tokio::test]
async fn a_release_grants_the_head_so_nobody_overtakes_it() {
    let server = shared_server();
    let prefix = unique_prefix("fair-grant");
    let (a, b) = two_managers(&server, &prefix).await;
    let holder = a.lock("k").fair(true).ttl(LONG).acquire().await.unwrap();
    let (done, finish) = tokio::sync::oneshot::channel::<()>();
    let head = tokio::spawn({
        let b = b.clone();
        async move {
            let guard = b
                .lock("k")
                .fair(true)
                .wait(Duration::from_secs(30))
                .acquire()
                .await
                .unwrap();
            finish.await.unwrap();
            guard.release().await.unwrap();
        }
    });
    queued(&server, &prefix, "k", 1).await;
    holder.release().await.unwrap();
    // Granted in the release itself: neither a fair nor a plain request finds it free, even
    // before the head has heard of it.
    assert!(
        a.lock("k")
            .fair(true)
            .try_acquire()
            .await
            .unwrap()
            .is_none()
    );
    assert!(a.lock("k").try_acquire().await.unwrap().is_none());
    done.send(()).unwrap();
    head.await.unwrap();
    assert_eq!(keys(&server, &prefix), Vec::<String>::new());
}

#[tokio::test]
async fn cancelled_waiters_leave_the_queue_at_once() {
    let server = shared_server();
    let prefix = unique_prefix("fair-cancel");
    let (a, b) = two_managers(&server, &prefix).await;
    let holder = a.lock("k").fair(true).ttl(LONG).acquire().await.unwrap();
    let entered = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for name in 0..6 {
        let locks = if name % 2 == 0 { &a } else { &b };
        tasks.push(waiter(locks, "k", name, &entered));
        queued(&server, &prefix, "k", name + 1).await;
    }
    // Three of them are cancelled, among them the head and one whose manager holds the lock.
    for name in [0, 3, 4] {
        tasks[name].abort();
    }
    // Taken out by the release sent behind each, well before an entry left alone would
    // lapse by itself (3 s without a renewal).
    queued_within(&server, &prefix, "k", 3, Duration::from_secs(1)).await;
    // One more gives up when its wait runs out: it is out of the queue when it answers.
    let impatient = b
        .lock("k")
        .fair(true)
        .wait(Duration::from_millis(200))
        .acquire()
        .await;
    assert!(
        matches!(impatient, Err(LockError::Busy { .. })),
        "{impatient:?}"
    );
    let mut conn = raw(&server).await;
    let left: usize = conn.llen(queue(&prefix, "k")).await.unwrap();
    assert_eq!(left, 3, "the waiter that gave up is still queued");
    holder.release().await.unwrap();
    for (name, task) in tasks.into_iter().enumerate() {
        let outcome = task.await;
        assert_eq!(outcome.is_err(), [0, 3, 4].contains(&name), "waiter {name}");
    }
    assert_eq!(*entered.lock().unwrap(), vec![1, 2, 5]);
    assert_eq!(keys(&server, &prefix), Vec::<String>::new());
}

#[tokio::test]
async fn a_waiter_cancelled_as_the_lock_is_granted_to_it_passes_it_on() {
    let server = shared_server();
    let prefix = unique_prefix("fair-cancel-grant");
    let (a, b) = two_managers(&server, &prefix).await;
    let seed = fastrand::u64(..);
    let mut rng = fastrand::Rng::with_seed(seed);
    for round in 0..30 {
        let holder = a.lock("k").fair(true).ttl(LONG).acquire().await.unwrap();
        let entered = Arc::new(Mutex::new(Vec::new()));
        // The first waiter is of the holder's manager (an in-process grant) or of another.
        let first = waiter(if round % 2 == 0 { &a } else { &b }, "k", 0, &entered);
        queued(&server, &prefix, "k", 1).await;
        let second = waiter(&b, "k", 1, &entered);
        queued(&server, &prefix, "k", 2).await;
        let release = tokio::spawn(holder.release());
        // Cancelled before, during or after the grant reaches it.
        for _ in 0..rng.usize(0..40) {
            tokio::task::yield_now().await;
        }
        first.abort();
        release.await.unwrap().unwrap();
        second
            .await
            .unwrap_or_else(|e| panic!("seed {seed}, round {round}: {e}"));
        let _ = first.await;
        let entered = entered.lock().unwrap().clone();
        assert!(
            entered == [0, 1] || entered == [1],
            "seed {seed}, round {round}: {entered:?}"
        );
        assert_eq!(
            keys(&server, &prefix),
            Vec::<String>::new(),
            "seed {seed}, round {round}"
        );
    }
}

#[tokio::test]
async fn a_waiter_whose_process_dies_drops_out_of_the_queue() {
    let server = shared_server();
    let prefix = unique_prefix("fair-dead");
    let locks = manager(&server, &prefix).await;
    let holder = locks
        .lock("k")
        .fair(true)
        .ttl(LONG)
        .acquire()
        .await
        .unwrap();
    // Another process queues first, and is killed while it waits.
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            &support::test_name(module_path!(), "child_waits_in_the_queue"),
            "--nocapture",
        ])
        .env(CHILD, format!("{} {prefix}", server.url()))
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    queued(&server, &prefix, "k", 1).await;
    let entered = Arc::new(Mutex::new(Vec::new()));
    let behind = waiter(&locks, "k", 1, &entered);
    queued(&server, &prefix, "k", 2).await;
    child.kill().unwrap();
    child.wait().unwrap();
    // Its entry's lease (3 s) ends, and the next script to run takes it out: the live
    // waiter's own renewal, within a second.
    queued(&server, &prefix, "k", 1).await;
    holder.release().await.unwrap();
    behind.await.unwrap();
    assert_eq!(*entered.lock().unwrap(), vec![1]);
    assert_eq!(keys(&server, &prefix), Vec::<String>::new());
}

#[tokio::test]
async fn child_waits_in_the_queue() {
    let Some(setup) = std::env::var(CHILD).ok() else {
        return; // run by `a_waiter_whose_process_dies_drops_out_of_the_queue` only
    };
    let (url, prefix) = setup.split_once(' ').unwrap();
    let locks = LockManager::builder()
        .redis_url(url)
        .key_prefix(prefix)
        .build()
        .await
        .unwrap();
    let taken = locks
        .lock("k")
        .fair(true)
        .wait(Duration::from_secs(60))
        .acquire()
        .await;
    panic!("the child should be killed while it waits, but: {taken:?}");
}

#[tokio::test]
async fn many_waiters_exclude_each_other_and_leave_nothing() {
    let server = shared_server();
    let prefix = unique_prefix("fair-many");
    let managers = [
        manager(&server, &prefix).await,
        manager(&server, &prefix).await,
        manager(&server, &prefix).await,
    ];
    let inside = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let entries = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for locks in &managers {
        for _ in 0..8 {
            let (locks, inside, entries) = (locks.clone(), inside.clone(), entries.clone());
            tasks.spawn(async move {
                for _ in 0..10 {
                    let guard = locks
                        .lock("hot")
                        .fair(true)
                        .ttl(Duration::from_secs(5))
                        .wait(Duration::from_secs(30))
                        .acquire()
                        .await
                        .unwrap();
                    assert!(!inside.swap(true, std::sync::atomic::Ordering::SeqCst));
                    entries.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    inside.store(false, std::sync::atomic::Ordering::SeqCst);
                    guard.release().await.unwrap();
                }
            });
        }
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    assert_eq!(entries.load(std::sync::atomic::Ordering::SeqCst), 240);
    assert_eq!(keys(&server, &prefix), Vec::<String>::new());
}

#[tokio::test]
async fn fair_plain_and_shared_requests_on_one_key_exclude_each_other() {
    let server = shared_server();
    let prefix = unique_prefix("fair-kinds");
    let locks = manager(&server, &prefix).await;
    let fair = locks.lock("k").fair(true).acquire().await.unwrap();
    assert!(locks.lock("k").try_acquire().await.unwrap().is_none());
    assert!(locks.read_lock("k").try_acquire().await.unwrap().is_none());
    assert!(
        locks
            .semaphore("k", 3)
            .try_acquire()
            .await
            .unwrap()
            .is_none()
    );
    fair.release().await.unwrap();
    let read = locks.read_lock("k").acquire().await.unwrap();
    let busy = locks
        .lock("k")
        .fair(true)
        .wait(Duration::from_millis(100))
        .acquire()
        .await;
    assert!(matches!(busy, Err(LockError::Busy { .. })), "{busy:?}");
    read.release().await.unwrap();
    let plain = locks.lock("k").acquire().await.unwrap();
    assert!(
        locks
            .lock("k")
            .fair(true)
            .try_acquire()
            .await
            .unwrap()
            .is_none()
    );
    plain.release().await.unwrap();
    assert_eq!(keys(&server, &prefix), Vec::<String>::new());
}

#[tokio::test]
async fn a_fair_lock_renews_extends_and_nests_like_any_other() {
    let server = shared_server();
    let prefix = unique_prefix("fair-lease");
    let locks = manager(&server, &prefix).await;
    distlock::scope(async {
        let outer = locks
            .lock("k")
            .fair(true)
            .reentrant(true)
            .watchdog(true)
            .ttl(Duration::from_millis(300))
            .acquire()
            .await
            .unwrap();
        let inner = locks
            .lock("k")
            .fair(true)
            .reentrant(true)
            .acquire()
            .await
            .unwrap();
        assert_eq!(inner.token(), outer.token());
        // Three leases long: only the watchdog keeps it.
        tokio::time::sleep(Duration::from_millis(900)).await;
        assert!(outer.is_held().await.unwrap());
        inner.release().await.unwrap();
        assert!(outer.is_held().await.unwrap());
        outer.extend(Duration::from_secs(5)).await.unwrap();
        outer.release().await.unwrap();
    })
    .await;
    assert_eq!(keys(&server, &prefix), Vec::<String>::new());
}

#[tokio::test]
async fn fair_requests_the_deployment_cannot_queue_are_refused() {
    let server = shared_server();
    let prefix = unique_prefix("fair-refused");
    let locks = manager(&server, &prefix).await;
    for (what, request) in [
        ("fencing", locks.lock("k").fair(true).fencing(true)),
        ("min_hold", locks.lock("k").fair(true).min_hold(LONG)),
        ("read", locks.read_lock("k").fair(true)),
        ("write", locks.write_lock("k").fair(true)),
        ("permits", locks.semaphore("k", 2).fair(true)),
    ] {
        let refused = request.ttl(LONG).acquire().await;
        assert!(
            matches!(refused, Err(LockError::InvalidInput { what: "fair", .. })),
            "{what}: {refused:?}"
        );
    }
    assert_eq!(keys(&server, &prefix), Vec::<String>::new());
}

#[distributed_lock(key = "job:{id}", fair, wait = "10s", manager = locks)]
async fn job(locks: &LockManager, id: u32, log: &Mutex<Vec<u32>>) -> Result<(), LockError> {
    log.lock().unwrap().push(id);
    Ok(())
}

#[tokio::test]
async fn an_annotated_function_takes_a_fair_lock() {
    let server = shared_server();
    let prefix = unique_prefix("fair-macro");
    let locks = manager(&server, &prefix).await;
    let holder = locks
        .lock("job:1")
        .fair(true)
        .ttl(LONG)
        .acquire()
        .await
        .unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let call = tokio::spawn({
        let (locks, log) = (locks.clone(), log.clone());
        async move { job(&locks, 1, &log).await }
    });
    queued(&server, &prefix, "job:1", 1).await;
    assert!(log.lock().unwrap().is_empty());
    holder.release().await.unwrap();
    call.await.unwrap().unwrap();
    assert_eq!(*log.lock().unwrap(), vec![1]);
    assert_eq!(keys(&server, &prefix), Vec::<String>::new());
}
