//! What a leader leaves for others to read: the record next to the lock and the news on the
//! election's channel (elected, resigned), and who leads, read back from the lock and the
//! record.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::leader::LeaderInfo;
use crate::error::LockError;
use crate::key::Keys;
use crate::manager::LockManager;

/// What a leader announces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum News {
    Elected {
        term: u64,
        token: String,
        since: u64,
    },
    Resigned {
        term: u64,
        token: String,
    },
}

impl News {
    pub(super) fn encode(&self) -> String {
        match self {
            Self::Elected { term, token, since } => format!("elected {term} {token} {since}"),
            Self::Resigned { term, token } => format!("resigned {term} {token}"),
        }
    }

    pub(super) fn decode(text: &str) -> Option<Self> {
        let mut words = text.split(' ');
        let news = match (words.next()?, words.next()?.parse().ok()?, words.next()?) {
            ("elected", term, token) => Self::Elected {
                term,
                token: token.to_owned(),
                since: words.next()?.parse().ok()?,
            },
            ("resigned", term, token) => Self::Resigned {
                term,
                token: token.to_owned(),
            },
            _ => return None,
        };
        words.next().is_none().then_some(news)
    }
}

pub(super) fn channel(keys: &Keys) -> String {
    format!("{}:leader", keys.lock)
}

pub(super) fn millis(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

/// How long a leader's record outlives a leader that never resigned (it crashed): the record
/// is only read next to a live lock, so this bounds what a dead election leaves behind.
pub(super) const RECORD_KEPT: Duration = Duration::from_secs(24 * 3600);

/// Records `news` next to the lock (a new leader's, or none after a resignation) and
/// publishes it. Best effort: the lock is what decides who leads; a failure here only leaves
/// observers to learn it later.
pub(super) async fn announce(manager: &LockManager, keys: &Keys, news: &News) {
    let (record, channel) = (channel(keys), channel(keys));
    let text = news.encode();
    let elected = matches!(news, News::Elected { .. });
    let sent = manager
        .inner
        .on_runtime(move |backend| async move {
            let node = backend.inspected();
            let write = if elected {
                let mut set = redis::cmd("SET");
                set.arg(&record)
                    .arg(&text)
                    .arg("PX")
                    .arg(RECORD_KEPT.as_millis() as u64);
                set
            } else {
                let mut del = redis::cmd("DEL");
                del.arg(&record);
                del
            };
            node.query::<redis::Value>(&write).await?;
            let mut publish = redis::cmd("PUBLISH");
            publish.arg(&channel).arg(&text);
            node.query::<redis::Value>(&publish).await
        })
        .await;
    if let Ok(Err(error)) = sent {
        tracing::debug!(%error, "an election's news was not announced");
    }
}

/// Who leads the election whose lock is `lock_name`, read from the lock itself (its holder
/// and fencing token: the hash of a fenced lock) and the record its leader wrote. Uses only
/// commands a user restricted by `LockManager::acl_rules` may send.
pub(super) async fn leader_of(
    manager: &LockManager,
    lock_name: &str,
) -> Result<Option<LeaderInfo>, LockError> {
    let keys = Keys::new(&manager.inner.prefix, lock_name.to_owned())?;
    let registry = Arc::clone(&manager.inner.registry);
    let read = move |backend: crate::backend::Backend| async move {
        let node = backend.inspected();
        let fields: Vec<String> = node.query(redis::cmd("HKEYS").arg(&keys.lock)).await?;
        let Some(token) = fields.into_iter().find(|field| {
            !matches!(field.as_str(), "mode" | "permits" | "fence" | "min_hold")
                && !field.starts_with("h:")
        }) else {
            return Ok(None);
        };
        let term: Option<u64> = node
            .query(redis::cmd("HGET").arg(&keys.lock).arg("fence"))
            .await?;
        let record: Option<String> = node.query(redis::cmd("GET").arg(channel(&keys))).await?;
        let since = match record.as_deref().and_then(News::decode) {
            Some(News::Elected {
                token: recorded,
                since,
                ..
            }) if recorded == token => UNIX_EPOCH.checked_add(Duration::from_millis(since)),
            _ => None,
        };
        let identity = registry.lookup(&backend, &token).await.ok().flatten();
        Ok::<_, redis::RedisError>(Some(LeaderInfo {
            term: term.unwrap_or_default(),
            token,
            identity,
            since,
        }))
    };
    manager
        .inner
        .on_runtime(read)
        .await?
        .map_err(|e| LockError::redis(lock_name, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn news_reads_back_as_written() {
        for news in [
            News::Elected {
                term: 7,
                token: "ab".repeat(16),
                since: 1_700_000_000_000,
            },
            News::Resigned {
                term: 7,
                token: "ab".repeat(16),
            },
        ] {
            assert_eq!(News::decode(&news.encode()), Some(news));
        }
        for text in [
            "",
            "elected",
            "elected x t 1",
            "resigned 1",
            "elected 1 t 1 extra",
        ] {
            assert_eq!(News::decode(text), None, "{text:?}");
        }
    }
}
