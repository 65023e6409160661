//! Forwarding through a real proxy server to real upstreams on 127.0.0.1.

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::routing::{get, post};
use bytes::Bytes;
use fastbox_proxy::{Forwarder, ForwarderConfig, ProxyError, Target};
use futures::{SinkExt, StreamExt};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::Value;
use tokio::sync::{Notify, mpsc};
use tokio_tungstenite::tungstenite::Message;

use support::{client, echo_app, serve, serve_proxy, serve_ws_echo};

/// Longest wait for anything that should happen at once.
const PATIENCE: Duration = Duration::from_secs(5);

async fn send(req: axum::http::Request<Body>) -> axum::http::Response<Incoming> {
    tokio::time::timeout(PATIENCE, client().request(req))
        .await
        .expect("response in time")
        .unwrap()
}

async fn json_body(response: axum::http::Response<Incoming>) -> Value {
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&bytes).unwrap()
}

async fn plain_proxy(upstream: SocketAddr) -> SocketAddr {
    serve_proxy(upstream, Vec::new(), HeaderMap::new()).await
}

#[tokio::test]
async fn get_and_post_reach_upstream_with_query_and_body() {
    let proxy = plain_proxy(serve(echo_app()).await).await;

    let get = axum::http::Request::get(format!("http://{proxy}/a/b?x=1&y=two%20words"))
        .body(Body::empty())
        .unwrap();
    let response = send(get).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-upstream"], "echo");
    let seen = json_body(response).await;
    assert_eq!(seen["method"], "GET");
    assert_eq!(seen["path"], "/a/b");
    assert_eq!(seen["query"], "x=1&y=two%20words");

    let post = axum::http::Request::post(format!("http://{proxy}/upload"))
        .header("content-type", "text/plain")
        .body(Body::from("hello body"))
        .unwrap();
    let seen = json_body(send(post).await).await;
    assert_eq!(seen["method"], "POST");
    assert_eq!(seen["body"], "hello body");
    assert_eq!(seen["headers"]["content-type"][0], "text/plain");
}

#[tokio::test]
async fn api_key_is_stripped_and_target_headers_are_added() {
    let upstream = serve(echo_app()).await;
    let mut add = HeaderMap::new();
    add.insert("x-fastbox-sandbox", HeaderValue::from_static("sbx-1"));
    let strip = vec![HeaderName::from_static("open-sandbox-api-key")];
    let proxy = serve_proxy(upstream, strip, add).await;

    let req = axum::http::Request::get(format!("http://{proxy}/"))
        .header("OPEN-SANDBOX-API-KEY", "secret")
        .header("x-fastbox-sandbox", "spoofed")
        .body(Body::empty())
        .unwrap();
    let seen = json_body(send(req).await).await;
    let headers = &seen["headers"];
    assert!(headers.get("open-sandbox-api-key").is_none(), "{headers}");
    assert_eq!(headers["x-fastbox-sandbox"], serde_json::json!(["sbx-1"]));
    assert_eq!(headers["host"][0], upstream.to_string());
    assert_eq!(headers["x-forwarded-host"][0], proxy.to_string());
    assert_eq!(headers["x-forwarded-for"][0], "127.0.0.1");
    assert_eq!(headers["x-forwarded-proto"][0], "http");
}

#[tokio::test]
async fn hop_by_hop_headers_are_removed_both_ways() {
    let proxy = plain_proxy(serve(echo_app()).await).await;
    let req = axum::http::Request::get(format!("http://{proxy}/"))
        .header("connection", "keep-alive, x-client-hop")
        .header("x-client-hop", "1")
        .header("keep-alive", "timeout=5")
        .header("proxy-authorization", "Basic eDp5")
        .header("te", "trailers")
        .header("x-end-to-end", "kept")
        .body(Body::empty())
        .unwrap();
    let response = send(req).await;
    for name in ["x-upstream-hop", "keep-alive", "proxy-authenticate"] {
        assert!(!response.headers().contains_key(name), "response {name}");
    }
    let seen = json_body(response).await;
    let headers = seen["headers"].as_object().unwrap();
    for name in [
        "connection",
        "x-client-hop",
        "keep-alive",
        "proxy-authorization",
        "te",
    ] {
        assert!(!headers.contains_key(name), "request {name}: {headers:?}");
    }
    assert_eq!(headers["x-end-to-end"][0], "kept");
}

#[tokio::test]
async fn request_body_is_streamed_to_upstream() {
    let (first_seen_tx, mut first_seen_rx) = mpsc::channel::<()>(1);
    let upstream = serve(Router::new().route(
        "/upload",
        post(move |req: Request| async move {
            let mut body = req.into_body();
            let mut received = Vec::new();
            while let Some(frame) = body.frame().await {
                if let Ok(data) = frame.unwrap().into_data() {
                    received.extend_from_slice(&data);
                    let _ = first_seen_tx.try_send(());
                }
            }
            received
        }),
    ))
    .await;
    let proxy = plain_proxy(upstream).await;

    let (chunks_tx, chunks_rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(4);
    let body = Body::from_stream(stream_of(chunks_rx));
    let req = axum::http::Request::post(format!("http://{proxy}/upload"))
        .body(body)
        .unwrap();
    let response = tokio::spawn(async move { client().request(req).await.unwrap() });

    chunks_tx.send(Ok(Bytes::from("first,"))).await.unwrap();
    tokio::time::timeout(PATIENCE, first_seen_rx.recv())
        .await
        .expect("upstream saw the first chunk before the upload ended");
    chunks_tx.send(Ok(Bytes::from("second"))).await.unwrap();
    drop(chunks_tx);

    let response = tokio::time::timeout(PATIENCE, response)
        .await
        .unwrap()
        .unwrap();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "first,second");
}

#[tokio::test]
async fn server_sent_events_are_not_buffered() {
    let client_saw_first = Arc::new(Notify::new());
    let second_sent = Arc::new(AtomicBool::new(false));
    let (saw, sent) = (client_saw_first.clone(), second_sent.clone());
    let upstream = serve(Router::new().route(
        "/events",
        get(move || async move {
            let events = two_events(saw, sent);
            (
                [("content-type", "text/event-stream")],
                Body::from_stream(events),
            )
        }),
    ))
    .await;
    let proxy = plain_proxy(upstream).await;

    let req = axum::http::Request::get(format!("http://{proxy}/events"))
        .body(Body::empty())
        .unwrap();
    let mut body = send(req).await.into_body();
    let mut received = Vec::new();
    while !received.ends_with(b"data: one\n\n") {
        let frame = tokio::time::timeout(PATIENCE, body.frame()).await.unwrap();
        received.extend_from_slice(&frame.unwrap().unwrap().into_data().unwrap());
    }
    assert!(
        !second_sent.load(Ordering::SeqCst),
        "first event arrived only after the second was sent"
    );
    client_saw_first.notify_one();
    let rest = tokio::time::timeout(PATIENCE, body.collect())
        .await
        .unwrap();
    assert_eq!(rest.unwrap().to_bytes(), "data: two\n\n");
}

/// Sends `data: one`; once the client has it (or patience ran out), waits ~300 ms more, then
/// records that it sends `data: two` and sends it.
fn two_events(
    client_saw_first: Arc<Notify>,
    second_sent: Arc<AtomicBool>,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> {
    let first = futures::stream::once(async { Ok(Bytes::from("data: one\n\n")) });
    let second = futures::stream::once(async move {
        let _ = tokio::time::timeout(PATIENCE, client_saw_first.notified()).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        second_sent.store(true, Ordering::SeqCst);
        Ok(Bytes::from("data: two\n\n"))
    });
    first.chain(second)
}

/// A stream of the items sent on `rx`.
fn stream_of<T: Send + 'static>(
    rx: mpsc::Receiver<T>,
) -> impl futures::Stream<Item = T> + Send + 'static {
    futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
}

#[tokio::test]
async fn websocket_messages_pass_through_the_proxy() {
    let proxy = plain_proxy(serve_ws_echo().await).await;
    let (mut ws, response) = tokio::time::timeout(
        PATIENCE,
        tokio_tungstenite::connect_async(format!("ws://{proxy}/ws?session=1")),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(response.status(), StatusCode::SWITCHING_PROTOCOLS);

    for message in [
        Message::text("hello through the proxy"),
        Message::binary(vec![0u8, 1, 2, 254, 255]),
    ] {
        ws.send(message.clone()).await.unwrap();
        let echoed = tokio::time::timeout(PATIENCE, ws.next()).await.unwrap();
        assert_eq!(echoed.unwrap().unwrap(), message);
    }

    ws.close(None).await.unwrap();
    let reply = tokio::time::timeout(PATIENCE, ws.next()).await.unwrap();
    assert!(matches!(reply, Some(Ok(Message::Close(_)))), "{reply:?}");
    let end = tokio::time::timeout(PATIENCE, ws.next()).await.unwrap();
    assert!(end.is_none(), "{end:?}");
}

fn target(addr: SocketAddr, path_and_query: &str) -> Target {
    Target {
        addr,
        path_and_query: path_and_query.to_owned(),
        strip_headers: Vec::new(),
        add_headers: HeaderMap::new(),
    }
}

fn empty_get() -> axum::http::Request<Body> {
    axum::http::Request::builder()
        .method(Method::GET)
        .uri("/")
        .body(Body::empty())
        .unwrap()
}

#[tokio::test]
async fn refused_connection_is_unreachable_at_once() {
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let forwarder = Forwarder::new(ForwarderConfig::default());
    let started = Instant::now();
    let error = forwarder
        .forward(empty_get(), &target(closed, "/"))
        .await
        .unwrap_err();
    assert!(error.is_unreachable(), "{error:?}");
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(matches!(error, ProxyError::Unreachable { addr, .. } if addr == closed));
}

#[tokio::test]
async fn connect_timeout_is_unreachable() {
    // TEST-NET-1 is never routed: the connect either times out or fails at once.
    let blackhole: SocketAddr = "192.0.2.1:9".parse().unwrap();
    let forwarder = Forwarder::new(ForwarderConfig {
        connect_timeout: Duration::from_millis(200),
    });
    let started = Instant::now();
    let error = forwarder
        .forward(empty_get(), &target(blackhole, "/"))
        .await
        .unwrap_err();
    assert!(error.is_unreachable(), "{error:?}");
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[tokio::test]
async fn relative_target_path_is_a_bad_request() {
    let forwarder = Forwarder::new(ForwarderConfig::default());
    let addr: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let error = forwarder
        .forward(empty_get(), &target(addr, "no-slash"))
        .await
        .unwrap_err();
    assert!(matches!(error, ProxyError::BadRequest(_)), "{error:?}");
    assert!(!error.is_unreachable());
}
