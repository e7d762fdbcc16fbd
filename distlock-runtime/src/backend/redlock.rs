//! RedLock: independent masters, and the majority rule. Every operation goes to all of them
//! at once and counts only with a majority: an acquisition holds when a majority granted it
//! and the lease left (TTL − elapsed − drift) is positive, and is given back on every master
//! otherwise; release, extend and renewal succeed with a majority. A master that restarted
//! (a new run_id: it forgot its locks) stays out of quorums for a while.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::future::join_all;
use futures_util::stream::FuturesUnordered;
use redis::RedisResult;
use tokio::runtime;

use super::hold::{AcquireRequest, Attempt, HoldIds, Renewal};
use super::node::{ConnectOptions, Node, bounded};

/// Several independent masters, a majority of which must agree.
#[derive(Clone, Debug)]
pub(super) struct RedLock {
    pub(super) nodes: Arc<[Node]>,
    pub(super) quorum: usize,
}

impl RedLock {
    /// Connects to every master; a majority must answer.
    pub(super) async fn connect(urls: &[String], options: ConnectOptions) -> RedisResult<Self> {
        let nodes = urls
            .iter()
            .map(|url| Node::new(url, options.clone()))
            .collect::<RedisResult<Vec<_>>>()?;
        let quorum = majority_of(nodes.len());
        let loaded = join_all(nodes.iter().map(Node::load_scripts)).await;
        let reachable = loaded.iter().filter(|r| r.is_ok()).count();
        if reachable < quorum {
            let first = loaded.into_iter().find_map(Result::err);
            return Err(first.unwrap_or_else(|| io::Error::other("no node reachable").into()));
        }
        let unchecked = nodes.iter().filter(|n| n.identity_unchecked()).count();
        if unchecked > 0 {
            tracing::warn!(
                masters = unchecked,
                "INFO is denied to this user: a RedLock master that restarts (and forgets its \
                 locks) cannot be noticed and kept out of quorums; allow `+info` to check"
            );
        }
        Ok(Self {
            nodes: nodes.into(),
            quorum,
        })
    }

    /// Runs `op` on every master at once, each bounded by `limit`; a master kept out of
    /// quorums after a restart answers with an error instead.
    pub(crate) async fn on_eligible<'a, T, Fut>(
        &'a self,
        limit: Duration,
        op: impl Fn(&'a Node) -> Fut,
    ) -> Vec<RedisResult<T>>
    where
        Fut: Future<Output = RedisResult<T>>,
    {
        // The check that a master did not restart is part of its attempt, and within the same
        // bound: a master that does not answer it costs no more than one that does not answer
        // the attempt.
        let op = &op;
        let attempts = self.nodes.iter().map(|node| {
            bounded(limit, async move {
                if node.eligible().await {
                    op(node).await
                } else {
                    Err(io::Error::other("master out of quorum after a restart").into())
                }
            })
        });
        join_all(attempts).await
    }

    /// One acquire attempt.
    pub(crate) async fn acquire(&self, req: &AcquireRequest) -> RedisResult<Attempt> {
        let limit = node_limit(req.lease);
        let started = std::time::Instant::now();
        let answers = self.on_eligible(limit, |node| node.acquire(req)).await;
        let elapsed = started.elapsed();
        let drift = req.lease / 100 + Duration::from_millis(2);
        let mut held = 0;
        let mut fence = 0;
        let mut busy_for: Option<Duration> = None;
        let mut holder: Option<[u64; 2]> = None;
        let mut error = None;
        let mut failed = 0;
        for answer in answers {
            match answer {
                Ok(Attempt::Held { fence: f }) => {
                    held += 1;
                    fence = fence.max(f);
                }
                // Semaphores are not available with several masters: no mismatch comes here.
                Ok(Attempt::Unreplicated { .. } | Attempt::PermitsMismatch { .. }) => {}
                Ok(Attempt::Busy {
                    holder_ttl,
                    holder: named,
                }) => {
                    holder = holder.or(named);
                    // A master whose copy is gone since (another waiter's minority grant,
                    // given back) is free there, not a holder about to leave: it bounds
                    // nothing, or every waiter would go round at once while the majority's
                    // holder keeps its lease.
                    let holder_ttl = holder_ttl.filter(|ttl| !ttl.is_zero());
                    busy_for = match (busy_for, holder_ttl) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                }
                Err(e) => {
                    failed += 1;
                    error = Some(e);
                }
            }
        }
        if held >= self.quorum && elapsed + drift < req.lease {
            return Ok(Attempt::Held { fence });
        }
        // Not held: give back whatever was granted, on every node, before answering. A node
        // that did not answer in time may still apply the grant late: it is told too.
        if held > 0 || failed > 0 {
            let ids = req.hold_ids();
            let releases = self
                .nodes
                .iter()
                .map(|n| bounded(limit, n.release(&ids, Duration::ZERO)));
            join_all(releases).await;
        }
        // Too few answers to call it busy: report why.
        match error {
            Some(error) if self.nodes.len() - failed < self.quorum => Err(error),
            _ => Ok(Attempt::Busy {
                holder_ttl: busy_for,
                holder,
            }),
        }
    }

    /// Gives back one hold; with several nodes, `false` only when a majority did not hold it.
    ///
    /// With several nodes it answers as soon as the answers so far decide the outcome, and
    /// leaves the slower nodes' releases to finish in the background: one frozen master does
    /// not hold up the release (its copy of the lock ends with its lease otherwise).
    pub(crate) async fn release(&self, ids: &HoldIds, keep: Duration) -> RedisResult<bool> {
        // One copy of the ids for all masters (the stragglers may outlive the caller).
        let shared = Arc::new(ids.clone());
        let mut pending: FuturesUnordered<_> = self
            .nodes
            .iter()
            .map(|node| {
                let (node, ids) = (node.clone(), shared.clone());
                async move { node.release(&ids, keep).await }
            })
            .collect();
        // Lost only when a majority positively did not hold it: a node that is down, or one
        // that never granted this hold, is not evidence that the lease ended.
        let (mut not_held, mut answered, mut error) = (0, 0, None);
        while let Some(answer) = pending.next().await {
            match answer {
                Ok(released) => {
                    answered += 1;
                    not_held += usize::from(!released);
                }
                Err(e) => error = Some(e),
            }
            let decided = not_held >= self.quorum || not_held + pending.len() < self.quorum;
            if answered >= self.quorum && decided && !pending.is_empty() {
                if let Ok(runtime) = runtime::Handle::try_current() {
                    drop(runtime.spawn(async move { while pending.next().await.is_some() {} }));
                }
                break;
            }
        }
        match error {
            Some(error) if answered < self.quorum => Err(error),
            _ => Ok(not_held < self.quorum),
        }
    }

    /// Sets the lease; with several nodes, `true` when a majority set it.
    pub(crate) async fn extend(
        &self,
        lock: &str,
        share: Option<&str>,
        token: &str,
        lease: Duration,
    ) -> RedisResult<bool> {
        let limit = node_limit(lease);
        let answers = join_all(
            self.nodes
                .iter()
                .map(|n| bounded(limit, n.extend(lock, share, token, lease))),
        )
        .await;
        self.majority(answers)
    }

    /// Renews a batch; with several nodes, a lease counts as renewed on a majority.
    pub(crate) async fn renew(&self, items: &[Renewal<'_>]) -> RedisResult<Vec<bool>> {
        // Bounded by the shortest lease in the batch: a renewal that waited the full response
        // timeout for a frozen master would end after the leases it renews.
        let shortest = items.iter().map(|i| i.lease).min().unwrap_or_default();
        let limit = node_limit(shortest);
        let answers = join_all(self.nodes.iter().map(|n| bounded(limit, n.renew(items)))).await;
        let mut counts = vec![0usize; items.len()];
        let mut error = None;
        let mut answered = 0;
        for answer in answers {
            match answer {
                Ok(renewed) => {
                    answered += 1;
                    for (count, yes) in counts.iter_mut().zip(renewed) {
                        *count += usize::from(yes);
                    }
                }
                Err(e) => error = Some(e),
            }
        }
        match error {
            Some(error) if answered < self.quorum => Err(error),
            _ => Ok(counts.into_iter().map(|c| c >= self.quorum).collect()),
        }
    }

    /// Whether the token holds the lock (on a majority).
    pub(crate) async fn holds(
        &self,
        lock: &str,
        share: Option<&str>,
        token: &str,
    ) -> RedisResult<bool> {
        let answers = join_all(self.nodes.iter().map(|n| n.holds(lock, share, token))).await;
        self.majority(answers)
    }

    /// Sends `cmd` to every master and returns each node's answers (see
    /// [`Node::ask_masters`]).
    pub(crate) async fn ask_masters(
        &self,
        cmds: &[redis::Cmd],
    ) -> Vec<RedisResult<(usize, Vec<(String, redis::Value)>)>> {
        join_all(self.nodes.iter().map(|n| n.ask_masters(cmds))).await
    }

    /// `true` with a majority of yes; an error when too few nodes answered to know.
    fn majority(&self, answers: Vec<RedisResult<bool>>) -> RedisResult<bool> {
        let mut yes = 0;
        let mut answered = 0;
        let mut error = None;
        for answer in answers {
            match answer {
                Ok(v) => {
                    answered += 1;
                    yes += usize::from(v);
                }
                Err(e) => error = Some(e),
            }
        }
        match error {
            Some(error) if yes < self.quorum && answered < self.quorum => Err(error),
            _ => Ok(yes >= self.quorum),
        }
    }
}

/// How many of `masters` make a majority.
pub(super) fn majority_of(masters: usize) -> usize {
    masters / 2 + 1
}

/// How long one RedLock master may take over its part of an operation on a lease of `lease`:
/// a small part of the lease, so that a master that does not answer is counted as failed
/// while the lease can still be used (or renewed) on the others.
pub(super) fn node_limit(lease: Duration) -> Duration {
    (lease / 10).clamp(Duration::from_millis(10), Duration::from_secs(1))
}
