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
}

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
        let key = KeyPair::generate()?;
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
