//! `LockManager::from_env()`: the process environment configures a working manager.

use std::process::Command;

use distlock::{LockError, LockManagerBuilder};

use crate::support;

/// Set in the child process that this test starts with a prepared environment.
const CHILD: &str = "DISTLOCK_TEST_ENV_CHILD";

#[test]
fn from_env_reads_the_process_environment() {
    let server = support::shared_server();
    // The variables are set on a child run of this test binary: the environment of the
    // running process is shared by every test thread.
    let output = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            &support::test_name(module_path!(), "child_builds_from_env"),
            "--nocapture",
        ])
        .env(CHILD, "1")
        .env("DISTLOCK_URL", server.url())
        .env("DISTLOCK_KEY_PREFIX", "envtest:")
        .env("DISTLOCK_DEFAULT_TTL", "7s")
        .env("DISTLOCK_CLIENT_NAME", "env-client")
        .env_remove("REDIS_URL")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "child failed:\n{stdout}");
    assert!(
        stdout.contains("child: prefix envtest:, ttl 7s, named env-client and env-client"),
        "{stdout}"
    );
}

#[tokio::test]
async fn child_builds_from_env() {
    if std::env::var_os(CHILD).is_none() {
        return; // run by `from_env_reads_the_process_environment` only
    }
    let locks = distlock::LockManager::from_env().await.unwrap();
    let guard = locks.lock("env").acquire().await.unwrap();
    // A builder that names no client takes the environment's name too.
    let url = std::env::var("DISTLOCK_URL").unwrap();
    let built = distlock::LockManager::builder()
        .redis_url(url)
        .build()
        .await
        .unwrap();
    println!(
        "child: prefix {}, ttl {}s, named {} and {}",
        locks.key_prefix(),
        guard.ttl().as_secs(),
        locks.identity().client_name,
        built.identity().client_name,
    );
    guard.release().await.unwrap();
}

#[tokio::test]
async fn from_vars_builds_a_working_manager() {
    let server = support::shared_server();
    let prefix = support::unique_prefix("env");
    let locks = LockManagerBuilder::from_vars([
        ("DISTLOCK_URL", server.url()),
        ("DISTLOCK_KEY_PREFIX", prefix.clone()),
    ])
    .unwrap()
    .build()
    .await
    .unwrap();
    let guard = locks.lock("k").acquire().await.unwrap();
    assert_eq!(
        support::keys(&server, &prefix),
        vec![format!("{prefix}{{k}}")]
    );
    guard.release().await.unwrap();
}

#[test]
fn a_bad_variable_is_a_config_error_naming_it() {
    let error = LockManagerBuilder::from_vars([
        ("DISTLOCK_URL", "redis://:hunter2@127.0.0.1:1"),
        ("DISTLOCK_RESPONSE_TIMEOUT", "fast"),
    ])
    .unwrap_err();
    assert!(
        matches!(&error, LockError::Config(m) if m.contains("DISTLOCK_RESPONSE_TIMEOUT")),
        "{error}"
    );
    assert!(!error.to_string().contains("hunter2"));
}

/// The message of the `Config` error `vars` make, before anything connects.
fn config_error(vars: &[(&str, &str)]) -> String {
    match LockManagerBuilder::from_vars(vars.iter().copied()) {
        Err(LockError::Config(message)) => message,
        other => panic!("expected a Config error, got {other:?}"),
    }
}

#[test]
fn a_key_prefix_with_braces_is_an_error_naming_its_variable() {
    let error = config_error(&[
        ("DISTLOCK_URL", "redis://127.0.0.1:1"),
        ("DISTLOCK_KEY_PREFIX", "a{b}"),
    ]);
    assert!(error.contains("DISTLOCK_KEY_PREFIX"), "{error}");
}

#[test]
fn a_default_ttl_longer_than_max_ttl_is_an_error_naming_its_variable() {
    let error = config_error(&[
        ("DISTLOCK_URL", "redis://127.0.0.1:1"),
        ("DISTLOCK_DEFAULT_TTL", "1000000h"),
    ]);
    assert!(
        error.contains("DISTLOCK_DEFAULT_TTL") && error.contains("1000000h"),
        "{error}"
    );
}

#[test]
fn a_url_of_another_scheme_is_an_error_naming_its_variable() {
    let error = config_error(&[("REDIS_URL", "tcp://:hunter2@127.0.0.1:1")]);
    assert!(error.contains("REDIS_URL"), "{error}");
    assert!(!error.contains("hunter2"), "{error}");
}
