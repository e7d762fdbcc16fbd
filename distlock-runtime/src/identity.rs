//! Who holds a lock: every manager registers its identity (client name, host, pid, start
//! time) in Redis once, under one key kept alive by its own background work, and every owner
//! token it makes starts with the manager's id. Reading a holder's identity is then one `GET`
//! of the registration its token names; nothing is written per acquisition.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;

use crate::backend::Backend;
use crate::driver::Driver;

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
/// The longest client name accepted.
pub(crate) const MAX_CLIENT_NAME: usize = 128;

/// Who a lock's holder is: the identity of the [`LockManager`](crate::LockManager) that took
/// it, as that manager registered it in Redis.
///
/// Shown by the inspector next to each holder's token, carried by
/// [`LockError::Busy`](crate::LockError::Busy) when the server named the holder, and by an
/// election's [`LeaderInfo`](crate::LeaderInfo). Its `Display` reads
/// `orders-api on host-3, pid 4242`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HolderIdentity {
    /// The manager's id: the first 16 hex digits of every owner token it makes.
    pub manager_id: String,
    /// The client name (see [`LockManagerBuilder::client_name`](crate::LockManagerBuilder::client_name)).
    pub client_name: String,
    /// The host name of the machine the manager runs on.
    pub host: String,
    /// The process id of the manager's process.
    pub pid: u32,
    /// When the manager was built (the wall clock of its host).
    pub started: SystemTime,
}

impl fmt::Display for HolderIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} on {}, pid {}", self.client_name, self.host, self.pid)
    }
}

impl HolderIdentity {
    /// This process's identity under `client_name`, for the manager `manager_id`.
    pub(crate) fn current(manager_id: &str, client_name: String) -> Self {
        // To the millisecond, as the registration records it.
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        Self {
            manager_id: manager_id.to_owned(),
            client_name,
            host: host_name(),
            pid: std::process::id(),
            started: UNIX_EPOCH + Duration::from_millis(now.as_millis() as u64),
        }
    }

    /// The registration's value: one field per line.
    pub(crate) fn encode(&self) -> String {
        let started = self
            .started
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis();
        format!(
            "distlock-manager 1\n{}\n{}\n{}\n{started}",
            self.client_name, self.host, self.pid
        )
    }

    /// Reads a registration's value; `None` for anything else.
    pub(crate) fn decode(manager_id: &str, value: &str) -> Option<Self> {
        let mut lines = value.split('\n');
        if lines.next()? != "distlock-manager 1" {
            return None;
        }
        let client_name = lines.next()?.to_owned();
        let host = lines.next()?.to_owned();
        let pid = lines.next()?.parse().ok()?;
        let started = UNIX_EPOCH.checked_add(Duration::from_millis(lines.next()?.parse().ok()?))?;
        Some(Self {
            manager_id: manager_id.to_owned(),
            client_name,
            host,
            pid,
            started,
        })
    }
}

/// The default client name: the name of the running executable.
pub(crate) fn default_client_name() -> String {
    std::env::current_exe()
        .ok()
        .and_then(|path| path.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .filter(|name| check_client_name(name).is_ok())
        .unwrap_or_else(|| "distlock".to_owned())
}

/// A client name is shown in one line and sent as a connection name, which Redis takes in
/// printable ASCII without spaces (`!` to `~`).
pub(crate) fn check_client_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("must not be empty".into());
    }
    if name.len() > MAX_CLIENT_NAME {
        return Err(format!("is longer than {MAX_CLIENT_NAME} bytes"));
    }
    if let Some(bad) = name.chars().find(|c| !c.is_ascii_graphic()) {
        return Err(format!(
            "must be printable ASCII without spaces (found {bad:?})"
        ));
    }
    Ok(())
}

/// This machine's host name (Linux's kernel record, then `HOSTNAME`), or `unknown`; one
/// line of printable characters, as the registration records it.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|name| name.trim().replace(|c: char| c.is_control(), "?"))
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "unknown".to_owned())
}

/// The manager id a token names: its first 16 hex digits.
pub(crate) fn manager_of(token: &str) -> Option<&str> {
    (token.len() == 32 && token.bytes().all(|b| b.is_ascii_hexdigit())).then(|| &token[..16])
}

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
pub(crate) struct Lookup<'a> {
    pub(crate) registry: &'a Arc<Registry>,
    pub(crate) backend: &'a Backend,
    pub(crate) driver: &'a Driver,
}

/// A holder's identity for an error: `None` when it is gone, or could not be read at once.
pub(crate) async fn resolve(via: impl Into<Lookup<'_>>, token: &str) -> Option<HolderIdentity> {
    let Lookup {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registration_reads_back_as_written() {
        let identity = HolderIdentity::current("00112233445566aa", "orders-api".into());
        let read = HolderIdentity::decode("00112233445566aa", &identity.encode()).unwrap();
        assert_eq!(read.client_name, "orders-api");
        assert_eq!(read.pid, std::process::id());
        assert_eq!(read.host, identity.host);
        let millis = |t: SystemTime| t.duration_since(UNIX_EPOCH).unwrap().as_millis();
        assert_eq!(millis(read.started), millis(identity.started));
        assert_eq!(
            read.to_string(),
            format!("orders-api on {}, pid {}", read.host, read.pid)
        );
    }

    #[test]
    fn anything_else_reads_as_no_identity() {
        for value in [
            "",
            "x",
            "distlock-manager 1\na\nb\nnot-a-pid\n1",
            "distlock-manager 2\na\nb\n1\n1",
        ] {
            assert_eq!(HolderIdentity::decode("0", value), None, "{value:?}");
        }
    }

    #[test]
    fn a_token_names_its_manager() {
        assert_eq!(
            manager_of("00112233445566778899aabbccddeeff"),
            Some("0011223344556677")
        );
        assert_eq!(manager_of("short"), None);
        assert_eq!(manager_of("zz112233445566778899aabbccddeeff"), None);
    }

    #[test]
    fn client_names_are_one_printable_word() {
        assert!(check_client_name("orders-api").is_ok());
        assert!(check_client_name("").is_err());
        assert!(check_client_name("two words").is_err());
        assert!(check_client_name("line\nbreak").is_err());
        assert!(check_client_name("caf\u{e9}").is_err());
        assert!(check_client_name(&"x".repeat(MAX_CLIENT_NAME + 1)).is_err());
    }
}
