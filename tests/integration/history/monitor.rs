//! The liveness monitor: samples every key while the programs run.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use distlock::LockManager;

use super::checker::Judged;
use super::model::{KEYS, SAMPLE, STALL};
use super::world::{Probe, World};

/// Samples every key until `stop`: a key free in Redis, entered by nobody, while a request
/// sleeps waiting for it, for longer than `STARVED` plus the fault allowance, is a liveness
/// violation, and so are all the keys of a set free together for that long while the set
/// sleeps waiting for them; an exclusive holder's key whose lease outlasts what its owner
/// asked for, a lease violation.
pub(super) async fn monitor(
    world: World,
    locks: LockManager,
    stop: Arc<tokio::sync::Notify>,
    faults: bool,
) {
    let mut free_since: HashMap<&str, Instant> = HashMap::new();
    // Since when each key has been free in Redis, sample after sample.
    let mut free_in_redis: HashMap<&'static str, Instant> = HashMap::new();
    // A plain lock owned by a token that no holder in the history has: since when, by whom.
    let mut orphaned: HashMap<&str, (String, Instant)> = HashMap::new();
    let stopped = stop.notified();
    tokio::pin!(stopped);
    loop {
        let due = Instant::now() + SAMPLE;
        tokio::select! {
            () = &mut stopped => return,
            () = tokio::time::sleep_until(due.into()) => {}
        }
        let woke = Instant::now();
        if woke > due + STALL {
            world.history.lock().stalls.push((due, woke));
        }
        for key in KEYS {
            let sampled = Instant::now();
            let pttl = world.probe.pttl(&locks.redis_key(key)).await;
            if pttl == Some(-2) {
                free_in_redis.entry(key).or_insert(sampled);
            } else {
                free_in_redis.remove(key);
            }
            // Every release answered `Ok` has arrived: a plain lock whose owner left the
            // history (released, dropped, cancelled) is gone within moments, not at its lease's
            // end. Through faults a release may go unanswered, and then the lease runs out.
            // (On RedLock, on any master: a late attempt may land on a few only.)
            let owners = match pttl {
                Some(ms) if ms > 0 => world.probe.owners(&locks.redis_key(key)).await,
                _ => Vec::new(),
            };
            let now = Instant::now();
            let mut state = world.history.lock();
            state.liveness_samples += 1;
            let holds = |owner: &String| {
                (state.holders.get(key).into_iter().flatten()).any(|h| h.owner == *owner)
            };
            match owners.into_iter().find(|owner| !holds(owner)) {
                Some(owner) => {
                    let since = match orphaned.get(key) {
                        Some((o, since)) if *o == owner => *since,
                        _ => {
                            orphaned.insert(key, (owner.clone(), sampled));
                            sampled
                        }
                    };
                    drop(state);
                    let judged = if faults {
                        world.history.orphaned(key, &owner, since, now)
                    } else {
                        world
                            .history
                            .orphaned_without_faults(key, &owner, since, now)
                    };
                    if judged {
                        orphaned.remove(key);
                    }
                    state = world.history.lock();
                }
                _ => {
                    orphaned.remove(key);
                }
            }
            drop(state);
            if !matches!(world.probe, Probe::Masters(_)) {
                world.history.prolonged(key, pttl, sampled, now);
            }
            if pttl != Some(-2) {
                free_since.remove(key);
                continue;
            }
            let free = *free_since.entry(key).or_insert(sampled);
            if world.history.starved(key, free, now) != Judged::Fine {
                free_since.remove(key);
            }
        }
        world
            .history
            .starved_sets(&mut free_in_redis, Instant::now());
    }
}
