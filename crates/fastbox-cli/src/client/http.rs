//! What calls to the lifecycle API and to execd share: sending a request, turning a failed
//! reply into an error that carries the `{code, message}` envelope, the HTTP status and the
//! request id, and naming a server that does not answer at all.

use reqwest::StatusCode;
use reqwest::blocking::{RequestBuilder, Response};
use serde::de::DeserializeOwned;

use fastbox_api::lifecycle::ErrorResponse;

/// The header the lifecycle server echoes or generates on every response.
pub const REQUEST_ID: &str = "x-request-id";

/// Longest error body quoted when it is not the `{code, message}` envelope.
const MAX_QUOTED_BODY: usize = 300;

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// Nothing listens at `origin` (connection refused, unknown host, connect timeout).
    #[error("cannot connect to {origin}: {cause}; is `fastbox up` running there?")]
    Unreachable { origin: String, cause: String },
    /// The request failed after the connection was made, or the body could not be read.
    #[error("{what}")]
    Transport {
        what: String,
        #[source]
        source: reqwest::Error,
    },
    /// The server answered with a status that is not a success.
    #[error(transparent)]
    Reply(#[from] ErrorReply),
    /// A success whose body is not what the API promises.
    #[error("{what}: the answer is not the expected JSON")]
    Decode {
        what: String,
        #[source]
        source: serde_json::Error,
    },
}

impl HttpError {
    /// The error reply, when the server answered with one.
    pub fn reply(&self) -> Option<&ErrorReply> {
        match self {
            Self::Reply(reply) => Some(reply),
            _ => None,
        }
    }
}

/// A non-success answer: `<code>: <message> (HTTP <status>, request <id>)`.
#[derive(Debug, Clone, thiserror::Error)]
pub struct ErrorReply {
    pub status: StatusCode,
    /// The envelope's `code`; None when the body was not the envelope.
    pub code: Option<String>,
    pub message: String,
    pub request_id: Option<String>,
}

impl std::fmt::Display for ErrorReply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(code) = &self.code {
            write!(f, "{code}: ")?;
        }
        write!(f, "{} (HTTP {}", self.message, self.status.as_u16())?;
        if let Some(id) = &self.request_id {
            write!(f, ", request {id}")?;
        }
        f.write_str(")")
    }
}

impl ErrorReply {
    /// Reads a failed response: its envelope if it has one, else a short quote of its body.
    pub fn read(response: Response) -> Self {
        let status = response.status();
        let request_id = response
            .headers()
            .get(REQUEST_ID)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let body = response.text().unwrap_or_default();
        let (code, message) = parse_error_body(status, &body);
        Self {
            status,
            code,
            message,
            request_id,
        }
    }

    /// This reply has the status and the envelope code given.
    pub fn is(&self, status: StatusCode, code: &str) -> bool {
        self.status == status && self.code.as_deref() == Some(code)
    }
}

/// `{code, message}` when the body is the envelope; otherwise no code and the body itself
/// (shortened), or the status's reason when the body is empty.
fn parse_error_body(status: StatusCode, body: &str) -> (Option<String>, String) {
    if let Ok(envelope) = serde_json::from_str::<ErrorResponse>(body) {
        return (Some(envelope.code), envelope.message);
    }
    let text = body.trim();
    if text.is_empty() {
        let reason = status.canonical_reason().unwrap_or("no reason given");
        return (None, reason.to_string());
    }
    let mut quoted: String = text.chars().take(MAX_QUOTED_BODY).collect();
    if quoted.len() < text.len() {
        quoted.push_str("...");
    }
    (None, quoted)
}

/// Sends `request`; a non-success status becomes [`HttpError::Reply`].
pub fn send(request: RequestBuilder, what: &str) -> Result<Response, HttpError> {
    let response = request.send().map_err(|e| transport_error(e, what))?;
    if response.status().is_success() {
        Ok(response)
    } else {
        Err(ErrorReply::read(response).into())
    }
}

/// Sends `request` and decodes the JSON body of its success.
pub fn send_json<T: DeserializeOwned>(request: RequestBuilder, what: &str) -> Result<T, HttpError> {
    let body = send(request, what)?
        .bytes()
        .map_err(|e| transport_error(e, what))?;
    serde_json::from_slice(&body).map_err(|source| HttpError::Decode {
        what: what.to_string(),
        source,
    })
}

/// A failed connection names the server and its innermost cause; anything else keeps the
/// whole chain.
pub fn transport_error(error: reqwest::Error, what: &str) -> HttpError {
    if error.is_connect() {
        let origin = error
            .url()
            .map(|u| u.origin().ascii_serialization())
            .unwrap_or_else(|| "the server".to_string());
        return HttpError::Unreachable {
            origin,
            cause: root_cause(&error),
        };
    }
    HttpError::Transport {
        what: what.to_string(),
        source: error,
    }
}

fn root_cause(error: &(dyn std::error::Error + 'static)) -> String {
    let mut current = error;
    while let Some(next) = current.source() {
        current = next;
    }
    current.to_string()
}

/// A blocking HTTP client; `timeout` None lets streams (command output, downloads) run as
/// long as they last.
pub fn client(
    timeout: Option<std::time::Duration>,
) -> Result<reqwest::blocking::Client, HttpError> {
    reqwest::blocking::Client::builder()
        .user_agent(concat!("fastbox-cli/", env!("CARGO_PKG_VERSION")))
        .connect_timeout(std::time::Duration::from_secs(5))
        .timeout(timeout)
        .build()
        .map_err(|source| HttpError::Transport {
            what: "build the HTTP client".to_string(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_envelope_gives_code_and_message() {
        let (code, message) = parse_error_body(
            StatusCode::NOT_FOUND,
            r#"{"code":"SANDBOX::NOT_FOUND","message":"sandbox x not found"}"#,
        );
        assert_eq!(code.as_deref(), Some("SANDBOX::NOT_FOUND"));
        assert_eq!(message, "sandbox x not found");
    }

    #[test]
    fn other_bodies_are_quoted_or_replaced_by_the_reason() {
        assert_eq!(
            parse_error_body(StatusCode::BAD_GATEWAY, "upstream down\n"),
            (None, "upstream down".to_string())
        );
        assert_eq!(
            parse_error_body(StatusCode::BAD_GATEWAY, ""),
            (None, "Bad Gateway".to_string())
        );
        let long = "x".repeat(1000);
        let (_, quoted) = parse_error_body(StatusCode::INTERNAL_SERVER_ERROR, &long);
        assert_eq!(quoted.len(), MAX_QUOTED_BODY + 3);
    }

    #[test]
    fn replies_print_code_message_status_and_request() {
        let reply = ErrorReply {
            status: StatusCode::UNAUTHORIZED,
            code: Some("INVALID_API_KEY".into()),
            message: "Authentication credentials are invalid.".into(),
            request_id: Some("abc123".into()),
        };
        assert_eq!(
            reply.to_string(),
            "INVALID_API_KEY: Authentication credentials are invalid. (HTTP 401, request abc123)"
        );
        let bare = ErrorReply {
            code: None,
            request_id: None,
            message: "Bad Gateway".into(),
            status: StatusCode::BAD_GATEWAY,
        };
        assert_eq!(bare.to_string(), "Bad Gateway (HTTP 502)");
    }
}
