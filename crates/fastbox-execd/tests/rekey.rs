//! `/fastbox/rekey`: a clone of a claimed sandbox gets its own token, and nothing else changes.

mod common;

use axum::http::StatusCode;
use common::*;
use serde_json::json;

const TEMPLATE: &str = "template-token-0123";
const OWNER: &str = "owner-token-0123456789";
const CLONE: &str = "clone-token-0123456789";

fn template() -> TestApp {
    test_app_with(|c| {
        c.access_token = Some(fastbox_execd::auth::AccessToken::from_secret(
            TEMPLATE.into(),
        ))
    })
    .with_token(TEMPLATE)
}

async fn rekey(app: &TestApp, token: &str) -> Reply {
    app.post_json("/fastbox/rekey", json!({"access_token": token}))
        .await
}

#[tokio::test]
async fn rekey_of_a_claimed_sandbox_replaces_the_token_and_keeps_the_env() {
    let app = template();
    let r = app
        .post_json(
            "/fastbox/claim",
            json!({"access_token": OWNER, "envs": {"CLAIMED": "yes"}}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let owner = app.with_token(OWNER);
    let before = owner.state.tenancy.current();

    let r = rekey(&owner, CLONE).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(r.json(), json!({"rekeyed": true, "claimed": true}));

    for uri in ["/ping", "/fastbox/claim", "/proxy/1/x", "/command/status/x"] {
        let old = owner.get(uri).await;
        assert_eq!(old.status, StatusCode::UNAUTHORIZED, "{uri}");
        assert_eq!(old.json()["code"], "UNAUTHORIZED");
    }
    let clone = app.with_token(CLONE);
    assert_eq!(clone.get("/ping").await.status, StatusCode::OK);
    assert_eq!(clone.get("/fastbox/claim").await.json()["claimed"], true);
    let after = clone.state.tenancy.current();
    assert_eq!(after.env, before.env);
    assert_eq!(after.envs_file, before.envs_file);
    let ev = clone.run(json!({"command": "echo \"$CLAIMED\""})).await;
    assert_eq!(texts(&ev, "stdout"), ["yes"]);
    // No entrypoint was started by the rekey.
    let status = clone.get("/fastbox/entrypoint/status").await.json();
    assert_eq!(status["configured"], false);
}

#[tokio::test]
async fn rekey_of_an_unclaimed_sandbox_leaves_it_unclaimed_and_claimable() {
    let app = template();
    let r = rekey(&app, CLONE).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(r.json(), json!({"rekeyed": true, "claimed": false}));
    assert_eq!(app.get("/ping").await.status, StatusCode::UNAUTHORIZED);
    let clone = app.with_token(CLONE);
    assert_eq!(clone.get("/fastbox/claim").await.json()["claimed"], false);
    let r = clone
        .post_json("/fastbox/claim", json!({"access_token": OWNER}))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(
        app.with_token(OWNER).get("/ping").await.status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn a_rekey_with_a_wrong_token_is_unauthorized_and_changes_nothing() {
    let app = template();
    let r = rekey(&app.with_token("not-the-template-token"), CLONE).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(app.get("/ping").await.status, StatusCode::OK);
    assert_eq!(
        app.with_token(CLONE).get("/ping").await.status,
        StatusCode::UNAUTHORIZED
    );
}

#[tokio::test]
async fn invalid_rekeys_are_400_envelopes_and_change_nothing() {
    let app = template();
    for body in [
        json!({}),
        json!({"access_token": "too-short"}),
        json!({"access_token": "has a space in it 0123"}),
        json!({"access_token": 12345678901234567u64}),
        json!({"access_token": CLONE, "envs": {"A": "b"}}),
    ] {
        let r = app.post_json("/fastbox/rekey", body.clone()).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}: {}", r.text());
        assert_eq!(r.json()["code"], "INVALID_REQUEST_BODY", "{body}");
        assert!(r.json()["message"].is_string(), "{body}");
        assert!(
            !r.text().contains(CLONE),
            "the token is echoed: {}",
            r.text()
        );
    }
    assert_eq!(app.get("/ping").await.status, StatusCode::OK);
}
