//! Credentials and TLS material, and the clients that use them. Nothing here is ever printed.

use std::fmt;

use redis::cluster::ClusterClientBuilder;
use redis::{Client, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, RedisResult};

use crate::LockError;

/// How the data nodes are authenticated and encrypted, beyond what their URLs say.
#[derive(Clone, Default)]
pub(crate) struct Security {
    /// Replaces the user name and password of the data nodes' URLs.
    pub(crate) credentials: Option<Credentials>,
    /// Used by every `rediss://` connection (Sentinels included).
    pub(crate) tls: Option<Tls>,
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
        self.tls_client(info)
    }

    /// A client for a Sentinel at `info`: its URL's credentials, the configured certificates.
    pub(crate) fn tls_client(&self, info: ConnectionInfo) -> RedisResult<Client> {
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
        let wants_tls = urls.iter().any(|url| {
            url.as_str()
                .into_connection_info()
                .is_ok_and(|info| matches!(info.addr(), ConnectionAddr::TcpTls { .. }))
                || url.starts_with("rediss://")
                || url.starts_with("valkeys://")
        });
        if !cfg!(feature = "tls") && (wants_tls || self.tls.is_some()) {
            return Err(LockError::Config(
                "TLS needs the `tls` feature of distlock (`features = [\"tls\"]`)".into(),
            ));
        }
        if let Some(tls) = &self.tls {
            if !wants_tls {
                return Err(LockError::Config(
                    "TLS certificates were given but no endpoint uses TLS: use `rediss://` URLs"
                        .into(),
                ));
            }
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
    #[cfg(feature = "tls")]
    fn check(&self) -> Result<(), LockError> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};

        let certificates = |what: &str, pem: &[u8]| {
            let parsed: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(pem).collect();
            match parsed {
                Ok(certs) if !certs.is_empty() => Ok(()),
                _ => Err(LockError::Config(format!(
                    "`{what}` holds no PEM certificate (`-----BEGIN CERTIFICATE-----`)"
                ))),
            }
        };
        if let Some(ca) = &self.ca {
            certificates("tls_ca_certificate", ca)?;
        }
        if let Some((cert, key)) = &self.client {
            certificates("tls_client_certificate", cert)?;
            if PrivateKeyDer::from_pem_slice(key).is_err() {
                return Err(LockError::Config(
                    "the key of `tls_client_certificate` holds no PEM private key \
                     (`-----BEGIN PRIVATE KEY-----`)"
                        .into(),
                ));
            }
        }
        Ok(())
    }

    #[cfg(not(feature = "tls"))]
    fn check(&self) -> Result<(), LockError> {
        Ok(())
    }
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
