//! The execution event stream shared by commands, sessions and code contexts.
//!
//! Frames are bare JSON followed by `\n\n`, the "legacy" framing of the reference execd that
//! both the Python SDK and the code-interpreter SDK parse. Every event carries a millisecond
//! `timestamp` (the SDK drops events without one) and empty fields are omitted, never `null`.
//! A `ping` keepalive goes out every 3 s so proxies do not cut long, quiet executions.

use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::Serialize;
use tokio::sync::mpsc;

use crate::clock::now_ms;
use crate::reaper::ExitStatus;

pub const KEEPALIVE: Duration = Duration::from_secs(3);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EventType {
    Init,
    Status,
    Error,
    Stdout,
    Stderr,
    Result,
    ExecutionComplete,
    ExecutionCount,
    Ping,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ErrorInfo {
    pub ename: String,
    pub evalue: String,
    pub traceback: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StreamEvent {
    #[serde(rename = "type")]
    pub kind: EventType,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub execution_count: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub execution_time: Option<u64>,
    pub timestamp: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub results: Option<serde_json::Map<String, serde_json::Value>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorInfo>,
}

/// Which output stream a line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl StreamEvent {
    fn new(kind: EventType) -> Self {
        StreamEvent {
            kind,
            text: None,
            execution_count: None,
            execution_time: None,
            timestamp: now_ms(),
            results: None,
            error: None,
        }
    }

    fn with_text(kind: EventType, text: impl Into<String>) -> Self {
        StreamEvent {
            text: Some(text.into()),
            ..Self::new(kind)
        }
    }

    /// The first event: its text is the command, session-run or context id.
    pub fn init(id: &str) -> Self {
        Self::with_text(EventType::Init, id)
    }

    /// One output line; a blank line is sent as `"\n"` so the event is not empty.
    pub fn output(stream: Stream, line: String) -> Self {
        let kind = match stream {
            Stream::Stdout => EventType::Stdout,
            Stream::Stderr => EventType::Stderr,
        };
        Self::with_text(
            kind,
            if line.is_empty() {
                "\n".to_string()
            } else {
                line
            },
        )
    }

    pub fn complete(elapsed: Duration) -> Self {
        StreamEvent {
            execution_time: Some(elapsed.as_millis() as u64),
            ..Self::new(EventType::ExecutionComplete)
        }
    }

    pub fn error(ename: &str, evalue: impl Into<String>, traceback: Vec<String>) -> Self {
        StreamEvent {
            error: Some(ErrorInfo {
                ename: ename.to_string(),
                evalue: evalue.into(),
                traceback,
            }),
            ..Self::new(EventType::Error)
        }
    }

    /// The terminal event of a command that exited non-zero.
    pub fn exit_error(status: ExitStatus) -> Self {
        Self::error(
            "CommandExecError",
            status.code().to_string(),
            vec![status.describe()],
        )
    }

    /// The terminal event of a finished execution: `execution_complete` on success, else the
    /// `CommandExecError` carrying the exit code (and no completion, as the SDK expects).
    pub fn finished(status: ExitStatus, elapsed: Duration) -> Self {
        if status.success() {
            Self::complete(elapsed)
        } else {
            Self::exit_error(status)
        }
    }

    pub fn count(n: u64) -> Self {
        StreamEvent {
            execution_count: Some(n),
            ..Self::new(EventType::ExecutionCount)
        }
    }

    /// A value result; `text` is what Jupyter calls `text/plain`.
    pub fn result(text: String) -> Self {
        let mut results = serde_json::Map::new();
        results.insert("text".to_string(), serde_json::Value::String(text));
        StreamEvent {
            results: Some(results),
            ..Self::new(EventType::Result)
        }
    }

    /// A rich result: a MIME bundle (`image/png` base64, `text/html`, ...), its
    /// `text/plain` named `text` as the reference execd names it.
    pub fn result_bundle(bundle: std::collections::BTreeMap<String, String>) -> Self {
        let results = bundle
            .into_iter()
            .map(|(mime, data)| {
                let key = if mime == "text/plain" {
                    "text".to_string()
                } else {
                    mime
                };
                (key, serde_json::Value::String(data))
            })
            .collect();
        StreamEvent {
            results: Some(results),
            ..Self::new(EventType::Result)
        }
    }

    pub fn ping() -> Self {
        Self::with_text(EventType::Ping, "pong")
    }

    /// `{json}\n\n`.
    pub fn frame(&self) -> Bytes {
        let mut v = serde_json::to_vec(self).unwrap_or_default();
        v.extend_from_slice(b"\n\n");
        Bytes::from(v)
    }
}

/// The producing side of an event stream. Sends fail silently once the client is gone: the
/// execution itself goes on.
#[derive(Clone)]
pub struct EventTx(mpsc::Sender<StreamEvent>);

impl EventTx {
    pub async fn send(&self, event: StreamEvent) {
        let _ = self.0.send(event).await;
    }
}

pub fn channel() -> (EventTx, mpsc::Receiver<StreamEvent>) {
    let (tx, rx) = mpsc::channel(256);
    (EventTx(tx), rx)
}

/// An SSE response draining `rx`, with keepalive pings, ending when every sender is dropped.
pub fn response(rx: mpsc::Receiver<StreamEvent>) -> Response {
    let ticks = tokio::time::interval_at(tokio::time::Instant::now() + KEEPALIVE, KEEPALIVE);
    let stream = futures::stream::unfold((rx, ticks), |(mut rx, mut ticks)| async move {
        let event = tokio::select! {
            biased;
            e = rx.recv() => e?,
            _ = ticks.tick() => StreamEvent::ping(),
        };
        Some((
            Ok::<_, std::convert::Infallible>(event.frame()),
            (rx, ticks),
        ))
    });
    let mut resp = Body::from_stream(stream).into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_bare_json_without_empty_fields() {
        let f = StreamEvent::output(Stream::Stdout, String::new()).frame();
        let s = std::str::from_utf8(&f).unwrap();
        assert!(s.starts_with("{\"type\":\"stdout\",\"text\":\"\\n\",\"timestamp\":"));
        assert!(s.ends_with("}\n\n"));
        assert!(!s.contains("null"));
    }

    #[test]
    fn non_zero_exit_is_command_exec_error() {
        let e = StreamEvent::finished(ExitStatus::Exited(3), Duration::ZERO);
        let err = e.error.unwrap();
        assert_eq!(err.ename, "CommandExecError");
        assert_eq!(err.evalue, "3");
        assert_eq!(err.traceback, vec!["exit status 3"]);
    }
}
