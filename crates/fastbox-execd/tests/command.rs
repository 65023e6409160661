//! `/command`: event sequences, background status and logs, timeout, interrupt, validation.

mod common;

use std::time::{Duration, Instant};

use axum::http::StatusCode;
use common::*;
use serde_json::json;

#[tokio::test]
async fn success_streams_init_lines_and_completion() {
    let app = test_app();
    let ev = app.run(json!({"command": "echo hi; echo there"})).await;
    assert_eq!(
        types(&ev),
        ["init", "stdout", "stdout", "execution_complete"]
    );
    assert_eq!(ev[0]["text"].as_str().unwrap().len(), 36);
    assert_eq!(texts(&ev, "stdout"), ["hi", "there"]);
    assert!(ev[3]["execution_time"].is_u64());
    assert!(
        ev.iter()
            .all(|e| e["timestamp"].as_u64().unwrap() > 1_600_000_000_000)
    );
}

#[tokio::test]
async fn failure_ends_with_command_exec_error_and_no_completion() {
    let app = test_app();
    let ev = app
        .run(json!({"command": "echo out; echo err >&2; exit 3"}))
        .await;
    let t = types(&ev);
    assert_eq!(t.first().unwrap(), "init");
    assert_eq!(t.last().unwrap(), "error");
    assert!(!t.contains(&"execution_complete".to_string()));
    assert_eq!(texts(&ev, "stdout"), ["out"]);
    assert_eq!(texts(&ev, "stderr"), ["err"]);
    let err = &ev.last().unwrap()["error"];
    assert_eq!(err["ename"], "CommandExecError");
    assert_eq!(err["evalue"], "3");
    assert_eq!(err["traceback"], json!(["exit status 3"]));
}

#[tokio::test]
async fn blank_lines_and_unterminated_tail() {
    let app = test_app();
    let ev = app
        .run(json!({"command": "printf 'a\\n\\nb\\r\\nc'"}))
        .await;
    assert_eq!(texts(&ev, "stdout"), ["a", "\n", "b", "c"]);
    assert_eq!(types(&ev).last().unwrap(), "execution_complete");
}

#[tokio::test]
async fn missing_program_reports_shell_not_found() {
    let app = test_app();
    let ev = app
        .run(json!({"command": "definitely-not-a-command-xyz"}))
        .await;
    assert!(texts(&ev, "stderr").join("\n").contains("not found"));
    assert_eq!(ev.last().unwrap()["error"]["evalue"], "127");
}

#[tokio::test]
async fn argv_runs_without_a_shell() {
    let app = test_app();
    let ev = app
        .run(json!({"argv": ["printf", "%s|", "a b", "$HOME"]}))
        .await;
    assert_eq!(texts(&ev, "stdout"), ["a b|$HOME|"]);
}

#[tokio::test]
async fn argv_spawn_failure_is_init_then_error() {
    let app = test_app();
    let ev = app.run(json!({"argv": ["/nonexistent/binary"]})).await;
    assert_eq!(types(&ev), ["init", "error"]);
    let id = ev[0]["text"].as_str().unwrap();
    let status = app.get(&format!("/command/status/{id}")).await.json();
    assert_eq!(status["running"], false);
    assert!(
        status["error"]
            .as_str()
            .unwrap()
            .contains("/nonexistent/binary")
    );
}

#[tokio::test]
async fn cwd_expands_variables_from_the_command_env() {
    let dir = tempfile::tempdir().unwrap();
    let app = test_app();
    let ev = app
        .run(json!({"command": "pwd; echo $GREETING", "cwd": "${BASE}/sub", "envs": {"BASE": dir.path(), "GREETING": "hello"}}))
        .await;
    assert_eq!(
        types(&ev).last().unwrap(),
        "error",
        "sub does not exist yet: spawn fails"
    );
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    let ev = app
        .run(json!({"command": "pwd; echo $GREETING", "cwd": "${BASE}/sub", "envs": {"BASE": dir.path(), "GREETING": "hello"}}))
        .await;
    let canonical = dir.path().join("sub").canonicalize().unwrap();
    assert_eq!(texts(&ev, "stdout"), [canonical.to_str().unwrap(), "hello"]);
}

#[tokio::test]
async fn undefined_cwd_variable_is_rejected() {
    let app = test_app();
    let r = app
        .post_json(
            "/command",
            json!({"command": "true", "cwd": "$NOPE_NOT_SET_X"}),
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.json()["code"], "INVALID_REQUEST_BODY");
}

#[tokio::test]
async fn envs_file_is_read_at_every_spawn_and_request_envs_win() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("envs");
    let app = test_app_with(|c| c.envs_file = Some(file.clone()));
    std::fs::write(&file, "A='from file'\nB=\"also \\\"file\\\"\"\n").unwrap();
    let ev = app
        .run(json!({"command": "echo \"$A|$B\"", "envs": {"B": "request"}}))
        .await;
    assert_eq!(texts(&ev, "stdout"), ["from file|request"]);
    std::fs::write(&file, "A='changed'\n").unwrap();
    let ev = app.run(json!({"command": "echo \"$A\""})).await;
    assert_eq!(texts(&ev, "stdout"), ["changed"]);
}

#[tokio::test]
async fn access_token_is_not_inherited() {
    let app = test_app_with(|c| {
        c.access_token = Some(fastbox_execd::auth::AccessToken::from_secret(
            "secret".into(),
        ))
    });
    let r = app
        .send(
            axum::http::Request::post("/command")
                .header("X-EXECD-ACCESS-TOKEN", "secret")
                .body(axum::body::Body::from(
                    json!({"command": "echo ${EXECD_ACCESS_TOKEN:-unset}"}).to_string(),
                ))
                .unwrap(),
        )
        .await;
    assert_eq!(texts(&r.events(), "stdout"), ["unset"]);
}

#[tokio::test]
async fn background_command_has_status_and_cursor_logs() {
    let app = test_app();
    let ev = app
        .run(json!({"command": "echo one; echo two >&2; sleep 0.3; printf three", "background": true}))
        .await;
    assert_eq!(types(&ev), ["init", "execution_complete"]);
    let id = ev[0]["text"].as_str().unwrap().to_string();
    let running = app.get(&format!("/command/status/{id}")).await.json();
    assert_eq!(running["running"], true);
    assert_eq!(running["exit_code"], serde_json::Value::Null);
    assert_eq!(running["finished_at"], serde_json::Value::Null);
    let status = wait_finished(&app, &id).await;
    assert_eq!(status["exit_code"], 0);
    assert_eq!(
        status["content"],
        "echo one; echo two >&2; sleep 0.3; printf three"
    );
    assert!(status["finished_at"].as_str().unwrap().ends_with('Z'));

    let all = app.get(&format!("/command/{id}/logs")).await;
    assert_eq!(all.status, StatusCode::OK);
    assert_eq!(all.text(), "one\ntwo\nthree\n");
    assert_eq!(
        all.header("EXECD-COMMANDS-TAIL-CURSOR").as_deref(),
        Some("3")
    );
    let tail = app.get(&format!("/command/{id}/logs?cursor=2")).await;
    assert_eq!(tail.text(), "three\n");
    let none = app.get(&format!("/command/{id}/logs?cursor=3")).await;
    assert_eq!(none.text(), "");
    assert_eq!(
        none.header("EXECD-COMMANDS-TAIL-CURSOR").as_deref(),
        Some("3")
    );
}

#[tokio::test]
async fn timeout_kills_the_process_group() {
    let app = test_app();
    let started = Instant::now();
    let ev = app
        .run(json!({"command": "sleep 30 & sleep 30; echo never", "timeout": 300}))
        .await;
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(ev.last().unwrap()["error"]["evalue"], "137");
    assert!(texts(&ev, "stdout").is_empty());
    let status = app
        .get(&format!(
            "/command/status/{}",
            ev[0]["text"].as_str().unwrap()
        ))
        .await
        .json();
    assert_eq!(status["error"], "command timed out");
}

#[tokio::test]
async fn interrupt_stops_a_background_command() {
    let app = test_app();
    let ev = app
        .run(json!({"command": "sleep 30", "background": true}))
        .await;
    let id = ev[0]["text"].as_str().unwrap();
    let r = app.delete(&format!("/command?id={id}")).await;
    assert_eq!(r.status, StatusCode::OK);
    let status = wait_finished(&app, id).await;
    assert_eq!(status["exit_code"], 143);
    assert_eq!(
        app.delete("/command?id=nope").await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(app.delete("/command").await.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn invalid_requests_are_400_envelopes() {
    let app = test_app();
    for body in [
        json!({"command": "a", "argv": ["b"]}),
        json!({}),
        json!({"argv": [""]}),
        json!({"command": "true", "gid": 5}),
        json!({"command": 5}),
    ] {
        let r = app.post_json("/command", body.clone()).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(r.json()["code"], "INVALID_REQUEST_BODY");
    }
    let r = app.get("/command/status/unknown").await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn uid_and_gid_switch_identity() {
    if !is_root() {
        eprintln!("skipped: switching uid needs root");
        return;
    }
    let app = test_app();
    let ev = app
        .run(json!({"command": "id -u; id -g", "uid": 65534, "gid": 65533}))
        .await;
    assert_eq!(texts(&ev, "stdout"), ["65534", "65533"]);
}

#[tokio::test]
async fn children_get_oom_score_zero() {
    let app = test_app();
    let ev = app
        .run(json!({"command": "cat /proc/self/oom_score_adj"}))
        .await;
    assert_eq!(texts(&ev, "stdout"), ["0"]);
}

#[tokio::test]
async fn keepalive_pings_during_quiet_commands() {
    let app = test_app();
    let ev = app.run(json!({"command": "sleep 3.4; echo done"})).await;
    let pings: Vec<_> = ev.iter().filter(|e| e["type"] == "ping").collect();
    assert!(!pings.is_empty(), "{ev:?}");
    assert_eq!(pings[0]["text"], "pong");
    assert_eq!(types(&ev).last().unwrap(), "execution_complete");
}
