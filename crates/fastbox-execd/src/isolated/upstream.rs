//! Requests to a session's own execd, over its Unix socket (an abstract name in execd's
//! network namespace), with the session's token.

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Method, Request, header};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

use super::IsolatedError;
use crate::auth::TOKEN_HEADER;

/// Where a session's execd listens, and its token.
#[derive(Clone)]
pub struct Upstream {
    pub socket: String,
    pub token: String,
}

fn upstream_err(e: impl std::fmt::Display) -> IsolatedError {
    IsolatedError::Upstream(e.to_string())
}

impl Upstream {
    async fn connect(&self) -> Result<tokio::net::UnixStream, IsolatedError> {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(self.socket.as_bytes())
            .map_err(upstream_err)?;
        let stream = std::os::unix::net::UnixStream::connect_addr(&addr).map_err(upstream_err)?;
        stream.set_nonblocking(true).map_err(upstream_err)?;
        tokio::net::UnixStream::from_std(stream).map_err(upstream_err)
    }

    /// Sends `method path_and_query` with `headers` (hop-by-hop and token headers are the
    /// caller's to strip) and `body`; the response streams.
    pub async fn send(
        &self,
        method: Method,
        path_and_query: &str,
        mut headers: HeaderMap,
        body: Body,
    ) -> Result<hyper::Response<Incoming>, IsolatedError> {
        let stream = self.connect().await?;
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
        use http_body_util::BodyExt;
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
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(upstream_err)?
            .to_bytes();
        let value = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
        Ok((status, value))
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
