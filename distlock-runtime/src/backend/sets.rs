//! Sets of locks taken together: one script per server for the whole set, one per hash slot
//! on Cluster (in a fixed global order, with rollback), the quorum rule with RedLock.

use std::collections::BTreeMap;
use std::io;
use std::time::Duration;

use futures_util::future::join_all;
use redis::RedisResult;

use super::hold::millis;
use super::node::{Node, bounded};
use super::redlock::{RedLock, node_limit};
use crate::scripts;

/// One lock of a set: its key, fencing counter and wake channel.
#[derive(Debug, Clone)]
pub(crate) struct SetKey {
    pub(crate) lock: String,
    pub(crate) fence: String,
    pub(crate) wake: String,
}

/// Everything one attempt at a set sends. Every lock of the set is written as a first
/// exclusive hold of `token`, exactly as a single exclusive lock is.
#[derive(Debug, Clone)]
pub(crate) struct SetRequest {
    pub(crate) keys: Vec<SetKey>,
    pub(crate) token: String,
    pub(crate) lease: Duration,
    pub(crate) fencing: bool,
}

/// The answer to one attempt at a set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SetAttempt {
    /// Every lock is held; one fencing token per lock, in the request's order (0 without).
    Held { fences: Vec<u64> },
    /// Nothing is held: lock `at` (an index into the request) is held by another owner for
    /// about `holder_ttl` more.
    Busy {
        at: usize,
        holder_ttl: Option<Duration>,
    },
    /// Granted, but fewer replicas than asked acknowledged it: already given back.
    Unreplicated { acked: u32, wanted: u32 },
}

impl SetRequest {
    /// The same request restricted to the locks at `indices`.
    fn part(&self, indices: &[usize]) -> Self {
        Self {
            keys: indices.iter().map(|&i| self.keys[i].clone()).collect(),
            token: self.token.clone(),
            lease: self.lease,
            fencing: self.fencing,
        }
    }
}

/// The Cluster hash slot of `key`: CRC16 (XMODEM) of its hash tag (or of the whole key
/// without one), modulo 16384. (`redis::cluster_routing::Slot` does not expose its number,
/// and the global order needs one.)
fn slot_of(key: &str) -> u16 {
    let key = key.as_bytes();
    let tag = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let close = key[open..].iter().position(|&b| b == b'}')?;
            Some(&key[open + 1..open + close])
        })
        .filter(|tag| !tag.is_empty())
        .unwrap_or(key);
    let mut crc: u16 = 0;
    for &byte in tag {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

/// The locks of `keys` grouped by hash slot, slots in ascending order, each group sorted by
/// key: the one order every client takes them in.
fn by_slot<'a>(keys: impl Iterator<Item = &'a str>) -> Vec<Vec<usize>> {
    let mut groups: BTreeMap<u16, Vec<(&str, usize)>> = BTreeMap::new();
    for (at, key) in keys.enumerate() {
        groups.entry(slot_of(key)).or_default().push((key, at));
    }
    groups
        .into_values()
        .map(|mut group| {
            group.sort_unstable();
            group.into_iter().map(|(_, at)| at).collect()
        })
        .collect()
}

impl Node {
    /// One attempt at a whole set: one script call, or on Cluster one per hash slot.
    pub(crate) async fn acquire_set(&self, req: &SetRequest) -> RedisResult<SetAttempt> {
        if !self.is_cluster() {
            return self.acquire_together(req).await;
        }
        let groups = by_slot(req.keys.iter().map(|k| k.lock.as_str()));
        let mut fences = vec![0; req.keys.len()];
        for (taken, group) in groups.iter().enumerate() {
            let answer = self.acquire_together(&req.part(group)).await;
            let outcome = match answer {
                Ok(SetAttempt::Held { fences: got }) => {
                    for (&at, fence) in group.iter().zip(got) {
                        fences[at] = fence;
                    }
                    continue;
                }
                Ok(SetAttempt::Busy { at, holder_ttl }) => Ok(SetAttempt::Busy {
                    at: group[at],
                    holder_ttl,
                }),
                Ok(other) => Ok(other),
                // The reply may be lost after a grant: that group is given back too.
                Err(error) => Err((error, taken + 1)),
            };
            let undo = match &outcome {
                Ok(_) => taken,
                Err((_, through)) => *through,
            };
            let given_back: Vec<usize> = groups[..undo].iter().flatten().copied().collect();
            if !given_back.is_empty() {
                // Best effort: what is not given back here ends with its lease.
                let _ = self.release_set(&req.part(&given_back)).await;
            }
            return outcome.map_err(|(error, _)| error);
        }
        Ok(SetAttempt::Held { fences })
    }

    /// One script call for locks that all live in one hash slot (any locks, off Cluster).
    async fn acquire_together(&self, req: &SetRequest) -> RedisResult<SetAttempt> {
        let call = scripts::multi_acquire(
            req.keys
                .iter()
                .map(|key| (key.lock.as_str(), key.fence.as_str())),
            &req.token,
            req.lease,
            req.fencing,
        );
        let Some((wanted, timeout)) = self.pool.sync_replicas else {
            let mut conn = self.conn().await?;
            let answer: Vec<i64> = self.watch(self.bounded(call.invoke_async(&mut conn)).await)?;
            return set_attempt(&answer);
        };
        // As for one lock: the grant and its WAIT on a connection of their own.
        let mut conn = self.replicated_conn().await?;
        let answer: Vec<i64> = self.watch(self.bounded(call.invoke_async(&mut conn)).await)?;
        let attempt = set_attempt(&answer)?;
        if matches!(attempt, SetAttempt::Held { .. }) {
            let wait = redis::cmd("WAIT")
                .arg(wanted)
                .arg(millis(timeout))
                .to_owned();
            let limit = self.pool.response_timeout + timeout;
            let acked: i64 = self.watch(bounded(limit, wait.query_async(&mut conn)).await)?;
            self.put_back(conn);
            let acked = u32::try_from(acked).unwrap_or(0);
            if acked < wanted {
                self.release_set(req).await?;
                return Ok(SetAttempt::Unreplicated { acked, wanted });
            }
        } else {
            self.put_back(conn);
        }
        Ok(attempt)
    }

    /// Gives back every lock of a set that `req.token` holds; one `true` per lock given back.
    pub(crate) async fn release_set(&self, req: &SetRequest) -> RedisResult<Vec<bool>> {
        if !self.is_cluster() {
            return self.release_together(req).await;
        }
        let groups = by_slot(req.keys.iter().map(|k| k.lock.as_str()));
        let calls = groups.iter().map(|group| {
            let part = req.part(group);
            async move { self.release_together(&part).await }
        });
        let mut released = vec![false; req.keys.len()];
        for (group, answer) in groups.iter().zip(join_all(calls).await) {
            for (&at, yes) in group.iter().zip(answer?) {
                released[at] = yes;
            }
        }
        Ok(released)
    }

    async fn release_together(&self, req: &SetRequest) -> RedisResult<Vec<bool>> {
        let mut conn = self.conn().await?;
        let call = scripts::multi_release(
            req.keys
                .iter()
                .map(|key| (key.lock.as_str(), key.wake.as_str())),
            &req.token,
        );
        let released: Vec<i64> = self.watch(self.bounded(call.invoke_async(&mut conn)).await)?;
        Ok(released.into_iter().map(|r| r == 1).collect())
    }
}

/// The answer of the set script: `{1, fence…}` or `{0, index (1-based), pttl}`.
fn set_attempt(answer: &[i64]) -> RedisResult<SetAttempt> {
    match answer {
        [1, fences @ ..] => Ok(SetAttempt::Held {
            fences: fences
                .iter()
                .map(|&f| u64::try_from(f).unwrap_or(0))
                .collect(),
        }),
        [0, at, pttl] => Ok(SetAttempt::Busy {
            at: usize::try_from(*at - 1).unwrap_or(0),
            holder_ttl: u64::try_from(*pttl).ok().map(Duration::from_millis),
        }),
        _ => Err(io::Error::other("unexpected answer from the set script").into()),
    }
}

impl RedLock {
    /// One attempt at a set; with several masters, held when a majority granted the whole
    /// set and the lease left is positive, given back on every master otherwise.
    pub(crate) async fn acquire_set(&self, req: &SetRequest) -> RedisResult<SetAttempt> {
        let limit = node_limit(req.lease);
        let started = std::time::Instant::now();
        let answers = self.on_eligible(limit, |node| node.acquire_set(req)).await;
        let elapsed = started.elapsed();
        let drift = req.lease / 100 + Duration::from_millis(2);
        let (mut held, mut failed) = (0, 0);
        let (mut busy_at, mut busy_for) = (None, None::<Duration>);
        let mut error = None;
        for answer in answers {
            match answer {
                Ok(SetAttempt::Held { .. }) => held += 1,
                Ok(SetAttempt::Busy { at, holder_ttl }) => {
                    busy_at.get_or_insert(at);
                    busy_for = match (busy_for, holder_ttl) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                }
                // Replication is not combined with several masters.
                Ok(SetAttempt::Unreplicated { .. }) => {}
                Err(e) => {
                    failed += 1;
                    error = Some(e);
                }
            }
        }
        if held >= self.quorum && elapsed + drift < req.lease {
            // Fencing is not available with several masters: no token to report.
            return Ok(SetAttempt::Held {
                fences: vec![0; req.keys.len()],
            });
        }
        if held > 0 || failed > 0 {
            let releases = self
                .nodes
                .iter()
                .map(|n| bounded(limit, n.release_set(req)));
            join_all(releases).await;
        }
        match error {
            Some(error) if self.nodes.len() - failed < self.quorum => Err(error),
            _ => Ok(SetAttempt::Busy {
                at: busy_at.unwrap_or(0),
                holder_ttl: busy_for,
            }),
        }
    }

    /// Gives back a set; with several masters, a lock counts as given back unless a majority
    /// positively did not hold it.
    pub(crate) async fn release_set(&self, req: &SetRequest) -> RedisResult<Vec<bool>> {
        let limit = node_limit(req.lease);
        let answers = join_all(
            self.nodes
                .iter()
                .map(|n| bounded(limit, n.release_set(req))),
        )
        .await;
        let mut not_held = vec![0usize; req.keys.len()];
        let (mut answered, mut error) = (0, None);
        for answer in answers {
            match answer {
                Ok(released) => {
                    answered += 1;
                    for (count, yes) in not_held.iter_mut().zip(released) {
                        *count += usize::from(!yes);
                    }
                }
                Err(e) => error = Some(e),
            }
        }
        match error {
            Some(error) if answered < self.quorum => Err(error),
            _ => Ok(not_held.into_iter().map(|n| n < self.quorum).collect()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::cluster_routing::Slot;

    #[test]
    fn slots_are_the_ones_redis_computes() {
        for key in [
            "p:{a}",
            "p:{order:42}",
            "p:{a{b}",
            "p:{}x",
            "plain",
            "p:{a%7Db}~",
            "{x}:fence",
        ] {
            assert_eq!(Slot::new(slot_of(key)), Some(Slot::for_key(key)), "{key}");
        }
        // A known value: CLUSTER KEYSLOT foo = 12182.
        assert_eq!(slot_of("foo"), 12182);
    }

    #[test]
    fn slots_come_in_one_global_order() {
        let keys = ["p:{b}", "p:{a}", "p:{c}", "p:{a}x"];
        let groups = by_slot(keys.iter().copied());
        let slots: Vec<u16> = groups.iter().map(|g| slot_of(keys[g[0]])).collect();
        assert!(slots.windows(2).all(|w| w[0] < w[1]), "{slots:?}");
        // The same set listed in another order gives the same sequence of keys.
        let reversed: Vec<&str> = keys.iter().rev().copied().collect();
        let again = by_slot(reversed.iter().copied());
        let names = |groups: &[Vec<usize>], keys: &[&str]| -> Vec<String> {
            groups
                .iter()
                .flatten()
                .map(|&i| keys[i].to_owned())
                .collect()
        };
        assert_eq!(names(&groups, &keys), names(&again, &reversed));
    }
}
