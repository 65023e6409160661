//! `/proxy/{port}/...`: a reverse proxy to `127.0.0.1:{port}` inside the sandbox.
//!
//! The Docker-style endpoints of OpenSandbox (`host:port/proxy/44772`) and apps listening on
//! any port are reached through it. Each request gets its own connection to the app (sandbox-
//! local, so pooling buys nothing and an idle execd holds no connection); bodies stream both
//! ways without buffering, so SSE passes through as it is produced, and `Upgrade` requests
//! (WebSocket) are spliced byte for byte once both sides have switched protocols. The access
//! token, checked before this handler, is not forwarded to the app.

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::http::header::{self, HeaderMap, HeaderName};
use axum::http::{StatusCode, Uri};
use axum::response::Response;
use axum::routing::any;
use hyper_util::rt::TokioIo;

use crate::auth::TOKEN_HEADER;
use crate::error::ApiError;
use crate::state::AppState;

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("invalid proxy port {0:?}")]
    InvalidPort(String),
    #[error("cannot connect to 127.0.0.1:{port}: {source}")]
    Connect { port: u16, source: std::io::Error },
    #[error("upstream 127.0.0.1:{port} failed: {source}")]
    Upstream { port: u16, source: hyper::Error },
}

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/proxy/{port}", any(proxy))
        .route("/proxy/{port}/", any(proxy))
        .route("/proxy/{port}/{*rest}", any(proxy))
}

/// Headers that describe one hop and must not be forwarded.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// The upstream port and the path-and-query to request there.
pub fn target(uri: &Uri) -> Result<(u16, String), ProxyError> {
    let rest = uri.path().strip_prefix("/proxy/").unwrap_or_default();
    let (port, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let port = port
        .parse::<u16>()
        .ok()
        .filter(|&p| p != 0)
        .ok_or_else(|| ProxyError::InvalidPort(port.to_string()))?;
    let pq = match uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path.to_string(),
    };
    Ok((port, pq))
}

fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && headers.get_all(header::CONNECTION).iter().any(|v| {
            v.to_str()
                .is_ok_and(|s| s.to_ascii_lowercase().contains("upgrade"))
        })
}

/// Removes hop-by-hop headers (and those named by `Connection`), keeping the upgrade pair
/// when the request is an upgrade.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap, keep_upgrade: bool) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|s| s.trim().to_ascii_lowercase()))
        .filter(|s| s != "upgrade")
        .filter_map(|s| HeaderName::from_bytes(s.as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        if keep_upgrade && (name == "connection" || name == "upgrade") {
            continue;
        }
        headers.remove(name);
    }
}

async fn proxy(req: Request) -> Result<Response, ApiError> {
    let (port, path_and_query) = target(req.uri())?;
    let upgrade = is_upgrade(req.headers());
    let (mut parts, body) = req.into_parts();
    let client_upgrade = if upgrade {
        parts.extensions.remove::<hyper::upgrade::OnUpgrade>()
    } else {
        None
    };
    strip_hop_by_hop(&mut parts.headers, upgrade);
    parts.headers.remove(TOKEN_HEADER);
    if !parts.headers.contains_key(header::HOST)
        && let Ok(v) = format!("127.0.0.1:{port}").parse()
    {
        parts.headers.insert(header::HOST, v);
    }
    let mut out = hyper::Request::builder()
        .method(parts.method)
        .uri(path_and_query)
        .version(hyper::Version::HTTP_11)
        .body(body)
        .map_err(|e| ProxyError::InvalidPort(e.to_string()))?;
    *out.headers_mut() = parts.headers;

    let stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|source| ProxyError::Connect { port, source })?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|source| ProxyError::Upstream { port, source })?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(port, error = %e, "proxy connection ended");
        }
    });
    let mut resp = sender
        .send_request(out)
        .await
        .map_err(|source| ProxyError::Upstream { port, source })?;

    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        if let Some(client) = client_upgrade {
            let upstream = hyper::upgrade::on(&mut resp);
            tokio::spawn(async move {
                match tokio::try_join!(client, upstream) {
                    Ok((c, u)) => {
                        let _ = tokio::io::copy_bidirectional(
                            &mut TokioIo::new(c),
                            &mut TokioIo::new(u),
                        )
                        .await;
                    }
                    Err(e) => tracing::debug!(port, error = %e, "upgrade failed"),
                }
            });
        }
        let (parts, _) = resp.into_parts();
        return Ok(Response::from_parts(parts, Body::empty()));
    }
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers, false);
    Ok(Response::from_parts(parts, Body::new(body)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_splits_port_path_and_query() {
        let t = |s: &str| target(&s.parse().unwrap());
        assert_eq!(t("/proxy/8080/a/b?x=1").unwrap(), (8080, "/a/b?x=1".into()));
        assert_eq!(t("/proxy/8080").unwrap(), (8080, "/".into()));
        assert_eq!(t("/proxy/8080/").unwrap(), (8080, "/".into()));
        assert!(t("/proxy/0/x").is_err());
        assert!(t("/proxy/99999/x").is_err());
        assert!(t("/proxy/abc/x").is_err());
    }
}
