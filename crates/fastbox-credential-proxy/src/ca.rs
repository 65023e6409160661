//! The CA the sandbox trusts for the proxy: it signs, on demand, one certificate per bound
//! host name the sandbox connects to (kept for reuse). The CA's key never leaves the node.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("certificate authority: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("certificate authority: {0}")]
    Key(#[from] rustls::Error),
    #[error("certificate authority key {path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

/// The key file of a kept CA.
const KEY_FILE: &str = "ca-key.pem";

/// The proxy's CA, and the host certificates it signed.
pub struct ProxyCa {
    key: KeyPair,
    cert: rcgen::Certificate,
    issued: Mutex<HashMap<String, Arc<CertifiedKey>>>,
}

impl std::fmt::Debug for ProxyCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyCa").finish_non_exhaustive()
    }
}

impl ProxyCa {
    /// A new CA (an ECDSA P-256 key), named `name`.
    pub fn generate(name: &str) -> Result<Self, CaError> {
        Self::with_key(KeyPair::generate()?, name)
    }

    /// The CA whose key is kept in `dir` (made there on first use, mode 0600, `dir` made
    /// 0700), named `name`. After a restart its certificate is signed again from the same
    /// key and name, which is what a sandbox's trust in it rests on: what it signs still
    /// verifies in sandboxes that trusted the certificate before.
    pub fn load_or_generate(dir: &std::path::Path, name: &str) -> Result<Self, CaError> {
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        let io = |path: &std::path::Path| {
            let path = path.to_path_buf();
            move |source| CaError::Io { path, source }
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io(dir))?;
        let path = dir.join(KEY_FILE);
        let key = match std::fs::read_to_string(&path) {
            Ok(pem) => KeyPair::from_pem(&pem)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let key = KeyPair::generate()?;
                let tmp = dir.join(format!("{KEY_FILE}.tmp"));
                let mut file = std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(0o600)
                    .open(&tmp)
                    .map_err(io(&tmp))?;
                std::io::Write::write_all(&mut file, key.serialize_pem().as_bytes())
                    .and_then(|()| file.sync_all())
                    .map_err(io(&tmp))?;
                std::fs::rename(&tmp, &path).map_err(io(&path))?;
                key
            }
            Err(e) => return Err(io(&path)(e)),
        };
        Self::with_key(key, name)
    }

    fn with_key(key: KeyPair, name: &str) -> Result<Self, CaError> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name);
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key)?;
        Ok(Self {
            key,
            cert,
            issued: Mutex::new(HashMap::new()),
        })
    }

    /// The CA's certificate, PEM: what the sandbox's trust store gets.
    pub fn certificate_pem(&self) -> String {
        self.cert.pem()
    }

    pub fn certificate_der(&self) -> CertificateDer<'static> {
        self.cert.der().clone()
    }

    /// The certificate and key for host `name`, signed now or earlier.
    pub fn for_host(&self, name: &str) -> Result<Arc<CertifiedKey>, CaError> {
        if let Some(done) = self.issued.lock().expect("issued lock").get(name) {
            return Ok(done.clone());
        }
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(vec![name.to_string()])?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name);
        params.distinguished_name = dn;
        params.use_authority_key_identifier_extension = true;
        let cert = params.signed_by(&key, &self.cert, &self.key)?;
        let der_key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let signing = rustls::crypto::ring::sign::any_supported_type(&der_key)?;
        let certified = Arc::new(CertifiedKey::new(
            vec![cert.der().clone(), self.certificate_der()],
            signing,
        ));
        self.issued
            .lock()
            .expect("issued lock")
            .insert(name.to_string(), certified.clone());
        Ok(certified)
    }
}

/// Serves the certificate of the name a ClientHello asks for.
#[derive(Debug)]
pub(crate) struct HostCertificates(pub Arc<ProxyCa>);

impl ResolvesServerCert for HostCertificates {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let name = hello.server_name()?;
        self.0.for_host(name).ok()
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use rustls::client::danger::ServerCertVerifier;

    use super::*;

    #[test]
    fn a_kept_ca_signs_with_the_same_key_after_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let kept = dir.path().join("proxy-ca");
        let first = ProxyCa::load_or_generate(&kept, "fastbox node CA").unwrap();
        let again = ProxyCa::load_or_generate(&kept, "fastbox node CA").unwrap();
        assert_eq!(first.key.public_key_der(), again.key.public_key_der());
        let other = ProxyCa::generate("fastbox node CA").unwrap();
        assert_ne!(first.key.public_key_der(), other.key.public_key_der());
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&kept.join(KEY_FILE)), 0o600);
        assert_eq!(mode(&kept), 0o700);
        // A host certificate the restarted CA signs verifies against the first certificate
        // (what sandboxes trusted).
        let mut roots = rustls::RootCertStore::empty();
        roots.add(first.certificate_der()).unwrap();
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            Arc::new(rustls::crypto::ring::default_provider()),
        )
        .build()
        .unwrap();
        let leaf = again.for_host("api.example.org").unwrap();
        let name = rustls::pki_types::ServerName::try_from("api.example.org").unwrap();
        verifier
            .verify_server_cert(
                &leaf.cert[0],
                &[],
                &name,
                &[],
                rustls::pki_types::UnixTime::now(),
            )
            .expect("the restarted CA's certificate verifies under the first one");
    }
}
