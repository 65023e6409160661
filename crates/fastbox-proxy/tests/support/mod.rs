//! In-process servers for the forwarding tests: upstreams and a proxy that calls `forward`.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use fastbox_proxy::{Forwarder, ForwarderConfig, Target};
use futures::{SinkExt, StreamExt};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Map, Value, json};
use tokio::net::TcpListener;

/// Serves `router` on a fresh 127.0.0.1 port, recording client addresses.
pub async fn serve(router: Router) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let service = router.into_make_service_with_connect_info::<SocketAddr>();
    tokio::spawn(async move { axum::serve(listener, service).await.unwrap() });
    addr
}

/// What the proxy under test does with every request.
struct ProxyState {
    forwarder: Forwarder,
    upstream: SocketAddr,
    strip_headers: Vec<HeaderName>,
    add_headers: HeaderMap,
}

/// Serves a proxy that forwards every request, path and query unchanged, to `upstream`.
pub async fn serve_proxy(
    upstream: SocketAddr,
    strip_headers: Vec<HeaderName>,
    add_headers: HeaderMap,
) -> SocketAddr {
    let state = Arc::new(ProxyState {
        forwarder: Forwarder::new(ForwarderConfig::default()),
        upstream,
        strip_headers,
        add_headers,
    });
    serve(Router::new().fallback(proxy).with_state(state)).await
}

async fn proxy(State(state): State<Arc<ProxyState>>, req: Request) -> Response {
    let target = Target {
        addr: state.upstream,
        path_and_query: req
            .uri()
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned(),
        strip_headers: state.strip_headers.clone(),
        add_headers: state.add_headers.clone(),
    };
    match state.forwarder.forward(req, &target).await {
        Ok(response) => response,
        Err(error) => (StatusCode::BAD_GATEWAY, error.to_string()).into_response(),
    }
}

/// An upstream that answers every request with a JSON description of it.
///
/// The response also carries hop-by-hop headers, which the proxy must drop.
pub fn echo_app() -> Router {
    Router::new().fallback(echo)
}

async fn echo(req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    let mut headers = Map::new();
    for name in parts.headers.keys() {
        let values: Vec<Value> = parts
            .headers
            .get_all(name)
            .iter()
            .map(|v| Value::from(v.to_str().unwrap()))
            .collect();
        headers.insert(name.to_string(), Value::Array(values));
    }
    let description = json!({
        "method": parts.method.as_str(),
        "path": parts.uri.path(),
        "query": parts.uri.query(),
        "headers": headers,
        "body": String::from_utf8_lossy(&body),
    });
    (
        [
            ("content-type", "application/json"),
            ("x-upstream", "echo"),
            ("connection", "x-upstream-hop"),
            ("x-upstream-hop", "1"),
            ("keep-alive", "timeout=5"),
            ("proxy-authenticate", "Basic"),
        ],
        description.to_string(),
    )
        .into_response()
}

/// A WebSocket server echoing text and binary messages; answers a close and stops.
pub async fn serve_ws_echo() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let mut ws = tokio_tungstenite::accept_async(stream).await.unwrap();
                while let Some(Ok(message)) = ws.next().await {
                    if message.is_text() || message.is_binary() {
                        ws.send(message).await.unwrap();
                    }
                }
            });
        }
    });
    addr
}

/// A plain HTTP/1.1 client, as a test's user agent.
pub fn client() -> Client<HttpConnector, Body> {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}
