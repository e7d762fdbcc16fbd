//! The check `build` makes once connected: a master whose `maxmemory-policy` may evict a
//! held lock is warned about, or refused with `require_noeviction`.

use crate::backend::{self, Backend};
use crate::error::LockError;

/// Reads every master's `maxmemory-policy` (CONFIG GET, else INFO memory) and warns about, or
/// with `require` refuses, any policy that may evict a held lock.
pub(super) async fn check_eviction(backend: &Backend, require: bool) -> Result<(), LockError> {
    let config = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .to_owned();
    let info = redis::cmd("INFO").arg("memory").to_owned();
    let mut unknown = 0;
    for answer in backend.ask_masters(&[config, info]).await {
        let policies = match answer {
            Ok((0, masters)) => config_policies(masters),
            Ok((_, masters)) => info_policies(masters),
            Err(error) if backend::denied(&error) => {
                unknown += 1;
                continue;
            }
            // An unreachable RedLock minority, or an answer late on a busy server: not knowing
            // its policy is no reason to fail.
            Err(error) => {
                tracing::debug!(%error, "maxmemory-policy not read");
                continue;
            }
        };
        for (master, policy) in policies {
            if policy == "noeviction" {
                continue;
            }
            if require {
                return Err(LockError::Config(format!(
                    "`require_noeviction`: the master at {master} has maxmemory-policy \
                     `{policy}`, which may evict held locks; set it to `noeviction`"
                )));
            }
            tracing::warn!(
                %master,
                %policy,
                "maxmemory-policy may evict held locks under memory pressure: set it to \
                 `noeviction` (or use `require_noeviction` to refuse)"
            );
        }
    }
    if unknown > 0 {
        if require {
            return Err(LockError::Config(
                "`require_noeviction`: maxmemory-policy cannot be read (CONFIG GET and INFO \
                 are denied to this user)"
                    .into(),
            ));
        }
        tracing::warn!(
            "maxmemory-policy could not be checked (CONFIG GET and INFO are denied to this \
             user): under memory pressure, a policy other than `noeviction` may evict held locks"
        );
    }
    Ok(())
}

/// `(master, policy)` from CONFIG GET answers (a map in RESP3, a pair in RESP2).
fn config_policies(masters: Vec<(String, redis::Value)>) -> Vec<(String, String)> {
    masters
        .into_iter()
        .filter_map(|(master, value)| {
            let pairs: std::collections::HashMap<String, String> =
                redis::from_redis_value(value).ok()?;
            Some((master, pairs.get("maxmemory-policy")?.clone()))
        })
        .collect()
}

/// `(master, policy)` from INFO memory answers.
fn info_policies(masters: Vec<(String, redis::Value)>) -> Vec<(String, String)> {
    masters
        .into_iter()
        .filter_map(|(master, value)| {
            let text: String = redis::from_redis_value(value).ok()?;
            let policy = text
                .lines()
                .find_map(|line| line.strip_prefix("maxmemory_policy:"))?;
            Some((master, policy.trim().to_owned()))
        })
        .collect()
}
