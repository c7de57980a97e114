//! A test certificate authority, made per run with the `openssl` command line.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Certificates for servers that serve clients over mutual TLS (etcd, Redis, PostgreSQL): a
/// CA, one server certificate (for 127.0.0.1 and localhost unless told otherwise) also usable
/// as a client certificate, and a client-only certificate, generated per run with the
/// `openssl` command line into a directory.
#[derive(Debug, Clone)]
pub struct TestTls {
    /// The CA certificate (PEM).
    pub ca: PathBuf,
    /// The members' certificate (PEM), also valid as a client certificate (etcdctl uses it).
    pub server_cert: PathBuf,
    /// Its key.
    pub server_key: PathBuf,
    /// A client certificate (PEM) signed by the CA.
    pub client_cert: PathBuf,
    /// Its key.
    pub client_key: PathBuf,
}

impl TestTls {
    /// Generates a fresh CA and certificates in `dir` (EC P-256, valid two days).
    pub fn generate(dir: &Path) -> io::Result<TestTls> {
        Self::generate_for(dir, "IP:127.0.0.1,DNS:localhost")
    }

    /// Like [`TestTls::generate`], with the server certificate naming `names` only (an
    /// openssl `subjectAltName` list such as `DNS:localhost`), to test name checks.
    pub fn generate_for(dir: &Path, names: &str) -> io::Result<TestTls> {
        fs::create_dir_all(dir)?;
        let p = |f: &str| dir.join(f);
        let s = |path: PathBuf| path.to_string_lossy().into_owned();
        fs::write(
            p("server.ext"),
            format!("subjectAltName={names}\nextendedKeyUsage=serverAuth,clientAuth\n"),
        )?;
        fs::write(p("client.ext"), "extendedKeyUsage=clientAuth\n")?;
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        let (ca, ca_key) = (s(p("ca.pem")), s(p("ca.key")));
        let ca_args = [
            "-keyout",
            &ca_key,
            "-out",
            &ca,
            "-days",
            "2",
            "-subj",
            "/CN=fencelock-test-ca",
        ];
        openssl(&[&["req", "-x509"][..], &ec, &ca_args].concat())?;
        for who in ["server", "client"] {
            let (key, csr) = (s(p(&format!("{who}.key"))), s(p(&format!("{who}.csr"))));
            let (pem, ext) = (s(p(&format!("{who}.pem"))), s(p(&format!("{who}.ext"))));
            let subj = format!("/CN={who}");
            openssl(
                &[
                    &["req"][..],
                    &ec,
                    &["-keyout", &key, "-out", &csr, "-subj", &subj],
                ]
                .concat(),
            )?;
            openssl(&[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                &ca,
                "-CAkey",
                &ca_key,
                "-CAcreateserial",
                "-out",
                &pem,
                "-days",
                "2",
                "-extfile",
                &ext,
            ])?;
        }
        Ok(TestTls {
            ca: p("ca.pem"),
            server_cert: p("server.pem"),
            server_key: p("server.key"),
            client_cert: p("client.pem"),
            client_key: p("client.key"),
        })
    }
}

fn openssl(args: &[&str]) -> io::Result<()> {
    let out = Command::new("openssl")
        .args(args)
        .stdin(Stdio::null())
        .output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "openssl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )))
    }
}
