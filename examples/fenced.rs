//! The paused holder: a worker holds a lock, freezes past its lease (a long GC pause, a
//! stopped VM), another worker takes the lock and writes, then the first wakes up and writes
//! too. Its late write is refused by both stores: in Redis by a guarded write, which runs
//! only while the lock is held, and in PostgreSQL by a fenced transaction, which commits only
//! with the highest fencing token the database has seen.
//!
//! Run it with `cargo run --example fenced --features postgres`. It starts a throwaway
//! `redis-server` and a throwaway PostgreSQL (`initdb` and `postgres` on `PATH` or under
//! `/usr/lib/postgresql/*/bin`).

use std::time::Duration;

use distlock::fence::postgres::{Fence, FenceError};
use distlock::testing::{PostgresServer, RedisServer};
use distlock::{LockGuard, LockManager};
use tokio_postgres::{Client, NoTls};

/// What became of each write of the story, in order.
#[derive(Debug, Default)]
pub struct Story {
    /// One line per write: who, which store, what happened.
    pub lines: Vec<String>,
    /// The value stored in Redis at the end.
    pub redis_value: String,
    /// The value stored in PostgreSQL at the end.
    pub sql_value: String,
}

/// Writes `who` to both stores under `guard`, and notes what happened.
async fn write_both(
    story: &mut Story,
    guard: &LockGuard,
    db: &mut Client,
    fence: &Fence,
    who: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let token = guard.fencing_token().unwrap_or(0);
    let mut pipe = redis::pipe();
    pipe.cmd("SET")
        .arg(guard.key_in_slot("owner"))
        .arg(who)
        .cmd("SET")
        .arg(guard.key_in_slot("fence"))
        .arg(token);
    let redis = match guard.guarded_write::<()>(&pipe).await {
        Ok(()) => "landed".to_owned(),
        Err(error) if error.is_lost() => format!("refused ({error})"),
        Err(error) => return Err(error.into()),
    };
    story
        .lines
        .push(format!("{who:<10} token {token}: redis {redis}"));

    let tx = db.transaction().await?;
    let sql = match fence.check_guard(&tx, guard).await {
        Ok(()) => {
            tx.execute("UPDATE accounts SET owner = $1 WHERE id = 1", &[&who])
                .await?;
            tx.commit().await?;
            "committed".to_owned()
        }
        // Returning drops the transaction: it rolls back.
        Err(error @ FenceError::Stale { .. }) => format!("refused ({error})"),
        Err(error) => return Err(error.into()),
    };
    story
        .lines
        .push(format!("{who:<10} token {token}: sql   {sql}"));
    Ok(())
}

async fn connect(conninfo: &str) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(conninfo, NoTls).await?;
    tokio::spawn(connection);
    Ok(client)
}

/// Plays the story against the Redis at `redis_url` and the PostgreSQL at `conninfo`.
pub async fn run(
    redis_url: &str,
    conninfo: &str,
    prefix: &str,
) -> Result<Story, Box<dyn std::error::Error>> {
    let build = || {
        LockManager::builder()
            .redis_url(redis_url)
            .key_prefix(prefix)
            .build()
    };
    let (paused, next) = (build().await?, build().await?);
    let (mut paused_db, mut next_db) = (connect(conninfo).await?, connect(conninfo).await?);
    let fence = Fence::new();
    fence.create_table(&paused_db).await?;
    paused_db
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS accounts (id int PRIMARY KEY, owner text NOT NULL);
             INSERT INTO accounts VALUES (1, '') ON CONFLICT DO NOTHING;",
        )
        .await?;
    let mut story = Story::default();

    // A short lease and no watchdog: nothing renews the lease while its holder is frozen.
    let stale = paused
        .lock("account:1")
        .ttl(Duration::from_millis(300))
        .watchdog(false)
        .fencing(true)
        .acquire()
        .await?;
    write_both(&mut story, &stale, &mut paused_db, &fence, "paused").await?;
    // The pause: the holder does nothing until its lease has run out.
    let _ = stale.lost().await;

    let current = next
        .lock("account:1")
        .fencing(true)
        .wait(Duration::from_secs(5))
        .acquire()
        .await?;
    write_both(&mut story, &current, &mut next_db, &fence, "next").await?;
    // The paused holder wakes up and writes as if it still held the lock.
    write_both(&mut story, &stale, &mut paused_db, &fence, "woken").await?;

    let get = redis::cmd("GET")
        .arg(current.key_in_slot("owner"))
        .to_owned();
    let (value,): (String,) = current.guarded_write(get).await?;
    story.redis_value = value;
    story.sql_value = next_db
        .query_one("SELECT owner FROM accounts WHERE id = 1", &[])
        .await?
        .get(0);
    current.release().await?;
    Ok(story)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let redis = RedisServer::start()?;
    let postgres = PostgresServer::start()?;
    let story = run(&redis.url(), &postgres.connection_string(), "fenced:").await?;
    for line in &story.lines {
        println!("{line}");
    }
    println!(
        "stored at the end: redis owner = {:?}, sql owner = {:?}",
        story.redis_value, story.sql_value
    );
    Ok(())
}
