//! The randomized history checker.
//!
//! Several managers (as if several processes) × many tasks run seeded random programs on a
//! handful of keys: every lock kind on the same keys, sets of 2–4 of those keys taken
//! together (`lock_all`), nested and sibling holds, try and wait, extend, watchdog,
//! `min_hold`, annotated calls, cancellation at random points, guards dropped instead of
//! released, panics in bodies, runtimes and managers shut down while their tasks hold locks.
//! Sets meet everything else: single holds inside sets and sets inside single holds and
//! other sets (a key held already is re-entered, a nested hold of its outer holder), sets
//! beside sibling holds, annotated sets, sets cancelled while they wait. Every entry and exit
//! goes to one history, which checks:
//!
//! * the compatibility matrix, ever: only read + read and up to `PERMITS` permits overlap
//!   (holds of one owner never conflict with themselves). A set is an exclusive hold of each
//!   of its keys, entered and left together. A lock is a lease, so a holder only counts until
//!   the conservative bound its guard gave (`remaining()`; a set's, the shortest of its
//!   leases); an entry while a conflicting holder's bound has not passed is an overlap;
//! * every call ends: each await is bounded, and running past the bound is a violation;
//! * `remaining()` never exceeds what the server has left of the lease (PTTL): of every lock
//!   a set took;
//! * nothing is left at the end: no lock keys (fencing counters stay by design), no
//!   subscribed channel, no local waiter, no lease under the watchdog;
//! * liveness: a monitor samples every key while the programs run. A key that is free in
//!   Redis while some request sleeps in `acquire()` for it, with nobody entering it, for
//!   longer than `STARVED` (plus any injected fault window the stretch overlaps and a
//!   recovery after it, and any stall the monitor measures on itself: its timer firing more
//!   than `STALL` late, when the machine ran nobody) is a violation. A set waits for all its keys at once: every one of
//!   them free in Redis together for that long, none entered, while the set sleeps, is a
//!   violation;
//! * steals: some programs have their own lock taken away while they hold it (a forced
//!   release through the inspector, a `DEL` of the key, a lease run out by a pause past a
//!   short `ttl`). The old holder's `extend`, `is_held` and (without faults) `release` must
//!   not succeed afterwards, its `lost()` must fire, and no holder's lease in Redis may
//!   outlast what its own owner asked for (a renewal or extend by a robbed holder would
//!   prolong it).
//!
//! `cargo test --test integration history::` runs a short budget on one server. The seed is
//! printed, and `DISTLOCK_SEED=<n>` replays it. `DISTLOCK_HISTORY_LONG=<acquisitions>` (say
//! 100000) runs the long mode: that many acquisitions on each topology — one server,
//! Sentinel, Cluster and RedLock over 3 — with faults mixed in (latency and partitions through
//! a proxy, servers paused; a RedLock master killed and restarted empty).

mod checker;
mod entries;
mod monitor;
mod programs;
mod sets;
mod steals;
mod topologies;
mod world;

use std::sync::Arc;
use std::time::Duration;

use distlock::{LockManager, LockRequest};

use crate::support;

use checker::*;
use entries::*;
use monitor::*;
use programs::*;
use sets::*;
use steals::*;
use topologies::*;
use world::*;

/// The keys every program works on: few, so that programs meet; four, so that a set can
/// name every one.
pub(super) const KEYS: [&str; 4] = ["a", "b", "c", "d"];
/// The permits of every semaphore (all users of a key must agree).
pub(super) const PERMITS: u32 = 2;
/// No call may take longer than this: past it, the call counts as hung.
pub(super) const BOUND: Duration = Duration::from_secs(30);
/// A key free in Redis while a request sleeps waiting for it, and nobody enters it, for longer
/// than this (outside fault windows) is a liveness violation.
pub(super) const STARVED: Duration = Duration::from_millis(250);
/// The monitor's timer firing later than this past its time is a stall of the process: that
/// stretch is allowed to a waiter as a fault window is (a loaded machine starves everyone).
pub(super) const STALL: Duration = Duration::from_millis(10);
/// After an injected fault ends, connections and subscriptions take this long to recover: a
/// free stretch that overlaps a fault window may last the window and this much longer.
pub(super) const RECOVERY: Duration = Duration::from_millis(1_500);
/// How long past its `wait` an acquire may still run (an attempt in flight, a loaded
/// machine).
pub(super) const OVERSTAY: Duration = Duration::from_secs(2);
/// The same through faults: a `wait` does not cut an attempt in flight, which may open a
/// connection twice and wait for two answers, each bounded by the manager's timeouts
/// (500 ms here): about 2 s, plus a paused server's pause.
pub(super) const OVERSTAY_FAULTS: Duration = Duration::from_secs(4);
/// Without faults, how long a plain lock may stay owned by a token that no holder in the
/// history has (a release on its way; a fair grant to a waiter that left, 2 s at most).
pub(super) const ORPHANED: Duration = Duration::from_secs(3);
/// How long after its hold was taken away a cohort's run may still pass it on, past one
/// round trip (the steal's own, measured as it is made): the run learns of it from its next
/// check's answer, and passes made while that is out are seen entering a moment later.
/// Fault windows (and the recovery after them) the stretch overlaps are allowed on top.
pub(super) const RUN_AFTER_STEAL: Duration = Duration::from_millis(10);
/// How often the monitor samples each key.
pub(super) const SAMPLE: Duration = Duration::from_millis(15);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Exclusive,
    Read,
    Write,
    Permit,
}

impl Kind {
    pub(super) fn request<'m>(self, locks: &'m LockManager, key: &str) -> LockRequest<'m> {
        match self {
            Self::Exclusive => locks.lock(key),
            Self::Read => locks.read_lock(key),
            Self::Write => locks.write_lock(key),
            Self::Permit => locks.semaphore(key, PERMITS),
        }
    }

    /// Whether two different owners may hold `self` and `other` on one key at once.
    pub(super) fn overlaps(self, other: Self) -> bool {
        matches!(
            (self, other),
            (Self::Read, Self::Read) | (Self::Permit, Self::Permit)
        )
    }

    /// The command that answers what is left of this kind's lease (as `PTTL` does): the
    /// lock's, or, for shares, the holder's share's in the lock's hash.
    pub(super) fn lease_left(self, locks: &LockManager, key: &str, token: &str) -> redis::Cmd {
        support::lease_left(&locks.redis_key(key), token)
    }
}

/// What a topology can do: RedLock has neither shared kinds nor fencing.
#[derive(Debug, Clone, Copy)]
pub(super) struct Features {
    pub(super) shared_kinds: bool,
    pub(super) fencing: bool,
    /// Fair locks (one queue per key): not with RedLock.
    pub(super) fair: bool,
    /// Leases of at most 2 s (RedLock: a restarted master stays out for longer than that).
    pub(super) short_leases: bool,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_programs_keep_every_guarantee() {
    if long_mode().is_some() {
        return; // the long mode runs every topology in `long_mode_on_every_topology`
    }
    let seed = seed();
    println!("history seed {seed} (replay with DISTLOCK_SEED={seed})");
    let server = support::shared_server();
    let prefix = support::unique_prefix("history");
    let managers = vec![
        support::manager(&server, &prefix).await,
        support::manager(&server, &prefix).await,
        support::manager(&server, &prefix).await,
    ];
    let world = World {
        history: Arc::default(),
        raw: raw(&server.url()).await,
        features: Features {
            shared_kinds: true,
            fencing: true,
            fair: true,
            short_leases: false,
        },
        check_leases: true,
        probe: Probe::One(raw(&server.url()).await),
    };
    let run = Run {
        managers: managers.len(),
        tasks: 8,
        ops: 30,
    };
    rounds("one server", seed, 3_000, &world, &managers, &run, false).await;
    check_nothing_left(&world, &managers, &[&server], &prefix).await;
    world.history.report(seed, "one server");
}

/// The long mode: every topology, with faults. Off unless `DISTLOCK_HISTORY_LONG` is set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_mode_on_every_topology() {
    let Some(target) = long_mode() else {
        return;
    };
    let seed = seed();
    println!("history long mode, {target} acquisitions per topology, seed {seed}");
    let only = std::env::var("DISTLOCK_HISTORY_TOPOLOGY").ok();
    let wanted = |name: &str| only.as_deref().is_none_or(|o| o == name);
    let run = Run {
        managers: 3,
        tasks: 8,
        ops: 40,
    };
    if wanted("single") {
        single_with_faults(seed, target, &run).await;
    }
    if wanted("sentinel") {
        sentinel_with_faults(seed, target, &run).await;
    }
    if wanted("cluster") {
        cluster_with_faults(seed, target, &run).await;
    }
    if wanted("redlock") {
        redlock_with_faults(seed, target, &run).await;
    }
}
