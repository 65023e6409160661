//! Metadata keys and values follow Kubernetes label rules (the reference server checks them
//! the same way); the `opensandbox.io/` prefix is reserved.

/// Prefix reserved for the platform's own labels.
pub const RESERVED_PREFIX: &str = "opensandbox.io/";

/// At most this many metadata entries per sandbox.
pub const MAX_ENTRIES: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LabelError {
    #[error("metadata has {0} entries; at most {MAX_ENTRIES} are allowed")]
    TooMany(usize),
    #[error("metadata key {key:?}: {why}")]
    Key { key: String, why: &'static str },
    #[error("metadata value {value:?} of key {key:?}: {why}")]
    Value {
        key: String,
        value: String,
        why: &'static str,
    },
}

/// Checks every entry of `metadata`.
pub fn validate<'a>(
    metadata: impl ExactSizeIterator<Item = (&'a String, &'a String)>,
) -> Result<(), LabelError> {
    if metadata.len() > MAX_ENTRIES {
        return Err(LabelError::TooMany(metadata.len()));
    }
    for (key, value) in metadata {
        validate_key(key).map_err(|why| LabelError::Key {
            key: key.clone(),
            why,
        })?;
        validate_value(value).map_err(|why| LabelError::Value {
            key: key.clone(),
            value: value.clone(),
            why,
        })?;
    }
    Ok(())
}

fn validate_key(key: &str) -> Result<(), &'static str> {
    if key.starts_with(RESERVED_PREFIX) {
        return Err("the opensandbox.io/ prefix is reserved");
    }
    let name = match key.split_once('/') {
        Some((prefix, name)) => {
            validate_dns_subdomain(prefix)?;
            name
        }
        None => key,
    };
    if name.is_empty() {
        return Err("the name part must not be empty");
    }
    validate_name(name)
}

fn validate_value(value: &str) -> Result<(), &'static str> {
    if value.is_empty() {
        return Ok(());
    }
    validate_name(value)
}

/// A label name or value: at most 63 characters, alphanumerics at both ends, `-`, `_`, `.`
/// and alphanumerics between.
fn validate_name(s: &str) -> Result<(), &'static str> {
    if s.len() > 63 {
        return Err("must be at most 63 characters");
    }
    let b = s.as_bytes();
    if !b[0].is_ascii_alphanumeric() || !b[b.len() - 1].is_ascii_alphanumeric() {
        return Err("must begin and end with a letter or digit");
    }
    if !b
        .iter()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
    {
        return Err("may contain only letters, digits, '-', '_' and '.'");
    }
    Ok(())
}

/// A DNS subdomain (RFC 1123): at most 253 characters, dot-separated lowercase labels.
fn validate_dns_subdomain(s: &str) -> Result<(), &'static str> {
    const WHY: &str = "the prefix must be a lowercase DNS subdomain of at most 253 characters";
    if s.is_empty() || s.len() > 253 {
        return Err(WHY);
    }
    for label in s.split('.') {
        let b = label.as_bytes();
        let ok = !b.is_empty()
            && b.len() <= 63
            && b.iter()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
            && b[0] != b'-'
            && b[b.len() - 1] != b'-';
        if !ok {
            return Err(WHY);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn check(pairs: &[(&str, &str)]) -> Result<(), LabelError> {
        let m: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        validate(m.iter())
    }

    #[test]
    fn kubernetes_label_rules() {
        check(&[("app", "web"), ("example.com/team", "a-b_c.d"), ("k", "")]).unwrap();
        assert!(matches!(
            check(&[("bad key", "v")]),
            Err(LabelError::Key { .. })
        ));
        assert!(matches!(check(&[("-k", "v")]), Err(LabelError::Key { .. })));
        assert!(matches!(
            check(&[("Ex.com/k", "v")]),
            Err(LabelError::Key { .. })
        ));
        assert!(matches!(check(&[("a/", "v")]), Err(LabelError::Key { .. })));
        assert!(matches!(
            check(&[("opensandbox.io/x", "v")]),
            Err(LabelError::Key { .. })
        ));
        let long = "v".repeat(64);
        assert!(matches!(
            check(&[("k", &long)]),
            Err(LabelError::Value { .. })
        ));
        assert!(matches!(
            check(&[("k", "a b")]),
            Err(LabelError::Value { .. })
        ));
        check(&[("k", &"v".repeat(63))]).unwrap();
    }

    #[test]
    fn too_many_entries() {
        let m: BTreeMap<String, String> = (0..65)
            .map(|i| (format!("k{i}"), "v".to_string()))
            .collect();
        assert_eq!(validate(m.iter()), Err(LabelError::TooMany(65)));
    }
}
