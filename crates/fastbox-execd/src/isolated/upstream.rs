//! Requests to a session's own execd, over its Unix socket, with the session's token. Every
//! step has a deadline and whole answers a size cap: the session's execd runs in the session,
//! whose code may stall or bloat it, and must not stall or bloat this execd.

use std::path::PathBuf;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Method, Request, header};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

use super::IsolatedError;
use crate::auth::TOKEN_HEADER;

/// How long connecting and the answer's head may take.
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);
/// The most of a whole answer read ([`Upstream::json`], [`Upstream::bytes`]).
pub const MAX_ANSWER: usize = 17 << 20;

/// Where a session's execd listens, and its token.
#[derive(Clone)]
pub struct Upstream {
    pub socket: PathBuf,
    pub token: String,
}

fn upstream_err(e: impl std::fmt::Display) -> IsolatedError {
    IsolatedError::Upstream(e.to_string())
}

impl Upstream {
    /// Sends `method path_and_query` with `headers` (hop-by-hop and token headers are the
    /// caller's to strip) and `body`; the response's body streams.
    pub async fn send(
        &self,
        method: Method,
        path_and_query: &str,
        headers: HeaderMap,
        body: Body,
    ) -> Result<hyper::Response<Incoming>, IsolatedError> {
        tokio::time::timeout(
            HEAD_TIMEOUT,
            self.send_now(method, path_and_query, headers, body),
        )
        .await
        .map_err(|_| upstream_err(format!("no answer within {HEAD_TIMEOUT:?}")))?
    }

    async fn send_now(
        &self,
        method: Method,
        path_and_query: &str,
        mut headers: HeaderMap,
        body: Body,
    ) -> Result<hyper::Response<Incoming>, IsolatedError> {
        let stream = tokio::net::UnixStream::connect(&self.socket)
            .await
            .map_err(upstream_err)?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(upstream_err)?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "isolated session connection ended");
            }
        });
        headers.insert(
            TOKEN_HEADER,
            HeaderValue::from_str(&self.token).map_err(upstream_err)?,
        );
        headers.insert(header::HOST, HeaderValue::from_static("isolated-session"));
        let mut req = Request::builder()
            .method(method)
            .uri(path_and_query)
            .body(body)
            .map_err(upstream_err)?;
        *req.headers_mut() = headers;
        sender.send_request(req).await.map_err(upstream_err)
    }

    /// A JSON request whose JSON answer is read whole.
    pub async fn json(
        &self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Result<(axum::http::StatusCode, serde_json::Value), IsolatedError> {
        let mut headers = HeaderMap::new();
        let body = match body {
            Some(v) => {
                headers.insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
                Body::from(v.to_string())
            }
            None => Body::empty(),
        };
        let resp = self.send(method, path, headers, body).await?;
        let status = resp.status();
        let bytes = Self::bytes(resp.into_body()).await?;
        let value = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
        Ok((status, value))
    }

    /// A whole answer body, up to [`MAX_ANSWER`] bytes and within [`HEAD_TIMEOUT`].
    pub async fn bytes(body: Incoming) -> Result<bytes::Bytes, IsolatedError> {
        let limited = http_body_util::Limited::new(body, MAX_ANSWER);
        match tokio::time::timeout(HEAD_TIMEOUT, limited.collect()).await {
            Ok(Ok(collected)) => Ok(collected.to_bytes()),
            Ok(Err(e)) => Err(upstream_err(e)),
            Err(_) => Err(upstream_err(format!(
                "answer not read within {HEAD_TIMEOUT:?}"
            ))),
        }
    }

    /// Waits until the session's execd answers `/ping` (or `patience` ran out).
    pub async fn wait_serving(&self, patience: std::time::Duration) -> Result<(), IsolatedError> {
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            match self.json(Method::GET, "/ping", None).await {
                Ok((status, _)) if status.is_success() => return Ok(()),
                Ok((status, _)) => {
                    return Err(upstream_err(format!(
                        "the session's execd answered {status}"
                    )));
                }
                Err(e) if tokio::time::Instant::now() >= deadline => return Err(e),
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(10)).await,
            }
        }
    }
}
