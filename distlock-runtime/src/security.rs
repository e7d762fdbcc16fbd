//! Credentials and TLS material, and the clients that use them. Nothing here is ever printed.

use std::fmt;
use std::time::Duration;

use redis::cluster::ClusterClientBuilder;
use redis::io::tcp::TcpSettings;
use redis::{Client, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, RedisResult};

use crate::error::LockError;

/// How the data nodes are authenticated and encrypted, beyond what their URLs say.
#[derive(Clone, Default)]
pub(crate) struct Security {
    /// Replaces the user name and password of the data nodes' URLs.
    pub(crate) credentials: Option<Credentials>,
    /// Used by every `rediss://` connection (Sentinels included).
    pub(crate) tls: Option<Tls>,
    /// TCP keepalive and user timeout of every connection (Sentinels included): see
    /// [`socket_timeouts`].
    pub(crate) socket: Option<SocketTimeouts>,
}

/// How long the kernel keeps a connection whose peer went silent (a partition drops packets
/// without a word; a half-open socket would otherwise wait out retransmits backing off to
/// two minutes, and an idle one would never notice).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SocketTimeouts {
    /// Idle this long, a connection sends keepalive probes, one a second.
    pub(crate) idle: Duration,
    /// Data (a request, or a probe) unacknowledged this long ends the connection (Linux's
    /// `TCP_USER_TIMEOUT`; elsewhere, the keepalive probes' count does it).
    pub(crate) unacknowledged: Duration,
}

/// The socket timeouts for a manager whose answers may take `response_timeout`: the kernel
/// gives up on a silent peer within a few seconds, and never before an answer could be late.
pub(crate) fn socket_timeouts(response_timeout: Duration) -> SocketTimeouts {
    SocketTimeouts {
        idle: Duration::from_secs(5),
        unacknowledged: (response_timeout * 2)
            .clamp(Duration::from_secs(2), Duration::from_secs(30)),
    }
}

impl SocketTimeouts {
    /// `settings` with keepalive probes and the user timeout on.
    fn apply(self, settings: TcpSettings) -> TcpSettings {
        const INTERVAL: Duration = Duration::from_secs(1);
        let probes = (self.unacknowledged.as_secs() as u32).max(1);
        let keepalive = socket2::TcpKeepalive::new().with_time(self.idle);
        #[cfg(any(target_os = "linux", target_os = "android", target_os = "fuchsia"))]
        let settings = settings.set_user_timeout(self.unacknowledged);
        #[cfg(not(any(target_os = "windows", target_os = "openbsd", target_os = "haiku")))]
        let keepalive = keepalive.with_interval(INTERVAL).with_retries(probes);
        settings.set_keepalive(keepalive)
    }
}

/// An ACL user (or `None`: the `default` user) and its password.
#[derive(Clone)]
pub(crate) struct Credentials {
    pub(crate) username: Option<String>,
    pub(crate) password: String,
}

/// PEM material for `rediss://` connections.
#[derive(Clone, Default)]
pub(crate) struct Tls {
    /// Trusted instead of the system's roots.
    pub(crate) ca: Option<Vec<u8>>,
    /// Certificate chain and private key presented to servers that ask (mutual TLS).
    pub(crate) client: Option<(Vec<u8>, Vec<u8>)>,
}

impl fmt::Debug for Security {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tls = self.tls.as_ref();
        f.debug_struct("Security")
            .field(
                "username",
                &self
                    .credentials
                    .as_ref()
                    .map(|c| c.username.as_deref().unwrap_or("default")),
            )
            .field("password", &self.credentials.as_ref().map(|_| "***"))
            .field(
                "tls_ca_certificate",
                &tls.and_then(|t| t.ca.as_ref()).map(|_| "<pem>"),
            )
            .field(
                "tls_client_certificate",
                &tls.and_then(|t| t.client.as_ref()).map(|_| "<pem>"),
            )
            .finish()
    }
}

impl Security {
    /// A client for a data node at `info`, with the configured credentials and certificates.
    pub(crate) fn client(&self, info: impl IntoConnectionInfo) -> RedisResult<Client> {
        let mut info = info.into_connection_info()?;
        if let Some(Credentials { username, password }) = &self.credentials {
            let mut redis = info.redis_settings().clone().set_password(password);
            if let Some(username) = username {
                redis = redis.set_username(username);
            }
            info = info.set_redis_settings(redis);
        }
        self.client_for(info)
    }

    /// A client for `info` (a Sentinel, a shard's master): its URL's credentials, and the
    /// configured certificates when it is reached over TLS.
    pub(crate) fn client_for(&self, mut info: ConnectionInfo) -> RedisResult<Client> {
        if let Some(socket) = self.socket {
            let settings = socket.apply(info.tcp_settings().clone());
            info = info.set_tcp_settings(settings);
        }
        match (&self.tls, info.addr()) {
            #[cfg(feature = "tls")]
            (Some(tls), ConnectionAddr::TcpTls { .. }) => {
                Client::build_with_tls(info, tls.certificates())
            }
            _ => Client::open(info),
        }
    }

    /// `builder` with the configured credentials and certificates.
    pub(crate) fn cluster(&self, mut builder: ClusterClientBuilder) -> ClusterClientBuilder {
        if let Some(socket) = self.socket {
            builder = builder.tcp_settings(socket.apply(TcpSettings::default()));
        }
        if let Some(Credentials { username, password }) = &self.credentials {
            builder = builder.password(password);
            if let Some(username) = username {
                builder = builder.username(username);
            }
        }
        #[cfg(feature = "tls")]
        if let Some(tls) = &self.tls {
            builder = builder.certs(tls.certificates());
        }
        builder
    }

    /// Checks the TLS material against the endpoints, before anything connects.
    pub(crate) fn check(&self, urls: &[String]) -> Result<(), LockError> {
        let wants_tls = wants_tls(urls);
        if !cfg!(feature = "tls") && (wants_tls || self.tls.is_some()) {
            return Err(LockError::Config(
                "TLS needs the `tls` feature of distlock (`features = [\"tls\"]`)".into(),
            ));
        }
        if let Some(tls) = &self.tls {
            check_tls_endpoints(urls).map_err(|reason| {
                LockError::Config(format!("TLS certificates were given but {reason}"))
            })?;
            tls.check()?;
        }
        #[cfg(feature = "tls")]
        if wants_tls {
            install_crypto_provider();
        }
        Ok(())
    }
}

impl Tls {
    #[cfg(feature = "tls")]
    fn certificates(&self) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: self
                .client
                .as_ref()
                .map(|(cert, key)| redis::ClientTlsConfig {
                    client_cert: cert.clone(),
                    client_key: key.clone(),
                }),
            root_cert: self.ca.clone(),
        }
    }

    /// Each PEM holds what it should; the messages never quote the material.
    fn check(&self) -> Result<(), LockError> {
        let config = |what: &str, reason: String| LockError::Config(format!("{what} {reason}"));
        if let Some(ca) = &self.ca {
            check_certificates(ca).map_err(|r| config("`tls_ca_certificate`", r))?;
        }
        if let Some((cert, key)) = &self.client {
            check_certificates(cert).map_err(|r| config("`tls_client_certificate`", r))?;
            check_private_key(key).map_err(|r| config("the key of `tls_client_certificate`", r))?;
        }
        Ok(())
    }
}

/// Whether any of `urls` connects with TLS.
fn wants_tls(urls: &[String]) -> bool {
    urls.iter().any(|url| {
        url.as_str()
            .into_connection_info()
            .is_ok_and(|info| matches!(info.addr(), ConnectionAddr::TcpTls { .. }))
            || url.starts_with("rediss://")
            || url.starts_with("valkeys://")
    })
}

/// Checks that TLS material has an endpoint to be used with. The reason, on failure,
/// follows what gave the material.
pub(crate) fn check_tls_endpoints(urls: &[String]) -> Result<(), String> {
    if wants_tls(urls) {
        Ok(())
    } else {
        Err("no endpoint uses TLS: use `rediss://` URLs".into())
    }
}

/// Checks that `pem` holds at least one PEM certificate (always `Ok` without the `tls`
/// feature, which the builder reports by itself). The reason, on failure, follows the name of
/// the setting; it never quotes the material.
#[cfg_attr(not(feature = "tls"), allow(unused_variables))]
pub(crate) fn check_certificates(pem: &[u8]) -> Result<(), String> {
    #[cfg(feature = "tls")]
    {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject;

        let parsed: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(pem).collect();
        if !parsed.is_ok_and(|certs| !certs.is_empty()) {
            return Err("holds no PEM certificate (`-----BEGIN CERTIFICATE-----`)".into());
        }
    }
    Ok(())
}

/// Checks that `pem` holds a PEM private key, as [`check_certificates`] does certificates.
#[cfg_attr(not(feature = "tls"), allow(unused_variables))]
pub(crate) fn check_private_key(pem: &[u8]) -> Result<(), String> {
    #[cfg(feature = "tls")]
    {
        use rustls::pki_types::PrivateKeyDer;
        use rustls::pki_types::pem::PemObject;

        if PrivateKeyDer::from_pem_slice(pem).is_err() {
            return Err("holds no PEM private key (`-----BEGIN PRIVATE KEY-----`)".into());
        }
    }
    Ok(())
}

/// rustls needs a process-wide crypto provider; when the application has not chosen one,
/// ring's is installed (the one distlock is built with).
#[cfg(feature = "tls")]
fn install_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Another thread may install one meanwhile: then that one is used, which is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}
