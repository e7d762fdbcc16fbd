//! Waiting for a busy lock without polling.
//!
//! Waiters of one manager for one key form a local FIFO queue, and only its head competes in
//! Redis. The head is woken by the release itself: the release script publishes on the
//! lock's wake channel (`prefix{key}:wake`), which the manager follows on one shared pub/sub
//! connection (on a Cluster with sharded pub/sub, on one per master: see `shards.rs`),
//! subscribed per key while the key has local waiters; a release made by this
//! manager also wakes the head directly. A timed look stays as the fallback for expiries
//! (which publish nothing): while the channel is followed, at the end of the holder's
//! remaining lease (a lost connection wakes every waiter to look again); while it is not, a
//! retry with full jitter, bounded by that lease.
//!
//! A waiter whose request is a plain exclusive lock also leaves an *offer* while it waits (not
//! while an attempt of its own is in flight): its owner token and lease. A release by this
//! manager takes the offer of the queue's head and swaps the owner on the server to that
//! token in its own round trip (see `guard/give_back.rs`), then hands the grant over through the
//! offer's channel: no publish, no wake-up, no second attempt. A run of such hand-offs is
//! bounded, so that other processes get their turn.
//!
//! Waiters of a *fair* lock queue in Redis instead (see `fair.lua`): their order is the
//! server's, shared by every process, and they never wait for a local head. Each has a
//! signal of its own: the release that grants it the lock publishes its token, which the
//! reader routes to that waiter alone; a release by this manager that grants one of its own
//! waiters hands the grant to that waiter's standing offer instead, in-process.
//!
//! A grant travels to its waiter as a [`Handed`], which gives the lock back if nobody takes
//! it. Releases themselves are sent by `release`, which tells the queue what they did.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use redis::aio::PubSubSink;
use tokio::sync::Notify;
use tokio::task::AbortHandle;

use crate::backend::Backend;
use crate::driver::Driver;
use crate::handed::Handed;

mod choice;
mod pubsub;
mod shards;
mod sit_out;
mod ticket;

use choice::{Choice, Terms, choose};
pub(crate) use choice::{CohortBounds, Passable};
use sit_out::{SittingOut, turn_of};
pub(crate) use ticket::Ticket;

/// The waiting side of one manager (a clone is another handle on the same waiters).
#[derive(Debug, Clone)]
pub(crate) struct Waiters {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    keys: Mutex<HashMap<String, Arc<KeyState>>>,
    /// The pub/sub connection (None until first needed, or after it was lost or dropped).
    /// Held across each subscribe or unsubscribe, so that those of one channel never overtake
    /// each other; every operation under it is bounded, so nobody holds it for long.
    sink: tokio::sync::Mutex<Sink>,
    /// Counts connections opened and given up: a key subscribed in an older one is not
    /// subscribed any more.
    generation: AtomicU64,
    /// The generation of the last connection whose reader saw it end.
    closed: AtomicU64,
    /// Set by `close`: no pub/sub connection from then on.
    shut: AtomicBool,
    /// On a Cluster with sharded pub/sub, the subscription connections, one per master, in
    /// place of the one classic connection.
    shards: shards::Shards,
    /// A task subscribes every waited channel again after the connection was lost.
    recovering: AtomicBool,
    /// Locks handed to a local waiter by a release.
    handoffs: AtomicU64,
    /// Of those, the ones passed with no server command (a cohort's local passes).
    passes: AtomicU64,
    /// The bounds of a run of local passes (`passes` 0: none).
    cohort: CohortBounds,
    /// Acquire attempts (of one key or a set) answered by the server.
    attempts: AtomicU64,
    /// What this manager's releases publish (see `ConnectOptions::manager_id`).
    manager_id: Arc<str>,
    connect_timeout: Duration,
    response_timeout: Duration,
}

#[derive(Default)]
struct Sink {
    sink: Option<PubSubSink>,
    /// The generation of `sink`.
    generation: u64,
    /// The task reading `sink`'s messages; aborting it closes the connection.
    reader: Option<AbortHandle>,
    /// After a failure, no connection is tried before this: waiters rely on their timers.
    retry_at: Option<Instant>,
}

impl std::fmt::Debug for Sink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sink")
            .field("connected", &self.sink.is_some())
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

/// The waiters of one key.
#[derive(Debug)]
pub(crate) struct KeyState {
    channel: String,
    queue: Mutex<Queue>,
    wake: Notify,
    /// Counts wake-ups (releases seen), so a waiter can tell whether one came since it looked.
    wakes: AtomicU64,
    /// The pub/sub generation this key is subscribed in (0: not subscribed).
    subscribed_in: AtomicU64,
    /// The last word from Redis to a local waiter: the failure, or none after a busy answer.
    last_failure: Mutex<Option<redis::RedisError>>,
    /// Where the unsubscribe goes once the key is idle.
    driver: Arc<Driver>,
}

#[derive(Debug, Default)]
struct Queue {
    /// The waiters in arrival order, each with its standing offer, if it left one.
    entries: VecDeque<Entry>,
    next_id: u64,
    /// The current run of local hand-offs: how many, since when.
    chain: Option<(u32, Instant)>,
    /// A waiter of this manager took the plain lock and has not released it yet, as far as
    /// this manager knows: until when its lease runs without renewal.
    held_here: Option<Instant>,
    /// A cohort's holder released the lock with nobody waiting: its run's other holders are
    /// likely back soon (their releases wait for the run's check), and queue here, behind
    /// one of them asking the server, instead of all asking at once. Until when.
    linger_until: Option<Instant>,
    /// After a run of hand-offs ended in a release to everyone: the local head lets the
    /// other processes have a turn each before it competes again, and waits until when at
    /// most (see [`SittingOut`]).
    sitting_out: Option<SittingOut>,
}

/// How long a key stays followed after a cohort's holder released it with nobody waiting
/// (see `Queue::linger_until`).
const LINGER: Duration = Duration::from_millis(2);

#[derive(Debug)]
struct Entry {
    id: u64,
    /// Told when this entry becomes the head (only it: a thousand waiters are not all woken
    /// each time the head leaves).
    turn: Arc<Notify>,
    offer: Option<Offer>,
    /// A fair waiter: its owner token, and the signal a grant to it sets.
    fair: Option<(String, Arc<Notify>)>,
}

/// Where a fair lock granted to a waiter of this manager goes (see [`Waiters::grant`]).
#[derive(Debug)]
pub(crate) enum Grant {
    /// To this standing offer.
    Offer(Offer),
    /// The waiter was signalled: it asks the server, which tells it the lock is its own.
    Signalled,
    /// No such waiter here (any more): it left, and its leaving gives the lock back.
    Gone,
}

/// A waiter's standing offer: the owner token and lease it would take the lock with, and
/// where to hand the grant.
#[derive(Debug)]
pub(crate) struct Offer {
    pub(crate) token: String,
    pub(crate) lease: Duration,
    /// The waiter may take the lock by a local pass (its request allows cohorts).
    pub(crate) cohort: bool,
    pub(crate) handed: tokio::sync::oneshot::Sender<Handed>,
}

/// What a release should do about the local waiters of its key.
#[derive(Debug)]
pub(crate) enum Next {
    /// Release to every process, and wake the local head if there is one.
    Release,
    /// Hand the lock to this waiter, through the server (its token, its lease).
    HandOff(Offer),
    /// Pass the lock to this waiter with no server command: it takes over the releasing
    /// holder's server hold (token and lease) as it is.
    Pass(Offer),
    /// The run of hand-offs is over: release to every process alike, waking nobody here
    /// ahead of the others (the local waiters hear the publish like everyone else).
    Yield,
}

impl Waiters {
    /// No waiters yet; pub/sub operations are bounded by the manager's timeouts.
    pub(crate) fn new(
        connect_timeout: Duration,
        response_timeout: Duration,
        manager_id: Arc<str>,
        cohort: CohortBounds,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                keys: Mutex::default(),
                sink: tokio::sync::Mutex::default(),
                generation: AtomicU64::new(0),
                closed: AtomicU64::new(0),
                shut: AtomicBool::new(false),
                shards: shards::Shards::default(),
                recovering: AtomicBool::new(false),
                handoffs: AtomicU64::new(0),
                passes: AtomicU64::new(0),
                cohort,
                attempts: AtomicU64::new(0),
                manager_id,
                connect_timeout,
                response_timeout,
            }),
        }
    }

    /// Whether any local request is waiting for the lock behind `channel`, or a task of this
    /// manager holds it (a request then queues for its release instead of asking the server).
    pub(crate) fn has_waiters(&self, channel: &str) -> bool {
        self.shared.lock_keys().contains_key(channel)
    }

    /// What this manager's releases publish, and its fair queue entries carry.
    pub(crate) fn manager_id(&self) -> &str {
        &self.shared.manager_id
    }

    /// How many locks releases handed to a local waiter so far.
    pub(crate) fn handoffs(&self) -> u64 {
        self.shared.handoffs.load(Ordering::Relaxed)
    }

    /// How many acquire attempts (of one key or a set) the server answered so far.
    pub(crate) fn attempts(&self) -> u64 {
        self.shared.attempts.load(Ordering::Relaxed)
    }

    /// Counts an acquire attempt answered.
    pub(crate) fn attempted(&self) {
        self.shared.attempts.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a lock handed to a local waiter.
    pub(crate) fn handed_off(&self) {
        self.shared.handoffs.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a lock passed to a local waiter with no server command (a hand-off too).
    pub(crate) fn passed(&self) {
        self.shared.passes.fetch_add(1, Ordering::Relaxed);
        self.handed_off();
    }

    /// How many locks were passed locally so far.
    pub(crate) fn passes(&self) -> u64 {
        self.shared.passes.load(Ordering::Relaxed)
    }

    /// How many local waiters stand ready for a hand-off right now.
    pub(crate) fn offers(&self) -> usize {
        let keys: Vec<_> = self.shared.lock_keys().values().cloned().collect();
        keys.iter()
            .filter(|key| {
                key.lock_queue()
                    .entries
                    .iter()
                    .find(|entry| entry.fair.is_none())
                    .is_some_and(|head| head.offer.is_some())
            })
            .count()
    }

    /// How many requests are queued right now, over every key.
    pub(crate) fn queued(&self) -> usize {
        let keys: Vec<_> = self.shared.lock_keys().values().cloned().collect();
        keys.iter().map(|key| key.lock_queue().entries.len()).sum()
    }

    /// How many keys have local waiters (and a subscription) right now; not those kept only
    /// while a task of this manager holds the lock, or for a moment after (see
    /// `Queue::linger_until`).
    pub(crate) fn waiting_keys(&self) -> usize {
        let keys: Vec<_> = self.shared.lock_keys().values().cloned().collect();
        keys.iter()
            .filter(|key| !key.lock_queue().entries.is_empty())
            .count()
    }

    /// Closes the pub/sub connection for good (the manager shut down); waiters fall back to
    /// their timers. Runs on the manager's runtime, where the connection's reader lives.
    pub(crate) fn close(&self) -> impl Future<Output = ()> + Send + 'static {
        let shared = self.shared.clone();
        async move {
            shared.shut.store(true, Ordering::Release);
            let mut sink = shared.sink.lock().await;
            if sink.sink.is_some() {
                shared.drop_connection(&mut sink);
            }
            drop(sink);
            shared.close_shards().await;
        }
    }

    /// Joins the back of the queue for the lock behind `channel`.
    pub(crate) fn join(
        &self,
        channel: &str,
        backend: &Backend,
        driver: &Arc<Driver>,
        metrics: crate::metrics::Labels,
    ) -> Ticket {
        self.enter(channel, backend, driver, metrics, None)
    }

    /// Waits for the fair lock behind `channel` with owner token `token`: its place is kept in
    /// Redis; here it only hears its grant (see the module docs).
    pub(crate) fn join_fair(
        &self,
        channel: &str,
        token: &str,
        backend: &Backend,
        driver: &Arc<Driver>,
        metrics: crate::metrics::Labels,
    ) -> Ticket {
        let signal = Arc::new(Notify::new());
        self.enter(
            channel,
            backend,
            driver,
            metrics,
            Some((token.to_owned(), signal)),
        )
    }

    fn enter(
        &self,
        channel: &str,
        backend: &Backend,
        driver: &Arc<Driver>,
        metrics: crate::metrics::Labels,
        fair: Option<(String, Arc<Notify>)>,
    ) -> Ticket {
        let signal = fair.as_ref().map(|(_, signal)| signal.clone());
        let turn = Arc::new(Notify::new());
        // The entry goes in while the key is in the map: a last waiter leaving meanwhile
        // (which takes the key out of the map only if its queue is empty, under the same
        // lock) cannot leave this one in a queue no release looks at.
        let mut keys = self.shared.lock_keys();
        let key = keys
            .entry(channel.to_owned())
            .or_insert_with(|| {
                Arc::new(KeyState {
                    channel: channel.to_owned(),
                    queue: Mutex::default(),
                    wake: Notify::new(),
                    wakes: AtomicU64::new(0),
                    subscribed_in: AtomicU64::new(0),
                    last_failure: Mutex::default(),
                    driver: driver.clone(),
                })
            })
            .clone();
        let id = {
            let mut queue = key.lock_queue();
            let id = queue.next_id;
            queue.next_id += 1;
            queue.entries.push_back(Entry {
                id,
                turn: turn.clone(),
                offer: None,
                fair,
            });
            id
        };
        drop(keys);
        Ticket {
            key,
            id,
            turn,
            signal,
            shared: Arc::downgrade(&self.shared),
            driver_backend: Some((backend.clone(), driver.clone())),
            _waiting: crate::metrics::Waiting::new(metrics),
        }
    }

    /// What a release of the lock behind `channel` by this manager should do (see
    /// [`choose`]): hand it to the local head's standing offer while the run of hand-offs is
    /// short, or release it. The offer taken is gone from the queue: its waiter finds it
    /// taken and waits for the outcome.
    pub(crate) fn next(&self, channel: &str, lease: Duration, passable: Option<Passable>) -> Next {
        let Some(key) = self.shared.lock_keys().get(channel).cloned() else {
            return Next::Release;
        };
        let mut queue = key.lock_queue();
        queue.held_here = None;
        let offer = queue
            .entries
            .iter_mut()
            .find(|entry| entry.fair.is_none())
            .and_then(|head| head.offer.take_if(|offer| !offer.handed.is_closed()));
        let terms = offer.as_ref().map(|offer| Terms {
            lease: offer.lease,
            cohort: offer.cohort,
        });
        let bounds = self.shared.cohort;
        let (choice, chain) = choose(terms, queue.chain, lease, passable, bounds, Instant::now());
        queue.chain = chain;
        let offer = match (choice, offer) {
            (Choice::HandOff, Some(offer)) => return Next::HandOff(offer),
            (Choice::Pass, Some(offer)) => return Next::Pass(offer),
            (Choice::Yield, offer) => {
                // The offer goes back to its waiter, which hears the release like everyone
                // else. Its wake-up may come before the release's answer says how many
                // others heard it (`yielded`): the head sits out one other's turns already.
                let head = queue.entries.iter_mut().find(|entry| entry.fair.is_none());
                if let Some(head) = head {
                    head.offer = offer;
                }
                let turn = turn_of(passable.is_some(), bounds, lease);
                queue.sitting_out = Some(SittingOut::provisional(turn, Instant::now()));
                return Next::Yield;
            }
            (Choice::Release | Choice::HandOff | Choice::Pass, offer) => offer,
        };
        debug_assert!(offer.is_none(), "a release to everyone takes no offer");
        if passable.is_some() && queue.entries.is_empty() {
            let until = Instant::now() + LINGER;
            queue.linger_until = Some(until);
            drop(queue);
            let shared = self.shared.clone();
            let lingering = key.clone();
            key.driver.spawn(async move {
                tokio::time::sleep_until(until.into()).await;
                shared.forget_if_idle(&lingering);
            });
            return Next::Release;
        }
        let idle = queue.is_idle();
        drop(queue);
        if idle {
            self.shared.forget_if_idle(&key);
        }
        Next::Release
    }

    /// A run of hand-offs ended with a release to everyone that `heard` subscribers heard.
    /// Other managers waiting for the key get their turns first: the local head lets one
    /// release by each of them pass (or a while, if they go quiet) before it competes again.
    /// With nobody else listening, the local head is woken at once.
    /// `cohort`: the run was one of local passes, whose slices are the cohort's time bound.
    pub(crate) fn yielded(&self, channel: &str, heard: u64, lease: Duration, cohort: bool) {
        let Some(key) = self.shared.lock_keys().get(channel).cloned() else {
            return;
        };
        let subscribed = key.subscribed_in.load(Ordering::Acquire) != 0;
        let others = heard.saturating_sub(u64::from(subscribed));
        if others == 0 {
            return self.unyielded(channel);
        }
        let slice = turn_of(cohort, self.shared.cohort, lease);
        let others = usize::try_from(others).unwrap_or(usize::MAX);
        let mut queue = key.lock_queue();
        // Releases heard since the yield (its provisional sit-out) still count.
        let heard = (queue.sitting_out.take())
            .filter(|sitting| sitting.provisional)
            .map(|sitting| sitting.heard);
        let mut sitting = SittingOut::new(others, slice, Instant::now());
        sitting.heard = heard.unwrap_or_default();
        if sitting.heard.len() < others {
            queue.sitting_out = Some(sitting);
        }
    }

    /// A release by this manager granted the fair lock behind `channel` to the waiter with
    /// owner token `token`: where the grant goes.
    pub(crate) fn grant(&self, channel: &str, token: &str) -> Grant {
        let Some(key) = self.shared.lock_keys().get(channel).cloned() else {
            return Grant::Gone;
        };
        let mut queue = key.lock_queue();
        let Some(entry) = queue
            .entries
            .iter_mut()
            .find(|entry| entry.fair.as_ref().is_some_and(|(own, _)| own == token))
        else {
            return Grant::Gone;
        };
        match entry.offer.take_if(|offer| !offer.handed.is_closed()) {
            Some(offer) => Grant::Offer(offer),
            None => {
                if let Some((_, signal)) = &entry.fair {
                    signal.notify_one();
                }
                Grant::Signalled
            }
        }
    }

    /// A release that chose to yield (see [`next`](Self::next)) did not reach everyone as
    /// one: the lock was not this manager's any more, or Redis did not answer. The head sits
    /// out no longer, and is woken at once.
    pub(crate) fn unyielded(&self, channel: &str) {
        if let Some(key) = self.shared.lock_keys().get(channel).cloned() {
            key.lock_queue().sitting_out = None;
        }
        self.released(channel);
    }

    /// A lock behind `channel` was released by this manager: wake its local head at once.
    pub(crate) fn released(&self, channel: &str) {
        let key = self.shared.lock_keys().get(channel).cloned();
        if let Some(key) = key {
            key.lock_queue().held_here = None;
            key.woken();
            self.shared.forget_if_idle(&key);
        }
    }
}

impl Shared {
    fn lock_keys(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<KeyState>>> {
        self.keys.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes `key` out of the map once nobody here waits for its lock and no task of this
    /// manager holds it, and stops following its wake channel. Kept while a task holds it:
    /// the next request of this manager then queues for its release (and a pass) instead of
    /// asking the server, as a waiter behind it would.
    fn forget_if_idle(self: &Arc<Self>, key: &Arc<KeyState>) {
        {
            let mut keys = self.lock_keys();
            // Another waiter may have joined meanwhile.
            if !key.lock_queue().is_idle()
                || !keys.get(&key.channel).is_some_and(|k| Arc::ptr_eq(k, key))
            {
                return;
            }
            keys.remove(&key.channel);
        }
        // A subscribe still in flight sees the key gone and unsubscribes by itself.
        let subscribed_in = key.subscribed_in.load(Ordering::Acquire);
        if subscribed_in == 0 {
            return;
        }
        let (shared, channel) = (self.clone(), key.channel.clone());
        key.driver
            .spawn(async move { shared.unfollow(&channel, subscribed_in).await });
    }
}

impl Queue {
    /// Nobody waits, and no task of this manager holds the lock (as far as it knows).
    fn is_idle(&self) -> bool {
        let now = Instant::now();
        self.entries.is_empty()
            && self.held_here.is_none_or(|until| now >= until)
            && self.linger_until.is_none_or(|until| now >= until)
    }

    /// The first waiter of the local queue; fair waiters keep their place in Redis instead.
    fn head(&self) -> Option<u64> {
        self.entries
            .iter()
            .find(|entry| entry.fair.is_none())
            .map(|entry| entry.id)
    }

    fn entry(&mut self, id: u64) -> Option<&mut Entry> {
        self.entries.iter_mut().find(|entry| entry.id == id)
    }
}

impl KeyState {
    fn lock_queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A release (or a lost connection): the local head looks again, and so does the oldest
    /// fair waiter, whose asking grants a lock that became free to the head of the fair
    /// queue, wherever that waits.
    fn woken(&self) {
        self.wakes.fetch_add(1, Ordering::AcqRel);
        self.wake.notify_one();
        let queue = self.lock_queue();
        if let Some((_, signal)) = queue.entries.iter().find_map(|entry| entry.fair.as_ref()) {
            signal.notify_one();
        }
    }

    /// The key's wake channel is followed from now on, in the connection of `generation`.
    /// Whatever was announced before went unheard: a head that trusted a task of this
    /// manager to wake it (an operator's forced release meanwhile announces nothing to this
    /// manager otherwise) asks the server once more.
    fn subscribed(&self, generation: u64) {
        self.subscribed_in.store(generation, Ordering::Release);
        let trusted = self.lock_queue().held_here.take().is_some();
        if trusted {
            self.woken();
        }
    }

    fn lock_last_failure(&self) -> std::sync::MutexGuard<'_, Option<redis::RedisError>> {
        self.last_failure.lock().unwrap_or_else(|e| e.into_inner())
    }
}
