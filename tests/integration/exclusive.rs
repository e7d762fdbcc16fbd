//! The exclusive lock through the manual API, against a real redis-server.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use distlock::{LockError, LockManager};
use redis::AsyncCommands;

use crate::support::{keys, manager, raw, shared_server, unique_prefix};

#[tokio::test]
async fn acquire_holds_the_key_and_release_frees_it() {
    let server = shared_server();
    let prefix = unique_prefix("basic");
    let locks = manager(&server, &prefix).await;

    let guard = locks
        .lock("order:42")
        .ttl(Duration::from_secs(10))
        .acquire()
        .await
        .unwrap();
    assert_eq!(guard.key(), "order:42");
    assert_eq!(guard.token().len(), 32);
    assert!(guard.remaining() > Duration::from_secs(9));
    assert!(guard.is_held().await.unwrap());
    assert_eq!(
        keys(&server, &prefix),
        vec![format!("{prefix}{{order:42}}")]
    );

    assert!(
        locks
            .lock("order:42")
            .try_acquire()
            .await
            .unwrap()
            .is_none()
    );
    guard.release().await.unwrap();
    assert!(keys(&server, &prefix).is_empty());
    let again = locks.lock("order:42").try_acquire().await.unwrap();
    again.expect("free after release").release().await.unwrap();
}

#[tokio::test]
async fn busy_lock_reports_attempts_and_wait() {
    let server = shared_server();
    let prefix = unique_prefix("busy");
    let locks = manager(&server, &prefix).await;
    let _held = locks.lock("k").acquire().await.unwrap();

    let started = Instant::now();
    let error = locks
        .lock("k")
        .retries(3)
        .retry_delay(Duration::from_millis(5))
        .acquire()
        .await
        .unwrap_err();
    match error {
        LockError::Busy {
            key,
            attempts,
            waited,
            ..
        } => {
            assert_eq!(key, "k");
            assert_eq!(attempts, 4);
            assert!(waited <= started.elapsed());
        }
        other => panic!("expected Busy, got {other:?}"),
    }
}

#[tokio::test]
async fn wait_bounds_the_total_time() {
    let server = shared_server();
    let prefix = unique_prefix("wait");
    let locks = manager(&server, &prefix).await;
    let _held = locks.lock("k").acquire().await.unwrap();

    let error = locks
        .lock("k")
        .wait(Duration::from_millis(150))
        .retry_delay(Duration::from_millis(10))
        .acquire()
        .await
        .unwrap_err();
    let LockError::Busy {
        attempts, waited, ..
    } = error
    else {
        panic!("expected Busy, got {error:?}");
    };
    assert!(attempts > 1, "a time bound alone keeps retrying");
    assert!(
        waited >= Duration::from_millis(150),
        "gave up early: {waited:?}"
    );
}

#[tokio::test]
async fn wait_bounds_a_waiter_whose_fallback_timer_is_far_off() {
    let server = shared_server();
    let prefix = unique_prefix("wait-far");
    let locks = manager(&server, &prefix).await;
    let _held = locks
        .lock("k")
        .ttl(Duration::from_secs(600))
        .acquire()
        .await
        .unwrap();
    // Its timer would fire minutes from now: only the deadline ends the wait.
    let waiting = locks
        .lock("k")
        .wait(Duration::from_millis(200))
        .retry_delay(Duration::from_secs(600))
        .acquire();
    match tokio::time::timeout(Duration::from_secs(10), waiting).await {
        Ok(Err(LockError::Busy { .. })) => {}
        Ok(other) => panic!("expected Busy, got {other:?}"),
        Err(_) => panic!("a wait of 200 ms went on past 10 s"),
    }
}

#[tokio::test]
async fn a_waiter_gets_the_lock_once_it_is_released() {
    let server = shared_server();
    let prefix = unique_prefix("handoff");
    let locks = manager(&server, &prefix).await;
    let held = locks.lock("k").acquire().await.unwrap();

    let waiter = {
        let locks = locks.clone();
        tokio::spawn(async move {
            locks
                .lock("k")
                .retries(1000)
                .retry_delay(Duration::from_millis(2))
                .acquire()
                .await
        })
    };
    held.release().await.unwrap();
    let guard = waiter
        .await
        .unwrap()
        .expect("the waiter takes the released lock");
    guard.release().await.unwrap();
}

/// The bug from the seed posts: a holder whose lease expired must not delete the lock that
/// the next holder took, and must learn that it had lost it.
#[tokio::test]
async fn an_expired_holder_never_deletes_the_next_holders_lock() {
    let server = shared_server();
    let prefix = unique_prefix("expired");
    let locks = manager(&server, &prefix).await;
    let mut conn = raw(&server).await;

    let first = locks
        .lock("k")
        .ttl(Duration::from_millis(50))
        .acquire()
        .await
        .unwrap();
    // The lease runs out while the first holder is still "working".
    let second = locks
        .lock("k")
        .ttl(Duration::from_secs(10))
        .wait(Duration::from_secs(2))
        .retry_delay(Duration::from_millis(5))
        .acquire()
        .await
        .unwrap();
    assert_eq!(first.remaining(), Duration::ZERO);
    assert!(!first.is_held().await.unwrap());
    assert!(matches!(
        first.extend(Duration::from_secs(5)).await,
        Err(LockError::Lost { .. })
    ));
    assert!(matches!(first.release().await, Err(LockError::Lost { .. })));

    // A plain lock is the owner's token under the key.
    let owner: Option<String> = conn.get(locks.redis_key("k")).await.unwrap();
    assert_eq!(
        owner.as_deref(),
        Some(second.token()),
        "the second holder's lock is untouched"
    );
    assert!(second.is_held().await.unwrap());
    second.release().await.unwrap();
}

#[tokio::test]
async fn extend_moves_the_lease() {
    let server = shared_server();
    let prefix = unique_prefix("extend");
    let locks = manager(&server, &prefix).await;
    let mut conn = raw(&server).await;
    let guard = locks
        .lock("k")
        .ttl(Duration::from_secs(1))
        .acquire()
        .await
        .unwrap();
    guard.extend(Duration::from_secs(60)).await.unwrap();
    let pttl: i64 = conn.pttl(locks.redis_key("k")).await.unwrap();
    assert!(pttl > 50_000, "pttl after extend: {pttl}");
    assert!(guard.remaining() > Duration::from_secs(50));
    assert!(matches!(
        guard.extend(Duration::ZERO).await,
        Err(LockError::InvalidInput { what: "ttl", .. })
    ));
    guard.release().await.unwrap();
}

#[tokio::test]
async fn fencing_tokens_grow_with_every_acquisition() {
    let server = shared_server();
    let prefix = unique_prefix("fence");
    let locks = manager(&server, &prefix).await;
    let mut last = 0;
    for _ in 0..5 {
        let guard = locks.lock("k").fencing(true).acquire().await.unwrap();
        let token = guard.fencing_token().expect("asked for a fencing token");
        assert!(token > last, "{token} after {last}");
        last = token;
        guard.release().await.unwrap();
    }
    let plain = locks.lock("k").acquire().await.unwrap();
    assert_eq!(plain.fencing_token(), None);
    plain.release().await.unwrap();
}

#[tokio::test]
async fn bad_input_is_an_error_before_any_round_trip() {
    let server = shared_server();
    let prefix = unique_prefix("input");
    let locks = manager(&server, &prefix).await;
    let empty = locks.lock("").acquire().await.unwrap_err();
    assert!(
        matches!(empty, LockError::InvalidInput { what: "key", .. }),
        "{empty}"
    );
    let long = locks
        .lock("x".repeat(distlock::MAX_KEY_LEN + 1))
        .try_acquire()
        .await
        .unwrap_err();
    assert!(
        matches!(long, LockError::InvalidInput { what: "key", .. }),
        "{long}"
    );
    let zero = locks
        .lock("k")
        .ttl(Duration::ZERO)
        .acquire()
        .await
        .unwrap_err();
    assert!(
        matches!(zero, LockError::InvalidInput { what: "ttl", .. }),
        "{zero}"
    );
    assert!(keys(&server, &prefix).is_empty());
}

#[tokio::test]
async fn dropping_a_guard_releases_in_the_background() {
    let server = shared_server();
    let prefix = unique_prefix("drop");
    let locks = manager(&server, &prefix).await;
    let guard = locks
        .lock("k")
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    drop(guard);
    // The next acquire goes out on the same connection after the background release.
    let next = locks
        .lock("k")
        .wait(Duration::from_secs(2))
        .retry_delay(Duration::from_millis(2))
        .acquire()
        .await
        .expect("the dropped guard's lock was released long before its 30 s lease");
    next.release().await.unwrap();
}

/// Three managers (three connections, as three processes would have) and twenty tasks each
/// do a read-modify-write in Redis under one lock: no update is lost, and no task ever
/// finds another inside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_exclusion_across_managers() {
    const MANAGERS: usize = 3;
    const TASKS: usize = 20;
    const ROUNDS: usize = 3;
    let server = shared_server();
    let prefix = unique_prefix("mutex");
    let inside = Arc::new(AtomicBool::new(false));
    let counter_key = format!("{prefix}counter");
    let mut handles = Vec::new();
    for _ in 0..MANAGERS {
        let locks = manager(&server, &prefix).await;
        for _ in 0..TASKS {
            let (locks, inside, counter_key) = (locks.clone(), inside.clone(), counter_key.clone());
            let mut conn = raw(&server).await;
            handles.push(tokio::spawn(async move {
                for _ in 0..ROUNDS {
                    let guard = locks
                        .lock("counter")
                        .ttl(Duration::from_secs(10))
                        .wait(Duration::from_secs(60))
                        .retry_delay(Duration::from_millis(2))
                        .acquire()
                        .await
                        .unwrap();
                    assert!(
                        !inside.swap(true, Ordering::SeqCst),
                        "two holders inside at once"
                    );
                    let value: Option<u64> = conn.get(&counter_key).await.unwrap();
                    tokio::task::yield_now().await;
                    let _: () = conn
                        .set(&counter_key, value.unwrap_or(0) + 1)
                        .await
                        .unwrap();
                    inside.store(false, Ordering::SeqCst);
                    guard.release().await.unwrap();
                }
            }));
        }
    }
    for handle in handles {
        handle.await.unwrap();
    }
    let mut conn = raw(&server).await;
    let total: u64 = conn.get(&counter_key).await.unwrap();
    assert_eq!(total, (MANAGERS * TASKS * ROUNDS) as u64);
    let _: () = conn.del(&counter_key).await.unwrap();
    assert!(keys(&server, &prefix).is_empty(), "no lock left behind");
}

#[tokio::test]
async fn many_distinct_keys_leave_nothing_behind() {
    let server = shared_server();
    let prefix = unique_prefix("many");
    let locks = manager(&server, &prefix).await;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..500 {
        let locks = locks.clone();
        tasks.spawn(async move {
            let guard = locks.lock(format!("job:{i}")).acquire().await.unwrap();
            guard.release().await.unwrap();
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    assert!(keys(&server, &prefix).is_empty());
}

/// A manager built inside one runtime keeps working from another (as with one
/// `#[tokio::test]` runtime per test and a manager kept in a static).
#[test]
fn a_manager_works_from_a_runtime_other_than_its_builders() {
    let server = shared_server();
    let prefix = unique_prefix("runtimes");
    let build = tokio::runtime::Runtime::new().unwrap();
    let locks: LockManager = build.block_on(manager(&server, &prefix));
    drop(build);
    for _ in 0..2 {
        let other = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        other.block_on(async {
            let guard = locks.lock("k").acquire().await.unwrap();
            guard.release().await.unwrap();
        });
    }
    // And a guard dropped outside of any runtime is still released.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let guard = rt.block_on(locks.lock("k").acquire()).unwrap();
    drop(rt);
    drop(guard);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let next = locks
            .lock("k")
            .wait(Duration::from_secs(2))
            .acquire()
            .await
            .unwrap();
        next.release().await.unwrap();
    });
}

/// Commands the server has run (those inside scripts included), apart from INFO and CONFIG.
fn commands_run(server: &distlock::testing::RedisServer) -> u64 {
    let info = server.command(&["INFO", "commandstats"]).unwrap();
    info.lines()
        .filter_map(|line| line.strip_prefix("cmdstat_"))
        .filter(|line| !line.starts_with("info:") && !line.starts_with("config"))
        .filter_map(|line| line.split_once(":calls="))
        .map(|(_, rest)| rest.split(',').next().unwrap().parse::<u64>().unwrap())
        .sum()
}

#[tokio::test]
async fn a_plain_lock_costs_the_server_no_more_than_a_hand_written_one() {
    // Its own server: the counts are server-wide.
    let server = distlock::testing::RedisServer::start().unwrap();
    let locks = manager(&server, "cost:").await;
    locks
        .lock("warm")
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let native = server
        .command(&["COMMAND", "INFO", "DELIFEQ"])
        .unwrap()
        .contains("delifeq");

    server.command(&["CONFIG", "RESETSTAT"]).unwrap();
    for i in 0..10 {
        let guard = locks.lock(format!("k{i}")).acquire().await.unwrap();
        guard.release().await.unwrap();
    }
    // SET NX PX GET, then a compare-and-delete and the wake-up: DELIFEQ + PUBLISH where the
    // server has it, else one script (GET, DEL, PUBLISH).
    let per_pair = if native { 3 } else { 5 };
    assert_eq!(commands_run(&server), 10 * per_pair);

    // A nested hold of a lock this code owns asks the server one read (is the outer hold
    // still this owner's?), and nothing more; released in any order, they ask nothing.
    distlock::scope(async {
        let outer = locks.lock("n").reentrant(true).acquire().await.unwrap();
        server.command(&["CONFIG", "RESETSTAT"]).unwrap();
        let inner = locks.lock("n").reentrant(true).acquire().await.unwrap();
        let read = locks.read_lock("n").acquire().await.unwrap();
        outer.release().await.unwrap();
        read.release().await.unwrap();
        assert_eq!(
            commands_run(&server),
            2,
            "one check per nested acquire, nothing per nested release"
        );
        assert!(
            inner.is_held().await.unwrap(),
            "the last hold keeps the lock"
        );
        inner.release().await.unwrap();
    })
    .await;
    assert!(keys(&server, "cost:").is_empty());
}

/// The futures a caller's task carries on every lock stay within their sizes before the
/// request layer became one engine (3,248 and 2,696 bytes, as this test measures them): a
/// larger future costs every caller's task, and boxing it the allocator's slow path.
#[tokio::test]
async fn acquire_and_release_futures_stay_small() {
    let server = shared_server();
    let prefix = unique_prefix("sizes");
    let locks = manager(&server, &prefix).await;
    let acquire = locks.lock("sized").acquire();
    let acquire_size = std::mem::size_of_val(&acquire);
    let guard = acquire.await.unwrap();
    let release = guard.release();
    let release_size = std::mem::size_of_val(&release);
    release.await.unwrap();
    println!("acquire() {acquire_size} bytes, release() {release_size} bytes");
    assert!(acquire_size <= 3280, "acquire() is {acquire_size} bytes");
    assert!(release_size <= 1024, "release() is {release_size} bytes");
}
