//! A claim's `trust_ca_pem`: the CA of the node's credential proxy, which the sandbox must
//! trust for the TLS the proxy ends. execd puts it where programs look:
//!
//! - appended to the system bundle (the first of [`SYSTEM_BUNDLES`] there is, once; created
//!   when there is none), which curl, wget, git and OpenSSL read by default;
//! - alone in [`CA_FILE`], for `NODE_EXTRA_CA_CERTS` (Node adds it to its own roots);
//! - with the system's roots in [`BUNDLE_FILE`], for `SSL_CERT_FILE`, `REQUESTS_CA_BUNDLE`,
//!   `CURL_CA_BUNDLE` and `GIT_SSL_CAINFO`;
//! - into Java's `cacerts` (JKS stores only: `super::java_trust`).
//!
//! These files are the tenant's own (execd writes them inside the sandbox, as its root);
//! paths are relative to the system root ([`crate::state::Config::system_root`], `/`).

use std::collections::BTreeMap;
use std::io;
use std::path::Path;

/// The CA alone.
pub const CA_FILE: &str = "etc/fastbox/credential-proxy-ca.pem";
/// The system's roots and the CA.
pub const BUNDLE_FILE: &str = "etc/fastbox/ca-bundle.pem";
/// Where distributions keep their bundle, in the order looked for.
pub const SYSTEM_BUNDLES: [&str; 3] = [
    "etc/ssl/certs/ca-certificates.crt",
    "etc/pki/tls/certs/ca-bundle.crt",
    "etc/ssl/cert.pem",
];
/// The largest CA accepted.
const MAX_PEM: usize = 16 * 1024;

/// Whether `pem` is one PEM certificate of a sane size.
pub fn validate(pem: &str) -> Result<(), String> {
    let trimmed = pem.trim();
    let shaped = trimmed.starts_with("-----BEGIN CERTIFICATE-----")
        && trimmed.ends_with("-----END CERTIFICATE-----")
        && trimmed.matches("-----BEGIN").count() == 1;
    match shaped
        && pem.len() <= MAX_PEM
        && pem
            .bytes()
            .all(|b| b.is_ascii_graphic() || b == b'\n' || b == b'\r' || b == b' ')
    {
        true => Ok(()),
        false => Err(format!(
            "trust_ca_pem must be one PEM certificate of at most {MAX_PEM} bytes"
        )),
    }
}

/// Installs `pem` under `root`; returns the variables that point programs at it.
pub fn install(root: &Path, pem: &str) -> io::Result<BTreeMap<String, String>> {
    let pem = format!("{}\n", pem.trim());
    std::fs::create_dir_all(root.join("etc/fastbox"))?;
    std::fs::write(root.join(CA_FILE), &pem)?;
    let system = SYSTEM_BUNDLES
        .iter()
        .map(|p| root.join(p))
        .find(|p| p.is_file())
        .unwrap_or_else(|| root.join(SYSTEM_BUNDLES[0]));
    let mut bundle = match std::fs::read_to_string(&system) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e),
    };
    if !bundle.contains(pem.trim()) {
        if !bundle.is_empty() && !bundle.ends_with('\n') {
            bundle.push('\n');
        }
        bundle.push_str(&pem);
        if let Some(dir) = system.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(&system, &bundle)?;
    }
    std::fs::write(root.join(BUNDLE_FILE), &bundle)?;
    // Java reads its own store. One it cannot take is not worth failing the claim over.
    match super::java_trust::pem_to_der(&pem).map(|der| super::java_trust::install(root, &der)) {
        Some(Ok(changed)) if !changed.is_empty() => {
            tracing::debug!(stores = ?changed, "credential proxy CA added to java trust stores")
        }
        Some(Err(e)) => tracing::warn!(error = %e, "java trust store not changed"),
        _ => {}
    }
    let in_sandbox = |p: &str| format!("/{p}");
    let mut env = BTreeMap::new();
    for var in [
        "SSL_CERT_FILE",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "GIT_SSL_CAINFO",
    ] {
        env.insert(var.to_string(), in_sandbox(BUNDLE_FILE));
    }
    env.insert("NODE_EXTRA_CA_CERTS".into(), in_sandbox(CA_FILE));
    Ok(env)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PEM: &str = "-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----\n";

    #[test]
    fn only_one_certificate_is_taken() {
        assert!(validate(PEM).is_ok());
        assert!(validate("junk").is_err());
        assert!(validate(&format!("{PEM}{PEM}")).is_err());
        assert!(validate(&PEM.replace("fake", "fa\u{1}ke")).is_err());
    }

    #[test]
    fn the_ca_joins_the_system_bundle_once_and_gets_files_of_its_own() {
        let root = tempfile::tempdir().unwrap();
        let system = root.path().join(SYSTEM_BUNDLES[0]);
        std::fs::create_dir_all(system.parent().unwrap()).unwrap();
        std::fs::write(&system, "SYSTEM ROOTS").unwrap();
        let env = install(root.path(), PEM).unwrap();
        install(root.path(), PEM).unwrap();
        let bundle = std::fs::read_to_string(&system).unwrap();
        assert_eq!(bundle, format!("SYSTEM ROOTS\n{PEM}"), "appended once");
        assert_eq!(
            std::fs::read_to_string(root.path().join(BUNDLE_FILE)).unwrap(),
            bundle
        );
        assert_eq!(
            std::fs::read_to_string(root.path().join(CA_FILE)).unwrap(),
            PEM
        );
        assert_eq!(env["SSL_CERT_FILE"], "/etc/fastbox/ca-bundle.pem");
        assert_eq!(
            env["NODE_EXTRA_CA_CERTS"],
            "/etc/fastbox/credential-proxy-ca.pem"
        );
        // A root without a bundle gets one.
        let bare = tempfile::tempdir().unwrap();
        install(bare.path(), PEM).unwrap();
        assert_eq!(
            std::fs::read_to_string(bare.path().join(SYSTEM_BUNDLES[0])).unwrap(),
            PEM
        );
    }
}
