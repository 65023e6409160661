//! `/proxy/{port}/...` to a local HTTP server: plain requests, streaming and WebSocket.

mod common;

use std::time::Duration;

use axum::Router;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use common::*;
use futures::{SinkExt, StreamExt};

async fn upstream() -> u16 {
    let app = Router::new()
        .route(
            "/hello",
            get(|headers: HeaderMap, uri: axum::http::Uri| async move {
                let leaked = headers.contains_key("x-execd-access-token");
                format!("hi {} token={leaked}", uri.query().unwrap_or(""))
            }),
        )
        .route(
            "/echo",
            post(|body: String| async move { (StatusCode::CREATED, body) }),
        )
        .route(
            "/stream",
            get(|| async {
                let s = futures::stream::unfold(0, |i| async move {
                    if i == 3 {
                        return None;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    Some((
                        Ok::<_, std::convert::Infallible>(format!("data: {i}\n\n")),
                        i + 1,
                    ))
                });
                (
                    [("content-type", "text/event-stream")],
                    axum::body::Body::from_stream(s),
                )
            }),
        )
        .route(
            "/ws",
            get(|ws: WebSocketUpgrade| async move {
                ws.on_upgrade(|mut socket: WebSocket| async move {
                    while let Some(Ok(msg)) = socket.recv().await {
                        if let Message::Text(t) = msg {
                            let _ = socket.send(Message::Text(format!("echo:{t}").into())).await;
                        }
                    }
                })
                .into_response()
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    port
}

#[tokio::test]
async fn proxies_requests_and_strips_the_token() {
    let port = upstream().await;
    let app = test_app_with(|c| {
        c.access_token = Some(fastbox_execd::auth::AccessToken::from_secret("tok".into()))
    });
    let r = app
        .send(
            axum::http::Request::get(format!("/proxy/{port}/hello?a=1&b=2"))
                .header("X-EXECD-ACCESS-TOKEN", "tok")
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.text(), "hi a=1&b=2 token=false");
    let r = app
        .send(
            axum::http::Request::post(format!("/proxy/{port}/echo"))
                .header("X-EXECD-ACCESS-TOKEN", "tok")
                .body(axum::body::Body::from("payload"))
                .unwrap(),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert_eq!(r.text(), "payload");
}

#[tokio::test]
async fn unreachable_port_is_502_and_bad_port_400() {
    let app = test_app();
    let free = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    assert_eq!(
        app.get(&format!("/proxy/{free}/x")).await.status,
        StatusCode::BAD_GATEWAY
    );
    assert_eq!(
        app.get("/proxy/notaport/x").await.status,
        StatusCode::BAD_REQUEST
    );
}

/// Serves the execd router on a real socket (upgrades need one).
async fn serve_execd() -> u16 {
    let app = test_app();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app.router).await.unwrap() });
    port
}

#[tokio::test]
async fn streams_pass_through_unbuffered() {
    let port = upstream().await;
    let execd = serve_execd().await;
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", execd))
        .await
        .unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    stream
        .write_all(format!("GET /proxy/{port}/stream HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut seen = String::new();
    let mut buf = [0u8; 1024];
    let mut first_data_at = None;
    let started = std::time::Instant::now();
    while !seen.contains("data: 2") {
        let n = stream.read(&mut buf).await.unwrap();
        assert!(n > 0);
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        if first_data_at.is_none() && seen.contains("data: 0") {
            first_data_at = Some(started.elapsed());
        }
    }
    assert!(seen.contains("text/event-stream"));
    assert!(
        first_data_at.unwrap() < Duration::from_millis(140),
        "first event was buffered"
    );
}

#[tokio::test]
async fn websocket_upgrades_are_spliced() {
    let port = upstream().await;
    let execd = serve_execd().await;
    let (mut ws, resp) =
        tokio_tungstenite::connect_async(format!("ws://127.0.0.1:{execd}/proxy/{port}/ws"))
            .await
            .unwrap();
    assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
    ws.send(tokio_tungstenite::tungstenite::Message::Text("ping".into()))
        .await
        .unwrap();
    let reply = tokio::time::timeout(Duration::from_secs(5), ws.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(reply.into_text().unwrap().as_str(), "echo:ping");
}
