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
mod model;
mod monitor;
mod program;
mod sets;
mod steals;
mod steps;
mod topologies;
mod world;

use std::sync::Arc;

use crate::support;

use model::Features;
use topologies::{
    Run, check_nothing_left, cluster_with_faults, long_mode, raw, redlock_with_faults, rounds,
    seed, sentinel_with_faults, single_with_faults,
};
use world::{Probe, World};

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
