//! [`Credential`]: the bearer token of the node and control routes, and the check every route
//! makes.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use http::{HeaderValue, StatusCode};

use super::http_util::envelope;
use super::{CREDENTIAL_HEADER, REFUSAL_HEADER};

/// Random bytes of a credential.
const BYTES: usize = 32;

/// A bearer token: 32 bytes from getrandom(2), written as 64 lowercase hex digits. Whoever
/// presents it may call the routes it guards. `Display` writes it (to hand it to the other
/// side); `Debug` never shows it.
#[derive(Clone)]
pub struct Credential(String);

/// A text that is not a credential (it is not repeated: it may be a mistyped secret).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a credential is {} hexadecimal digits (256 bits)", BYTES * 2)]
pub struct CredentialError;

impl Credential {
    /// A new credential from getrandom(2).
    pub fn generate() -> Result<Self, getrandom::Error> {
        let mut bytes = [0u8; BYTES];
        getrandom::fill(&mut bytes)?;
        Ok(Self(hex::encode(bytes)))
    }

    /// Whether `presented` is this credential, in time independent of where they differ
    /// (the length is public: always 64).
    pub fn matches(&self, presented: &[u8]) -> bool {
        let expected = self.0.as_bytes();
        expected.len() == presented.len()
            && expected
                .iter()
                .zip(presented)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }

    /// The header value that presents it (marked sensitive).
    pub(super) fn header_value(&self) -> HeaderValue {
        let mut value = HeaderValue::from_str(&self.0).expect("hex digits");
        value.set_sensitive(true);
        value
    }
}

impl FromStr for Credential {
    type Err = CredentialError;

    /// 64 hex digits, either case, surrounding white space ignored (a credential file's
    /// newline).
    fn from_str(text: &str) -> Result<Self, CredentialError> {
        let text = text.trim();
        if text.len() != BYTES * 2 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(CredentialError);
        }
        Ok(Self(text.to_ascii_lowercase()))
    }
}

impl fmt::Display for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Credential(<redacted>)")
    }
}

/// The SHA-256 of a credential: what a side that checks a credential keeps instead of it.
/// `Debug` shows nothing of it.
#[derive(Clone)]
pub struct CredentialDigest([u8; 32]);

impl CredentialDigest {
    /// The digest of the bytes presented (a header's value).
    pub fn of(presented: &[u8]) -> Self {
        use sha2::Digest;
        Self(sha2::Sha256::digest(presented).into())
    }

    /// Whether both are the same, in time independent of where they differ.
    pub fn matches(&self, other: &Self) -> bool {
        self.0
            .iter()
            .zip(&other.0)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// 64 hex digits, as [`CredentialDigest::to_hex`] wrote them.
    pub fn from_hex(text: &str) -> Option<Self> {
        Some(Self(hex::decode(text).ok()?.try_into().ok()?))
    }
}

impl fmt::Debug for CredentialDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CredentialDigest(..)")
    }
}

impl Credential {
    /// Its digest.
    pub fn digest(&self) -> CredentialDigest {
        CredentialDigest::of(self.0.as_bytes())
    }
}

/// The check in front of every route: a request without `credential` never reaches a
/// handler.
pub(super) async fn require(
    State(credential): State<Arc<Credential>>,
    req: Request,
    next: Next,
) -> Response {
    let mut refused = match req.headers().get(CREDENTIAL_HEADER) {
        Some(value) if credential.matches(value.as_bytes()) => return next.run(req).await,
        Some(_) => envelope(
            StatusCode::UNAUTHORIZED,
            "INVALID_CREDENTIAL",
            "wrong credential in X-Fastbox-Credential",
        ),
        None => envelope(
            StatusCode::UNAUTHORIZED,
            "MISSING_CREDENTIAL",
            "this route needs a credential in X-Fastbox-Credential",
        ),
    };
    // Not the sandbox's answer, on the proxy route.
    refused
        .headers_mut()
        .insert(REFUSAL_HEADER, HeaderValue::from_static("1"));
    refused
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_credentials_are_64_hex_digits_and_differ() {
        let a = Credential::generate().unwrap();
        let b = Credential::generate().unwrap();
        let text = a.to_string();
        assert_eq!(text.len(), 64);
        assert!(
            text.bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
        );
        assert_ne!(text, b.to_string());
    }

    #[test]
    fn credentials_parse_back_and_only_themselves_match() {
        let a = Credential::generate().unwrap();
        let text = a.to_string();
        let parsed: Credential = format!(" {}\n", text.to_uppercase()).parse().unwrap();
        assert!(parsed.matches(text.as_bytes()));
        assert!(a.matches(parsed.to_string().as_bytes()));
        let mut flipped = text.clone().into_bytes();
        flipped[63] = if flipped[63] == b'0' { b'1' } else { b'0' };
        for wrong in [
            &b""[..],
            &flipped,
            &text.as_bytes()[..63],
            format!("{text}0").as_bytes(),
            text.to_uppercase().as_bytes(),
            Credential::generate().unwrap().to_string().as_bytes(),
        ] {
            assert!(!a.matches(wrong), "{wrong:?}");
        }
        for bad in ["", "abc", &text[..63], &format!("{}g", &text[..63])] {
            let e = bad.parse::<Credential>().unwrap_err().to_string();
            assert!(e.contains("64 hexadecimal digits"), "{e}");
        }
    }

    #[test]
    fn debug_and_errors_never_show_the_secret() {
        let a = Credential::generate().unwrap();
        let text = a.to_string();
        assert_eq!(format!("{a:?}"), "Credential(<redacted>)");
        let e = format!("{}x", &text[..63])
            .parse::<Credential>()
            .unwrap_err();
        assert!(!format!("{e} {e:?}").contains(&text[..63]));
        assert!(a.header_value().is_sensitive());
    }
}
