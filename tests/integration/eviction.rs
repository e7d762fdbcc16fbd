//! `build()` reads every master's `maxmemory-policy`: an evicting policy is a warning, or a
//! refusal with `require_noeviction`.

use distlock::testing::RedisServer;
use distlock::{LockError, LockManager, LockManagerBuilder};

use crate::support;
use crate::support::logs::Logs;

const WARNING: &str = "may evict held locks";

fn builder(url: String) -> LockManagerBuilder {
    support::quick(support::single(url), &support::unique_prefix("eviction"))
}

#[tokio::test(flavor = "current_thread")]
async fn a_volatile_policy_is_a_warning() {
    let server = RedisServer::start_with_args(&["--maxmemory-policy", "volatile-lru"]).unwrap();
    let (logs, _guard) = Logs::capture_here();
    let locks = builder(server.url()).build().await.expect("builds");
    let warnings = logs.matching(WARNING);
    assert_eq!(warnings.len(), 1, "{:?}", logs.lines());
    assert!(warnings[0].contains("volatile-lru"), "{warnings:?}");
    let guard = locks.lock("job").acquire().await.unwrap();
    guard.release().await.unwrap();
}

#[tokio::test]
async fn require_noeviction_refuses_it() {
    let server = RedisServer::start_with_args(&["--maxmemory-policy", "volatile-lru"]).unwrap();
    let error = builder(server.url())
        .require_noeviction(true)
        .build()
        .await
        .unwrap_err();
    let message = error.to_string();
    assert!(matches!(error, LockError::Config(_)), "{error:?}");
    assert!(message.contains("volatile-lru"), "{message}");
    assert!(message.contains("require_noeviction"), "{message}");
}

#[tokio::test(flavor = "current_thread")]
async fn noeviction_is_fine() {
    let server = RedisServer::start_with_args(&["--maxmemory-policy", "noeviction"]).unwrap();
    let (logs, _guard) = Logs::capture_here();
    builder(server.url())
        .require_noeviction(true)
        .build()
        .await
        .expect("builds with noeviction");
    assert!(logs.matching("maxmemory").is_empty(), "{:?}", logs.lines());
}

#[tokio::test]
async fn info_is_read_when_config_is_denied() {
    let server = RedisServer::start_with_args(&["--maxmemory-policy", "allkeys-lru"]).unwrap();
    let rules = LockManager::acl_rules("app:lock:");
    let rules: Vec<&str> = rules.split(' ').collect();
    server.acl_setuser("locker", "pw", &rules).unwrap();
    let error = builder(server.url_as("locker", "pw"))
        .key_prefix("app:lock:")
        .require_noeviction(true)
        .build()
        .await
        .unwrap_err();
    assert!(error.to_string().contains("allkeys-lru"), "{error}");
}

#[tokio::test(flavor = "current_thread")]
async fn denied_is_built_with_one_log_line_or_refused_when_required() {
    let server = RedisServer::start_with_args(&["--maxmemory-policy", "volatile-ttl"]).unwrap();
    server
        .acl_setuser(
            "locker",
            "pw",
            &["~app:lock:*", "&app:lock:*", "+@all", "-@dangerous"],
        )
        .unwrap();
    let (logs, _guard) = Logs::capture_here();
    builder(server.url_as("locker", "pw"))
        .key_prefix("app:lock:")
        .build()
        .await
        .expect("builds although the policy cannot be read");
    assert_eq!(
        logs.matching("could not be checked").len(),
        1,
        "{:?}",
        logs.lines()
    );
    let required = builder(server.url_as("locker", "pw"))
        .key_prefix("app:lock:")
        .require_noeviction(true)
        .build()
        .await
        .unwrap_err();
    assert!(
        required.to_string().contains("cannot be read"),
        "{required}"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn every_cluster_master_is_checked() {
    let nodes = RedisServer::start_cluster(3).unwrap();
    let evicting = &nodes[2];
    let reply = evicting
        .command(&["CONFIG", "SET", "maxmemory-policy", "volatile-lfu"])
        .unwrap();
    assert_eq!(reply, "+OK");
    let (logs, _guard) = Logs::capture_here();
    support::cluster(&nodes[..1])
        .key_prefix(support::unique_prefix("eviction"))
        .build()
        .await
        .expect("builds");
    let warnings = logs.matching(WARNING);
    assert_eq!(warnings.len(), 1, "{:?}", logs.lines());
    assert!(
        warnings[0].contains(&evicting.port().to_string()) && warnings[0].contains("volatile-lfu"),
        "{warnings:?}"
    );
    let refused = support::cluster(&nodes[..1])
        .require_noeviction(true)
        .build()
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("volatile-lfu"), "{refused}");
}
