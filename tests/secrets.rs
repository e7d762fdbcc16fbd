//! No password (nor key material) ever shows in `Debug`, `Display`, errors or tracing output.

mod support;

use std::error::Error as _;
use std::sync::OnceLock;
use std::time::Duration;

use distlock::testing::RedisServer;
use distlock::{LockError, LockManager, LockManagerBuilder};
use support::logs::Logs;

const SECRET: &str = "Pa55-SECRET-word";
const WRONG: &str = "Wr0ng-SECRET-guess";
const KEY_MATERIAL: &str = "MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQg";

/// Everything logged by any thread of this test binary.
fn logs() -> &'static Logs {
    static LOGS: OnceLock<Logs> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Logs::default();
        tracing::subscriber::set_global_default(logs.clone()).expect("one global subscriber");
        logs
    })
}

fn quick(builder: LockManagerBuilder) -> LockManagerBuilder {
    builder
        .connect_timeout(Duration::from_millis(300))
        .response_timeout(Duration::from_millis(300))
}

/// Display and Debug of `error` and of every error it wraps.
fn render(error: &LockError) -> String {
    let mut text = format!("{error}\n{error:?}\n");
    let mut source = error.source();
    while let Some(inner) = source {
        text.push_str(&format!("{inner}\n{inner:?}\n"));
        source = inner.source();
    }
    text
}

async fn build_error(builder: LockManagerBuilder) -> String {
    match quick(builder).build().await {
        Ok(manager) => panic!("expected an error, built {manager:?}"),
        Err(error) => render(&error),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn no_secret_in_any_output() {
    let logs = logs();
    let mut seen = Vec::new();
    let server = RedisServer::start_with_password(SECRET).unwrap();
    let with_password = server.url();
    assert!(with_password.contains(SECRET));
    let pem = format!("-----BEGIN PRIVATE KEY-----\n{KEY_MATERIAL}\n-----END PRIVATE KEY-----\n");

    // builders
    for builder in [
        LockManager::builder().redis_url(&with_password),
        LockManager::builder().credentials("locker", SECRET),
        LockManager::builder().sentinel([format!("redis://:{SECRET}@127.0.0.1:1")], "mymaster"),
        LockManager::builder().redlock([&with_password, &with_password, &with_password]),
        LockManager::builder().cluster([&with_password]),
        LockManager::builder()
            .redis_url("rediss://127.0.0.1:1")
            .tls_client_certificate("cert", pem.clone()),
    ] {
        seen.push(format!("{builder:?}"));
    }

    // a working manager, its requests and guards, and what they log
    let locks = quick(LockManager::builder().redis_url(&with_password))
        .build()
        .await
        .unwrap();
    seen.push(format!("{locks:?}"));
    seen.push(format!(
        "{:?}",
        locks.lock("job").ttl(Duration::from_millis(200))
    ));
    let guard = locks
        .lock("job")
        .ttl(Duration::from_millis(200))
        .watchdog(true)
        .fencing(true)
        .acquire()
        .await
        .unwrap();
    seen.push(format!("{guard:?}"));
    tokio::time::sleep(Duration::from_millis(500)).await;
    guard.release().await.unwrap();
    let busy = locks.lock("busy").acquire().await.unwrap();
    let error = locks.lock("busy").retries(1).acquire().await.unwrap_err();
    seen.push(render(&error));
    busy.release().await.unwrap();

    // errors: bad URLs, refused connections, a wrong password, a missing permission
    let refused = format!("redis://user:{SECRET}@127.0.0.1:1");
    seen.push(build_error(LockManager::builder().redis_url(format!("http://u:{SECRET}@h"))).await);
    seen.push(
        build_error(LockManager::builder().redis_url(format!("redis://u:{SECRET}@h:port"))).await,
    );
    seen.push(build_error(LockManager::builder().redis_url(&refused)).await);
    seen.push(build_error(LockManager::builder().redlock([&refused, &refused, &refused])).await);
    seen.push(build_error(LockManager::builder().cluster([&refused])).await);
    seen.push(build_error(LockManager::builder().sentinel([&refused], "mymaster")).await);
    seen.push(build_error(LockManager::builder().redis_url(server.url_as("default", WRONG))).await);
    seen.push(
        build_error(
            LockManager::builder()
                .redis_url(server.url())
                .credentials("default", WRONG),
        )
        .await,
    );
    server
        .acl_setuser("locker", SECRET, &["~app:*", "+@all", "-script|load"])
        .unwrap();
    seen.push(build_error(LockManager::builder().redis_url(server.url_as("locker", SECRET))).await);
    for vars in [
        vec![("DISTLOCK_URL", format!("http://u:{SECRET}@h"))],
        vec![(
            "DISTLOCK_REDLOCK",
            format!("redis://u:{SECRET}@h,ftp://u:{SECRET}@h"),
        )],
    ] {
        let error = LockManagerBuilder::from_vars(vars).unwrap_err();
        seen.push(render(&error));
    }
    // a NOPERM while running
    server
        .acl_setuser("reader", SECRET, &["~elsewhere:*", "+@all"])
        .unwrap();
    let denied = quick(LockManager::builder().redis_url(server.url_as("reader", SECRET)))
        .build()
        .await
        .unwrap();
    seen.push(format!("{denied:?}"));
    seen.push(render(&denied.lock("job").try_acquire().await.unwrap_err()));
    drop((locks, denied));

    let logged = logs.lines();
    assert!(!logged.is_empty(), "the capture works");
    for text in seen.iter().chain(&logged) {
        for secret in [SECRET, WRONG, KEY_MATERIAL] {
            assert!(!text.contains(secret), "{secret} shows in: {text}");
        }
    }
}
