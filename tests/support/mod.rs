//! Shared by the integration tests: real `redis-server` processes and managers on them, on
//! every topology (`topology`).
#![allow(dead_code, unreachable_pub)]

pub mod logs;
mod topology;

pub use topology::*;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use distlock::LockManager;
use distlock::testing::RedisServer;

/// The server shared by the tests of one binary that do not fault it.
pub fn shared_server() -> Arc<RedisServer> {
    RedisServer::shared().expect("redis-server must be installed to run the integration tests")
}

/// The name the test harness gives the test `test` of the module `module` (its
/// `module_path!()`), as `--exact` takes it: the module path without the crate's name. A test
/// that runs a child of this test binary runs one test in it by this name.
pub fn test_name(module: &str, test: &str) -> String {
    match module.split_once("::") {
        Some((_, path)) => format!("{path}::{test}"),
        None => test.to_owned(),
    }
}

/// A fresh key prefix, so that tests sharing a server never see each other's keys.
pub fn unique_prefix(test: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("t{}:{test}:", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// A manager on `server` under `prefix`, with short timeouts so faults show quickly.
pub async fn manager(server: &RedisServer, prefix: &str) -> LockManager {
    manager_at(server.url(), prefix).await
}

/// The keys under `prefix` that exist on `server`.
pub fn keys(server: &RedisServer, prefix: &str) -> Vec<String> {
    let reply = server
        .command(&["KEYS", &format!("{prefix}*")])
        .expect("KEYS");
    reply
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect()
}

/// A raw connection for checks that must not go through distlock.
pub async fn raw(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// The command that answers, as `PTTL` does (ms; -2: gone), what is left of the lease of
/// `token`'s hold on the lock key `lock`: a read share or permit keeps its own lease in the
/// lock's hash (the field `s:<token>`, the server time it ends at), bounded by the key's
/// lease; any other hold has the key's lease.
pub fn lease_left(lock: &str, token: &str) -> redis::Cmd {
    const SCRIPT: &str = r"
        local pttl = redis.call('pttl', KEYS[1])
        local ends = redis.pcall('hget', KEYS[1], 's:' .. ARGV[1])
        if type(ends) ~= 'string' then
          return pttl
        end
        local t = redis.call('time')
        local left = tonumber(ends) - (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
        if left <= 0 then
          return -2
        end
        return math.min(left, pttl)
    ";
    redis::cmd("EVAL")
        .arg(SCRIPT)
        .arg(1)
        .arg(lock)
        .arg(token)
        .to_owned()
}

/// What a contended run saw.
pub struct Contention {
    /// Entries into the critical section.
    pub entries: u32,
    /// The fencing tokens of those entries, in the order they entered (with fencing).
    pub fences: Vec<u64>,
}

/// `tasks` tasks on each manager take the exclusive lock `"hot"` `rounds` times each, and on
/// every entry check that nobody else is inside. `halfway` is told when half the entries are
/// done (for a fault in the middle of the run). A release that fails during a fault is left
/// to the lock's lease.
pub async fn contend(
    managers: &[LockManager],
    tasks: usize,
    rounds: usize,
    fencing: bool,
    halfway: Option<Arc<tokio::sync::Notify>>,
) -> Contention {
    use std::sync::atomic::{AtomicBool, AtomicU32};
    let inside = Arc::new(AtomicBool::new(false));
    let entries = Arc::new(AtomicU32::new(0));
    let fences = Arc::new(std::sync::Mutex::new(Vec::new()));
    let half = u32::try_from(managers.len() * tasks * rounds / 2).unwrap();
    let mut running = tokio::task::JoinSet::new();
    for locks in managers {
        for _ in 0..tasks {
            let (locks, inside, entries, fences, halfway) = (
                locks.clone(),
                inside.clone(),
                entries.clone(),
                fences.clone(),
                halfway.clone(),
            );
            running.spawn(async move {
                for _ in 0..rounds {
                    let guard = locks
                        .lock("hot")
                        .ttl(Duration::from_secs(5))
                        .fencing(fencing)
                        .wait(Duration::from_secs(30))
                        .retry_delay(Duration::from_millis(2))
                        .acquire()
                        .await
                        .unwrap();
                    assert!(!inside.swap(true, Ordering::SeqCst), "two holders inside");
                    if let Some(fence) = guard.fencing_token() {
                        fences.lock().unwrap().push(fence);
                    }
                    if entries.fetch_add(1, Ordering::SeqCst) + 1 == half
                        && let Some(halfway) = &halfway
                    {
                        halfway.notify_one();
                    }
                    tokio::task::yield_now().await;
                    inside.store(false, Ordering::SeqCst);
                    let _ = guard.release().await;
                }
            });
        }
    }
    while let Some(done) = running.join_next().await {
        done.unwrap();
    }
    let fences = std::mem::take(&mut *fences.lock().unwrap());
    Contention {
        entries: entries.load(Ordering::SeqCst),
        fences,
    }
}

/// Takes `key` within 2 s (far less than any lease these tests leave behind) and gives it
/// back: proof that whatever held it before released it.
pub async fn take_soon(locks: &LockManager, key: &str, why: &str) {
    let guard = locks
        .lock(key)
        .wait(Duration::from_secs(2))
        .retry_delay(Duration::from_millis(2))
        .acquire()
        .await
        .unwrap_or_else(|e| panic!("{why}: {e}"));
    guard.release().await.unwrap();
}

/// Waits until `locks` has at least `n` requests queued behind busy locks.
pub async fn until_waiting(locks: &LockManager, n: usize) {
    let started = std::time::Instant::now();
    while locks.stats().waiting_requests < n {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no request queued: {:?}",
            locks.stats()
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}
