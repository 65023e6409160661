//! The access token of a `secureAccess` sandbox.
//!
//! 32 bytes from getrandom(2), written as URL-safe base64 without padding (43 characters), so
//! it fits an HTTP header as it is. A presented value is compared by hashing both sides with
//! SHA-256 and comparing the digests in constant time: neither where the values differ nor
//! their lengths show in the time taken. `Debug` never shows the token.

use std::fmt;

use sha2::{Digest, Sha256};

/// The header that carries a secure sandbox's access token (OpenSandbox's name for it).
pub const SECURE_ACCESS_HEADER: &str = "OpenSandbox-Secure-Access";

/// Random bytes of a generated token.
const TOKEN_BYTES: usize = 32;

/// A sandbox's access token.
#[derive(Clone)]
pub struct AccessToken(String);

impl AccessToken {
    /// A new token: 32 bytes from getrandom(2), URL-safe base64 without padding.
    pub fn generate() -> Result<Self, getrandom::Error> {
        let mut bytes = [0u8; TOKEN_BYTES];
        getrandom::fill(&mut bytes)?;
        Ok(Self(base64_url(&bytes)))
    }

    /// A token as it was recorded.
    pub fn from_recorded(token: String) -> Self {
        Self(token)
    }

    /// The token's text, to hand out in an endpoint's headers (and to record).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether `presented` is this token, in time independent of where they differ and of
    /// their lengths. An empty token matches nothing.
    pub fn matches(&self, presented: &[u8]) -> bool {
        if self.0.is_empty() {
            return false;
        }
        let expected = Sha256::digest(self.0.as_bytes());
        let given = Sha256::digest(presented);
        expected
            .iter()
            .zip(given.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

impl fmt::Debug for AccessToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AccessToken(<redacted>)")
    }
}

/// URL-safe base64 (RFC 4648 §5) without padding.
fn base64_url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |acc, (i, &b)| acc | u32::from(b) << (16 - 8 * i));
        // 2, 3 or 4 characters for 1, 2 or 3 bytes.
        for i in 0..=chunk.len() {
            let index = (n >> (18 - 6 * i)) & 0x3f;
            out.push(char::from(ALPHABET[index as usize]));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc_4648_vectors() {
        // RFC 4648 §10, without padding; the URL-safe alphabet's two differing characters.
        for (input, expected) in [
            (&b""[..], ""),
            (b"f", "Zg"),
            (b"fo", "Zm8"),
            (b"foo", "Zm9v"),
            (b"foob", "Zm9vYg"),
            (b"fooba", "Zm9vYmE"),
            (b"foobar", "Zm9vYmFy"),
            (&[0xfb, 0xff], "-_8"),
        ] {
            assert_eq!(base64_url(input), expected, "{input:?}");
        }
    }

    #[test]
    fn generated_tokens_are_43_url_safe_characters_and_differ() {
        let a = AccessToken::generate().unwrap();
        let b = AccessToken::generate().unwrap();
        assert_eq!(a.expose().len(), 43);
        assert!(
            a.expose()
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_'),
            "{}",
            a.expose()
        );
        assert_ne!(a.expose(), b.expose());
    }

    #[test]
    fn only_the_token_itself_matches() {
        let token = AccessToken::generate().unwrap();
        let text = token.expose().to_string();
        assert!(token.matches(text.as_bytes()));
        let mut flipped = text.clone().into_bytes();
        flipped[42] = if flipped[42] == b'A' { b'B' } else { b'A' };
        for wrong in [
            &b""[..],
            &flipped,
            &text.as_bytes()[..42],
            format!("{text}x").as_bytes(),
            text.to_uppercase().as_bytes(),
            AccessToken::generate().unwrap().expose().as_bytes(),
        ] {
            assert!(!token.matches(wrong), "{wrong:?}");
        }
        let recorded = AccessToken::from_recorded(text.clone());
        assert!(recorded.matches(text.as_bytes()));
        assert!(!AccessToken::from_recorded(String::new()).matches(b""));
    }

    #[test]
    fn debug_hides_the_token() {
        let token = AccessToken::generate().unwrap();
        let shown = format!("{token:?}");
        assert!(!shown.contains(token.expose()), "{shown}");
    }
}
