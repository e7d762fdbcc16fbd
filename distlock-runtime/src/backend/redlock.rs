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
use redis::{RedisError, RedisResult};
use tokio::runtime;

use super::connect::ConnectOptions;
use super::messages::{AcquireAnswer, AcquireRequest, HoldIds, HoldRef, Renewal};
use super::node::Node;
use super::pool::bounded;

/// Several independent masters, a majority of which must agree.
#[derive(Clone, Debug)]
pub(super) struct RedLock {
    pub(super) nodes: Arc<[Node]>,
    /// The quorum, and where a release that may not have reached every master is sent once
    /// more (one pointer: every backend handle carries this struct).
    shared: Arc<Shared>,
}

/// What the masters' handles share.
#[derive(Debug)]
struct Shared {
    quorum: usize,
    /// The manager's runtime, and how long after a request its socket may still deliver it.
    background: runtime::Handle,
    late: Duration,
}

impl RedLock {
    /// Connects to every master; a majority must answer.
    pub(super) async fn connect(urls: &[String], options: ConnectOptions) -> RedisResult<Self> {
        let background = options.background.clone();
        let response = options.response_timeout;
        let late = crate::security::socket_timeouts(response).unacknowledged + response;
        let nodes = urls
            .iter()
            .map(|url| Node::server(url, options.clone()))
            .collect::<RedisResult<Vec<_>>>()?;
        let quorum = majority_of(nodes.len());
        let loaded = join_all(nodes.iter().map(Node::load_scripts)).await;
        let reachable = loaded.iter().filter(|r| r.is_ok()).count();
        if reachable < quorum {
            let first = loaded.into_iter().find_map(Result::err);
            return Err(first.unwrap_or_else(|| io::Error::other("no node reachable").into()));
        }
        let unchecked = nodes.iter().filter(|n| n.restarts_unchecked()).count();
        if unchecked > 0 {
            tracing::warn!(
                masters = unchecked,
                "INFO is denied to this user: a RedLock master that restarts (and forgets its \
                 locks) cannot be noticed and kept out of quorums; allow `+info` to check"
            );
        }
        Ok(Self {
            nodes: nodes.into(),
            shared: Arc::new(Shared {
                quorum,
                background,
                late,
            }),
        })
    }

    /// Counts the masters' answers to one operation against this quorum.
    pub(super) fn tally(&self) -> Tally {
        Tally {
            quorum: self.shared.quorum,
            answered: 0,
            error: None,
        }
    }

    /// Runs `op` on every master at once, each bounded by `limit`.
    pub(super) async fn on_all<'a, T, Fut>(
        &'a self,
        limit: Duration,
        op: impl Fn(&'a Node) -> Fut,
    ) -> Vec<RedisResult<T>>
    where
        Fut: Future<Output = RedisResult<T>>,
    {
        join_all(self.nodes.iter().map(|node| bounded(limit, op(node)))).await
    }

    /// One acquire attempt.
    pub(crate) async fn acquire(&self, req: &AcquireRequest) -> RedisResult<AcquireAnswer> {
        let limit = node_limit(req.lease);
        let started = std::time::Instant::now();
        let answers = self
            .on_all(limit, |node| if_eligible(node, node.acquire(req)))
            .await;
        let elapsed = started.elapsed();
        let mut tally = self.tally();
        let (mut held, mut fence) = (0, 0);
        let mut busy_for: Option<Duration> = None;
        let mut holder: Option<[u64; 2]> = None;
        for attempt in answers.into_iter().filter_map(|answer| tally.count(answer)) {
            match attempt {
                AcquireAnswer::Held(f) => {
                    held += 1;
                    fence = fence.max(f);
                }
                // Semaphores are not available with several masters: no mismatch comes here.
                AcquireAnswer::Unreplicated { .. } | AcquireAnswer::PermitsMismatch { .. } => {}
                AcquireAnswer::Busy {
                    holder_ttl,
                    holder: named,
                    ..
                } => {
                    holder = holder.or(named);
                    // A master whose copy is gone since (another waiter's minority grant,
                    // given back) is free there, not a holder about to leave: it bounds
                    // nothing, or every waiter would go round at once while the majority's
                    // holder keeps its lease.
                    busy_for = sooner(busy_for, holder_ttl.filter(|ttl| !ttl.is_zero()));
                }
            }
        }
        if tally.granted(held, elapsed, req.lease) {
            return Ok(AcquireAnswer::Held(fence));
        }
        // Not held: give back whatever was granted, on every node, before answering.
        if tally.maybe_granted(held) {
            self.give_back(req.hold_ids(), limit).await;
        }
        // Too few answers to call it busy: report why.
        tally.outcome(AcquireAnswer::Busy {
            at: 0,
            holder_ttl: busy_for,
            holder,
        })
    }

    /// Gives back a grant that does not stand, on every node: waits up to `limit` for the
    /// answers, and leaves a slower node's release to finish on the caller's runtime instead
    /// of dropping it (a dropped one could leave that node's copy until its lease ends).
    ///
    /// Never sent again later: the request's next attempt carries the same token, and a
    /// late copy of this give-back would take away what that attempt won. Whatever is left
    /// when the request ends is the request's cover's to give back.
    async fn give_back(&self, ids: HoldIds, limit: Duration) {
        let ids = Arc::new(ids);
        let mut pending: FuturesUnordered<_> = self
            .nodes
            .iter()
            .map(|node| {
                let (node, ids) = (node.clone(), ids.clone());
                async move { node.release(&ids, Duration::ZERO).await }
            })
            .collect();
        let answered = async { while pending.next().await.is_some() {} };
        if tokio::time::timeout(limit, answered).await.is_err()
            && let Ok(runtime) = runtime::Handle::try_current()
        {
            drop(runtime.spawn(async move { while pending.next().await.is_some() {} }));
        }
    }

    /// Lets `pending`, the releases of a finished hold (`ids`) still out on some masters,
    /// finish on the caller's runtime, whose connections carry them behind whatever went to
    /// the same master before. A master that does not answer (`answered` says which did: the
    /// caller's runtime may go away first, and its connections with it, or the master failed)
    /// is sent the release once more from the manager's runtime, once its socket can deliver
    /// nothing sent before. The hold's token is its own (no later request carries it), so a
    /// second release can only find it gone.
    fn finish_in_background<F>(
        &self,
        mut pending: FuturesUnordered<F>,
        mut answered: Vec<bool>,
        ids: Arc<HoldIds>,
        keep_until: Option<std::time::Instant>,
    ) where
        F: Future<Output = (usize, RedisResult<bool>)> + Send + 'static,
    {
        let sent = std::time::Instant::now();
        let (told, heard) = tokio::sync::oneshot::channel::<Vec<bool>>();
        let stragglers = async move {
            while let Some((at, answer)) = pending.next().await {
                answered[at] = answer.is_ok();
            }
            let _ = told.send(answered);
        };
        if let Ok(runtime) = runtime::Handle::try_current() {
            drop(runtime.spawn(stragglers));
        }
        let (nodes, late) = (self.nodes.clone(), self.shared.late);
        drop(self.shared.background.spawn(async move {
            // Nothing heard: the caller's runtime went away with the stragglers.
            let answered = heard.await.unwrap_or_default();
            let unanswered: Vec<&Node> = (nodes.iter().enumerate())
                .filter(|(at, _)| !answered.get(*at).copied().unwrap_or(false))
                .map(|(_, node)| node)
                .collect();
            if unanswered.is_empty() {
                return;
            }
            tokio::time::sleep_until((sent + late).into()).await;
            // What is left of a `min_hold`.
            let keep = keep_until.map_or(Duration::ZERO, |until| {
                until.saturating_duration_since(std::time::Instant::now())
            });
            join_all(unanswered.into_iter().map(|node| node.release(&ids, keep))).await;
        }));
    }

    /// Gives back one hold; with several nodes, `false` only when a majority did not hold it.
    ///
    /// With several nodes it answers as soon as the answers so far decide the outcome, and
    /// leaves the slower nodes' releases to finish in the background: one frozen master does
    /// not hold up the release (its copy of the lock ends with its lease otherwise).
    pub(crate) async fn release(&self, ids: &HoldIds, keep: Duration) -> RedisResult<bool> {
        // One copy of the ids for all masters (the stragglers may outlive the caller).
        let shared = Arc::new(ids.clone());
        let keep_until = (!keep.is_zero()).then(|| std::time::Instant::now() + keep);
        let mut pending: FuturesUnordered<_> = (self.nodes.iter().enumerate())
            .map(|(at, node)| {
                let (node, ids) = (node.clone(), shared.clone());
                async move { (at, node.release(&ids, keep).await) }
            })
            .collect();
        // Lost only when a majority positively did not hold it: a node that is down, or one
        // that never granted this hold, is not evidence that the lease ended.
        let (mut tally, mut not_held) = (self.tally(), 0);
        let mut answered = vec![false; self.nodes.len()];
        while let Some((at, answer)) = pending.next().await {
            answered[at] = answer.is_ok();
            if let Some(released) = tally.count(answer) {
                not_held += usize::from(!released);
            }
            if tally.settled(not_held, pending.len()) && !pending.is_empty() {
                break;
            }
        }
        if !pending.is_empty() || answered.contains(&false) {
            self.finish_in_background(pending, answered, shared, keep_until);
        }
        let held = !tally.majority(not_held);
        tally.outcome(held)
    }

    /// Sets the lease; with several nodes, `true` when a majority set it.
    pub(crate) async fn extend(&self, hold: HoldRef<'_>, lease: Duration) -> RedisResult<bool> {
        let answers = self
            .on_all(node_limit(lease), |n| n.extend(hold, lease))
            .await;
        self.tally().yes(answers)
    }

    /// Renews a batch; with several nodes, a lease counts as renewed on a majority.
    pub(crate) async fn renew(&self, items: &[Renewal<'_>]) -> RedisResult<Vec<bool>> {
        // Bounded by the shortest lease in the batch: a renewal that waited the full response
        // timeout for a frozen master would end after the leases it renews.
        let shortest = items.iter().map(|i| i.lease).min().unwrap_or_default();
        // A master is one server: it answers for every item or fails as a whole.
        let answers = self
            .on_all(node_limit(shortest), |n| async move {
                let each = n.renew(items).await?;
                Ok(each.into_iter().map(|yes| yes.unwrap_or(false)).collect())
            })
            .await;
        self.tally().each(answers, items.len(), true)
    }

    /// Whether the token holds the lock (on a majority).
    pub(crate) async fn is_held(&self, hold: HoldRef<'_>) -> RedisResult<bool> {
        let answers = join_all(self.nodes.iter().map(|n| n.is_held(hold))).await;
        self.tally().yes(answers)
    }

    /// Whether the token holds the plain lock (on a majority).
    pub(crate) async fn is_held_plain(&self, lock: &str, token: &str) -> RedisResult<bool> {
        let answers = join_all(self.nodes.iter().map(|n| n.is_held_plain(lock, token))).await;
        self.tally().yes(answers)
    }

    /// Sends `cmd` to every master and returns each node's answers (see
    /// [`Node::ask_masters`]).
    pub(crate) async fn ask_masters(
        &self,
        cmds: &[redis::Cmd],
    ) -> Vec<RedisResult<(usize, Vec<(String, redis::Value)>)>> {
        join_all(self.nodes.iter().map(|n| n.ask_masters(cmds))).await
    }
}

/// The masters' answers to one operation, counted against the quorum: how many answered, and
/// the last error, which is the outcome when too few answered to decide it.
pub(super) struct Tally {
    /// How many masters make a majority.
    quorum: usize,
    /// How many masters answered (a refusal is an answer; an error or a timeout is not).
    answered: usize,
    /// The last error.
    error: Option<RedisError>,
}

impl Tally {
    /// Counts one master's answer: its value when it answered; an error is kept.
    pub(super) fn count<T>(&mut self, answer: RedisResult<T>) -> Option<T> {
        match answer {
            Ok(value) => {
                self.answered += 1;
                Some(value)
            }
            Err(error) => {
                self.error = Some(error);
                None
            }
        }
    }

    /// Whether `votes` masters make a majority.
    pub(super) fn majority(&self, votes: usize) -> bool {
        votes >= self.quorum
    }

    /// Whether a grant by `held` masters stands: a majority, and some of the `lease` left
    /// once the time the attempt took (`elapsed`) and the clocks' drift (1% of the lease,
    /// plus 2 ms) are taken off.
    pub(super) fn granted(&self, held: usize, elapsed: Duration, lease: Duration) -> bool {
        let drift = lease / 100 + Duration::from_millis(2);
        self.majority(held) && elapsed + drift < lease
    }

    /// Whether a grant that does not stand may have left copies to give back: `held` masters
    /// granted, or one failed (a master that did not answer in time may still apply the grant
    /// late).
    pub(super) fn maybe_granted(&self, held: usize) -> bool {
        held > 0 || self.error.is_some()
    }

    /// Whether `votes` so far decide the outcome, with `pending` masters yet to answer: a
    /// quorum answered, and the votes make a majority or no longer can.
    pub(super) fn settled(&self, votes: usize, pending: usize) -> bool {
        self.majority(self.answered) && (self.majority(votes) || !self.majority(votes + pending))
    }

    /// `value`, unless too few masters answered to know: then the last error.
    pub(super) fn outcome<T>(self, value: T) -> RedisResult<T> {
        match self.error {
            Some(error) if !self.majority(self.answered) => Err(error),
            _ => Ok(value),
        }
    }

    /// `true` when a majority of `answers` said yes.
    pub(super) fn yes(mut self, answers: Vec<RedisResult<bool>>) -> RedisResult<bool> {
        let mut yes = 0;
        for answer in answers {
            yes += self.count(answer).map_or(0, usize::from);
        }
        let majority = self.majority(yes);
        self.outcome(majority)
    }

    /// For a batch of `items`, answered one by one by every master: whether a majority
    /// answered `vote` for each.
    pub(super) fn each(
        mut self,
        answers: Vec<RedisResult<Vec<bool>>>,
        items: usize,
        vote: bool,
    ) -> RedisResult<Vec<bool>> {
        let mut votes = vec![0usize; items];
        for answer in answers {
            for (count, yes) in votes.iter_mut().zip(self.count(answer).unwrap_or_default()) {
                *count += usize::from(yes == vote);
            }
        }
        let majorities = votes.into_iter().map(|v| self.majority(v)).collect();
        self.outcome(majorities)
    }
}

/// Runs `op` on the RedLock master `node` if it may count towards a quorum now (see
/// [`Node::eligible`]); a master kept out of quorums after a restart answers with an error
/// instead. The check is part of the attempt, and within the same bound: a master that does
/// not answer it costs no more than one that does not answer the attempt.
pub(super) async fn if_eligible<T>(
    node: &Node,
    op: impl Future<Output = RedisResult<T>>,
) -> RedisResult<T> {
    if node.eligible().await {
        op.await
    } else {
        Err(io::Error::other("master out of quorum after a restart").into())
    }
}

/// The shorter of two waits, where either is known.
pub(super) fn sooner(a: Option<Duration>, b: Option<Duration>) -> Option<Duration> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
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
