//! The acquire engine: one loop for every request, one lock or a set ([`Claim`] says what an
//! attempt sends), plain or fair. It attempts, waits for a release (or a hand-off, or a
//! timer) and attempts again within the request's bounds, and hands back what it won; the
//! request's target builds the guard. What it does at each turn is `decide::step`'s answer;
//! the loop only carries it out.
//!
//! From the first attempt until the request settles, an attempt whose answer has not come
//! may hold the lock, and so may a fair request's place in the server's queue: [`Cover`]
//! gives back what it may hold if the request is dropped or gives up there. Shutdown meets
//! a request in one way: every wait inside ends with [`LockError::ShutDown`] (an attempt in
//! flight is bounded by the response timeout).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::backend::AcquireAnswer;
use crate::decide::{self, Bounds, State, Step, WaitKind};
use crate::error::LockError;
use crate::handed::Handed;
use crate::key::Keys;
use crate::kind::RequestKind;
use crate::manager::Inner;
use crate::metrics::Labels;
use crate::request::plan::Plan;
use crate::retry::Backoff;
use crate::waiters::Ticket;

mod claim;
mod cover;

pub(crate) use claim::{Attempted, Claim};
pub(crate) use cover::{Cover, send_behind};

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
    /// Until when an attempt whose answer never came may still reach the server: the hold
    /// won carries it, so that its last release is sent once more then.
    pub(crate) late_until: Option<Instant>,
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
            late_until: None,
        }
    }
}

/// Where waiting for a turn ended.
enum Turn {
    /// The request's turn: it may decide.
    Ready,
    /// A local release handed the lock over meanwhile.
    Handed(Handed),
    /// The deadline passed.
    Late,
}

/// One request being carried out.
pub(crate) struct Engine<'a, A: Claim> {
    inner: &'a Arc<Inner>,
    claim: &'a A,
    /// The locks' names (one, or a set's), for errors.
    names: &'a [Keys],
    kind: RequestKind,
    mode: WaitKind,
    ttl: Duration,
    backoff: Backoff,
    bounds: Bounds,
    metrics: Labels,
    cohort: bool,
    started: Instant,
    /// A local release may hand the lock over (a plain lock, where the backend allows it).
    hand_off: bool,
    cover: Cover<'a, A>,
    /// This request's place in the queue of lock `.0`, once it waits there.
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

impl<'a, A: Claim> Engine<'a, A> {
    /// An engine for `claim`, planned by `plan` (whose keys are `names`), started at `started`.
    pub(crate) fn new<K>(
        inner: &'a Arc<Inner>,
        claim: &'a A,
        plan: &Plan<K>,
        names: &'a [Keys],
        started: Instant,
    ) -> Self {
        let mode = match (A::SET, claim.fair()) {
            (true, _) => WaitKind::Set,
            (false, true) => WaitKind::Fair,
            (false, false) => WaitKind::Plain,
        };
        Self {
            inner,
            claim,
            names,
            kind: plan.kind,
            mode,
            ttl: plan.ttl,
            backoff: plan.backoff,
            bounds: Bounds {
                retries: plan.retries,
                deadline: plan.wait.map(|wait| started + wait),
            },
            metrics: plan.metrics,
            // Fair locks never pass locally.
            cohort: !plan.options.server_path && mode != WaitKind::Fair,
            started,
            hand_off: false,
            cover: Cover::new(inner, claim),
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
    pub(crate) fn covering(mut self, cover: Cover<'a, A>) -> Self {
        self.cover = cover;
        self
    }

    /// The waiting loop: carries out `decide::step` — attempts (after `first`, an attempt
    /// already made, if any), waits, and attempts again until the request wins or its
    /// bounds run out. `queue_first`: a request that may wait queues behind this manager's
    /// waiters of the lock before its first attempt.
    pub(crate) async fn acquire(
        mut self,
        first: Option<Attempted<A::Fences>>,
        queue_first: bool,
    ) -> Result<Outcome<A::Fences>, LockError> {
        if first.is_none() && queue_first && self.bounds.retries > 0 && self.has_waiters() {
            self.join(0, false);
        }
        let mut heard = first;
        if let Some(first) = &heard {
            self.heard(&first.answer);
        }
        // The wake-ups seen before the last attempt: one since then is worth a look.
        let mut seen = None;
        loop {
            if heard.is_none() {
                self.stand_ready();
                match self.turn().await? {
                    Turn::Ready => {}
                    Turn::Handed(handed) => return Ok(self.handed(handed)),
                    Turn::Late => return Err(self.give_up().await),
                }
                seen = self.ticket().map(Ticket::wakes);
            }
            let answer = heard.as_ref().map(|attempted| &attempted.answer);
            match decide::step(&self.state(), answer, &self.backoff, Instant::now()) {
                Step::Ask => {
                    // No offer stands while this waiter asks the server itself; one a
                    // release took meanwhile decides first.
                    if let Some(handed) = self.withdraw_offer().await? {
                        return Ok(self.handed(handed));
                    }
                    let attempted = self.cover.send(self.metrics).await?;
                    self.heard(&attempted.answer);
                    heard = Some(attempted);
                }
                Step::Grant => return Ok(self.granted(heard)),
                Step::Refuse => return Err(self.refused(heard)),
                Step::GiveUp => return Err(self.give_up().await),
                Step::Queue { at } => {
                    self.join(at, true);
                    heard = None;
                }
                Step::Sleep { until } => {
                    // Not asked (a task of this manager holds the lock, or this manager
                    // sits out): the holder the server named before may hold it no more.
                    if heard.take().is_none() {
                        self.holder = None;
                    }
                    if let Some(handed) = self.pause(until, seen).await? {
                        return Ok(self.handed(handed));
                    }
                }
            }
        }
    }

    /// What the request knows, for the decision.
    fn state(&self) -> State {
        let ticket = self.ticket();
        State {
            mode: self.mode,
            bounds: self.bounds,
            attempts: self.attempts,
            queued_at: self.ticket.as_ref().map(|(at, _)| *at),
            busy_at: self.busy_at,
            held_here: ticket.and_then(Ticket::held_here).filter(|_| self.hand_off),
            sitting_out: ticket.and_then(Ticket::sitting_out),
            announced: ticket.is_some_and(Ticket::is_subscribed),
        }
    }

    /// Notes an attempt's answer: the lock found busy and its holder, or the failure that is
    /// the last word now; and tells the local queue.
    fn heard(&mut self, answer: &redis::RedisResult<AcquireAnswer<A::Fences>>) {
        self.attempts += 1;
        match answer {
            &Ok(AcquireAnswer::Busy { at, holder, .. }) => {
                self.failure = None;
                self.holder = holder;
                self.busy_at = at.min(self.names.len() - 1);
            }
            Err(error) if decide::is_transient(error) => {
                tracing::debug!(attempts = self.attempts, %error, "acquire attempt failed");
                self.failure = Some(error.clone());
            }
            _ => return,
        }
        if let Some(ticket) = self.queue_heard() {
            ticket.heard(self.failure.clone());
        }
    }

    /// The local queue that keeps its waiters' last word from Redis: where only its head
    /// asks, that word is whichever local waiter asked last. A fair waiter asks for
    /// itself, and its own word is the last.
    fn queue_heard(&self) -> Option<&Ticket> {
        self.ticket().filter(|_| self.mode != WaitKind::Fair)
    }

    /// The outcome of a granted attempt.
    fn granted(&mut self, heard: Option<Attempted<A::Fences>>) -> Outcome<A::Fences> {
        let Some(Attempted {
            sent,
            answer: Ok(AcquireAnswer::Held(won)),
        }) = heard
        else {
            unreachable!("only a granted attempt is a grant");
        };
        if let (true, Some(ticket)) = (self.hand_off, self.ticket()) {
            ticket.holding(crate::lease::saturating_add(sent, self.ttl));
        }
        self.finish(Won::Asked { won, sent })
    }

    /// The error of an answer that waiting cannot change.
    fn refused(&self, heard: Option<Attempted<A::Fences>>) -> LockError {
        let key = self.name(0).to_owned();
        match heard.map(|attempted| attempted.answer) {
            Some(Ok(AcquireAnswer::PermitsMismatch { stored })) => LockError::PermitsMismatch {
                key,
                stored,
                requested: match self.kind {
                    RequestKind::Permits(permits) => permits,
                    _ => 0,
                },
            },
            Some(Ok(AcquireAnswer::Unreplicated { acked, wanted })) => {
                LockError::NotReplicated { key, acked, wanted }
            }
            Some(Err(error)) => LockError::redis(self.name(self.busy_at), error),
            Some(Ok(AcquireAnswer::Held(_) | AcquireAnswer::Busy { .. })) | None => {
                unreachable!("granted and busy are not refusals")
            }
        }
    }

    /// Joins the queue of lock `at` (leaving any other): the local queue, or for a fair lock
    /// the signal of its place in the server's queue; after an answer (`answered`), this
    /// request's last word is heard there.
    fn join(&mut self, at: usize, answered: bool) {
        let inner = self.inner;
        let (wake, backend, driver) = (self.claim.wake(at), &inner.backend, &inner.driver);
        let joined = match self.mode {
            WaitKind::Fair => {
                let ticket = inner.waiters.join_fair(
                    wake,
                    self.claim.token(),
                    backend,
                    driver,
                    self.metrics,
                );
                self.ticket = Some((at, ticket));
                return;
            }
            WaitKind::Plain | WaitKind::Set => {
                inner.waiters.join(wake, backend, driver, self.metrics)
            }
        };
        // What this request last heard becomes the queue's last word; one that joins before
        // its first attempt has heard nothing, and leaves the queue's word (a failure to reach
        // Redis, say) as it is for the waiters ahead of it.
        if answered {
            joined.heard(self.failure.clone());
        }
        // A writer queued behind waiters of its own manager does not compete before its
        // turn: its intent would only keep those ahead of it (readers) out of a free lock,
        // with nobody to take it. It leaves one again once refused as the head.
        if !joined.is_head() {
            self.cover.withdraw_intent();
        }
        self.ticket = Some((at, joined));
    }

    /// Stands ready for a hand-off while this request waits in a queue: that of a plain
    /// lock (a release by this manager hands it over), or a fair lock's (a release by this
    /// manager that grants it to this waiter hands the grant over in-process).
    fn stand_ready(&mut self) {
        let takes = self.hand_off || self.mode == WaitKind::Fair;
        if let (true, Some((_, waiting)), None) = (takes, &self.ticket, &self.offer) {
            self.offer = Some(waiting.offer(self.claim.token(), self.ttl, self.cohort));
        }
    }

    /// Waits for this request's turn in its queue (the head of a local one) and for the wake
    /// channel, within the deadline; a hand-off may come before it even sees its turn.
    async fn turn(&mut self) -> Result<Turn, LockError> {
        let Some((_, ticket)) = &self.ticket else {
            return Ok(Turn::Ready);
        };
        let turn = async {
            ticket.until_head().await;
            ticket.subscribe().await;
        };
        tokio::select! {
            () = turn => Ok(Turn::Ready),
            handed = receive(&mut self.offer) => Ok(handed.map_or(Turn::Ready, Turn::Handed)),
            () = until(self.inner, self.bounds.deadline) => Ok(Turn::Late),
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
            () = until(self.inner, self.bounds.deadline) => Err(self.give_up().await),
            () = self.inner.holds.until_shut_down() => Err(LockError::ShutDown),
        }
    }

    /// Waits for a release (or a grant, for a fair waiter), a hand-off, or the fallback timer
    /// at `until` that catches an expiry or a missed announcement. `seen`: the wake-ups
    /// counted before the last attempt.
    async fn pause(
        &mut self,
        until: Instant,
        seen: Option<u64>,
    ) -> Result<Option<Handed>, LockError> {
        // Ready for a hand-off again while this waits.
        self.stand_ready();
        let woken = async {
            match &self.ticket {
                Some((_, waiting)) => {
                    let seen = seen.unwrap_or_else(|| waiting.wakes());
                    waiting.woken(seen).await;
                }
                None => std::future::pending().await,
            }
        };
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
        self.cover.taken(&handed);
        // The waiters behind a plain lock's holder queue for its release.
        if let (true, Some(ticket)) = (self.hand_off, self.ticket()) {
            ticket.holding(handed.lease_until(self.ttl));
        }
        self.finish(Won::Handed(handed))
    }

    /// The request ended: the cover goes (giving back what it still covers), the ticket
    /// stays with the outcome.
    fn finish(&mut self, won: Won<A::Fences>) -> Outcome<A::Fences> {
        let ticket = self.ticket.take().map(|(_, ticket)| ticket);
        Outcome {
            won,
            attempts: self.attempts,
            started: self.started,
            queued: ticket.is_some(),
            ticket,
            late_until: self.cover.late_until,
        }
    }

    fn ticket(&self) -> Option<&Ticket> {
        self.ticket.as_ref().map(|(_, ticket)| ticket)
    }

    fn has_waiters(&self) -> bool {
        self.inner.waiters.has_waiters(self.claim.wake(0))
    }

    fn name(&self, at: usize) -> &str {
        &self.names[at.min(self.names.len() - 1)].name
    }

    /// The error of a request that gives up now. A fair request first leaves the server's
    /// queue (giving back a lock a release granted it meanwhile); if Redis does not answer,
    /// the cover sends that again. The last word decides: a failure to reach Redis is not
    /// reported as busy.
    async fn give_up(&mut self) -> LockError {
        if self.mode == WaitKind::Fair {
            self.cover.give_back().await;
        }
        let failure = match self.queue_heard() {
            Some(ticket) => ticket.last_failure(),
            None => self.failure.clone(),
        };
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
