//! The ends of a lock's life: extend, release cancelled mid-flight, guards whose runtime
//! shuts down, `LockManager::shutdown`, and durations too large to add to a clock.

use std::future::Future;
use std::pin::pin;
use std::task::Poll;
use std::time::{Duration, Instant};

use distlock::testing::{Fault, FaultProxy, RedisServer};
use distlock::{LockError, LockGuard, LockManager, MAX_TTL};
use redis::AsyncCommands;

use crate::support::{manager, raw, shared_server, take_soon, unique_prefix};

/// Far longer than any of these tests may take: a key still there after this long was left
/// behind, not slow to go.
const LONG: Duration = Duration::from_secs(60);

/// How long a background release may take on a loaded machine; well below `LONG`.
const PROMPTLY: Duration = Duration::from_secs(10);

/// Whether `key` exists, asked without going through distlock.
fn exists(server: &RedisServer, key: &str) -> bool {
    server.command(&["EXISTS", key]).unwrap().starts_with(":1")
}

/// Waits until `key` is gone from `server`, and fails if it is still there after `PROMPTLY`.
fn wait_until_gone(server: &RedisServer, key: &str, why: &str) {
    let started = Instant::now();
    while exists(server, key) {
        assert!(started.elapsed() < PROMPTLY, "{why}: `{key}` is still held");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The same from async code, without blocking the runtime.
async fn gone_soon(server: &RedisServer, key: &str, why: &str) {
    let mut conn = raw(server).await;
    let started = Instant::now();
    while conn.exists::<_, bool>(key).await.unwrap() {
        assert!(started.elapsed() < PROMPTLY, "{why}: `{key}` is still held");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Polls `future` exactly once and drops it: a caller that gave up right after starting it.
async fn poll_once_then_drop<F: Future>(future: F) -> bool {
    let mut future = pin!(future);
    std::future::poll_fn(|cx| Poll::Ready(future.as_mut().poll(cx).is_pending())).await
}

// ---------------------------------------------------------------------------------------
// extend never shortens a lease

/// `guard`'s `remaining()` never promises more than the server's lease: the lock key's, and
/// for read locks and permits (`shared`) also the share's own, in the lock's hash.
async fn assert_remaining_within_pttl(locks: &LockManager, guard: &LockGuard, shared: bool) {
    let mut conn = raw(&shared_server()).await;
    // `remaining()` first: the server's lease can only have shrunk since.
    let remaining = guard.remaining();
    let lock = locks.redis_key(guard.key());
    let mut probes = vec![(lock.clone(), redis::cmd("PTTL").arg(&lock).to_owned())];
    if shared {
        let share = format!("{lock}'s share of {}", guard.token());
        probes.push((share, crate::support::lease_left(&lock, guard.token())));
    }
    for (key, probe) in probes {
        let pttl: i64 = probe.query_async(&mut conn).await.unwrap();
        assert!(pttl > 0, "`{key}` has no lease left ({pttl})");
        let pttl = Duration::from_millis(u64::try_from(pttl).unwrap());
        assert!(
            remaining <= pttl,
            "remaining() says {remaining:?} but `{key}` expires in {pttl:?}"
        );
    }
}

#[tokio::test]
async fn extend_never_shortens_a_lease_so_remaining_stays_within_the_server_lease() {
    let server = shared_server();
    let locks = manager(&server, &unique_prefix("extend")).await;
    let ttl = Duration::from_secs(30);
    for (kind, shared) in [
        ("exclusive", false),
        ("write", false),
        ("read", true),
        ("permit", true),
    ] {
        let request = match kind {
            "exclusive" => locks.lock(kind),
            "write" => locks.write_lock(kind),
            "read" => locks.read_lock(kind),
            _ => locks.semaphore(kind, 2),
        };
        let guard = request.ttl(ttl).acquire().await.unwrap();
        assert_remaining_within_pttl(&locks, &guard, shared).await;
        guard.extend(Duration::from_secs(1)).await.unwrap();
        assert_remaining_within_pttl(&locks, &guard, shared).await;
        assert!(
            guard.remaining() > Duration::from_secs(20),
            "{kind}: extend shortened it"
        );
        guard.extend(Duration::from_secs(60)).await.unwrap();
        assert_remaining_within_pttl(&locks, &guard, shared).await;
        assert!(
            guard.remaining() > Duration::from_secs(50),
            "{kind}: extend did not lengthen it"
        );
        guard.extend(Duration::from_millis(5)).await.unwrap();
        assert_remaining_within_pttl(&locks, &guard, shared).await;
        guard.release().await.unwrap();
    }
}

// ---------------------------------------------------------------------------------------
// a late renewal reply never revives a lost lease

#[tokio::test]
async fn a_renewal_answered_after_the_deadline_leaves_the_lease_lost() {
    let server = RedisServer::start().unwrap();
    let proxy = FaultProxy::start(server.port()).unwrap();
    let locks = LockManager::builder()
        .redis_url(proxy.url())
        .key_prefix("late:")
        .response_timeout(Duration::from_secs(10))
        .build()
        .await
        .unwrap();
    // Open the watchdog's connection before the network slows down. On a loaded machine the
    // short lease can run out before its first renewal (and is renewed no more): take it again.
    let started = Instant::now();
    while locks.stats().leases_renewed == 0 {
        let warm = locks
            .lock("warm")
            .ttl(Duration::from_millis(30))
            .watchdog(true)
            .acquire()
            .await
            .unwrap();
        while locks.stats().leases_renewed == 0 && !warm.is_lost() {
            assert!(
                started.elapsed() < PROMPTLY,
                "the warm-up lease was never renewed"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // A lease that ran out is released with an error.
        let _ = warm.release().await;
    }

    // Each way takes `delay`: the acquire is answered after 2·delay, the renewal (due at once,
    // a third into the lease) reaches the server before the lease ends there, and its answer
    // comes back after the local deadline but before the deadline it would set.
    let (ttl, delay) = (Duration::from_millis(1500), Duration::from_millis(600));
    proxy.set(Fault::Latency(delay));
    let mut tries = 0;
    let (guard, before) = loop {
        tries += 1;
        let before = locks.stats();
        let guard = locks
            .lock("k")
            .ttl(ttl)
            .watchdog(true)
            .acquire()
            .await
            .unwrap();
        tokio::time::sleep(guard.remaining()).await;
        assert!(guard.is_lost(), "the local deadline has passed");
        if locks.stats().renewal_round_trips > before.renewal_round_trips {
            break (guard, before);
        }
        // On a loaded machine the watchdog may first look at the lease after its local
        // deadline, and then drops it without sending a renewal: nothing to answer late.
        assert!(
            tries < 5,
            "no renewal went out before the deadline in {tries} tries"
        );
        drop(guard);
    };
    // Wait for the renewal's answer.
    let started = Instant::now();
    loop {
        let now = locks.stats();
        if now.leases_renewed + now.leases_lost > before.leases_renewed + before.leases_lost {
            break;
        }
        assert!(
            started.elapsed() < PROMPTLY,
            "the renewal was never answered"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(guard.is_lost(), "a late renewal revived a lost lease");
    assert_eq!(guard.remaining(), Duration::ZERO);
    assert!(guard.lost().await.is_lost());
    proxy.set(Fault::Pass);
    drop(guard);
}

// ---------------------------------------------------------------------------------------
// a release whose caller gives up still happens

#[tokio::test]
async fn a_release_cancelled_after_its_first_poll_still_reaches_redis() {
    let server = shared_server();
    let prefix = unique_prefix("cancelled");
    let locks = manager(&server, &prefix).await;
    let other = manager(&server, &prefix).await;
    for shared in [false, true] {
        let request = if shared {
            locks.semaphore("k", 1)
        } else {
            locks.lock("k")
        };
        let guard = request.ttl(LONG).acquire().await.unwrap();
        let key = locks.redis_key("k");
        assert!(
            poll_once_then_drop(guard.release()).await,
            "the release was still on its way"
        );
        gone_soon(&server, &key, "a cancelled release").await;
        let next = if shared {
            other.semaphore("k", 1)
        } else {
            other.lock("k")
        };
        let next = next.try_acquire().await.unwrap();
        assert!(next.is_some(), "another manager could not take it at once");
        next.unwrap().release().await.unwrap();
    }
}

// ---------------------------------------------------------------------------------------
// guards alive when their runtime goes away

fn guards_of_a_dropped_runtime_are_released(shutdown_background: bool) {
    let server = shared_server();
    let prefix = unique_prefix("runtime");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let locks = runtime.block_on(manager(&server, &prefix));
    let (held, mut all_held) = tokio::sync::mpsc::channel(8);
    let names = ["plain", "watched", "read", "permit"];
    for name in names {
        let (locks, held) = (locks.clone(), held.clone());
        runtime.spawn(async move {
            let request = match name {
                "plain" => locks.lock(name),
                "watched" => locks.lock(name).watchdog(true),
                "read" => locks.read_lock(name),
                _ => locks.semaphore(name, 1),
            };
            let guard = request.ttl(LONG).acquire().await.unwrap();
            held.send(()).await.unwrap();
            std::future::pending::<()>().await;
            drop(guard);
        });
    }
    for _ in names {
        all_held.blocking_recv().unwrap();
    }
    for name in names {
        assert!(exists(&server, &locks.redis_key(name)));
    }
    if shutdown_background {
        runtime.shutdown_background();
    } else {
        drop(runtime);
    }
    for name in names {
        wait_until_gone(
            &server,
            &locks.redis_key(name),
            "a guard of a dropped runtime",
        );
    }
}

#[test]
fn dropping_a_runtime_releases_the_guards_its_tasks_held() {
    guards_of_a_dropped_runtime_are_released(false);
}

#[test]
fn shutting_a_runtime_down_in_the_background_releases_the_guards_its_tasks_held() {
    guards_of_a_dropped_runtime_are_released(true);
}

// ---------------------------------------------------------------------------------------
// LockManager::shutdown

/// Subscribers of `channel` on `server`.
async fn subscribers(conn: &mut redis::aio::MultiplexedConnection, channel: &str) -> i64 {
    let reply: (String, i64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(channel)
        .query_async(conn)
        .await
        .unwrap();
    reply.1
}

#[tokio::test]
async fn shutdown_releases_every_lock_and_fails_waiters_and_later_requests() {
    let server = shared_server();
    let prefix = unique_prefix("shutdown");
    let locks = manager(&server, &prefix).await;
    let other = manager(&server, &prefix).await;
    let mut conn = raw(&server).await;

    let exclusive = locks.lock("exclusive").ttl(LONG).acquire().await.unwrap();
    let read = locks.read_lock("read").ttl(LONG).acquire().await.unwrap();
    let permit = locks
        .semaphore("permit", 1)
        .ttl(LONG)
        .acquire()
        .await
        .unwrap();
    // A clone holds locks of the same manager.
    let clone = locks.clone();
    let watched = clone
        .lock("watched")
        .ttl(LONG)
        .watchdog(true)
        .acquire()
        .await
        .unwrap();

    // A request of this manager waits for a lock another manager holds.
    let foreign = other.lock("foreign").ttl(LONG).acquire().await.unwrap();
    let waiter = {
        let locks = locks.clone();
        tokio::spawn(async move { locks.lock("foreign").wait(LONG).acquire().await })
    };
    let wake = format!("{}:wake", locks.redis_key("foreign"));
    let started = Instant::now();
    while subscribers(&mut conn, &wake).await == 0 {
        assert!(started.elapsed() < PROMPTLY, "the waiter never subscribed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let (held, body_holds) = tokio::sync::oneshot::channel();
    let lost = tokio::spawn({
        let locks = locks.clone();
        async move {
            let guard = locks
                .lock("body")
                .ttl(LONG)
                .watchdog(true)
                .acquire()
                .await
                .unwrap();
            held.send(()).unwrap();
            guard.lost().await
        }
    });
    body_holds.await.unwrap();

    locks.shutdown().await;

    for name in ["exclusive", "read", "permit", "watched", "body"] {
        gone_soon(&server, &locks.redis_key(name), "shutdown").await;
    }
    assert!(exclusive.is_lost() && read.is_lost() && permit.is_lost() && watched.is_lost());
    assert!(matches!(watched.lost().await, LockError::ShutDown));
    assert!(matches!(lost.await.unwrap(), LockError::ShutDown));
    assert!(matches!(waiter.await.unwrap(), Err(LockError::ShutDown)));
    assert!(matches!(
        locks.lock("later").acquire().await,
        Err(LockError::ShutDown)
    ));
    assert!(matches!(
        clone.read_lock("later").try_acquire().await,
        Err(LockError::ShutDown)
    ));
    assert!(matches!(
        exclusive.release().await,
        Err(LockError::ShutDown)
    ));
    drop(read);
    assert!(matches!(permit.release().await, Err(LockError::ShutDown)));
    let started = Instant::now();
    while subscribers(&mut conn, &wake).await != 0 {
        assert!(
            started.elapsed() < PROMPTLY,
            "the pub/sub connection stayed subscribed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(locks.stats().waiting_keys, 0);

    // The other manager's lock is untouched, and it takes the released keys at once.
    assert!(exists(&server, &locks.redis_key("foreign")));
    for name in ["exclusive", "watched"] {
        take_soon(&other, name, "after shutdown").await;
    }
    foreign.release().await.unwrap();
    drop(watched);

    // Idempotent.
    locks.shutdown().await;
    clone.shutdown().await;
}

#[test]
fn shutdown_works_outside_any_runtime_and_from_another_runtime() {
    let server = shared_server();
    let prefix = unique_prefix("shutdown-anywhere");
    let building = tokio::runtime::Runtime::new().unwrap();
    let locks = building.block_on(manager(&server, &prefix));
    let guard = building
        .block_on(locks.lock("k").ttl(LONG).acquire())
        .unwrap();
    let other = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    other.block_on(locks.shutdown());
    wait_until_gone(
        &server,
        &locks.redis_key("k"),
        "shutdown from another runtime",
    );
    drop(guard);
    drop(building);
    // And with no runtime at all: a manager whose guard is held by nobody's runtime.
    let again = tokio::runtime::Runtime::new().unwrap();
    let second = again.block_on(manager(&server, &prefix));
    let guard = again
        .block_on(second.lock("k").ttl(LONG).acquire())
        .unwrap();
    drop(again);
    futures_lite_block_on(second.shutdown());
    wait_until_gone(
        &server,
        &second.redis_key("k"),
        "shutdown outside a runtime",
    );
    drop(guard);
}

/// Runs `future` on this thread with no tokio runtime around it.
fn futures_lite_block_on<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    let thread = std::thread::current();
    let waker = std::task::Waker::from(std::sync::Arc::new(Unpark(thread)));
    let mut cx = std::task::Context::from_waker(&waker);
    loop {
        if let Poll::Ready(output) = future.as_mut().poll(&mut cx) {
            return output;
        }
        std::thread::park();
    }
}

struct Unpark(std::thread::Thread);

impl std::task::Wake for Unpark {
    fn wake(self: std::sync::Arc<Self>) {
        self.0.unpark();
    }
}

#[tokio::test]
async fn a_macro_body_stops_when_its_manager_shuts_down() {
    let server = shared_server();
    let locks = manager(&server, &unique_prefix("shutdown-body")).await;
    let entered = std::sync::Arc::new(tokio::sync::Notify::new());

    #[distlock::distributed_lock(key = "job", ttl = "60s", watchdog, manager = locks)]
    async fn job(locks: &LockManager, entered: &tokio::sync::Notify) -> Result<(), LockError> {
        entered.notify_one();
        std::future::pending::<()>().await;
        Ok(())
    }

    let running = tokio::spawn({
        let (locks, entered) = (locks.clone(), entered.clone());
        async move { job(&locks, &entered).await }
    });
    entered.notified().await;
    locks.shutdown().await;
    assert!(matches!(running.await.unwrap(), Err(LockError::ShutDown)));
    gone_soon(&server, &locks.redis_key("job"), "shutdown").await;
}

// ---------------------------------------------------------------------------------------
// durations too large for a clock

const HUGE: [Duration; 3] = [
    Duration::MAX,
    Duration::from_secs(u64::MAX / 2),
    Duration::from_secs(1 << 40),
];

#[tokio::test]
async fn huge_leases_are_refused_and_the_largest_allowed_one_works() {
    let server = shared_server();
    let locks = manager(&server, &unique_prefix("huge-ttl")).await;
    for huge in HUGE.into_iter().chain([MAX_TTL + Duration::from_millis(1)]) {
        let refused = locks.lock("k").ttl(huge).acquire().await;
        assert!(
            matches!(refused, Err(LockError::InvalidInput { what: "ttl", .. })),
            "{huge:?}: {refused:?}"
        );
    }
    let guard = locks.lock("k").ttl(MAX_TTL).acquire().await.unwrap();
    assert!(guard.remaining() > MAX_TTL / 2);
    for huge in HUGE {
        assert!(matches!(
            guard.extend(huge).await,
            Err(LockError::InvalidInput { what: "ttl", .. })
        ));
    }
    guard.extend(MAX_TTL).await.unwrap();
    guard.release().await.unwrap();
}

#[tokio::test]
async fn huge_min_hold_is_refused_as_longer_than_the_lease() {
    let server = shared_server();
    let locks = manager(&server, &unique_prefix("huge-min-hold")).await;
    for huge in HUGE {
        let refused = locks.lock("k").min_hold(huge).acquire().await;
        assert!(
            matches!(
                refused,
                Err(LockError::InvalidInput {
                    what: "min_hold",
                    ..
                })
            ),
            "{huge:?}: {refused:?}"
        );
    }
    let refused = locks
        .lock("k")
        .ttl(Duration::from_secs(1))
        .min_hold(Duration::from_secs(2))
        .acquire()
        .await;
    assert!(matches!(
        refused,
        Err(LockError::InvalidInput {
            what: "min_hold",
            ..
        })
    ));
}

#[tokio::test]
async fn huge_waits_delays_and_holds_mean_forever() {
    let server = shared_server();
    let prefix = unique_prefix("huge-forever");
    let locks = manager(&server, &prefix).await;
    let holder = manager(&server, &prefix).await;
    for huge in HUGE {
        // max_hold: renewed for as long as the guard lives.
        let guard = locks
            .lock("watched")
            .ttl(Duration::from_secs(5))
            .watchdog(true)
            .max_hold(huge)
            .acquire()
            .await
            .unwrap();
        guard.release().await.unwrap();

        // wait and retry_delay: a waiter that is woken by the release.
        for variant in 0..3 {
            let held = holder.lock("busy").ttl(LONG).acquire().await.unwrap();
            let waiter = tokio::spawn({
                let locks = locks.clone();
                async move {
                    let request = locks.lock("busy").ttl(LONG);
                    let request = match variant {
                        0 => request.wait(huge),
                        1 => request.retries(3).retry_delay(huge),
                        _ => request.wait(huge).retry_delay(huge),
                    };
                    request.acquire().await
                }
            });
            let started = Instant::now();
            while locks.stats().waiting_keys == 0 {
                assert!(started.elapsed() < PROMPTLY, "the request never waited");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            held.release().await.unwrap();
            let guard = waiter.await.unwrap().unwrap();
            guard.release().await.unwrap();
        }
    }
}

#[tokio::test]
async fn huge_builder_durations_build_a_working_manager_or_are_refused() {
    let server = shared_server();
    for huge in HUGE {
        let refused = LockManager::builder()
            .redis_url(server.url())
            .default_ttl(huge)
            .build()
            .await;
        assert!(
            matches!(&refused, Err(LockError::Config(m)) if m.contains("default_ttl")),
            "{huge:?}: {refused:?}"
        );
        let locks = LockManager::builder()
            .redis_url(server.url())
            .key_prefix(unique_prefix("huge-builder"))
            .default_wait(huge)
            .default_retry_delay(huge)
            .default_max_hold(Some(huge))
            .connect_timeout(huge)
            .response_timeout(huge)
            .sync_replicas(1, huge)
            .redlock_restart_delay(huge)
            .build()
            .await
            .unwrap();
        // With no replica, a grant would wait for one forever: take the lock with a manager
        // that does not ask for acknowledgements.
        drop(locks);
        let locks = LockManager::builder()
            .redis_url(server.url())
            .key_prefix(unique_prefix("huge-builder"))
            .default_wait(huge)
            .default_retry_delay(huge)
            .default_max_hold(Some(huge))
            .connect_timeout(huge)
            .response_timeout(huge)
            .build()
            .await
            .unwrap();
        let guard = locks.lock("k").watchdog(true).acquire().await.unwrap();
        guard.release().await.unwrap();
    }
}

/// The clients connected to `server`, as its `INFO clients` counts them (the one asking
/// included).
fn connected_clients(server: &RedisServer) -> usize {
    let info = server.command(&["INFO", "clients"]).expect("INFO clients");
    info.lines()
        .find_map(|line| line.trim().strip_prefix("connected_clients:"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no connected_clients in {info:?}"))
}

/// Counted on a server of its own, so that only this test's connections are counted while
/// other tests run beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtimes_that_come_and_go_leave_no_connections_behind() {
    let server = RedisServer::start().unwrap();
    let prefix = unique_prefix("runtimes");
    let locks = manager(&server, &prefix).await;
    // Each runtime locks through a connection of its own; once it shuts down, that
    // connection (and what it holds of the runtime: its socket, its poller) must go.
    let cycle = |locks: LockManager| {
        tokio::task::spawn_blocking(move || {
            for _ in 0..200 {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                runtime.block_on(async {
                    let guard = locks.lock("k").acquire().await.unwrap();
                    guard.release().await.unwrap();
                });
                drop(runtime);
            }
        })
    };
    cycle(locks.clone()).await.unwrap();
    let before = connected_clients(&server);
    cycle(locks.clone()).await.unwrap();
    let after = connected_clients(&server);
    assert!(
        after < before + 150,
        "200 runtimes came and went, and {} connections stayed open ({before} before, {after} after)",
        after.saturating_sub(before)
    );
}
