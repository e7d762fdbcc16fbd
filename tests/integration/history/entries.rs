//! What programs hand the history: the grants it reads (`Granted`: a guard's, or a set's
//! hold of one of its keys), and the records of a request asleep (`Waiting`) and of a hold
//! entered (`Entry`, `SetEntry`), which note their end in the history when dropped.

use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock::{LockGuard, MultiGuard};

use super::checker::{Granted, History, push_recent};
use super::model::Kind;

impl Granted for LockGuard {
    fn token(&self) -> &str {
        LockGuard::token(self)
    }
    fn remaining(&self) -> Duration {
        LockGuard::remaining(self)
    }
    fn local_passes(&self) -> u32 {
        LockGuard::local_passes(self)
    }
    fn fencing_token(&self) -> Option<u64> {
        LockGuard::fencing_token(self)
    }
    fn ttl(&self) -> Duration {
        LockGuard::ttl(self)
    }
    fn waited(&self) -> Duration {
        LockGuard::waited(self)
    }
}

/// A set's hold of one of its keys: exclusive, owned by the set's token; or, for a key the
/// set re-entered, the hold of that key's outer holder (its owner, its place in a cohort's
/// run, its kind).
#[derive(Debug)]
pub(super) struct SetHold {
    pub(super) key: &'static str,
    pub(super) owner: String,
    pub(super) passes: u32,
    pub(super) kind: Kind,
}

/// One key of a granted set, as the history reads it.
pub(super) struct SetKeyGrant<'g> {
    pub(super) set: &'g MultiGuard,
    pub(super) hold: &'g SetHold,
    pub(super) first: bool,
}

impl Granted for SetKeyGrant<'_> {
    fn token(&self) -> &str {
        &self.hold.owner
    }
    fn remaining(&self) -> Duration {
        self.set.remaining()
    }
    fn local_passes(&self) -> u32 {
        self.hold.passes
    }
    fn fencing_token(&self) -> Option<u64> {
        self.set.fencing_token(self.hold.key)
    }
    fn ttl(&self) -> Duration {
        self.set.ttl()
    }
    fn waited(&self) -> Duration {
        self.set.waited()
    }
    fn counts(&self) -> bool {
        self.first
    }
}

/// A request sleeping in `acquire()`, for the liveness monitor.
pub(super) struct Waiting {
    pub(super) history: Arc<History>,
    pub(super) id: u64,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.history.lock().waiting.remove(&self.id);
    }
}

/// Being inside a critical section. Dropped (exit recorded) before the guard is released or
/// dropped: declare it after the guard.
pub(super) struct Entry {
    pub(super) history: Arc<History>,
    pub(super) key: String,
    pub(super) id: u64,
}

impl Entry {
    /// The guard's lease moved on (extend, renewal): so does the bound.
    pub(super) fn refresh(&self, guard: &LockGuard) {
        self.refresh_by(guard.remaining());
    }

    /// The hold is valid for `remaining` more.
    pub(super) fn refresh_by(&self, remaining: Duration) {
        let until = Instant::now() + remaining;
        let mut state = self.history.lock();
        if let Some(holder) = state
            .holders
            .get_mut(&self.key)
            .and_then(|hs| hs.iter_mut().find(|h| h.id == self.id))
        {
            holder.valid_until = holder.valid_until.max(until);
        }
    }
}

impl Entry {
    /// The owner asked for a lease of `ttl` (an extend): its key may live that long.
    pub(super) fn extended(&self, guard: &LockGuard, ttl: Duration) {
        let mut state = self.history.lock();
        let cap = state
            .lease_caps
            .entry(guard.token().to_owned())
            .or_default();
        *cap = (*cap).max(ttl);
    }

    /// The key's lease is not this owner's alone to bound (a fair grant).
    pub(super) fn uncapped(&self) {
        let mut state = self.history.lock();
        if let Some(holder) = state
            .holders
            .get_mut(&self.key)
            .and_then(|hs| hs.iter_mut().find(|h| h.id == self.id))
        {
            holder.capped = false;
        }
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        let mut state = self.history.lock();
        let mut owner = None;
        let mut fence = None;
        if let Some(holders) = state.holders.get_mut(&self.key) {
            if let Some(holder) = holders.iter().find(|h| h.id == self.id) {
                owner = Some(holder.owner.clone());
                fence = holder.fence;
            }
            holders.retain(|h| h.id != self.id);
        }
        if let Some(fence) = fence
            && let Some(entry) = state
                .fences
                .get_mut(&self.key)
                .and_then(|fences| fences.iter_mut().find(|(f, _)| *f == fence))
        {
            entry.1 = Some(Instant::now());
        }
        if let Some(owner) = owner
            && !state.holders.values().flatten().any(|h| h.owner == owner)
        {
            state.lease_caps.remove(&owner);
        }
        let event = format!("{:?} #{} leaves {}", Instant::now(), self.id, self.key);
        push_recent(&mut state, event);
    }
}

/// Being inside a set: a hold of each of its keys. Dropped (every exit recorded) before the
/// guard is released or dropped.
pub(super) struct SetEntry {
    pub(super) history: Arc<History>,
    pub(super) entries: Vec<Entry>,
    /// The owner of each key's hold (the set's token, or an outer hold's).
    pub(super) owners: Vec<String>,
    /// The keys the set took itself (not re-entered).
    pub(super) own_keys: Vec<&'static str>,
}

impl SetEntry {
    /// The set's leases moved on (extend, renewal): so do the bounds.
    pub(super) fn refresh(&self, guard: &MultiGuard) {
        for entry in &self.entries {
            entry.refresh_by(guard.remaining());
        }
    }

    /// The set asked for leases of `ttl` (an extend, which reaches the holds it re-entered
    /// too): its keys may live that long.
    pub(super) fn extended(&self, ttl: Duration) {
        let mut state = self.history.lock();
        for owner in &self.owners {
            let cap = state.lease_caps.entry(owner.clone()).or_default();
            *cap = (*cap).max(ttl);
        }
    }
}

/// The records the history hands out: an entry, a set's entry, a request asleep.
impl History {
    /// `guard` was just granted, for a request made at `asked`: checked against everyone
    /// inside (see [`History::admit`]), and inside until the entry is dropped.
    pub(super) fn enter(
        self: &Arc<Self>,
        who: &str,
        key: &str,
        kind: Kind,
        guard: &impl Granted,
        asked: Instant,
    ) -> Entry {
        Entry {
            history: self.clone(),
            key: key.to_owned(),
            id: self.admit(who, key, kind, guard, asked),
        }
    }

    /// The set `guard` was just granted: a hold of each of its `keys` (key, owner, kind), each
    /// checked against everyone inside as a single hold is.
    pub(super) fn enter_set(
        self: &Arc<Self>,
        who: &str,
        holds: &[SetHold],
        guard: &MultiGuard,
        asked: Instant,
    ) -> SetEntry {
        let entries = holds
            .iter()
            .enumerate()
            .map(|(at, hold)| {
                let grant = SetKeyGrant {
                    set: guard,
                    hold,
                    first: at == 0,
                };
                self.enter(who, hold.key, hold.kind, &grant, asked)
            })
            .collect();
        let mut state = self.lock();
        state.sets += 1;
        state.set_keys += holds.len() as u64;
        let own = guard.token();
        SetEntry {
            history: self.clone(),
            entries,
            owners: holds.iter().map(|hold| hold.owner.clone()).collect(),
            own_keys: (holds.iter())
                .filter(|hold| hold.owner == own)
                .map(|hold| hold.key)
                .collect(),
        }
    }

    /// A request starts sleeping in `acquire()` for `key`; it stops when this is dropped.
    pub(super) fn waits(self: &Arc<Self>, who: &str, key: &str) -> Waiting {
        self.waits_all(who, &[key])
    }

    /// A request starts sleeping in `acquire()` until every one of `keys` is free at once (a
    /// set); it stops when this is dropped.
    pub(super) fn waits_all(self: &Arc<Self>, who: &str, keys: &[&str]) -> Waiting {
        let keys = keys.iter().map(|&key| key.to_owned()).collect();
        let mut state = self.lock();
        let id = state.next_waiter;
        state.next_waiter += 1;
        state
            .waiting
            .insert(id, (keys, Instant::now(), who.to_owned()));
        Waiting {
            history: self.clone(),
            id,
        }
    }
}
