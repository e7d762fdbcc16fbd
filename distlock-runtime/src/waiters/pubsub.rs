//! The pub/sub side of waiting: the reader that routes each release to its key's waiters,
//! following a key's wake channel while it has waiters, and getting every waited channel back
//! after the connection is lost. The classic connection is here; on a Cluster with sharded
//! pub/sub, `shards.rs` follows each channel on its slot's master instead.

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use futures_util::Stream;
use redis::aio::PubSubStream;

use super::{KeyState, Shared, Sink};
use crate::backend::Backend;

impl Shared {
    /// A message arrived on `channel`: a release, by this manager if it carries its manager id; or,
    /// `=token`, a fair lock granted to the waiter with that owner token.
    pub(super) fn dispatch(&self, channel: &str, message: &[u8]) {
        let key = self.lock_keys().get(channel).cloned();
        if let Some(key) = key {
            if let Some(token) = message.strip_prefix(b"=") {
                let queue = key.lock_queue();
                let granted = queue.entries.iter().find_map(|entry| {
                    entry
                        .fair
                        .as_ref()
                        .filter(|(own, _)| own.as_bytes() == token)
                });
                if let Some((_, signal)) = granted {
                    signal.notify_one();
                }
                return;
            }
            if message != self.manager_id.as_bytes() {
                let mut queue = key.lock_queue();
                // Not this manager's own release: whoever it was (another process, an
                // operator's forced release, a writer's intent taken back), the lock may not
                // be held here any more, and the head asks the server instead of waiting for
                // a release of this manager's that may never come.
                queue.held_here = None;
                if let Some(sitting) = &mut queue.sitting_out
                    && sitting.heard(message, Instant::now())
                {
                    queue.sitting_out = None;
                }
            }
            key.woken();
        }
    }

    /// The connection of `generation` is gone: its keys are not subscribed any more, and
    /// everyone is woken to look again (and to subscribe on a new connection).
    pub(super) fn lost_connection(&self, generation: u64) {
        let keys: Vec<_> = self.lock_keys().values().cloned().collect();
        for key in keys {
            let _ = key.subscribed_in.compare_exchange(
                generation,
                0,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
            key.woken();
        }
    }

    /// Gives up the current connection: closes it (its reader ends, which drops the socket)
    /// and tries no new one for a while.
    pub(super) fn drop_connection(&self, sink: &mut Sink) {
        sink.sink = None;
        if let Some(reader) = sink.reader.take() {
            reader.abort();
        }
        sink.retry_at = Some(Instant::now() + self.connect_timeout);
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.lost_connection(sink.generation);
    }

    /// Makes sure `key`'s channel is followed. Runs on the manager's runtime, where the
    /// connection and its reader live, and always to its end, so that whether the channel is
    /// subscribed is never left unknown. Every step is bounded; a failure leaves the waiters
    /// to their timers.
    pub(super) async fn follow(self: Arc<Self>, key: Arc<KeyState>, backend: Backend) {
        if backend.sharded_wakes() {
            return self.follow_shard(key, backend).await;
        }
        // The holder of the sink finishes within this (a connect, or a subscribe and an
        // unsubscribe): waiting longer means something is stuck.
        let patience = self.connect_timeout + self.response_timeout * 2;
        let Ok(mut sink) = tokio::time::timeout(patience, self.sink.lock()).await else {
            tracing::debug!("pub/sub connection busy; waiting on timers");
            return;
        };
        if self.shut.load(Ordering::Acquire) {
            return;
        }
        if sink.sink.is_some() && self.closed.load(Ordering::Acquire) == sink.generation {
            self.drop_connection(&mut sink);
            sink.retry_at = None;
        }
        if sink.sink.is_none() {
            if sink.retry_at.is_some_and(|at| Instant::now() < at) {
                return;
            }
            // Bounded by the connect timeout.
            match backend.pubsub().await {
                Ok(pubsub) => {
                    let (new, stream) = pubsub.split();
                    let generation = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
                    let reader = tokio::spawn(read(
                        Arc::downgrade(&self),
                        stream,
                        generation,
                        backend.clone(),
                    ));
                    *sink = Sink {
                        sink: Some(new),
                        generation,
                        reader: Some(reader.abort_handle()),
                        retry_at: None,
                    };
                }
                Err(error) => {
                    tracing::debug!(%error, "no pub/sub connection; waiting on timers");
                    sink.retry_at = Some(Instant::now() + self.connect_timeout);
                    return;
                }
            }
        }
        let generation = sink.generation;
        if key.subscribed_in.load(Ordering::Acquire) == generation || !self.is_waited(&key) {
            return;
        }
        let Some(connection) = sink.sink.as_mut() else {
            return;
        };
        match tokio::time::timeout(self.response_timeout, connection.subscribe(&key.channel)).await
        {
            Ok(Ok(())) => key.subscribed(generation),
            Ok(Err(error)) => {
                tracing::debug!(%error, "subscribe failed; waiting on timers");
                self.drop_connection(&mut sink);
                self.recover(&backend);
                return;
            }
            Err(_) => {
                tracing::debug!("no answer to subscribe; waiting on timers");
                self.drop_connection(&mut sink);
                self.recover(&backend);
                return;
            }
        }
        // The last waiter left while this subscribed, and found nothing to unsubscribe.
        if !self.lock_keys().contains_key(&key.channel) {
            self.unsubscribe(&mut sink, &key.channel).await;
        }
    }

    /// After the connection was lost: subscribes every waited channel again, as soon as a
    /// connection can be opened (tried every connect timeout or so, on the manager's
    /// runtime), then wakes every waiter to look again, since a release may have gone
    /// unheard meanwhile (a partition drops the message without a word). Without this, a
    /// waiter whose wake-up was lost would sleep until its fallback timer.
    pub(super) fn recover(self: &Arc<Self>, backend: &Backend) {
        if self.shut.load(Ordering::Acquire) || self.recovering.swap(true, Ordering::AcqRel) {
            return;
        }
        let (shared, backend) = (Arc::clone(self), backend.clone());
        drop(tokio::spawn(async move {
            shared.resubscribe(backend).await;
            shared.recovering.store(false, Ordering::Release);
        }));
    }

    /// Subscribes every key that lost its subscription again, then wakes those keys (only
    /// those: on a Cluster, the keys of the other shards heard every release meanwhile).
    pub(super) async fn resubscribe(self: &Arc<Self>, backend: Backend) {
        let mut lost: Vec<Arc<KeyState>> = Vec::new();
        loop {
            let keys: Vec<_> = self.lock_keys().values().cloned().collect();
            if keys.is_empty() || self.shut.load(Ordering::Acquire) {
                return;
            }
            for key in &keys {
                if self.alive(key.subscribed_in.load(Ordering::Acquire)) {
                    continue;
                }
                if !lost.iter().any(|seen| Arc::ptr_eq(seen, key)) {
                    lost.push(Arc::clone(key));
                }
                Arc::clone(self)
                    .follow(Arc::clone(key), backend.clone())
                    .await;
            }
            if keys.iter().all(|key| {
                self.alive(key.subscribed_in.load(Ordering::Acquire)) || !self.is_waited(key)
            }) {
                for key in &lost {
                    key.woken();
                }
                // Once more when an attempt in flight at that wake-up has had its answer (a
                // waiter counts wake-ups from its last look, which that attempt is): it then
                // sleeps on what may be a stale busy answer, and is woken to look again.
                tokio::time::sleep(self.response_timeout + Duration::from_millis(50)).await;
                for key in lost.iter().filter(|key| self.is_waited(key)) {
                    key.woken();
                }
                return;
            }
            let pause = self.connect_timeout.mul_f64(1.0 + fastrand::f64() / 2.0);
            tokio::time::sleep(pause).await;
        }
    }

    /// Whether the connection of `generation` (a key's `subscribed_in`) is open: the classic
    /// one, or a shard's.
    pub(super) fn alive(&self, generation: u64) -> bool {
        generation != 0
            && ((generation == self.generation.load(Ordering::Acquire)
                && self.closed.load(Ordering::Acquire) != generation)
                || self.shards.is_open(generation))
    }

    /// Stops following `channel`, subscribed on the connection of `subscribed_in`, once
    /// nobody waits for it any more.
    pub(super) async fn unfollow(&self, channel: &str, subscribed_in: u64) {
        if self.shards.is_open(subscribed_in) {
            return self.shard_unfollow(channel, subscribed_in).await;
        }
        // Every holder of the sink lets go within its bounds.
        let mut sink = self.sink.lock().await;
        // Re-joined while this waited for the sink: the new waiters keep the subscription.
        // On another connection than the one subscribed: nothing to undo.
        if self.lock_keys().contains_key(channel) || sink.generation != subscribed_in {
            return;
        }
        self.unsubscribe(&mut sink, channel).await;
    }

    /// Whether `key` is still the waiting state of its channel.
    pub(super) fn is_waited(&self, key: &Arc<KeyState>) -> bool {
        self.lock_keys()
            .get(&key.channel)
            .is_some_and(|k| Arc::ptr_eq(k, key))
    }

    /// Stops following `channel`, within the response timeout or by dropping the connection.
    pub(super) async fn unsubscribe(&self, sink: &mut Sink, channel: &str) {
        let Some(connection) = sink.sink.as_mut() else {
            return;
        };
        let error = match tokio::time::timeout(
            self.response_timeout,
            connection.unsubscribe(channel),
        )
        .await
        {
            Ok(Ok(())) => return,
            Ok(Err(error)) => error.to_string(),
            Err(_) => "no answer".to_owned(),
        };
        tracing::debug!(%error, "unsubscribe failed; dropping the pub/sub connection");
        self.drop_connection(sink);
    }
}

/// Routes every message to its key's waiters, until the connection ends; then has the
/// waited channels subscribed again on a new one.
pub(super) async fn read(
    shared: Weak<Shared>,
    mut stream: PubSubStream,
    generation: u64,
    backend: Backend,
) {
    while let Some(message) = std::future::poll_fn(|cx| Pin::new(&mut stream).poll_next(cx)).await {
        let Some(shared) = shared.upgrade() else {
            return;
        };
        shared.dispatch(message.get_channel_name(), message.get_payload_bytes());
    }
    if let Some(shared) = shared.upgrade() {
        tracing::debug!("pub/sub connection lost");
        shared.closed.store(generation, Ordering::Release);
        shared.lost_connection(generation);
        shared.recover(&backend);
    }
}
