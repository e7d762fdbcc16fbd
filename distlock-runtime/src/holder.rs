//! Who holds a lock, as a value: the identity a manager registers (client name, host, pid,
//! start time), how it is written to and read from its registration, and the rules for a
//! client name. Registering and reading registrations is [`crate::identity`]'s job.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

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
