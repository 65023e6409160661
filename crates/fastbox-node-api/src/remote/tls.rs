//! TLS for the node and control APIs, each side pinning the other's certificate.
//!
//! Each listener has an identity of its own ([`TlsIdentity`]): a self-signed certificate and
//! its key, made at its first start and kept in a directory of its data directory. Nobody
//! signs these certificates; a client trusts exactly one certificate, named by its
//! [`CertPin`] (the SHA-256 of its DER form), and checks that the server holds its key (the
//! TLS handshake's signature). Names and dates are not checked: the pin is the trust.
//!
//! How the pins travel: a node gets the server's from a file the operator copies with the
//! join token (`DATA_DIR/control-cert.pem` of the server), and tells the server its own in
//! its registration, which goes over that pinned connection. So neither side ever accepts a
//! certificate it has not been given over a channel it already trusts.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::ConnectInfo;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use sha2::{Digest as _, Sha256};
use tokio::net::TcpListener;

/// Why a TLS identity, pin or configuration could not be had.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("{path}: {message}")]
    Pem { path: PathBuf, message: String },
    #[error("a certificate could not be made: {0}")]
    Generate(String),
    #[error("TLS configuration: {0}")]
    Config(String),
    #[error("{0:?} is not a certificate pin (64 hex digits: a SHA-256)")]
    Pin(String),
}

/// The SHA-256 of a certificate's DER form: the one certificate a client accepts.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CertPin([u8; 32]);

impl CertPin {
    /// The pin of a certificate in DER form.
    pub fn of_der(der: &[u8]) -> Self {
        Self(Sha256::digest(der).into())
    }

    /// The pin of the first certificate of PEM file `path`.
    pub fn of_pem_file(path: &Path) -> Result<Self, TlsError> {
        let certs = read_certs(path)?;
        Ok(Self::of_der(&certs[0]))
    }
}

impl std::fmt::Display for CertPin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl std::fmt::Debug for CertPin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CertPin({self})")
    }
}

impl std::str::FromStr for CertPin {
    type Err = TlsError;

    fn from_str(text: &str) -> Result<Self, TlsError> {
        let bad = || TlsError::Pin(text.to_string());
        if text.len() != 64 || !text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(bad());
        }
        let bytes = hex::decode(text).map_err(|_| bad())?;
        Ok(Self(bytes.try_into().map_err(|_| bad())?))
    }
}

/// A listener's certificate and key (see the module docs).
pub struct TlsIdentity {
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    cert_path: PathBuf,
}

impl std::fmt::Debug for TlsIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsIdentity")
            .field("cert", &self.cert_path)
            .field("pin", &self.pin())
            .finish_non_exhaustive()
    }
}

/// The certificate's file in an identity's directory (public).
pub const CERT_FILE: &str = "cert.pem";
/// The key's file in an identity's directory (mode 0600).
pub const KEY_FILE: &str = "key.pem";
/// Held (`flock`) while an identity is looked for and made.
const LOCK_FILE: &str = ".lock";

impl TlsIdentity {
    /// The identity kept in `dir` (`cert.pem`, `key.pem`), made there first when it has none:
    /// a new key and a self-signed certificate for `names` (host names or addresses, for
    /// the operator's eyes; clients check the pin, not names).
    pub fn load_or_create(dir: &Path, names: &[String]) -> Result<Self, TlsError> {
        let io_err = |what, path: &Path| {
            let path = path.to_path_buf();
            move |source| TlsError::Io { what, path, source }
        };
        let (cert_path, key_path) = (dir.join(CERT_FILE), dir.join(KEY_FILE));
        create_private_dir(dir).map_err(io_err("create", dir))?;
        // Two processes (or threads) making the identity at once would otherwise each write
        // a key and a certificate, and could leave one's key beside the other's certificate.
        let lock_path = dir.join(LOCK_FILE);
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io_err("open", &lock_path))?;
        lock.lock().map_err(io_err("lock", &lock_path))?;
        if !cert_path.exists() {
            let names = if names.is_empty() {
                vec!["fastbox".to_string()]
            } else {
                names.to_vec()
            };
            let made = rcgen::generate_simple_self_signed(names)
                .map_err(|e| TlsError::Generate(e.to_string()))?;
            // The key first: a certificate without its key is never left behind.
            write_new(&key_path, made.key_pair.serialize_pem().as_bytes(), 0o600)
                .map_err(io_err("write", &key_path))?;
            write_new(&cert_path, made.cert.pem().as_bytes(), 0o644)
                .map_err(io_err("write", &cert_path))?;
        }
        drop(lock);
        let certs = read_certs(&cert_path)?;
        let key = PrivateKeyDer::from_pem_file(&key_path).map_err(|e| TlsError::Pem {
            path: key_path.clone(),
            message: e.to_string(),
        })?;
        Ok(Self {
            certs,
            key,
            cert_path,
        })
    }

    /// The pin of this identity's certificate.
    pub fn pin(&self) -> CertPin {
        CertPin::of_der(&self.certs[0])
    }

    /// Where the certificate is (a copy of it is what clients pin).
    pub fn cert_path(&self) -> &Path {
        &self.cert_path
    }

    /// An acceptor presenting this identity.
    pub fn acceptor(&self) -> Result<tokio_rustls::TlsAcceptor, TlsError> {
        let config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_no_client_auth()
            .with_single_cert(self.certs.clone(), self.key.clone_key())
            .map_err(|e| TlsError::Config(e.to_string()))?;
        Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
    }
}

/// A client configuration that accepts the one certificate `pin` names.
pub fn pinned_client_config(pin: CertPin) -> Result<rustls::ClientConfig, TlsError> {
    let provider = provider();
    let verifier = Pinned {
        pin,
        algorithms: provider.signature_verification_algorithms,
    };
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth())
}

/// Serves `router` over TLS with `acceptor` (the callers' addresses as `ConnectInfo`, HTTP/1
/// upgrades passed on) until `stop` turns true. A connection whose handshake fails or takes
/// over 10 s is dropped, so is one that sends no request head within 30 s; at most
/// [`MAX_CONNECTIONS`] are served at once (the others wait to be accepted).
pub async fn serve_tls(
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    router: axum::Router,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> io::Result<()> {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
            return Ok(());
        };
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors and the like: wait, then accept again.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            // (The guard `wait_for` answers must not outlive the branch: not `Send`.)
            () = async { drop(stop.wait_for(|s| *s).await) } => return Ok(()),
        };
        let (acceptor, router) = (acceptor.clone(), router.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let _ = tcp.set_nodelay(true);
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake refused");
                    return;
                }
                Err(_) => return,
            };
            let service = hyper_util::service::TowerToHyperService::new(
                router.layer(axum::Extension(ConnectInfo::<SocketAddr>(peer))),
            );
            let mut builder =
                hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
            builder
                .http1()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT);
            let _ = builder
                .serve_connection_with_upgrades(hyper_util::rt::TokioIo::new(tls), service)
                .await;
        });
    }
}

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a connection may take to send a request's head.
const HEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// Connections served at once by one listener.
pub const MAX_CONNECTIONS: usize = 1024;

/// The one crypto provider of these connections (ring), named explicitly: the process may
/// hold several.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Accepts the certificate whose pin it holds, and only when the peer proves it holds its
/// key.
#[derive(Debug)]
struct Pinned {
    pin: CertPin,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let presented = CertPin::of_der(end_entity);
        if presented == self.pin {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(format!(
                "certificate {presented} is not the pinned {}",
                self.pin
            )))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem_err = |message: String| TlsError::Pem {
        path: path.to_path_buf(),
        message,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| pem_err(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_err(e.to_string()))?;
    if certs.is_empty() {
        return Err(pem_err("no certificate in it".into()));
    }
    Ok(certs)
}

fn create_private_dir(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Writes `bytes` to a new temporary file beside `path` with `mode`, then renames it there.
fn write_new(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let tmp = path.with_extension(format!("new.{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_identity_is_made_once_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let tls = dir.path().join("tls");
        let made = TlsIdentity::load_or_create(&tls, &["n1".into()]).unwrap();
        let again = TlsIdentity::load_or_create(&tls, &["n1".into()]).unwrap();
        assert_eq!(made.pin(), again.pin());
        assert_eq!(CertPin::of_pem_file(made.cert_path()).unwrap(), made.pin());
        use std::os::unix::fs::PermissionsExt as _;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&tls.join(KEY_FILE)), 0o600);
        assert_eq!(mode(&tls), 0o700);
        let other = TlsIdentity::load_or_create(&dir.path().join("other"), &[]).unwrap();
        assert_ne!(other.pin(), made.pin());
    }

    #[test]
    fn an_identity_made_by_many_at_once_is_one_whole_identity() {
        let dir = tempfile::tempdir().unwrap();
        let tls = dir.path().join("tls");
        let made: Vec<TlsIdentity> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..8)
                .map(|_| scope.spawn(|| TlsIdentity::load_or_create(&tls, &[]).unwrap()))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for identity in &made {
            assert_eq!(identity.pin(), made[0].pin());
            // rustls refuses a key that is not the certificate's.
            identity.acceptor().expect("the key is the certificate's");
        }
    }

    #[test]
    fn pins_read_back_and_refuse_anything_else() {
        let pin = CertPin::of_der(b"a certificate");
        assert_eq!(pin.to_string().parse::<CertPin>().unwrap(), pin);
        for bad in ["", "00", &"g".repeat(64), &pin.to_string().to_uppercase()] {
            assert!(bad.parse::<CertPin>().is_err(), "{bad:?}");
        }
    }
}
