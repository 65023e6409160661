//! Router-level behaviour: ping, access token, unsupported and unknown routes, entrypoint.

mod common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::*;

#[tokio::test]
async fn ping_is_an_empty_200() {
    let app = test_app();
    let r = app.get("/ping").await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.body.is_empty());
}

#[tokio::test]
async fn token_is_required_on_every_route_when_configured() {
    let app = test_app_with(|c| {
        c.access_token = Some(fastbox_execd::auth::AccessToken::from_secret(
            "s3cret".into(),
        ))
    });
    for uri in ["/ping", "/command/status/x", "/proxy/1/x", "/metrics"] {
        let r = app.get(uri).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{uri}");
        assert_eq!(r.json()["code"], "UNAUTHORIZED");
        assert!(
            r.json()["message"]
                .as_str()
                .unwrap()
                .contains("X-EXECD-ACCESS-TOKEN")
        );
    }
    let wrong = app
        .send(
            Request::get("/ping")
                .header("X-EXECD-ACCESS-TOKEN", "s3cre")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
    let right = app
        .send(
            Request::get("/ping")
                .header("x-execd-access-token", "s3cret")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(right.status, StatusCode::OK);
}

#[tokio::test]
async fn isolation_is_reported_unavailable_as_the_spec_has_it() {
    let app = test_app();
    let caps = app.get("/v1/isolated/capabilities").await;
    assert_eq!(caps.status, StatusCode::OK);
    assert_eq!(caps.json()["available"], false);
    assert!(
        caps.json()["message"]
            .as_str()
            .unwrap()
            .contains("bootstrap.execd.isolation=enable")
    );
    for uri in [
        "/v1/isolated/session",
        "/v1/isolated/sessions",
        "/v1/isolated",
    ] {
        let r = app.get(uri).await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{uri}");
        assert_eq!(r.json()["code"], "NOT_SUPPORTED");
    }
    let r = app
        .post_json("/v1/isolated/session", serde_json::json!({}))
        .await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
}

/// With `--isolation` the routes are served; requests are validated before anything is
/// built (sessions themselves are built in real sandboxes: `tests/sdk/test_isolated_sessions.py`).
#[tokio::test]
async fn isolation_routes_validate_before_building() {
    let app = test_app_with(|c| c.isolation = true);
    let caps = app.get("/v1/isolated/capabilities").await;
    assert_eq!(caps.json()["available"], true, "{:?}", caps.json());
    assert_eq!(
        app.get("/v1/isolated/sessions").await.json()["sessions"],
        serde_json::json!([])
    );
    let r = app
        .post_json(
            "/v1/isolated/session",
            serde_json::json!({"workspace": {"path": "relative"}}),
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{:?}", r.json());
    assert!(r.json()["message"].as_str().unwrap().contains("absolute"));
    let r = app
        .post_json(
            "/v1/isolated/session",
            serde_json::json!({"overlays": [{"path": "/tmp/x", "persist": true}]}),
        )
        .await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{:?}", r.json());
    let missing = "/v1/isolated/session/00000000-0000-4000-8000-000000000000";
    assert_eq!(app.get(missing).await.status, StatusCode::NOT_FOUND);
    assert_eq!(
        app.get(&format!("{missing}/files/info?path=/"))
            .await
            .status,
        StatusCode::NOT_FOUND
    );
    let r = app
        .post_json(&format!("{missing}/commit"), serde_json::json!({}))
        .await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test]
async fn unknown_routes_are_404_envelopes() {
    let app = test_app();
    let r = app.get("/nope").await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert!(r.json()["code"].is_string());
}

#[tokio::test]
async fn entrypoint_is_supervised_and_logged() {
    let app = test_app();
    let status = app.get("/fastbox/entrypoint/status").await.json();
    assert_eq!(status["configured"], false);
    fastbox_execd::entrypoint::start(
        &app.state,
        vec![
            "sh".into(),
            "-c".into(),
            "echo started; echo oops >&2; exit 4".into(),
        ],
    );
    let mut status = serde_json::Value::Null;
    for _ in 0..100 {
        status = app.get("/fastbox/entrypoint/status").await.json();
        if status["running"] == false {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(status["exit_code"], 4);
    assert_eq!(status["argv"][0], "sh");
    let logs = app.get("/fastbox/entrypoint/logs").await;
    let text = logs.text();
    assert!(
        text.contains("started\n") && text.contains("oops\n"),
        "{text}"
    );
}

#[tokio::test]
async fn code_port_answers_http_200_and_reports_the_probe() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let probes = Arc::new(AtomicUsize::new(0));
    let counted = probes.clone();
    let port = fastbox_execd::code_port::spawn(0, move || {
        counted.fetch_add(1, Ordering::SeqCst);
    })
    .await
    .unwrap();
    let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    conn.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = String::new();
    conn.read_to_string(&mut buf).await.unwrap();
    assert!(buf.starts_with("HTTP/1.1 200 OK"), "{buf}");
    assert_eq!(probes.load(Ordering::SeqCst), 1);
}
