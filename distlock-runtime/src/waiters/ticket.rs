//! A waiter's place in its key's queue: waiting for its turn and its wake-ups, following the
//! key's channel while it waits, and leaving the queue when dropped.

use super::*;

/// A place in a key's queue; leaving (drop) lets the next waiter compete.
#[derive(Debug)]
pub(crate) struct Ticket {
    pub(super) key: Arc<KeyState>,
    pub(super) id: u64,
    /// Told when this ticket becomes the head of its queue.
    pub(super) turn: Arc<Notify>,
    /// A fair waiter's own signal (see [`Waiters::join_fair`]).
    pub(super) signal: Option<Arc<Notify>>,
    pub(super) shared: Weak<Shared>,
    pub(super) driver_backend: Option<(Backend, Arc<Driver>)>,
    pub(super) _waiting: crate::metrics::Waiting,
}

impl Ticket {
    /// Completes at the next wake-up meant for this waiter: for a fair waiter, a grant to it
    /// (or a release worth asking after) heard since it last completed; for any other, the
    /// first wake-up after `seen` (at once if one already came).
    pub(crate) async fn woken(&self, seen: u64) {
        match &self.signal {
            Some(signal) => signal.notified().await,
            None => self.woken_since(seen).await,
        }
    }

    /// Whether this ticket is at the head of its queue now.
    pub(crate) fn is_head(&self) -> bool {
        self.key.lock_queue().head() == Some(self.id)
    }

    /// Waits until this ticket is at the head of its queue. A fair waiter's turn is kept in
    /// Redis: it waits for no local head.
    pub(crate) async fn until_head(&self) {
        if self.signal.is_some() {
            return;
        }
        loop {
            let turn = self.turn.notified();
            if self.key.lock_queue().head() == Some(self.id) {
                return;
            }
            turn.await;
        }
    }

    /// Leaves a standing offer for a local release to hand the lock over (see the module
    /// docs): the lock would be taken with `token` for `lease`. Replaces an earlier offer of
    /// this ticket; the receiver gets the grant.
    pub(crate) fn offer(
        &self,
        token: &str,
        lease: Duration,
        cohort: bool,
    ) -> tokio::sync::oneshot::Receiver<Handed> {
        let (handed, receiver) = tokio::sync::oneshot::channel();
        let offer = Offer {
            token: token.to_owned(),
            lease,
            cohort,
            handed,
        };
        if let Some(entry) = self.key.lock_queue().entry(self.id) {
            entry.offer = Some(offer);
        }
        receiver
    }

    /// Notes that this ticket's request took the (plain) lock: the next head leaves its offer
    /// at once instead of asking the server.
    pub(crate) fn holding(&self, lease_until: Instant) {
        self.key.lock_queue().held_here = Some(lease_until);
    }

    /// Until when the local head lets other processes' releases pass (see
    /// [`Waiters::yielded`]) before it asks: the end of the sit-out, or the look it takes
    /// once two turns have gone by unused; `None` when it may ask now.
    pub(crate) fn sitting_out(&self) -> Option<Instant> {
        let mut queue = self.key.lock_queue();
        let now = Instant::now();
        let sitting = queue.sitting_out.as_ref()?;
        if now >= sitting.until {
            queue.sitting_out = None;
            return None;
        }
        sitting.waits_until(now)
    }

    /// Until when a waiter of this manager holds the plain lock, if it does (see
    /// [`holding`](Self::holding)); past the end of its lease, the server decides.
    pub(crate) fn held_here(&self) -> Option<Instant> {
        self.key
            .lock_queue()
            .held_here
            .filter(|until| Instant::now() < *until)
    }

    /// Takes this ticket's offer back: `false` when a release already took it (its outcome
    /// then arrives on the offer's receiver).
    pub(crate) fn withdraw(&self) -> bool {
        let mut queue = self.key.lock_queue();
        queue
            .entry(self.id)
            .and_then(|entry| entry.offer.take())
            .is_some()
    }

    /// The wake-up count now; pass it to [`woken_since`](Self::woken_since).
    pub(crate) fn wakes(&self) -> u64 {
        self.key.wakes.load(Ordering::Acquire)
    }

    /// Completes at the first wake-up after `seen` (at once if one already came).
    async fn woken_since(&self, seen: u64) {
        loop {
            let notified = self.key.wake.notified();
            if self.wakes() != seen {
                return;
            }
            notified.await;
        }
    }

    /// Records what Redis last answered a local waiter of this key: `failure`, or none after a
    /// busy answer.
    pub(crate) fn heard(&self, failure: Option<redis::RedisError>) {
        *self.key.lock_last_failure() = failure;
    }

    /// The failure Redis last answered a local waiter of this key with, unless a busy answer
    /// came after it.
    pub(crate) fn last_failure(&self) -> Option<redis::RedisError> {
        self.key.lock_last_failure().clone()
    }

    /// Whether the manager follows this key's wake channel right now: a message published
    /// from here on reaches this waiter.
    pub(crate) fn is_subscribed(&self) -> bool {
        let Some(shared) = self.shared.upgrade() else {
            return false;
        };
        shared.alive(self.key.subscribed_in.load(Ordering::Acquire))
    }

    /// Makes sure the manager follows this key's wake channel, within the manager's connect
    /// and response timeouts. Errors are not fatal: the waiter then relies on its timed
    /// fallback.
    pub(crate) async fn subscribe(&self) {
        let Some(shared) = self.shared.upgrade() else {
            return;
        };
        if shared.alive(self.key.subscribed_in.load(Ordering::Acquire)) {
            return;
        }
        let Some((backend, driver)) = &self.driver_backend else {
            return;
        };
        let follow = shared.follow(self.key.clone(), backend.clone());
        let _ = driver.run(follow).await;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let idle;
        {
            let mut queue = self.key.lock_queue();
            let was_head = queue.head() == Some(self.id);
            queue.entries.retain(|entry| entry.id != self.id);
            idle = queue.is_idle();
            if was_head && let Some(next) = queue.entries.iter().find(|entry| entry.fair.is_none())
            {
                // Kept as a permit if the next is not waiting for it yet.
                next.turn.notify_one();
            }
        }
        if let (true, Some(shared)) = (idle, self.shared.upgrade()) {
            shared.forget_if_idle(&self.key);
        }
    }
}
