//! `/session`: a bash that keeps cwd and exported env across runs.

mod common;

use axum::http::StatusCode;
use common::*;
use serde_json::{Value, json};

async fn run(app: &TestApp, id: &str, body: Value) -> Vec<Value> {
    let r = app.post_json(&format!("/session/{id}/run"), body).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    r.events()
}

#[tokio::test]
async fn session_keeps_cwd_and_exported_env() {
    let dir = tempfile::tempdir().unwrap();
    let app = test_app();
    let r = app.post_json("/session", json!({"cwd": dir.path()})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let id = r.json()["session_id"].as_str().unwrap().to_string();

    let ev = run(
        &app,
        &id,
        json!({"command": "pwd; mkdir -p sub && cd sub; export GREETING=hi; X=local"}),
    )
    .await;
    assert_eq!(types(&ev), ["init", "stdout", "execution_complete"]);
    assert_eq!(ev[0]["text"], id);
    let base = dir.path().canonicalize().unwrap();
    assert_eq!(texts(&ev, "stdout"), [base.to_str().unwrap()]);

    let ev = run(
        &app,
        &id,
        json!({"command": "pwd; echo \"$GREETING $X\"; printf 'a\\n\\nb'"}),
    )
    .await;
    assert_eq!(
        texts(&ev, "stdout"),
        [
            base.join("sub").to_str().unwrap(),
            "hi local",
            "a",
            "\n",
            "b"
        ]
    );

    let ev = run(&app, &id, json!({"command": "echo oops >&2; false"})).await;
    assert_eq!(texts(&ev, "stderr"), ["oops"]);
    assert_eq!(ev.last().unwrap()["error"]["evalue"], "1");

    // A per-run cwd applies to that run only.
    let ev = run(&app, &id, json!({"command": "pwd", "cwd": "/"})).await;
    assert_eq!(texts(&ev, "stdout"), ["/"]);
    let ev = run(&app, &id, json!({"command": "pwd"})).await;
    assert_eq!(texts(&ev, "stdout"), [base.join("sub").to_str().unwrap()]);

    // Reading stdin sees EOF instead of swallowing the next script.
    let ev = run(&app, &id, json!({"command": "cat; echo after"})).await;
    assert_eq!(texts(&ev, "stdout"), ["after"]);

    assert_eq!(
        app.delete(&format!("/session/{id}")).await.status,
        StatusCode::OK
    );
    assert_eq!(
        app.delete(&format!("/session/{id}")).await.status,
        StatusCode::NOT_FOUND
    );
    let r = app
        .post_json(&format!("/session/{id}/run"), json!({"command": "true"}))
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.json()["code"], "SESSION_NOT_FOUND");
}

#[tokio::test]
async fn exit_and_timeout_end_the_run_and_restart_the_shell() {
    let app = test_app();
    let r = app
        .send(
            axum::http::Request::post("/session")
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "empty body is allowed: {}",
        r.text()
    );
    let id = r.json()["session_id"].as_str().unwrap().to_string();
    run(&app, &id, json!({"command": "export KEEP=1"})).await;

    let ev = run(&app, &id, json!({"command": "echo bye; exit 3"})).await;
    assert_eq!(texts(&ev, "stdout"), ["bye"]);
    assert_eq!(ev.last().unwrap()["error"]["evalue"], "3");

    let ev = run(&app, &id, json!({"command": "echo \"[${KEEP:-}]\""})).await;
    assert_eq!(texts(&ev, "stdout"), ["[]"], "a fresh shell after exit");

    let started = std::time::Instant::now();
    let ev = run(
        &app,
        &id,
        json!({"command": "echo start; sleep 30", "timeout": 300}),
    )
    .await;
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    assert_eq!(texts(&ev, "stdout"), ["start"]);
    assert_eq!(ev.last().unwrap()["error"]["evalue"], "137");
    let ev = run(&app, &id, json!({"command": "echo alive"})).await;
    assert_eq!(texts(&ev, "stdout"), ["alive"]);
}
