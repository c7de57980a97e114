//! What the TLS engines share: the one crypto provider, and reading certificate and key
//! files so that no error ever carries a file's contents (a private key must not reach a log).

use std::path::Path;

use crate::core::error::{Error, Result};

/// Makes ring the process' rustls crypto provider unless the application chose one already.
///
/// Clients built inside other crates (the Redis driver) ask rustls for the process default;
/// with no default installed and more than one provider compiled in, rustls would panic at
/// the first handshake.
pub(crate) fn ensure_provider() {
    // An `Err` means a provider is installed already: the application's choice stands.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

#[cfg(any(feature = "postgres", feature = "redis", feature = "etcd"))]
/// The ring provider, for TLS configurations fencelock builds itself.
pub(crate) fn provider() -> std::sync::Arc<rustls::crypto::CryptoProvider> {
    std::sync::Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads a PEM file named by a URL option; the error names the option and the path, never
/// the contents.
pub(crate) fn read_pem(path: &Path, option: &str) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| {
        Error::invalid(format!(
            "cannot read the TLS file {} given as {option}= in the backend URL: {}",
            path.display(),
            e.kind()
        ))
    })
}

#[cfg(any(feature = "postgres", feature = "redis", feature = "etcd"))]
/// The certificates of a PEM file, for a trust store or a client chain.
pub(crate) fn certificates(
    path: &Path,
    option: &str,
) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>> {
    use rustls::pki_types::pem::PemObject;
    let pem = read_pem(path, option)?;
    let certs = rustls::pki_types::CertificateDer::pem_slice_iter(&pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|_| not_pem(path, option, "certificates"))?;
    if certs.is_empty() {
        return Err(not_pem(path, option, "certificates"));
    }
    Ok(certs)
}

#[cfg(any(feature = "postgres", feature = "redis", feature = "etcd"))]
/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub(crate) fn private_key(
    path: &Path,
    option: &str,
) -> Result<rustls::pki_types::PrivateKeyDer<'static>> {
    use rustls::pki_types::pem::PemObject;
    let pem = read_pem(path, option)?;
    rustls::pki_types::PrivateKeyDer::from_pem_slice(&pem)
        .map_err(|_| not_pem(path, option, "a private key"))
}

#[cfg(any(feature = "postgres", feature = "redis", feature = "etcd"))]
fn not_pem(path: &Path, option: &str, what: &str) -> Error {
    Error::invalid(format!(
        "the TLS file {} given as {option}= in the backend URL holds no PEM {what}",
        path.display()
    ))
}

#[cfg(any(feature = "postgres", feature = "redis", feature = "etcd"))]
/// A trust store of the certificates in `path`, or of the system's roots when there is none.
pub(crate) fn roots(path: Option<&Path>, option: &str) -> Result<rustls::RootCertStore> {
    let mut store = rustls::RootCertStore::empty();
    match path {
        Some(path) => {
            for cert in certificates(path, option)? {
                store
                    .add(cert)
                    .map_err(|_| not_pem(path, option, "CA certificates"))?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            store.add_parsable_certificates(found.certs);
            if store.is_empty() {
                return Err(Error::invalid(format!(
                    "no system CA certificates found to verify the server; give {option}=PATH"
                )));
            }
        }
    }
    Ok(store)
}

/// What one TLS handshake with a server settled on, as diagnostics report it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TlsSession {
    /// The protocol version: `TLS 1.3` or `TLS 1.2`.
    pub version: String,
    /// The cipher suite, as IANA names it.
    pub cipher: String,
}

#[cfg(any(feature = "redis", feature = "etcd"))]
/// The TLS files of a URL whose engine verifies servers as webpki does: the chain against
/// `ca` (the system's roots when absent) and the host name as written in the URL.
pub(crate) struct Verified<'a> {
    pub(crate) ca: Option<&'a Path>,
    pub(crate) cert: Option<&'a Path>,
    pub(crate) key: Option<&'a Path>,
}

#[cfg(any(feature = "redis", feature = "etcd"))]
/// One TLS handshake with `node`, verified as the engine's own connections are (see
/// [`Verified`]), on a connection of its own that is closed afterwards: the version and
/// cipher the engine's connections get, since they offer the same.
pub(crate) async fn handshake(
    node: &crate::core::url::HostPort,
    files: Verified<'_>,
    limit: std::time::Duration,
) -> Result<TlsSession> {
    use std::sync::Arc;
    let provider = provider();
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::invalid(format!("TLS settings: {e}")))?
        .with_root_certificates(roots(files.ca, "ca")?);
    let config = match (files.cert, files.key) {
        (Some(cert), Some(key)) => builder
            .with_client_auth_cert(certificates(cert, "cert")?, private_key(key, "key")?)
            .map_err(|e| {
                Error::invalid(format!(
                    "the client certificate (cert=) and key (key=) in the backend URL: {e}"
                ))
            })?,
        _ => builder.with_no_client_auth(),
    };
    let name = rustls::pki_types::ServerName::try_from(node.host.clone())
        .map_err(|e| Error::invalid(format!("{node}: not a TLS server name: {e}")))?;
    let connect = async {
        let tcp = tokio::net::TcpStream::connect((node.host.as_str(), node.port)).await?;
        tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
    };
    let stream = match tokio::time::timeout(limit, connect).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            return Err(Error::new(
                crate::core::error::ErrorKind::Engine,
                format!("{node}: TLS handshake failed: {e}"),
            ))
        }
        Err(_) => {
            return Err(Error::new(
                crate::core::error::ErrorKind::Engine,
                format!(
                    "{node}: no TLS handshake within {}",
                    crate::core::options::display_duration(limit)
                ),
            ))
        }
    };
    let session = stream.get_ref().1;
    let version = match session.protocol_version() {
        Some(rustls::ProtocolVersion::TLSv1_3) => "TLS 1.3".to_owned(),
        Some(rustls::ProtocolVersion::TLSv1_2) => "TLS 1.2".to_owned(),
        Some(other) => format!("{other:?}"),
        None => "unknown".to_owned(),
    };
    let cipher = session
        .negotiated_cipher_suite()
        .and_then(|c| c.suite().as_str())
        .unwrap_or("unknown")
        .to_owned();
    Ok(TlsSession { version, cipher })
}
