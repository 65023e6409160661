//! One worker's client of the lifecycle API and of the sandboxes' execd: a create timed until
//! execd answers `/ping` through the endpoint the API hands out (polled the way the SDK does),
//! and the untimed delete. One connection pool per worker, reused for every request it makes.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use reqwest::blocking::{Client, RequestBuilder, Response};
use serde::Deserialize;
use serde_json::Value;

use fastbox_api::lifecycle::Endpoint;
use fastbox_runtime::spec::EXECD_PORT;

use crate::client::api::API_KEY_HEADER;
use crate::client::http::{self, ErrorReply, HttpError};
use crate::client::wait::NOT_READY_CODE;

/// Between two endpoint lookups, or two pings, of a sandbox that is not ready yet. Shorter
/// than the SDK's 200 ms so that polling does not round the measured latency up.
const POLL: Duration = Duration::from_millis(10);

/// The request a failure happened in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Create,
    Endpoint,
    Ping,
    Delete,
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Create => "create",
            Self::Endpoint => "endpoint",
            Self::Ping => "ping",
            Self::Delete => "delete",
        })
    }
}

/// Why a create did not become ready, or a delete did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// The server answered with a status the benchmark does not accept (for a create: anything
    /// but 202).
    #[error("{phase} answered {reply}")]
    Refused { phase: Phase, reply: ErrorReply },
    /// A success whose body is not the JSON the API promises.
    #[error("{phase} answered {status} with a body that is not the expected JSON")]
    Malformed { phase: Phase, status: u16 },
    /// No answer: connection refused or reset, or the request timed out.
    #[error("{phase}: {kind}")]
    Transport {
        phase: Phase,
        kind: &'static str,
        #[source]
        source: reqwest::Error,
    },
    /// The sandbox was created but its execd did not answer `/ping` before the deadline.
    #[error("not ready before the deadline (last: {last})")]
    NotReady { last: String },
}

impl Failure {
    /// The key failures are counted under: the phase, then the status and the envelope's code
    /// (`create 429 SANDBOX::...`), or what went wrong without one.
    pub fn reason(&self) -> String {
        match self {
            Self::Refused { phase, reply } => {
                let status = reply.status.as_u16();
                match &reply.code {
                    Some(code) => format!("{phase} {status} {code}"),
                    None => format!("{phase} {status}"),
                }
            }
            Self::Malformed { phase, status } => format!("{phase} {status} malformed"),
            Self::Transport { phase, kind, .. } => format!("{phase} {kind}"),
            Self::NotReady { .. } => "not ready within the timeout".to_string(),
        }
    }

    fn transport(phase: Phase) -> impl Fn(reqwest::Error) -> Self {
        move |source| {
            let kind = if source.is_connect() {
                "cannot connect"
            } else if source.is_timeout() {
                "timed out"
            } else {
                "transport error"
            };
            Self::Transport {
                phase,
                kind,
                source,
            }
        }
    }
}

/// One timed create: the sandbox it made, if any (to delete afterwards, untimed), and either
/// the time from sending the create to execd's `/ping` 200, or why it failed.
pub struct Attempt {
    pub sandbox: Option<String>,
    pub result: Result<Duration, Failure>,
}

#[derive(Deserialize)]
struct Created {
    id: String,
}

pub struct BenchClient {
    /// `{server}/v1`.
    v1: String,
    /// The API's scheme, which execd endpoints are reached with too.
    scheme: String,
    api_key: Option<String>,
    http: Client,
}

impl BenchClient {
    /// A client of the lifecycle API at `server`; no request of it outlasts `timeout`.
    pub fn try_new(
        server: &reqwest::Url,
        api_key: Option<String>,
        timeout: Duration,
    ) -> Result<Self, HttpError> {
        Ok(Self {
            v1: format!("{}/v1", server.as_str().trim_end_matches('/')),
            scheme: server.scheme().to_string(),
            api_key,
            http: http::client(Some(timeout))?,
        })
    }

    pub(crate) fn api(&self, method: reqwest::Method, path: &str) -> RequestBuilder {
        let request = self.http.request(method, format!("{}{path}", self.v1));
        match &self.api_key {
            Some(key) => request.header(API_KEY_HEADER, key),
            None => request,
        }
    }

    /// Creates a sandbox with `body` and waits until its execd answers `/ping`, at most
    /// `timeout` from sending the create.
    pub fn create_until_ready(&self, body: &Value, timeout: Duration) -> Attempt {
        let start = Instant::now();
        let deadline = start + timeout;
        let id = match self.create(body, deadline) {
            Ok(id) => id,
            Err(failure) => {
                return Attempt {
                    sandbox: None,
                    result: Err(failure),
                };
            }
        };
        let result = self.until_ready(&id, deadline).map(|()| start.elapsed());
        Attempt {
            sandbox: Some(id),
            result,
        }
    }

    /// `DELETE /v1/sandboxes/{id}`: the server answers once the deletion is recorded.
    pub fn delete(&self, id: &str) -> Result<(), Failure> {
        let response = self
            .api(reqwest::Method::DELETE, &format!("/sandboxes/{id}"))
            .send()
            .map_err(Failure::transport(Phase::Delete))?;
        if response.status().is_success() {
            Ok(())
        } else {
            Err(refused(Phase::Delete, response))
        }
    }

    fn create(&self, body: &Value, deadline: Instant) -> Result<String, Failure> {
        let response = self
            .api(reqwest::Method::POST, "/sandboxes")
            .timeout(remaining(deadline))
            .json(body)
            .send()
            .map_err(Failure::transport(Phase::Create))?;
        if response.status() != StatusCode::ACCEPTED {
            return Err(refused(Phase::Create, response));
        }
        decode::<Created>(Phase::Create, response).map(|created| created.id)
    }

    /// Waits until sandbox `id`'s execd answers `/ping` through a freshly fetched endpoint.
    pub(crate) fn until_ready(&self, id: &str, deadline: Instant) -> Result<(), Failure> {
        let endpoint = self.execd_endpoint(id, deadline)?;
        let url = format!(
            "{}://{}/ping",
            self.scheme,
            endpoint.endpoint.trim_end_matches('/')
        );
        loop {
            let mut request = self.http.get(&url).timeout(remaining(deadline));
            for (name, value) in endpoint.headers.iter().flatten() {
                request = request.header(name, value);
            }
            let last = match request.send() {
                Ok(response) if response.status() == StatusCode::OK => return Ok(()),
                Ok(response)
                    if matches!(
                        response.status(),
                        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN
                    ) =>
                {
                    return Err(refused(Phase::Ping, response));
                }
                Ok(response) => format!("ping answered {}", response.status().as_u16()),
                Err(e) => format!("ping: {e}"),
            };
            poll_or_give_up(deadline, last)?;
        }
    }

    /// The execd endpoint, polled while the API answers 404 `POD_IP_NOT_AVAILABLE`.
    fn execd_endpoint(&self, id: &str, deadline: Instant) -> Result<Endpoint, Failure> {
        loop {
            let response = self
                .api(
                    reqwest::Method::GET,
                    &format!("/sandboxes/{id}/endpoints/{EXECD_PORT}"),
                )
                .query(&[("use_server_proxy", "false")])
                .timeout(remaining(deadline))
                .send()
                .map_err(Failure::transport(Phase::Endpoint))?;
            if response.status() == StatusCode::OK {
                return decode(Phase::Endpoint, response);
            }
            let reply = ErrorReply::read(response);
            if !reply.is(StatusCode::NOT_FOUND, NOT_READY_CODE) {
                return Err(Failure::Refused {
                    phase: Phase::Endpoint,
                    reply,
                });
            }
            poll_or_give_up(deadline, format!("endpoint: {reply}"))?;
        }
    }
}

fn refused(phase: Phase, response: Response) -> Failure {
    Failure::Refused {
        phase,
        reply: ErrorReply::read(response),
    }
}

fn decode<T: serde::de::DeserializeOwned>(phase: Phase, response: Response) -> Result<T, Failure> {
    let status = response.status().as_u16();
    response
        .json()
        .map_err(|_| Failure::Malformed { phase, status })
}

/// Time left until `deadline`, at least a millisecond (a zero timeout means none to reqwest).
fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

/// Sleeps one polling interval, or gives up with `last` when the deadline comes first.
fn poll_or_give_up(deadline: Instant, last: String) -> Result<(), Failure> {
    if Instant::now() + POLL >= deadline {
        return Err(Failure::NotReady { last });
    }
    std::thread::sleep(POLL);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(status: StatusCode, code: Option<&str>) -> ErrorReply {
        ErrorReply {
            status,
            code: code.map(str::to_string),
            message: "m".into(),
            request_id: None,
        }
    }

    #[test]
    fn refusals_are_counted_by_phase_status_and_code() {
        let rate_limited = Failure::Refused {
            phase: Phase::Create,
            reply: reply(StatusCode::TOO_MANY_REQUESTS, Some("SANDBOX::NO_CAPACITY")),
        };
        assert_eq!(rate_limited.reason(), "create 429 SANDBOX::NO_CAPACITY");
        let bare = Failure::Refused {
            phase: Phase::Endpoint,
            reply: reply(StatusCode::BAD_GATEWAY, None),
        };
        assert_eq!(bare.reason(), "endpoint 502");
    }

    #[test]
    fn timeouts_share_one_reason_whatever_the_last_error() {
        let a = Failure::NotReady { last: "x".into() };
        let b = Failure::NotReady { last: "y".into() };
        assert_eq!(a.reason(), b.reason());
    }

    #[test]
    fn the_api_path_is_appended_to_v1_of_the_server() {
        let url = reqwest::Url::parse("http://127.0.0.1:8080/").unwrap();
        let client = BenchClient::try_new(&url, None, Duration::from_secs(1)).unwrap();
        assert_eq!(client.v1, "http://127.0.0.1:8080/v1");
        assert_eq!(client.scheme, "http");
    }
}
