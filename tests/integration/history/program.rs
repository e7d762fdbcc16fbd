//! One task's program: random operations, each a step of `steps.rs`, a set program
//! (`sets.rs`), a steal or an election (`steals.rs`).

use std::time::{Duration, Instant};

use distlock::LockManager;

use super::model::Kind;
use super::sets::sets;
use super::steals::{elect, robbed};
use super::steps::{Plan, annotated, expected, leave, shut_down_a_runtime, take, work};
use super::world::World;

/// One task's program: `ops` random operations.
pub(super) async fn program(
    world: World,
    locks: LockManager,
    who: String,
    seed: u64,
    ops: u32,
    faults: bool,
) {
    let mut rng = fastrand::Rng::with_seed(seed);
    for _ in 0..ops {
        // Now and then a set of keys, among the single holds of the same keys.
        if rng.u8(..6) == 0 {
            sets(&world, &locks, &who, &mut rng, faults).await;
            continue;
        }
        let mut plan = Plan::random(&mut rng, world.features);
        if !faults
            && plan
                .wait
                .is_some_and(|wait| wait >= Duration::from_millis(300))
        {
            plan.retry_delay = Duration::from_millis(300);
        }
        match rng.u8(..100) {
            // A hold taken away from its holder.
            0..=4 => distlock::scope(robbed(&world, &locks, &who, plan, &mut rng, faults)).await,
            // An election: one leader at a time, each term larger than the last.
            40..=44 if world.features.fencing => {
                elect(&world, &locks, &who, plan, &mut rng, faults).await;
            }
            // A plain hold, maybe extended.
            5..=44 => {
                if let Some((guard, entry)) = take(&world, &locks, &who, plan, faults).await {
                    work(&guard, &entry, &mut rng).await;
                    if rng.u8(..4) == 0 {
                        let ttl = Duration::from_millis(rng.u64(1..3_000));
                        entry.extended(&guard, ttl);
                        if let Some(Err(error)) = world.bounded("extend", guard.extend(ttl)).await
                            && !expected(&error, faults)
                        {
                            world
                                .history
                                .violation(format!("error: extend: unexpected {error:?}"));
                        }
                        entry.refresh(&guard);
                        world.check_lease(&locks, plan.key, plan.kind, &guard).await;
                    }
                    leave(&world, guard, entry, &mut rng, faults).await;
                }
            }
            // Nested holds in one scope, released in a random order.
            45..=59 => {
                let nested_kind = match plan.kind {
                    Kind::Write if rng.bool() => Kind::Read, // downgrade
                    other => other,
                };
                distlock::scope(async {
                    let outer = Plan {
                        reentrant: true,
                        ..plan
                    };
                    let Some((guard, entry)) = take(&world, &locks, &who, outer, faults).await
                    else {
                        return;
                    };
                    let inner = Plan {
                        kind: nested_kind,
                        downgrade: nested_kind != plan.kind,
                        reentrant: true,
                        min_hold: None,
                        fair: plan.fair && nested_kind == plan.kind,
                        ..plan
                    };
                    let nested = take(&world, &locks, &who, inner, faults).await;
                    work(&guard, &entry, &mut rng).await;
                    match nested {
                        Some((inner_guard, inner_entry)) if rng.bool() => {
                            leave(&world, guard, entry, &mut rng, faults).await;
                            leave(&world, inner_guard, inner_entry, &mut rng, faults).await;
                        }
                        Some((inner_guard, inner_entry)) => {
                            leave(&world, inner_guard, inner_entry, &mut rng, faults).await;
                            leave(&world, guard, entry, &mut rng, faults).await;
                        }
                        None => leave(&world, guard, entry, &mut rng, faults).await,
                    }
                })
                .await;
            }
            // Sibling futures of one task, each in its own scope: separate owners.
            60..=69 => {
                let other = Plan::random(&mut rng, world.features);
                let (mut left_rng, mut right_rng) = (rng.fork(), rng.fork());
                let (world_l, world_r) = (world.clone(), world.clone());
                let (locks_l, locks_r) = (locks.clone(), locks.clone());
                let (who_l, who_r) = (format!("{who}/left"), format!("{who}/right"));
                let left = distlock::scope(async move {
                    if let Some((g, e)) = take(&world_l, &locks_l, &who_l, plan, faults).await {
                        work(&g, &e, &mut left_rng).await;
                        leave(&world_l, g, e, &mut left_rng, faults).await;
                    }
                });
                let right = distlock::scope(async move {
                    let plan = Plan {
                        key: plan.key,
                        ..other
                    };
                    if let Some((g, e)) = take(&world_r, &locks_r, &who_r, plan, faults).await {
                        work(&g, &e, &mut right_rng).await;
                        leave(&world_r, g, e, &mut right_rng, faults).await;
                    }
                });
                tokio::join!(left, right);
            }
            // Annotated calls re-entering themselves, and siblings of them.
            70..=77 => {
                let depth = rng.u32(..3);
                let results = if rng.bool() {
                    let alone = annotated(&locks, &world, plan.key, depth, Instant::now());
                    vec![world.bounded("annotated", alone).await]
                } else {
                    let both = async {
                        tokio::join!(
                            annotated(&locks, &world, plan.key, depth, Instant::now()),
                            annotated(&locks, &world, plan.key, 0, Instant::now())
                        )
                    };
                    let (a, b) = world.bounded("annotated siblings", both).await.unzip();
                    vec![a, b]
                };
                for error in results.into_iter().flatten().filter_map(Result::err) {
                    if !expected(&error, faults) {
                        world
                            .history
                            .violation(format!("error: annotated: unexpected {error:?}"));
                    }
                }
            }
            // An acquisition cancelled at a random point.
            78..=85 => {
                let cancel_after = Duration::from_micros(rng.u64(0..3_000));
                let request = plan.request(&locks).wait(Duration::from_millis(50));
                let asked = Instant::now();
                if let Ok(Ok(guard)) = tokio::time::timeout(cancel_after, request.acquire()).await {
                    let entry = (world.history).enter(&who, plan.key, plan.kind, &guard, asked);
                    leave(&world, guard, entry, &mut rng, faults).await;
                }
            }
            // A body that panics while holding the lock.
            86..=91 => {
                let (world2, locks2, who2) = (world.clone(), locks.clone(), who.clone());
                let holder = tokio::spawn(async move {
                    let held = take(&world2, &locks2, &who2, plan, faults).await;
                    if let Some((_guard, _entry)) = held {
                        panic!("a body panics while holding {}", plan.key);
                    }
                });
                let _ = world.bounded("panicking holder", holder).await;
            }
            // A lease held past its TTL by the watchdog.
            92..=96 => {
                let plan = Plan {
                    ttl: Duration::from_millis(150),
                    watchdog: true,
                    ..plan
                };
                if let Some((guard, entry)) = take(&world, &locks, &who, plan, faults).await {
                    for _ in 0..rng.u8(1..5) {
                        tokio::time::sleep(Duration::from_millis(40)).await;
                        entry.refresh(&guard);
                        world.check_lease(&locks, plan.key, plan.kind, &guard).await;
                    }
                    leave(&world, guard, entry, &mut rng, faults).await;
                }
            }
            // A runtime shut down while its tasks hold locks.
            _ => shut_down_a_runtime(&world, &locks, &who, plan, faults).await,
        }
    }
}
