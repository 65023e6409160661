//! Forwarding one request to a sandbox port: a streaming HTTP/1.1 reverse proxy.
//!
//! Used by the lifecycle server's proxy and by the node proxy alike; each resolves the
//! sandbox, checks credentials and rewrites the path, then hands the request to
//! [`Forwarder::forward`] with a [`Target`]. Forwarding:
//! - strips hop-by-hop headers and the caller's `strip_headers` (the server strips its API
//!   key), adds `add_headers`, points `Host` at the upstream and records the original host,
//!   client address and scheme in `X-Forwarded-*` (see `headers`);
//! - streams both bodies frame by frame, never buffering them, so uploads start at once and
//!   server-sent events arrive one by one;
//! - splices HTTP/1.1 upgrades (WebSocket) when the upstream answers 101 (see `upgrade`).
//!
//! Upstream connections are pooled by one hyper-util client per [`Forwarder`]. Connecting has
//! a timeout; responses have none, because event streams and upgraded sessions run for as long
//! as the sandbox keeps them open.

mod headers;
mod upgrade;

use std::error::Error as StdError;
use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{HeaderMap, HeaderName, Request, Response, StatusCode, Uri, Version};
use hyper::upgrade::OnUpgrade;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Any error, boxed, as the source of a [`ProxyError`].
type BoxError = Box<dyn StdError + Send + Sync>;

/// Settings of a [`Forwarder`].
#[derive(Debug, Clone)]
pub struct ForwarderConfig {
    /// Longest wait for a TCP connection to the upstream (default 5 s).
    pub connect_timeout: Duration,
}

impl Default for ForwarderConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
        }
    }
}

/// Where and how to forward one request.
#[derive(Debug, Clone)]
pub struct Target {
    /// The upstream's address (a sandbox's address, reachable only from the host).
    pub addr: SocketAddr,
    /// The path and query to request from the upstream, already rewritten; starts with `/`.
    pub path_and_query: String,
    /// Request headers removed before forwarding (credentials meant for the proxy).
    pub strip_headers: Vec<HeaderName>,
    /// Request headers set before forwarding, replacing any of the same name.
    pub add_headers: HeaderMap,
}

/// Why a request could not be forwarded.
///
/// This crate builds no error responses: callers map these to their own error envelope.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// No connection to the upstream: refused, unroutable or timed out.
    #[error("upstream {addr} unreachable")]
    Unreachable {
        /// The upstream's address.
        addr: SocketAddr,
        /// The connect error.
        #[source]
        source: BoxError,
    },
    /// The connection was made but the exchange failed.
    #[error("upstream request failed")]
    Upstream {
        /// What failed.
        #[source]
        source: BoxError,
    },
    /// The request or target cannot be forwarded as given.
    #[error("bad proxy request: {0}")]
    BadRequest(String),
}

impl ProxyError {
    /// Whether no connection to the upstream could be made (for a 502 versus other errors).
    pub fn is_unreachable(&self) -> bool {
        matches!(self, Self::Unreachable { .. })
    }
}

/// Forwards requests to upstreams over pooled HTTP/1.1 connections.
///
/// Cheap to clone; clones share the connection pool.
#[derive(Debug, Clone)]
pub struct Forwarder {
    client: Client<HttpConnector, Body>,
}

impl Forwarder {
    /// A forwarder with its own connection pool.
    pub fn new(config: ForwarderConfig) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(config.connect_timeout));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new()).build(connector);
        Self { client }
    }

    /// Forwards `req` to `target` and returns the upstream's response, body still streaming.
    ///
    /// For an upgrade the upstream accepts, the 101 response is returned and a task splices
    /// the two connections once the client has received it.
    pub async fn forward(
        &self,
        req: Request<Body>,
        target: &Target,
    ) -> Result<Response<Body>, ProxyError> {
        let (upstream_req, client_upgrade) = upstream_request(req, target)?;
        let mut response = self
            .client
            .request(upstream_req)
            .await
            .map_err(|error| classify(error, target.addr))?;

        let switching = response.status() == StatusCode::SWITCHING_PROTOCOLS;
        if switching {
            let Some(client_upgrade) = client_upgrade else {
                return Err(ProxyError::Upstream {
                    source: "upstream switched protocols without an upgrade request".into(),
                });
            };
            let upstream_upgrade = hyper::upgrade::on(&mut response);
            upgrade::spawn_splice(client_upgrade, upstream_upgrade, target.addr);
        }
        let (mut parts, body) = response.into_parts();
        headers::remove_hop_by_hop(&mut parts.headers, switching);
        Ok(Response::from_parts(parts, Body::new(body)))
    }
}

/// Builds the upstream request from the client's, keeping the body as a stream.
///
/// Returns the client connection's pending upgrade when the request is an upgrade the server
/// can honour (HTTP/1.1 with `Connection: upgrade` and `Upgrade`); otherwise any upgrade
/// headers are dropped with the other hop-by-hop headers.
fn upstream_request(
    req: Request<Body>,
    target: &Target,
) -> Result<(Request<Body>, Option<OnUpgrade>), ProxyError> {
    let uri = upstream_uri(target)?;
    let (mut parts, body) = req.into_parts();
    let client_upgrade = if headers::is_upgrade(&parts.headers) {
        parts.extensions.remove::<OnUpgrade>()
    } else {
        None
    };
    let client = parts
        .extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map(|ConnectInfo(addr)| *addr);

    let mut headers = std::mem::take(&mut parts.headers);
    headers::remove_hop_by_hop(&mut headers, client_upgrade.is_some());
    headers::apply_target_headers(&mut headers, &target.strip_headers, &target.add_headers);
    headers::set_forwarding(&mut headers, target.addr, client);

    let mut upstream = Request::new(body);
    *upstream.method_mut() = parts.method;
    *upstream.uri_mut() = uri;
    *upstream.version_mut() = Version::HTTP_11;
    *upstream.headers_mut() = headers;
    Ok((upstream, client_upgrade))
}

/// `http://{addr}{path_and_query}`.
fn upstream_uri(target: &Target) -> Result<Uri, ProxyError> {
    if !target.path_and_query.starts_with('/') {
        return Err(ProxyError::BadRequest(
            "upstream path does not start with '/'".to_owned(),
        ));
    }
    Uri::builder()
        .scheme("http")
        .authority(target.addr.to_string())
        .path_and_query(target.path_and_query.as_str())
        .build()
        .map_err(|error| ProxyError::BadRequest(format!("invalid upstream path: {error}")))
}

/// Tells connect failures (the sandbox port is not there) from failed exchanges.
fn classify(error: hyper_util::client::legacy::Error, addr: SocketAddr) -> ProxyError {
    if error.is_connect() {
        ProxyError::Unreachable {
            addr,
            source: error.into(),
        }
    } else {
        ProxyError::Upstream {
            source: error.into(),
        }
    }
}
