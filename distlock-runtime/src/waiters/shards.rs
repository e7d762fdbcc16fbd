//! Wake-ups per shard, on a Redis Cluster whose servers have sharded pub/sub (Redis 7.0,
//! Valkey): the release scripts publish with `SPUBLISH` on the lock's wake channel, which the
//! Cluster delivers only inside the shard that owns the channel's slot (the lock's own), and
//! the waiters follow each channel with `SSUBSCRIBE` on that slot's master: one subscription
//! connection per master that owns waited channels, chosen by the slot map. A master that is
//! down, cut off or failing over costs only the wake-ups of the keys it owns; their waiters
//! rely on their timers until those keys are subscribed again.
//!
//! The slot map is read from the Cluster (`CLUSTER SLOTS`) when first needed, and again after
//! something says it changed: an `SSUBSCRIBE` answered `MOVED` (the channel goes to the master
//! named at once), a connection lost or not opened (a failover may be under way), a
//! `sunsubscribe` that a master sent of itself (it gave the slot away). The keys concerned
//! are subscribed again on the right master by the recovery that follows a lost classic
//! connection (`Shared::recover`), which then wakes them, since a release may have gone
//! unheard meanwhile.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use redis::{PushInfo, PushKind, Value};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};
use tokio::task::AbortHandle;

use super::{KeyState, Shared};
use crate::backend::{Backend, SlotRanges, slot_of};

/// The first generation of a shard's connection: far from those of the classic connection,
/// so that a key's `subscribed_in` names one connection whichever path it took.
const FIRST_GENERATION: u64 = 1 << 40;

/// The slot map is read again at most this often, however many keys ask.
const REREAD: Duration = Duration::from_millis(100);

/// The subscription connections of one manager, one per master, and the slot map.
#[derive(Debug)]
pub(super) struct Shards {
    map: Mutex<SlotMap>,
    /// Held while the map is read: one read at a time.
    reading: tokio::sync::Mutex<()>,
    /// Each master's subscription connection, by address.
    masters: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Shard>>>>,
    /// The connections open now, by generation.
    open: Mutex<HashMap<u64, Arc<tokio::sync::Mutex<Shard>>>>,
    /// The `SUNSUBSCRIBE`s sent and not yet confirmed (generation, channel): a confirmation
    /// of one of those is no master giving the channel away.
    leaving: Mutex<HashSet<(u64, String)>>,
    next: AtomicU64,
}

#[derive(Debug, Default)]
struct SlotMap {
    /// The master of each slot range; a single slot that a `MOVED` answer named comes first.
    ranges: SlotRanges,
    /// Something says the map changed: read it again.
    stale: bool,
    read_at: Option<Instant>,
    /// Masters that could not be reached lately: asked for the map last.
    down: HashSet<String>,
}

/// One master's subscription connection. Held across each subscribe or unsubscribe on it,
/// so that those of one channel never overtake each other.
#[derive(Default)]
struct Shard {
    conn: Option<MultiplexedConnection>,
    generation: u64,
    /// The task reading the connection's pushes.
    reader: Option<AbortHandle>,
    /// After a failure, no connection is tried before this.
    retry_at: Option<Instant>,
}

impl std::fmt::Debug for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shard")
            .field("connected", &self.conn.is_some())
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

impl Default for Shards {
    fn default() -> Self {
        Self {
            map: Mutex::default(),
            reading: tokio::sync::Mutex::new(()),
            masters: Mutex::default(),
            open: Mutex::default(),
            leaving: Mutex::default(),
            next: AtomicU64::new(FIRST_GENERATION),
        }
    }
}

fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shards {
    /// Whether the shard connection of `generation` is open.
    pub(super) fn is_open(&self, generation: u64) -> bool {
        locked(&self.open).contains_key(&generation)
    }

    /// The master of `slot` in the map, as last read.
    fn master_in_map(&self, slot: u16) -> Option<String> {
        let map = locked(&self.map);
        let range = map
            .ranges
            .iter()
            .find(|(a, b, _)| (*a..=*b).contains(&slot));
        range.map(|(_, _, master)| master.clone())
    }

    /// Whether the map needs reading now.
    fn needs_reading(&self) -> bool {
        let map = locked(&self.map);
        map.ranges.is_empty() || (map.stale && map.read_at.is_none_or(|at| at.elapsed() >= REREAD))
    }

    /// The masters to ask for the map, those that were reachable lately first.
    fn ask_order(&self) -> Vec<String> {
        let map = locked(&self.map);
        let mut seen = HashSet::new();
        let mut order: Vec<(bool, String)> = (map.ranges.iter())
            .filter(|(_, _, master)| seen.insert(master.clone()))
            .map(|(_, _, master)| (map.down.contains(master), master.clone()))
            .collect();
        order.sort_by_key(|(down, _)| *down);
        order.into_iter().map(|(_, master)| master).collect()
    }

    /// The map may be out of date: read it again before the next subscribe; `down`, if
    /// given, could not be reached.
    fn stale(&self, down: Option<&str>) {
        let mut map = locked(&self.map);
        map.stale = true;
        if let Some(down) = down {
            map.down.insert(down.to_owned());
        }
    }

    /// A `MOVED` answer said that `slot` belongs to `master`.
    fn redirect(&self, slot: u16, master: String) {
        let mut map = locked(&self.map);
        map.ranges.insert(0, (slot, slot, master));
        map.stale = true;
    }

    /// The subscription connection of `master` (not opened yet, perhaps).
    fn shard(&self, master: &str) -> Arc<tokio::sync::Mutex<Shard>> {
        locked(&self.masters)
            .entry(master.to_owned())
            .or_default()
            .clone()
    }
}

impl Shared {
    /// Makes sure `key`'s channel is followed on the master of its slot (see the module's
    /// text). As `follow`: bounded at every step, a failure leaves the waiters to their
    /// timers.
    pub(super) async fn follow_shard(self: Arc<Self>, key: Arc<KeyState>, backend: Backend) {
        let slot = slot_of(&key.channel);
        // A `MOVED` answer sends the channel once more, to the master it named.
        for _ in 0..2 {
            let Some(master) = self.master_of(slot, &backend).await else {
                return;
            };
            match self.subscribe_on(&master, &key, &backend).await {
                Some(moved_to) => self.shards.redirect(slot, moved_to),
                None => return,
            }
        }
    }

    /// The master of `slot`, after reading the slot map if it is unknown or stale.
    async fn master_of(&self, slot: u16, backend: &Backend) -> Option<String> {
        if self.shards.needs_reading() {
            let patience = self.response_timeout * 4;
            if let Ok(_reading) = tokio::time::timeout(patience, self.shards.reading.lock()).await
                && self.shards.needs_reading()
            {
                let answer = backend.slot_masters(&self.shards.ask_order()).await;
                let mut map = locked(&self.shards.map);
                map.read_at = Some(Instant::now());
                match answer {
                    Ok(ranges) if !ranges.is_empty() => {
                        map.ranges = ranges;
                        map.stale = false;
                    }
                    Ok(_) => tracing::debug!("an empty slot map; waiting on timers"),
                    Err(error) => tracing::debug!(%error, "no slot map; waiting on timers"),
                }
            }
        }
        self.shards.master_in_map(slot)
    }

    /// Subscribes `key`'s channel on the connection to `master`, opened if need be; `Some`
    /// with the master the channel belongs to instead, when `master` says so (`MOVED`).
    async fn subscribe_on(
        self: &Arc<Self>,
        master: &str,
        key: &Arc<KeyState>,
        backend: &Backend,
    ) -> Option<String> {
        let shard = self.shards.shard(master);
        // The holder finishes within this (a connect, or a subscribe and an unsubscribe).
        let patience = self.connect_timeout + self.response_timeout * 2;
        let Ok(mut shard) = tokio::time::timeout(patience, shard.lock()).await else {
            tracing::debug!("shard connection busy; waiting on timers");
            return None;
        };
        if self.shut.load(Ordering::Acquire) {
            return None;
        }
        // Its reader saw it end: a new one, without waiting.
        if shard.conn.is_some() && !self.shards.is_open(shard.generation) {
            shard.conn = None;
        }
        if shard.conn.is_none() && !self.open_shard(&mut shard, master, backend).await {
            return None;
        }
        let generation = shard.generation;
        if key.subscribed_in.load(Ordering::Acquire) == generation || !self.is_waited(key) {
            return None;
        }
        let answer = self
            .shard_command(&mut shard, "SSUBSCRIBE", &key.channel)
            .await;
        match answer {
            Ok(()) => key.subscribed(generation),
            Err(Some(moved_to)) => return Some(moved_to),
            Err(None) => {
                self.drop_shard(&mut shard, master);
                self.recover(backend);
                return None;
            }
        }
        // The last waiter left while this subscribed, and found nothing to unsubscribe.
        if !self.lock_keys().contains_key(&key.channel) {
            self.shard_unsubscribe(&mut shard, master, &key.channel)
                .await;
        }
        None
    }

    /// Opens the subscription connection of `master` into `shard`, and its reader: whether
    /// it is open. A failure waits a connect timeout before the next try.
    async fn open_shard(
        self: &Arc<Self>,
        shard: &mut Shard,
        master: &str,
        backend: &Backend,
    ) -> bool {
        if shard.retry_at.is_some_and(|at| Instant::now() < at) {
            return false;
        }
        let (pushes, received) = unbounded_channel();
        match backend.shard_pubsub(master, pushes).await {
            Ok(conn) => {
                let generation = self.shards.next.fetch_add(1, Ordering::AcqRel);
                let reader = tokio::spawn(read_shard(
                    Arc::downgrade(self),
                    received,
                    generation,
                    backend.clone(),
                ));
                *shard = Shard {
                    conn: Some(conn),
                    generation,
                    reader: Some(reader.abort_handle()),
                    retry_at: None,
                };
                let this = self.shards.shard(master);
                locked(&self.shards.open).insert(generation, this);
                locked(&self.shards.map).down.remove(master);
                true
            }
            Err(error) => {
                tracing::debug!(%error, "no connection to a shard's master; waiting on timers");
                shard.retry_at = Some(Instant::now() + self.connect_timeout);
                self.shards.stale(Some(master));
                false
            }
        }
    }

    /// Sends `verb channel` (`SSUBSCRIBE` or `SUNSUBSCRIBE`) on `shard`'s connection and
    /// checks its confirmation; `Err(Some(master))` when the channel belongs to another
    /// master (`MOVED`), `Err(None)` when the connection cannot be trusted any more.
    async fn shard_command(
        &self,
        shard: &mut Shard,
        verb: &str,
        channel: &str,
    ) -> Result<(), Option<String>> {
        let conn = shard.conn.as_mut().ok_or(None)?;
        let mut cmd = redis::cmd(verb);
        cmd.arg(channel);
        let answer = tokio::time::timeout(self.response_timeout, conn.send_packed_command(&cmd));
        let error = match answer.await {
            Ok(Ok(value)) => match value.extract_error() {
                Ok(value) if confirms(&value, verb, channel) => return Ok(()),
                Ok(value) => format!("an answer out of step: {value:?}"),
                Err(error) => match error.redirect_node() {
                    Some((master, _)) => return Err(Some(master.to_owned())),
                    None => error.to_string(),
                },
            },
            Ok(Err(error)) => error.to_string(),
            Err(_) => "no answer".to_owned(),
        };
        tracing::debug!(%error, verb, "a shard's subscription failed; waiting on timers");
        Err(None)
    }

    /// Stops following `channel` on `shard`'s connection, or drops the connection.
    async fn shard_unsubscribe(&self, shard: &mut Shard, master: &str, channel: &str) {
        // Its confirmation reaches the reader too: that one is no master giving it away.
        let leaving = (shard.generation, channel.to_owned());
        locked(&self.shards.leaving).insert(leaving.clone());
        if self
            .shard_command(shard, "SUNSUBSCRIBE", channel)
            .await
            .is_err()
        {
            locked(&self.shards.leaving).remove(&leaving);
            self.drop_shard(shard, master);
        }
    }

    /// Stops following `channel`, subscribed on the shard connection of `generation`, once
    /// nobody waits for it (see `forget_if_idle`).
    pub(super) async fn shard_unfollow(&self, channel: &str, generation: u64) {
        let Some(shard) = locked(&self.shards.open).get(&generation).cloned() else {
            return;
        };
        let mut shard = shard.lock().await;
        if self.lock_keys().contains_key(channel) || shard.generation != generation {
            return;
        }
        let master = slot_of(channel);
        let master = self.shards.master_in_map(master).unwrap_or_default();
        self.shard_unsubscribe(&mut shard, &master, channel).await;
    }

    /// Gives up `shard`'s connection (of `master`): closed, no new one for a while, and its
    /// keys told.
    fn drop_shard(&self, shard: &mut Shard, master: &str) {
        shard.conn = None;
        if let Some(reader) = shard.reader.take() {
            reader.abort();
        }
        shard.retry_at = Some(Instant::now() + self.connect_timeout);
        self.shards.stale(Some(master));
        self.lost_shard(shard.generation);
    }

    /// The shard connection of `generation` is gone: its keys, and only those, are not
    /// subscribed any more, and look again (and subscribe on a new connection).
    fn lost_shard(&self, generation: u64) {
        if locked(&self.shards.open).remove(&generation).is_none() {
            return;
        }
        locked(&self.shards.leaving).retain(|(of, _)| *of != generation);
        self.shards.stale(None);
        let keys: Vec<_> = self.lock_keys().values().cloned().collect();
        for key in keys {
            let lost = key.subscribed_in.compare_exchange(
                generation,
                0,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
            if lost.is_ok() {
                key.woken();
            }
        }
    }

    /// A master unsubscribed `channel` of itself on the connection of `generation`: it gave
    /// the channel's slot away (a failover, a reshard). The key looks again, and subscribes
    /// where the slot went.
    fn moved_away(self: &Arc<Self>, channel: &str, generation: u64, backend: &Backend) {
        let leaving = (generation, channel.to_owned());
        if locked(&self.shards.leaving).remove(&leaving) {
            return;
        }
        let Some(key) = self.lock_keys().get(channel).cloned() else {
            return;
        };
        let moved =
            key.subscribed_in
                .compare_exchange(generation, 0, Ordering::AcqRel, Ordering::Acquire);
        if moved.is_ok() {
            self.shards.stale(None);
            key.woken();
            self.recover(backend);
        }
    }

    /// Closes every shard connection for good (the manager shut down).
    pub(super) async fn close_shards(&self) {
        let shards: Vec<_> = locked(&self.shards.masters).drain().collect();
        for (master, shard) in shards {
            let mut shard = shard.lock().await;
            if shard.conn.is_some() {
                self.drop_shard(&mut shard, &master);
            }
        }
    }
}

/// Whether `value` confirms `verb` (`SSUBSCRIBE` or `SUNSUBSCRIBE`) of `channel`.
fn confirms(value: &Value, verb: &str, channel: &str) -> bool {
    let kind = match verb {
        "SSUBSCRIBE" => PushKind::SSubscribe,
        _ => PushKind::SUnsubscribe,
    };
    matches!(value, Value::Push { kind: k, data } if *k == kind
        && matches!(data.first(), Some(Value::BulkString(c)) if c == channel.as_bytes()))
}

/// Routes the messages of one shard connection to their keys' waiters, and hears a master
/// give a channel away, until the connection ends; then has its keys subscribed again.
async fn read_shard(
    shared: Weak<Shared>,
    mut pushes: UnboundedReceiver<PushInfo>,
    generation: u64,
    backend: Backend,
) {
    while let Some(push) = pushes.recv().await {
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let channel = match push.data.first() {
            Some(Value::BulkString(channel)) => std::str::from_utf8(channel).ok(),
            _ => None,
        };
        match (push.kind, channel) {
            (PushKind::SMessage, Some(channel)) => {
                if let Some(Value::BulkString(message)) = push.data.get(1) {
                    shared.dispatch(channel, message);
                }
            }
            (PushKind::SUnsubscribe, Some(channel)) => {
                shared.moved_away(channel, generation, &backend);
            }
            (PushKind::Disconnection, _) => break,
            _ => {}
        }
    }
    if let Some(shared) = shared.upgrade() {
        tracing::debug!("a shard's subscription connection was lost");
        shared.lost_shard(generation);
        shared.recover(&backend);
    }
}
