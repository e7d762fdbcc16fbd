//! The liveness monitor: samples every key while the programs run.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock::LockManager;

use super::checker::Judged;
use super::model::{KEYS, ORPHANED, SAMPLE, STALL, STARVED};
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
                    } else if now.saturating_duration_since(since) > ORPHANED {
                        world.history.violation(format!(
                            "orphan: {key} held by {} for {:?}, a token no holder has",
                            &owner[owner.len().saturating_sub(8)..],
                            now.saturating_duration_since(since)
                        ));
                        true
                    } else {
                        false
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
            // Prolonged leases: the key outlives what every live exclusive owner asked for.
            let capped: Vec<(String, Duration)> = state
                .holders
                .get(key)
                .into_iter()
                .flatten()
                .filter(|h| h.capped && h.valid_until > now && h.entered < sampled)
                .map(|h| {
                    (
                        h.owner.clone(),
                        state.lease_caps.get(&h.owner).copied().unwrap_or_default(),
                    )
                })
                .collect();
            if let (Some(pttl), Some((owner, cap))) = (pttl, capped.first())
                && capped.iter().all(|(o, _)| o == owner)
                && !matches!(world.probe, Probe::Masters(_))
                && u128::try_from(pttl).is_ok_and(|ms| ms > cap.as_millis() + 50)
            {
                let what = format!(
                    "lease: {key}'s PTTL is {pttl} ms while its holder {} asked for at most {cap:?}",
                    &owner[owner.len() - 8..]
                );
                drop(state);
                world.history.violation(what);
                state = world.history.lock();
            }
            drop(state);
            if pttl != Some(-2) {
                free_since.remove(key);
                continue;
            }
            let free = *free_since.entry(key).or_insert(sampled);
            if world.history.starved(key, free, now) != Judged::Fine {
                free_since.remove(key);
            }
        }
        starved_sets(&world, &mut free_in_redis);
    }
}

/// A set sleeping in `acquire()` can only enter once every one of its keys is free: all of them
/// free in Redis together (`free`, from the monitor's samples), none entered by anybody, for
/// longer than `STARVED` plus the fault allowance, is a liveness violation.
pub(super) fn starved_sets(world: &World, free: &mut HashMap<&'static str, Instant>) {
    let now = Instant::now();
    let state = world.history.lock();
    let mut stretches = Vec::new();
    for (keys, since, who) in state.waiting.values().filter(|(keys, _, _)| keys.len() > 1) {
        let mut from = Some(*since);
        for key in keys {
            let entered = state.last_entry.get(key).copied();
            from = match (from, free.get(key.as_str())) {
                (Some(from), Some(&free)) => Some(from.max(free).max(entered.unwrap_or(from))),
                _ => None,
            };
        }
        if let Some(from) = from {
            stretches.push((keys.clone(), from, *since, who.clone()));
        }
    }
    drop(state);
    for (keys, from, since, who) in stretches {
        let starved = now.saturating_duration_since(from);
        let allowed = world.history.allowance(from, now);
        if starved > STARVED && starved > STARVED + allowed {
            world.history.violation(format!(
                "liveness: {keys:?} all free in Redis for {starved:?}, entered by nobody, while \
                 the set {who} waited for them (since {:?} ago; {allowed:?} of it in faults or \
                 stalls)",
                since.elapsed()
            ));
            for key in &keys {
                free.remove(key.as_str());
            }
        }
    }
}
