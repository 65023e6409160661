//! What a rule names: a host name, a `*.` wildcard, an IPv4 address or an IPv4 network.
//!
//! Targets are parsed once, into their canonical form: names lower-cased without a trailing
//! dot, addresses and networks as `Ipv4Addr` displays them. Two rules name the same target
//! exactly when their canonical strings are equal (what PATCH and DELETE merge by).

use std::fmt;
use std::net::Ipv4Addr;

use super::PolicyError;

/// Longest host name in presentation form (RFC 1035: 255 octets on the wire).
pub const MAX_NAME_LEN: usize = 253;

/// Longest label of a host name.
pub const MAX_LABEL_LEN: usize = 63;

/// A rule's target, validated.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// Exactly this host name (`api.example.com`).
    Name(String),
    /// Every name strictly below this one: `*.example.com` holds `example.com` and matches
    /// `a.example.com` and `a.b.example.com`, never `example.com` itself (as OpenSandbox's
    /// egress sidecar decides).
    Wildcard(String),
    /// One IPv4 address.
    Address(Ipv4Addr),
    /// An IPv4 network; its host bits are zero.
    Network(Ipv4Net),
}

/// An IPv4 network: address and prefix length, host bits zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ipv4Net {
    network: Ipv4Addr,
    len: u8,
}

impl Ipv4Net {
    /// The network `network/len`; fails if `len > 32` or host bits are set.
    pub fn try_new(network: Ipv4Addr, len: u8) -> Result<Self, String> {
        if len > 32 {
            return Err(format!("prefix length {len} is larger than 32"));
        }
        let masked = Ipv4Addr::from(u32::from(network) & Self::mask(len));
        if masked != network {
            return Err(format!("host bits are set (the network is {masked}/{len})"));
        }
        Ok(Self { network, len })
    }

    /// The network address.
    pub fn network(&self) -> Ipv4Addr {
        self.network
    }

    /// The prefix length.
    pub fn prefix_len(&self) -> u8 {
        self.len
    }

    /// Whether `addr` is inside.
    pub fn contains(&self, addr: Ipv4Addr) -> bool {
        u32::from(addr) & Self::mask(self.len) == u32::from(self.network)
    }

    fn mask(len: u8) -> u32 {
        u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0)
    }
}

impl fmt::Display for Ipv4Net {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.len)
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Name(name) => f.write_str(name),
            Target::Wildcard(suffix) => write!(f, "*.{suffix}"),
            Target::Address(addr) => write!(f, "{addr}"),
            Target::Network(net) => write!(f, "{net}"),
        }
    }
}

impl Target {
    /// Parses a rule target; `index` is the rule's position, for the error.
    pub fn parse(index: usize, raw: &str) -> Result<Self, PolicyError> {
        let bad = |reason: String| PolicyError::BadTarget {
            index,
            target: raw.to_owned(),
            reason,
        };
        let text = raw.trim();
        if text.is_empty() {
            return Err(bad("the target is empty".into()));
        }
        if looks_like_ipv6(text) {
            return Err(PolicyError::Ipv6Target {
                index,
                target: raw.to_owned(),
            });
        }
        if text.contains(':') {
            return Err(bad(
                "`:` is not allowed: a target has no scheme and no port".into(),
            ));
        }
        if let Some((addr, len)) = text.split_once('/') {
            let addr: Ipv4Addr = addr
                .parse()
                .map_err(|_| bad(format!("{addr:?} is not an IPv4 address")))?;
            let len: u8 = len
                .parse()
                .map_err(|_| bad(format!("{len:?} is not a prefix length")))?;
            return Ipv4Net::try_new(addr, len)
                .map(Target::Network)
                .map_err(bad);
        }
        if let Ok(addr) = text.parse::<Ipv4Addr>() {
            return Ok(Target::Address(addr));
        }
        let lower = text.to_ascii_lowercase();
        let name = lower.strip_suffix('.').unwrap_or(&lower);
        match name.strip_prefix("*.") {
            Some(suffix) => {
                validate_name(index, raw, suffix)?;
                Ok(Target::Wildcard(suffix.to_owned()))
            }
            None => {
                validate_name(index, raw, name)?;
                Ok(Target::Name(name.to_owned()))
            }
        }
    }

    /// Whether this target matches the host name `name` (lower case, no trailing dot).
    /// Address and network targets match no name.
    pub fn matches_name(&self, name: &str) -> bool {
        match self {
            Target::Name(exact) => exact == name,
            Target::Wildcard(suffix) => name
                .strip_suffix(suffix.as_str())
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
            Target::Address(_) | Target::Network(_) => false,
        }
    }

    /// Whether this target matches the destination `addr`. Name targets match no address.
    pub fn matches_address(&self, addr: Ipv4Addr) -> bool {
        match self {
            Target::Address(a) => *a == addr,
            Target::Network(net) => net.contains(addr),
            Target::Name(_) | Target::Wildcard(_) => false,
        }
    }

    /// Whether the target is an address or a network (enforced per packet) rather than a
    /// name (enforced by the DNS forwarder).
    pub fn is_address(&self) -> bool {
        matches!(self, Target::Address(_) | Target::Network(_))
    }
}

/// An IPv6 address or network, bracketed or not.
fn looks_like_ipv6(text: &str) -> bool {
    let addr = text.split_once('/').map_or(text, |(addr, _)| addr);
    let addr = addr.trim_start_matches('[').trim_end_matches(']');
    addr.parse::<std::net::Ipv6Addr>().is_ok()
}

/// A host name: labels of `[a-z0-9_-]`, 1..=63 bytes each, not starting or ending with `-`,
/// at most 253 bytes in all, and not all-numeric at the end (that is a mistyped address).
fn validate_name(index: usize, raw: &str, name: &str) -> Result<(), PolicyError> {
    let bad = |reason: String| PolicyError::BadTarget {
        index,
        target: raw.to_owned(),
        reason,
    };
    if name.len() > MAX_NAME_LEN {
        return Err(PolicyError::NameTooLong {
            index,
            len: name.len(),
            max: MAX_NAME_LEN,
        });
    }
    if name.contains('*') {
        return Err(bad(
            "`*` is only allowed as the whole first label (`*.example.com`)".into(),
        ));
    }
    for label in name.split('.') {
        if label.is_empty() {
            return Err(bad("the name has an empty label".into()));
        }
        if label.len() > MAX_LABEL_LEN {
            return Err(bad(format!(
                "label {label:?} is longer than {MAX_LABEL_LEN} bytes"
            )));
        }
        if let Some(c) = label
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
        {
            return Err(bad(format!(
                "{c:?} is not allowed in a host name (expected an FQDN, `*.domain`, an IPv4 address or an IPv4 CIDR)"
            )));
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err(bad(format!("label {label:?} starts or ends with `-`")));
        }
    }
    let last = name.rsplit('.').next().unwrap_or(name);
    if last.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad("this is neither a host name nor an IPv4 address".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(raw: &str) -> Result<Target, PolicyError> {
        Target::parse(0, raw)
    }

    #[test]
    fn targets_parse_into_their_canonical_form() {
        let cases = [
            ("Example.COM.", "example.com"),
            ("*.Example.com", "*.example.com"),
            ("_dmarc.example.com", "_dmarc.example.com"),
            ("localhost", "localhost"),
            ("10.1.2.3", "10.1.2.3"),
            ("10.1.0.0/16", "10.1.0.0/16"),
            ("0.0.0.0/0", "0.0.0.0/0"),
            ("192.0.2.7/32", "192.0.2.7/32"),
            ("  api.example.org ", "api.example.org"),
        ];
        for (raw, canonical) in cases {
            assert_eq!(parse(raw).unwrap().to_string(), canonical, "{raw}");
        }
        assert!(matches!(parse("*.a.b").unwrap(), Target::Wildcard(s) if s == "a.b"));
        assert!(matches!(parse("a.b").unwrap(), Target::Name(_)));
        assert!(matches!(parse("1.2.3.4").unwrap(), Target::Address(_)));
        assert!(matches!(parse("1.2.3.0/24").unwrap(), Target::Network(_)));
    }

    #[test]
    fn bad_targets_are_rejected_with_a_reason() {
        let cases = [
            ("", "empty"),
            ("*", "first label"),
            ("*.", "first label"),
            ("*..com", "empty label"),
            ("a.*.com", "first label"),
            ("*foo.com", "first label"),
            ("http://example.com", "no scheme and no port"),
            ("example.com:443", "no scheme and no port"),
            ("exa!mple.com", "not allowed in a host name"),
            ("example.com/path", "not an IPv4 address"),
            ("a..b", "empty label"),
            ("-a.com", "starts or ends"),
            ("a b.com", "not allowed"),
            ("1.2.3", "neither a host name nor an IPv4 address"),
            ("256.1.1.1", "neither"),
            ("01.2.3.4", "neither"),
            (
                "10.0.0.1/24",
                "host bits are set (the network is 10.0.0.0/24)",
            ),
            ("10.0.0.0/33", "larger than 32"),
            ("10.0.0.0/x", "not a prefix length"),
        ];
        for (raw, reason) in cases {
            let err = parse(raw).unwrap_err().to_string();
            assert!(err.contains(reason), "{raw:?}: {err}");
        }
        let long_label = format!("{}.com", "a".repeat(64));
        assert!(
            parse(&long_label)
                .unwrap_err()
                .to_string()
                .contains("longer than 63")
        );
    }

    #[test]
    fn ipv6_targets_are_rejected_clearly() {
        for raw in ["::1", "2001:db8::/32", "[2001:db8::1]", "::ffff:10.0.0.1"] {
            assert!(
                matches!(parse(raw), Err(PolicyError::Ipv6Target { .. })),
                "{raw}"
            );
        }
        assert!(
            parse("2001:db8::1")
                .unwrap_err()
                .to_string()
                .contains("IPv6")
        );
    }

    #[test]
    fn over_long_names_are_rejected() {
        let label = "a".repeat(63);
        let name = [label.as_str(); 4].join("."); // 255 bytes
        assert!(matches!(
            parse(&name),
            Err(PolicyError::NameTooLong { len: 255, .. })
        ));
        let fits = [label.as_str(), &label, &label, &"a".repeat(61)].join(".");
        assert_eq!(fits.len(), 253);
        assert!(parse(&fits).is_ok());
    }

    #[test]
    fn wildcards_match_names_below_their_domain_but_not_the_domain() {
        let w = parse("*.example.com").unwrap();
        assert!(w.matches_name("a.example.com"));
        assert!(w.matches_name("a.b.example.com"));
        assert!(!w.matches_name("example.com"));
        assert!(!w.matches_name("badexample.com"));
        assert!(!w.matches_name("a.example.com.evil"));
        assert!(!w.matches_name(".example.com"));
        let exact = parse("example.com").unwrap();
        assert!(exact.matches_name("example.com"));
        assert!(!exact.matches_name("a.example.com"));
    }

    #[test]
    fn networks_contain_their_addresses() {
        let net = parse("10.1.2.0/23").unwrap();
        assert!(net.matches_address("10.1.2.0".parse().unwrap()));
        assert!(net.matches_address("10.1.3.255".parse().unwrap()));
        assert!(!net.matches_address("10.1.4.0".parse().unwrap()));
        assert!(!net.matches_name("10.1.2.0"));
        let all = parse("0.0.0.0/0").unwrap();
        assert!(all.matches_address("203.0.113.9".parse().unwrap()));
        let one = parse("203.0.113.9").unwrap();
        assert!(one.matches_address("203.0.113.9".parse().unwrap()));
        assert!(!one.matches_address("203.0.113.8".parse().unwrap()));
    }
}
