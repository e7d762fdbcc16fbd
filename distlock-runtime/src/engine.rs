//! The acquire engine: one loop for every request, one lock or a set ([`Ask`] says what an
//! attempt sends), with fair locks as a mode of it. It attempts, waits for a release (or a
//! hand-off, or a timer) and attempts again within the request's bounds, and hands back what
//! it won; the request's target builds the guard. The decisions are `decide`'s.
//!
//! From the first attempt until the request settles, an attempt whose answer has not come
//! may hold the lock: [`Cover`] gives back what it may hold if the request is dropped or
//! gives up there. Shutdown meets a request in one way: every wait inside ends with
//! [`LockError::ShutDown`] (an attempt in flight is bounded by the response timeout).

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::LockError;
use crate::backend::FAIR_REFRESH;
use crate::decide::{self, Answer, Bounds, Holder, Step};
use crate::key::Keys;
use crate::manager::Inner;
use crate::metrics::Labels;
use crate::request::Plan;
use crate::request::RequestKind;
use crate::retry::Backoff;
use crate::waiters::Handed;
use crate::waiters::Ticket;

/// What one attempt sends, and what the engine needs to know of it: one lock, or a set.
pub(crate) trait Ask: Sync {
    /// What a granted attempt brings: the fencing token (tokens, for a set).
    type Fences: Send + 'static;

    /// Several locks: the queue to follow is that of the lock found busy, known only from a
    /// busy answer; and a set takes no turns in a cohort's sit-out.
    const SET: bool = false;

    /// Sends one attempt.
    fn send(
        &self,
        inner: &Inner,
    ) -> impl Future<Output = Result<redis::RedisResult<Reply<Self::Fences>>, LockError>> + Send;

    /// The owner token the attempts carry.
    fn token(&self) -> &str;

    /// The wake channel of lock `at` (for a set, the one found busy).
    fn wake(&self, at: usize) -> &str;

    /// Gives back, right behind the last attempt, what an attempt whose answer never came may
    /// hold, then takes back `intent`.
    fn release_behind(&self, inner: &Arc<Inner>, intent: Option<String>);

    /// Gives back what the attempts may hold, now: `Some` when Redis answered (`true`: there
    /// was something to give back).
    fn give_back(&self, inner: &Inner) -> impl Future<Output = Option<bool>> + Send;

    /// The intent a refused attempt leaves to keep new readers out (a writer's), if any.
    fn intent(&self) -> Option<&str> {
        None
    }

    /// Takes back the intent this request left, from the manager's runtime.
    fn withdraw_intent(&self, _inner: &Arc<Inner>, _intent: String) {}
}

/// The answer to one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reply<W> {
    /// Granted: the fencing token(s).
    Held(W),
    /// Another owner holds lock `at` for about `holder_ttl` more; `holder` is that owner's
    /// token (as two numbers), when the server named it.
    Busy {
        at: usize,
        holder_ttl: Option<Duration>,
        holder: Option<[u64; 2]>,
    },
    /// The semaphore is in use with `stored` permits, not the number asked for.
    PermitsMismatch { stored: u32 },
    /// Granted, but fewer replicas than asked acknowledged it: already given back.
    Unreplicated { acked: u32, wanted: u32 },
}

impl<W> Reply<W> {
    /// What the decision needs of the answer.
    fn answer(outcome: &redis::RedisResult<Self>) -> Answer {
        match outcome {
            Ok(Reply::Held(_)) => Answer::Granted,
            Ok(Reply::Busy { holder_ttl, .. }) => Answer::Busy {
                holder_ttl: *holder_ttl,
            },
            Ok(Reply::PermitsMismatch { .. } | Reply::Unreplicated { .. }) => Answer::Refused,
            Err(error) if is_transient(error) => Answer::Transient,
            Err(_) => Answer::Fatal,
        }
    }
}

/// Errors after which the same attempt may succeed if sent again.
/// Connection failures, and server answers that say "not now" (TRYAGAIN, CLUSTERDOWN,
/// MASTERDOWN, LOADING, READONLY during a failover, …): retried within the request's
/// bounds, and reported as the Redis error they are, never as busy, if the bounds run out.
pub(crate) fn is_transient(error: &redis::RedisError) -> bool {
    error.is_io_error()
        || error.is_timeout()
        || error.is_connection_dropped()
        || error.is_connection_refusal()
        || !matches!(error.retry_method(), redis::RetryMethod::NoRetry)
}

/// What a request won.
#[derive(Debug)]
pub(crate) enum Won<W> {
    /// An attempt, sent at `sent` (when its lease began), was granted.
    Asked { won: W, sent: Instant },
    /// A local release handed the lock over.
    Handed(Handed),
}

/// How a request ended well: what it won, after how many attempts, and its place in the
/// local queue (kept until the guard is built, so that the waiters behind see the holder).
#[derive(Debug)]
pub(crate) struct Outcome<W> {
    pub(crate) won: Won<W>,
    pub(crate) attempts: u32,
    pub(crate) started: Instant,
    /// The request waited in its manager's queue.
    pub(crate) queued: bool,
    pub(crate) ticket: Option<Ticket>,
}

impl<W> Outcome<W> {
    /// The outcome of a first attempt, granted at once.
    pub(crate) fn at_once(won: W, sent: Instant, started: Instant) -> Self {
        Self {
            won: Won::Asked { won, sent },
            attempts: 1,
            started,
            queued: false,
            ticket: None,
        }
    }
}

/// Sends one attempt of `ask`; `cover` covers it from now until its answer has been looked
/// at. Returns when it was sent, and the answer.
pub(crate) async fn send<'a, A: Ask>(
    inner: &'a Arc<Inner>,
    ask: &'a A,
    metrics: Labels,
    cover: &mut Cover<'a, A>,
) -> Result<First<A::Fences>, LockError> {
    crate::metrics::attempt(metrics);
    let sent = Instant::now();
    cover.maybe_held = true;
    let outcome = ask.send(inner).await?;
    if outcome.is_ok() {
        inner.waiters.attempted();
    }
    Ok(First { sent, outcome })
}

/// The answer to an attempt already made (before the loop, by the caller).
pub(crate) struct First<W> {
    pub(crate) sent: Instant,
    pub(crate) outcome: redis::RedisResult<Reply<W>>,
}

/// What the loop does after an attempt or a look at its queue.
enum Then<W> {
    /// The request settled.
    Won(Outcome<W>),
    /// Look again at once.
    Again,
    /// Wait for a release, a hand-off or a timer; the holder's lease if known.
    Wait(Option<Duration>),
}

/// One request being carried out.
pub(crate) struct Engine<'a, A: Ask> {
    inner: &'a Arc<Inner>,
    ask: &'a A,
    /// The locks' names (one, or a set's), for errors.
    names: &'a [Keys],
    kind: RequestKind,
    ttl: Duration,
    backoff: Backoff,
    bounds: Bounds,
    metrics: Labels,
    cohort: bool,
    started: Instant,
    /// A local release may hand the lock over (a plain lock, where the backend allows it).
    hand_off: bool,
    /// Fair mode: the queue is in Redis.
    fair: bool,
    cover: Cover<'a, A>,
    /// This request's place in the local queue of lock `.0`, once it waits there.
    ticket: Option<(usize, Ticket)>,
    /// The receiving end of a standing offer to take the lock from a local release.
    offer: Option<oneshot::Receiver<Handed>>,
    attempts: u32,
    /// The last failure to reach Redis, if the last word was one.
    failure: Option<redis::RedisError>,
    /// The holder the server named in the last busy answer.
    holder: Option<[u64; 2]>,
    busy_at: usize,
}

impl<'a, A: Ask> Engine<'a, A> {
    /// An engine for `ask`, planned by `plan` (whose keys are `names`), started at `started`.
    pub(crate) fn new<K>(
        inner: &'a Arc<Inner>,
        ask: &'a A,
        plan: &Plan<K>,
        names: &'a [Keys],
        started: Instant,
    ) -> Self {
        Self {
            inner,
            ask,
            names,
            kind: plan.kind,
            ttl: plan.ttl,
            backoff: plan.backoff,
            bounds: Bounds {
                retries: plan.retries,
                deadline: plan.wait.map(|wait| started + wait),
            },
            metrics: plan.metrics,
            cohort: !plan.options.no_cohort,
            started,
            hand_off: false,
            fair: false,
            cover: Cover::new(inner, ask),
            ticket: None,
            offer: None,
            attempts: 0,
            failure: None,
            holder: None,
            busy_at: 0,
        }
    }

    /// Lets a local release hand the lock over to this request while it waits.
    pub(crate) fn hand_off(mut self, hand_off: bool) -> Self {
        self.hand_off = hand_off;
        self
    }

    /// Takes over the cover of an attempt made before the loop.
    pub(crate) fn covering(mut self, mut cover: Cover<'a, A>) -> Self {
        self.cover.maybe_held = std::mem::replace(&mut cover.maybe_held, false);
        self
    }

    async fn send(&mut self) -> Result<First<A::Fences>, LockError> {
        send(self.inner, self.ask, self.metrics, &mut self.cover).await
    }

    /// The waiting loop: attempts (after `first`, the answer to one already made, if any),
    /// waits, and attempts again until the request wins or its bounds run out.
    pub(crate) async fn wait(
        mut self,
        mut first: Option<First<A::Fences>>,
        queue_first: bool,
    ) -> Result<Outcome<A::Fences>, LockError> {
        let queues = self.bounds.retries > 0;
        if first.is_none() && queues && queue_first && self.has_waiters() {
            let inner = self.inner;
            let joined = inner.waiters.join(
                self.ask.wake(0),
                &inner.backend,
                &inner.driver,
                self.metrics,
            );
            self.ticket = Some((0, joined));
        }
        loop {
            self.stand_ready();
            if let Some(handed) = self.turn().await? {
                return Ok(self.handed(handed));
            }
            let seen = self.ticket.as_ref().map(|(_, ticket)| ticket.wakes());
            let sitting_out = self.ticket().filter(|_| !A::SET);
            let sitting_out = sitting_out.and_then(Ticket::sitting_out);
            let holder_ttl = match self.next(&mut first, sitting_out, queues).await? {
                Then::Won(outcome) => return Ok(outcome),
                Then::Again => continue,
                Then::Wait(holder_ttl) => holder_ttl,
            };
            if let Some(handed) = self.pause(holder_ttl, sitting_out, seen).await? {
                return Ok(self.handed(handed));
            }
            if self.past_deadline() {
                return Err(self.give_up_now());
            }
        }
    }

    /// The next step after waiting for a turn: none while a task of this manager holds the
    /// lock or the manager sits out, else an attempt and what its answer decides.
    async fn next(
        &mut self,
        first: &mut Option<First<A::Fences>>,
        sitting_out: Option<Instant>,
        queues: bool,
    ) -> Result<Then<A::Fences>, LockError> {
        // A task of this manager holds the lock: its release hands it over (or wakes this
        // head); asking the server now would only hear "busy".
        let sibling_holds = self.ticket().and_then(Ticket::held_here);
        if let Some(until) = sibling_holds.filter(|_| self.hand_off) {
            // A task of this manager holds it now, whoever the server named before; its lease
            // bounds the wait, as the holder's PTTL would.
            self.holder = None;
            return Ok(Then::Wait(Some(
                until.saturating_duration_since(Instant::now()),
            )));
        }
        // Or this manager just had a run of hand-offs: other processes' turns come first.
        if sitting_out.is_some() {
            self.holder = None;
            return Ok(Then::Wait(None));
        }
        // No offer stands while this waiter asks the server itself; one a release took
        // meanwhile decides first.
        if let Some(handed) = self.withdraw_offer().await? {
            return Ok(Then::Won(self.handed(handed)));
        }
        self.attempts += 1;
        let First { sent, outcome } = match first.take() {
            Some(first) => first,
            None => self.send().await?,
        };
        self.decide(sent, outcome, queues)
    }

    /// What an attempt's answer decides.
    fn decide(
        &mut self,
        sent: Instant,
        outcome: redis::RedisResult<Reply<A::Fences>>,
        queues: bool,
    ) -> Result<Then<A::Fences>, LockError> {
        self.cover.answered(outcome.as_ref().ok());
        let answer = Reply::answer(&outcome);
        let holder_ttl = match outcome {
            Ok(Reply::Held(won)) => {
                self.cover.maybe_held = false;
                if let (true, Some(ticket)) = (self.hand_off, self.ticket()) {
                    ticket.holding(crate::lease::saturating_add(sent, self.ttl));
                }
                return Ok(Then::Won(self.settle(Won::Asked { won, sent })));
            }
            Ok(Reply::Busy {
                at,
                holder_ttl,
                holder,
            }) => {
                self.cover.maybe_held = false;
                self.failure = None;
                self.holder = holder;
                self.busy_at = at.min(self.names.len() - 1);
                holder_ttl
            }
            Ok(refused) => {
                self.cover.maybe_held = false;
                return Err(self.refused(refused));
            }
            // A lost reply may hide a granted lock: the next attempt resends the same hold,
            // which the script recognises; the cover releases it if none follows.
            Err(error) if is_transient(&error) => {
                tracing::debug!(attempts = self.attempts, %error, "acquire attempt failed");
                self.failure = Some(error);
                None
            }
            Err(error) => return Err(LockError::redis(self.name(self.busy_at), error)),
        };
        if let Some(ticket) = self.ticket() {
            ticket.heard(self.failure.clone());
        }
        let queued = self
            .ticket
            .as_ref()
            .is_some_and(|(at, _)| *at == self.busy_at);
        // A set knows which lock to wait for only from a busy answer.
        let queues = queues && (!A::SET || matches!(answer, Answer::Busy { .. }));
        let step = decide::after(
            answer,
            self.bounds,
            &self.backoff,
            self.attempts,
            (queued, queues),
            None,
            Instant::now(),
        );
        match step {
            Step::GiveUp => Err(self.give_up(self.failure.clone())),
            // First time busy on this lock: queue up and follow its wake channel, then look
            // again at once (a release between the busy answer and the subscription
            // publishes unheard). So does a set found busy on another lock than the one it
            // just queued for (a release of that lock before its channel is followed would
            // leave the set asleep while every lock is free); that lock was free at this look,
            // so each such turn follows a release and is no busy loop.
            Step::Queue => {
                self.join(self.busy_at);
                Ok(Then::Again)
            }
            _ => Ok(Then::Wait(holder_ttl)),
        }
    }

    /// The error of an answer that waiting cannot change.
    fn refused(&self, reply: Reply<A::Fences>) -> LockError {
        let key = self.name(0).to_owned();
        match reply {
            Reply::PermitsMismatch { stored } => LockError::PermitsMismatch {
                key,
                stored,
                requested: match self.kind {
                    RequestKind::Permits(permits) => permits,
                    _ => 0,
                },
            },
            Reply::Unreplicated { acked, wanted } => {
                LockError::NotReplicated { key, acked, wanted }
            }
            Reply::Held(_) | Reply::Busy { .. } => {
                unreachable!("granted and busy are not refusals")
            }
        }
    }

    /// Joins the local queue of lock `at` (leaving any other) after an answer, and hears this
    /// request's last word there.
    fn join(&mut self, at: usize) {
        let inner = self.inner;
        let joined = inner.waiters.join(
            self.ask.wake(at),
            &inner.backend,
            &inner.driver,
            self.metrics,
        );
        joined.heard(self.failure.clone());
        // A writer queued behind waiters of its own manager does not compete before its
        // turn: its intent would only keep those ahead of it (readers) out of a free lock,
        // with nobody to take it. It leaves one again once refused as the head.
        if !joined.is_head() {
            self.cover.withdraw_intent();
        }
        self.ticket = Some((at, joined));
    }

    /// Stands ready for a hand-off while this request waits in the queue of a plain lock.
    fn stand_ready(&mut self) {
        if let (true, Some((_, waiting)), None) = (self.hand_off, &self.ticket, &self.offer) {
            self.offer = Some(waiting.offer(self.ask.token(), self.ttl, self.cohort));
        }
    }

    /// Waits for this request's turn at the head of its queue (and for the wake channel),
    /// within the deadline; a hand-off may come before it even sees its turn.
    async fn turn(&mut self) -> Result<Option<Handed>, LockError> {
        let Some((_, ticket)) = &self.ticket else {
            return Ok(None);
        };
        let turn = async {
            ticket.until_head().await;
            ticket.subscribe().await;
        };
        tokio::select! {
            () = turn => Ok(None),
            handed = receive(&mut self.offer) => Ok(handed),
            () = until(self.inner, self.bounds.deadline) => Err(self.give_up_now()),
            () = self.inner.holds.until_shut_down() => Err(LockError::ShutDown),
        }
    }

    /// Takes back the standing offer before asking the server; a release that took it
    /// meanwhile decides first, within its bounds.
    async fn withdraw_offer(&mut self) -> Result<Option<Handed>, LockError> {
        let (Some(receiver), Some(waiting)) = (self.offer.take(), self.ticket()) else {
            return Ok(None);
        };
        if waiting.withdraw() {
            return Ok(None);
        }
        tokio::select! {
            handed = receiver => Ok(handed.ok()),
            () = until(self.inner, self.bounds.deadline) => Err(if self.fair {
                self.fair_give_up().await
            } else {
                self.give_up_now()
            }),
            () = self.inner.holds.until_shut_down() => Err(LockError::ShutDown),
        }
    }

    /// Waits for a release, a hand-off, or the fallback timer that catches an expiry or a
    /// missed announcement: the end of the holder's lease while the wake channel is followed,
    /// else backoff with full jitter capped by that lease (see [`decide::sleep`]).
    async fn pause(
        &mut self,
        holder_ttl: Option<Duration>,
        sitting_out: Option<Instant>,
        seen: Option<u64>,
    ) -> Result<Option<Handed>, LockError> {
        // Checked as it goes to sleep: a connection lost from here on wakes it (`recover`).
        let holder = Holder {
            lease: holder_ttl,
            announced: self.ticket().is_some_and(Ticket::is_subscribed),
        };
        let step = decide::sleep(
            self.bounds,
            &self.backoff,
            self.attempts,
            holder,
            sitting_out,
            Instant::now(),
        );
        let Step::Sleep { until } = step else {
            return Err(self.give_up_now());
        };
        let woken = async {
            match &self.ticket {
                Some((_, waiting)) => {
                    let seen = seen.unwrap_or_else(|| waiting.wakes());
                    waiting.woken_since(seen).await;
                }
                None => std::future::pending().await,
            }
        };
        // Ready for a hand-off again while this waits.
        if let (true, Some((_, waiting)), None) = (self.hand_off, &self.ticket, &self.offer) {
            self.offer = Some(waiting.offer(self.ask.token(), self.ttl, self.cohort));
        }
        tokio::select! {
            handed = receive(&mut self.offer) => Ok(handed),
            () = woken => Ok(None),
            _ = self.inner.sleep_until(until) => Ok(None),
            () = self.inner.holds.until_shut_down() => Err(LockError::ShutDown),
        }
    }

    /// The outcome of a hand-off: the lock's lease began when it was sent, or is the shared
    /// lease of the hold passed locally.
    fn handed(&mut self, handed: Handed) -> Outcome<A::Fences> {
        // A hand-off through the server gave this request's own token: it covers any grant an
        // unanswered attempt may hold, which must not be released now. A local pass gave
        // another: the cover stays, for what such an attempt may hold.
        if !handed.is_local() {
            self.cover.maybe_held = false;
        }
        if let Some(ticket) = self.ticket() {
            ticket.holding(handed.lease_until(self.ttl));
        }
        self.settle(Won::Handed(handed))
    }

    /// The request settled: the cover goes (giving back what it still covers), the ticket
    /// stays with the outcome.
    fn settle(&mut self, won: Won<A::Fences>) -> Outcome<A::Fences> {
        let ticket = self.ticket.take().map(|(_, ticket)| ticket);
        Outcome {
            won,
            attempts: self.attempts,
            started: self.started,
            queued: ticket.is_some(),
            ticket,
        }
    }

    fn ticket(&self) -> Option<&Ticket> {
        self.ticket.as_ref().map(|(_, ticket)| ticket)
    }

    fn has_waiters(&self) -> bool {
        self.inner.waiters.has_waiters(self.ask.wake(0))
    }

    fn name(&self, at: usize) -> &str {
        &self.names[at.min(self.names.len() - 1)].name
    }

    fn past_deadline(&self) -> bool {
        self.bounds.deadline.is_some_and(|d| d <= Instant::now())
    }

    /// The error of a request that gives up now: the last word decides, so a failure to reach
    /// Redis is not reported as busy. Once in the queue, the word of whichever local waiter
    /// asked last (see `Ticket::heard`).
    fn give_up_now(&self) -> LockError {
        let failure = match self.ticket() {
            Some(ticket) => ticket.last_failure(),
            None => self.failure.clone(),
        };
        self.give_up(failure)
    }

    /// The error of a request that gave up with `failure` as the last word; a busy error
    /// carries the holder the server named, if it did.
    pub(crate) fn give_up(&self, failure: Option<redis::RedisError>) -> LockError {
        let key = self.name(self.busy_at);
        match failure {
            Some(error) => LockError::redis(key, error),
            None => LockError::Busy {
                key: key.to_owned(),
                attempts: self.attempts,
                waited: self.started.elapsed(),
                holder_token: self.holder.map(crate::backend::token_text),
                holder: None,
            },
        }
    }
}

/// Fair mode: ask (which queues this request in Redis the first time), then wait for the
/// grant — handed over by a release of this manager, or heard from another's — or for the
/// timer that renews the queue entry and notices an expiry.
impl<'a, A: Ask> Engine<'a, A> {
    /// The fair loop. `join`: the request may queue (it may wait).
    pub(crate) async fn fair(mut self, join: bool) -> Result<Outcome<A::Fences>, LockError> {
        self.fair = true;
        let mut looked_again = false;
        loop {
            // No offer stands while this waiter asks the server itself; one a release took
            // meanwhile decides first.
            if let Some(handed) = self.withdraw_offer().await? {
                return Ok(self.fair_handed(handed));
            }
            // Where this manager already waits for the key, this request waits with them
            // from its first attempt on: it hears every grant from then on, and needs no
            // second look.
            if self.ticket.is_none() && join && self.has_waiters() {
                self.join_fair();
            }
            let heard_all = self.ticket().is_some_and(Ticket::is_subscribed);
            self.attempts += 1;
            let First { sent, outcome } = self.send().await?;
            let holder_ttl = match self.fair_answer(outcome)? {
                Ok(won) => {
                    self.cover.maybe_held = false;
                    return Ok(self.settle(Won::Asked { won, sent }));
                }
                Err(holder_ttl) => holder_ttl,
            };
            if self.attempts > self.bounds.retries || self.past_deadline() {
                return Err(self.fair_give_up().await);
            }
            if self.ticket.is_none() {
                self.join_fair();
            }
            if !heard_all {
                self.fair_subscribe().await?;
                // The first time, ask again at once: a grant published before the
                // subscription went unheard.
                if !looked_again {
                    looked_again = true;
                    continue;
                }
            }
            if let Some(handed) = self.fair_pause(holder_ttl).await? {
                return Ok(self.fair_handed(handed));
            }
            if self.past_deadline() {
                // A grant that came meanwhile is given back (or passed on) by the leaving.
                return Err(self.fair_give_up().await);
            }
        }
    }

    /// A fair attempt's answer: the grant, or the holder's lease to wait for.
    #[allow(clippy::type_complexity)]
    fn fair_answer(
        &mut self,
        outcome: redis::RedisResult<Reply<A::Fences>>,
    ) -> Result<Result<A::Fences, Option<Duration>>, LockError> {
        Ok(Err(match outcome {
            Ok(Reply::Held(won)) => return Ok(Ok(won)),
            Ok(Reply::Busy { holder_ttl, .. }) => {
                self.failure = None;
                holder_ttl
            }
            Ok(refused @ Reply::Unreplicated { .. }) => return Err(self.refused(refused)),
            Ok(Reply::PermitsMismatch { .. }) => None,
            Err(error) if is_transient(&error) => {
                tracing::debug!(attempts = self.attempts, %error, "acquire attempt failed");
                self.failure = Some(error);
                None
            }
            Err(error) => return Err(LockError::redis(self.name(0), error)),
        }))
    }

    fn join_fair(&mut self) {
        let inner = self.inner;
        let ticket = inner.waiters.join_fair(
            self.ask.wake(0),
            self.ask.token(),
            &inner.backend,
            &inner.driver,
            self.metrics,
        );
        self.ticket = Some((0, ticket));
    }

    /// Follows the wake channel (again, after a lost connection), within the deadline.
    async fn fair_subscribe(&self) -> Result<(), LockError> {
        let Some(waiting) = self.ticket() else {
            return Ok(());
        };
        tokio::select! {
            () = waiting.subscribe() => Ok(()),
            () = until(self.inner, self.bounds.deadline) => Ok(()),
            () = self.inner.holds.until_shut_down() => Err(LockError::ShutDown),
        }
    }

    /// Grants are told; asking again only renews the entry and notices a holder whose lease
    /// ended (which tells nobody). A request bounded by a number of retries spends them at
    /// its backoff's pace, as any other.
    async fn fair_pause(
        &mut self,
        holder_ttl: Option<Duration>,
    ) -> Result<Option<Handed>, LockError> {
        let pause = if self.bounds.retries == u32::MAX {
            let expiry = holder_ttl.map(|ttl| ttl + Duration::from_millis(1));
            expiry.unwrap_or(FAIR_REFRESH).min(FAIR_REFRESH)
        } else {
            self.backoff
                .delay(self.attempts, holder_ttl)
                .min(FAIR_REFRESH)
        };
        let mut until = Instant::now() + pause;
        if let Some(deadline) = self.bounds.deadline {
            until = until.min(deadline);
        }
        let Some((_, waiting)) = &self.ticket else {
            return Ok(None);
        };
        self.offer = Some(waiting.offer(self.ask.token(), self.ttl, false));
        tokio::select! {
            handed = receive(&mut self.offer) => Ok(handed),
            () = waiting.signalled() => Ok(None),
            _ = self.inner.sleep_until(until) => Ok(None),
            () = self.inner.holds.until_shut_down() => Err(LockError::ShutDown),
        }
    }

    fn fair_handed(&mut self, handed: Handed) -> Outcome<A::Fences> {
        self.cover.maybe_held = false;
        self.settle(Won::Handed(handed))
    }

    /// A fair request that gives up leaves the queue before it answers (and gives back a lock
    /// a release granted it meanwhile); if Redis does not answer, the cover sends that again.
    async fn fair_give_up(&mut self) -> LockError {
        if let Some(released) = self.ask.give_back(self.inner).await {
            self.cover.maybe_held = false;
            if released {
                tracing::debug!("a lock granted while giving up was passed on");
            }
        }
        self.give_up(self.failure.clone())
    }
}

/// Sends a release right behind an attempt whose caller gave up (`release` makes one; it
/// says whether Redis answered), for a lock or a set alike.
///
/// In a tokio runtime, the release is queued on that runtime's connection before this
/// returns, right behind the attempt, so it cannot overtake it there. If that runtime goes
/// away (or the connection fails) before the answer, the manager's runtime sends it once more,
/// and only that outcome is logged. Outside any runtime, the manager's runtime sends it.
///
/// A connection whose answer timed out is dropped, and the release may then go on a new one
/// while the attempt still sits in the old socket, to be delivered if the network heals
/// before the kernel gives up on it. So the release is sent once more when that can no
/// longer happen ([`Backend::late_delivery`](crate::backend::Backend::late_delivery)): a
/// release of what was never granted, or was already given back, changes nothing.
pub(crate) fn send_behind<R, F>(inner: &Inner, release: R)
where
    R: Fn() -> F + Send + 'static,
    F: Future<Output = redis::RedisResult<()>> + Send + 'static,
{
    let late = inner.backend.late_delivery();
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return inner.driver.spawn(release_again(None, release, late));
    };
    let (answered, answer) = oneshot::channel();
    let here = release();
    let here = async move {
        if here.await.is_ok() {
            let _ = answered.send(());
        }
    };
    // One poll queues the request on the connection; the task finishes the rest.
    let mut here = Box::pin(here);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    if here.as_mut().poll(&mut cx).is_pending() {
        drop(runtime.spawn(here));
    }
    inner
        .driver
        .spawn(release_again(Some(answer), release, late));
}

/// Sends `release` from the manager's runtime, unless `first` says the one sent before was
/// answered, and logs a failure; then, `late` after, once more (see [`send_behind`]).
async fn release_again<R, F>(first: Option<oneshot::Receiver<()>>, release: R, late: Duration)
where
    R: Fn() -> F,
    F: Future<Output = redis::RedisResult<()>>,
{
    let sent = tokio::time::Instant::now();
    let answered = match first {
        Some(answer) => answer.await.is_ok(),
        None => false,
    };
    if !answered && let Err(error) = release().await {
        tracing::warn!(%error, "a release behind an abandoned attempt failed; the lease will expire");
    }
    tokio::time::sleep_until(sent + late).await;
    if let Err(error) = release().await {
        tracing::debug!(%error, "the late release behind an abandoned attempt failed");
    }
}

/// Waits until `deadline`, or for ever without one.
async fn until(inner: &Inner, deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => {
            let _ = inner.sleep_until(deadline).await;
        }
        None => std::future::pending().await,
    }
}

/// Waits for the hand-off behind a standing offer: `None` (and the offer gone) when the
/// release that took it could not hand the lock over; pending while no offer stands.
async fn receive(offer: &mut Option<oneshot::Receiver<Handed>>) -> Option<Handed> {
    let Some(receiver) = offer else {
        return std::future::pending().await;
    };
    let handed = receiver.await.ok();
    *offer = None;
    handed
}

/// An attempt whose answer has not arrived: if the request is dropped here, the hold may
/// exist on the server, so a release is sent behind it on the same connection.
///
/// It also covers a writer's intent. A writer refused while it may try again leaves an
/// intent that keeps new readers out (see `write_acquire.lua`); one that stops waiting
/// without the lock — it gives up, fails, or is cancelled — takes its intent back at once,
/// which wakes the readers it kept out: a free lock does not stay closed to them until the
/// intent expires. Behind an unanswered attempt, the intent is taken back after that
/// attempt's release, on the same connection, so that the attempt cannot set it again after.
pub(crate) struct Cover<'a, A: Ask> {
    inner: &'a Arc<Inner>,
    ask: &'a A,
    pub(crate) maybe_held: bool,
    /// An intent of this request may be in Redis (an answered attempt was refused).
    intent_left: bool,
}

impl<'a, A: Ask> Cover<'a, A> {
    /// Covers nothing yet.
    pub(crate) fn new(inner: &'a Arc<Inner>, ask: &'a A) -> Self {
        Self {
            inner,
            ask,
            maybe_held: false,
            intent_left: false,
        }
    }

    /// Notes what an attempt's answer (`None`: none came) means for the intent: a writer
    /// granted the lock took its own intent back in the same script; one refused, or whose
    /// answer was lost, may have left one.
    fn answered(&mut self, reply: Option<&Reply<A::Fences>>) {
        self.intent_left =
            self.ask.intent().is_some() && matches!(reply, None | Some(Reply::Busy { .. }));
    }

    /// Takes back the intent an answered, refused attempt left, now.
    fn withdraw_intent(&mut self) {
        if !self.intent_left || self.maybe_held {
            return;
        }
        self.intent_left = false;
        if let Some(intent) = self.ask.intent() {
            self.ask.withdraw_intent(self.inner, intent.to_owned());
        }
    }
}

impl<A: Ask> Drop for Cover<'_, A> {
    fn drop(&mut self) {
        let intent = self
            .ask
            .intent()
            .filter(|_| self.intent_left || self.maybe_held)
            .map(str::to_owned);
        if self.maybe_held {
            self.ask.release_behind(self.inner, intent);
        } else if let Some(intent) = intent {
            self.ask.withdraw_intent(self.inner, intent);
        }
    }
}
