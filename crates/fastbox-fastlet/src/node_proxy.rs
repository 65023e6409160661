//! The node proxy: path-form routes to sandbox ports, `/{id}/{port}/...` and, signed,
//! `/{id}/{port}/{expires_b36}/{sig}/...` (OSEP-0011). These are the endpoints the lifecycle
//! API hands out; a sandbox's own address never leaves the node. The lifecycle server's proxy
//! (`/v1/sandboxes/{id}/proxy/{port}/...`) routes through [`NodeProxy::proxy_to_sandbox`] too.
//!
//! Who may pass is [`access`]: a `secureAccess` sandbox's ports need its access token
//! (`OpenSandbox-Secure-Access`) or a valid signed route (else 401); other sandboxes' plain
//! routes are open to anyone who can reach the node proxy (execd still checks its own
//! per-sandbox token); a signed route is checked before anything reaches the sandbox (a
//! tampered or expired one gets 403, or 401 for a secure sandbox). Failed checks are
//! rate-limited per source address (429).
//!
//! Port 18080 (OpenSandbox's egress API) never reaches the sandbox: the node proxy answers it
//! itself ([`egress`]), with the policy operations of the server's [`EgressApi`].

pub mod access;
pub mod egress;
pub mod vault;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use fastbox_api::lifecycle::ErrorResponse;
use fastbox_proxy::{Forwarder, ProxyError, RouteError, RouteKeys, Target, split_route};

use crate::Fastlet;

pub use access::{AccessApi, AccessGuard, Presented, SECURE_ACCESS_HEADER, SandboxAccess};
pub use egress::{
    EGRESS_AUTH_HEADER, EGRESS_PORT, EgressApi, EgressApiError, PolicyChange, VIA_EGRESS_PORT,
};
/// Whether a request without a route signature may pass.
pub use fastbox_node_api::wire::Unsigned;

#[derive(Debug, thiserror::Error)]
pub enum NodeProxyError {
    #[error("no route {0}: expected /{{sandbox id}}/{{port}}/...")]
    BadRoute(String),
    #[error("sandbox {0} is not running on this node")]
    NotRunning(String),
    #[error("route credential rejected: {0}")]
    Forbidden(RouteError),
    #[error("this route needs a signature")]
    Unsigned,
    /// A secure sandbox's port without a valid credential.
    #[error("{0}")]
    Unauthorized(&'static str),
    /// Too many failed credential checks from this source (or from everyone).
    #[error("too many failed credential checks{}; retry in {} s", match .0.by { access::LimitedBy::Source => " from this address", access::LimitedBy::Global => "" }, .0.retry_after_secs())]
    TooManyFailures(access::Limited),
    #[error("sandbox port is unreachable: {0}")]
    Upstream(#[from] ProxyError),
}

impl NodeProxyError {
    pub fn status(&self) -> StatusCode {
        match self {
            Self::BadRoute(_) | Self::NotRunning(_) => StatusCode::NOT_FOUND,
            Self::Forbidden(_) | Self::Unsigned => StatusCode::FORBIDDEN,
            Self::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Self::TooManyFailures(_) => StatusCode::TOO_MANY_REQUESTS,
            Self::Upstream(_) => StatusCode::BAD_GATEWAY,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            Self::BadRoute(_) => "GENERAL::NOT_FOUND",
            Self::NotRunning(_) => "SANDBOX::NOT_FOUND",
            Self::Forbidden(_) | Self::Unsigned => "SANDBOX::ROUTE_FORBIDDEN",
            Self::Unauthorized(_) => "SANDBOX::SECURE_ACCESS_DENIED",
            Self::TooManyFailures(_) => "SANDBOX::TOO_MANY_FAILED_ATTEMPTS",
            Self::Upstream(_) => "SANDBOX::UPSTREAM_UNAVAILABLE",
        }
    }
}

impl IntoResponse for NodeProxyError {
    fn into_response(self) -> Response {
        let body = ErrorResponse {
            code: self.code().to_string(),
            message: self.to_string(),
        };
        let mut response = (self.status(), axum::Json(body)).into_response();
        // The request's body was not read (it was for the sandbox): the connection ends with
        // this answer, and says so, so a keep-alive client does not send its next request on it.
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        if let Self::TooManyFailures(limited) = &self {
            response.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from(limited.retry_after_secs()),
            );
        }
        response
    }
}

/// What the node proxy needs.
#[derive(Clone)]
pub struct NodeProxy {
    pub fastlet: Arc<Fastlet>,
    /// The route signing keys (followed as the key file is rotated).
    pub keys: RouteKeys,
    pub forwarder: Arc<Forwarder>,
    /// The policy operations behind port 18080.
    pub egress: Arc<dyn EgressApi>,
    /// Which sandboxes are secure, and their tokens (the server's records).
    pub access: Arc<dyn AccessApi>,
    /// The credential rules and the failure counters, shared by both proxies.
    pub guard: Arc<AccessGuard>,
}

impl NodeProxy {
    /// Forwards `req` to `port` of sandbox `id`; `path` is what follows `{id}/{port}`
    /// (optionally a route credential, then the sandbox path). `strip` names request
    /// headers that must not reach the sandbox.
    pub async fn proxy_to_sandbox(
        &self,
        id: &str,
        port: u16,
        path: &str,
        unsigned: Unsigned,
        strip: &[HeaderName],
        req: Request,
    ) -> Result<Response, NodeProxyError> {
        let signer = self.keys.current();
        let route = split_route(path, |c| signer.holds(c));
        // Only a sandbox this node runs is asked about (the server may read its store).
        let sandbox = self
            .fastlet
            .route(id)
            .ok_or_else(|| NodeProxyError::NotRunning(id.to_string()))?;
        let access = self
            .access
            .access(id)
            .await
            .ok_or_else(|| NodeProxyError::NotRunning(id.to_string()))?;
        let source = req
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map_or(Presented::UNKNOWN_SOURCE, |c| c.0.ip());
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default();
        let presented = Presented {
            route: &route,
            headers: req.headers(),
            source,
            unsigned,
        };
        self.guard
            .authorize(id, port, &access, &signer, &presented, now)?;
        if port == EGRESS_PORT {
            let vault = self.fastlet.vault_cell(id);
            return Ok(
                egress::serve(self.egress.clone(), vault, id, &sandbox, &route.rest, req).await,
            );
        }
        let path_and_query = match req.uri().query() {
            Some(q) => format!("{}?{q}", route.rest),
            None => route.rest.clone(),
        };
        // The access token is the proxies' business, never the sandbox's.
        let mut strip_headers = strip.to_vec();
        strip_headers.push(HeaderName::from_static("opensandbox-secure-access"));
        let target = Target {
            addr: (sandbox.address, port).into(),
            path_and_query,
            strip_headers,
            add_headers: HeaderMap::new(),
        };
        Ok(self.forwarder.forward(req, &target).await?)
    }
}

/// The node proxy's HTTP service.
pub fn router(proxy: NodeProxy) -> Router {
    Router::new().fallback(route).with_state(proxy)
}

async fn route(State(proxy): State<NodeProxy>, req: Request<Body>) -> Response {
    let path = req.uri().path().to_string();
    let Some((id, port, rest)) = split_prefix(&path) else {
        return NodeProxyError::BadRoute(path).into_response();
    };
    proxy
        .proxy_to_sandbox(id, port, rest, Unsigned::Allowed, &[], req)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `/{id}/{port}{rest}` -> (id, port, rest).
pub fn split_prefix(path: &str) -> Option<(&str, u16, &str)> {
    let path = path.strip_prefix('/')?;
    let (id, after) = path.split_once('/')?;
    let (port, rest) = match after.find('/') {
        Some(i) => (&after[..i], &after[i..]),
        None => (after, ""),
    };
    let port: u16 = port.parse().ok().filter(|p| *p != 0)?;
    (!id.is_empty()).then_some((id, port, rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_prefixes() {
        assert_eq!(
            split_prefix("/abc/44772/ping"),
            Some(("abc", 44772, "/ping"))
        );
        assert_eq!(split_prefix("/abc/44772"), Some(("abc", 44772, "")));
        assert_eq!(split_prefix("/abc/44772/"), Some(("abc", 44772, "/")));
        assert_eq!(split_prefix("/abc/x/ping"), None);
        assert_eq!(split_prefix("/abc/0/ping"), None);
        assert_eq!(split_prefix("/abc"), None);
        assert_eq!(split_prefix("//1"), None);
    }
}
