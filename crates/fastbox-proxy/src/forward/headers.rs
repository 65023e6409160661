//! Header rewriting between client and upstream (RFC 9110 §7.6.1).
//!
//! Hop-by-hop headers describe one connection and must not travel further: `Connection` and
//! every header it names, `Keep-Alive`, `Proxy-*`, `TE`, `Trailer`, `Transfer-Encoding` and
//! `Upgrade`. The one exception is an upgrade handshake, which the proxy forwards so both
//! connections switch protocols together: it keeps `Upgrade` and sends `Connection: upgrade`.

use std::net::SocketAddr;

use axum::http::header::{self, HeaderMap, HeaderName, HeaderValue};

/// Hop-by-hop headers removed in every direction (besides those `Connection` names).
const HOP_BY_HOP: [HeaderName; 5] = [
    header::CONNECTION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// `Keep-Alive` has no constant in `http`.
const KEEP_ALIVE: &str = "keep-alive";

/// Whether the message asks to switch protocols (`Connection: upgrade` plus `Upgrade`).
pub(crate) fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE) && connection_tokens(headers).any(|t| t == "upgrade")
}

/// Removes hop-by-hop headers; with `keep_upgrade`, re-adds `Connection: upgrade` and the
/// original `Upgrade` value.
pub(crate) fn remove_hop_by_hop(headers: &mut HeaderMap, keep_upgrade: bool) {
    let upgrade = headers.get(header::UPGRADE).cloned();
    let named: Vec<HeaderName> = connection_tokens(headers)
        .filter_map(|token| HeaderName::from_bytes(token.as_bytes()).ok())
        .collect();
    for name in named.iter().chain(&HOP_BY_HOP) {
        headers.remove(name);
    }
    headers.remove(KEEP_ALIVE);
    let proxy_headers: Vec<HeaderName> = headers
        .keys()
        .filter(|name| name.as_str().starts_with("proxy-"))
        .cloned()
        .collect();
    for name in proxy_headers {
        headers.remove(name);
    }
    if let (true, Some(upgrade)) = (keep_upgrade, upgrade) {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, upgrade);
    }
}

/// Removes `strip`, then sets every header in `add` (replacing values of the same name).
pub(crate) fn apply_target_headers(headers: &mut HeaderMap, strip: &[HeaderName], add: &HeaderMap) {
    for name in strip.iter().chain(add.keys()) {
        headers.remove(name);
    }
    for (name, value) in add {
        headers.append(name, value.clone());
    }
}

/// Points `Host` at the upstream and records the original host, client and scheme in
/// `X-Forwarded-Host`, `X-Forwarded-For` and `X-Forwarded-Proto`.
///
/// The client address is known only when the server recorded it (`ConnectInfo`); the scheme is
/// `http` unless a proxy in front already said otherwise, since fastbox listens on plain HTTP.
pub(crate) fn set_forwarding(
    headers: &mut HeaderMap,
    upstream: SocketAddr,
    client: Option<SocketAddr>,
) {
    if let Some(host) = headers.remove(header::HOST)
        && !headers.contains_key("x-forwarded-host")
    {
        headers.insert("x-forwarded-host", host);
    }
    if let Ok(host) = HeaderValue::from_str(&upstream.to_string()) {
        headers.insert(header::HOST, host);
    }
    let Some(client) = client else {
        return;
    };
    let forwarded_for = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|value| value.to_str().ok())
        .map(str::to_owned)
        .chain([client.ip().to_string()])
        .collect::<Vec<_>>()
        .join(", ");
    if let Ok(value) = HeaderValue::from_str(&forwarded_for) {
        headers.insert("x-forwarded-for", value);
    }
    if !headers.contains_key("x-forwarded-proto") {
        headers.insert("x-forwarded-proto", HeaderValue::from_static("http"));
    }
}

/// The comma-separated, lower-cased tokens of every `Connection` header.
fn connection_tokens(headers: &HeaderMap) -> impl Iterator<Item = String> + '_ {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(|token| token.trim().to_ascii_lowercase())
        .filter(|token| !token.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_static(value));
        }
        map
    }

    #[test]
    fn removes_hop_by_hop_and_connection_named_headers() {
        let mut map = headers(&[
            ("connection", "keep-alive, X-Custom-Hop"),
            ("x-custom-hop", "1"),
            ("keep-alive", "timeout=5"),
            ("proxy-authorization", "Basic x"),
            ("proxy-connection", "keep-alive"),
            ("te", "trailers"),
            ("trailer", "x-checksum"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "websocket"),
            ("content-type", "text/plain"),
        ]);
        remove_hop_by_hop(&mut map, false);
        assert_eq!(map, headers(&[("content-type", "text/plain")]));
    }

    #[test]
    fn upgrade_keeps_connection_upgrade_and_upgrade() {
        let mut map = headers(&[
            ("connection", "keep-alive, Upgrade"),
            ("upgrade", "websocket"),
            ("keep-alive", "timeout=5"),
            ("sec-websocket-key", "abc"),
        ]);
        assert!(is_upgrade(&map));
        remove_hop_by_hop(&mut map, true);
        assert_eq!(
            map,
            headers(&[
                ("sec-websocket-key", "abc"),
                ("connection", "upgrade"),
                ("upgrade", "websocket"),
            ])
        );
    }

    #[test]
    fn upgrade_needs_both_headers() {
        assert!(!is_upgrade(&headers(&[("upgrade", "websocket")])));
        assert!(!is_upgrade(&headers(&[("connection", "upgrade")])));
        assert!(is_upgrade(&headers(&[
            ("connection", "a"),
            ("connection", "UPGRADE"),
            ("upgrade", "h2c")
        ])));
    }

    #[test]
    fn target_headers_strip_then_replace() {
        let mut map = headers(&[
            ("open-sandbox-api-key", "secret"),
            ("x-added", "from-client"),
            ("accept", "*/*"),
        ]);
        let add = headers(&[("x-added", "one"), ("x-added", "two")]);
        apply_target_headers(
            &mut map,
            &[HeaderName::from_static("open-sandbox-api-key")],
            &add,
        );
        assert_eq!(
            map,
            headers(&[("accept", "*/*"), ("x-added", "one"), ("x-added", "two")])
        );
    }

    #[test]
    fn forwarding_headers_record_host_client_and_scheme() {
        let mut map = headers(&[
            ("host", "public.example"),
            ("x-forwarded-for", "203.0.113.9"),
        ]);
        set_forwarding(
            &mut map,
            "127.0.0.1:8080".parse().unwrap(),
            Some("192.0.2.7:5555".parse().unwrap()),
        );
        assert_eq!(map["host"], "127.0.0.1:8080");
        assert_eq!(map["x-forwarded-host"], "public.example");
        assert_eq!(map["x-forwarded-for"], "203.0.113.9, 192.0.2.7");
        assert_eq!(map["x-forwarded-proto"], "http");
    }

    #[test]
    fn without_client_address_only_host_changes() {
        let mut map = HeaderMap::new();
        set_forwarding(&mut map, "[::1]:80".parse().unwrap(), None);
        assert_eq!(map, headers(&[("host", "[::1]:80")]));
    }
}
