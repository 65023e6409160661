//! Small pieces both directions share: the error envelope, hop-by-hop headers, the proxy
//! route's segment encoding, bounded reads of answers.

use std::error::Error as StdError;

use axum::Json;
use axum::response::{IntoResponse, Response};
use fastbox_api::lifecycle::ErrorResponse;
use http::StatusCode;
use http::header::{self, HeaderMap, HeaderName};

/// The lifecycle API's `{code, message}` envelope.
pub(super) fn envelope(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    let body = ErrorResponse {
        code: code.to_string(),
        message: message.into(),
    };
    (status, Json(body)).into_response()
}

/// Removes the headers that describe one connection (RFC 9110 §7.6.1): `Connection` and
/// what it names, `Keep-Alive`, `Proxy-*`, `TE`, `Trailer`, `Transfer-Encoding`, `Upgrade`.
pub(super) fn remove_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    let fixed = [
        header::CONNECTION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        HeaderName::from_static("keep-alive"),
    ];
    for name in named.iter().chain(&fixed) {
        headers.remove(name);
    }
    let proxy: Vec<HeaderName> = headers
        .keys()
        .filter(|name| name.as_str().starts_with("proxy-"))
        .cloned()
        .collect();
    for name in proxy {
        headers.remove(name);
    }
}

/// Whether a request asks to switch protocols (`Connection: upgrade` plus `Upgrade`).
pub(super) fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
}

/// `text` as one path segment: every byte but RFC 3986's unreserved ones percent-encoded,
/// `/` and `%` included.
pub(super) fn encode_segment(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The inverse of [`encode_segment`] (any `%XX` decoded once); `None` for a malformed escape
/// or bytes that are not UTF-8.
pub(super) fn decode_segment(segment: &str) -> Option<String> {
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = segment.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// POSTs the JSON `body` to `base` + `path` with `credential` (in [`super::CREDENTIAL_HEADER`]),
/// within `timeout`: the answer's status and its body (at most `limit` bytes), or why there is
/// none (`unreachable at BASE: ...`, or an answer over the limit).
pub(super) async fn post_json(
    http: &reqwest::Client,
    base: &str,
    path: &str,
    credential: &super::credential::Credential,
    body: Vec<u8>,
    timeout: std::time::Duration,
    limit: usize,
) -> Result<(StatusCode, Vec<u8>), String> {
    let response = http
        .post(format!("{base}{path}"))
        .header(super::CREDENTIAL_HEADER, credential.header_value())
        .header(header::CONTENT_TYPE, "application/json")
        .timeout(timeout)
        .body(body)
        .send()
        .await
        .map_err(|e| {
            format!(
                "unreachable at {base}: {}",
                super::node_client::transport_error(&e, timeout)
            )
        })?;
    let status = response.status();
    Ok((status, read_bounded(response, limit, timeout).await?))
}

/// A refusal's text: the `{code, message}` envelope's, else the first 512 bytes as they are.
pub(super) fn refusal_text(body: &[u8]) -> String {
    match serde_json::from_slice::<ErrorResponse>(body) {
        Ok(e) => format!("{}: {}", e.code, e.message),
        Err(_) => String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned(),
    }
}

/// An answer's body, at most `limit` bytes (`timeout`: the request's, to say so).
pub(super) async fn read_bounded(
    mut response: reqwest::Response,
    limit: usize,
    timeout: std::time::Duration,
) -> Result<Vec<u8>, String> {
    if response.content_length().is_some_and(|n| n > limit as u64) {
        return Err(format!("an answer over {limit} bytes"));
    }
    let mut body = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| super::node_client::transport_error(&e, timeout))?
    {
        if body.len() + chunk.len() > limit {
            return Err(format!("an answer over {limit} bytes"));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// An error and its sources, `: `-separated (reqwest's own text leaves out the cause).
pub(super) fn chain(e: &dyn StdError) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let next = s.to_string();
        if !text.contains(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_round_trip_and_never_hold_a_separator() {
        for text in [
            "",
            "/",
            "/ping",
            "/a/../../node/v1/remove",
            "/%2e%2e/x",
            "/ü ?#%",
            "..",
            "/v1.2/x~y_z-",
        ] {
            let encoded = encode_segment(text);
            assert!(
                !encoded.contains('/') && !encoded.contains('?') && !encoded.contains('#'),
                "{encoded}"
            );
            assert_eq!(decode_segment(&encoded).as_deref(), Some(text), "{encoded}");
        }
        assert_eq!(encode_segment("/a b"), "%2Fa%20b");
        for bad in ["%", "%2", "%zz", "%FF"] {
            assert_eq!(decode_segment(bad), None, "{bad}");
        }
    }

    #[test]
    fn hop_by_hop_headers_go_and_the_rest_stay() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("connection", "keep-alive, x-private"),
            ("x-private", "1"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("proxy-authorization", "secret"),
            ("te", "trailers"),
            ("upgrade", "websocket"),
            ("authorization", "Bearer app"),
            ("content-length", "3"),
        ] {
            headers.insert(
                HeaderName::from_static(name),
                http::HeaderValue::from_static(value),
            );
        }
        assert!(!is_upgrade(&headers));
        remove_hop_by_hop(&mut headers);
        let mut left: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["authorization", "content-length"]);
    }
}
