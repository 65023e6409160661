//! A small blocking client of the execd API, enough for `fastbox sandbox run`: wait for
//! `/ping`, run a command and stream its events.
//!
//! Whatever answers on execd's port lives in a sandbox, which the tenant controls, so no
//! answer is buffered without a bound: an error answer is read up to [`MAX_CONTROL_ANSWER`]
//! (beyond, it is reported as too large, unread), and each event line of a command stream up
//! to [`MAX_EVENT_LINE`] (beyond, the stream fails with [`ExecdClientError::TooLarge`]). The
//! stream itself may go on as long as the command prints.

use std::io::{BufRead, BufReader, Read};
use std::time::{Duration, Instant};

use serde::Deserialize;

/// Most of a control answer (claim, rekey, an error answer) read from execd: 1 MiB.
pub const MAX_CONTROL_ANSWER: usize = 1 << 20;

/// Longest event line of a command stream: 1 MiB (execd cuts output lines at 64 KiB, which
/// JSON escaping makes at most 384 KiB).
pub const MAX_EVENT_LINE: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ExecdClientError {
    #[error("execd client: {}", with_causes(.0))]
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
    #[error("execd's {what} is larger than {limit} bytes; not read further")]
    TooLarge { what: &'static str, limit: usize },
}

/// `e` and each of its causes ("error sending request" alone does not say what failed:
/// a refused connection, a reset, a timeout).
fn with_causes(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
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

    /// The HTTP client execd clients use. It keeps no connection open between calls: a
    /// slot's address passes to the next sandbox in it, and a connection kept to the one
    /// before (whose network namespace went without closing it) would reach the new one,
    /// which resets it (claims failed that way under load). A connection gets 5 s: under
    /// load a claim's first SYNs were seen lost, and TCP sends its third at 3 s.
    pub fn http_client() -> Result<reqwest::blocking::Client, ExecdClientError> {
        Ok(reqwest::blocking::Client::builder()
            .timeout(None)
            .connect_timeout(Duration::from_secs(5))
            .pool_max_idle_per_host(0)
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
    /// with `envs` and runs `entrypoint` (execd's `POST /fastbox/claim`); with
    /// `trust_ca_pem`, the sandbox trusts that CA (the node's credential proxy's) first.
    pub fn claim(
        &self,
        token: &str,
        envs: &[(String, String)],
        entrypoint: &[String],
        trust_ca_pem: Option<&str>,
    ) -> Result<(), ExecdClientError> {
        let envs: serde_json::Map<String, serde_json::Value> = envs
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
            .collect();
        let mut body = serde_json::json!({ "access_token": token, "envs": envs });
        if !entrypoint.is_empty() {
            body["entrypoint"] = serde_json::json!(entrypoint);
        }
        if let Some(pem) = trust_ca_pem {
            body["trust_ca_pem"] = serde_json::json!(pem);
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
            return Err(refused(resp));
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
            return Err(refused(resp));
        }
        let mut code = None;
        let mut reader = BufReader::new(resp);
        while let Some(line) = read_line_capped(&mut reader, MAX_EVENT_LINE)? {
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

/// [`ExecdClientError::Refused`] with execd's answer, read up to [`MAX_CONTROL_ANSWER`].
fn refused(resp: reqwest::blocking::Response) -> ExecdClientError {
    let status = resp.status();
    let body = match read_capped(resp, MAX_CONTROL_ANSWER) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(e) => format!("<{e}>"),
    };
    ExecdClientError::Refused { status, body }
}

/// The whole of `body` if it is at most `limit` bytes; otherwise
/// [`ExecdClientError::TooLarge`], having read only `limit + 1` bytes.
fn read_capped(body: impl Read, limit: usize) -> Result<Vec<u8>, ExecdClientError> {
    let mut out = Vec::new();
    body.take(limit as u64 + 1).read_to_end(&mut out)?;
    if out.len() > limit {
        return Err(ExecdClientError::TooLarge {
            what: "answer",
            limit,
        });
    }
    Ok(out)
}

/// The next line of `reader` without its `\n` (lossy UTF-8), `None` at the end;
/// [`ExecdClientError::TooLarge`] for a line longer than `limit` bytes, of which only
/// `limit + 1` are read.
fn read_line_capped(
    reader: &mut impl BufRead,
    limit: usize,
) -> Result<Option<String>, ExecdClientError> {
    let mut line = Vec::new();
    let n = reader.take(limit as u64 + 1).read_until(b'\n', &mut line)?;
    if n == 0 {
        return Ok(None);
    }
    if line.last() == Some(&b'\n') {
        line.pop();
    } else if line.len() > limit {
        return Err(ExecdClientError::TooLarge {
            what: "command stream line",
            limit,
        });
    }
    Ok(Some(String::from_utf8_lossy(&line).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::{Ipv4Addr, TcpListener};

    #[test]
    fn no_connection_is_kept_between_calls() {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = accepted.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let mut s = stream.unwrap();
                std::thread::spawn(move || {
                    use std::io::Read;
                    let mut buf = [0u8; 4096];
                    // Answers every request on the connection, keeping it open (keep-alive).
                    while let Ok(n) = s.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        let _ = s.write_all(
                            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: keep-alive\r\n\r\n",
                        );
                    }
                });
            }
        });
        let client = ExecdClient::with_client(
            format!("http://{addr}"),
            None,
            ExecdClient::http_client().unwrap(),
        );
        for _ in 0..2 {
            let status = client
                .request(reqwest::Method::GET, "/ping")
                .send()
                .unwrap()
                .status();
            assert!(status.is_success());
        }
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    /// A one-request HTTP server on loopback answering `status` with `body` (the bytes
    /// after the head), then closing. Returns its base URL.
    fn server(status: &'static str, content_type: &'static str, body: Vec<u8>) -> String {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut req = [0u8; 8192];
            let _ = s.read(&mut req);
            let head = format!(
                "HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\n\
                 content-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            let _ = s.write_all(head.as_bytes());
            let _ = s.write_all(&body);
        });
        format!("http://{addr}")
    }

    fn client(base: String) -> ExecdClient {
        ExecdClient::new(base, Some("t".into())).unwrap()
    }

    #[test]
    fn a_refusal_carries_execds_answer() {
        let base = server(
            "409 Conflict",
            "application/json",
            br#"{"code":"ALREADY_CLAIMED"}"#.to_vec(),
        );
        match client(base).rekey("0123456789abcdef").unwrap_err() {
            ExecdClientError::Refused { status, body } => {
                assert_eq!(status, reqwest::StatusCode::CONFLICT);
                assert_eq!(body, r#"{"code":"ALREADY_CLAIMED"}"#);
            }
            other => panic!("{other}"),
        }
    }

    #[test]
    fn an_oversized_refusal_is_reported_unread() {
        let base = server(
            "500 Internal Server Error",
            "text/plain",
            vec![b'x'; 3 << 20],
        );
        match client(base)
            .claim("0123456789abcdef", &[], &[], None)
            .unwrap_err()
        {
            ExecdClientError::Refused { body, .. } => assert_eq!(
                body,
                "<execd's answer is larger than 1048576 bytes; not read further>"
            ),
            other => panic!("{other}"),
        }
    }

    #[test]
    fn a_command_stream_line_over_the_limit_fails_the_stream() {
        let mut body = b"data: {\"type\":\"init\"}\n\n".to_vec();
        body.extend(vec![b'x'; MAX_EVENT_LINE + 10]);
        let base = server("200 OK", "text/event-stream", body);
        let err = client(base).run(&["true".into()], |_| {}).unwrap_err();
        assert!(
            matches!(
                err,
                ExecdClientError::TooLarge {
                    what: "command stream line",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn a_command_stream_is_read_to_its_result() {
        let body = b"data: {\"type\":\"stdout\",\"text\":\"hi\"}\n\n\
                     data: {\"type\":\"execution_complete\"}\n\n"
            .to_vec();
        let base = server("200 OK", "text/event-stream", body);
        let mut seen = Vec::new();
        let code = client(base)
            .run(&["echo".into()], |e| seen.push(e.kind.clone()))
            .unwrap();
        assert_eq!(
            (code, seen.as_slice()),
            (
                0,
                &["stdout".to_owned(), "execution_complete".to_owned()][..]
            )
        );
    }

    #[test]
    fn lines_are_read_up_to_the_limit() {
        let mut r = BufReader::new(&b"abc\ndefg\nhi"[..]);
        assert_eq!(read_line_capped(&mut r, 3).unwrap().as_deref(), Some("abc"));
        assert!(matches!(
            read_line_capped(&mut r, 3),
            Err(ExecdClientError::TooLarge { .. })
        ));
        let mut r = BufReader::new(&b"hi"[..]);
        assert_eq!(read_line_capped(&mut r, 3).unwrap().as_deref(), Some("hi"));
        assert_eq!(read_line_capped(&mut r, 3).unwrap(), None);
    }
}
