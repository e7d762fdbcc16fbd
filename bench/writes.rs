//! The bench's "writes under a held lock" table: a plain `SET` through a raw connection
//! beside the same `SET` as a guarded write (the owner check and the write in one script,
//! one round trip), by tasks that each write in turn for the row's time.

use std::time::{Duration, Instant};

use distlock::LockManager;
use distlock::testing::RedisServer;

/// `cmdstat_<name>` calls the server has answered so far.
fn calls(server: &RedisServer, name: &str) -> u64 {
    let info = server
        .command(&["INFO", "commandstats"])
        .unwrap_or_default();
    let prefix = format!("cmdstat_{name}:calls=");
    info.lines()
        .find_map(|line| line.strip_prefix(prefix.as_str()))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Writes by `tasks` tasks for `run`, each task's next write after its last: writes done.
async fn drive<F, Fut>(tasks: usize, run: Duration, write: F) -> u64
where
    F: Fn(usize, u64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let until = Instant::now() + run;
    let mut set = tokio::task::JoinSet::new();
    for task in 0..tasks {
        let write = write.clone();
        set.spawn(async move {
            let mut done = 0;
            while Instant::now() < until {
                write(task, done).await;
                done += 1;
            }
            done
        });
    }
    set.join_all().await.into_iter().sum()
}

/// Prints the table.
pub(crate) async fn run(
    server: &RedisServer,
    locks: &LockManager,
    raw: &redis::aio::MultiplexedConnection,
    run: Duration,
) -> Result<(), Box<dyn std::error::Error>> {
    println!(
        "\nwrites under a held lock: a SET through a plain connection, and the same SET as a \
         guarded write (round trips per write counted by the server: SET or EVALSHA calls)"
    );
    println!(
        "{:>14} {:>6} {:>12} {:>12} {:>12}",
        "write", "tasks", "writes/s", "µs/write", "round trips"
    );
    for tasks in [1, 16] {
        let guards = futures_util::future::try_join_all(
            (0..tasks).map(|t| locks.lock(format!("w{t}")).watchdog(true).acquire()),
        )
        .await?;
        let keys: Vec<String> = guards.iter().map(|g| g.key_in_slot("v")).collect();

        let before = calls(server, "set");
        let (conn, plain_keys) = (raw.clone(), keys.clone());
        let started = Instant::now();
        let plain = drive(tasks, run, move |task, n| {
            let (mut conn, key) = (conn.clone(), plain_keys[task].clone());
            async move {
                let _: () = redis::cmd("SET")
                    .arg(&key)
                    .arg(n)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
            }
        })
        .await;
        row(
            "plain write",
            tasks,
            plain,
            started.elapsed(),
            calls(server, "set") - before,
        );

        let guards = std::sync::Arc::new(guards);
        let before = calls(server, "evalsha");
        let started = Instant::now();
        let shared = guards.clone();
        let guarded = drive(tasks, run, move |task, n| {
            let (guards, key) = (shared.clone(), keys[task].clone());
            async move {
                let _: (String,) = guards[task]
                    .guarded_write(redis::cmd("SET").arg(&key).arg(n))
                    .await
                    .unwrap();
            }
        })
        .await;
        let trips = calls(server, "evalsha") - before;
        row("guarded write", tasks, guarded, started.elapsed(), trips);
        if let Ok(guards) = std::sync::Arc::try_unwrap(guards) {
            for guard in guards {
                guard.release().await?;
            }
        }
    }
    Ok(())
}

fn row(name: &str, tasks: usize, writes: u64, took: Duration, trips: u64) {
    let rate = writes as f64 / took.as_secs_f64();
    println!(
        "{name:>14} {tasks:>6} {rate:>12.0} {:>12.1} {:>12.2}",
        tasks as f64 * 1e6 / rate.max(1.0),
        trips as f64 / writes.max(1) as f64
    );
}
