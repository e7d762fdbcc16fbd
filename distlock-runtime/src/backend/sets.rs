//! Sets of locks taken together: one script per server for the whole set, one per hash slot
//! on Cluster (in a fixed global order, with rollback), the quorum rule with RedLock.

use std::io;
use std::time::Duration;

use redis::RedisResult;

use super::messages::AcquireAnswer;
use super::node::Node;
use super::redlock::{RedLock, if_eligible, node_limit, sooner};
use crate::scripts;

/// One lock of a set: its key, fencing counter and wake channel, and, in a release, how
/// much longer the key must live (a `min_hold` of a hold nested in the set's; zero otherwise).
#[derive(Debug, Clone)]
pub(crate) struct SetKey {
    pub(crate) lock: String,
    pub(crate) fence: String,
    pub(crate) wake: String,
    pub(crate) keep: Duration,
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

impl Node {
    /// One attempt at a whole set: one script call, or on Cluster one per hash slot.
    pub(crate) async fn acquire_set(
        &self,
        req: &SetRequest,
    ) -> RedisResult<AcquireAnswer<Vec<u64>>> {
        let locks = req.keys.iter().map(|k| k.lock.as_str());
        let Some(groups) = self.route.slot_groups(locks) else {
            return self.acquire_together(req).await;
        };
        let mut fences = vec![0; req.keys.len()];
        for (taken, group) in groups.iter().enumerate() {
            let answer = self.acquire_together(&req.part(group)).await;
            let outcome = match answer {
                Ok(AcquireAnswer::Held(got)) => {
                    for (&at, fence) in group.iter().zip(got) {
                        fences[at] = fence;
                    }
                    continue;
                }
                Ok(AcquireAnswer::Busy { at, holder_ttl, .. }) => Ok(AcquireAnswer::Busy {
                    at: group[at],
                    holder_ttl,
                    holder: None,
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
            if !given_back.is_empty()
                && let Err(error) = self.release_set(&req.part(&given_back)).await
            {
                // Not given back: the attempt answers as one whose reply was lost, so that
                // the request's cover gives the groups back through the release path.
                return Err(error);
            }
            return outcome.map_err(|(error, _)| error);
        }
        Ok(AcquireAnswer::Held(fences))
    }

    /// One script call for locks that all live in one hash slot (any locks, off Cluster).
    async fn acquire_together(&self, req: &SetRequest) -> RedisResult<AcquireAnswer<Vec<u64>>> {
        let call = scripts::set_acquire(
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
            return set_answer(&answer);
        };
        if !self.route.one_server() {
            // On Cluster, the WAIT follows the grant on its slot's lane (see
            // `Node::acquire_replicated_cluster`): each slot group waits on its own master.
            let mut conn = self.conn().await?;
            let answer: Vec<i64> = self.watch(self.bounded(call.invoke_async(&mut conn)).await)?;
            let attempt = set_answer(&answer)?;
            if matches!(attempt, AcquireAnswer::Held(_)) {
                let acked = self.wait_replicas(&mut conn, wanted, timeout).await?;
                if acked < wanted {
                    self.release_set(req).await?;
                    return Ok(AcquireAnswer::Unreplicated { acked, wanted });
                }
            }
            return Ok(attempt);
        }
        // As for one lock: the grant and its WAIT on a connection of their own.
        let mut conn = self.replicated_conn().await?;
        let answer: Vec<i64> = self.watch(self.bounded(call.invoke_async(&mut conn)).await)?;
        let attempt = set_answer(&answer)?;
        if matches!(attempt, AcquireAnswer::Held(_)) {
            let acked = self.wait_replicas(&mut conn, wanted, timeout).await?;
            self.pool.put_back(conn);
            if acked < wanted {
                self.release_set(req).await?;
                return Ok(AcquireAnswer::Unreplicated { acked, wanted });
            }
        } else {
            self.pool.put_back(conn);
        }
        Ok(attempt)
    }

    /// Gives back every lock of a set that `req.token` holds; one `true` per lock given back.
    pub(crate) async fn release_set(&self, req: &SetRequest) -> RedisResult<Vec<bool>> {
        let locks = req.keys.iter().map(|k| k.lock.as_str());
        let release = |group: &[usize]| {
            let part = req.part(group);
            async move { self.release_together(&part).await }
        };
        self.route.per_slot(locks, release).await
    }

    /// Gives back the locks of a set that all live in one hash slot (any locks, off Cluster)
    /// in one call.
    async fn release_together(&self, req: &SetRequest) -> RedisResult<Vec<bool>> {
        let mut conn = self.conn().await?;
        let call = scripts::set_release(
            req.keys
                .iter()
                .map(|key| (key.lock.as_str(), key.wake.as_str(), key.keep)),
            &req.token,
            self.wakes(),
        );
        let released: Vec<i64> = self.watch(self.bounded(call.invoke_async(&mut conn)).await)?;
        Ok(released.into_iter().map(|r| r == 1).collect())
    }
}

/// The answer of the set script: `{1, fence…}` or `{0, index (1-based), pttl}`.
fn set_answer(answer: &[i64]) -> RedisResult<AcquireAnswer<Vec<u64>>> {
    match answer {
        [1, fences @ ..] => Ok(AcquireAnswer::Held(
            fences
                .iter()
                .map(|&f| u64::try_from(f).unwrap_or(0))
                .collect(),
        )),
        [0, at, pttl] => Ok(AcquireAnswer::Busy {
            at: usize::try_from(*at - 1).unwrap_or(0),
            holder_ttl: u64::try_from(*pttl).ok().map(Duration::from_millis),
            holder: None,
        }),
        _ => Err(io::Error::other("unexpected answer from the set script").into()),
    }
}

impl RedLock {
    /// One attempt at a set; with several masters, held when a majority granted the whole
    /// set and the lease left is positive, given back on every master otherwise.
    pub(crate) async fn acquire_set(
        &self,
        req: &SetRequest,
    ) -> RedisResult<AcquireAnswer<Vec<u64>>> {
        let limit = node_limit(req.lease);
        let started = std::time::Instant::now();
        let answers = self
            .on_all(limit, |node| if_eligible(node, node.acquire_set(req)))
            .await;
        let elapsed = started.elapsed();
        let mut tally = self.tally();
        let mut held = 0;
        let (mut busy_at, mut busy_for) = (None, None::<Duration>);
        for attempt in answers.into_iter().filter_map(|answer| tally.count(answer)) {
            match attempt {
                AcquireAnswer::Held(_) => held += 1,
                AcquireAnswer::Busy { at, holder_ttl, .. } => {
                    busy_at.get_or_insert(at);
                    busy_for = sooner(busy_for, holder_ttl);
                }
                // Replication is not combined with several masters; sets ask for no permits.
                AcquireAnswer::Unreplicated { .. } | AcquireAnswer::PermitsMismatch { .. } => {}
            }
        }
        if tally.granted(held, elapsed, req.lease) {
            // Fencing is not available with several masters: no token to report.
            return Ok(AcquireAnswer::Held(vec![0; req.keys.len()]));
        }
        if tally.maybe_granted(held) {
            self.on_all(limit, |n| n.release_set(req)).await;
        }
        tally.outcome(AcquireAnswer::Busy {
            at: busy_at.unwrap_or(0),
            holder_ttl: busy_for,
            holder: None,
        })
    }

    /// Gives back a set; with several masters, a lock counts as given back unless a majority
    /// positively did not hold it.
    pub(crate) async fn release_set(&self, req: &SetRequest) -> RedisResult<Vec<bool>> {
        let answers = self
            .on_all(node_limit(req.lease), |n| n.release_set(req))
            .await;
        let not_held = self.tally().each(answers, req.keys.len(), false)?;
        Ok(not_held.into_iter().map(|lost| !lost).collect())
    }
}
