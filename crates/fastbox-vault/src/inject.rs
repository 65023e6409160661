//! What a binding does to an outgoing request: its auth header set (any header of that name
//! the sandbox sent is dropped first), and its placeholders replaced by credential values in
//! the surfaces each names. Path and query values are percent-encoded, JSON bodies get the
//! value JSON-escaped, form bodies form-encoded; compressed and multipart bodies are left
//! as they are.

use crate::wire::{AuthSpec, Surface};
use crate::{Binding, Vault};

/// A request's head, as the proxy forwards it.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestHead {
    pub method: String,
    /// The path and query, as sent (`/v1/x?a=b`).
    pub target: String,
    pub headers: Vec<(String, String)>,
}

impl RequestHead {
    fn set(&mut self, name: &str, value: String) {
        self.headers.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
        self.headers.push((name.to_string(), value));
    }
}

/// Applies `binding`'s auth and its path, query and header substitutions to `head`.
/// Credentials the binding names are in `vault` (checked when the binding was made).
pub fn apply_head(vault: &Vault, binding: &Binding, head: &mut RequestHead) {
    let value = |name: &str| {
        vault
            .value(name)
            .map(|s| s.expose().to_string())
            .unwrap_or_default()
    };
    // Placeholders first: an auth value is never searched for placeholders.
    for s in binding.spec.auth.substitutions() {
        let replacement = value(&s.credential);
        for surface in &s.surfaces {
            match surface {
                Surface::Path | Surface::Query => {
                    let (path, query) = match head.target.split_once('?') {
                        Some((p, q)) => (p.to_string(), Some(q.to_string())),
                        None => (head.target.clone(), None),
                    };
                    let encoded = percent_encode(&replacement, false);
                    let (path, query) = match surface {
                        Surface::Path => (path.replace(&s.placeholder, &encoded), query),
                        _ => (path, query.map(|q| q.replace(&s.placeholder, &encoded))),
                    };
                    head.target = match query {
                        Some(q) => format!("{path}?{q}"),
                        None => path,
                    };
                }
                Surface::Header => {
                    for (name, v) in &mut head.headers {
                        if !name.eq_ignore_ascii_case("host") {
                            *v = v.replace(&s.placeholder, &replacement);
                        }
                    }
                }
                Surface::Body => {}
            }
        }
    }
    match &binding.spec.auth {
        AuthSpec::Bearer { credential, .. } => {
            head.set("Authorization", format!("Bearer {}", value(credential)))
        }
        AuthSpec::Basic { credential, .. } => {
            head.set("Authorization", format!("Basic {}", value(credential)))
        }
        AuthSpec::ApiKey {
            name, credential, ..
        } => head.set(name, value(credential)),
        AuthSpec::CustomHeaders { headers, .. } => {
            for h in headers {
                head.set(&h.name, value(&h.credential));
            }
        }
        AuthSpec::Passthrough { .. } => {}
    }
}

/// `body` with `binding`'s body substitutions made, by its content type; None when nothing
/// changed (no body substitution, no placeholder in it, or a body left as it is).
pub fn apply_body(
    vault: &Vault,
    binding: &Binding,
    content_type: Option<&str>,
    content_encoding: Option<&str>,
    body: &[u8],
) -> Option<Vec<u8>> {
    let subs: Vec<_> = binding
        .spec
        .auth
        .substitutions()
        .iter()
        .filter(|s| s.surfaces.contains(&Surface::Body))
        .collect();
    if subs.is_empty() || content_encoding.is_some_and(|e| !e.eq_ignore_ascii_case("identity")) {
        return None;
    }
    let media = content_type
        .and_then(|t| t.split(';').next())
        .map(|t| t.trim().to_ascii_lowercase())
        .unwrap_or_default();
    if media.starts_with("multipart/") {
        return None;
    }
    let mut text = String::from_utf8(body.to_vec()).ok()?;
    let mut changed = false;
    for s in subs {
        if !text.contains(&s.placeholder) {
            continue;
        }
        let raw = vault.value(&s.credential)?.expose();
        let encoded = match media.as_str() {
            m if m == "application/json" || m.ends_with("+json") => {
                let quoted = serde_json::to_string(raw).expect("a string serializes");
                quoted[1..quoted.len() - 1].to_string()
            }
            "application/x-www-form-urlencoded" => percent_encode(raw, true),
            _ => raw.to_string(),
        };
        text = text.replace(&s.placeholder, &encoded);
        changed = true;
    }
    changed.then(|| text.into_bytes())
}

/// Percent-encodes all but RFC 3986's unreserved characters; `form`: a space is `+`.
fn percent_encode(value: &str, form: bool) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                out.push(b as char)
            }
            b' ' if form => out.push('+'),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::RequestTarget;
    use crate::wire::CreateRequest;

    fn vault(auth: serde_json::Value) -> Vault {
        Vault::create(
            serde_json::from_value::<CreateRequest>(json!({
                "credentials": [
                    {"name": "tok", "source": {"type": "inline", "value": "t0k&n /+"}},
                    {"name": "b64", "source": {"type": "inline", "value": "dXNlcjpwYXNz"}}
                ],
                "bindings": [{"name": "b", "match": {"hosts": ["api.example.org"]}, "auth": auth}]
            }))
            .unwrap(),
        )
        .unwrap()
    }

    fn head(target: &str, headers: &[(&str, &str)]) -> RequestHead {
        RequestHead {
            method: "POST".into(),
            target: target.into(),
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
        }
    }

    fn applied(v: &Vault, mut h: RequestHead) -> RequestHead {
        let binding = v
            .binding_for(&RequestTarget {
                scheme: "https",
                host: "api.example.org",
                method: "POST",
                path: "/",
            })
            .expect("bound");
        apply_head(v, binding, &mut h);
        h
    }

    #[test]
    fn auth_headers_replace_what_the_sandbox_sent() {
        let v = vault(json!({"type": "bearer", "credential": "tok"}));
        let h = applied(
            &v,
            head("/", &[("authorization", "Bearer fake"), ("Accept", "*/*")]),
        );
        assert_eq!(
            h.headers,
            [
                ("Accept".to_string(), "*/*".to_string()),
                ("Authorization".to_string(), "Bearer t0k&n /+".to_string())
            ]
        );
        let v = vault(json!({"type": "basic", "credential": "b64"}));
        let h = applied(&v, head("/", &[]));
        assert_eq!(h.headers[0].1, "Basic dXNlcjpwYXNz");
        let v = vault(json!({"type": "apiKey", "name": "X-Api-Key", "credential": "tok"}));
        let h = applied(&v, head("/", &[("x-api-key", "placeholder")]));
        assert_eq!(
            h.headers,
            [("X-Api-Key".to_string(), "t0k&n /+".to_string())]
        );
        let v = vault(json!({"type": "customHeaders", "headers": [
            {"name": "X-A", "credential": "tok"}, {"name": "X-B", "credential": "b64"}]}));
        let h = applied(&v, head("/", &[]));
        assert_eq!(h.headers.len(), 2);
    }

    #[test]
    fn placeholders_are_replaced_where_the_binding_says_and_encoded_for_the_place() {
        let v = vault(json!({"type": "passthrough", "substitutions": [
            {"credential": "tok", "placeholder": "__TOKEN__", "in": ["path", "query", "header"]}
        ]}));
        let h = applied(
            &v,
            head(
                "/u/__TOKEN__/x?key=__TOKEN__",
                &[("X-Token", "v=__TOKEN__"), ("Host", "__TOKEN__")],
            ),
        );
        assert_eq!(h.target, "/u/t0k%26n%20%2F%2B/x?key=t0k%26n%20%2F%2B");
        assert_eq!(h.headers[0].1, "v=t0k&n /+");
        assert_eq!(h.headers[1].1, "__TOKEN__", "never the Host header");
        // Only where named: a query-only substitution leaves the path.
        let v = vault(json!({"type": "passthrough", "substitutions": [
            {"credential": "tok", "placeholder": "P", "in": ["query"]}]}));
        assert_eq!(
            applied(&v, head("/P?q=P", &[])).target,
            "/P?q=t0k%26n%20%2F%2B"
        );
    }

    #[test]
    fn bodies_get_the_value_encoded_for_their_type() {
        let v = vault(json!({"type": "passthrough", "substitutions": [
            {"credential": "tok", "placeholder": "__T__", "in": ["body"]}]}));
        let binding = v
            .binding_for(&RequestTarget {
                scheme: "https",
                host: "api.example.org",
                method: "POST",
                path: "/",
            })
            .unwrap();
        let body = |t: Option<&str>, e: Option<&str>, b: &str| {
            apply_body(&v, binding, t, e, b.as_bytes()).map(|b| String::from_utf8(b).unwrap())
        };
        assert_eq!(
            body(
                Some("application/json; charset=utf-8"),
                None,
                r#"{"k":"__T__"}"#
            )
            .as_deref(),
            Some(r#"{"k":"t0k&n /+"}"#)
        );
        assert_eq!(
            body(Some("application/x-www-form-urlencoded"), None, "k=__T__").as_deref(),
            Some("k=t0k%26n+%2F%2B")
        );
        assert_eq!(
            body(Some("text/plain"), None, "__T__").as_deref(),
            Some("t0k&n /+")
        );
        assert_eq!(body(Some("application/json"), Some("gzip"), "__T__"), None);
        assert_eq!(
            body(Some("multipart/form-data; boundary=x"), None, "__T__"),
            None
        );
        assert_eq!(body(Some("application/json"), None, "{}"), None);
    }
}
