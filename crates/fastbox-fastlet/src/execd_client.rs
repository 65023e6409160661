//! A small blocking client of the execd API, enough for `fastbox sandbox run`: wait for
//! `/ping`, run a command and stream its events.

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Deserialize;

pub struct ExecdClient {
    base: String,
    token: Option<String>,
    http: reqwest::blocking::Client,
}

/// One event of the command stream (compat §4.2).
#[derive(Debug, Deserialize)]
pub struct Event {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
    #[serde(default)]
    pub error: Option<EventError>,
}

#[derive(Debug, Deserialize)]
pub struct EventError {
    #[serde(default)]
    pub evalue: String,
}

impl ExecdClient {
    pub fn new(base: String, token: Option<String>) -> anyhow::Result<Self> {
        let http = reqwest::blocking::Client::builder()
            .timeout(None)
            .connect_timeout(Duration::from_secs(2))
            .build()?;
        Ok(Self { base, token, http })
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::blocking::RequestBuilder {
        let req = self.http.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(t) => req.header("X-EXECD-ACCESS-TOKEN", t),
            None => req,
        }
    }

    /// Poll `/ping` until it answers 2xx or `timeout` passes.
    pub fn wait_ready(&self, timeout: Duration) -> anyhow::Result<Duration> {
        let start = Instant::now();
        loop {
            let answered = self
                .request(reqwest::Method::GET, "/ping")
                .timeout(Duration::from_millis(500))
                .send();
            if let Ok(resp) = answered
                && resp.status().is_success()
            {
                return Ok(start.elapsed());
            }
            if start.elapsed() > timeout {
                bail!(
                    "execd at {} did not answer /ping within {timeout:?}",
                    self.base
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Run `argv` and hand every event to `on_event`; returns the exit code.
    pub fn run(&self, argv: &[String], mut on_event: impl FnMut(&Event)) -> anyhow::Result<i32> {
        let resp = self
            .request(reqwest::Method::POST, "/command")
            .header("Accept", "text/event-stream")
            .json(&serde_json::json!({ "argv": argv }))
            .send()
            .context("POST /command")?;
        if !resp.status().is_success() {
            let status = resp.status();
            bail!(
                "execd refused the command ({status}): {}",
                resp.text().unwrap_or_default()
            );
        }
        let mut code = None;
        for line in BufReader::new(resp).lines() {
            let line = line.context("read command stream")?;
            let json = line.trim().trim_start_matches("data:").trim();
            if json.is_empty() {
                continue;
            }
            let event: Event =
                serde_json::from_str(json).with_context(|| format!("bad event {json}"))?;
            match event.kind.as_str() {
                "execution_complete" => code = Some(0),
                "error" => {
                    code = Some(
                        event
                            .error
                            .as_ref()
                            .and_then(|e| e.evalue.parse().ok())
                            .unwrap_or(1),
                    );
                }
                _ => {}
            }
            on_event(&event);
        }
        code.context("the command stream ended without a result")
    }
}
