//! Elections, and holds taken away from their holders.

use std::time::{Duration, Instant};

use distlock::{LockError, LockGuard, LockManager};

use super::checker::push_recent;
use super::model::{KEYS, Kind};
use super::steps::{Plan, expected, leave, take, work};
use super::world::World;

/// Campaigns in the election named after `plan.key`, leads for a moment and resigns (or drops
/// the leadership): the election's lock is checked for overlap like any other, and its terms
/// must grow from leader to leader.
pub(super) async fn elect(
    world: &World,
    locks: &LockManager,
    who: &str,
    plan: Plan,
    rng: &mut fastrand::Rng,
    faults: bool,
) {
    let election = locks
        .election(plan.key)
        .ttl(plan.ttl)
        .wait(plan.wait.unwrap_or(Duration::from_millis(100)));
    let asked = Instant::now();
    let leadership = match world.bounded("campaign", election.campaign()).await {
        Some(Ok(leadership)) => leadership,
        Some(Err(error)) if !expected(&error, faults) => {
            world
                .history
                .violation(format!("error: campaign: unexpected {error:?}"));
            return;
        }
        _ => return,
    };
    let key = format!("election:{}", plan.key);
    let guard = leadership.guard();
    let entry = (world.history).enter(who, &key, Kind::Exclusive, guard, asked);
    let term = leadership.term();
    world.history.term(who, &key, term, asked);
    work(leadership.guard(), &entry, rng).await;
    drop(entry);
    if rng.u8(..4) == 0 {
        drop(leadership);
    } else if let Some(Err(error)) = world.bounded("resign", leadership.resign()).await
        && !expected(&error, faults)
    {
        world
            .history
            .violation(format!("error: resign: unexpected {error:?}"));
    }
    // Marked after the release was sent (a dropped leadership's is on its way): a candidate
    // that begins to campaign from here on must draw a larger term.
    world.history.left(&key, term);
}

/// Takes an exclusive or write lock with a short lease, has it taken away (a forced release
/// through the inspector, a `DEL`, or a pause past the lease), and checks that the robbed
/// holder learns of it and changes nothing any more.
pub(super) async fn robbed(
    world: &World,
    locks: &LockManager,
    who: &str,
    plan: Plan,
    rng: &mut fastrand::Rng,
    faults: bool,
) {
    let kind = if world.features.shared_kinds && rng.bool() {
        Kind::Write
    } else {
        Kind::Exclusive
    };
    let plan = Plan {
        kind,
        ttl: Duration::from_millis(rng.u64(150..400)),
        wait: Some(Duration::from_millis(rng.u64(1..300))),
        min_hold: None,
        fair: false,
        // Inside a scope: an acquire nested in the robbed hold asks for the same owner.
        reentrant: true,
        downgrade: false,
        ..plan
    };
    let Some((guard, entry)) = take(world, locks, who, plan, faults).await else {
        return;
    };
    // A task of the same manager waits behind the holder; the steal must wake it.
    let behind = rng
        .bool()
        .then(|| waiter_behind(world, locks, who, plan, faults));
    // A forced release removes whatever holds the key: under faults the robbed lease may
    // have run out already, and another holder would be robbed instead.
    let how = match (faults, plan.watchdog) {
        (true, true) => 1,
        (true, false) => 1 + rng.u8(..2),
        (false, true) => rng.u8(..2),
        (false, false) => rng.u8(..3),
    };
    let sent = Instant::now();
    let stolen = match how {
        0 => {
            // Out of the history first: whoever enters after the steal is no overlap.
            drop(entry);
            matches!(
                world
                    .bounded("force_release", locks.force_release(plan.key))
                    .await,
                Some(Ok(Some(_)))
            )
        }
        1 => {
            drop(entry);
            let lock = locks.redis_key(plan.key);
            world
                .probe
                .steal(&lock, &format!("{lock}:wake"), guard.token())
                .await
        }
        _ => {
            // A pause past the lease: the key expires under its holder.
            tokio::time::sleep(guard.ttl() + Duration::from_millis(20)).await;
            drop(entry);
            true
        }
    };
    // The steal's round trip (the lease's end's: a probe's).
    let round_trip = match how {
        0 | 1 => sent.elapsed(),
        _ => {
            let sent = Instant::now();
            let _ = world.probe.pttl(&locks.redis_key(plan.key)).await;
            sent.elapsed()
        }
    };
    if !stolen {
        // The steal did not happen (a fault, or the lock was already gone): leave quietly.
        let _ = world.bounded("release", guard.release()).await;
        join_behind(world, behind).await;
        return;
    }
    {
        let mut state = world.history.lock();
        state.steals += 1;
        state
            .robbed
            .insert(guard.token().to_owned(), (Instant::now(), round_trip));
        let event = format!("{:?} {who} robbed of {} ({how})", Instant::now(), plan.key);
        push_recent(&mut state, event);
    }
    // Someone else may take the lock meanwhile.
    tokio::time::sleep(Duration::from_millis(rng.u64(0..30))).await;
    if rng.bool() {
        nested_in_robbed(world, locks, who, plan, rng, faults).await;
    }
    after_the_steal(world, who, plan, guard, rng, faults).await;
    join_behind(world, behind).await;
}

/// What the robbed holder may still do: its `extend`, `is_held` and (without faults)
/// `release` must not succeed, and its `lost()` must fire.
async fn after_the_steal(
    world: &World,
    who: &str,
    plan: Plan,
    guard: LockGuard,
    rng: &mut fastrand::Rng,
    faults: bool,
) {
    if rng.bool()
        && let Some(Ok(())) = world
            .bounded(
                "extend",
                guard.extend(Duration::from_millis(rng.u64(100..3_000))),
            )
            .await
    {
        world.history.violation(format!(
            "steal: {who}'s extend of {} succeeded after the lock was taken away",
            plan.key
        ));
    }
    if rng.bool()
        && let Some(Ok(true)) = world.bounded("is_held", guard.is_held()).await
    {
        world.history.violation(format!(
            "steal: {who}'s is_held on {} said yes after the lock was taken away",
            plan.key
        ));
    }
    // The loss shows, with the watchdog at its next renewal, without it when the lease ends.
    if rng.bool() {
        let bound = guard.ttl() * 2 + Duration::from_secs(2);
        if tokio::time::timeout(bound, guard.lost()).await.is_err() {
            world.history.violation(format!(
                "steal: {who}'s lost() on {} did not fire within {bound:?} of the lock being taken away",
                plan.key
            ));
        }
    }
    match rng.u8(..3) {
        0 => drop(guard),
        _ => {
            // A release that passes the (robbed) hold to a task of the same manager waits
            // for the run's check, which finds it gone.
            if let Some(Ok(())) = world.bounded("release", guard.release()).await
                && !faults
            {
                world.history.violation(format!(
                    "steal: {who}'s release of {} succeeded after the lock was taken away",
                    plan.key
                ));
            }
        }
    }
}

/// A task of the robbed holder's own manager that waits for the key meanwhile, patient and
/// (without faults) with a long fallback timer: the liveness monitor holds it to its bound
/// once the key is free, after a forced release or a `DEL` as after any release.
fn waiter_behind(
    world: &World,
    locks: &LockManager,
    who: &str,
    plan: Plan,
    faults: bool,
) -> tokio::task::JoinHandle<()> {
    let waiter = Plan {
        kind: Kind::Exclusive,
        ttl: Duration::from_millis(400),
        wait: Some(Duration::from_millis(1_500)),
        fencing: false,
        watchdog: false,
        min_hold: None,
        reentrant: false,
        fair: false,
        downgrade: false,
        retry_delay: Duration::from_millis(if faults { 2 } else { 300 }),
        ..plan
    };
    let (world, locks, who) = (world.clone(), locks.clone(), format!("{who}/behind"));
    tokio::spawn(async move {
        let mut rng = fastrand::Rng::with_seed(u64::from(plan.key.as_bytes()[0]));
        if let Some((guard, entry)) = take(&world, &locks, &who, waiter, faults).await {
            leave(&world, guard, entry, &mut rng, faults).await;
        }
    })
}

async fn join_behind(world: &World, behind: Option<tokio::task::JoinHandle<()>>) {
    if let Some(behind) = behind {
        let _ = world.bounded("waiter behind a robbed holder", behind).await;
    }
}

/// An acquire nested in the robbed hold (a single lock of its key, or a set naming it): the
/// hold is gone, so the answer must be a refusal, `LockError::Lost` (under faults, a Redis
/// error may come first).
async fn nested_in_robbed(
    world: &World,
    locks: &LockManager,
    who: &str,
    plan: Plan,
    rng: &mut fastrand::Rng,
    faults: bool,
) {
    let answer = if rng.bool() {
        let nested = plan.request(locks).wait(Duration::from_millis(20));
        let answer = world.bounded("nested acquire", nested.acquire()).await;
        answer.map(|answer| answer.map(|guard| format!("granted {:?}", guard.key())))
    } else {
        let other = KEYS[(KEYS.iter().position(|k| *k == plan.key).unwrap_or(0) + 1) % KEYS.len()];
        let set = locks
            .lock_all([plan.key, other])
            .reentrant(true)
            .wait(Duration::from_millis(20));
        let answer = world.bounded("nested set", set.acquire()).await;
        answer.map(|answer| answer.map(|guard| format!("granted the set {:?}", guard.keys())))
    };
    match answer {
        None | Some(Err(LockError::Lost { .. })) => {}
        Some(Err(LockError::Redis { .. })) if faults => {}
        Some(other) => world.history.violation(format!(
            "lost: {who}'s acquire nested in its robbed hold of {} answered {other:?}, not \
             LockError::Lost",
            plan.key
        )),
    }
}
