//! `/metrics` and `/metrics/watch` shapes.

mod common;

use axum::http::StatusCode;
use common::*;
use http_body_util::BodyExt;
use tower::ServiceExt;

fn check(m: &serde_json::Value) {
    let f = |k: &str| {
        m[k].as_f64()
            .unwrap_or_else(|| panic!("{k} missing in {m}"))
    };
    assert!(f("cpu_count") > 0.0);
    assert!((0.0..=100.0).contains(&f("cpu_used_pct")));
    assert!(f("mem_total_mib") > 0.0);
    assert!(f("mem_used_mib") <= f("mem_total_mib"));
    let now = fastbox_execd::clock::now_ms();
    assert!(m["timestamp"].as_u64().unwrap().abs_diff(now) < 120_000);
}

#[tokio::test]
async fn metrics_has_the_sdk_fields() {
    let app = test_app();
    let r = app.get("/metrics").await;
    assert_eq!(r.status, StatusCode::OK);
    check(&r.json());
}

#[tokio::test]
async fn watch_streams_one_json_line_per_second() {
    let app = test_app();
    let resp = app
        .router
        .clone()
        .oneshot(
            axum::http::Request::get("/metrics/watch")
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let mut text = String::new();
    let started = std::time::Instant::now();
    while text.matches('\n').count() < 2 {
        let frame = body.frame().await.unwrap().unwrap();
        text.push_str(std::str::from_utf8(frame.data_ref().unwrap()).unwrap());
    }
    assert!(started.elapsed() >= std::time::Duration::from_millis(900));
    for line in text.lines().take(2) {
        check(&serde_json::from_str(line).unwrap());
    }
}
