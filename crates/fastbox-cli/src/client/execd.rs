//! A blocking client of one sandbox's execd, reached through the endpoint the lifecycle API
//! hands out (`host:port/path` plus headers such as `X-EXECD-ACCESS-TOKEN`): readiness,
//! commands with their event stream (compat §4.2), uploads and downloads (§4.4).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::time::Duration;

use reqwest::Method;
use reqwest::blocking::{Body, Client, RequestBuilder, Response};
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use serde::Serialize;

use fastbox_api::lifecycle::Endpoint;
pub use fastbox_fastlet::execd_client::Event;

use super::http::{self, HttpError};
use super::multipart;

#[derive(Debug, thiserror::Error)]
pub enum ExecdError {
    #[error(transparent)]
    Http(#[from] HttpError),
    #[error("the endpoint header {name:?} cannot be sent")]
    BadHeader { name: String },
    #[error("read the command's event stream")]
    Stream(#[source] std::io::Error),
    #[error("execd sent an event that is not JSON: {line}")]
    BadEvent {
        line: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("the command's event stream ended without a result")]
    NoResult,
}

/// `POST /command`: a shell command line, where and with what environment it runs.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CommandRequest {
    pub command: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub envs: BTreeMap<String, String>,
}

/// How a command ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommandOutcome {
    /// It ran and exited with this code.
    Exited(i32),
    /// It could not be started; execd's reason.
    NotStarted(String),
}

#[derive(Clone)]
pub struct ExecdClient {
    /// `{scheme}://{endpoint}`; execd paths are appended as they are.
    base: String,
    headers: HeaderMap,
    http: Client,
}

impl ExecdClient {
    /// The execd behind `endpoint`, reached with `scheme` (the lifecycle API's).
    pub fn try_new(scheme: &str, endpoint: &Endpoint) -> Result<Self, ExecdError> {
        let mut headers = HeaderMap::new();
        for (name, value) in endpoint.headers.iter().flatten() {
            let bad = || ExecdError::BadHeader { name: name.clone() };
            headers.insert(
                HeaderName::from_bytes(name.as_bytes()).map_err(|_| bad())?,
                HeaderValue::from_str(value).map_err(|_| bad())?,
            );
        }
        Ok(Self {
            base: format!("{scheme}://{}", endpoint.endpoint.trim_end_matches('/')),
            headers,
            http: http::client(None)?,
        })
    }

    fn request(&self, method: Method, path: &str) -> RequestBuilder {
        self.http
            .request(method, format!("{}{path}", self.base))
            .headers(self.headers.clone())
    }

    /// `GET /ping`, answered within a second.
    pub fn ping(&self) -> Result<(), HttpError> {
        http::send(
            self.request(Method::GET, "/ping")
                .timeout(Duration::from_secs(1)),
            "ping execd",
        )
        .map(drop)
    }

    /// Runs `command` in the foreground, handing every event to `on_event` as it arrives.
    pub fn run(
        &self,
        command: &CommandRequest,
        on_event: impl FnMut(&Event),
    ) -> Result<CommandOutcome, ExecdError> {
        let response = http::send(
            self.request(Method::POST, "/command")
                .header(reqwest::header::ACCEPT, "text/event-stream")
                .json(command),
            "start the command",
        )?;
        read_events(BufReader::new(response), on_event)
    }

    /// `DELETE /command?id=`: stops a running command (its whole process group).
    pub fn interrupt(&self, command_id: &str) -> Result<(), HttpError> {
        http::send(
            self.request(Method::DELETE, "/command")
                .query(&[("id", command_id)]),
            "interrupt the command",
        )
        .map(drop)
    }

    /// Writes `content` to the absolute `path` with permission bits `mode` (parents are
    /// created). `len` is the content's length when known; otherwise the body is chunked.
    pub fn upload(
        &self,
        path: &str,
        mode: u32,
        content: impl Read + Send + 'static,
        len: Option<u64>,
    ) -> Result<(), HttpError> {
        let form = multipart::single_file(path, mode, content, len);
        let body = match form.len {
            Some(len) => Body::sized(form.reader, len),
            None => Body::new(form.reader),
        };
        http::send(
            self.request(Method::POST, "/files/upload")
                .header(CONTENT_TYPE, form.content_type)
                .body(body),
            "upload the file",
        )
        .map(drop)
    }

    /// `GET /files/download?path=`: the file's content as a stream.
    pub fn download(&self, path: &str) -> Result<Response, HttpError> {
        http::send(
            self.request(Method::GET, "/files/download")
                .query(&[("path", path)]),
            "download the file",
        )
    }
}

/// Reads an execd event stream to its end. Events are one JSON object per line, bare (as
/// execd writes them) or after `data:` (standard SSE); other SSE fields are skipped. The
/// outcome is the last `execution_complete` (exit 0) or `error` (exit code in `evalue`).
pub fn read_events(
    stream: impl BufRead,
    mut on_event: impl FnMut(&Event),
) -> Result<CommandOutcome, ExecdError> {
    let mut outcome = None;
    for line in stream.lines() {
        let line = line.map_err(ExecdError::Stream)?;
        let Some(json) = event_json(&line) else {
            continue;
        };
        let event: Event = serde_json::from_str(json).map_err(|source| ExecdError::BadEvent {
            line: line.clone(),
            source,
        })?;
        match event.kind.as_str() {
            "execution_complete" => outcome = Some(CommandOutcome::Exited(0)),
            "error" => {
                let value = event
                    .error
                    .as_ref()
                    .map(|e| e.evalue.clone())
                    .unwrap_or_default();
                outcome = Some(match value.trim().parse() {
                    Ok(code) => CommandOutcome::Exited(code),
                    Err(_) => CommandOutcome::NotStarted(value),
                });
            }
            _ => {}
        }
        on_event(&event);
    }
    outcome.ok_or(ExecdError::NoResult)
}

/// The JSON of one stream line, if the line carries an event.
fn event_json(line: &str) -> Option<&str> {
    let line = line.trim();
    let json = match line.strip_prefix("data:") {
        Some(data) => data.trim_start(),
        None if line.starts_with('{') => line,
        // Blank separators, comments (`: ...`) and the `event:`/`id:`/`retry:` fields.
        None => return None,
    };
    (!json.is_empty()).then_some(json)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds_and_outcome(stream: &str) -> (Vec<String>, Result<CommandOutcome, ExecdError>) {
        let mut kinds = Vec::new();
        let outcome = read_events(stream.as_bytes(), |e| kinds.push(e.kind.clone()));
        (kinds, outcome)
    }

    #[test]
    fn a_failing_command_ends_with_its_exit_code() {
        let stream = concat!(
            "{\"type\":\"init\",\"text\":\"c1\",\"timestamp\":1}\n\n",
            "{\"type\":\"stdout\",\"text\":\"out\",\"timestamp\":2}\n\n",
            "{\"type\":\"ping\",\"text\":\"pong\",\"timestamp\":3}\n\n",
            "{\"type\":\"error\",\"error\":{\"ename\":\"CommandExecError\",\"evalue\":\"3\",\"traceback\":[]},\"timestamp\":4}\n\n",
        );
        let (kinds, outcome) = kinds_and_outcome(stream);
        assert_eq!(kinds, ["init", "stdout", "ping", "error"]);
        assert_eq!(outcome.unwrap(), CommandOutcome::Exited(3));
    }

    #[test]
    fn standard_sse_framing_is_accepted() {
        let stream = concat!(
            ": comment\n",
            "event: message\n",
            "data: {\"type\":\"init\",\"text\":\"c1\"}\n\n",
            "data: {\"type\":\"execution_complete\",\"execution_time\":5}\n\n",
        );
        let (kinds, outcome) = kinds_and_outcome(stream);
        assert_eq!(kinds, ["init", "execution_complete"]);
        assert_eq!(outcome.unwrap(), CommandOutcome::Exited(0));
    }

    #[test]
    fn a_spawn_failure_is_not_an_exit_code() {
        let stream = "{\"type\":\"init\"}\n\n{\"type\":\"error\",\"error\":{\"ename\":\"E\",\"evalue\":\"no such file\"}}\n\n";
        let (_, outcome) = kinds_and_outcome(stream);
        assert_eq!(
            outcome.unwrap(),
            CommandOutcome::NotStarted("no such file".into())
        );
    }

    #[test]
    fn a_stream_without_result_or_with_garbage_fails() {
        let (_, outcome) = kinds_and_outcome("{\"type\":\"init\"}\n\n");
        assert!(matches!(outcome, Err(ExecdError::NoResult)));
        let (_, outcome) = kinds_and_outcome("{not json\n");
        assert!(matches!(outcome, Err(ExecdError::BadEvent { .. })));
    }

    #[test]
    fn endpoints_become_base_urls_with_their_headers() {
        let endpoint = Endpoint {
            endpoint: "127.0.0.1:8081/abc/44772".into(),
            headers: Some(BTreeMap::from([(
                "X-EXECD-ACCESS-TOKEN".into(),
                "t".into(),
            )])),
        };
        let execd = ExecdClient::try_new("http", &endpoint).unwrap();
        assert_eq!(execd.base, "http://127.0.0.1:8081/abc/44772");
        assert_eq!(execd.headers["x-execd-access-token"], "t");
        let bad = Endpoint {
            endpoint: "h:1".into(),
            headers: Some(BTreeMap::from([("bad header".into(), "v".into())])),
        };
        assert!(matches!(
            ExecdClient::try_new("http", &bad),
            Err(ExecdError::BadHeader { .. })
        ));
    }
}
