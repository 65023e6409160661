//! `WWW-Authenticate` challenges (RFC 7235) as registries send them:
//! `Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull"`.

use std::collections::BTreeMap;

/// One challenge: a lower-cased scheme and its parameters (keys lower-cased).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    pub scheme: String,
    pub params: BTreeMap<String, String>,
}

/// Parses every challenge of a header value; malformed trailing parts are ignored.
pub fn parse_challenges(header: &str) -> Vec<Challenge> {
    let bytes = header.as_bytes();
    let mut out: Vec<Challenge> = Vec::new();
    let mut i = 0;
    loop {
        while i < bytes.len() && (bytes[i].is_ascii_whitespace() || bytes[i] == b',') {
            i += 1;
        }
        if i >= bytes.len() {
            break;
        }
        let start = i;
        while i < bytes.len()
            && !bytes[i].is_ascii_whitespace()
            && bytes[i] != b','
            && bytes[i] != b'='
        {
            i += 1;
        }
        let token = &header[start..i];
        let mut j = i;
        while j < bytes.len() && bytes[j].is_ascii_whitespace() {
            j += 1;
        }
        if j < bytes.len() && bytes[j] == b'=' && !token.is_empty() {
            // key=value of the current challenge
            i = j + 1;
            while i < bytes.len() && bytes[i].is_ascii_whitespace() {
                i += 1;
            }
            let mut value = String::new();
            if i < bytes.len() && bytes[i] == b'"' {
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    if bytes[i] == b'\\' && i + 1 < bytes.len() {
                        i += 1;
                    }
                    let ch = header[i..].chars().next().unwrap_or('\u{fffd}');
                    value.push(ch);
                    i += ch.len_utf8();
                }
                i += 1; // closing quote
            } else {
                let vstart = i;
                while i < bytes.len() && bytes[i] != b',' && !bytes[i].is_ascii_whitespace() {
                    i += 1;
                }
                value.push_str(&header[vstart..i]);
            }
            if let Some(current) = out.last_mut() {
                current.params.insert(token.to_ascii_lowercase(), value);
            }
        } else if !token.is_empty() {
            out.push(Challenge {
                scheme: token.to_ascii_lowercase(),
                params: BTreeMap::new(),
            });
        } else {
            i += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_challenge_with_quoted_commas() {
        let c = parse_challenges(
            r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:samalba/my-app:pull,push""#,
        );
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].scheme, "bearer");
        assert_eq!(c[0].params["realm"], "https://auth.example/token");
        assert_eq!(c[0].params["service"], "registry.example");
        assert_eq!(c[0].params["scope"], "repository:samalba/my-app:pull,push");
    }

    #[test]
    fn basic_challenge_and_several_challenges() {
        let c = parse_challenges(r#"Basic realm="basic-realm""#);
        assert_eq!(
            (c[0].scheme.as_str(), c[0].params["realm"].as_str()),
            ("basic", "basic-realm")
        );
        let c = parse_challenges(
            r#"Basic realm="a", Bearer realm="https://t/x", error="insufficient_scope""#,
        );
        assert_eq!(c.len(), 2);
        assert_eq!(c[1].scheme, "bearer");
        assert_eq!(c[1].params["error"], "insufficient_scope");
    }

    #[test]
    fn unquoted_values_escapes_and_odd_spacing() {
        let c =
            parse_challenges(r#"  BEARER  Realm = https://t/x , service=svc, note="a \"q\" b""#);
        assert_eq!(c[0].scheme, "bearer");
        assert_eq!(c[0].params["realm"], "https://t/x");
        assert_eq!(c[0].params["service"], "svc");
        assert_eq!(c[0].params["note"], r#"a "q" b"#);
        assert!(parse_challenges("").is_empty());
        assert_eq!(parse_challenges("Bearer realm=\"unterminated").len(), 1);
    }
}
