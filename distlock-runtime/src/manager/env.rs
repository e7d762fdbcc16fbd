//! Configuration from environment variables: [`LockManager::from_env`].

use std::time::Duration;

use super::{LockManager, LockManagerBuilder, check_masters, check_timeout};
use crate::error::LockError;
use crate::key::check_prefix;
use crate::lease::check_ttl;
use crate::security::{check_certificates, check_private_key, check_tls_endpoints};

/// The variables [`LockManagerBuilder::from_vars`] reads, in the order it checks them.
const TOPOLOGIES: [&str; 4] = [
    "DISTLOCK_URL",
    "DISTLOCK_CLUSTER",
    "DISTLOCK_SENTINEL",
    "DISTLOCK_REDLOCK",
];

impl LockManager {
    /// Builds a manager from the process environment and connects, as
    /// [`LockManagerBuilder::from_env`] then [`build`](LockManagerBuilder::build).
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), distlock_runtime::LockError> {
    /// // DISTLOCK_URL=redis://127.0.0.1:6379 DISTLOCK_KEY_PREFIX=myapp:lock:
    /// let locks = distlock_runtime::LockManager::from_env().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn from_env() -> Result<LockManager, LockError> {
        LockManagerBuilder::from_env()?.build().await
    }
}

impl LockManagerBuilder {
    /// A builder configured from the process environment; options set on it afterwards
    /// override what the environment said.
    ///
    /// | variable | meaning |
    /// |---|---|
    /// | `DISTLOCK_URL` | one Redis server (falls back to `REDIS_URL` when no topology variable is set) |
    /// | `DISTLOCK_CLUSTER` | Redis Cluster seeds, comma-separated URLs |
    /// | `DISTLOCK_SENTINEL` + `DISTLOCK_SENTINEL_MASTER` | Sentinel URLs, comma-separated, and the master's name |
    /// | `DISTLOCK_REDLOCK` | RedLock masters, comma-separated URLs (at least 3) |
    /// | `DISTLOCK_KEY_PREFIX` | the key prefix |
    /// | `DISTLOCK_CLIENT_NAME` | the name this manager goes by (see [`client_name`](Self::client_name)) |
    /// | `DISTLOCK_DEFAULT_TTL` | the default lease: `30s`, `500ms`, `2m`, `1h` |
    /// | `DISTLOCK_CONNECT_TIMEOUT`, `DISTLOCK_RESPONSE_TIMEOUT` | durations, as above |
    /// | `DISTLOCK_TLS_CA_FILE` | a PEM file of CA certificates to trust for `rediss://` (see [`tls_ca_certificate`](Self::tls_ca_certificate)) |
    /// | `DISTLOCK_TLS_CERT_FILE` + `DISTLOCK_TLS_KEY_FILE` | PEM files of a client certificate and its key (see [`tls_client_certificate`](Self::tls_client_certificate)) |
    ///
    /// Exactly one topology may be set. A bad value is a [`LockError::Config`] that names
    /// the variable (and never shows a password): every value is checked here as
    /// [`build`](Self::build) would check it, so that `build` finds no fault in what the
    /// environment gave (only in options set afterwards, in a missing `tls` feature, and in
    /// what needs a connection).
    pub fn from_env() -> Result<Self, LockError> {
        Self::from_vars(std::env::vars_os().filter_map(|(name, value)| {
            Some((name.into_string().ok()?, value.into_string().ok()?))
        }))
    }

    /// As [`from_env`](Self::from_env), from the given `(name, value)` pairs instead of the
    /// process environment (variables not listed are unset).
    pub fn from_vars<I, K, V>(vars: I) -> Result<Self, LockError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let vars = Vars(
            vars.into_iter()
                .map(|(k, v)| (k.as_ref().to_owned(), v.as_ref().to_owned()))
                .collect(),
        );
        let builder = vars.topology()?;
        let builder = vars.options(builder)?;
        vars.tls(builder)
    }
}

/// The variables given, in order (the last of a name wins).
struct Vars(Vec<(String, String)>);

impl Vars {
    /// The variable `name`, trimmed; `None` when unset or blank.
    fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.trim())
            .filter(|v| !v.is_empty())
    }

    /// A builder for the one topology variable set (or `REDIS_URL`).
    fn topology(&self) -> Result<LockManagerBuilder, LockError> {
        let get = |name: &str| self.get(name);
        let set: Vec<&str> = TOPOLOGIES
            .into_iter()
            .filter(|name| get(name).is_some())
            .collect();
        let builder = LockManagerBuilder::default();
        match set.as_slice() {
            [] => match get("REDIS_URL") {
                Some(_) => Ok(builder.redis_url(url_var(&get, "REDIS_URL")?)),
                None => Err(LockError::Config(
                    "no Redis endpoint in the environment: set DISTLOCK_URL (or REDIS_URL), \
                     DISTLOCK_CLUSTER, DISTLOCK_SENTINEL or DISTLOCK_REDLOCK"
                        .into(),
                )),
            },
            ["DISTLOCK_URL"] => Ok(builder.redis_url(url_var(&get, "DISTLOCK_URL")?)),
            ["DISTLOCK_CLUSTER"] => Ok(builder.cluster(list_var(&get, "DISTLOCK_CLUSTER")?)),
            ["DISTLOCK_SENTINEL"] => {
                let master = get("DISTLOCK_SENTINEL_MASTER").ok_or_else(|| {
                    LockError::Config(
                        "DISTLOCK_SENTINEL is set but DISTLOCK_SENTINEL_MASTER (the master's \
                         name) is not"
                            .into(),
                    )
                })?;
                Ok(builder.sentinel(list_var(&get, "DISTLOCK_SENTINEL")?, master))
            }
            ["DISTLOCK_REDLOCK"] => {
                let masters = list_var(&get, "DISTLOCK_REDLOCK")?;
                check_masters(masters.len())
                    .map_err(|reason| config("DISTLOCK_REDLOCK", reason))?;
                Ok(builder.redlock(masters))
            }
            several => Err(LockError::Config(format!(
                "{} are all set: choose one topology",
                several.join(" and ")
            ))),
        }
    }

    /// The key prefix, the client name, the default TTL and the timeouts.
    fn options(&self, mut builder: LockManagerBuilder) -> Result<LockManagerBuilder, LockError> {
        let get = |name: &str| self.get(name);
        if let Some(prefix) = get("DISTLOCK_KEY_PREFIX") {
            check_prefix(prefix).map_err(|reason| config("DISTLOCK_KEY_PREFIX", reason))?;
            builder = builder.key_prefix(prefix);
        }
        if let Some(name) = get("DISTLOCK_CLIENT_NAME") {
            crate::holder::check_client_name(name)
                .map_err(|reason| config("DISTLOCK_CLIENT_NAME", reason))?;
            builder = builder.client_name(name);
        }
        if let Some(ttl) = duration_var(&get, "DISTLOCK_DEFAULT_TTL", check_ttl)? {
            builder = builder.default_ttl(ttl);
        }
        if let Some(timeout) = duration_var(&get, "DISTLOCK_CONNECT_TIMEOUT", check_timeout)? {
            builder = builder.connect_timeout(timeout);
        }
        if let Some(timeout) = duration_var(&get, "DISTLOCK_RESPONSE_TIMEOUT", check_timeout)? {
            builder = builder.response_timeout(timeout);
        }
        Ok(builder)
    }

    /// The TLS files, which need `rediss://` endpoints.
    fn tls(&self, mut builder: LockManagerBuilder) -> Result<LockManagerBuilder, LockError> {
        let get = |name: &str| self.get(name);
        if get("DISTLOCK_TLS_CERT_FILE").is_some() != get("DISTLOCK_TLS_KEY_FILE").is_some() {
            return Err(LockError::Config(
                "DISTLOCK_TLS_CERT_FILE and DISTLOCK_TLS_KEY_FILE go together: set both or neither"
                    .into(),
            ));
        }
        let mut tls = None;
        if let Some(ca) = file_var(&get, "DISTLOCK_TLS_CA_FILE", check_certificates)? {
            builder = builder.tls_ca_certificate(ca);
            tls = Some("DISTLOCK_TLS_CA_FILE");
        }
        if let (Some(cert), Some(key)) = (
            file_var(&get, "DISTLOCK_TLS_CERT_FILE", check_certificates)?,
            file_var(&get, "DISTLOCK_TLS_KEY_FILE", check_private_key)?,
        ) {
            builder = builder.tls_client_certificate(cert, key);
            tls = tls.or(Some("DISTLOCK_TLS_CERT_FILE"));
        }
        if let Some(name) = tls {
            check_tls_endpoints(builder.endpoint_urls())
                .map_err(|reason| config(name, format!("is set but {reason}")))?;
        }
        Ok(builder)
    }
}

/// A [`LockError::Config`] about the variable `name`: `reason` follows its name.
fn config(name: &str, reason: impl std::fmt::Display) -> LockError {
    LockError::Config(format!("{name} {reason}"))
}

/// One URL, checked as `build` checks it.
fn url_var<'a>(get: &impl Fn(&str) -> Option<&'a str>, name: &str) -> Result<String, LockError> {
    let url = get(name).unwrap_or_default();
    check_url(name, url)?;
    Ok(url.to_owned())
}

/// Comma-separated URLs, each checked as `build` checks it.
fn list_var<'a>(
    get: &impl Fn(&str) -> Option<&'a str>,
    name: &str,
) -> Result<Vec<String>, LockError> {
    let urls: Vec<String> = get(name)
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(str::to_owned)
        .collect();
    if urls.is_empty() {
        return Err(LockError::Config(format!(
            "{name} holds no URL: expected comma-separated `redis://host:port` URLs"
        )));
    }
    for url in &urls {
        check_url(name, url)?;
    }
    Ok(urls)
}

fn check_url(name: &str, url: &str) -> Result<(), LockError> {
    super::check_url(url).map_err(|reason| config(name, reason))
}

/// The contents of the file the variable names, passed by `check` (they are never quoted in
/// errors: they may be a key).
fn file_var<'a>(
    get: &impl Fn(&str) -> Option<&'a str>,
    name: &str,
    check: fn(&[u8]) -> Result<(), String>,
) -> Result<Option<Vec<u8>>, LockError> {
    get(name)
        .map(|path| {
            let pem = std::fs::read(path).map_err(|error| {
                LockError::Config(format!("{name}: cannot read `{path}`: {error}"))
            })?;
            check(&pem).map_err(|reason| config(name, format_args!("(`{path}`) {reason}")))?;
            Ok(pem)
        })
        .transpose()
}

/// The duration the variable holds, passed by `check`.
fn duration_var<'a>(
    get: &impl Fn(&str) -> Option<&'a str>,
    name: &str,
    check: fn(Duration) -> Result<(), String>,
) -> Result<Option<Duration>, LockError> {
    get(name)
        .map(|value| {
            let duration = parse_duration(value).ok_or_else(|| {
                config(
                    name,
                    format_args!(
                        "must be a duration above zero such as `30s`, `500ms`, `2m` or `1h`, \
                         got `{value}`"
                    ),
                )
            })?;
            check(duration).map_err(|reason| config(name, format_args!("{reason} (`{value}`)")))?;
            Ok(duration)
        })
        .transpose()
}

/// The duration syntax of [`crate::parse_duration`], as an `Option`.
fn parse_duration(text: &str) -> Option<Duration> {
    crate::duration::parse_duration(text).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config_error(vars: &[(&str, &str)]) -> String {
        match LockManagerBuilder::from_vars(vars.iter().copied()) {
            Err(LockError::Config(message)) => message,
            other => panic!("expected a Config error, got {other:?}"),
        }
    }

    #[test]
    fn durations_take_a_unit() {
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("10s"), Some(Duration::from_secs(10)));
        assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Some(Duration::from_secs(3600)));
        for bad in [
            "",
            "10",
            "s",
            "0s",
            "1.5s",
            "-1s",
            "10 days",
            "99999999999999999999h",
        ] {
            assert_eq!(parse_duration(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn every_topology_is_read() {
        let single = LockManagerBuilder::from_vars([("DISTLOCK_URL", "redis://a:1")]).unwrap();
        assert!(format!("{single:?}").contains("redis://a:1"));
        let fallback = LockManagerBuilder::from_vars([("REDIS_URL", "redis://b:2")]).unwrap();
        assert!(format!("{fallback:?}").contains("redis://b:2"));
        let cluster =
            LockManagerBuilder::from_vars([("DISTLOCK_CLUSTER", "redis://a:1, redis://b:2")])
                .unwrap();
        assert!(format!("{cluster:?}").contains("redis://b:2"));
        let redlock = LockManagerBuilder::from_vars([(
            "DISTLOCK_REDLOCK",
            "redis://a:1,redis://b:2,redis://c:3",
        )])
        .unwrap();
        assert!(format!("{redlock:?}").contains("topology: \"redlock\""));
        let sentinel = LockManagerBuilder::from_vars([
            ("DISTLOCK_SENTINEL", "redis://s:26379"),
            ("DISTLOCK_SENTINEL_MASTER", "mymaster"),
        ])
        .unwrap();
        assert!(format!("{sentinel:?}").contains("mymaster"));
    }

    #[test]
    fn options_are_read() {
        let builder = LockManagerBuilder::from_vars([
            ("DISTLOCK_URL", "redis://a:1"),
            ("DISTLOCK_KEY_PREFIX", "svc:lock:"),
            ("DISTLOCK_DEFAULT_TTL", "7s"),
            ("DISTLOCK_RESPONSE_TIMEOUT", "250ms"),
        ])
        .unwrap();
        let debug = format!("{builder:?}");
        assert!(debug.contains("svc:lock:"), "{debug}");
        assert!(debug.contains("ttl: 7s"), "{debug}");
        assert!(debug.contains("response_timeout: 250ms"), "{debug}");
    }

    #[test]
    fn a_bad_value_names_its_variable() {
        assert!(config_error(&[]).contains("DISTLOCK_URL"));
        let ttl = config_error(&[
            ("DISTLOCK_URL", "redis://a:1"),
            ("DISTLOCK_DEFAULT_TTL", "soon"),
        ]);
        assert!(
            ttl.contains("DISTLOCK_DEFAULT_TTL") && ttl.contains("soon"),
            "{ttl}"
        );
        let url = config_error(&[("DISTLOCK_URL", "http://user:hunter2@a:1")]);
        assert!(url.contains("DISTLOCK_URL"), "{url}");
        assert!(!url.contains("hunter2"), "{url}");
        let two = config_error(&[
            ("DISTLOCK_URL", "redis://a:1"),
            ("DISTLOCK_CLUSTER", "redis://b:2"),
        ]);
        assert!(
            two.contains("DISTLOCK_URL") && two.contains("DISTLOCK_CLUSTER"),
            "{two}"
        );
        let master = config_error(&[("DISTLOCK_SENTINEL", "redis://s:26379")]);
        assert!(master.contains("DISTLOCK_SENTINEL_MASTER"), "{master}");
        let empty = config_error(&[("DISTLOCK_REDLOCK", " , ")]);
        assert!(empty.contains("DISTLOCK_REDLOCK"), "{empty}");
        let missing = config_error(&[
            ("DISTLOCK_URL", "rediss://a:1"),
            ("DISTLOCK_TLS_CA_FILE", "/nonexistent/ca.pem"),
        ]);
        assert!(
            missing.contains("DISTLOCK_TLS_CA_FILE") && missing.contains("/nonexistent/ca.pem"),
            "{missing}"
        );
        let half = config_error(&[
            ("DISTLOCK_URL", "rediss://a:1"),
            ("DISTLOCK_TLS_KEY_FILE", "/dev/null"),
        ]);
        assert!(half.contains("DISTLOCK_TLS_CERT_FILE"), "{half}");
    }

    #[test]
    fn what_build_would_refuse_names_its_variable() {
        let masters = config_error(&[("DISTLOCK_REDLOCK", "redis://a:1,redis://b:2")]);
        assert!(
            masters.contains("DISTLOCK_REDLOCK needs at least 3"),
            "{masters}"
        );
        let db = config_error(&[("DISTLOCK_URL", "redis://:hunter2@a:1/x")]);
        assert!(db.starts_with("DISTLOCK_URL holds a URL"), "{db}");
        assert!(!db.contains("hunter2"), "{db}");
        // The client's detail would quote the URL's query.
        let split = config_error(&[("DISTLOCK_CLUSTER", "redis://u:12?protocol=hunter2@a:1")]);
        assert!(split.contains("DISTLOCK_CLUSTER"), "{split}");
        assert!(!split.contains("hunter2"), "{split}");
        let timeout = config_error(&[
            ("DISTLOCK_URL", "redis://a:1"),
            ("DISTLOCK_CONNECT_TIMEOUT", "0s"),
        ]);
        assert!(timeout.contains("DISTLOCK_CONNECT_TIMEOUT"), "{timeout}");
    }

    #[cfg(feature = "tls")]
    #[test]
    fn tls_files_are_checked() {
        let dir = std::env::temp_dir().join(format!("distlock-env-pem-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = |name: &str, text: &str| {
            let file = dir.join(name);
            std::fs::write(&file, text).unwrap();
            file.to_str().unwrap().to_owned()
        };
        let pem = |label: &str| format!("-----BEGIN {label}-----\nAAAA\n-----END {label}-----\n");
        let junk: &str = &path("junk", "not pem");
        let cert_pem: &str = &path("c.pem", &pem("CERTIFICATE"));
        let key_pem: &str = &path("k.pem", &pem("PRIVATE KEY"));
        let url = |url: &'static str| ("DISTLOCK_URL", url);
        let ca = |path| ("DISTLOCK_TLS_CA_FILE", path);
        let cert = |path| ("DISTLOCK_TLS_CERT_FILE", path);
        let key = |path| ("DISTLOCK_TLS_KEY_FILE", path);
        let tls = "rediss://a:1";
        let cases: [(&[(&str, &str)], &str); 5] = [
            (&[url(tls), ca(junk)], "DISTLOCK_TLS_CA_FILE (`"),
            (
                &[url(tls), cert(junk), key(key_pem)],
                "DISTLOCK_TLS_CERT_FILE (`",
            ),
            (
                &[url(tls), cert(cert_pem), key(junk)],
                "DISTLOCK_TLS_KEY_FILE (`",
            ),
            (
                &[url("redis://a:1"), ca(cert_pem)],
                "DISTLOCK_TLS_CA_FILE is set but",
            ),
            (
                &[url("redis://a:1"), cert(cert_pem), key(key_pem)],
                "DISTLOCK_TLS_CERT_FILE is set but",
            ),
        ];
        for (vars, named) in cases {
            let message = config_error(vars);
            assert!(message.starts_with(named), "{message}");
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn tls_files_are_read() {
        let dir = std::env::temp_dir().join(format!("distlock-env-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (ca, cert, key) = (dir.join("ca.pem"), dir.join("c.pem"), dir.join("k.pem"));
        // Only the PEM blocks are checked here; what they hold is checked when connecting.
        let pem = |label: &str| format!("-----BEGIN {label}-----\nAAAA\n-----END {label}-----\n");
        for (file, label) in [
            (&ca, "CERTIFICATE"),
            (&cert, "CERTIFICATE"),
            (&key, "PRIVATE KEY"),
        ] {
            std::fs::write(file, pem(label)).unwrap();
        }
        let builder = LockManagerBuilder::from_vars([
            ("DISTLOCK_URL", "rediss://a:1"),
            ("DISTLOCK_TLS_CA_FILE", ca.to_str().unwrap()),
            ("DISTLOCK_TLS_CERT_FILE", cert.to_str().unwrap()),
            ("DISTLOCK_TLS_KEY_FILE", key.to_str().unwrap()),
        ])
        .unwrap();
        let debug = format!("{builder:?}");
        assert!(debug.contains("tls_ca_certificate: Some"), "{debug}");
        assert!(debug.contains("tls_client_certificate: Some"), "{debug}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
