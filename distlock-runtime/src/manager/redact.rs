//! How a Redis URL shows in `Debug` output, logs and errors: without its credentials.

/// The URL `raw` with its user name and password replaced by `***`, for logs and errors:
/// scheme, host, port and path (the database number, or a socket's path) are kept; the query
/// and fragment are dropped (a query may carry a password: `unix://` URLs take theirs there).
///
/// The URL is read by the `url` crate, the parser the redis client uses. A user name or
/// password with a `/`, `?` or `#` that is not percent-encoded ends the authority early, so
/// part of it would be read as the host, port or path: whenever an `@` is found past the
/// authority, nothing but the scheme is shown (`redis://***`). A URL that does not parse
/// shows nothing of itself (`<redis url>`).
pub(crate) fn redact_url(raw: &str) -> String {
    const UNREADABLE: &str = "<redis url>";
    let Ok(url) = url::Url::parse(raw) else {
        return UNREADABLE.to_owned();
    };
    // The parser ignores leading and trailing controls and spaces.
    let raw = raw.trim_matches(|c: char| c <= ' ');
    let Some((scheme, rest)) = raw.split_once("://") else {
        return UNREADABLE.to_owned();
    };
    if !url.has_authority() || !scheme.eq_ignore_ascii_case(url.scheme()) {
        return UNREADABLE.to_owned();
    }
    // Where the parser ends the authority: at the first `/`, `?` or `#` after the `//` (and
    // `\` for the schemes the URL standard calls special), even inside a password.
    let special = matches!(
        url.scheme(),
        "http" | "https" | "ws" | "wss" | "ftp" | "file"
    );
    let end = rest
        .find(|c| matches!(c, '/' | '?' | '#') || (special && c == '\\'))
        .unwrap_or(rest.len());
    let (authority, after) = rest.split_at(end);
    // The user name and password are what precedes the authority's last `@`.
    let userinfo = authority.rfind('@').map_or("", |at| &authority[..at]);
    let credentials = !url.username().is_empty() || url.password().is_some();
    if after.contains('@') || userinfo.is_empty() == credentials {
        return format!("{}://***", url.scheme());
    }
    let shown = &url[url::Position::BeforeHost..url::Position::AfterPath];
    let hidden = if credentials { "***@" } else { "" };
    format!("{}://{hidden}{shown}", url.scheme())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_lose_their_credentials() {
        assert_eq!(
            redact_url("redis://127.0.0.1:6379"),
            "redis://127.0.0.1:6379"
        );
        assert_eq!(
            redact_url("redis://:hunter2@db:6379/0"),
            "redis://***@db:6379/0"
        );
        assert_eq!(redact_url("rediss://user:p%40ss@db"), "rediss://***@db");
        assert_eq!(
            redact_url("redis://db:6379/1?password=hunter2"),
            "redis://db:6379/1"
        );
        assert_eq!(redact_url("not a url"), "<redis url>");
    }

    #[test]
    fn credentials_that_split_the_url_show_nothing_of_it() {
        // A user name or password with a raw `/`, `?` or `#` ends the authority early, and
        // its pieces would be read as host, port, path, query or fragment: none shows.
        assert_eq!(redact_url("redis://:pa/ss@host"), "<redis url>");
        assert_eq!(redact_url("redis://:1234/ss@host"), "<redis url>");
        assert_eq!(redact_url("redis://u:12?x@db"), "redis://***");
        assert_eq!(redact_url("redis://user:pa@x/y@host:1/0"), "redis://***");
        assert_eq!(redact_url("rediss://:p#w@db"), "<redis url>");
        assert_eq!(redact_url("http://u:p@h\\x@y"), "http://***");
        // Not after a scheme and `//`: nothing shows.
        assert_eq!(redact_url("pass:word@host"), "<redis url>");
        assert_eq!(redact_url("redis:user:pass@host"), "<redis url>");
    }

    #[test]
    fn what_is_no_secret_is_kept() {
        assert_eq!(redact_url("redis://:p@ss@host:1/0"), "redis://***@host:1/0");
        assert_eq!(redact_url("redis://user@db"), "redis://***@db");
        assert_eq!(redact_url("redis://@db"), "redis://db");
        assert_eq!(redact_url("redis://:p\\w@db"), "redis://***@db");
        assert_eq!(
            redact_url("redis://:pw@[::1]:6379/2#insecure"),
            "redis://***@[::1]:6379/2"
        );
        assert_eq!(redact_url("REDIS://db:7000/3"), "redis://db:7000/3");
        assert_eq!(
            redact_url("unix:///run/redis.sock?db=1&user=u&pass=secret"),
            "unix:///run/redis.sock"
        );
        assert_eq!(
            redact_url("redis+unix://u:pw@localhost/run/redis.sock"),
            "redis+unix://***@localhost/run/redis.sock"
        );
        assert_eq!(redact_url("tcp://u:pw@db:1"), "tcp://***@db:1");
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        /// Mostly the characters that end or split the parts of a URL, sometimes any
        /// printable one.
        fn secret() -> impl Strategy<Value = String> {
            proptest::collection::vec(
                prop_oneof![
                    3 => proptest::sample::select(vec![
                        '/', '?', '#', '@', ':', '%', '[', ']', '\\', '&', '=', ' ', '2', 'F', 'a',
                        '\u{e9}', '\u{65e5}',
                    ]),
                    1 => any::<char>().prop_filter("printable", |c| !c.is_control()),
                ],
                0..16,
            )
            .prop_map(String::from_iter)
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

        /// Whether `output` shows `secret` (raw or percent-encoded) where `allowed`, what the
        /// redaction may show, does not explain it.
        fn shows(output: &str, secret: &str, allowed: &[String]) -> bool {
            secret.chars().count() >= 3
                && [secret.to_owned(), encoded(secret)].iter().any(|s| {
                    output.contains(s.as_str()) && !allowed.iter().any(|a| a.contains(s.as_str()))
                })
        }

        proptest! {
            #[test]
            fn no_credential_ever_shows(
                scheme in proptest::sample::select(vec!["redis", "rediss", "redis+unix", "unix"]),
                host in proptest::sample::select(vec!["db", "127.0.0.1", "[::1]", "a.example"]),
                port in proptest::sample::select(vec!["", ":6379", ":7000"]),
                db in proptest::option::of(0..16u8),
                socket_host in proptest::sample::select(vec!["", "localhost"]),
                query in proptest::sample::select(vec!["", "?protocol=resp3", "?db=2"]),
                username in proptest::option::of(secret()),
                password in secret(),
                raw in any::<bool>(),
                in_query in any::<bool>(),
            ) {
                let unix = scheme.contains("unix");
                let address = if unix {
                    format!("{socket_host}/run/redis.sock")
                } else {
                    let db = db.map_or_else(String::new, |db| format!("/{db}"));
                    format!("{host}{port}{db}")
                };
                let write = |text: &str| if raw { text.to_owned() } else { encoded(text) };
                let userinfo = match &username {
                    Some(username) => format!("{}:{}", write(username), write(&password)),
                    None => format!(":{}", write(&password)),
                };
                let url = if in_query {
                    let join = if query.is_empty() { '?' } else { '&' };
                    let user = username
                        .as_deref()
                        .map_or_else(String::new, |u| format!("user={}&", write(u)));
                    format!("{scheme}://{address}{query}{join}{user}pass={}", write(&password))
                } else {
                    format!("{scheme}://{userinfo}@{address}{query}")
                };
                let output = redact_url(&url);

                let plain = format!("{scheme}://{address}");
                let hidden = format!("{scheme}://***@{address}");
                let allowed = [
                    plain.clone(),
                    hidden.clone(),
                    format!("{scheme}://***"),
                    "<redis url>".to_owned(),
                ];
                prop_assert!(allowed.contains(&output), "{} shows as {}", url, output);
                if !raw {
                    let expected = if in_query {
                        plain
                    } else if userinfo == ":" {
                        format!("{scheme}://***")
                    } else if unix && socket_host.is_empty() {
                        // Credentials need a host: the URL does not parse.
                        "<redis url>".to_owned()
                    } else {
                        hidden
                    };
                    prop_assert_eq!(&output, &expected, "{}", url);
                }
                for secret in std::iter::once(&password).chain(&username) {
                    prop_assert!(!shows(&output, secret, &allowed), "{} shows as {}", url, output);
                }
            }
        }
    }
}
