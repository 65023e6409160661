//! Content digests: blake3, written as 64 lowercase hex digits.
//!
//! Blocks and manifests are named by the digest of their bytes. The hex form is the only
//! spelling accepted on the way in (no upper case, no prefix), so one content has exactly one
//! name in every store.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Length of a digest in bytes.
const DIGEST_LEN: usize = 32;

/// Why a string is not a digest.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DigestError {
    /// Wrong number of characters.
    #[error("digest {0:?} is not 64 hex digits")]
    Length(String),
    /// A character outside `0-9a-f`.
    #[error("digest {0:?} is not lowercase hex")]
    NotLowercaseHex(String),
}

/// The blake3 digest of some bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest([u8; DIGEST_LEN]);

impl Digest {
    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Digest(*blake3::hash(bytes).as_bytes())
    }

    /// Parse 64 lowercase hex digits.
    pub fn from_hex(text: &str) -> Result<Self, DigestError> {
        if text.len() != DIGEST_LEN * 2 {
            return Err(DigestError::Length(text.to_string()));
        }
        if !text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(DigestError::NotLowercaseHex(text.to_string()));
        }
        let mut bytes = [0u8; DIGEST_LEN];
        hex::decode_to_slice(text, &mut bytes)
            .map_err(|_| DigestError::NotLowercaseHex(text.to_string()))?;
        Ok(Digest(bytes))
    }

    /// The 64 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// The raw 32 bytes.
    pub fn as_bytes(&self) -> &[u8; DIGEST_LEN] {
        &self.0
    }
}

impl From<blake3::Hash> for Digest {
    fn from(hash: blake3::Hash) -> Self {
        Digest(*hash.as_bytes())
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({self})")
    }
}

impl FromStr for Digest {
    type Err = DigestError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Digest::from_hex(s)
    }
}

impl Serialize for Digest {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for Digest {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Digest::from_hex(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_matches_blake3() {
        let digest = Digest::of(b"hello");
        assert_eq!(digest.to_hex(), blake3::hash(b"hello").to_hex().as_str());
        assert_eq!(Digest::from_hex(&digest.to_hex()), Ok(digest));
    }

    #[test]
    fn only_lowercase_hex_of_the_right_length_parses() {
        let hex = Digest::of(b"x").to_hex();
        assert!(matches!(
            Digest::from_hex(&hex.to_uppercase()),
            Err(DigestError::NotLowercaseHex(_))
        ));
        assert!(matches!(
            Digest::from_hex(&hex[1..]),
            Err(DigestError::Length(_))
        ));
        assert!(matches!(
            Digest::from_hex(&format!("g{}", &hex[1..])),
            Err(DigestError::NotLowercaseHex(_))
        ));
    }

    #[test]
    fn serializes_as_a_hex_string() {
        let digest = Digest::of(b"y");
        let json = serde_json::to_string(&digest).unwrap();
        assert_eq!(json, format!("\"{digest}\""));
        assert_eq!(serde_json::from_str::<Digest>(&json).unwrap(), digest);
    }
}
