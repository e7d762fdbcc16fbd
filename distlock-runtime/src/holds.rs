//! The holds a manager has granted and not yet given back: what
//! [`LockManager::shutdown`](crate::LockManager::shutdown) gives back, and whether it was called.
//!
//! A guard lists its hold, and a set each of its locks, as one [`Listing`]: shutdown drains
//! the list and gives every hold on it back; a guard whose listing it took finds so.

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::watch;

use crate::backend::HoldIds;
use crate::id_map::IdMap;
use crate::lease::LeaseState;

/// A hold as the manager lists it, for [`LockManager::shutdown`](crate::LockManager::shutdown).
#[derive(Debug)]
pub(crate) struct ListedHold {
    pub(crate) ids: Arc<HoldIds>,
    /// Until when its key is kept (`min_hold`), read when it is given back: a hold nested in
    /// it since it was listed may have asked for longer.
    pub(crate) keep_until: KeepUntil,
    pub(crate) lease: Arc<LeaseState>,
}

/// Reads a hold's `min_hold` end as it is now.
pub(crate) struct KeepUntil(Box<dyn Fn() -> Option<Instant> + Send + Sync>);

impl KeepUntil {
    /// Reads it with `read`.
    pub(crate) fn new(read: impl Fn() -> Option<Instant> + Send + Sync + 'static) -> Self {
        Self(Box::new(read))
    }

    /// Until when the key is kept, now.
    pub(crate) fn now(&self) -> Option<Instant> {
        (self.0)()
    }
}

impl std::fmt::Debug for KeepUntil {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("KeepUntil").field(&self.now()).finish()
    }
}

/// Every hold of one manager that is still to be given back, and whether it shut down.
#[derive(Debug, Default)]
pub(crate) struct HoldList {
    listed: Mutex<Listed>,
    shut_down: watch::Sender<bool>,
}

#[derive(Debug, Default)]
struct Listed {
    by_id: IdMap<u64, ListedHold>,
    next_id: u64,
}

/// Where a guard's holds (one, or a set's) stand with their manager.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Listing {
    /// Listed under these ids, so that shutdown can give them back.
    Listed(Range<u64>),
    /// Granted while the manager shut down: not listed, still to be given back.
    Unlisted,
    /// Given back, or handed to shutdown.
    Done,
}

impl HoldList {
    fn lock(&self) -> std::sync::MutexGuard<'_, Listed> {
        self.listed.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lists the holds of one guard together: [`Listing::Unlisted`] once the manager has
    /// shut down.
    pub(crate) fn list(&self, holds: impl IntoIterator<Item = ListedHold>) -> Listing {
        let mut listed = self.lock();
        if self.is_shut_down() {
            return Listing::Unlisted;
        }
        let first = listed.next_id;
        for live in holds {
            let id = listed.next_id;
            listed.next_id += 1;
            listed.by_id.insert(id, live);
        }
        Listing::Listed(first..listed.next_id)
    }

    /// Takes `listing` off the list: `true` when giving its holds back is up to the caller,
    /// `false` when shutdown (or an earlier release) took them first. Shutdown takes every
    /// hold at once, so one still listed means all are.
    pub(crate) fn unlist(&self, listing: &mut Listing) -> bool {
        match std::mem::replace(listing, Listing::Done) {
            Listing::Listed(ids) if ids.is_empty() => true,
            Listing::Listed(ids) => {
                let mut listed = self.lock();
                ids.fold(false, |ours, id| listed.by_id.remove(&id).is_some() | ours)
            }
            Listing::Unlisted => true,
            Listing::Done => false,
        }
    }

    /// Whether shutdown gave back the holds of `listing`.
    pub(crate) fn given_back(&self, listing: &Listing) -> bool {
        match listing {
            Listing::Listed(ids) => {
                let listed = self.lock();
                ids.clone().any(|id| !listed.by_id.contains_key(&id))
            }
            Listing::Unlisted | Listing::Done => false,
        }
    }

    /// Whether [`LockManager::shutdown`](crate::LockManager::shutdown) was called.
    pub(crate) fn is_shut_down(&self) -> bool {
        *self.shut_down.borrow()
    }

    /// Follows whether the manager shut down. The flag goes with the manager: once that is
    /// dropped, the receiver finds the channel closed.
    pub(crate) fn watch(&self) -> watch::Receiver<bool> {
        self.shut_down.subscribe()
    }

    /// Completes once the manager has shut down.
    pub(crate) async fn until_shut_down(&self) {
        let mut shut_down = self.watch();
        let _ = shut_down.wait_for(|down| *down).await;
    }

    /// Marks the manager shut down, and takes every listed hold off the list, its lease
    /// marked lost, for the caller to give back; nothing the second time.
    pub(crate) fn shut_down(&self) -> Vec<ListedHold> {
        let live: Vec<ListedHold> = {
            let mut listed = self.lock();
            if self.shut_down.send_replace(true) {
                return Vec::new();
            }
            listed.by_id.drain().map(|(_, live)| live).collect()
        };
        for hold in &live {
            hold.lease.mark_lost();
        }
        live
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn live(n: u8) -> ListedHold {
        let ids = HoldIds {
            lock: format!("lock{n}"),
            wake: format!("wake{n}"),
            token: "token".into(),
            shared: false,
            plain: true,
            fair: None,
            late_until: None,
        };
        ListedHold {
            ids: Arc::new(ids),
            keep_until: KeepUntil::new(|| None),
            lease: Arc::new(LeaseState::new(Instant::now(), Duration::from_secs(10))),
        }
    }

    #[test]
    fn a_listing_is_given_back_once_by_its_guard_or_by_shutdown() {
        let holds = HoldList::default();
        let mut one = holds.list([live(1)]);
        let mut set = holds.list([live(2), live(3)]);
        assert!(!holds.given_back(&one) && !holds.given_back(&set));
        assert!(holds.unlist(&mut one));
        assert!(!holds.unlist(&mut one), "a second unlist finds it done");
        let taken = holds.shut_down();
        assert_eq!(taken.len(), 2, "shutdown takes the set's two locks");
        assert!(taken.iter().all(|live| live.lease.is_lost()));
        assert!(holds.given_back(&set));
        assert!(!holds.unlist(&mut set), "shutdown gave the set back");
        assert_eq!(holds.list([live(4)]), Listing::Unlisted);
        assert!(
            holds.shut_down().is_empty(),
            "the second shutdown does nothing"
        );
    }
}
