//! Which requests a binding takes: schemes (`https` by default), host names (exact, or
//! `*.example.com` for every name below it, as egress rules read them), methods, and path
//! patterns (exact, or a prefix ending in `*`).

use fastbox_egress_policy::{PolicyError, Target};

use crate::wire::MatchSpec;

const DEFAULT_METHODS: [&str; 5] = ["GET", "POST", "PUT", "PATCH", "DELETE"];

/// An outgoing request, as far as matching goes.
#[derive(Debug, Clone, Copy)]
pub struct RequestTarget<'a> {
    /// `https` or `http`.
    pub scheme: &'a str,
    /// The host name, without port (any case; a trailing dot is ignored).
    pub host: &'a str,
    pub method: &'a str,
    /// The path, without its query.
    pub path: &'a str,
}

#[derive(Debug, Clone)]
pub(crate) struct Matcher {
    schemes: Vec<String>,
    hosts: Vec<Target>,
    methods: Vec<String>,
    paths: Vec<PathPattern>,
}

#[derive(Debug, Clone, PartialEq)]
enum PathPattern {
    Exact(String),
    Prefix(String),
}

impl PathPattern {
    fn parse(raw: &str) -> Result<Self, String> {
        if !raw.starts_with('/') {
            return Err(format!("path {raw:?} does not start with /"));
        }
        match raw.strip_suffix('*') {
            Some(prefix) if prefix.contains('*') => {
                Err(format!("path {raw:?}: `*` is only allowed at the end"))
            }
            Some(prefix) => Ok(PathPattern::Prefix(prefix.to_string())),
            None if raw.contains('*') => {
                Err(format!("path {raw:?}: `*` is only allowed at the end"))
            }
            None => Ok(PathPattern::Exact(raw.to_string())),
        }
    }

    fn matches(&self, path: &str) -> bool {
        match self {
            PathPattern::Exact(p) => p == path,
            PathPattern::Prefix(p) => path.starts_with(p.as_str()),
        }
    }

    fn len(&self) -> usize {
        match self {
            PathPattern::Exact(p) | PathPattern::Prefix(p) => p.len(),
        }
    }
}

/// A host name as the matcher compares it: lower case, no trailing dot.
pub(crate) fn normal_host(host: &str) -> String {
    let lower = host.to_ascii_lowercase();
    lower.strip_suffix('.').unwrap_or(&lower).to_string()
}

impl Matcher {
    pub fn compile(spec: &MatchSpec) -> Result<Self, String> {
        let schemes = match &spec.schemes {
            None => vec!["https".to_string()],
            Some(list) if list.is_empty() => return Err("match.schemes is empty".into()),
            Some(list) => list
                .iter()
                .map(|s| match s.as_str() {
                    "https" | "http" => Ok(s.clone()),
                    other => Err(format!("match.schemes: {other:?} is not https or http")),
                })
                .collect::<Result<_, _>>()?,
        };
        if let Some(ports) = &spec.ports
            && let Some(bad) = ports.iter().find(|p| **p != 80 && **p != 443)
        {
            return Err(format!(
                "match.ports: {bad} is not allowed (ports are deprecated: the port follows the scheme, 80 or 443)"
            ));
        }
        if spec.hosts.is_empty() {
            return Err("match.hosts is empty".into());
        }
        let hosts = spec
            .hosts
            .iter()
            .enumerate()
            .map(|(i, raw)| match Target::parse(i, raw) {
                Ok(t @ (Target::Name(_) | Target::Wildcard(_))) => Ok(t),
                Ok(_) => Err(format!(
                    "match.hosts[{i}]: {raw:?} is an address; bindings name hosts"
                )),
                Err(PolicyError::BadTarget { reason, .. }) => {
                    Err(format!("match.hosts[{i}]: {raw:?}: {reason}"))
                }
                Err(_) => Err(format!("match.hosts[{i}]: {raw:?} is not a host name")),
            })
            .collect::<Result<_, _>>()?;
        let methods = match &spec.methods {
            None => DEFAULT_METHODS.iter().map(|m| m.to_string()).collect(),
            Some(list) if list.is_empty() => return Err("match.methods is empty".into()),
            Some(list) => list
                .iter()
                .map(|m| {
                    let upper = m.to_ascii_uppercase();
                    match !upper.is_empty() && upper.bytes().all(|b| b.is_ascii_uppercase()) {
                        true => Ok(upper),
                        false => Err(format!("match.methods: {m:?} is not a method")),
                    }
                })
                .collect::<Result<_, _>>()?,
        };
        let paths = match &spec.paths {
            None => vec![PathPattern::Prefix("/".into())],
            Some(list) if list.is_empty() => return Err("match.paths is empty".into()),
            Some(list) => list
                .iter()
                .map(|p| PathPattern::parse(p).map_err(|e| format!("match.paths: {e}")))
                .collect::<Result<_, _>>()?,
        };
        Ok(Self {
            schemes,
            hosts,
            methods,
            paths,
        })
    }

    /// Whether this binding takes host `host` at all (for TLS: only such connections are
    /// opened by the proxy).
    pub fn binds_host(&self, scheme: &str, host: &str) -> bool {
        let host = normal_host(host);
        self.schemes.iter().any(|s| s == scheme) && self.hosts.iter().any(|t| t.matches_name(&host))
    }

    /// How specifically this binding takes `target` (None: it does not): an exact host
    /// before a wildcard, then the longest path pattern.
    pub fn specificity(&self, target: &RequestTarget<'_>) -> Option<(bool, usize)> {
        let host = normal_host(target.host);
        if !self.schemes.iter().any(|s| s == target.scheme)
            || !self
                .methods
                .iter()
                .any(|m| m.eq_ignore_ascii_case(target.method))
        {
            return None;
        }
        let exact = self
            .hosts
            .iter()
            .filter(|t| t.matches_name(&host))
            .map(|t| matches!(t, Target::Name(_)))
            .max()?;
        let path = self
            .paths
            .iter()
            .filter(|p| p.matches(target.path))
            .map(PathPattern::len)
            .max()?;
        Some((exact, path))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(hosts: &[&str]) -> MatchSpec {
        MatchSpec {
            hosts: hosts.iter().map(|h| h.to_string()).collect(),
            ..Default::default()
        }
    }

    fn target<'a>(
        scheme: &'a str,
        host: &'a str,
        method: &'a str,
        path: &'a str,
    ) -> RequestTarget<'a> {
        RequestTarget {
            scheme,
            host,
            method,
            path,
        }
    }

    #[test]
    fn defaults_are_https_the_usual_methods_and_every_path() {
        let m = Matcher::compile(&spec(&["api.example.org"])).unwrap();
        assert!(
            m.specificity(&target("https", "API.example.org.", "post", "/v1/x"))
                .is_some()
        );
        assert!(
            m.specificity(&target("http", "api.example.org", "GET", "/"))
                .is_none()
        );
        assert!(
            m.specificity(&target("https", "api.example.org", "HEAD", "/"))
                .is_none()
        );
        assert!(
            m.specificity(&target("https", "other.example.org", "GET", "/"))
                .is_none()
        );
        assert!(m.binds_host("https", "api.example.org"));
        assert!(!m.binds_host("http", "api.example.org"));
    }

    #[test]
    fn wildcards_paths_and_specificity() {
        let m = Matcher::compile(&MatchSpec {
            hosts: vec!["*.example.org".into(), "example.org".into()],
            paths: Some(vec!["/v1/*".into(), "/v1/models".into()]),
            schemes: Some(vec!["http".into(), "https".into()]),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(
            m.specificity(&target("http", "a.b.example.org", "GET", "/v1/models")),
            Some((false, 10))
        );
        assert_eq!(
            m.specificity(&target("https", "example.org", "GET", "/v1/other")),
            Some((true, 4))
        );
        assert_eq!(
            m.specificity(&target("https", "example.org", "GET", "/v2")),
            None
        );
        assert_eq!(
            m.specificity(&target("https", "badexample.org", "GET", "/v1/x")),
            None
        );
    }

    #[test]
    fn bad_matches_are_named() {
        let bad = |m: MatchSpec| Matcher::compile(&m).unwrap_err();
        assert!(bad(spec(&[])).contains("hosts is empty"));
        assert!(bad(spec(&["10.0.0.1"])).contains("address"));
        assert!(bad(spec(&["exa mple.org"])).contains("hosts[0]"));
        assert!(
            bad(MatchSpec {
                ports: Some(vec![8443]),
                ..spec(&["a.org"])
            })
            .contains("8443")
        );
        assert!(
            Matcher::compile(&MatchSpec {
                ports: Some(vec![443, 80]),
                ..spec(&["a.org"])
            })
            .is_ok()
        );
        assert!(
            bad(MatchSpec {
                schemes: Some(vec!["ftp".into()]),
                ..spec(&["a.org"])
            })
            .contains("ftp")
        );
        assert!(
            bad(MatchSpec {
                paths: Some(vec!["v1".into()]),
                ..spec(&["a.org"])
            })
            .contains("start with /")
        );
        assert!(
            bad(MatchSpec {
                paths: Some(vec!["/a*/b".into()]),
                ..spec(&["a.org"])
            })
            .contains("end")
        );
        assert!(
            bad(MatchSpec {
                methods: Some(vec!["G ET".into()]),
                ..spec(&["a.org"])
            })
            .contains("method")
        );
    }
}
