//! A small blocking client of the execd API, enough for `fastbox sandbox run`: wait for
//! `/ping`, run a command and stream its events.

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum ExecdClientError {
    #[error("execd client: {0}")]
    Http(#[from] reqwest::Error),
    #[error("execd at {base} did not answer /ping within {timeout:?}")]
    NotReady { base: String, timeout: Duration },
    #[error("execd refused the command ({status}): {body}")]
    Refused {
        status: reqwest::StatusCode,
        body: String,
    },
    #[error("reading the command stream: {0}")]
    Stream(#[from] std::io::Error),
    #[error("bad event {line:?}: {source}")]
    BadEvent {
        line: String,
        source: serde_json::Error,
    },
    #[error("the command stream ended without a result")]
    NoResult,
}

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
    pub fn new(base: String, token: Option<String>) -> Result<Self, ExecdClientError> {
        Ok(Self::with_client(base, token, Self::http_client()?))
    }

    /// A client over an existing connection pool (cheap: building a blocking client starts
    /// a thread).
    pub fn with_client(
        base: String,
        token: Option<String>,
        http: reqwest::blocking::Client,
    ) -> Self {
        Self { base, token, http }
    }

    /// The HTTP client execd clients use.
    pub fn http_client() -> Result<reqwest::blocking::Client, ExecdClientError> {
        Ok(reqwest::blocking::Client::builder()
            .timeout(None)
            .connect_timeout(Duration::from_secs(2))
            .build()?)
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::blocking::RequestBuilder {
        let req = self.http.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(t) => req.header("X-EXECD-ACCESS-TOKEN", t),
            None => req,
        }
    }

    /// Poll `/ping` until it answers 2xx or `timeout` passes.
    pub fn wait_ready(&self, timeout: Duration) -> Result<Duration, ExecdClientError> {
        self.poll_ping(timeout, true)
    }

    /// Like [`ExecdClient::wait_ready`], but without sending the token: a 401 proves execd
    /// serves too. For the start of a template, whose memory (request buffers included) is
    /// checkpointed and published: the token must never have passed through it.
    pub fn wait_serving(&self, timeout: Duration) -> Result<Duration, ExecdClientError> {
        self.poll_ping(timeout, false)
    }

    fn poll_ping(&self, timeout: Duration, with_token: bool) -> Result<Duration, ExecdClientError> {
        let start = Instant::now();
        loop {
            let req = if with_token {
                self.request(reqwest::Method::GET, "/ping")
            } else {
                self.http.get(format!("{}/ping", self.base))
            };
            let answered = req.timeout(Duration::from_millis(500)).send();
            if let Ok(resp) = answered
                && (resp.status().is_success()
                    || (!with_token && resp.status() == reqwest::StatusCode::UNAUTHORIZED))
            {
                return Ok(start.elapsed());
            }
            if start.elapsed() > timeout {
                return Err(ExecdClientError::NotReady {
                    base: self.base.clone(),
                    timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Claims a restored execd: from now on it answers to `token` only, starts processes
    /// with `envs` and runs `entrypoint` (execd's `POST /fastbox/claim`).
    pub fn claim(
        &self,
        token: &str,
        envs: &[(String, String)],
        entrypoint: &[String],
    ) -> Result<(), ExecdClientError> {
        let envs: serde_json::Map<String, serde_json::Value> = envs
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
            .collect();
        let mut body = serde_json::json!({ "access_token": token, "envs": envs });
        if !entrypoint.is_empty() {
            body["entrypoint"] = serde_json::json!(entrypoint);
        }
        self.post_control("/fastbox/claim", &body)
    }

    /// Gives a restored execd a new access token and changes nothing else: no entrypoint, same
    /// environment (execd's `POST /fastbox/rekey`). For clones of a snapshot of a claimed
    /// sandbox. Authenticated with this client's token; from now on execd answers to `token`
    /// only.
    pub fn rekey(&self, token: &str) -> Result<(), ExecdClientError> {
        self.post_control(
            "/fastbox/rekey",
            &serde_json::json!({ "access_token": token }),
        )
    }

    /// POSTs `body` to one of execd's `/fastbox/...` control routes; anything but a success
    /// is [`ExecdClientError::Refused`] with execd's answer.
    fn post_control(&self, path: &str, body: &serde_json::Value) -> Result<(), ExecdClientError> {
        let resp = self
            .request(reqwest::Method::POST, path)
            .timeout(Duration::from_secs(10))
            .json(body)
            .send()?;
        if !resp.status().is_success() {
            return Err(ExecdClientError::Refused {
                status: resp.status(),
                body: resp.text().unwrap_or_default(),
            });
        }
        Ok(())
    }

    /// Run `argv` and hand every event to `on_event`; returns the exit code.
    pub fn run(
        &self,
        argv: &[String],
        on_event: impl FnMut(&Event),
    ) -> Result<i32, ExecdClientError> {
        self.run_request(&serde_json::json!({ "argv": argv }), on_event)
    }

    /// Run `command` with `/bin/sh -c`, killed by execd after `timeout`; returns the exit code.
    pub fn run_shell(&self, command: &str, timeout: Duration) -> Result<i32, ExecdClientError> {
        let body = serde_json::json!({
            "argv": ["/bin/sh", "-c", command],
            "timeout": timeout.as_millis() as u64,
        });
        self.run_request(&body, |_| {})
    }

    /// POSTs `body` to `/command` and reads its event stream to the result.
    fn run_request(
        &self,
        body: &serde_json::Value,
        mut on_event: impl FnMut(&Event),
    ) -> Result<i32, ExecdClientError> {
        let resp = self
            .request(reqwest::Method::POST, "/command")
            .header("Accept", "text/event-stream")
            .json(body)
            .send()?;
        if !resp.status().is_success() {
            return Err(ExecdClientError::Refused {
                status: resp.status(),
                body: resp.text().unwrap_or_default(),
            });
        }
        let mut code = None;
        for line in BufReader::new(resp).lines() {
            let line = line?;
            let json = line.trim().trim_start_matches("data:").trim();
            if json.is_empty() {
                continue;
            }
            let event: Event =
                serde_json::from_str(json).map_err(|source| ExecdClientError::BadEvent {
                    line: json.to_string(),
                    source,
                })?;
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
        code.ok_or(ExecdClientError::NoResult)
    }
}
