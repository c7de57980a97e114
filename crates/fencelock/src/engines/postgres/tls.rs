//! TLS for PostgreSQL sessions: one rustls connector per client, whose certificate verifier
//! gives each `sslmode` libpq's meaning (the driver itself knows only disable, prefer and
//! require, and would verify nothing).

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::url::{PgTls, SslMode};
use crate::core::error::{Error, Result};
use crate::core::tls;

/// The connector for every session of one client. With `sslmode=disable` the driver never
/// starts TLS, so the connector is built but not used.
pub(crate) fn connector(settings: &PgTls) -> Result<MakeRustlsConnect> {
    let provider = tls::provider();
    let verifier: Arc<dyn ServerCertVerifier> = match settings.mode {
        SslMode::Disable => Arc::new(Unverified(provider.clone())),
        SslMode::Prefer | SslMode::Require if settings.root_cert.is_none() => {
            Arc::new(Unverified(provider.clone()))
        }
        SslMode::Prefer | SslMode::Require | SslMode::VerifyCa => {
            Arc::new(ChainOnly(webpki(settings, &provider)?))
        }
        SslMode::VerifyFull => webpki(settings, &provider)?,
    };
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::invalid(format!("TLS settings for PostgreSQL: {e}")))?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let config = match (&settings.cert, &settings.key) {
        (Some(cert), Some(key)) => builder
            .with_client_auth_cert(
                tls::certificates(cert, "sslcert")?,
                tls::private_key(key, "sslkey")?,
            )
            // rustls' message says what is wrong with the pair, never the key's bytes.
            .map_err(|e| {
                Error::invalid(format!(
                    "the client certificate (sslcert=) and key (sslkey=) in the backend URL: {e}"
                ))
            })?,
        _ => builder.with_no_client_auth(),
    };
    Ok(MakeRustlsConnect::new(config))
}

/// Chain and host name checked against `sslrootcert`, or the system's roots.
fn webpki(settings: &PgTls, provider: &Arc<CryptoProvider>) -> Result<Arc<WebPkiServerVerifier>> {
    let roots = tls::roots(settings.root_cert.as_deref(), "sslrootcert")?;
    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| Error::invalid(format!("sslrootcert in the backend URL: {e}")))
}

/// `verify-ca`: the chain is verified, the name in the certificate is not.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            // webpki checks the name last, after the chain: a name error means a good chain.
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// `prefer` and `require` without `sslrootcert`: encrypted, but any certificate is accepted,
/// as libpq does. The handshake's signatures are still checked, so the session's keys belong
/// to whoever holds the certificate's key.
#[derive(Debug)]
struct Unverified(Arc<CryptoProvider>);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
