//! Helpers shared by the integration tests: an in-process router, request builders and an
//! event-stream parser.
#![allow(dead_code)]

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Request, StatusCode};
use fastbox_execd::{AppState, Config, app};
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;

#[derive(Clone)]
pub struct TestApp {
    pub router: Router,
    pub state: AppState,
    /// Sent as `X-EXECD-ACCESS-TOKEN` on every request that does not carry one.
    pub token: Option<String>,
}

pub fn test_app() -> TestApp {
    test_app_with(|_| {})
}

pub fn test_app_with(adjust: impl FnOnce(&mut Config)) -> TestApp {
    let env: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| k != "EXECD_ENVS")
        .collect();
    let mut config = Config::with_env(env);
    adjust(&mut config);
    let state = AppState::new(config).expect("state");
    TestApp {
        router: app(state.clone()),
        state,
        token: None,
    }
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not json ({e}): {:?}", self.text()))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .map(|v| v.to_str().unwrap().to_string())
    }

    /// The body split into stream events (`{json}\n\n` frames).
    pub fn events(&self) -> Vec<Value> {
        parse_events(&self.text())
    }
}

pub fn parse_events(text: &str) -> Vec<Value> {
    text.split("\n\n")
        .filter(|f| !f.trim().is_empty())
        .map(|f| serde_json::from_str(f).unwrap_or_else(|e| panic!("bad frame {f:?}: {e}")))
        .collect()
}

impl TestApp {
    /// The same app, with every request carrying `token`.
    pub fn with_token(&self, token: &str) -> TestApp {
        TestApp {
            token: Some(token.to_string()),
            ..self.clone()
        }
    }

    pub async fn send(&self, mut req: Request<Body>) -> Reply {
        if let Some(token) = &self.token {
            let headers = req.headers_mut();
            if !headers.contains_key("x-execd-access-token") {
                headers.insert("x-execd-access-token", token.parse().unwrap());
            }
        }
        let resp = self.router.clone().oneshot(req).await.unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        Reply {
            status,
            headers,
            body,
        }
    }

    pub async fn get(&self, uri: &str) -> Reply {
        self.send(Request::get(uri).body(Body::empty()).unwrap())
            .await
    }

    pub async fn delete(&self, uri: &str) -> Reply {
        self.send(Request::delete(uri).body(Body::empty()).unwrap())
            .await
    }

    pub async fn post_json(&self, uri: &str, body: Value) -> Reply {
        self.send(
            Request::post(uri)
                .header("content-type", "application/json")
                .body(Body::from(body.to_string()))
                .unwrap(),
        )
        .await
    }

    /// Runs a command to completion and returns its events.
    pub async fn run(&self, body: Value) -> Vec<Value> {
        let r = self.post_json("/command", body).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        assert_eq!(
            r.header("content-type").as_deref(),
            Some("text/event-stream")
        );
        r.events()
    }
}

/// The event types in order.
pub fn types(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["type"].as_str().unwrap().to_string())
        .collect()
}

/// Texts of events of one type.
pub fn texts(events: &[Value], kind: &str) -> Vec<String> {
    events
        .iter()
        .filter(|e| e["type"] == kind)
        .map(|e| e["text"].as_str().unwrap_or_default().to_string())
        .collect()
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

pub fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// A multipart body of metadata/file pairs as the SDK sends it.
pub fn upload_body(files: &[(Value, &[u8])]) -> (String, Vec<u8>) {
    let boundary = "opensandbox_0123456789abcdef_1700000000";
    let mut body = Vec::new();
    for (meta, data) in files {
        body.extend_from_slice(format!("--{boundary}\r\nContent-Disposition: form-data; name=\"metadata\"; filename=\"metadata\"\r\nContent-Type: application/json\r\n\r\n{meta}\r\n").as_bytes());
        body.extend_from_slice(format!("--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f\"\r\nContent-Type: application/octet-stream\r\n\r\n").as_bytes());
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

/// Polls `GET /command/status/{id}` until the command is no longer running.
pub async fn wait_finished(app: &TestApp, id: &str) -> Value {
    for _ in 0..200 {
        let s = app.get(&format!("/command/status/{id}")).await.json();
        if s["running"] == false {
            return s;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    panic!("command {id} did not finish");
}
