//! `/fastbox/claim`: a restored clone gets its own token, environment and entrypoint.

mod common;

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::*;
use serde_json::{Value, json};

/// The token the template was started with (every clone of it wakes up with this one).
const TEMPLATE: &str = "template-token-0123";
/// The token the claim hands out.
const OWNER: &str = "owner-token-0123456789";

fn template() -> TestApp {
    test_app_with(|c| {
        c.access_token = Some(fastbox_execd::auth::AccessToken::from_secret(
            TEMPLATE.into(),
        ))
    })
    .with_token(TEMPLATE)
}

async fn claim(app: &TestApp, body: Value) -> Reply {
    app.post_json("/fastbox/claim", body).await
}

async fn is_claimed(app: &TestApp) -> bool {
    let r = app.get("/fastbox/claim").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    r.json()["claimed"].as_bool().unwrap()
}

#[tokio::test]
async fn claim_replaces_the_token_on_every_route() {
    let app = template();
    assert!(!is_claimed(&app).await);
    let r = claim(&app, json!({"access_token": OWNER})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(r.json(), json!({"claimed": true, "entrypoint_pid": null}));

    let owner = app.with_token(OWNER);
    for uri in ["/ping", "/fastbox/claim", "/proxy/1/x", "/command/status/x"] {
        let old = app.get(uri).await;
        assert_eq!(old.status, StatusCode::UNAUTHORIZED, "{uri}");
        assert_eq!(old.json()["code"], "UNAUTHORIZED");
        assert_ne!(
            owner.get(uri).await.status,
            StatusCode::UNAUTHORIZED,
            "{uri}"
        );
    }
    assert!(is_claimed(&owner).await);
}

#[tokio::test]
async fn a_template_started_without_a_token_gets_one_at_claim() {
    let app = test_app();
    assert!(!is_claimed(&app).await);
    let r = claim(&app, json!({"access_token": OWNER})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(app.get("/ping").await.status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        app.with_token(OWNER).get("/ping").await.status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn claim_envs_reach_later_processes_and_request_envs_win() {
    let app = template();
    let r = claim(
        &app,
        json!({"access_token": OWNER, "envs": {"CLAIMED": "yes", "BOTH": "claim"}}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let owner = app.with_token(OWNER);

    let ev = owner
        .run(json!({"command": "echo \"$CLAIMED|$BOTH\"", "envs": {"BOTH": "request"}}))
        .await;
    assert_eq!(texts(&ev, "stdout"), ["yes|request"]);
    let ev = owner
        .run(json!({"argv": ["sh", "-c", "echo \"$BOTH\""]}))
        .await;
    assert_eq!(texts(&ev, "stdout"), ["claim"]);

    let session = owner.post_json("/session", json!({})).await.json();
    let id = session["session_id"].as_str().unwrap();
    let r = owner
        .post_json(
            &format!("/session/{id}/run"),
            json!({"command": "echo \"$CLAIMED\""}),
        )
        .await;
    assert_eq!(texts(&r.events(), "stdout"), ["yes"]);
}

#[tokio::test]
async fn claim_envs_file_is_read_at_spawn_and_named_in_execd_envs() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("envs");
    std::fs::write(&file, "FROM_FILE='file'\nBOTH='file'\n").unwrap();
    let app = template();
    let r = claim(
        &app,
        json!({"access_token": OWNER, "envs": {"BOTH": "claim"}, "envs_file": file}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let ev = app
        .with_token(OWNER)
        .run(json!({"command": "echo \"$FROM_FILE|$BOTH|$EXECD_ENVS\""}))
        .await;
    assert_eq!(
        texts(&ev, "stdout"),
        [format!("file|file|{}", file.display())]
    );
}

#[tokio::test]
async fn claim_starts_the_entrypoint_with_the_claim_env() {
    let app = template();
    let r = claim(
        &app,
        json!({
            "access_token": OWNER,
            "envs": {"GREETING": "hello"},
            "entrypoint": ["sh", "-c", "echo \"$GREETING from the entrypoint\"; exec sleep 30"],
        }),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let pid = r.json()["entrypoint_pid"].as_i64().expect("a pid");
    let owner = app.with_token(OWNER);

    let status = owner.get("/fastbox/entrypoint/status").await.json();
    assert_eq!(status["configured"], true);
    assert_eq!(status["running"], true);
    assert_eq!(status["pid"], pid);
    assert_eq!(status["argv"][0], "sh");
    let mut logs = String::new();
    for _ in 0..100 {
        logs = owner.get("/fastbox/entrypoint/logs").await.text();
        if !logs.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(logs, "hello from the entrypoint\n");
    fastbox_execd::shutdown::terminate_children(&app.state, Duration::from_secs(2)).await;
}

#[tokio::test]
async fn an_entrypoint_that_cannot_start_is_reported() {
    let app = template();
    let r = claim(
        &app,
        json!({"access_token": OWNER, "entrypoint": ["/nonexistent/entrypoint"]}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(r.json()["entrypoint_pid"], Value::Null);
    assert!(r.json()["entrypoint_error"].is_string(), "{}", r.text());
    let status = app
        .with_token(OWNER)
        .get("/fastbox/entrypoint/status")
        .await
        .json();
    assert_eq!(status["configured"], true);
    assert_eq!(status["running"], false);
}

#[tokio::test]
async fn claim_without_an_entrypoint_leaves_none() {
    let app = template();
    let r = claim(&app, json!({"access_token": OWNER})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let owner = app.with_token(OWNER);
    let status = owner.get("/fastbox/entrypoint/status").await.json();
    assert_eq!(status["configured"], false);
    assert_eq!(status["running"], false);
    assert_eq!(status["pid"], Value::Null);
    assert_eq!(owner.get("/fastbox/entrypoint/logs").await.text(), "");
}

#[tokio::test]
async fn a_second_claim_is_a_conflict_and_keeps_the_first() {
    let app = template();
    assert_eq!(
        claim(&app, json!({"access_token": OWNER})).await.status,
        StatusCode::OK
    );
    let owner = app.with_token(OWNER);
    let again = claim(&owner, json!({"access_token": "another-token-0123456"})).await;
    assert_eq!(again.status, StatusCode::CONFLICT, "{}", again.text());
    assert_eq!(again.json()["code"], "ALREADY_CLAIMED");
    assert!(again.json()["message"].is_string());
    assert_eq!(owner.get("/ping").await.status, StatusCode::OK);
    assert_eq!(
        app.with_token("another-token-0123456")
            .get("/ping")
            .await
            .status,
        StatusCode::UNAUTHORIZED
    );
}

#[tokio::test]
async fn a_claim_with_a_wrong_token_is_unauthorized_and_changes_nothing() {
    let app = template();
    for intruder in [
        app.with_token("not-the-template-token"),
        without_token(&app),
    ] {
        let r = claim(&intruder, json!({"access_token": OWNER})).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED);
        assert_eq!(r.json()["code"], "UNAUTHORIZED");
    }
    assert!(!is_claimed(&app).await);
    assert_eq!(app.get("/ping").await.status, StatusCode::OK);
}

/// `app` without any token header.
fn without_token(app: &TestApp) -> TestApp {
    TestApp {
        token: None,
        ..app.clone()
    }
}

#[tokio::test]
async fn invalid_claims_are_400_envelopes_and_change_nothing() {
    let app = template();
    let bodies = [
        json!({}),
        json!({"access_token": "too-short"}),
        json!({"access_token": "has a space in it 0123"}),
        json!({"access_token": 12345678901234567u64}),
        json!({"access_token": OWNER, "entrypoint": []}),
        json!({"access_token": OWNER, "entrypoint": "sh"}),
        json!({"access_token": OWNER, "envs": {"A=B": "x"}}),
        json!({"access_token": OWNER, "envs": {"EXECD_ACCESS_TOKEN": OWNER}}),
        json!({"access_token": OWNER, "envs_file": "relative/envs"}),
        json!({"access_token": OWNER, "accessToken": OWNER}),
    ];
    for body in bodies {
        let r = claim(&app, body.clone()).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}: {}", r.text());
        assert_eq!(r.json()["code"], "INVALID_REQUEST_BODY", "{body}");
        assert!(r.json()["message"].is_string(), "{body}");
        assert!(
            !r.text().contains(OWNER),
            "the token is echoed: {}",
            r.text()
        );
    }
    let not_json = app
        .send(
            Request::post("/fastbox/claim")
                .body(Body::from("access_token=x"))
                .unwrap(),
        )
        .await;
    assert_eq!(not_json.status, StatusCode::BAD_REQUEST);
    assert_eq!(not_json.json()["code"], "INVALID_REQUEST_BODY");
    assert!(!is_claimed(&app).await);
    assert_eq!(app.get("/ping").await.status, StatusCode::OK);
}

#[tokio::test]
async fn a_claimed_entrypoint_after_one_started_is_a_conflict_and_changes_nothing() {
    let app = template();
    fastbox_execd::entrypoint::start(&app.state, vec!["true".into()]);
    let r = claim(&app, json!({"access_token": OWNER, "entrypoint": ["true"]})).await;
    assert_eq!(r.status, StatusCode::CONFLICT, "{}", r.text());
    assert_eq!(r.json()["code"], "ENTRYPOINT_ALREADY_STARTED");
    assert!(!is_claimed(&app).await);
    assert_eq!(app.get("/ping").await.status, StatusCode::OK);
    // The same claim without an entrypoint is fine.
    let r = claim(&app, json!({"access_token": OWNER})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
}

/// A made-up certificate: execd checks its shape, not its contents.
const CA_PEM: &str = "-----BEGIN CERTIFICATE-----\nMIIBproxyCA\n-----END CERTIFICATE-----\n";

#[tokio::test]
async fn a_claim_with_the_proxys_ca_installs_it_and_points_programs_at_it() {
    let root = tempfile::tempdir().unwrap();
    let system = root.path().join("etc/ssl/certs/ca-certificates.crt");
    std::fs::create_dir_all(system.parent().unwrap()).unwrap();
    std::fs::write(&system, "SYSTEM ROOTS\n").unwrap();
    let system_root = root.path().to_path_buf();
    let app = test_app_with(|c| {
        c.access_token = Some(fastbox_execd::auth::AccessToken::from_secret(
            TEMPLATE.into(),
        ));
        c.system_root = system_root;
    })
    .with_token(TEMPLATE);

    // Not a certificate: refused, nothing written, not claimed.
    let r = claim(&app, json!({"access_token": OWNER, "trust_ca_pem": "junk"})).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.text());
    assert!(!is_claimed(&app).await);
    assert_eq!(std::fs::read_to_string(&system).unwrap(), "SYSTEM ROOTS\n");

    let r = claim(
        &app,
        json!({"access_token": OWNER, "trust_ca_pem": CA_PEM,
               "envs": {"REQUESTS_CA_BUNDLE": "/mine.pem"}}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(
        std::fs::read_to_string(&system).unwrap(),
        format!("SYSTEM ROOTS\n{CA_PEM}")
    );
    assert_eq!(
        std::fs::read_to_string(root.path().join("etc/fastbox/credential-proxy-ca.pem")).unwrap(),
        CA_PEM
    );
    let ev = app
        .with_token(OWNER)
        .run(json!({"command": "echo \"$SSL_CERT_FILE|$NODE_EXTRA_CA_CERTS|$REQUESTS_CA_BUNDLE\""}))
        .await;
    assert_eq!(
        texts(&ev, "stdout"),
        ["/etc/fastbox/ca-bundle.pem|/etc/fastbox/credential-proxy-ca.pem|/mine.pem"],
        "the claim's own variables win"
    );
}
