//! A private certificate authority for the TLS tests, made with the `openssl` CLI.

use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use super::run_tool_in;

/// A private certificate authority with a server certificate (for `127.0.0.1` and
/// `localhost`) and a client certificate signed by it, generated with the `openssl` CLI in a
/// temporary directory that is removed on drop.
#[derive(Debug)]
pub struct TestCertificates {
    dir: PathBuf,
}

impl TestCertificates {
    /// Generates a fresh CA, server certificate and client certificate (ECDSA P-256).
    pub fn generate() -> io::Result<Self> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("distlock-tls-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let certs = Self { dir };
        let key = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        let ca_subject = ["-subj", "/CN=distlock test CA", "-days", "2"];
        certs.openssl(&[
            &["req", "-x509", "-keyout", "ca.key", "-out", "ca.crt"],
            &key,
            &ca_subject,
        ])?;
        for (name, usage) in [
            ("server", "serverAuth,clientAuth"),
            ("client", "clientAuth"),
        ] {
            let (ext, csr, crt) = (
                format!("{name}.ext"),
                format!("{name}.csr"),
                format!("{name}.crt"),
            );
            std::fs::write(
                certs.dir.join(&ext),
                format!(
                    "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n\
                     keyUsage=digitalSignature\nextendedKeyUsage={usage}\n"
                ),
            )?;
            let subject = format!("/CN=distlock test {name}");
            let keyout = format!("{name}.key");
            certs.openssl(&[
                &["req", "-keyout", &keyout, "-out", &csr, "-subj", &subject],
                &key,
            ])?;
            certs.openssl(&[&[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-out",
                &crt,
                "-extfile",
                &ext,
            ]])?;
        }
        Ok(certs)
    }

    /// The CA certificate, PEM.
    pub fn ca_pem(&self) -> io::Result<String> {
        std::fs::read_to_string(self.dir.join("ca.crt"))
    }

    /// The client certificate, PEM.
    pub fn client_cert_pem(&self) -> io::Result<String> {
        std::fs::read_to_string(self.dir.join("client.crt"))
    }

    /// The client certificate's private key, PEM.
    pub fn client_key_pem(&self) -> io::Result<String> {
        std::fs::read_to_string(self.dir.join("client.key"))
    }

    /// The path of a generated file: `ca.crt`, `client.crt`, `client.key`, `server.crt`, ….
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Runs `openssl` in the certificates' directory with the concatenated `parts`.
    fn openssl(&self, parts: &[&[&str]]) -> io::Result<()> {
        run_tool_in(&self.dir, "openssl", &parts.concat())
    }
}

impl Drop for TestCertificates {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
