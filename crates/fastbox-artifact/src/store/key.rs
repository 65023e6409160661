//! Index keys: the names artifacts are found by (an image reference, a template id).
//!
//! A key is any short string without control characters. Stores that keep keys in file or
//! object names use [`IndexKey::escaped`]: `[A-Za-z0-9._-]` stay, every other byte (and a
//! leading `.`, so no key is `.`, `..` or hidden) becomes `%XX`; the escaping is reversible.

use std::fmt;

/// The longest key, in bytes: escaped, it still fits a file name (255 bytes) for typical
/// image references.
pub const MAX_KEY_LEN: usize = 200;

/// Why a string is not an index key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexKeyError {
    /// Empty.
    #[error("index key is empty")]
    Empty,
    /// Longer than [`MAX_KEY_LEN`].
    #[error("index key {0:?} is longer than {MAX_KEY_LEN} bytes")]
    TooLong(String),
    /// Escaped, longer than a file name may be.
    #[error("index key {0:?} is longer than 255 bytes once escaped")]
    EscapedTooLong(String),
    /// Contains a control character.
    #[error("index key {0:?} contains a control character")]
    Control(String),
    /// Not a valid escaped key.
    #[error("{0:?} is not an escaped index key")]
    BadEscape(String),
}

/// A validated index key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IndexKey(String);

impl IndexKey {
    /// Validate a key.
    pub fn try_new(key: impl Into<String>) -> Result<Self, IndexKeyError> {
        let key = key.into();
        if key.is_empty() {
            return Err(IndexKeyError::Empty);
        }
        if key.len() > MAX_KEY_LEN {
            return Err(IndexKeyError::TooLong(key));
        }
        if key.chars().any(char::is_control) {
            return Err(IndexKeyError::Control(key));
        }
        let parsed = IndexKey(key);
        if parsed.escaped().len() > 255 {
            return Err(IndexKeyError::EscapedTooLong(parsed.0));
        }
        Ok(parsed)
    }

    /// The key as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key as a file or object name (see the module docs).
    pub fn escaped(&self) -> String {
        let mut out = String::with_capacity(self.0.len());
        for (i, byte) in self.0.bytes().enumerate() {
            let plain = byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.');
            if plain && !(i == 0 && byte == b'.') {
                out.push(byte as char);
            } else {
                out.push_str(&format!("%{byte:02X}"));
            }
        }
        out
    }

    /// The key an escaped name stands for; only names [`IndexKey::escaped`] produces parse.
    pub fn from_escaped(name: &str) -> Result<Self, IndexKeyError> {
        let bad = || IndexKeyError::BadEscape(name.to_string());
        let mut bytes = Vec::with_capacity(name.len());
        let mut rest = name.as_bytes();
        while let Some((&first, tail)) = rest.split_first() {
            if first == b'%' {
                let hex = tail.get(..2).ok_or_else(bad)?;
                let hex = std::str::from_utf8(hex).map_err(|_| bad())?;
                bytes.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
                rest = &tail[2..];
            } else {
                bytes.push(first);
                rest = tail;
            }
        }
        let key = IndexKey::try_new(String::from_utf8(bytes).map_err(|_| bad())?)?;
        if key.escaped() != name {
            return Err(bad());
        }
        Ok(key)
    }
}

impl fmt::Display for IndexKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_reversibly_into_a_safe_file_name() {
        for raw in [
            "docker.io/library/python:3.12",
            "template/ab-12_x",
            ".hidden",
            "..",
            "%41",
            "ünïcode",
            "registry:5000/a@sha256:0123",
        ] {
            let key = IndexKey::try_new(raw).unwrap();
            let name = key.escaped();
            assert!(!name.contains('/') && !name.starts_with('.'), "{name}");
            assert_eq!(IndexKey::from_escaped(&name).unwrap(), key);
        }
        assert_eq!(
            IndexKey::try_new("python:3.12").unwrap().escaped(),
            "python%3A3.12"
        );
    }

    #[test]
    fn rejects_empty_long_and_control_keys() {
        assert_eq!(IndexKey::try_new(""), Err(IndexKeyError::Empty));
        assert!(matches!(
            IndexKey::try_new("x".repeat(MAX_KEY_LEN + 1)),
            Err(IndexKeyError::TooLong(_))
        ));
        assert!(matches!(
            IndexKey::try_new("/".repeat(100)),
            Err(IndexKeyError::EscapedTooLong(_))
        ));
        assert!(matches!(
            IndexKey::try_new("a\nb"),
            Err(IndexKeyError::Control(_))
        ));
    }

    #[test]
    fn only_canonical_escapes_parse() {
        assert!(IndexKey::from_escaped("a%2").is_err());
        assert!(
            IndexKey::from_escaped("%61").is_err(),
            "'a' must not be escaped"
        );
        assert!(
            IndexKey::from_escaped("a%3a").is_err(),
            "escapes are upper case"
        );
        assert!(IndexKey::from_escaped(".tmp").is_err());
    }
}
