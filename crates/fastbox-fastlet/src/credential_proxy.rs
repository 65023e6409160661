//! The node's Credential Vault proxy: the listener the instance table redirects the HTTPS
//! of `credentialProxy` sandboxes to, run on a thread of its own, and the sessions it
//! serves (one per such sandbox, by address).
//!
//! - Its CA is kept in `DATA_DIR/credential-proxy` (key 0600; see
//!   `fastbox_credential_proxy::ProxyCa::load_or_generate`), so sandboxes that trusted it
//!   before a restart, or that paused and resumed, still trust what it signs. Nodes given
//!   the same directory (`--credential-proxy-ca-dir`) share the CA, so a sandbox moved
//!   between them trusts the new node's proxy too.
//! - Bound hosts are verified against the host's trust store (`rustls-native-certs`, which
//!   honours `SSL_CERT_FILE` and `SSL_CERT_DIR`), plus the operator's extra roots
//!   (`--credential-proxy-roots FILE`).
//! - A session resolves and connects as its sandbox (`SlotConnector`), so the sandbox's
//!   egress policy and the private ranges decide where the proxy may go.

use std::collections::HashMap;
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use fastbox_credential_proxy::node::{Sandboxes, SlotConnector, serve};
use fastbox_credential_proxy::{Proxy, ProxyCa, Session, Upstream, VaultSource};
use rustls::RootCertStore;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// The CA's name, as sandboxes see it in their trust store.
const CA_NAME: &str = "fastbox credential proxy CA";

/// Where the node's proxy gets its CA and its roots.
#[derive(Debug, Clone, Default)]
pub struct CredentialProxyConfig {
    /// The CA's directory (`None`: `DATA_DIR/credential-proxy`).
    pub ca_dir: Option<PathBuf>,
    /// PEM files of roots trusted for bound hosts besides the host's trust store.
    pub extra_roots: Vec<PathBuf>,
}

/// Why the proxy could not start.
#[derive(Debug, thiserror::Error)]
pub enum CredentialProxyError {
    #[error("credential proxy CA: {0}")]
    Ca(#[from] fastbox_credential_proxy::CaError),
    #[error("credential proxy roots {path}: {message}")]
    Roots { path: PathBuf, message: String },
    #[error("credential proxy listener: {0}")]
    Io(#[from] std::io::Error),
}

/// The running proxy of this node.
pub struct CredentialProxy {
    port: u16,
    ca_pem: String,
    sessions: Arc<SessionTable>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for CredentialProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CredentialProxy")
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

impl CredentialProxy {
    /// Loads (or makes) the CA, reads the roots and starts listening on every address, on a
    /// free port: the one the instance table's redirect names ([`CredentialProxy::port`]).
    /// Only redirected connections reach it (the table drops the rest), and it serves only
    /// addresses of sandboxes it was given ([`CredentialProxy::admit`]).
    pub fn start(
        data_dir: &Path,
        cfg: &CredentialProxyConfig,
    ) -> Result<Self, CredentialProxyError> {
        let ca_dir = cfg
            .ca_dir
            .clone()
            .unwrap_or_else(|| data_dir.join("credential-proxy"));
        let ca = Arc::new(ProxyCa::load_or_generate(&ca_dir, CA_NAME)?);
        let roots = Arc::new(trusted_roots(&cfg.extra_roots)?);
        raise_open_files_limit();
        let proxy = Arc::new(Proxy::new(ca.clone(), Upstream { roots }));
        let listener = TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0))?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let sessions = Arc::new(SessionTable::default());
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let served = sessions.clone() as Arc<dyn Sandboxes>;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("credential-proxy")
            .enable_all()
            .build()?;
        let thread = std::thread::Builder::new()
            .name(format!("credential-proxy-{port}"))
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => {
                            tracing::error!(error = %e, "credential proxy: listener");
                            return;
                        }
                    };
                    tokio::select! {
                        () = serve(listener, proxy, served) => {}
                        _ = stopped => {}
                    }
                });
                runtime.shutdown_background();
            })?;
        tracing::info!(port, ca_dir = %ca_dir.display(), "credential proxy listening");
        Ok(Self {
            port,
            ca_pem: ca.certificate_pem(),
            sessions,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The port the instance table redirects to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The CA's certificate (PEM), which `credentialProxy` sandboxes trust.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// Serves the sandbox at `slot`'s address from now on, with `vault`.
    pub fn admit(&self, slot: &fastbox_runtime::net::NetSlot, vault: VaultSource) {
        let session = Session {
            vault,
            connector: Arc::new(SlotConnector::for_slot(slot)),
        };
        self.sessions
            .by_address
            .write()
            .expect("sessions lock")
            .insert(slot.address, session);
    }

    /// Serves nothing more at `address`.
    pub fn forget(&self, address: Ipv4Addr) {
        self.sessions
            .by_address
            .write()
            .expect("sessions lock")
            .remove(&address);
    }

    /// Stops listening (connections in flight are dropped).
    pub fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for CredentialProxy {
    fn drop(&mut self) {
        self.stop();
    }
}

#[derive(Default)]
struct SessionTable {
    by_address: RwLock<HashMap<Ipv4Addr, Session>>,
}

impl Sandboxes for SessionTable {
    fn session(&self, address: Ipv4Addr) -> Option<Session> {
        self.by_address
            .read()
            .expect("sessions lock")
            .get(&address)
            .cloned()
    }
}

/// Raises this process's soft limit of open files to its hard limit: the proxy holds two
/// descriptors per connection, up to `node::MAX_CONNECTIONS`.
fn raise_open_files_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && soft < hard
        && let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard)
    {
        tracing::warn!(soft, hard, error = %e, "could not raise the open files limit");
    }
}

/// The host's trust store and the PEM files of `extra`.
fn trusted_roots(extra: &[PathBuf]) -> Result<RootCertStore, CredentialProxyError> {
    let mut roots = RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for e in &native.errors {
        tracing::warn!(error = %e, "credential proxy: a root of the host's trust store was not read");
    }
    let (_, unparsed) = roots.add_parsable_certificates(native.certs);
    if unparsed > 0 {
        tracing::warn!(
            unparsed,
            "credential proxy: roots of the host's trust store not parsed"
        );
    }
    for path in extra {
        let bad = |message: String| CredentialProxyError::Roots {
            path: path.clone(),
            message,
        };
        let certs = CertificateDer::pem_file_iter(path)
            .map_err(|e| bad(e.to_string()))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| bad(e.to_string()))?;
        if certs.is_empty() {
            return Err(bad("no certificate in it".into()));
        }
        for cert in certs {
            roots.add(cert).map_err(|e| bad(e.to_string()))?;
        }
    }
    if roots.is_empty() {
        // The node runs without them: bound hosts then fail verification (502), nothing else.
        tracing::warn!(
            "credential proxy: no trusted roots (the host's trust store is empty and no --credential-proxy-roots was given): bound hosts cannot be verified"
        );
    }
    Ok(roots)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extra_roots_are_read_and_a_file_without_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let ca = ProxyCa::generate("extra root").unwrap();
        let good = dir.path().join("good.pem");
        std::fs::write(&good, ca.certificate_pem()).unwrap();
        let before = trusted_roots(&[]).map(|r| r.len()).unwrap_or(0);
        assert_eq!(trusted_roots(&[good]).unwrap().len(), before + 1);
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let err = trusted_roots(&[empty]).unwrap_err().to_string();
        assert!(err.contains("no certificate"), "{err}");
        let missing = dir.path().join("missing.pem");
        assert!(trusted_roots(&[missing]).is_err());
    }

    #[test]
    fn the_ca_is_kept_across_starts() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = CredentialProxyConfig::default();
        let first = CredentialProxy::start(dir.path(), &cfg).unwrap();
        let key = std::fs::read(dir.path().join("credential-proxy/ca-key.pem")).unwrap();
        drop(first);
        let second = CredentialProxy::start(dir.path(), &cfg).unwrap();
        assert_eq!(
            std::fs::read(dir.path().join("credential-proxy/ca-key.pem")).unwrap(),
            key
        );
        assert!(second.ca_pem().contains("BEGIN CERTIFICATE"));
        assert_ne!(second.port(), 0);
    }
}
