//! Long critical sections: watchdog renewal, the lease-lost signal, fencing tokens,
//! reentrancy and `min_hold`, against real redis-server processes.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use distlock::testing::RedisServer;
use distlock::{LockError, LockManager, distributed_lock};
use redis::AsyncCommands;
use tokio::sync::Notify;

use crate::support::{keys, manager, raw, shared_server, unique_prefix};

const TTL: Duration = Duration::from_millis(300);

/// Takes `"k"` with a `TTL` lease under the watchdog.
async fn watched(locks: &LockManager) -> distlock::LockGuard {
    locks
        .lock("k")
        .ttl(TTL)
        .watchdog(true)
        .acquire()
        .await
        .unwrap()
}

/// `evalsha` calls the server has answered so far.
fn evalsha_calls(server: &RedisServer) -> u64 {
    let info = server.command(&["INFO", "commandstats"]).unwrap();
    info.lines()
        .find_map(|line| line.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

#[tokio::test]
async fn the_watchdog_holds_a_long_body_and_stops_at_release() {
    let server = RedisServer::start().unwrap();
    let holder = manager(&server, "wd:").await;
    let other = manager(&server, "wd:").await;
    let guard = watched(&holder).await;

    // Ten leases long, another manager never gets in.
    let until = Instant::now() + TTL * 10;
    let mut attempts = 0;
    while Instant::now() < until {
        assert!(
            other.lock("k").try_acquire().await.unwrap().is_none(),
            "entered a held lock"
        );
        attempts += 1;
        tokio::time::sleep(TTL / 10).await;
    }
    assert!(attempts > 50);
    assert!(!guard.is_lost());
    assert!(guard.is_held().await.unwrap());
    let renewals = holder.stats().renewal_round_trips;
    assert!(
        renewals >= 20,
        "renewed at about TTL/3: {renewals} round trips"
    );
    guard.release().await.unwrap();

    // After release, not one renewal reaches Redis for three renewal intervals.
    let (calls, trips) = (evalsha_calls(&server), holder.stats().renewal_round_trips);
    tokio::time::sleep(TTL).await;
    assert_eq!(evalsha_calls(&server), calls, "a script ran after release");
    assert_eq!(holder.stats().renewal_round_trips, trips);
    other
        .lock("k")
        .try_acquire()
        .await
        .unwrap()
        .expect("free after release")
        .release()
        .await
        .unwrap();
}

#[tokio::test]
async fn a_server_restarted_empty_is_a_lost_lease() {
    let server = RedisServer::start().unwrap();
    let locks = manager(&server, "restart:").await;
    let guard = watched(&locks).await;
    server.restart().unwrap();
    let lost = tokio::time::timeout(TTL * 2, guard.lost())
        .await
        .expect("reported within the lease");
    assert!(lost.is_lost());
    assert!(guard.is_lost());
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
}

#[tokio::test]
async fn a_stolen_lock_is_never_extended_by_the_old_watchdog() {
    let server = shared_server();
    let prefix = unique_prefix("stolen");
    let locks = manager(&server, &prefix).await;
    let mut conn = raw(&server).await;
    let guard = watched(&locks).await;
    let key = locks.redis_key("k");
    // Another owner replaces the lock (as after an expiry and a new acquisition).
    let _: () = conn.del(&key).await.unwrap();
    let _: () = conn.hset(&key, "thief", 1).await.unwrap();
    let _: () = conn.pexpire(&key, 5_000).await.unwrap();

    let lost = tokio::time::timeout(TTL * 2, guard.lost())
        .await
        .expect("lost reported");
    assert!(lost.is_lost());
    // Counted right after the guard was told.
    let started = Instant::now();
    while locks.stats().leases_lost == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the loss was never counted"
        );
        tokio::task::yield_now().await;
    }
    let pttl: i64 = conn.pttl(&key).await.unwrap();
    assert!(pttl <= 5_000, "the thief's lease was extended: {pttl}");
    let thief: bool = conn.hexists(&key, "thief").await.unwrap();
    assert!(thief);
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
    let _: () = conn.del(&key).await.unwrap();
}

#[tokio::test]
async fn the_renewal_that_finds_the_lock_taken_marks_the_lease_lost_at_once() {
    let server = shared_server();
    let prefix = unique_prefix("stolen-at-once");
    let locks = manager(&server, &prefix).await;
    let mut conn = raw(&server).await;
    // A lease long enough that its local deadline is far off when the renewal finds out.
    let guard = locks
        .lock("k")
        .ttl(Duration::from_secs(3))
        .watchdog(true)
        .acquire()
        .await
        .unwrap();
    let key = locks.redis_key("k");
    let _: () = conn.del(&key).await.unwrap();
    let _: () = conn.set_ex(&key, "thief", 30).await.unwrap();
    let started = Instant::now();
    while locks.stats().leases_lost == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no renewal found the lock taken"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Not at the end of the local lease, seconds later: now.
    assert!(
        guard.is_lost(),
        "the renewal saw the thief, and the guard does not know"
    );
    assert_eq!(guard.remaining(), Duration::ZERO);
    let _: () = conn.del(&key).await.unwrap();
}

/// A holder whose executor is blocked stops being renewed, so its lock expires and another
/// owner can take it; on resume the holder learns that it lost the lease.
#[test]
fn a_blocked_executor_loses_its_lease() {
    let server = shared_server();
    let prefix = unique_prefix("blocked");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let locks = runtime.block_on(manager(&server, &prefix));
    let other = locks.clone();
    let (blocking, blocked) = std::sync::mpsc::channel();
    let holder = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let guard = watched(&locks).await;
            blocking.send(()).unwrap();
            // Blocks this runtime's only thread for two leases.
            std::thread::sleep(TTL * 2);
            let lost = guard.is_lost();
            let release = guard.release().await;
            (lost, release)
        })
    });
    blocked.recv().unwrap();
    let taken = runtime
        .block_on(
            other
                .lock("k")
                .wait(TTL * 3)
                .retry_delay(Duration::from_millis(5))
                .acquire(),
        )
        .expect("the blocked holder's lock expired");
    let (lost, release) = holder.join().unwrap();
    assert!(lost, "the holder learns that it lost the lease");
    assert!(matches!(release, Err(LockError::Lost { .. })));
    runtime.block_on(taken.release()).unwrap();
}

#[tokio::test]
async fn max_hold_ends_renewal() {
    let server = shared_server();
    let prefix = unique_prefix("maxhold");
    let locks = manager(&server, &prefix).await;
    let guard = locks
        .lock("k")
        .ttl(TTL)
        .watchdog(true)
        .max_hold(TTL * 2)
        .acquire()
        .await
        .unwrap();
    let started = Instant::now();
    let lost = tokio::time::timeout(TTL * 10, guard.lost())
        .await
        .expect("renewal stopped");
    assert!(lost.is_lost());
    assert!(started.elapsed() >= TTL * 2, "renewed until max_hold");
}

#[derive(Debug)]
enum AppError {
    Lock(LockError),
}

impl From<LockError> for AppError {
    fn from(error: LockError) -> Self {
        Self::Lock(error)
    }
}

#[distributed_lock(key = "job", ttl = "300ms", watchdog, manager = locks)]
async fn endless(locks: &LockManager, entered: &Notify) -> Result<(), AppError> {
    let _ = locks;
    entered.notify_one();
    std::future::pending::<()>().await;
    Ok(())
}

#[distributed_lock(key = "job", ttl = "300ms", watchdog, on_lost = "error", manager = locks)]
async fn finishes_anyway(
    locks: &LockManager,
    entered: &Notify,
    go: &Notify,
) -> Result<u32, AppError> {
    let _ = locks;
    entered.notify_one();
    go.notified().await;
    Ok(7)
}

#[tokio::test]
async fn on_lost_abort_stops_the_body_and_on_lost_error_reports_after_it() {
    let server = shared_server();
    let prefix = unique_prefix("onlost");
    let locks = manager(&server, &prefix).await;
    let mut conn = raw(&server).await;
    let key = locks.redis_key("job");

    let entered = Notify::new();
    let call = endless(&locks, &entered);
    tokio::pin!(call);
    tokio::select! {
        _ = &mut call => panic!("the body never returns by itself"),
        () = entered.notified() => {}
    }
    let _: () = conn.del(&key).await.unwrap();
    let outcome = tokio::time::timeout(TTL * 2, call)
        .await
        .expect("the body was stopped");
    assert!(
        matches!(outcome, Err(AppError::Lock(LockError::Lost { .. }))),
        "{outcome:?}"
    );

    let (entered, go) = (Notify::new(), Notify::new());
    let call = finishes_anyway(&locks, &entered, &go);
    tokio::pin!(call);
    tokio::select! {
        _ = &mut call => panic!("waits for `go`"),
        () = entered.notified() => {}
    }
    let _: () = conn.del(&key).await.unwrap();
    go.notify_one();
    let outcome = call.await;
    assert!(
        matches!(outcome, Err(AppError::Lock(LockError::Lost { .. }))),
        "{outcome:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_strictly_increase_under_contention() {
    let server = shared_server();
    let prefix = unique_prefix("fencing");
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..2 {
        let locks = manager(&server, &prefix).await;
        for _ in 0..8 {
            let (locks, seen) = (locks.clone(), seen.clone());
            tasks.spawn(async move {
                for _ in 0..5 {
                    let guard = locks
                        .lock("k")
                        .fencing(true)
                        .wait(Duration::from_secs(30))
                        .retry_delay(Duration::from_millis(2))
                        .acquire()
                        .await
                        .unwrap();
                    seen.lock().unwrap().push(guard.fencing_token().unwrap());
                    guard.release().await.unwrap();
                }
            });
        }
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 80);
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "in order of entry: {seen:?}"
    );
}

#[distributed_lock(key = "account:{id}", reentrant, manager = locks)]
async fn outer(locks: &LockManager, id: u32, depth: u32) -> Result<u32, AppError> {
    if depth == 0 {
        return Ok(0);
    }
    Ok(1 + Box::pin(outer(locks, id, depth - 1)).await?)
}

#[distributed_lock(key = "account:{id}", reentrant, manager = locks)]
async fn spawns_a_competitor(locks: &LockManager, id: u32) -> Result<bool, AppError> {
    let other = locks.clone();
    // Another task is another owner, even when spawned from inside the holder.
    let competitor = tokio::spawn(async move {
        other
            .lock(format!("account:{id}"))
            .reentrant(true)
            .try_acquire()
            .await
    });
    Ok(competitor.await.unwrap()?.is_none())
}

#[distributed_lock(key = "plain:{id}", retries = 1000, retry_delay = "10ms", manager = locks)]
async fn not_reentrant(locks: &LockManager, id: u32, nest: bool) -> Result<(), AppError> {
    if nest {
        Box::pin(not_reentrant(locks, id, false)).await?;
    }
    Ok(())
}

#[tokio::test]
async fn reentrant_nesting_spawned_competitors_and_self_deadlock() {
    let server = shared_server();
    let prefix = unique_prefix("reentrant");
    let locks = manager(&server, &prefix).await;
    let mut conn = raw(&server).await;

    assert_eq!(outer(&locks, 1, 3).await.unwrap(), 3);
    assert!(keys(&server, &prefix).is_empty(), "every hold released");

    assert!(
        spawns_a_competitor(&locks, 2).await.unwrap(),
        "the spawned task was kept out"
    );

    let outer_guard = locks
        .lock("account:3")
        .reentrant(true)
        .acquire()
        .await
        .unwrap();
    let count = distlock::scope(async {
        let outer_guard = locks
            .lock("account:4")
            .reentrant(true)
            .acquire()
            .await
            .unwrap();
        let inner = locks
            .lock("account:4")
            .reentrant(true)
            .acquire()
            .await
            .unwrap();
        assert_eq!(inner.token(), outer_guard.token());
        // Nested holds are counted in the process: Redis holds the owner's token once.
        let key = locks.redis_key("account:4");
        let during: Option<String> = conn.get(&key).await.unwrap();
        inner.release().await.unwrap();
        let after: Option<String> = conn.get(&key).await.unwrap();
        let token = outer_guard.token().to_owned();
        outer_guard.release().await.unwrap();
        let released: Option<String> = conn.get(&key).await.unwrap();
        (
            during == Some(token.clone()),
            after == Some(token),
            released,
        )
    })
    .await;
    assert_eq!(count, (true, true, None));
    outer_guard.release().await.unwrap();

    let started = Instant::now();
    let outcome = not_reentrant(&locks, 5, true).await;
    assert!(
        matches!(
            outcome,
            Err(AppError::Lock(LockError::WouldDeadlock { .. }))
        ),
        "{outcome:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "failed at once, not after its retries"
    );
    assert!(keys(&server, &prefix).is_empty());
}

static RUNS: AtomicU32 = AtomicU32::new(0);

#[distributed_lock(key = "nightly", ttl = "5s", min_hold = "500ms", on_busy = "skip", manager = locks)]
async fn nightly(locks: &LockManager) -> Result<bool, AppError> {
    let _ = locks;
    RUNS.fetch_add(1, Ordering::SeqCst);
    Ok(true)
}

#[tokio::test]
async fn min_hold_skips_a_second_run_until_it_has_passed() {
    let server = shared_server();
    let prefix = unique_prefix("minhold");
    let locks = manager(&server, &prefix).await;
    let started = Instant::now();
    assert!(nightly(&locks).await.unwrap());
    assert!(!nightly(&locks).await.unwrap(), "skipped: within min_hold");
    assert_eq!(RUNS.load(Ordering::SeqCst), 1);
    let left = Duration::from_millis(500).saturating_sub(started.elapsed());
    tokio::time::sleep(left + Duration::from_millis(50)).await;
    assert!(
        nightly(&locks).await.unwrap(),
        "runs again once min_hold has passed"
    );
    assert_eq!(RUNS.load(Ordering::SeqCst), 2);
}

/// 1,000 leases held at once are renewed in a few round trips per interval, not one each
/// (`cargo run --release --example renewal` measures the exact number).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_is_batched() {
    let server = RedisServer::start().unwrap();
    let locks = manager(&server, "batch:").await;
    let ttl = Duration::from_millis(600);
    let mut guards = Vec::new();
    for i in 0..1_000 {
        guards.push(
            locks
                .lock(format!("k{i}"))
                .ttl(ttl)
                .watchdog(true)
                .acquire()
                .await
                .unwrap(),
        );
    }
    // Leases taken at different moments fall into step within a few renewal intervals.
    tokio::time::sleep(ttl * 2).await;
    let before = locks.stats();
    tokio::time::sleep(ttl * 3).await;
    let after = locks.stats();
    let trips = after.renewal_round_trips - before.renewal_round_trips;
    let renewed = after.leases_renewed - before.leases_renewed;
    assert!(
        renewed >= 5_000,
        "each lease renewed about every TTL/3: {renewed}"
    );
    assert!(
        trips * 50 <= renewed,
        "{trips} round trips for {renewed} renewals"
    );
    assert!(guards.iter().all(|g| !g.is_lost()));
    for guard in guards {
        guard.release().await.unwrap();
    }
    assert!(keys(&server, "batch:").is_empty());
}

/// A watchdog that falls behind says so while every lease is still valid: renewals held up
/// by a server that stops answering for a while go out with less than half of their lease
/// left, which is counted and logged as a warning naming a late lock, and both leases are
/// renewed in time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watchdog_falling_behind_warns_before_any_lease_is_lost() {
    let logs = crate::support::logs::Logs::global();
    let server = RedisServer::start().unwrap();
    let prefix = unique_prefix("behind");
    // Answers may take as long as the pause below: the renewal waits instead of failing.
    let locks = LockManager::builder()
        .redis_url(server.url())
        .key_prefix(&prefix)
        .response_timeout(Duration::from_secs(4))
        .build()
        .await
        .unwrap();
    // The watchdog's connection is opened first (renewing a short lease), so that the
    // renewal below waits for the paused server's answer rather than for a connection.
    let warm = locks
        .lock("behind:warm")
        .ttl(Duration::from_millis(300))
        .watchdog(true)
        .acquire()
        .await
        .unwrap();
    let warmed = Instant::now();
    while locks.stats().leases_renewed == 0 {
        assert!(warmed.elapsed() < Duration::from_secs(5), "never renewed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    warm.release().await.unwrap();
    let renewals_before = locks.stats().renewal_round_trips;
    let ttl = Duration::from_secs(3);
    let take = |key: &'static str| locks.lock(key).ttl(ttl).watchdog(true).acquire();
    // Renewals are planned a third of the lease in; the second lease's falls more than the
    // sixth of a lease after the first's, so the two are not renewed together.
    let first = take("behind:first").await.unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    let second = take("behind:second").await.unwrap();
    let taken = Instant::now();
    server.pause().unwrap();
    // The first renewal goes out and waits for the server; the second lease's renewal is due
    // meanwhile and waits behind it.
    while locks.stats().renewal_round_trips == renewals_before {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Resumed once the second lease has less than half left, well before it runs out.
    tokio::time::sleep_until((taken + ttl * 2 / 3).into()).await;
    server.resume().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let warning = loop {
        let lines = logs.matching("lease renewals are falling behind");
        if let Some(line) = lines.into_iter().find(|line| line.contains(&prefix)) {
            break line;
        }
        assert!(Instant::now() < deadline, "no warning: {:?}", locks.stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(warning.starts_with("WARN"), "{warning}");
    assert!(
        warning.contains("{behind:first}") || warning.contains("{behind:second}"),
        "names a late lock: {warning}"
    );
    // Both leases go on: each is renewed once the server answers again.
    let mut redis = raw(&server).await;
    for key in ["behind:first", "behind:second"] {
        loop {
            let pttl: i64 = redis.pttl(locks.redis_key(key)).await.unwrap();
            if pttl > ttl.as_millis() as i64 / 2 {
                break;
            }
            assert!(pttl > 0, "{key} ran out: {:?}", locks.stats());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let stats = locks.stats();
    assert!(stats.renewals_late >= 1, "{stats:?}");
    assert_eq!(stats.leases_lost, 0, "warned, and nothing lost: {stats:?}");
    assert!(!first.is_lost() && !second.is_lost());
    first.release().await.unwrap();
    second.release().await.unwrap();
}
