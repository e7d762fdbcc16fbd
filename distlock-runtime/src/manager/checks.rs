//! The checks `build` makes before anything connects, each one a function that
//! [`from_vars`](super::LockManagerBuilder::from_vars) runs too, so that its errors name the
//! variable. Each returns the reason on failure, to follow the name of the setting.

use std::time::Duration;

use super::redact_url;

/// The schemes of the URLs the redis client connects to.
const SCHEMES: [&str; 7] = [
    "redis",
    "rediss",
    "valkey",
    "valkeys",
    "redis+unix",
    "valkey+unix",
    "unix",
];

/// Checks an endpoint URL before anything connects: a scheme the redis client knows, and a
/// URL it reads. The reason, on failure, follows the name of the setting the URL came from (a
/// builder method or an environment variable); it shows the URL through [`redact_url`] only,
/// and leaves out the client's detail, which may quote part of the URL.
pub(crate) fn check_url(url: &str) -> Result<(), String> {
    use redis::IntoConnectionInfo;

    let scheme = url
        .split_once("://")
        .map(|(scheme, _)| scheme.to_ascii_lowercase());
    let Some(scheme) = scheme.filter(|scheme| SCHEMES.contains(&scheme.as_str())) else {
        return Err(format!(
            "must hold `redis://` or `rediss://` URLs, got `{}`",
            redact_url(url)
        ));
    };
    // Without the `tls` feature the client reads no `rediss://` URL; `build` says why.
    if !cfg!(feature = "tls") && matches!(scheme.as_str(), "rediss" | "valkeys") {
        return Ok(());
    }
    url.into_connection_info().map(drop).map_err(|error| {
        let hint = if url.contains('@') {
            " (a user name or password must have its `/`, `?`, `#` and `%` percent-encoded)"
        } else {
            ""
        };
        format!(
            "holds a URL the redis client cannot read, `{}`: {}{hint}",
            redact_url(url),
            without_detail(&error)
        )
    })
}

/// The redis client's `error` without its detail: a URL's errors may quote part of it (the
/// `protocol` parameter).
fn without_detail(error: &redis::RedisError) -> String {
    let text = error.to_string();
    match error.detail() {
        None => text,
        Some(detail) => text
            .strip_suffix(detail)
            .and_then(|text| text.strip_suffix(": "))
            .map_or_else(|| error.category().to_owned(), str::to_owned),
    }
}

/// Checks the number of RedLock masters. The reason, on failure, follows `RedLock` or the
/// name of an environment variable.
pub(crate) fn check_masters(count: usize) -> Result<(), String> {
    if count < 3 {
        return Err(format!("needs at least 3 independent masters, got {count}"));
    }
    Ok(())
}

/// Checks a connect or response timeout. The reason, on failure, follows the name of the
/// setting.
pub(crate) fn check_timeout(timeout: Duration) -> Result<(), String> {
    if timeout.is_zero() {
        return Err("must be greater than zero".into());
    }
    Ok(())
}
