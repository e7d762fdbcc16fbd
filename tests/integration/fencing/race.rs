//! Holders race for one lock with random pauses past their leases and forced releases
//! (steals); every write goes both to Redis (guarded) and to PostgreSQL (fenced). The stored
//! histories never go back in fence order. Prints its seed; `DISTLOCK_SEED=<n>` replays it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use distlock::LockManager;
use distlock::fence::postgres::{Fence, FenceError};
use distlock::testing::PostgresServer;
use tokio_postgres::Client;

use super::postgres::connect;
use crate::support::{manager, shared_server, unique_prefix};

const TTL: Duration = Duration::from_millis(80);
const HOLDERS: usize = 4;
const ROUNDS: usize = 12;

#[derive(Default)]
struct Counts {
    redis_landed: AtomicU32,
    redis_refused: AtomicU32,
    sql_landed: AtomicU32,
    sql_refused: AtomicU32,
}

/// One fenced insert into the ledger: `Ok(false)` when the token was stale.
async fn ledger_write(db: &mut Client, fence: &Fence, token: u64) -> Result<bool, FenceError> {
    let tx = db.transaction().await?;
    match fence.check(&tx, "hot", token).await {
        Err(FenceError::Stale { .. }) => return Ok(false),
        other => other?,
    }
    let token = i64::try_from(token).unwrap();
    tx.execute("INSERT INTO ledger (token) VALUES ($1)", &[&token])
        .await?;
    tx.commit().await?;
    Ok(true)
}

async fn holder(
    locks: LockManager,
    mut db: Client,
    fence: Arc<Fence>,
    counts: Arc<Counts>,
    seed: u64,
) {
    let mut rng = fastrand::Rng::with_seed(seed);
    for round in 0..ROUNDS {
        let guard = locks
            .lock("hot")
            .ttl(TTL)
            .watchdog(false)
            .fencing(true)
            .wait(Duration::from_secs(20))
            .acquire()
            .await
            .unwrap();
        let token = guard.fencing_token().unwrap();
        // A pause, past the lease in the first round and in about a third of the others:
        // the lock may have passed on meanwhile (or been stolen).
        if round == 0 || rng.u8(..3) == 0 {
            tokio::time::sleep(TTL + Duration::from_millis(rng.u64(5..60))).await;
        } else {
            tokio::time::sleep(Duration::from_millis(rng.u64(0..10))).await;
        }
        if rng.u8(..6) == 0 {
            // A steal: the lock is removed under whoever holds it now.
            let _ = locks.force_release("hot").await;
        }
        let push = redis::cmd("RPUSH")
            .arg(guard.key_in_slot("history"))
            .arg(token)
            .to_owned();
        match guard.guarded_write::<(i64,)>(push).await {
            Ok(_) => counts.redis_landed.fetch_add(1, Ordering::Relaxed),
            Err(error) if error.is_lost() => counts.redis_refused.fetch_add(1, Ordering::Relaxed),
            Err(error) => panic!("guarded write failed: {error}"),
        };
        match ledger_write(&mut db, &fence, token).await.unwrap() {
            true => counts.sql_landed.fetch_add(1, Ordering::Relaxed),
            false => counts.sql_refused.fetch_add(1, Ordering::Relaxed),
        };
        let _ = guard.release().await;
    }
}

/// The first place where `history` goes back, if any.
fn regression(history: &[u64]) -> Option<(usize, u64, u64)> {
    history
        .windows(2)
        .enumerate()
        .find(|(_, pair)| pair[1] < pair[0])
        .map(|(at, pair)| (at + 1, pair[0], pair[1]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_holders_with_pauses_and_steals_never_go_back_in_fence_order() {
    let seed = match std::env::var("DISTLOCK_SEED") {
        Ok(seed) => seed.trim().parse().expect("DISTLOCK_SEED must be a number"),
        Err(_) => fastrand::u64(..),
    };
    println!("fencing race seed {seed} (replay with DISTLOCK_SEED={seed})");
    let pg = PostgresServer::start().unwrap();
    let setup = connect(&pg).await;
    let fence = Arc::new(Fence::new());
    fence.create_table(&setup).await.unwrap();
    setup
        .batch_execute("CREATE TABLE ledger (seq bigserial PRIMARY KEY, token bigint NOT NULL)")
        .await
        .unwrap();
    let server = shared_server();
    let prefix = unique_prefix("fencing-race");
    let counts = Arc::new(Counts::default());
    let mut tasks = Vec::new();
    for h in 0..HOLDERS {
        let locks = manager(&server, &prefix).await;
        let db = connect(&pg).await;
        let seed = seed ^ (h as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        tasks.push(tokio::spawn(holder(
            locks,
            db,
            fence.clone(),
            counts.clone(),
            seed,
        )));
    }
    for task in tasks {
        task.await.unwrap();
    }

    // Inserts into the ledger take the fence row's lock first, so `seq` is commit order.
    let sql: Vec<u64> = setup
        .query("SELECT token FROM ledger ORDER BY seq", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| u64::try_from(row.get::<_, i64>(0)).unwrap())
        .collect();
    let locks = manager(&server, &prefix).await;
    let guard = locks.lock("hot").acquire().await.unwrap();
    let range = redis::cmd("LRANGE")
        .arg(guard.key_in_slot("history"))
        .arg(0)
        .arg(-1)
        .to_owned();
    let (redis,): (Vec<u64>,) = guard.guarded_write(range).await.unwrap();
    guard.release().await.unwrap();

    let load = |n: &AtomicU32| n.load(Ordering::Relaxed);
    println!(
        "fencing race seed {seed}: redis {} landed / {} refused, sql {} landed / {} refused",
        load(&counts.redis_landed),
        load(&counts.redis_refused),
        load(&counts.sql_landed),
        load(&counts.sql_refused),
    );
    assert_eq!(
        redis.len() as u32,
        load(&counts.redis_landed),
        "seed {seed}"
    );
    assert_eq!(sql.len() as u32, load(&counts.sql_landed), "seed {seed}");
    assert!(
        load(&counts.redis_refused) > 0,
        "seed {seed}: no holder wrote after its lease, so nothing was tested"
    );
    assert_eq!(
        regression(&redis),
        None,
        "redis history went back (seed {seed})"
    );
    assert_eq!(
        regression(&sql),
        None,
        "sql history went back (seed {seed})"
    );
}
