//! Set programs: `lock_all` alone, inside holds and other sets, beside siblings, annotated,
//! cancelled, renewed and held by a panic.

use std::time::{Duration, Instant};

use distlock::{LockError, LockManager, MultiGuard, distributed_lock};

use super::entries::{SetEntry, SetHold};
use super::model::{Kind, OVERSTAY, OVERSTAY_FAULTS};
use super::steps::{Inside, Plan, SetPlan, expected, leave, take, work};
use super::world::World;

/// Takes the set `plan` inside the holds `inside`; on success the caller is inside every key.
pub(super) async fn take_set(
    world: &World,
    locks: &LockManager,
    who: &str,
    plan: &SetPlan,
    inside: &[Inside],
    faults: bool,
) -> Option<(MultiGuard, SetEntry)> {
    let keys = plan.keys();
    // Keys held already are nested holds, granted (or refused) at once: the set waits for the
    // others, all free at once.
    let fresh: Vec<&'static str> = keys
        .iter()
        .copied()
        .filter(|&key| inside.iter().all(|held| held.key != key))
        .collect();
    let attempt = plan.request(locks);
    let asked = Instant::now();
    let result = if let Some(wait) = plan.wait {
        let waiting = (!fresh.is_empty())
            .then(|| world.history.waits_all(&format!("{who} {plan:?}"), &fresh));
        let result = world.bounded("acquire of a set", attempt.acquire()).await;
        drop(waiting);
        let took = asked.elapsed();
        let overstay = if faults { OVERSTAY_FAULTS } else { OVERSTAY };
        if took > wait + overstay {
            world.history.violation(format!(
                "wait: {who}'s acquire of {keys:?} with a wait of {wait:?} took {took:?}"
            ));
        }
        result?.map(Some)
    } else {
        world
            .bounded("try_acquire of a set", attempt.try_acquire())
            .await?
    };
    match result {
        Ok(Some(guard)) => {
            if guard.keys() != keys {
                world.history.violation(format!(
                    "set: {who} asked for {:?} and holds {:?}",
                    plan.names,
                    guard.keys()
                ));
            }
            let entry = enter_set(world, who, &keys, inside, &guard, asked);
            world.check_set_lease(locks, &fresh, &guard).await;
            Some((guard, entry))
        }
        Ok(None) => None,
        Err(error) => {
            if !expected(&error, faults) {
                world
                    .history
                    .violation(format!("error: {who} {plan:?}: unexpected {error:?}"));
            }
            None
        }
    }
}

/// Records the set `guard` of `keys`, taken inside `inside`: a key held there is re-entered
/// (its outer hold's owner holds it), every other key is an exclusive hold of the set's token.
/// `asked`: when the request was made.
pub(super) fn enter_set(
    world: &World,
    who: &str,
    keys: &[&'static str],
    inside: &[Inside],
    guard: &MultiGuard,
    asked: Instant,
) -> SetEntry {
    let holds: Vec<SetHold> = keys
        .iter()
        .map(|&key| match inside.iter().find(|held| held.key == key) {
            Some(outer) => SetHold {
                key,
                owner: outer.owner.clone(),
                passes: outer.passes,
                kind: outer.kind,
            },
            None => SetHold {
                key,
                owner: guard.token().to_owned(),
                passes: 0,
                kind: Kind::Exclusive,
            },
        })
        .collect();
    world.history.enter_set(who, &holds, guard, asked)
}

/// Leaves a set: the exits are recorded, then the guard released (or dropped, or its release
/// cancelled after a random time).
pub(super) async fn leave_set(
    world: &World,
    guard: MultiGuard,
    entry: SetEntry,
    rng: &mut fastrand::Rng,
    faults: bool,
) {
    drop(entry);
    match rng.u8(..10) {
        0..=5 => {
            if let Some(Err(error)) = world.bounded("release of a set", guard.release()).await
                && !expected(&error, faults)
            {
                world
                    .history
                    .violation(format!("error: release of a set: unexpected {error:?}"));
            }
        }
        6 | 7 => drop(guard),
        _ => {
            let cancel_after = Duration::from_micros(rng.u64(0..2_000));
            let _ = tokio::time::timeout(cancel_after, guard.release()).await;
        }
    }
}

/// A set's critical section: a short random pause, refreshing the bounds on the way, and
/// now and then an extend.
pub(super) async fn work_set(
    world: &World,
    locks: &LockManager,
    guard: &MultiGuard,
    entry: &SetEntry,
    rng: &mut fastrand::Rng,
    faults: bool,
) {
    for _ in 0..rng.u8(..3) {
        tokio::time::sleep(Duration::from_micros(rng.u64(0..3_000))).await;
        entry.refresh(guard);
    }
    if rng.u8(..4) == 0 {
        let ttl = Duration::from_millis(rng.u64(1..3_000));
        entry.extended(ttl);
        if let Some(Err(error)) = world.bounded("extend of a set", guard.extend(ttl)).await
            && !expected(&error, faults)
        {
            world
                .history
                .violation(format!("error: extend of a set: unexpected {error:?}"));
        }
        entry.refresh(guard);
        world.check_set_lease(locks, &entry.own_keys, guard).await;
    }
}

#[distributed_lock(keys = ["{first}", "{second}"], ttl = "2s", retries = 50, retry_delay = "2ms",
    wait = "300ms", reentrant, guard = guard, manager = locks)]
pub(super) async fn annotated_set(
    locks: &LockManager,
    world: &World,
    first: &'static str,
    second: &'static str,
    inside: &[Inside],
    depth: u32,
    asked: Instant,
) -> Result<(), LockError> {
    let keys = [first, second];
    let _entry = enter_set(world, "annotated set", &keys, inside, guard, asked);
    if depth > 0 {
        // Re-enters its own locks: nested holds of the same owners.
        let inside = Inside::and_set(inside, guard, &keys);
        Box::pin(annotated_set(
            locks,
            world,
            first,
            second,
            &inside,
            depth - 1,
            asked,
        ))
        .await?;
    }
    tokio::task::yield_now().await;
    Ok(())
}

/// Sets of 2–4 keys among the single holds on the same keys: alone, inside single holds and
/// other sets (re-entering the keys they share), with single holds inside them, beside
/// sibling holds, annotated, cancelled while they wait, renewed past their lease, and held by
/// a body that panics.
pub(super) async fn sets(
    world: &World,
    locks: &LockManager,
    who: &str,
    rng: &mut fastrand::Rng,
    faults: bool,
) {
    let plan = SetPlan::random(rng, world.features, faults);
    match rng.u8(..12) {
        0 | 1 => set_alone(world, locks, who, &plan, rng, faults).await,
        3 => set_inside_a_hold(world, locks, who, plan, rng, faults).await,
        2 | 4 => hold_inside_a_set(world, locks, who, plan, rng, faults).await,
        5 => set_inside_a_set(world, locks, who, plan, rng, faults).await,
        6 => set_beside_a_sibling(world, locks, who, &plan, rng, faults).await,
        7 => annotated_sets(world, locks, who, &plan, rng, faults).await,
        8 => set_cancelled(world, locks, who, &plan, rng, faults).await,
        9 | 10 => set_renewed(world, locks, who, plan, rng, faults).await,
        _ => set_held_by_a_panic(world, locks, who, plan, faults).await,
    }
}

/// A set alone, maybe extended.
pub(super) async fn set_alone(
    world: &World,
    locks: &LockManager,
    who: &str,
    plan: &SetPlan,
    rng: &mut fastrand::Rng,
    faults: bool,
) {
    if let Some((guard, entry)) = take_set(world, locks, who, plan, &[], faults).await {
        work_set(world, locks, &guard, &entry, rng, faults).await;
        leave_set(world, guard, entry, rng, faults).await;
    }
}

/// A set inside a single hold, mostly of one of its keys (re-entered: a nested hold of the
/// single lock, or refused when either is not reentrant or the hold is shared); released in a
/// random order.
pub(super) async fn set_inside_a_hold(
    world: &World,
    locks: &LockManager,
    who: &str,
    plan: SetPlan,
    rng: &mut fastrand::Rng,
    faults: bool,
) {
    let keys = plan.keys();
    let mut outer = Plan::random(rng, world.features);
    outer.reentrant = rng.u8(..8) != 0;
    if rng.u8(..4) != 0 {
        outer.key = keys[rng.usize(..keys.len())];
    }
    let plan = SetPlan {
        reentrant: rng.u8(..8) != 0,
        ..plan
    };
    distlock::scope(async {
        let Some((guard, entry)) = take(world, locks, who, outer, faults).await else {
            return;
        };
        let inside = [Inside::single(outer.key, outer.held_as(), &guard)];
        let set = take_set(world, locks, who, &plan, &inside, faults).await;
        work(&guard, &entry, rng).await;
        match set {
            Some((set, set_entry)) if rng.bool() => {
                leave(world, guard, entry, rng, faults).await;
                leave_set(world, set, set_entry, rng, faults).await;
            }
            Some((set, set_entry)) => {
                leave_set(world, set, set_entry, rng, faults).await;
                leave(world, guard, entry, rng, faults).await;
            }
            None => leave(world, guard, entry, rng, faults).await,
        }
    })
    .await;
}

/// A single hold inside a set, mostly of one of its keys (a nested hold of the set's lock, a
/// read one a downgrade); released in a random order.
pub(super) async fn hold_inside_a_set(
    world: &World,
    locks: &LockManager,
    who: &str,
    plan: SetPlan,
    rng: &mut fastrand::Rng,
    faults: bool,
) {
    let keys = plan.keys();
    let plan = SetPlan {
        reentrant: rng.u8(..8) != 0,
        ..plan
    };
    let mut inner = Plan::random(rng, world.features);
    if rng.u8(..4) != 0 {
        inner.key = keys[rng.usize(..keys.len())];
    }
    let reentered = keys.contains(&inner.key);
    // A hold nested in the set's exclusive lock may ask for a `min_hold`: the key must stay
    // held that long, past the set's release (see `History::min_hold`).
    let min_hold = (reentered && rng.u8(..4) != 0).then(|| Duration::from_millis(rng.u64(20..120)));
    if min_hold.is_some() {
        inner.kind = Kind::Exclusive;
    }
    let inner = Plan {
        reentrant: rng.u8(..8) != 0,
        min_hold: min_hold.or(inner.min_hold.filter(|_| !reentered)),
        fair: inner.fair && !reentered && min_hold.is_none(),
        downgrade: reentered && inner.kind == Kind::Read,
        ..inner
    };
    distlock::scope(async {
        let asked = Instant::now();
        let Some((set, set_entry)) = take_set(world, locks, who, &plan, &[], faults).await else {
            return;
        };
        let nested = take(world, locks, who, inner, faults).await;
        if let (Some((guard, _)), Some(min_hold), true) = (&nested, min_hold, inner.reentrant) {
            // Counted from before the set was asked for: no later than the server's own count.
            let kept = min_hold.min(inner.ttl).min(set.ttl());
            world
                .history
                .min_hold(inner.key, guard.token(), asked + kept);
        }
        work_set(world, locks, &set, &set_entry, rng, faults).await;
        match nested {
            Some((guard, entry)) if rng.bool() => {
                leave_set(world, set, set_entry, rng, faults).await;
                leave(world, guard, entry, rng, faults).await;
            }
            Some((guard, entry)) => {
                leave(world, guard, entry, rng, faults).await;
                leave_set(world, set, set_entry, rng, faults).await;
            }
            None => leave_set(world, set, set_entry, rng, faults).await,
        }
    })
    .await;
}

/// A set inside a set: the keys they share are nested holds of the outer set; released in a
/// random order.
pub(super) async fn set_inside_a_set(
    world: &World,
    locks: &LockManager,
    who: &str,
    plan: SetPlan,
    rng: &mut fastrand::Rng,
    faults: bool,
) {
    let keys = plan.keys();
    let plan = SetPlan {
        reentrant: rng.u8(..8) != 0,
        ..plan
    };
    let inner = SetPlan {
        reentrant: rng.u8(..8) != 0,
        ..SetPlan::random(rng, world.features, faults)
    };
    distlock::scope(async {
        let Some((outer, outer_entry)) = take_set(world, locks, who, &plan, &[], faults).await
        else {
            return;
        };
        let inside = Inside::and_set(&[], &outer, &keys);
        let set = take_set(world, locks, who, &inner, &inside, faults).await;
        work_set(world, locks, &outer, &outer_entry, rng, faults).await;
        match set {
            Some((set, set_entry)) if rng.bool() => {
                leave_set(world, outer, outer_entry, rng, faults).await;
                leave_set(world, set, set_entry, rng, faults).await;
            }
            Some((set, set_entry)) => {
                leave_set(world, set, set_entry, rng, faults).await;
                leave_set(world, outer, outer_entry, rng, faults).await;
            }
            None => leave_set(world, outer, outer_entry, rng, faults).await,
        }
    })
    .await;
}

/// Sibling futures of one task, each in its own scope: a set beside a single hold of one of
/// its keys or beside another set, separate owners that exclude each other.
pub(super) async fn set_beside_a_sibling(
    world: &World,
    locks: &LockManager,
    who: &str,
    plan: &SetPlan,
    rng: &mut fastrand::Rng,
    faults: bool,
) {
    let keys = plan.keys();
    let (mut left_rng, mut right_rng) = (rng.fork(), rng.fork());
    let mut single = Plan::random(rng, world.features);
    single.key = keys[rng.usize(..keys.len())];
    let other = rng
        .bool()
        .then(|| SetPlan::random(rng, world.features, faults));
    let (who_l, who_r) = (format!("{who}/left"), format!("{who}/right"));
    let left = distlock::scope(async {
        if let Some((g, e)) = take_set(world, locks, &who_l, plan, &[], faults).await {
            work_set(world, locks, &g, &e, &mut left_rng, faults).await;
            leave_set(world, g, e, &mut left_rng, faults).await;
        }
    });
    let right = distlock::scope(async {
        if let Some(other) = &other {
            if let Some((g, e)) = take_set(world, locks, &who_r, other, &[], faults).await {
                work_set(world, locks, &g, &e, &mut right_rng, faults).await;
                leave_set(world, g, e, &mut right_rng, faults).await;
            }
        } else if let Some((g, e)) = take(world, locks, &who_r, single, faults).await {
            work(&g, &e, &mut right_rng).await;
            leave(world, g, e, &mut right_rng, faults).await;
        }
    });
    tokio::join!(left, right);
}

/// An annotated set re-entering itself, maybe inside a single hold of one of its keys.
pub(super) async fn annotated_sets(
    world: &World,
    locks: &LockManager,
    who: &str,
    plan: &SetPlan,
    rng: &mut fastrand::Rng,
    faults: bool,
) {
    let keys = plan.keys();
    let (first, second) = (keys[0], keys[1]);
    let depth = rng.u32(..3);
    let mut outer = Plan::random(rng, world.features);
    outer.key = first;
    let outer = Plan {
        kind: Kind::Exclusive,
        reentrant: true,
        ..outer
    };
    let inside_a_hold = rng.bool();
    let result = distlock::scope(async {
        if !inside_a_hold {
            let asked = Instant::now();
            return Some(annotated_set(locks, world, first, second, &[], depth, asked).await);
        }
        let (guard, entry) = take(world, locks, who, outer, faults).await?;
        let inside = [Inside::single(first, Kind::Exclusive, &guard)];
        let call = annotated_set(locks, world, first, second, &inside, depth, Instant::now());
        let result = world.bounded("annotated set", call).await;
        leave(world, guard, entry, rng, faults).await;
        result
    });
    if let Some(Err(error)) = world.bounded("annotated set", result).await.flatten()
        && !expected(&error, faults)
    {
        world
            .history
            .violation(format!("error: annotated set: unexpected {error:?}"));
    }
}

/// A set's acquisition cancelled at a random point.
pub(super) async fn set_cancelled(
    world: &World,
    locks: &LockManager,
    who: &str,
    plan: &SetPlan,
    rng: &mut fastrand::Rng,
    faults: bool,
) {
    let cancel_after = Duration::from_micros(rng.u64(0..3_000));
    let request = plan.request(locks).wait(Duration::from_millis(50));
    let asked = Instant::now();
    if let Ok(Ok(guard)) = tokio::time::timeout(cancel_after, request.acquire()).await {
        let entry = enter_set(world, who, &plan.keys(), &[], &guard, asked);
        leave_set(world, guard, entry, rng, faults).await;
    }
}

/// A set held past its ttl by the watchdog: every lock of the set renewed.
pub(super) async fn set_renewed(
    world: &World,
    locks: &LockManager,
    who: &str,
    plan: SetPlan,
    rng: &mut fastrand::Rng,
    faults: bool,
) {
    let plan = SetPlan {
        ttl: Duration::from_millis(150),
        watchdog: true,
        ..plan
    };
    if let Some((guard, entry)) = take_set(world, locks, who, &plan, &[], faults).await {
        for _ in 0..rng.u8(1..5) {
            tokio::time::sleep(Duration::from_millis(40)).await;
            entry.refresh(&guard);
            world.check_set_lease(locks, &plan.keys(), &guard).await;
        }
        leave_set(world, guard, entry, rng, faults).await;
    }
}

/// A body that panics while holding a set.
pub(super) async fn set_held_by_a_panic(
    world: &World,
    locks: &LockManager,
    who: &str,
    plan: SetPlan,
    faults: bool,
) {
    let (world2, locks2, who2) = (world.clone(), locks.clone(), who.to_owned());
    let holder = tokio::spawn(async move {
        let held = take_set(&world2, &locks2, &who2, &plan, &[], faults).await;
        if let Some((_guard, _entry)) = held {
            panic!("a body panics while holding the set {:?}", plan.names);
        }
    });
    let _ = world.bounded("panicking holder of a set", holder).await;
}
