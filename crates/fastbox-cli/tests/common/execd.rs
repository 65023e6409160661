//! One sandbox's execd as a client reaches it: through the endpoint the lifecycle API hands
//! out, with the token it hands out.

use std::collections::BTreeMap;
use std::time::Duration;

use reqwest::blocking::Client;
use serde_json::Value;

use super::server::UpServer;

const TOKEN_HEADER: &str = "X-EXECD-ACCESS-TOKEN";

/// One sandbox's execd, through the endpoint `GET /v1/sandboxes/{id}/endpoints/44772` returns.
pub struct Execd {
    pub base: String,
    pub token: String,
    http: Client,
}

/// What one command printed, and the id execd gave it (the text of its `init` event).
pub struct Run {
    pub command_id: String,
    pub stdout: String,
}

impl Execd {
    pub fn of(server: &UpServer, id: &str) -> Execd {
        let (status, ep) = server.get(&format!("/v1/sandboxes/{id}/endpoints/44772"));
        assert_eq!(status, 200, "endpoint of {id}: {ep}");
        let token = ep["headers"][TOKEN_HEADER]
            .as_str()
            .unwrap_or_else(|| panic!("the endpoint of {id} carries the execd token: {ep}"))
            .to_string();
        // The endpoint's other headers (a secure sandbox's access token) go with every
        // request, as the SDK sends them.
        let mut others = reqwest::header::HeaderMap::new();
        for (name, value) in ep["headers"].as_object().into_iter().flatten() {
            if name != TOKEN_HEADER {
                others.insert(
                    reqwest::header::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                    value.as_str().unwrap().parse().unwrap(),
                );
            }
        }
        Execd {
            base: format!("http://{}", ep["endpoint"].as_str().unwrap()),
            token,
            http: Client::builder()
                .timeout(Duration::from_secs(60))
                .default_headers(others)
                .build()
                .unwrap(),
        }
    }

    /// The status of `GET /ping` presenting `token`.
    pub fn ping_with(&self, token: &str) -> u16 {
        self.try_ping(token).expect("ping")
    }

    /// The status of `GET /ping` presenting `token`, or the transport error.
    pub fn try_ping(&self, token: &str) -> reqwest::Result<u16> {
        self.http
            .get(format!("{}/ping", self.base))
            .header(TOKEN_HEADER, token)
            .send()
            .map(|r| r.status().as_u16())
    }

    /// Runs `script` with `POST /command {"command": ...}` and collects its stdout lines;
    /// panics unless the stream ends with `execution_complete`.
    pub fn sh(&self, script: &str) -> Run {
        let resp = self
            .http
            .post(format!("{}/command", self.base))
            .header(TOKEN_HEADER, &self.token)
            .json(&serde_json::json!({ "command": script }))
            .send()
            .expect("POST /command");
        assert_eq!(resp.status(), 200, "POST /command {script:?}");
        let body = resp.text().expect("the command stream");
        let (mut command_id, mut stdout, mut stderr) =
            (String::new(), String::new(), String::new());
        let mut complete = false;
        for line in body.lines() {
            let json = line.trim().trim_start_matches("data:").trim();
            if json.is_empty() {
                continue;
            }
            let event: Value =
                serde_json::from_str(json).unwrap_or_else(|e| panic!("bad event {json:?}: {e}"));
            let text = event["text"].as_str().unwrap_or_default();
            let text = if text == "\n" { "" } else { text };
            match event["type"].as_str().unwrap_or_default() {
                "init" => command_id = text.to_string(),
                "stdout" => stdout.push_str(&format!("{text}\n")),
                "stderr" => stderr.push_str(&format!("{text}\n")),
                "execution_complete" => complete = true,
                "error" => panic!("{script:?} failed: {event}\nstderr: {stderr}"),
                _ => {}
            }
        }
        assert!(complete, "{script:?}: no execution_complete in {body}");
        Run { command_id, stdout }
    }

    /// `key=value` lines of `script` as a map.
    pub fn facts(&self, script: &str) -> (String, BTreeMap<String, String>) {
        let run = self.sh(script);
        let facts = run
            .stdout
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.trim().to_string()))
            .collect();
        (run.command_id, facts)
    }
}
