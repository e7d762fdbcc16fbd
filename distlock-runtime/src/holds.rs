//! The holds a manager has granted and not yet given back: what
//! [`LockManager::shutdown`](crate::LockManager::shutdown) gives back, and whether it was called.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::watch;

use crate::backend::HoldIds;
use crate::id_map::IdMap;
use crate::lease::LeaseState;
use crate::waiters::Releaser;

/// A hold as the manager lists it, for [`LockManager::shutdown`](crate::LockManager::shutdown).
#[derive(Debug)]
pub(crate) struct Live {
    pub(crate) ids: Arc<HoldIds>,
    pub(crate) keep_until: Option<Instant>,
    pub(crate) lease: Arc<LeaseState>,
}

/// Every hold of one manager that is still to be given back, and whether it shut down.
#[derive(Debug, Default)]
pub(crate) struct Holds {
    listed: Mutex<Listed>,
    shut_down: watch::Sender<bool>,
}

#[derive(Debug, Default)]
struct Listed {
    by_id: IdMap<u64, Live>,
    next_id: u64,
}

impl Holds {
    fn lock(&self) -> std::sync::MutexGuard<'_, Listed> {
        self.listed.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lists a new hold; `None` once the manager has shut down.
    pub(crate) fn list(&self, live: Live) -> Option<u64> {
        let mut listed = self.lock();
        if self.is_shut_down() {
            return None;
        }
        let id = listed.next_id;
        listed.next_id += 1;
        listed.by_id.insert(id, live);
        Some(id)
    }

    /// Takes a hold off the list; `false` when shutdown took it first.
    pub(crate) fn unlist(&self, id: u64) -> bool {
        self.lock().by_id.remove(&id).is_some()
    }

    pub(crate) fn is_listed(&self, id: u64) -> bool {
        self.lock().by_id.contains_key(&id)
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

    /// Marks the manager shut down and gives back every listed hold through `releaser`,
    /// marking its lease lost; does nothing the second time.
    pub(crate) async fn shut_down(&self, releaser: &Releaser) {
        let live: Vec<Live> = {
            let mut listed = self.lock();
            if self.shut_down.send_replace(true) {
                return;
            }
            listed.by_id.drain().map(|(_, live)| live).collect()
        };
        for hold in &live {
            hold.lease.mark_lost();
        }
        let releases = live.into_iter().map(|hold| {
            let release = releaser.clone().logged(hold.ids, hold.keep_until);
            releaser.driver.run(release)
        });
        futures_util::future::join_all(releases).await;
    }
}
