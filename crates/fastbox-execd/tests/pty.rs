//! `/pty`: a shell on a pseudo-terminal over WebSocket.

mod common;

use std::time::Duration;

use axum::http::StatusCode;
use common::*;
use futures::{SinkExt, StreamExt};
use serde_json::json;
use tokio_tungstenite::tungstenite::Message;

#[tokio::test]
async fn pty_echoes_and_reports_exit() {
    let app = test_app();
    let r = app.post_json("/pty", json!({})).await;
    assert_eq!(r.status, StatusCode::CREATED);
    let id = r.json()["session_id"].as_str().unwrap().to_string();
    let status = app.get(&format!("/pty/{id}")).await.json();
    assert_eq!(status["running"], false);
    assert_eq!(status["launch_attempted"], false);

    let router = app.router.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });

    let (mut ws, _) =
        tokio_tungstenite::connect_async(format!("ws://127.0.0.1:{port}/pty/{id}/ws"))
            .await
            .unwrap();
    let first = tokio::time::timeout(Duration::from_secs(5), ws.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let connected: serde_json::Value = serde_json::from_str(first.to_text().unwrap()).unwrap();
    assert_eq!(connected["type"], "connected");
    assert_eq!(connected["mode"], "pty");

    // A second client is refused while the first is attached.
    let second =
        tokio_tungstenite::connect_async(format!("ws://127.0.0.1:{port}/pty/{id}/ws")).await;
    assert!(second.is_err());

    ws.send(Message::Text(
        json!({"type": "resize", "cols": 100, "rows": 30})
            .to_string()
            .into(),
    ))
    .await
    .unwrap();
    let mut stdin = vec![0u8];
    stdin.extend_from_slice(b"stty size; echo marker-$((40+2))\n");
    ws.send(Message::Binary(stdin.into())).await.unwrap();
    ws.send(Message::Text(json!({"type": "ping"}).to_string().into()))
        .await
        .unwrap();

    let mut output = Vec::new();
    let mut pong = false;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !String::from_utf8_lossy(&output).contains("marker-42") {
        let msg = tokio::time::timeout_at(deadline, ws.next())
            .await
            .expect("no output")
            .unwrap()
            .unwrap();
        match msg {
            Message::Binary(b) => {
                assert_eq!(b[0], 0x01);
                output.extend_from_slice(&b[1..]);
            }
            Message::Text(t) => pong |= t.contains("pong"),
            _ => {}
        }
    }
    let text = String::from_utf8_lossy(&output);
    assert!(text.contains("30 100"), "resize applies: {text}");
    assert!(pong);
    let running = app.get(&format!("/pty/{id}")).await.json();
    assert_eq!(running["running"], true);
    assert!(running["output_offset"].as_u64().unwrap() > 0);

    ws.send(Message::Text(
        json!({"type": "stdin", "data": "exit 5\n"})
            .to_string()
            .into(),
    ))
    .await
    .unwrap();
    let mut exit_code = None;
    while exit_code.is_none() {
        match tokio::time::timeout_at(deadline, ws.next())
            .await
            .expect("no exit frame")
        {
            Some(Ok(Message::Text(t))) => {
                let v: serde_json::Value = serde_json::from_str(&t).unwrap();
                if v["type"] == "exit" {
                    exit_code = v["exit_code"].as_i64();
                }
            }
            Some(Ok(_)) => {}
            _ => break,
        }
    }
    assert_eq!(exit_code, Some(5));

    // Reconnecting replays what was printed.
    let (mut ws, _) =
        tokio_tungstenite::connect_async(format!("ws://127.0.0.1:{port}/pty/{id}/ws?since=0"))
            .await
            .unwrap();
    let replay = tokio::time::timeout(Duration::from_secs(5), ws.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let bytes = replay.into_data();
    assert_eq!(bytes[0], 0x03);
    assert!(String::from_utf8_lossy(&bytes[9..]).contains("marker-42"));

    assert_eq!(
        app.delete(&format!("/pty/{id}")).await.status,
        StatusCode::OK
    );
    assert_eq!(
        app.get(&format!("/pty/{id}")).await.status,
        StatusCode::NOT_FOUND
    );
}
