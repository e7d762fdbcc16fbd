//! Fenced writes to a real PostgreSQL: a stale holder's transaction never commits after a
//! newer holder's.

use distlock::LockManager;
use distlock::fence::postgres::{Fence, FenceError};
use distlock::testing::PostgresServer;
use tokio_postgres::{Client, NoTls};

use super::{short_hold, take_when_free};
use crate::support::{manager, shared_server, unique_prefix};

/// A client of `server`, its connection driven by a task of its own.
pub(super) async fn connect(server: &PostgresServer) -> Client {
    let (client, connection) = tokio_postgres::connect(&server.connection_string(), NoTls)
        .await
        .expect("connects to the test PostgreSQL");
    tokio::spawn(connection);
    client
}

/// A fence table and an `accounts` table with one row of balance 0.
pub(super) async fn setup(client: &Client) -> Fence {
    let fence = Fence::new();
    fence.create_table(client).await.unwrap();
    client
        .batch_execute(
            "CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL, last text);
             INSERT INTO accounts VALUES (1, 0, '');",
        )
        .await
        .unwrap();
    fence
}

/// One fenced transaction: the check, then `balance = value, last = who`.
async fn fenced_update(
    client: &mut Client,
    fence: &Fence,
    guard: &distlock::LockGuard,
    value: i64,
    who: &str,
) -> Result<(), FenceError> {
    let tx = client.transaction().await?;
    fence.check_guard(&tx, guard).await?;
    tx.execute(
        "UPDATE accounts SET balance = $1, last = $2 WHERE id = 1",
        &[&value, &who],
    )
    .await?;
    tx.commit().await?;
    Ok(())
}

async fn stored(client: &Client) -> (i64, String) {
    let row = client
        .query_one("SELECT balance, last FROM accounts WHERE id = 1", &[])
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

#[tokio::test]
async fn a_paused_holders_late_sql_write_is_refused_while_the_new_holders_landed() {
    let pg = PostgresServer::start().unwrap();
    let mut old_db = connect(&pg).await;
    let mut new_db = connect(&pg).await;
    let fence = setup(&old_db).await;
    let server = shared_server();
    let prefix = unique_prefix("fencing-pg");
    let (old, new): (LockManager, LockManager) = (
        manager(&server, &prefix).await,
        manager(&server, &prefix).await,
    );

    let stale = short_hold(&old, "acct").await;
    fenced_update(&mut old_db, &fence, &stale, 1, "old-early")
        .await
        .unwrap();
    assert!(stale.lost().await.is_lost());
    let current = take_when_free(&new, "acct").await;
    fenced_update(&mut new_db, &fence, &current, 2, "new")
        .await
        .unwrap();

    let late = fenced_update(&mut old_db, &fence, &stale, 3, "old-late").await;
    match late {
        Err(FenceError::Stale {
            resource,
            token,
            highest,
            ..
        }) => {
            assert_eq!(resource, "acct");
            assert_eq!(Some(token), stale.fencing_token());
            assert_eq!(Some(highest), current.fencing_token());
        }
        other => panic!("the stale write was not refused: {other:?}"),
    }
    assert_eq!(stored(&new_db).await, (2, "new".to_owned()));
    // The same holder may write again.
    fenced_update(&mut new_db, &fence, &current, 4, "new-again")
        .await
        .unwrap();
    assert_eq!(stored(&new_db).await, (4, "new-again".to_owned()));
    current.release().await.unwrap();
}

#[tokio::test]
async fn an_older_transaction_still_open_commits_before_the_newer_one_or_not_at_all() {
    let pg = PostgresServer::start().unwrap();
    let mut old_db = connect(&pg).await;
    let new_db = connect(&pg).await;
    let fence = setup(&old_db).await;

    // The older holder checked its token 5 and is paused inside its transaction.
    let old_tx = old_db.transaction().await.unwrap();
    fence.check(&old_tx, "acct", 5).await.unwrap();
    // The newer holder's check waits on the resource's row until the older one ends.
    let newer = tokio::spawn(async move {
        let mut new_db = new_db;
        let tx = new_db.transaction().await.unwrap();
        fence.check(&tx, "acct", 6).await.unwrap();
        tx.execute("UPDATE accounts SET last = 'new' WHERE id = 1", &[])
            .await
            .unwrap();
        tx.commit().await.unwrap();
        new_db
    });
    old_tx
        .execute("UPDATE accounts SET last = 'old' WHERE id = 1", &[])
        .await
        .unwrap();
    old_tx.commit().await.unwrap();
    let new_db = newer.await.unwrap();
    assert_eq!(
        stored(&new_db).await.1,
        "new",
        "the newer write commits last"
    );

    // Token 5 again, now below the accepted 6: refused.
    let tx = old_db.transaction().await.unwrap();
    let refused = Fence::new().check(&tx, "acct", 5).await;
    assert!(
        matches!(refused, Err(FenceError::Stale { highest: 6, .. })),
        "{refused:?}"
    );
}

#[tokio::test]
async fn a_guard_without_a_token_and_bad_names_are_refused() {
    assert!(matches!(
        Fence::with_table("x; DROP TABLE y"),
        Err(FenceError::InvalidInput { .. })
    ));
    assert_eq!(
        Fence::with_table("app.fences").unwrap().table(),
        "app.fences"
    );
    let pg = PostgresServer::start().unwrap();
    let mut db = connect(&pg).await;
    let fence = Fence::new();
    fence.create_table(&db).await.unwrap();
    let server = shared_server();
    let locks = manager(&server, &unique_prefix("fencing-pg-none")).await;
    let guard = locks.lock("acct").acquire().await.unwrap();
    let tx = db.transaction().await.unwrap();
    let refused = fence.check_guard(&tx, &guard).await;
    assert!(
        matches!(refused, Err(FenceError::NoToken { .. })),
        "{refused:?}"
    );
    drop(tx);
    guard.release().await.unwrap();
}

#[allow(dead_code, unreachable_pub)]
#[path = "../../../examples/fenced.rs"]
mod fenced;

#[tokio::test]
async fn the_fenced_example_refuses_the_woken_holders_writes() {
    let pg = PostgresServer::start().unwrap();
    let server = shared_server();
    let story = fenced::run(
        &server.url(),
        &pg.connection_string(),
        &unique_prefix("fencing-example"),
    )
    .await
    .unwrap();
    assert_eq!(story.redis_value, "next");
    assert_eq!(story.sql_value, "next");
    let woken: Vec<&String> = story
        .lines
        .iter()
        .filter(|l| l.starts_with("woken"))
        .collect();
    assert_eq!(woken.len(), 2, "{:?}", story.lines);
    assert!(
        woken.iter().all(|l| l.contains("refused")),
        "{:?}",
        story.lines
    );
}
