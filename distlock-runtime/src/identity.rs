//! The registry of holders' identities: every manager registers its
//! [`HolderIdentity`] (client name, host, pid, start time) in Redis once, under one key kept alive by its own background work, and every owner
//! token it makes starts with the manager's id. Reading a holder's identity is then one `GET`
//! of the registration its token names; nothing is written per acquisition.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::backend::Backend;
use crate::driver::Driver;
use crate::holder::{HolderIdentity, manager_of};

/// How long a registration outlives its manager's last refresh: a crashed manager shows as
/// gone within this long.
pub(crate) const REGISTRATION_TTL: Duration = Duration::from_secs(10);
/// How often a live manager refreshes its registration.
const REFRESH: Duration = Duration::from_secs(3);
/// Identities remembered per manager (a full cache is emptied).
const CACHED: usize = 1024;
/// How long an identity read is trusted without reading again: a manager that dies shows as
/// gone to a reader within its registration's lease plus this.
const TRUSTED: Duration = Duration::from_secs(1);

/// The registration key of manager `id` under `prefix`: `distlock-manager:<prefix><id>`,
/// outside the prefix itself (so that the keys under a prefix are the locks' alone, and a
/// released lock leaves nothing there) but one namespace per prefix, which an ACL rule can
/// grant with the prefix's own (see `LockManager::acl_rules`).
pub(crate) fn registration_key(prefix: &str, id: &str) -> String {
    format!("{REGISTRATIONS}{prefix}{id}")
}

/// Where managers register (see [`registration_key`]).
pub(crate) const REGISTRATIONS: &str = "distlock-manager:";

/// A manager's registration, and the identities of other holders it has read.
#[derive(Debug)]
pub(crate) struct Registry {
    pub(crate) identity: HolderIdentity,
    prefix: String,
    key: String,
    known: Mutex<HashMap<String, (Option<HolderIdentity>, Instant)>>,
}

impl Registry {
    pub(crate) fn new(prefix: &str, identity: HolderIdentity) -> Self {
        Self {
            prefix: prefix.to_owned(),
            key: registration_key(prefix, &identity.manager_id),
            identity,
            known: Mutex::new(HashMap::new()),
        }
    }

    /// Writes (or refreshes) the registration on every master. A failure is logged and left
    /// to the next refresh: identity is for people reading, never for a lock's safety.
    pub(crate) async fn register(&self, backend: &Backend) {
        let mut set = redis::cmd("SET");
        set.arg(&self.key)
            .arg(self.identity.encode())
            .arg("PX")
            .arg(REGISTRATION_TTL.as_millis() as u64);
        for node in backend.nodes() {
            if let Err(error) = node.query::<redis::Value>(&set).await {
                tracing::debug!(%error, "the manager's registration was not written");
            }
        }
    }

    /// Removes the registration (at shutdown).
    pub(crate) async fn unregister(&self, backend: &Backend) {
        let mut del = redis::cmd("DEL");
        del.arg(&self.key);
        for node in backend.nodes() {
            let _ = node.query::<redis::Value>(&del).await;
        }
    }

    /// The identity of the manager that made `token`, read from its registration (remembered
    /// for a second). `Ok(None)`: no registration, so that manager is gone (or the token was
    /// not made by a manager that registers).
    pub(crate) async fn lookup(
        &self,
        backend: &Backend,
        token: &str,
    ) -> Result<Option<HolderIdentity>, redis::RedisError> {
        let Some(id) = manager_of(token) else {
            return Ok(None);
        };
        if id == self.identity.manager_id {
            return Ok(Some(self.identity.clone()));
        }
        if let Some((known, read)) = self.lock_known().get(id)
            && read.elapsed() < TRUSTED
        {
            return Ok(known.clone());
        }
        let mut get = redis::cmd("GET");
        get.arg(registration_key(&self.prefix, id));
        let value: Option<String> = backend.inspected().query(&get).await?;
        let identity = value.and_then(|value| HolderIdentity::decode(id, &value));
        // Known or not, remembered a moment: a busy lock asked for again and again costs
        // one read per holder per second at most.
        let mut known = self.lock_known();
        if known.len() >= CACHED {
            known.clear();
        }
        known.insert(id.to_owned(), (identity.clone(), Instant::now()));
        Ok(identity)
    }

    fn lock_known(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, (Option<HolderIdentity>, Instant)>> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Keeps a manager's registration alive from its background runtime until the manager is
/// dropped or shut down: `shut_down` is the manager's shutdown flag, whose channel closes
/// when the manager is dropped.
pub(crate) async fn keep_registered(
    registry: Arc<Registry>,
    backend: Backend,
    shut_down: watch::Receiver<bool>,
) {
    loop {
        tokio::time::sleep(REFRESH).await;
        if shut_down.has_changed().is_err() || *shut_down.borrow() {
            return;
        }
        registry.register(&backend).await;
        // A shutdown that removed the registration while this refresh was on its way must
        // not see it come back.
        if *shut_down.borrow() {
            registry.unregister(&backend).await;
            return;
        }
    }
}

/// How long a busy error waits for its holder's identity at most: past it, the error goes
/// without the name (the identity is for people reading, never worth a delay).
const LOOKUP_BOUND: Duration = Duration::from_millis(100);

/// What reading a holder's identity takes of a manager: its registry, and the backend and
/// driver to read through.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HolderLookup<'a> {
    pub(crate) registry: &'a Arc<Registry>,
    pub(crate) backend: &'a Backend,
    pub(crate) driver: &'a Driver,
}

/// A holder's identity for an error: `None` when it is gone, or could not be read at once.
pub(crate) async fn resolve(
    via: impl Into<HolderLookup<'_>>,
    token: &str,
) -> Option<HolderIdentity> {
    let HolderLookup {
        registry,
        backend,
        driver,
    } = via.into();
    let registry = Arc::clone(registry);
    let token = token.to_owned();
    let lookup = move |backend: Backend| async move {
        tokio::time::timeout(LOOKUP_BOUND, registry.lookup(&backend, &token)).await
    };
    let backend = backend.clone();
    // On the caller's runtime, or on the manager's when the caller is not in one.
    let read = if tokio::runtime::Handle::try_current().is_ok() {
        Ok(lookup(backend).await)
    } else {
        driver.run(lookup(backend)).await
    };
    match read {
        Ok(Ok(Ok(identity))) => identity,
        _ => None,
    }
}
