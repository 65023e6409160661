//! Java's trust store: the CA of a claim's `trust_ca_pem` added to the JDK's `cacerts` as a
//! trusted certificate entry, so Java clients (which read neither the system bundle nor
//! `SSL_CERT_FILE`) trust the credential proxy too.
//!
//! Only the JKS format is written (what Debian's `ca-certificates-java` makes, and what a
//! JDK's own `cacerts` is when it is not a link to it), with the store's well-known password
//! `changeit`. A store whose integrity digest does not verify with it, or of another format
//! (PKCS12), is left alone: a store execd cannot read back is never rewritten.
//!
//! JKS layout (big endian): magic `FEEDFEED`, version 2, entry count; per trusted
//! certificate entry: tag 2, alias (`u16` length + UTF-8), creation time (ms, `u64`),
//! certificate type (`u16` length + `X.509`), DER length (`u32`), DER; then a SHA-1 of the
//! password as UTF-16BE, the bytes `Mighty Aphrodite`, and everything before the digest.

use std::io;
use std::path::{Path, PathBuf};

use sha1::{Digest, Sha1};

/// The alias of the entry execd adds.
pub const ALIAS: &str = "fastbox-credential-proxy";
/// Where JDKs keep `cacerts`, relative to the system root: Debian's shared store, then each
/// JDK's own (a link to the shared one on Debian, a file of its own elsewhere).
const SHARED_STORE: &str = "etc/ssl/certs/java/cacerts";
const JDK_DIRS: [&str; 2] = ["usr/lib/jvm", "opt/java"];

const MAGIC: u32 = 0xFEED_FEED;
const PASSWORD: &str = "changeit";
const TRUSTED_CERT: u32 = 2;

/// Adds certificate `der` under [`ALIAS`] to every JKS `cacerts` under `root` that does not
/// hold it yet; returns the stores changed.
pub fn install(root: &Path, der: &[u8]) -> io::Result<Vec<PathBuf>> {
    let mut changed = Vec::new();
    for store in stores(root) {
        let Ok(bytes) = std::fs::read(&store) else {
            continue;
        };
        match with_entry(&bytes, ALIAS, der, now_ms()) {
            Some(updated) => {
                let tmp = store.with_extension("fastbox-tmp");
                std::fs::write(&tmp, &updated)?;
                std::fs::rename(&tmp, &store)?;
                changed.push(store);
            }
            None => {
                tracing::debug!(store = %store.display(), "java trust store left alone (not JKS with the default password, or it has the CA)")
            }
        }
    }
    Ok(changed)
}

/// The `cacerts` files under `root` that are files, not links.
fn stores(root: &Path) -> Vec<PathBuf> {
    let mut found = vec![root.join(SHARED_STORE)];
    for dir in JDK_DIRS {
        let Ok(entries) = std::fs::read_dir(root.join(dir)) else {
            continue;
        };
        for jdk in entries.flatten() {
            found.push(jdk.path().join("lib/security/cacerts"));
        }
    }
    found
        .into_iter()
        .filter(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_file()))
        .collect()
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The digest JKS ends with, over `body`.
fn digest(body: &[u8]) -> [u8; 20] {
    let mut sha = Sha1::new();
    for unit in PASSWORD.encode_utf16() {
        sha.update(unit.to_be_bytes());
    }
    sha.update(b"Mighty Aphrodite");
    sha.update(body);
    sha.finalize().into()
}

/// `store` with a trusted certificate entry `alias` for `der` added, or None when it is not
/// a JKS store whose digest verifies, or it already has `alias` or `der`.
pub fn with_entry(store: &[u8], alias: &str, der: &[u8], created_ms: u64) -> Option<Vec<u8>> {
    if store.len() < 12 + 20 {
        return None;
    }
    let (body, tail) = store.split_at(store.len() - 20);
    let be32 = |at: usize| u32::from_be_bytes(body[at..at + 4].try_into().expect("4 bytes"));
    if be32(0) != MAGIC || be32(4) != 2 || digest(body) != tail {
        return None;
    }
    if contains(body, alias.as_bytes()) || contains(body, der) {
        return None;
    }
    let count = be32(8).checked_add(1)?;
    let mut out = Vec::with_capacity(store.len() + der.len() + 64);
    out.extend_from_slice(&body[..8]);
    out.extend_from_slice(&count.to_be_bytes());
    out.extend_from_slice(&body[12..]);
    out.extend_from_slice(&TRUSTED_CERT.to_be_bytes());
    push_utf(&mut out, alias)?;
    out.extend_from_slice(&created_ms.to_be_bytes());
    push_utf(&mut out, "X.509")?;
    out.extend_from_slice(&u32::try_from(der.len()).ok()?.to_be_bytes());
    out.extend_from_slice(der);
    let sum = digest(&out);
    out.extend_from_slice(&sum);
    Some(out)
}

fn push_utf(out: &mut Vec<u8>, text: &str) -> Option<()> {
    out.extend_from_slice(&u16::try_from(text.len()).ok()?.to_be_bytes());
    out.extend_from_slice(text.as_bytes());
    Some(())
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

/// The DER of one PEM certificate (`trust::validate` checked its shape).
pub fn pem_to_der(pem: &str) -> Option<Vec<u8>> {
    let body: String = pem
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with("-----") && !l.is_empty())
        .collect();
    decode_base64(&body)
}

fn decode_base64(text: &str) -> Option<Vec<u8>> {
    let value = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let bytes = text.trim_end_matches('=').as_bytes();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let mut acc = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            acc |= value(c)? << (18 - 6 * i);
        }
        let n = match chunk.len() {
            4 => 3,
            3 => 2,
            2 => 1,
            _ => return None,
        };
        out.extend_from_slice(&acc.to_be_bytes()[1..1 + n]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An empty JKS store with a valid digest.
    fn empty_store() -> Vec<u8> {
        let mut body = Vec::new();
        body.extend_from_slice(&MAGIC.to_be_bytes());
        body.extend_from_slice(&2u32.to_be_bytes());
        body.extend_from_slice(&0u32.to_be_bytes());
        let sum = digest(&body);
        body.extend_from_slice(&sum);
        body
    }

    #[test]
    fn an_entry_is_added_once_and_the_digest_verifies() {
        let der = b"\x30\x82\x01\x0afake certificate".to_vec();
        let store = with_entry(&empty_store(), ALIAS, &der, 1).unwrap();
        let (body, tail) = store.split_at(store.len() - 20);
        assert_eq!(digest(body), tail);
        assert_eq!(&body[8..12], &1u32.to_be_bytes());
        assert!(with_entry(&store, ALIAS, &der, 2).is_none(), "once");
        // A store whose digest does not verify (another password, damage) is left alone.
        let mut damaged = empty_store();
        damaged[5] ^= 1;
        assert!(with_entry(&damaged, ALIAS, &der, 1).is_none());
        assert!(with_entry(b"\x30\x82 PKCS12", ALIAS, &der, 1).is_none());
    }

    #[test]
    fn pem_decodes_to_der() {
        let pem = "-----BEGIN CERTIFICATE-----\nTWFu\nTWE=\n-----END CERTIFICATE-----\n";
        assert_eq!(pem_to_der(pem).unwrap(), b"ManMa");
        assert!(pem_to_der("-----BEGIN CERTIFICATE-----\n*\n-----END CERTIFICATE-----").is_none());
    }

    /// `keytool -list` of the store at `path` with `args`: whether it succeeded, and what it
    /// printed (stdout, then stderr).
    fn keytool_list(args: &[&str], path: &Path) -> (bool, String) {
        let listed = std::process::Command::new("keytool")
            .arg("-list")
            .args(args)
            .args(["-storepass", PASSWORD, "-keystore"])
            .arg(path)
            .output()
            .unwrap();
        let text = format!(
            "{} {}",
            String::from_utf8_lossy(&listed.stdout),
            String::from_utf8_lossy(&listed.stderr)
        );
        (listed.status.success(), text)
    }

    /// The JDK's own tool reads the store back, when this machine has one.
    #[test]
    fn keytool_lists_the_added_entry() {
        if std::process::Command::new("keytool")
            .arg("-help")
            .output()
            .is_err()
        {
            eprintln!("skipped: keytool is not installed");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cacerts");
        // A real certificate: keytool parses it.
        let der = pem_to_der(TEST_CA).unwrap();
        std::fs::write(
            &path,
            with_entry(&empty_store(), ALIAS, &der, now_ms()).unwrap(),
        )
        .unwrap();
        let (listed, text) = keytool_list(&["-storetype", "JKS"], &path);
        assert!(listed, "{text}");
        assert!(
            text.contains(ALIAS) && text.contains("trustedCertEntry"),
            "{text}"
        );
        // And a real Debian store, when this machine has one: the entry joins its roots.
        let Ok(debian) = std::fs::read(Path::new("/").join(SHARED_STORE)) else {
            return;
        };
        let updated = with_entry(&debian, ALIAS, &der, now_ms()).expect("Debian's store is JKS");
        std::fs::write(&path, updated).unwrap();
        let (listed, text) = keytool_list(&["-alias", ALIAS], &path);
        assert!(listed && text.contains("trustedCertEntry"), "{text}");
    }

    /// A self-signed test CA (`openssl req -x509 -newkey ec`).
    const TEST_CA: &str = "-----BEGIN CERTIFICATE-----
MIIBjDCCATGgAwIBAgIUAa2EBN4zdIhtxp2D+p9lDY5e9jwwCgYIKoZIzj0EAwIw
GjEYMBYGA1UEAwwPZmFzdGJveCB0ZXN0IENBMCAXDTI2MTIwNzA4MDY0MFoYDzIx
MjYxMTEzMDgwNjQwWjAaMRgwFgYDVQQDDA9mYXN0Ym94IHRlc3QgQ0EwWTATBgcq
hkjOPQIBBggqhkjOPQMBBwNCAAQ+s0852VALKpIRutnWiaHcIuKdOHEclU0QFTmR
Av3otNbwQGMi3y3IB/q/d05Kn4yIt1fYKtWrTcV1JkZjrKQuo1MwUTAdBgNVHQ4E
FgQUPzxaAT0/zdsE2zFbS+Z93BVtodwwHwYDVR0jBBgwFoAUPzxaAT0/zdsE2zFb
S+Z93BVtodwwDwYDVR0TAQH/BAUwAwEB/zAKBggqhkjOPQQDAgNJADBGAiEArK1S
YZnei5uJ3f3eDmZ1DomJXTWX8pnuQYaZHzxabLkCIQCQHJ87BxAlwG0wE0MJ5We2
YvEop6oFmtK7j5Yb+bQHWg==
-----END CERTIFICATE-----";
}
