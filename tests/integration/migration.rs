//! Slot migration: a hash slot moved from master to master key by key, as `redis-cli
//! --cluster reshard` moves it (`CLUSTER SETSLOT … IMPORTING` / `MIGRATING`, then `MIGRATE`
//! per key, then `SETSLOT … NODE`), back and forth, while readers, writers, permit holders
//! and exclusive holders of several managers contend on two locks of that slot. No
//! conflicting holders ever overlap and fencing tokens keep increasing: every script
//! declares every key it touches, so the server never runs one on half-moved state (it
//! answers `ASK` or `TRYAGAIN`, which the clients follow), and a lock's shares move with it.
//!
//! The test runs on whatever server the suite runs on (`DISTLOCK_REDIS_SERVER`): CI runs the
//! suite on Redis 7.0 and again on Valkey 9.1.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distlock::testing::RedisServer;
use distlock::{LockError, LockManager};

use crate::support;

/// How many times the slot moves at least, each time to the next master.
const MOVES: usize = 8;
/// Leases far longer than any hold (a few ms): a holder that enters with at least
/// [`ENOUGH`] left never loses its lock inside, so the record of who is inside is exact. A
/// release that fails while the slot moves leaves the lock to this lease.
const TTL: Duration = Duration::from_secs(5);
const ENOUGH: Duration = Duration::from_secs(1);
/// How long each holder stays inside (ms): long enough to be inside while the slot is half
/// moved.
const HOLD: std::ops::Range<u64> = 30..120;
/// The pause between two keys of a move: how long the slot stays half moved.
const BETWEEN_KEYS: Duration = Duration::from_millis(25);
/// How long the slot stays put between two moves.
const SETTLED: Duration = Duration::from_millis(1200);

/// What one worker takes, again and again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// A read share of the read-write lock.
    Reader,
    /// Its write side.
    Writer,
    /// A permit of the semaphore (of [`PERMITS`]), the other lock.
    Permit,
    /// The read-write lock's key as an exclusive lock.
    Exclusive,
}

const PERMITS: u32 = 2;

/// The workers of each manager: their role, and their lock (0: the read-write lock, which
/// exclusive holders take too; 1: the semaphore).
const ROLES: [(Role, usize); 7] = [
    (Role::Reader, 0),
    (Role::Reader, 0),
    (Role::Writer, 0),
    (Role::Exclusive, 0),
    (Role::Permit, 1),
    (Role::Permit, 1),
    (Role::Permit, 1),
];

/// Who is inside each lock right now, as the workers say on entering and before leaving,
/// and every conflict seen.
#[derive(Default)]
struct Record {
    readers: u32,
    writers: u32,
    permits: u32,
    exclusive: u32,
    /// The highest fencing token of each lock any holder entered with, and the token of the
    /// last holder that excluded every other.
    highest: [u64; 2],
    last_alone: [u64; 2],
    entries: [u32; 4],
    conflicts: Vec<String>,
}

impl Record {
    /// A holder of `role` enters with fencing token `fence`: what it finds must allow it.
    fn enter(&mut self, role: Role, fence: u64) {
        let lock = usize::from(role == Role::Permit);
        let alone_inside = self.writers + self.exclusive;
        let conflict = match role {
            Role::Reader => alone_inside > 0,
            Role::Writer | Role::Exclusive => self.readers > 0 || alone_inside > 0,
            Role::Permit => self.permits >= PERMITS,
        };
        let alone = matches!(role, Role::Writer | Role::Exclusive);
        // A holder alone drew its token after every earlier holder's; a sharer after the last
        // holder alone's.
        let stale = if alone {
            fence <= self.highest[lock]
        } else {
            fence <= self.last_alone[lock]
        };
        if conflict || stale {
            self.conflicts.push(format!(
                "{role:?} with fence {fence} entered beside {} readers, {} writers, {} \
                 permits, {} exclusive (highest fence {}, last alone {})",
                self.readers,
                self.writers,
                self.permits,
                self.exclusive,
                self.highest[lock],
                self.last_alone[lock],
            ));
        }
        self.highest[lock] = self.highest[lock].max(fence);
        if alone {
            self.last_alone[lock] = fence;
        }
        *self.count(role) += 1;
        self.entries[role as usize] += 1;
    }

    fn leave(&mut self, role: Role) {
        *self.count(role) -= 1;
    }

    fn count(&mut self, role: Role) -> &mut u32 {
        match role {
            Role::Reader => &mut self.readers,
            Role::Writer => &mut self.writers,
            Role::Permit => &mut self.permits,
            Role::Exclusive => &mut self.exclusive,
        }
    }
}

/// The names of two locks whose keys share one hash slot under `locks`' prefix.
fn two_locks_in_one_slot(locks: &LockManager) -> (String, String) {
    use redis::cluster_routing::Slot;
    let first = "doc".to_owned();
    let slot = Slot::for_key(locks.redis_key(&first));
    let second = (0..)
        .map(|i| format!("pool:{i}"))
        .find(|name| Slot::for_key(locks.redis_key(name)) == slot)
        .expect("some name hashes to every slot");
    (first, second)
}

/// One worker: takes its lock as `role` until `stop`, holds it a few milliseconds, and
/// records what it saw. An acquire or release that fails while the slot moves fails with a
/// `LockError` (counted in `errors`), never with a wrong grant.
async fn work(
    locks: LockManager,
    name: String,
    role: Role,
    record: Arc<Mutex<Record>>,
    stop: Arc<AtomicBool>,
    errors: Arc<AtomicU32>,
) {
    let mut attempts = 0u32;
    while !stop.load(Ordering::Relaxed) {
        attempts += 1;
        let request = match role {
            Role::Reader => locks.read_lock(&name),
            Role::Writer => locks.write_lock(&name),
            Role::Permit => locks.semaphore(&name, PERMITS),
            Role::Exclusive => locks.lock(&name),
        };
        let request = request.ttl(TTL).fencing(true);
        // Most wait (a waiting writer keeps new readers out); exclusive holders mostly ask
        // again and again instead, so that some ask while the slot is half moved, and every
        // fourth time wait like the others (asking only, they could be kept out all along by
        // the waiting writers and readers).
        let answer = if role != Role::Exclusive || attempts.is_multiple_of(4) {
            request
                .wait(Duration::from_secs(2))
                .acquire()
                .await
                .map(Some)
        } else {
            request.try_acquire().await
        };
        let guard = match answer {
            Ok(Some(guard)) => guard,
            Ok(None) => {
                tokio::time::sleep(Duration::from_millis(2)).await;
                continue;
            }
            Err(LockError::Busy { .. }) => continue,
            Err(error) => {
                expect_clean_failure(&error);
                errors.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let fence = guard.fencing_token().expect("taken with fencing");
        if guard.remaining() < ENOUGH {
            // Granted late (an answer that took retries): not sure to outlast its hold.
            drop(guard.release().await);
            continue;
        }
        record.lock().unwrap().enter(role, fence);
        let hold = fastrand::u64(HOLD);
        tokio::time::sleep(Duration::from_millis(hold)).await;
        // Out of the record before the server hears of it: the record may only ever say
        // "free" early, never late.
        record.lock().unwrap().leave(role);
        let (left, sent) = (guard.remaining(), Instant::now());
        match guard.release().await {
            Ok(()) => {}
            // Its lease ended while the release waited for the move: the lock was given up
            // by then. Sooner, something else removed this holder's share.
            Err(LockError::Lost { .. }) if sent.elapsed() >= left => {}
            Err(LockError::Lost { .. }) => record.lock().unwrap().conflicts.push(format!(
                "{role:?} lost its lock with {left:?} of its lease left"
            )),
            Err(error) => {
                expect_clean_failure(&error);
                errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        // Out for a while, so that every kind finds the lock free now and then.
        tokio::time::sleep(Duration::from_millis(fastrand::u64(HOLD))).await;
    }
}

/// Errors while the slot is half moved are expected (a timeout while the server answers
/// `TRYAGAIN`), as Redis errors. A script refused for touching a key it did not declare
/// (Redis and Valkey refuse a non-local one; others refuse any) is not.
fn expect_clean_failure(error: &LockError) {
    assert!(
        matches!(error, LockError::Redis { .. }),
        "an acquire failed with {error:?}"
    );
    let text = error.to_string();
    assert!(
        !text.contains("non local key") && !text.contains("CROSSSLOT"),
        "a script touched a key it did not declare: {text}"
    );
}

/// The master of `nodes` that serves `slot` now, by its own view.
fn owner_of(nodes: &[RedisServer], ids: &[String], slot: u16) -> usize {
    let listing = nodes[0].command(&["CLUSTER", "NODES"]).unwrap();
    for line in listing.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let serves = fields.iter().skip(8).any(|range| {
            let (low, high) = range.split_once('-').unwrap_or((range, range));
            match (low.parse::<u16>(), high.parse::<u16>()) {
                (Ok(low), Ok(high)) => (low..=high).contains(&slot),
                _ => false,
            }
        });
        if serves {
            return ids.iter().position(|id| id == fields[0]).unwrap();
        }
    }
    panic!("nobody serves slot {slot}: {listing}");
}

/// Moves `slot` from master `from` to master `to` as `redis-cli --cluster reshard` does:
/// importing on the target, migrating on the source, then every key with its own `MIGRATE`
/// (a pause between keys, so that clients meet the slot half moved), then the new owner
/// told to the target, the source and every other master.
fn move_slot(nodes: &[RedisServer], ids: &[String], slot: u16, hops: (usize, usize)) -> usize {
    let (from, to) = hops;
    let locks_first = fastrand::bool();
    let slot_arg = slot.to_string();
    let ok = |reply: String, what: &str| assert!(reply.starts_with('+'), "{what}: {reply}");
    ok(
        nodes[to]
            .command(&["CLUSTER", "SETSLOT", &slot_arg, "IMPORTING", &ids[from]])
            .unwrap(),
        "SETSLOT IMPORTING",
    );
    ok(
        nodes[from]
            .command(&["CLUSTER", "SETSLOT", &slot_arg, "MIGRATING", &ids[to]])
            .unwrap(),
        "SETSLOT MIGRATING",
    );
    let url = nodes[to].url();
    let (host, port) = url
        .trim_start_matches("redis://")
        .rsplit_once(':')
        .expect("host:port");
    let mut moved = 0;
    loop {
        let listed = nodes[from]
            .command(&["CLUSTER", "GETKEYSINSLOT", &slot_arg, "100"])
            .unwrap();
        let mut keys: Vec<&str> = listed.lines().filter(|l| !l.is_empty()).collect();
        // The server lists keys in an order of its own, which reshard follows; some moves
        // take the worst one for a lock instead: its key and its fencing counter (what an
        // exclusive acquire declares) before anything else of it.
        if locks_first {
            keys.sort_by_key(|key| match key {
                _ if key.ends_with('}') => 0,
                _ if key.ends_with(":fence") => 1,
                _ => 2,
            });
        }
        let Some(key) = keys.first() else {
            break;
        };
        let key = (*key).to_owned();
        let reply = nodes[from]
            .command(&["MIGRATE", host, port, "", "0", "5000", "KEYS", &key])
            .unwrap();
        // NOKEY: it expired meanwhile. BUSYKEY would be one key on both masters.
        assert!(
            reply == "+OK" || reply == "+NOKEY",
            "MIGRATE {key}: {reply}"
        );
        moved += 1;
        std::thread::sleep(BETWEEN_KEYS);
    }
    let node = ["CLUSTER", "SETSLOT", &slot_arg, "NODE", &ids[to]];
    ok(nodes[to].command(&node).unwrap(), "SETSLOT NODE (target)");
    ok(nodes[from].command(&node).unwrap(), "SETSLOT NODE (source)");
    for (i, other) in nodes.iter().enumerate() {
        if i != to && i != from {
            ok(other.command(&node).unwrap(), "SETSLOT NODE (others)");
        }
    }
    moved
}

/// Three managers of the cluster `nodes`, under one prefix.
async fn managers_of(nodes: &[RedisServer]) -> Vec<LockManager> {
    let prefix = support::unique_prefix("migrate");
    let mut managers = Vec::new();
    for _ in 0..3 {
        // Time enough for the client to follow TRYAGAIN until the move is through.
        let builder = support::cluster(nodes)
            .key_prefix(&prefix)
            .response_timeout(Duration::from_secs(3));
        managers.push(support::connect(builder).await);
    }
    managers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_moved_key_by_key_never_splits_a_lock() {
    let nodes = RedisServer::start_cluster(3).unwrap();
    let ids: Vec<String> = nodes
        .iter()
        .map(|n| n.command(&["CLUSTER", "MYID"]).unwrap())
        .collect();
    let managers = managers_of(&nodes).await;
    let (rw, pool) = two_locks_in_one_slot(&managers[0]);
    let slot_reply = nodes[0]
        .command(&["CLUSTER", "KEYSLOT", &managers[0].redis_key(&rw)])
        .unwrap();
    let slot: u16 = slot_reply.trim_start_matches(':').parse().unwrap();

    let record = Arc::new(Mutex::new(Record::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(AtomicU32::new(0));
    let mut workers = Vec::new();
    for locks in &managers {
        for (role, name) in ROLES {
            let name = if name == 0 { &rw } else { &pool };
            let (record, stop, errors) = (record.clone(), stop.clone(), errors.clone());
            let work = work(locks.clone(), name.clone(), role, record, stop, errors);
            workers.push(tokio::spawn(work));
        }
    }

    // The slot moves while they contend, each time to the next master.
    let mover = {
        let (record, ids) = (record.clone(), ids.clone());
        tokio::task::spawn_blocking(move || {
            let mut log = Vec::new();
            // At least MOVES moves, and more (up to four times as many) until every role
            // has held its lock: a busy machine slows some of them down.
            for round in 0..4 * MOVES {
                let entries = record.lock().unwrap().entries;
                if round >= MOVES && entries.iter().all(|&n| n > 0) {
                    break;
                }
                let from = owner_of(&nodes, &ids, slot);
                let to = (from + 1) % nodes.len();
                let keys = move_slot(&nodes, &ids, slot, (from, to));
                log.push((from, to, keys, entries));
                std::thread::sleep(SETTLED);
            }
            (nodes, log)
        })
    };
    let (nodes, log) = mover.await.unwrap();
    stop.store(true, Ordering::Relaxed);
    for worker in workers {
        worker.await.unwrap();
    }
    let record = std::mem::take(&mut *record.lock().unwrap());
    println!(
        "slot {slot} moved {} times (from, to, keys moved, entries before): {log:?}; \
         entries (reader, writer, permit, exclusive): {:?}; errors: {}",
        log.len(),
        record.entries,
        errors.load(Ordering::Relaxed)
    );
    assert!(
        record.conflicts.is_empty(),
        "conflicting holders: {:#?}",
        record.conflicts
    );
    assert!(
        record.entries.iter().all(|&n| n > 0),
        "every role held its lock: {:?}",
        record.entries
    );
    // The locks work where the slot ended, and nothing of theirs is left elsewhere.
    // A release that failed mid-move left its lock to its lease: wait that out.
    let guard = managers[0]
        .write_lock(&rw)
        .wait(TTL * 2)
        .acquire()
        .await
        .unwrap();
    guard.release().await.unwrap();
    let owner = owner_of(&nodes, &ids, slot);
    for (i, node) in nodes.iter().enumerate() {
        let left = node
            .command(&["CLUSTER", "COUNTKEYSINSLOT", &slot.to_string()])
            .unwrap();
        if i != owner {
            assert_eq!(
                left, ":0",
                "keys of slot {slot} left on a master that gave it up"
            );
        }
    }
}
