//! Several keys at once: a set is held whole or not at all, never deadlocks whatever order
//! its keys are listed in, waits for a release of the key it found busy, and leaves nothing
//! behind when its acquisition is cancelled or its holder panics.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use distlock::testing::{Fault, FaultProxy, RedisServer};
use distlock::{LockError, LockManager, distributed_lock};

use crate::support::{keys, manager, raw, shared_server, take_soon, unique_prefix};

mod topologies;

const ACCOUNTS: usize = 4;
const START: i64 = 1_000;

/// Accounts in memory, each with an occupancy flag that catches two holders inside at once.
struct Bank {
    balances: [AtomicI64; ACCOUNTS],
    inside: [AtomicBool; ACCOUNTS],
}

impl Bank {
    fn new() -> Self {
        Self {
            balances: std::array::from_fn(|_| AtomicI64::new(START)),
            inside: std::array::from_fn(|_| AtomicBool::new(false)),
        }
    }

    /// A read-modify-write of both accounts, with a yield in the middle so that an overlap
    /// would be seen.
    async fn transfer(&self, from: usize, to: usize, amount: i64) {
        for account in [from, to] {
            assert!(
                !self.inside[account].swap(true, Ordering::SeqCst),
                "two holders inside account {account}"
            );
        }
        let (a, b) = (
            self.balances[from].load(Ordering::SeqCst),
            self.balances[to].load(Ordering::SeqCst),
        );
        tokio::task::yield_now().await;
        self.balances[from].store(a - amount, Ordering::SeqCst);
        self.balances[to].store(b + amount, Ordering::SeqCst);
        for account in [from, to] {
            self.inside[account].store(false, Ordering::SeqCst);
        }
    }

    fn total(&self) -> i64 {
        self.balances.iter().map(|b| b.load(Ordering::SeqCst)).sum()
    }
}

#[distributed_lock(
    keys = ["account:{from}", "account:{to}"],
    ttl = "10s",
    wait = "20s",
    retry_delay = "5ms",
    manager = locks
)]
async fn transfer(
    locks: &LockManager,
    bank: &Bank,
    from: usize,
    to: usize,
    amount: i64,
) -> Result<(), LockError> {
    bank.transfer(from, to, amount).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_in_both_directions_never_deadlock_nor_overlap() {
    let server = shared_server();
    let prefix = unique_prefix("transfers");
    let managers = [
        manager(&server, &prefix).await,
        manager(&server, &prefix).await,
    ];
    let bank = Arc::new(Bank::new());
    let mut tasks = tokio::task::JoinSet::new();
    for (m, locks) in managers.iter().enumerate() {
        for t in 0..8 {
            let (locks, bank) = (locks.clone(), bank.clone());
            tasks.spawn(async move {
                for round in 0..40 {
                    let from = (t + round) % ACCOUNTS;
                    let to = (from + 1 + (round + m) % (ACCOUNTS - 1)) % ACCOUNTS;
                    let amount = i64::try_from(round % 7 + 1).unwrap();
                    if round % 2 == 0 {
                        transfer(&locks, &bank, from, to, amount).await.unwrap();
                    } else {
                        // By hand, with the keys listed the other way round.
                        let guard = locks
                            .lock_all([format!("account:{to}"), format!("account:{from}")])
                            .ttl(Duration::from_secs(10))
                            .wait(Duration::from_secs(20))
                            .retry_delay(Duration::from_millis(5))
                            .acquire()
                            .await
                            .unwrap();
                        bank.transfer(from, to, amount).await;
                        guard.release().await.unwrap();
                    }
                }
            });
        }
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    assert_eq!(bank.total(), START * i64::try_from(ACCOUNTS).unwrap());
    assert!(
        keys(&server, &prefix).is_empty(),
        "{:?}",
        keys(&server, &prefix)
    );
}

#[tokio::test]
async fn a_busy_key_leaves_nothing_of_the_set_behind() {
    let server = shared_server();
    let prefix = unique_prefix("all-or-nothing");
    let locks = manager(&server, &prefix).await;
    let other = manager(&server, &prefix).await;
    let held = other.lock("b").acquire().await.unwrap();
    for set in [["a", "b", "c"], ["c", "b", "a"]] {
        assert!(locks.lock_all(set).try_acquire().await.unwrap().is_none());
        assert_eq!(
            keys(&server, &prefix),
            vec![locks.redis_key("b")],
            "{set:?}"
        );
    }
    // Nor does a set whose busy key is found after some free ones were looked at, while
    // another lock kind holds it.
    held.release().await.unwrap();
    let read = other.read_lock("c").acquire().await.unwrap();
    assert!(
        locks
            .lock_all(["a", "b", "c"])
            .try_acquire()
            .await
            .unwrap()
            .is_none()
    );
    assert!(!keys(&server, &prefix).contains(&locks.redis_key("a")));
    read.release().await.unwrap();

    let set = locks
        .lock_all(["a", "b", "c"])
        .try_acquire()
        .await
        .unwrap()
        .unwrap();
    // Each lock of the set is the single lock of that name.
    assert!(other.lock("b").try_acquire().await.unwrap().is_none());
    assert!(other.read_lock("a").try_acquire().await.unwrap().is_none());
    set.release().await.unwrap();
    assert!(keys(&server, &prefix).is_empty());
}

#[tokio::test]
async fn equal_names_are_taken_once() {
    let server = shared_server();
    let prefix = unique_prefix("dedupe");
    let locks = manager(&server, &prefix).await;
    let set = locks.lock_all(["x", "y", "x"]).acquire().await.unwrap();
    assert_eq!(set.keys(), ["x", "y"]);
    let mut present = keys(&server, &prefix);
    present.sort();
    assert_eq!(present, vec![locks.redis_key("x"), locks.redis_key("y")]);
    set.release().await.unwrap();
    assert!(keys(&server, &prefix).is_empty());

    let empty: [&str; 0] = [];
    let error = locks.lock_all(empty).acquire().await.unwrap_err();
    assert!(
        matches!(error, LockError::InvalidInput { what: "keys", .. }),
        "{error}"
    );
    let error = locks.lock_all(["ok", ""]).acquire().await.unwrap_err();
    assert!(
        matches!(error, LockError::InvalidInput { what: "key", .. }),
        "{error}"
    );
}

/// `INFO commandstats`: the EVALSHA calls, and the other commands seen. Commands that a
/// script runs are counted there too, so the others are checked to be those alone.
fn evalsha_calls(server: &RedisServer) -> u64 {
    // What the set scripts call inside the server; a client command would be anything else.
    const IN_SCRIPTS: [&str; 8] = [
        "type", "hset", "pexpire", "hmget", "del", "publish", "hexists", "pttl",
    ];
    let info = server.command(&["INFO", "commandstats"]).unwrap();
    let mut evalsha = 0;
    for line in info.lines() {
        let Some((name, stats)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        let calls: u64 = stats
            .strip_prefix("calls=")
            .and_then(|s| s.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap();
        match name {
            "evalsha" => evalsha = calls,
            "info" | "config|resetstat" => {}
            other => assert!(IN_SCRIPTS.contains(&other), "a client sent `{other}`"),
        }
    }
    evalsha
}

#[tokio::test]
async fn a_two_key_set_costs_one_round_trip_to_take_and_one_to_give_back() {
    // Its own server: the counters are server-wide.
    let server = RedisServer::start().unwrap();
    let locks = manager(&server, "cost:").await;
    // Scripts and connection are ready after a first use.
    let warm = locks.lock_all(["a", "b"]).acquire().await.unwrap();
    warm.release().await.unwrap();
    server.command(&["CONFIG", "RESETSTAT"]).unwrap();

    let set = locks
        .lock_all(["account:1", "account:2"])
        .acquire()
        .await
        .unwrap();
    assert_eq!(evalsha_calls(&server), 1);
    set.release().await.unwrap();
    assert_eq!(evalsha_calls(&server), 2);
}

#[tokio::test]
async fn a_cancelled_acquisition_leaves_nothing_behind() {
    let server = shared_server();
    let prefix = unique_prefix("cancel");
    let locks = manager(&server, &prefix).await;
    // Cancelled while waiting for a busy key.
    let held = locks.lock("b").acquire().await.unwrap();
    let waiting = locks
        .lock_all(["a", "b"])
        .wait(Duration::from_secs(30))
        .acquire();
    assert!(
        tokio::time::timeout(Duration::from_millis(200), waiting)
            .await
            .is_err()
    );
    assert_eq!(keys(&server, &prefix), vec![locks.redis_key("b")]);
    held.release().await.unwrap();

    // Cancelled with its attempt in flight (slowed down on the way): the grant that lands
    // is given back right behind it.
    let proxy = FaultProxy::start(server.port()).unwrap();
    let slow = LockManager::builder()
        .redis_url(proxy.url())
        .key_prefix(&prefix)
        .build()
        .await
        .unwrap();
    proxy.set(Fault::Latency(Duration::from_millis(300)));
    let attempt = slow
        .lock_all(["a", "b"])
        .ttl(Duration::from_secs(60))
        .acquire();
    assert!(
        tokio::time::timeout(Duration::from_millis(100), attempt)
            .await
            .is_err()
    );
    // Far less than the 60 s lease: whatever was granted was given back.
    after_what_was_sent(&slow).await;
    assert!(
        keys(&server, &prefix).is_empty(),
        "{:?}",
        keys(&server, &prefix)
    );
}

/// Waits until everything `locks` has sent so far from this runtime reached the server and
/// was answered: a request sent now on the same connection comes back after all of it.
async fn after_what_was_sent(locks: &LockManager) {
    let marker = locks.lock("marker").acquire().await.unwrap();
    marker.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_while_acquiring_or_holding_releases_the_whole_set() {
    let server = shared_server();
    let prefix = unique_prefix("panic");
    let locks = manager(&server, &prefix).await;
    let holder = locks.clone();
    let panicked = tokio::spawn(async move {
        let _set = holder
            .lock_all(["a", "b"])
            .ttl(Duration::from_secs(60))
            .acquire()
            .await
            .unwrap();
        panic!("in the middle of the transfer");
    })
    .await;
    assert!(panicked.unwrap_err().is_panic());
    take_soon(&locks, "a", "panic while holding").await;
    take_soon(&locks, "b", "panic while holding").await;

    // A sibling branch panics while the set's attempt is on its (slowed) way.
    let proxy = FaultProxy::start(server.port()).unwrap();
    let slow = LockManager::builder()
        .redis_url(proxy.url())
        .key_prefix(&prefix)
        .build()
        .await
        .unwrap();
    proxy.set(Fault::Latency(Duration::from_millis(300)));
    let sender = slow.clone();
    let panicked = tokio::spawn(async move {
        let acquire = sender
            .lock_all(["b", "a"])
            .ttl(Duration::from_secs(60))
            .acquire();
        let fail = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            panic!("while the set was being taken");
        };
        let _ = tokio::join!(acquire, fail);
    })
    .await;
    assert!(panicked.unwrap_err().is_panic());
    after_what_was_sent(&slow).await;
    assert!(
        keys(&server, &prefix).is_empty(),
        "{:?}",
        keys(&server, &prefix)
    );
}

#[tokio::test]
async fn a_busy_set_is_woken_by_the_release_not_by_its_timer() {
    let server = shared_server();
    let prefix = unique_prefix("wake");
    let holder = manager(&server, &prefix).await;
    let waiter = manager(&server, &prefix).await;
    let day = Duration::from_secs(24 * 3600);
    let held = holder.lock("b").ttl(day).acquire().await.unwrap();
    let observed = waiter.clone();
    let waiting = tokio::spawn(async move {
        // Its fallback timer fires at a random point of a day: only a wake-up is fast.
        waiter
            .lock_all(["a", "b", "c"])
            .retry_delay(day)
            .retries(5)
            .acquire()
            .await
    });
    // The waiter follows the busy key's wake channel before the key is released.
    let channel = format!("{prefix}{{b}}:wake");
    let started = std::time::Instant::now();
    while server
        .command(&["PUBSUB", "CHANNELS", &channel])
        .unwrap()
        .is_empty()
    {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the waiter never subscribed"
        );
        tokio::task::yield_now().await;
    }
    assert_eq!(observed.stats().waiting_keys, 1);
    held.release().await.unwrap();
    let set = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("woken by the release")
        .unwrap()
        .unwrap();
    assert!(set.attempts() >= 2);
    set.release().await.unwrap();
}

#[tokio::test]
async fn the_watchdog_renews_every_lease_and_reports_any_one_lost() {
    let server = shared_server();
    let prefix = unique_prefix("watchdog");
    let locks = manager(&server, &prefix).await;
    let set = locks
        .lock_all(["a", "b"])
        .ttl(Duration::from_millis(300))
        .watchdog(true)
        .acquire()
        .await
        .unwrap();
    // Three leases long: held only because each was renewed.
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert!(set.is_held().await.unwrap());
    assert!(!set.is_lost());
    assert!(locks.stats().leases_renewed >= 4, "{:?}", locks.stats());

    let mut conn = raw(&server).await;
    let _: () = redis::cmd("DEL")
        .arg(locks.redis_key("b"))
        .query_async(&mut conn)
        .await
        .unwrap();
    let lost = tokio::time::timeout(Duration::from_secs(5), set.lost())
        .await
        .expect("the lost lease is reported");
    assert!(lost.is_lost());
    assert!(set.is_lost());
    assert!(matches!(set.release().await, Err(LockError::Lost { key, .. }) if key == "b"));
    assert!(keys(&server, &prefix).is_empty());
}

#[tokio::test]
async fn a_held_key_reentered_through_a_set_is_a_nested_hold() {
    let server = shared_server();
    let prefix = unique_prefix("reentry");
    let locks = manager(&server, &prefix).await;
    let other = manager(&server, &prefix).await;
    distlock::scope(async {
        let outer = locks
            .lock("acct:1")
            .reentrant(true)
            .acquire()
            .await
            .unwrap();
        let refused = locks.lock_all(["acct:2", "acct:1"]).acquire().await;
        assert!(
            matches!(refused, Err(LockError::WouldDeadlock { ref key, .. }) if key == "acct:1")
        );
        assert!(keys(&server, &prefix) == vec![locks.redis_key("acct:1")]);

        let set = locks
            .lock_all(["acct:2", "acct:1"])
            .reentrant(true)
            .acquire()
            .await
            .unwrap();
        assert!(other.lock("acct:2").try_acquire().await.unwrap().is_none());
        set.release().await.unwrap();
        // The outer hold is still there; the set's own key is free.
        assert!(other.lock("acct:1").try_acquire().await.unwrap().is_none());
        let free = other.lock("acct:2").try_acquire().await.unwrap().unwrap();
        free.release().await.unwrap();
        outer.release().await.unwrap();
    })
    .await;
    assert!(keys(&server, &prefix).is_empty());

    // Single locks inside a held set re-enter its keys.
    distlock::scope(async {
        let set = locks
            .lock_all(["x", "y"])
            .reentrant(true)
            .acquire()
            .await
            .unwrap();
        let inner = locks.lock("y").reentrant(true).acquire().await.unwrap();
        inner.release().await.unwrap();
        assert!(other.lock("y").try_acquire().await.unwrap().is_none());
        set.release().await.unwrap();
    })
    .await;
    assert!(keys(&server, &prefix).is_empty());

    // The set given back first: a key re-entered inside it stays with the inner hold.
    for drop_it in [false, true] {
        distlock::scope(async {
            let set = locks
                .lock_all(["x", "y"])
                .reentrant(true)
                .acquire()
                .await
                .unwrap();
            let inner = locks.lock("y").reentrant(true).acquire().await.unwrap();
            if drop_it {
                drop(set);
                // The background release of "x" wakes a waiter: wait for it.
                other
                    .lock("x")
                    .wait(Duration::from_secs(5))
                    .acquire()
                    .await
                    .unwrap()
                    .release()
                    .await
                    .unwrap();
            } else {
                set.release().await.unwrap();
            }
            assert!(other.lock("y").try_acquire().await.unwrap().is_none());
            let x = other.lock("x").try_acquire().await.unwrap().unwrap();
            x.release().await.unwrap();
            inner.release().await.unwrap();
            let y = other.lock("y").try_acquire().await.unwrap().unwrap();
            y.release().await.unwrap();
        })
        .await;
        assert!(keys(&server, &prefix).is_empty());
    }
}

#[tokio::test]
async fn fencing_draws_one_token_per_key_from_that_key_counter() {
    let server = shared_server();
    let prefix = unique_prefix("fencing");
    let locks = manager(&server, &prefix).await;
    let single = locks.lock("f1").fencing(true).acquire().await.unwrap();
    assert_eq!(single.fencing_token(), Some(1));
    single.release().await.unwrap();
    let set = locks
        .lock_all(["f2", "f1"])
        .fencing(true)
        .acquire()
        .await
        .unwrap();
    assert_eq!(set.fencing_token("f1"), Some(2));
    assert_eq!(set.fencing_token("f2"), Some(1));
    assert_eq!(set.fencing_token("f3"), None);
    set.release().await.unwrap();
    let single = locks.lock("f2").fencing(true).acquire().await.unwrap();
    assert_eq!(single.fencing_token(), Some(2));
    single.release().await.unwrap();
}

#[tokio::test]
async fn shutdown_gives_back_every_set() {
    let server = shared_server();
    let prefix = unique_prefix("shutdown");
    let locks = manager(&server, &prefix).await;
    let other = manager(&server, &prefix).await;
    let set = locks
        .lock_all(["a", "b"])
        .ttl(Duration::from_secs(60))
        .acquire()
        .await
        .unwrap();
    let held = other.lock("c").acquire().await.unwrap();
    let waiter = locks.clone();
    let waiting = tokio::spawn(async move {
        waiter
            .lock_all(["c", "d"])
            .wait(Duration::from_secs(60))
            .acquire()
            .await
    });
    while locks.stats().waiting_keys == 0 {
        tokio::task::yield_now().await;
    }
    locks.shutdown().await;
    assert_eq!(keys(&server, &prefix), vec![locks.redis_key("c")]);
    assert!(matches!(set.release().await, Err(LockError::ShutDown)));
    assert!(matches!(waiting.await.unwrap(), Err(LockError::ShutDown)));
    assert!(matches!(
        locks.lock_all(["e"]).acquire().await,
        Err(LockError::ShutDown)
    ));
    held.release().await.unwrap();
}

/// A single hold nested in a set's lock shares the set's lease: what renews or extends it
/// reaches every lock of the set, so the set never promises more than a lock has on the
/// server; once the set is given back, the nested hold renews its own lock alone.
#[tokio::test]
async fn a_hold_nested_in_a_set_renews_and_extends_the_whole_set() {
    let server = shared_server();
    let prefix = unique_prefix("set-nested");
    use redis::AsyncCommands;
    let locks = manager(&server, &prefix).await;
    let other = manager(&server, &prefix).await;
    let mut redis = raw(&server).await;
    let ttl = Duration::from_millis(900);
    distlock::scope(async {
        let set = (locks.lock_all(["a", "b"]).ttl(ttl).reentrant(true))
            .acquire()
            .await
            .unwrap();
        let nested = locks
            .lock("a")
            .ttl(ttl)
            .reentrant(true)
            .watchdog(true)
            .acquire()
            .await
            .unwrap();
        // Three leases long: only the nested hold's renewals keep the set.
        tokio::time::sleep(ttl * 3).await;
        for key in ["a", "b"] {
            let pttl: i64 = redis.pttl(locks.redis_key(key)).await.unwrap();
            assert!(
                set.remaining().as_millis() as i64 <= pttl,
                "{key}: the set promises {:?}, the server has {pttl} ms",
                set.remaining()
            );
        }
        // An extend of the nested hold reaches the set's other lock too.
        nested.extend(Duration::from_secs(20)).await.unwrap();
        let pttl: i64 = redis.pttl(locks.redis_key("b")).await.unwrap();
        assert!(pttl > 10_000, "b was not extended: {pttl} ms");
        // The set given back, the nested hold goes on with its own lock.
        set.release().await.unwrap();
        take_soon(&other, "b", "b was given back with the set").await;
        tokio::time::sleep(ttl * 2).await;
        assert!(!nested.is_lost() && nested.is_held().await.unwrap());
        nested.release().await.unwrap();
    })
    .await;
    assert!(keys(&server, &prefix).is_empty());
}
