//! Signing and verifying one route credential (OSEP-0011, byte for byte).
//!
//! The credential for sandbox `id`, port `port`, expiring at `expires` (Unix seconds) is
//! `hex(SHA256(BE32(len(secret)) || secret || BE32(len(canon)) || canon))[0..8]` followed by the
//! one-character key id, where `canon` is `"v1\nshort\n{id}\n{port}\n{expires_b36}\n"`. The key id
//! names the secret, so keys can be rotated while old routes stay checkable: a [`RouteSigner`]
//! holds one or more keys, signs with the newest and verifies with the key a credential names.
//!
//! The signature keeps 32 bits of the digest (OSEP-0011 fixes that), so a credential can be
//! guessed in about 2^31 tries: the proxies rate-limit failed checks
//! ([`crate::access::FailureLimiter`]) and bound how far ahead an expiry may be
//! ([`RouteSigner::verify_bounded`]).

use std::fmt;

use sha2::{Digest, Sha256};

use super::RouteError;
use super::b36::{from_b36, to_b36};

/// Hex digits of the digest kept in a signature (the key id follows them).
const SIG_HEX_LEN: usize = 8;

/// Shortest secret accepted (128 bits); generated secrets are 32 bytes.
pub(crate) const MIN_SECRET_LEN: usize = 16;

/// Longest secret accepted, so its length always fits the 32-bit length prefix.
pub(crate) const MAX_SECRET_LEN: usize = 4096;

/// One secret and the key id that names it.
#[derive(Clone)]
pub(crate) struct RouteKey {
    pub(crate) id: char,
    pub(crate) secret: Vec<u8>,
}

/// Signs and verifies route credentials with a keyring: one or more secrets, each named by a
/// key id. The last key signs; every key verifies the credentials that name it.
///
/// `Debug` shows the key ids only, never a secret.
#[derive(Clone)]
pub struct RouteSigner {
    /// Never empty; ids are distinct; the last one signs.
    keys: Vec<RouteKey>,
}

impl RouteSigner {
    /// A signer with one key: `secret`, named by `key_id` (one of `0-9a-z`).
    ///
    /// The secret must be 16 to 4096 bytes long.
    pub fn try_new(key_id: char, secret: Vec<u8>) -> Result<Self, RouteError> {
        Self::with_keys(vec![(key_id, secret)])
    }

    /// A signer holding `keys`, oldest first: the last one signs, all of them verify.
    ///
    /// Every key id must be one of `0-9a-z` and appear once, and every secret must be 16 to
    /// 4096 bytes long; at least one key is needed.
    pub fn with_keys(keys: Vec<(char, Vec<u8>)>) -> Result<Self, RouteError> {
        if keys.is_empty() {
            return Err(RouteError::NoKeys);
        }
        let mut checked: Vec<RouteKey> = Vec::with_capacity(keys.len());
        for (id, secret) in keys {
            if !is_key_id(id) {
                return Err(RouteError::InvalidKeyId(id));
            }
            if !(MIN_SECRET_LEN..=MAX_SECRET_LEN).contains(&secret.len()) {
                return Err(RouteError::InvalidSecretLength(secret.len()));
            }
            if checked.iter().any(|k| k.id == id) {
                return Err(RouteError::DuplicateKeyId(id));
            }
            checked.push(RouteKey { id, secret });
        }
        Ok(Self { keys: checked })
    }

    /// The keys of one node of a cluster (`scope`: its name), derived from these: the same
    /// ids, each secret `SHA-256(len ‖ secret ‖ len ‖ "fastbox node route key\n" ‖ scope)`.
    /// A node holding its own keys verifies the routes signed for its sandboxes and can sign
    /// no route another node accepts.
    pub fn derive(&self, scope: &str) -> RouteSigner {
        let label = format!("fastbox node route key\n{scope}");
        let keys = self
            .keys
            .iter()
            .map(|k| RouteKey {
                id: k.id,
                secret: Sha256::new()
                    .chain_update(be32_len(k.secret.len()))
                    .chain_update(&k.secret)
                    .chain_update(be32_len(label.len()))
                    .chain_update(label.as_bytes())
                    .finalize()
                    .to_vec(),
            })
            .collect();
        RouteSigner { keys }
    }

    /// The keys as a key file holds them (secret).
    pub fn file_text(&self) -> String {
        super::key_file::render(self)
    }

    /// The key id this signer appends to the signatures it makes (the newest key's).
    pub fn key_id(&self) -> char {
        self.signing().id
    }

    /// The ids of every key held, oldest first (the last one signs).
    pub fn key_ids(&self) -> Vec<char> {
        self.keys.iter().map(|k| k.id).collect()
    }

    /// Whether a key named `key_id` is held (and so verifies the credentials naming it).
    pub fn holds(&self, key_id: char) -> bool {
        self.key(key_id).is_some()
    }

    /// The 9-character signature of a route to `port` of `sandbox_id` until `expires`, made
    /// with the newest key.
    pub fn sign(&self, sandbox_id: &str, port: u16, expires: u64) -> String {
        sign_with(self.signing(), sandbox_id, port, &to_b36(expires))
    }

    /// Checks a credential taken from a route and returns its expiry time (Unix seconds).
    ///
    /// The key the signature names is the one checked. The signature is checked before the
    /// expiry, so [`RouteError::Expired`] is only ever reported for a credential this signer
    /// issued. A route is valid up to and including the second `expires`.
    pub fn verify(
        &self,
        sandbox_id: &str,
        port: u16,
        expires_b36: &str,
        sig: &str,
        now_unix: u64,
    ) -> Result<u64, RouteError> {
        self.verify_bounded(sandbox_id, port, expires_b36, sig, now_unix, u64::MAX)
    }

    /// [`RouteSigner::verify`], also refusing a genuine credential whose expiry lies more
    /// than `max_lifetime_secs` after `now_unix` ([`RouteError::TooFarAhead`]): routes are
    /// never issued that far ahead, so one that claims it was signed with a leaked key or
    /// issued under a longer limit.
    pub fn verify_bounded(
        &self,
        sandbox_id: &str,
        port: u16,
        expires_b36: &str,
        sig: &str,
        now_unix: u64,
        max_lifetime_secs: u64,
    ) -> Result<u64, RouteError> {
        let expires = from_b36(expires_b36).ok_or(RouteError::Malformed)?;
        let key_id = sig_key_id(sig).ok_or(RouteError::Malformed)?;
        let key = self.key(key_id).ok_or(RouteError::UnknownKey(key_id))?;
        // The canonical string signs `expires_b36` as given; `from_b36` accepted only the
        // canonical form, so it equals `to_b36(expires)`.
        let expected = sign_with(key, sandbox_id, port, expires_b36);
        if !constant_time_eq(expected.as_bytes(), sig.as_bytes()) {
            return Err(RouteError::BadSignature);
        }
        if now_unix > expires {
            return Err(RouteError::Expired { expires });
        }
        if expires - now_unix > max_lifetime_secs {
            return Err(RouteError::TooFarAhead {
                expires,
                max_secs: max_lifetime_secs,
            });
        }
        Ok(expires)
    }

    /// The keys, oldest first (for the key file).
    pub(crate) fn keys(&self) -> &[RouteKey] {
        &self.keys
    }

    fn signing(&self) -> &RouteKey {
        self.keys.last().expect("a signer holds at least one key")
    }

    fn key(&self, key_id: char) -> Option<&RouteKey> {
        self.keys.iter().find(|k| k.id == key_id)
    }
}

/// The signature of `canon`'s fields with `key`: the first 8 hex digits of the OSEP-0011
/// digest, then the key id.
fn sign_with(key: &RouteKey, sandbox_id: &str, port: u16, expires_b36: &str) -> String {
    let canon = format!("v1\nshort\n{sandbox_id}\n{port}\n{expires_b36}\n");
    let digest = Sha256::new()
        .chain_update(be32_len(key.secret.len()))
        .chain_update(&key.secret)
        .chain_update(be32_len(canon.len()))
        .chain_update(canon.as_bytes())
        .finalize();
    let mut sig = hex::encode(&digest[..SIG_HEX_LEN / 2]);
    sig.push(key.id);
    sig
}

impl fmt::Debug for RouteSigner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RouteSigner")
            .field("key_ids", &self.key_ids())
            .finish_non_exhaustive()
    }
}

/// Whether `c` may name a key: one of `0-9a-z`.
pub(crate) fn is_key_id(c: char) -> bool {
    matches!(c, '0'..='9' | 'a'..='z')
}

/// The key id of a signature-shaped string: 8 lowercase hex digits and a key id.
pub(crate) fn sig_key_id(sig: &str) -> Option<char> {
    let (hex, key_id) = sig.split_at_checked(SIG_HEX_LEN)?;
    let mut rest = key_id.chars();
    let key_id = rest.next().filter(|&c| is_key_id(c))?;
    let hex_ok = hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    (hex_ok && rest.next().is_none()).then_some(key_id)
}

/// A length as the 32-bit big-endian prefix of the digest input.
///
/// Secrets are capped at 4096 bytes and sandbox ids come from URL paths, so lengths never
/// reach 4 GiB; saturating keeps this total without a panic path.
fn be32_len(len: usize) -> [u8; 4] {
    u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes()
}

/// Compares two byte strings in time independent of where they differ.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {

    #[test]
    fn derived_keys_verify_their_own_routes_only() {
        let base = RouteSigner::with_keys(vec![('0', vec![7; 32]), ('1', vec![9; 32])]).unwrap();
        let (a, b) = (base.derive("n1"), base.derive("n2"));
        assert_eq!(a.key_ids(), base.key_ids());
        assert_eq!(
            a.file_text(),
            base.derive("n1").file_text(),
            "deterministic"
        );
        let sig = a.sign("sbx", 8080, 4_000_000_000);
        assert!(
            a.verify("sbx", 8080, &to_b36(4_000_000_000), &sig, 0)
                .is_ok()
        );
        for other in [&base, &b] {
            assert!(
                other
                    .verify("sbx", 8080, &to_b36(4_000_000_000), &sig, 0)
                    .is_err()
            );
        }
        assert_ne!(a.file_text(), base.file_text());
    }

    use super::*;

    const SECRET: &[u8] = b"fastbox-test-secret";
    const ID: &str = "sbx-123";
    const PORT: u16 = 8080;
    /// 1_700_000_000 in base 36.
    const EXPIRES: u64 = 1_700_000_000;
    const EXPIRES_B36: &str = "s44we8";
    /// Computed with Python's hashlib from the OSEP-0011 definition.
    const KNOWN_SIG: &str = "9363e73ek";

    fn signer() -> RouteSigner {
        RouteSigner::try_new('k', SECRET.to_vec()).unwrap()
    }

    /// The OSEP-0011 signature, written out from the definition rather than the code under test.
    fn reference_sig(secret: &[u8], canon: &str, key_id: char) -> String {
        let mut input = Vec::new();
        input.extend_from_slice(&(secret.len() as u32).to_be_bytes());
        input.extend_from_slice(secret);
        input.extend_from_slice(&(canon.len() as u32).to_be_bytes());
        input.extend_from_slice(canon.as_bytes());
        let digest = Sha256::digest(&input);
        format!("{}{key_id}", &hex::encode(digest)[..8])
    }

    #[test]
    fn sign_matches_known_vector() {
        let canon = "v1\nshort\nsbx-123\n8080\ns44we8\n";
        assert_eq!(reference_sig(SECRET, canon, 'k'), KNOWN_SIG);
        assert_eq!(signer().sign(ID, PORT, EXPIRES), KNOWN_SIG);
    }

    #[test]
    fn verify_accepts_known_vector_until_expiry() {
        let s = signer();
        assert_eq!(
            s.verify(ID, PORT, EXPIRES_B36, KNOWN_SIG, 0).unwrap(),
            EXPIRES
        );
        assert_eq!(
            s.verify(ID, PORT, EXPIRES_B36, KNOWN_SIG, EXPIRES).unwrap(),
            EXPIRES
        );
        assert!(matches!(
            s.verify(ID, PORT, EXPIRES_B36, KNOWN_SIG, EXPIRES + 1),
            Err(RouteError::Expired { expires: EXPIRES })
        ));
    }

    #[test]
    fn verify_rejects_tampering_with_each_field() {
        let s = signer();
        let other = RouteSigner::try_new('k', b"another-secret-16b".to_vec()).unwrap();
        let now = EXPIRES - 10;
        for result in [
            s.verify("sbx-124", PORT, EXPIRES_B36, KNOWN_SIG, now),
            s.verify(ID, 8081, EXPIRES_B36, KNOWN_SIG, now),
            s.verify(ID, PORT, "s44we9", KNOWN_SIG, now),
            s.verify(ID, PORT, EXPIRES_B36, "9363e73fk", now),
            other.verify(ID, PORT, EXPIRES_B36, KNOWN_SIG, now),
            // Expired and tampered: the signature is what is reported.
            s.verify(ID, PORT, "s44we9", KNOWN_SIG, u64::MAX),
        ] {
            assert!(
                matches!(result, Err(RouteError::BadSignature)),
                "{result:?}"
            );
        }
    }

    #[test]
    fn verify_rejects_other_key_ids() {
        assert!(matches!(
            signer().verify(ID, PORT, EXPIRES_B36, "9363e73ea", 0),
            Err(RouteError::UnknownKey('a'))
        ));
        let same_secret_other_id = RouteSigner::try_new('a', SECRET.to_vec()).unwrap();
        assert!(matches!(
            same_secret_other_id.verify(ID, PORT, EXPIRES_B36, KNOWN_SIG, 0),
            Err(RouteError::UnknownKey('k'))
        ));
    }

    #[test]
    fn verify_rejects_malformed_credentials() {
        let s = signer();
        for (expires, sig) in [
            ("", KNOWN_SIG),
            ("S44WE8", KNOWN_SIG),
            ("0s44we8", KNOWN_SIG),
            (EXPIRES_B36, ""),
            (EXPIRES_B36, "9363e73e"),
            (EXPIRES_B36, "9363e73ekk"),
            (EXPIRES_B36, "9363e73eK"),
            (EXPIRES_B36, "9363e73é"),
            (EXPIRES_B36, "9363E73Ek"),
            (EXPIRES_B36, "zzzzzzzzk"),
        ] {
            let result = s.verify(ID, PORT, expires, sig, 0);
            assert!(
                matches!(result, Err(RouteError::Malformed)),
                "{expires:?} {sig:?}: {result:?}"
            );
        }
    }

    #[test]
    fn try_new_validates_key_id_and_secret() {
        assert!(matches!(
            RouteSigner::try_new('A', SECRET.to_vec()),
            Err(RouteError::InvalidKeyId('A'))
        ));
        assert!(matches!(
            RouteSigner::try_new('-', SECRET.to_vec()),
            Err(RouteError::InvalidKeyId('-'))
        ));
        assert!(matches!(
            RouteSigner::try_new('a', vec![0; 15]),
            Err(RouteError::InvalidSecretLength(15))
        ));
        assert_eq!(
            RouteSigner::try_new('z', vec![0; 16]).unwrap().key_id(),
            'z'
        );
    }

    #[test]
    fn two_keys_verify_by_key_id_and_the_newest_signs() {
        let old = signer();
        let new = RouteSigner::try_new('m', b"the-next-route-secret".to_vec()).unwrap();
        let both = RouteSigner::with_keys(vec![
            ('k', SECRET.to_vec()),
            ('m', b"the-next-route-secret".to_vec()),
        ])
        .unwrap();
        assert_eq!(both.key_id(), 'm');
        assert_eq!(both.key_ids(), vec!['k', 'm']);
        assert!(both.holds('k') && both.holds('m') && !both.holds('a'));
        // New routes are signed with the newest key, byte for byte as that key alone signs.
        let fresh = both.sign(ID, PORT, EXPIRES);
        assert_eq!(fresh, new.sign(ID, PORT, EXPIRES));
        assert!(fresh.ends_with('m'));
        // Routes of either key verify, each with its own secret.
        let now = EXPIRES - 10;
        assert_eq!(
            both.verify(ID, PORT, EXPIRES_B36, KNOWN_SIG, now).unwrap(),
            EXPIRES
        );
        assert_eq!(
            both.verify(ID, PORT, EXPIRES_B36, &fresh, now).unwrap(),
            EXPIRES
        );
        // The key id selects the secret: an old signature relabelled as the new key's, or
        // the other way round, is a mismatch.
        let relabelled = format!("{}m", &KNOWN_SIG[..8]);
        assert!(matches!(
            both.verify(ID, PORT, EXPIRES_B36, &relabelled, now),
            Err(RouteError::BadSignature)
        ));
        let relabelled = format!("{}k", &fresh[..8]);
        assert!(matches!(
            both.verify(ID, PORT, EXPIRES_B36, &relabelled, now),
            Err(RouteError::BadSignature)
        ));
        // Once the old key is gone, its routes name an unknown key.
        assert!(matches!(
            new.verify(ID, PORT, EXPIRES_B36, KNOWN_SIG, now),
            Err(RouteError::UnknownKey('k'))
        ));
        assert_eq!(
            old.verify(ID, PORT, EXPIRES_B36, KNOWN_SIG, now).unwrap(),
            EXPIRES
        );
    }

    #[test]
    fn keyrings_need_distinct_valid_keys() {
        assert!(matches!(
            RouteSigner::with_keys(vec![]),
            Err(RouteError::NoKeys)
        ));
        assert!(matches!(
            RouteSigner::with_keys(vec![('a', vec![1; 16]), ('a', vec![2; 16])]),
            Err(RouteError::DuplicateKeyId('a'))
        ));
        assert!(matches!(
            RouteSigner::with_keys(vec![('a', vec![1; 16]), ('B', vec![2; 16])]),
            Err(RouteError::InvalidKeyId('B'))
        ));
        assert!(matches!(
            RouteSigner::with_keys(vec![('a', vec![1; 16]), ('b', vec![2; 8])]),
            Err(RouteError::InvalidSecretLength(8))
        ));
    }

    #[test]
    fn expiry_beyond_the_bound_is_refused() {
        let s = signer();
        let day = 86_400;
        // Exactly at the bound: accepted; one second beyond: refused, after the signature.
        assert_eq!(
            s.verify_bounded(ID, PORT, EXPIRES_B36, KNOWN_SIG, EXPIRES - day, day)
                .unwrap(),
            EXPIRES
        );
        assert!(matches!(
            s.verify_bounded(ID, PORT, EXPIRES_B36, KNOWN_SIG, EXPIRES - day - 1, day),
            Err(RouteError::TooFarAhead {
                expires: EXPIRES,
                max_secs: 86_400
            })
        ));
        // A forged credential far ahead is reported as what it is: a bad signature.
        assert!(matches!(
            s.verify_bounded(ID, PORT, "zzzzzz", KNOWN_SIG, 0, day),
            Err(RouteError::BadSignature)
        ));
        // Without a bound (verify), any future expiry is fine.
        assert!(s.verify(ID, PORT, EXPIRES_B36, KNOWN_SIG, 0).is_ok());
    }

    #[test]
    fn debug_hides_the_secret() {
        let shown = format!("{:?}", signer());
        assert!(shown.contains("'k'"), "{shown}");
        assert!(!shown.contains("fastbox"), "{shown}");
    }
}
