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

#[cfg(feature = "postgres")]
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

#[cfg(feature = "postgres")]
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

#[cfg(feature = "postgres")]
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

#[cfg(feature = "postgres")]
fn not_pem(path: &Path, option: &str, what: &str) -> Error {
    Error::invalid(format!(
        "the TLS file {} given as {option}= in the backend URL holds no PEM {what}",
        path.display()
    ))
}

#[cfg(feature = "postgres")]
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
