//! Waiting for a busy lock without polling.
//!
//! Waiters of one manager for one key form a local FIFO queue, and only its head competes in
//! Redis. The head is woken by the release itself: the release script publishes on the
//! lock's wake channel (`prefix{key}:wake`), which the manager follows on one shared pub/sub
//! connection, subscribed per key while the key has local waiters; a release made by this
//! manager also wakes the head directly. A timed retry with full jitter, bounded by the
//! holder's remaining lease, stays as the fallback for expiries (which publish nothing) and
//! for a pub/sub connection that is down.

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use futures_util::Stream;
use redis::aio::{PubSubSink, PubSubStream};
use tokio::sync::Notify;

use crate::backend::Backend;
use crate::driver::Driver;

/// The waiting side of one manager.
#[derive(Debug, Default)]
pub(crate) struct Waiters {
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    keys: Mutex<HashMap<String, Arc<KeyState>>>,
    /// The pub/sub connection (None until first needed, or after it was lost), with the
    /// generation that counts reconnects. Held across subscribe calls, so that subscribe and
    /// unsubscribe of one channel never overtake each other.
    sink: tokio::sync::Mutex<Sink>,
    generation: AtomicU64,
    /// Set by `close`: no pub/sub connection from then on.
    closed: tokio::sync::watch::Sender<bool>,
}

#[derive(Default)]
struct Sink {
    sink: Option<PubSubSink>,
}

impl std::fmt::Debug for Sink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sink")
            .field("connected", &self.sink.is_some())
            .finish()
    }
}

/// The waiters of one key.
#[derive(Debug)]
pub(crate) struct KeyState {
    channel: String,
    queue: Mutex<Queue>,
    head_changed: Notify,
    wake: Notify,
    /// Counts wake-ups (releases seen), so a waiter can tell whether one came since it looked.
    wakes: AtomicU64,
    /// The pub/sub generation this key is subscribed in (0: not subscribed).
    subscribed_in: AtomicU64,
}

#[derive(Debug, Default)]
struct Queue {
    ids: VecDeque<u64>,
    next_id: u64,
}

/// A place in a key's queue; leaving (drop) lets the next waiter compete.
#[derive(Debug)]
pub(crate) struct Ticket {
    key: Arc<KeyState>,
    id: u64,
    shared: Weak<Shared>,
    driver_backend: Option<(Backend, Arc<Driver>)>,
}

impl Waiters {
    /// Whether any local request is waiting for the lock behind `channel`.
    pub(crate) fn has_waiters(&self, channel: &str) -> bool {
        self.shared.lock_keys().contains_key(channel)
    }

    /// How many keys have local waiters (and a subscription) right now.
    pub(crate) fn waiting_keys(&self) -> usize {
        self.shared.lock_keys().len()
    }

    /// Joins the back of the queue for the lock behind `channel`.
    pub(crate) fn join(&self, channel: &str, backend: &Backend, driver: &Arc<Driver>) -> Ticket {
        let key = self
            .shared
            .lock_keys()
            .entry(channel.to_owned())
            .or_insert_with(|| {
                Arc::new(KeyState {
                    channel: channel.to_owned(),
                    queue: Mutex::default(),
                    head_changed: Notify::new(),
                    wake: Notify::new(),
                    wakes: AtomicU64::new(0),
                    subscribed_in: AtomicU64::new(0),
                })
            })
            .clone();
        let id = {
            let mut queue = key.lock_queue();
            let id = queue.next_id;
            queue.next_id += 1;
            queue.ids.push_back(id);
            id
        };
        Ticket {
            key,
            id,
            shared: Arc::downgrade(&self.shared),
            driver_backend: Some((backend.clone(), driver.clone())),
        }
    }

    /// Closes the pub/sub connection for good (the manager shut down); waiters fall back to
    /// their timers.
    pub(crate) fn close(&self) -> impl Future<Output = ()> + Send + 'static {
        let shared = self.shared.clone();
        async move {
            shared.closed.send_replace(true);
            shared.sink.lock().await.sink = None;
        }
    }

    /// A lock behind `channel` was released by this manager: wake its local head at once.
    pub(crate) fn released(&self, channel: &str) {
        let key = self.shared.lock_keys().get(channel).cloned();
        if let Some(key) = key {
            key.woken();
        }
    }
}

impl Shared {
    fn lock_keys(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<KeyState>>> {
        self.keys.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A message arrived on `channel`.
    fn dispatch(&self, channel: &str) {
        let key = self.lock_keys().get(channel).cloned();
        if let Some(key) = key {
            key.woken();
        }
    }

    /// The pub/sub connection is gone: wake everyone (they re-check and resubscribe).
    fn lost_connection(&self) {
        let keys: Vec<_> = self.lock_keys().values().cloned().collect();
        for key in keys {
            key.subscribed_in.store(0, Ordering::Release);
            key.woken();
        }
    }
}

impl KeyState {
    fn lock_queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn woken(&self) {
        self.wakes.fetch_add(1, Ordering::AcqRel);
        self.wake.notify_one();
    }
}

impl Ticket {
    /// Waits until this ticket is at the head of its queue.
    pub(crate) async fn until_head(&self) {
        loop {
            let changed = self.key.head_changed.notified();
            if self.key.lock_queue().ids.front() == Some(&self.id) {
                return;
            }
            changed.await;
        }
    }

    /// The wake-up count now; pass it to [`woken_since`](Self::woken_since).
    pub(crate) fn wakes(&self) -> u64 {
        self.key.wakes.load(Ordering::Acquire)
    }

    /// Completes at the first wake-up after `seen` (at once if one already came).
    pub(crate) async fn woken_since(&self, seen: u64) {
        loop {
            let notified = self.key.wake.notified();
            if self.wakes() != seen {
                return;
            }
            notified.await;
        }
    }

    /// Makes sure the manager follows this key's wake channel. Errors are not fatal: the
    /// waiter then relies on its timed fallback.
    pub(crate) async fn subscribe(&self) {
        let Some(shared) = self.shared.upgrade() else {
            return;
        };
        let Some((backend, driver)) = &self.driver_backend else {
            return;
        };
        let generation = shared.generation.load(Ordering::Acquire);
        if generation != 0 && self.key.subscribed_in.load(Ordering::Acquire) == generation {
            return;
        }
        let mut sink = shared.sink.lock().await;
        if sink.sink.is_none() {
            match connect(&shared, backend, driver).await {
                Some(new) => sink.sink = Some(new),
                None => return,
            }
        }
        let generation = shared.generation.load(Ordering::Acquire);
        if self.key.subscribed_in.load(Ordering::Acquire) == generation {
            return;
        }
        let Some(connection) = sink.sink.as_mut() else {
            return;
        };
        match connection.subscribe(&self.key.channel).await {
            Ok(()) => self.key.subscribed_in.store(generation, Ordering::Release),
            Err(error) => {
                tracing::debug!(%error, "subscribe failed; waiting on timers");
                sink.sink = None;
            }
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let was_head;
        let empty;
        {
            let mut queue = self.key.lock_queue();
            was_head = queue.ids.front() == Some(&self.id);
            queue.ids.retain(|&id| id != self.id);
            empty = queue.ids.is_empty();
        }
        if was_head {
            self.key.head_changed.notify_waiters();
        }
        if !empty {
            return;
        }
        let Some(shared) = self.shared.upgrade() else {
            return;
        };
        {
            let mut keys = shared.lock_keys();
            // Another waiter may have joined meanwhile.
            if self.key.lock_queue().ids.is_empty()
                && keys
                    .get(&self.key.channel)
                    .is_some_and(|k| Arc::ptr_eq(k, &self.key))
            {
                keys.remove(&self.key.channel);
            } else {
                return;
            }
        }
        if self.key.subscribed_in.load(Ordering::Acquire) == 0 {
            return;
        }
        let Some((_, driver)) = self.driver_backend.take() else {
            return;
        };
        let channel = self.key.channel.clone();
        driver.spawn(async move {
            let mut sink = shared.sink.lock().await;
            // Re-joined while this waited for the sink: the new waiters keep the subscription.
            if shared.lock_keys().contains_key(&channel) {
                return;
            }
            if let Some(connection) = sink.sink.as_mut()
                && let Err(error) = connection.unsubscribe(&channel).await
            {
                tracing::debug!(%error, "unsubscribe failed");
                sink.sink = None;
            }
        });
    }
}

/// Opens the pub/sub connection on the manager's runtime and starts its reader there.
async fn connect(
    shared: &Arc<Shared>,
    backend: &Backend,
    driver: &Arc<Driver>,
) -> Option<PubSubSink> {
    if *shared.closed.borrow() {
        return None;
    }
    let backend = backend.clone();
    let pubsub = match driver.run(async move { backend.pubsub().await }).await {
        Ok(Ok(pubsub)) => pubsub,
        Ok(Err(error)) => {
            tracing::debug!(%error, "no pub/sub connection; waiting on timers");
            return None;
        }
        Err(_) => return None,
    };
    let (sink, stream) = pubsub.split();
    shared.generation.fetch_add(1, Ordering::AcqRel);
    driver.spawn(read(Arc::downgrade(shared), stream));
    Some(sink)
}

/// Routes every message to its key's waiters, until the connection ends.
async fn read(shared: Weak<Shared>, mut stream: PubSubStream) {
    let Some(mut closed) = shared.upgrade().map(|shared| shared.closed.subscribe()) else {
        return;
    };
    loop {
        let next = std::future::poll_fn(|cx| Pin::new(&mut stream).poll_next(cx));
        // Dropping the stream ends the connection.
        let message = tokio::select! {
            message = next => message,
            _ = closed.wait_for(|closed| *closed) => None,
        };
        let Some(message) = message else {
            break;
        };
        let Some(shared) = shared.upgrade() else {
            return;
        };
        shared.dispatch(message.get_channel_name());
    }
    if let Some(shared) = shared.upgrade() {
        tracing::debug!("pub/sub connection lost");
        if let Ok(mut sink) = shared.sink.try_lock() {
            sink.sink = None;
        }
        shared.lost_connection();
    }
}
