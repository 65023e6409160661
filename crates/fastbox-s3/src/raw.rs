//! Signed S3 requests that object_store does not make for us.
//!
//! object_store covers gets, puts (with `If-None-Match: *`), deletes, listings and multipart
//! parts. A few requests it has no call for: the bucket check at open (a `ListObjectsV2` whose
//! error code says *why* it failed), creating a bucket, copying an object onto itself to
//! refresh its modification time (`x-amz-metadata-directive: REPLACE`), and completing a
//! multipart upload with `If-None-Match: *`. [`RawClient`] makes those: SigV4-signed with
//! object_store's own signer, sent through object_store's HTTP client (same timeouts and
//! `allow_http`), path-style URLs (`<endpoint>/<bucket>/<key>`).
//!
//! Retries follow the configured [`Retries`]: transport failures, 5xx and 429 are retried
//! with exponential backoff; any other status is returned to the caller as a [`RawResponse`]
//! to interpret.

use std::time::{Duration, Instant};

use bytes::Bytes;
use object_store::ClientOptions;
use object_store::aws::{AwsAuthorizer, AwsCredential};
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpRequestBody, ReqwestConnector,
};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};

use crate::config::{Retries, S3Config};

pub use http::{Method, StatusCode};

/// Characters left as they are in a key or query value: RFC 3986's unreserved set (what
/// SigV4's canonical form expects).
const ENCODE: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// Why a raw request failed before an answer arrived.
#[derive(Debug, thiserror::Error)]
pub enum RawError {
    /// The HTTP client could not be built.
    #[error("build the HTTP client: {0}")]
    Client(#[source] object_store::Error),
    /// The request could not be built or signed.
    #[error("{method} {url}: cannot build or sign the request: {reason}")]
    Request {
        method: Method,
        url: String,
        reason: String,
    },
    /// No answer after every retry (connection refused, reset, timeout). The message spells
    /// out the whole chain of causes (the HTTP client's own message is vague).
    #[error(
        "{method} {url}: no answer after {attempts} attempt(s): {}",
        causes(error)
    )]
    Transport {
        method: Method,
        url: String,
        attempts: usize,
        error: HttpError,
    },
}

/// An answer, whatever its status.
#[derive(Debug)]
pub struct RawResponse {
    /// The status.
    pub status: StatusCode,
    /// The body.
    pub body: Bytes,
}

impl RawResponse {
    /// The `<Code>` of an S3 error body, if there is one.
    pub fn error_code(&self) -> Option<String> {
        xml_element(&self.body, "Code")
    }

    /// The `<Message>` of an S3 error body, if there is one.
    pub fn error_message(&self) -> Option<String> {
        xml_element(&self.body, "Message")
    }

    /// `status`, `code: message` for messages.
    pub fn describe(&self) -> String {
        let mut text = self.status.to_string();
        if let Some(code) = self.error_code() {
            text.push_str(&format!(", {code}"));
        }
        if let Some(message) = self.error_message() {
            text.push_str(&format!(": {message}"));
        }
        text
    }
}

/// One request: the bucket itself when `key` is None.
#[derive(Debug, Clone)]
pub struct RawRequest {
    /// The method.
    pub method: Method,
    /// The object key (unencoded), or None for the bucket.
    pub key: Option<String>,
    /// Query parameters (unencoded).
    pub query: Vec<(String, String)>,
    /// Extra headers (signed).
    pub headers: Vec<(&'static str, String)>,
    /// The body.
    pub body: Bytes,
}

impl RawRequest {
    /// A request without query, headers or body.
    pub fn new(method: Method, key: Option<&str>) -> Self {
        RawRequest {
            method,
            key: key.map(str::to_string),
            query: Vec::new(),
            headers: Vec::new(),
            body: Bytes::new(),
        }
    }

    /// Add a query parameter.
    pub fn query(mut self, name: &str, value: &str) -> Self {
        self.query.push((name.to_string(), value.to_string()));
        self
    }

    /// Add a header.
    pub fn header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }

    /// Set the body.
    pub fn body(mut self, body: impl Into<Bytes>) -> Self {
        self.body = body.into();
        self
    }
}

/// Signs and sends [`RawRequest`]s to one bucket. See the module docs.
#[derive(Debug)]
pub struct RawClient {
    http: HttpClient,
    credential: AwsCredential,
    region: String,
    base: String,
    bucket: String,
    retries: Retries,
}

impl RawClient {
    /// A client for the configuration's endpoint and bucket (credentials must be set).
    pub fn new(config: &S3Config, options: &ClientOptions) -> Result<Self, RawError> {
        let http = ReqwestConnector::default()
            .connect(options)
            .map_err(RawError::Client)?;
        Ok(RawClient {
            http,
            credential: AwsCredential {
                key_id: config.access_key_id.clone().unwrap_or_default(),
                secret_key: config.secret_access_key.clone().unwrap_or_default(),
                token: config.session_token.clone(),
            },
            region: config.region().to_string(),
            base: config.endpoint_url(),
            bucket: config.bucket.clone(),
            retries: config.retries,
        })
    }

    /// The URL of a request (path style).
    pub fn url(&self, request: &RawRequest) -> String {
        let mut url = format!("{}/{}", self.base, self.bucket);
        if let Some(key) = &request.key {
            url.push('/');
            url.push_str(&encode_key(key));
        }
        for (i, (name, value)) in request.query.iter().enumerate() {
            url.push(if i == 0 { '?' } else { '&' });
            url.push_str(&utf8_percent_encode(name, ENCODE).to_string());
            url.push('=');
            url.push_str(&utf8_percent_encode(value, ENCODE).to_string());
        }
        url
    }

    /// The value of an `x-amz-copy-source` header naming `key` in this bucket.
    pub fn copy_source(&self, key: &str) -> String {
        format!("{}/{}", self.bucket, encode_key(key))
    }

    /// Send `request`, retrying transient failures; any answer that is not retried is
    /// returned, whatever its status.
    pub async fn send(&self, request: &RawRequest) -> Result<RawResponse, RawError> {
        let url = self.url(request);
        let started = Instant::now();
        let mut backoff = self.retries.initial_backoff;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let signed = self.signed(request, &url)?;
            let outcome = match self.http.execute(signed).await {
                Ok(response) => {
                    let status = response.status();
                    response
                        .into_body()
                        .bytes()
                        .await
                        .map(|body| RawResponse { status, body })
                }
                Err(error) => Err(error),
            };
            let transient = match &outcome {
                Ok(response) => {
                    response.status.is_server_error()
                        || response.status == StatusCode::TOO_MANY_REQUESTS
                }
                Err(_) => true,
            };
            let may_retry = attempt <= self.retries.max_retries
                && started.elapsed() + backoff <= self.retries.retry_timeout;
            if transient && may_retry {
                tracing::debug!(method = %request.method, url, attempt, "transient S3 failure; retrying");
                tokio::time::sleep(backoff).await;
                backoff = next_backoff(backoff, self.retries.max_backoff);
                continue;
            }
            return outcome.map_err(|error| RawError::Transport {
                method: request.method.clone(),
                url,
                attempts: attempt,
                error,
            });
        }
    }

    fn signed(
        &self,
        request: &RawRequest,
        url: &str,
    ) -> Result<http::Request<HttpRequestBody>, RawError> {
        let failed = |reason: String| RawError::Request {
            method: request.method.clone(),
            url: url.to_string(),
            reason,
        };
        let mut builder = http::Request::builder()
            .method(request.method.clone())
            .uri(url);
        for (name, value) in &request.headers {
            builder = builder.header(*name, value);
        }
        let mut signed = builder
            .body(HttpRequestBody::from(request.body.clone()))
            .map_err(|e| failed(e.to_string()))?;
        AwsAuthorizer::new(&self.credential, "s3", &self.region)
            .try_authorize(&mut signed, None)
            .map_err(|e| failed(e.to_string()))?;
        Ok(signed)
    }
}

/// An error and its sources, `: `-separated, without repeats (wrappers often repeat their
/// source's text).
fn causes(error: &dyn std::error::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next = Some(error);
    while let Some(error) = next {
        let text = error.to_string();
        if !parts.iter().any(|part| part.contains(&text)) {
            parts.push(text);
        }
        next = error.source();
    }
    parts.join(": ")
}

/// The next backoff: double, at most `max`.
fn next_backoff(current: Duration, max: Duration) -> Duration {
    (current * 2).min(max)
}

/// A key in a URL path: each segment encoded, the `/` between them kept.
fn encode_key(key: &str) -> String {
    key.split('/')
        .map(|segment| utf8_percent_encode(segment, ENCODE).to_string())
        .collect::<Vec<_>>()
        .join("/")
}

/// The text of the first `<name>` element of an XML body (S3 error bodies are flat).
pub fn xml_element(body: &[u8], name: &str) -> Option<String> {
    let text = std::str::from_utf8(body).ok()?;
    let open = format!("<{name}>");
    let start = text.find(&open)? + open.len();
    let end = text[start..].find(&format!("</{name}>"))? + start;
    Some(xml_unescape(&text[start..end]))
}

/// Undo XML's five predefined entities.
fn xml_unescape(text: &str) -> String {
    text.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}

/// Escape text for an XML element.
pub fn xml_escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&apos;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_queries_are_encoded_for_sigv4() {
        let mut config = S3Config::new("bucket");
        config.endpoint = Some("http://127.0.0.1:9".into());
        config.allow_http = true;
        let client = RawClient::new(&config, &ClientOptions::new().with_allow_http(true)).unwrap();
        let request = RawRequest::new(Method::GET, Some("p/index/python%3A3.12"))
            .query("uploadId", "a+b/c")
            .query("list-type", "2");
        assert_eq!(
            client.url(&request),
            "http://127.0.0.1:9/bucket/p/index/python%253A3.12?uploadId=a%2Bb%2Fc&list-type=2"
        );
        assert_eq!(
            client.url(&RawRequest::new(Method::PUT, None)),
            "http://127.0.0.1:9/bucket"
        );
        assert_eq!(
            client.copy_source("p/blocks/ab/x y"),
            "bucket/p/blocks/ab/x%20y"
        );
    }

    #[test]
    fn reads_s3_error_bodies() {
        let response = RawResponse {
            status: StatusCode::FORBIDDEN,
            body: Bytes::from_static(
                b"<?xml version=\"1.0\"?><Error><Code>SignatureDoesNotMatch</Code><Message>a &amp; b</Message></Error>",
            ),
        };
        assert_eq!(
            response.error_code().as_deref(),
            Some("SignatureDoesNotMatch")
        );
        assert_eq!(response.error_message().as_deref(), Some("a & b"));
        assert_eq!(
            response.describe(),
            "403 Forbidden, SignatureDoesNotMatch: a & b"
        );
        assert_eq!(xml_element(b"<a>", "Code"), None);
        assert_eq!(xml_escape("<\"&'>"), "&lt;&quot;&amp;&apos;&gt;");
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let max = Duration::from_millis(300);
        assert_eq!(
            next_backoff(Duration::from_millis(100), max),
            Duration::from_millis(200)
        );
        assert_eq!(next_backoff(Duration::from_millis(200), max), max);
    }
}
