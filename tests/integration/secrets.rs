//! No password (nor key material) ever shows in `Debug`, `Display`, errors or tracing output.

use std::error::Error as _;
use std::time::Duration;

use distlock::testing::RedisServer;
use distlock::{LockError, LockManager, LockManagerBuilder};

use crate::support::logs::Logs;

const SECRET: &str = "Pa55-SECRET-word";
const WRONG: &str = "Wr0ng-SECRET-guess";
const KEY_MATERIAL: &str = "MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQg";
/// A password with the characters that end a URL's authority (`/`, `?`, `#`): written raw, it
/// splits the URL, and any of its pieces would show if the URL were cut by hand.
const SPLIT: &str = "Sl4shy/Qu3ry?H4shy#T41l";
/// The same, with a leading number: written raw, the URL parses, with a port and a path.
const SPLIT_PORT: &str = "6380/Qu3ry?H4shy#T41l";
/// A user name written raw before `SPLIT_PORT`: it parses as the host.
const SPLIT_USER: &str = "Us3rN4me";
/// What must never show of these: each piece on its own.
const SPLIT_PIECES: [&str; 5] = ["Sl4shy", "Qu3ry", "H4shy", "T41l", SPLIT_USER];

/// Everything logged by any thread of this test binary, from the first call on: the tests of
/// the other modules too, so none of them may log these secrets either.
fn logs() -> &'static Logs {
    Logs::global()
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

/// `text` percent-encoded as a URL's user name or password should be.
fn encoded(text: &str) -> String {
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
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

#[tokio::test(flavor = "multi_thread")]
async fn no_piece_of_a_password_that_splits_the_url_shows() {
    let logs = logs();
    let mut seen = Vec::new();
    let server = RedisServer::start_with_password(SPLIT).unwrap();
    let port = server.port();

    // Percent-encoded, it connects.
    let encoded_url = format!("redis://:{}@127.0.0.1:{port}/0", encoded(SPLIT));
    let builder = quick(LockManager::builder().redis_url(&encoded_url));
    seen.push(format!("{builder:?}"));
    let locks = builder.build().await.unwrap();
    seen.push(format!("{locks:?}"));
    let guard = locks.lock("split").acquire().await.unwrap();
    seen.push(format!("{guard:?}"));
    guard.release().await.unwrap();
    drop(locks);
    let env = LockManagerBuilder::from_vars([("DISTLOCK_URL", &encoded_url)]).unwrap();
    seen.push(format!("{env:?}"));
    let locks = quick(env).build().await.unwrap();
    seen.push(format!("{locks:?}"));
    drop(locks);

    // Percent-encoded but wrong, and written raw: errors that show none of it.
    let wrong = format!("redis://default:{}@127.0.0.1:{port}/0", encoded(SPLIT_PORT));
    let raw = [
        format!("redis://:{SPLIT}@127.0.0.1:{port}/0"),
        format!("redis://default:{SPLIT}@127.0.0.1:{port}"),
        format!("rediss://:{SPLIT}@127.0.0.1:{port}"),
        format!("redis://{SPLIT_USER}:{SPLIT_PORT}@127.0.0.1:{port}/0"),
        format!("redis://{SPLIT_USER}:{SPLIT_PORT}@127.0.0.1:{port}"),
    ];
    for url in std::iter::once(&wrong).chain(&raw) {
        for builder in [
            LockManager::builder().redis_url(url),
            LockManager::builder().cluster([url]),
            LockManager::builder().sentinel([url], "mymaster"),
            LockManager::builder().redlock([url, url, url]),
        ] {
            seen.push(format!("{builder:?}"));
            seen.push(build_error(builder).await);
        }
        for name in ["DISTLOCK_URL", "REDIS_URL", "DISTLOCK_CLUSTER"] {
            match LockManagerBuilder::from_vars([(name, url)]) {
                Ok(builder) => {
                    seen.push(format!("{builder:?}"));
                    seen.push(build_error(builder).await);
                }
                Err(error) => seen.push(render(&error)),
            }
        }
    }

    let logged = logs.lines();
    for text in seen.iter().chain(&logged) {
        for secret in [SPLIT, SPLIT_PORT, &encoded(SPLIT), &encoded(SPLIT_PORT)]
            .into_iter()
            .chain(SPLIT_PIECES)
        {
            assert!(!text.contains(secret), "{secret} shows in: {text}");
        }
    }
}
