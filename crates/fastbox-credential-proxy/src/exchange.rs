//! One request on an ended connection: the authority checked against the ClientHello's
//! name (or, in plain HTTP, the first request's), the credentials of its binding injected,
//! the request sent to the host itself, the answer redacted.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fastbox_vault::inject::{self, RequestHead};
use fastbox_vault::redact::Redactor;
use fastbox_vault::{RequestTarget, Vault};
use http::header::{self, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use rustls::ClientConfig;
use rustls::pki_types::ServerName;

use crate::body::Redacted;
use crate::{Scheme, Session, Upstream};

/// The largest request body read whole for a body substitution.
const MAX_SUBSTITUTED_BODY: usize = 8 * 1024 * 1024;
/// How long connecting to the host may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Headers of one hop only: never forwarded either way.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

type ProxyBody = BoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

pub(crate) struct Exchange {
    /// The name the ClientHello asked for, or the first request's host (lower case).
    pub server_name: String,
    pub scheme: Scheme,
    pub session: Session,
    pub upstream: Upstream,
}

/// Why a request was not forwarded, or its answer not had.
#[derive(Debug, thiserror::Error)]
enum ExchangeError {
    #[error("the request names {0:?}, not the host this connection was opened for")]
    Misdirected(String),
    #[error("the request body is over {MAX_SUBSTITUTED_BODY} bytes")]
    TooLarge,
    #[error("reading the request: {0}")]
    Request(String),
    #[error("{0}")]
    Upstream(String),
}

impl ExchangeError {
    fn status(&self) -> StatusCode {
        match self {
            ExchangeError::Misdirected(_) => StatusCode::MISDIRECTED_REQUEST,
            ExchangeError::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ExchangeError::Request(_) => StatusCode::BAD_REQUEST,
            ExchangeError::Upstream(_) => StatusCode::BAD_GATEWAY,
        }
    }
}

fn boxed<B>(body: B) -> ProxyBody
where
    B: hyper::body::Body<Data = Bytes> + Send + Sync + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    body.map_err(Into::into).boxed()
}

impl Exchange {
    pub async fn serve(&self, req: Request<Incoming>) -> Response<ProxyBody> {
        let vault = self.session.vault.read().expect("vault lock").clone();
        match self.forward(req, vault.as_deref()).await {
            Ok(response) => response,
            Err(e) => {
                tracing::info!(host = %self.server_name, error = %e, "credential proxy: request not forwarded");
                let mut response = Response::new(boxed(Full::new(Bytes::from(format!(
                    "fastbox credential proxy: {e}\n"
                )))));
                *response.status_mut() = e.status();
                response
            }
        }
    }

    async fn forward(
        &self,
        req: Request<Incoming>,
        vault: Option<&Vault>,
    ) -> Result<Response<ProxyBody>, ExchangeError> {
        let (parts, body) = req.into_parts();
        let authority = parts
            .headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .map(str::to_string)
            .or_else(|| parts.uri.authority().map(|a| a.to_string()))
            .unwrap_or_default();
        let host = authority_host(&authority);
        if host != self.server_name {
            return Err(ExchangeError::Misdirected(authority));
        }
        let target = parts
            .uri
            .path_and_query()
            .map_or("/".to_string(), |p| p.as_str().to_string());
        let path = target.split('?').next().unwrap_or("/").to_string();
        let mut head = RequestHead {
            method: parts.method.as_str().to_string(),
            target,
            headers: parts
                .headers
                .iter()
                .filter(|(n, _)| !HOP_BY_HOP.contains(&n.as_str()))
                .filter_map(|(n, v)| Some((n.as_str().to_string(), v.to_str().ok()?.to_string())))
                .collect(),
        };
        let binding = vault.and_then(|v| {
            v.binding_for(&RequestTarget {
                scheme: self.scheme.as_str(),
                host: &self.server_name,
                method: parts.method.as_str(),
                path: &path,
            })
        });
        let header_of = |name: &str| {
            head.headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.clone())
        };
        let content_type = header_of("content-type");
        let content_encoding = header_of("content-encoding");
        let body: ProxyBody = match (vault, binding) {
            (Some(vault), Some(binding)) => {
                inject::apply_head(vault, binding, &mut head);
                let substitutes_body = binding
                    .spec
                    .auth
                    .substitutions()
                    .iter()
                    .any(|s| s.surfaces.contains(&fastbox_vault::wire::Surface::Body));
                match substitutes_body {
                    true => {
                        let whole = Limited::new(body, MAX_SUBSTITUTED_BODY)
                            .collect()
                            .await
                            .map_err(|e| {
                                match e.downcast_ref::<http_body_util::LengthLimitError>() {
                                    Some(_) => ExchangeError::TooLarge,
                                    None => ExchangeError::Request(e.to_string()),
                                }
                            })?
                            .to_bytes();
                        let bytes = inject::apply_body(
                            vault,
                            binding,
                            content_type.as_deref(),
                            content_encoding.as_deref(),
                            &whole,
                        )
                        .map_or(whole, Bytes::from);
                        head.headers
                            .retain(|(n, _)| !n.eq_ignore_ascii_case("content-length"));
                        head.headers
                            .push(("content-length".into(), bytes.len().to_string()));
                        boxed(Full::new(bytes))
                    }
                    false => boxed(body),
                }
            }
            _ => boxed(body),
        };
        // Plain bodies back, so redaction sees what the host sent.
        head.headers
            .retain(|(n, _)| !n.eq_ignore_ascii_case("accept-encoding"));
        head.headers
            .push(("accept-encoding".into(), "identity".into()));
        let mut request = Request::builder()
            .method(head.method.as_str())
            .uri(head.target.as_str());
        for (name, value) in &head.headers {
            let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_str(value),
            ) else {
                continue;
            };
            request = request.header(name, value);
        }
        let request = request
            .body(body)
            .map_err(|e| ExchangeError::Request(e.to_string()))?;
        let response = self.send(request).await?;
        let redactor = Redactor::new(&vault.map(Vault::redaction_set).unwrap_or_default());
        let (mut parts, body) = response.into_parts();
        for name in HOP_BY_HOP {
            parts.headers.remove(*name);
        }
        // The body's length changes when a secret in it is masked.
        parts.headers.remove(header::CONTENT_LENGTH);
        for value in parts.headers.values_mut() {
            let redacted = redactor.redact(value.as_bytes());
            if redacted != value.as_bytes()
                && let Ok(v) = HeaderValue::from_bytes(&redacted)
            {
                *value = v;
            }
        }
        Ok(Response::from_parts(
            parts,
            boxed(Redacted::new(body, redactor)),
        ))
    }

    /// Sends `request` to the host: its name resolved here, every address checked, TLS
    /// verified for the name against the roots given (plain HTTP: none).
    async fn send(&self, request: Request<ProxyBody>) -> Result<Response<Incoming>, ExchangeError> {
        let upstream = &self.upstream;
        let connector = &self.session.connector;
        let addresses = connector
            .resolve(&self.server_name, self.scheme)
            .await
            .map_err(|e| ExchangeError::Upstream(format!("resolving {}: {e}", self.server_name)))?;
        if addresses.is_empty() {
            return Err(ExchangeError::Upstream(format!(
                "{} resolves to no address the sandbox may reach",
                self.server_name
            )));
        }
        let mut last = None;
        let mut tcp = None;
        for address in addresses {
            match tokio::time::timeout(CONNECT_TIMEOUT, connector.connect(address)).await {
                Ok(Ok(stream)) => {
                    tcp = Some(stream);
                    break;
                }
                Ok(Err(e)) => last = Some(e.to_string()),
                Err(_) => last = Some("timed out".into()),
            }
        }
        let tcp = tcp.ok_or_else(|| {
            ExchangeError::Upstream(format!(
                "connecting to {}: {}",
                self.server_name,
                last.unwrap_or_default()
            ))
        })?;
        if self.scheme == Scheme::Http {
            return self.send_over(tcp, request).await;
        }
        let mut config =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .expect("ring supports the default versions")
                .with_root_certificates(upstream.roots.clone())
                .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let server_name = ServerName::try_from(self.server_name.clone())
            .map_err(|e| ExchangeError::Upstream(e.to_string()))?;
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(server_name, tcp)
            .await
            .map_err(|e| ExchangeError::Upstream(format!("TLS with {}: {e}", self.server_name)))?;
        self.send_over(tls, request).await
    }

    /// Sends `request` over connection `io` to the host.
    async fn send_over<IO>(
        &self,
        io: IO,
        request: Request<ProxyBody>,
    ) -> Result<Response<Incoming>, ExchangeError>
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io))
            .await
            .map_err(|e| ExchangeError::Upstream(e.to_string()))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        sender
            .send_request(request)
            .await
            .map_err(|e| ExchangeError::Upstream(format!("{}: {e}", self.server_name)))
    }
}

/// The host of an authority (`Host` header), lower case, without port or trailing dot.
pub(crate) fn authority_host(authority: &str) -> String {
    let host = match authority.rsplit_once(':') {
        Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => authority,
    };
    let lower = host.to_ascii_lowercase();
    lower.strip_suffix('.').unwrap_or(&lower).to_string()
}

#[cfg(test)]
mod tests {
    use super::authority_host;

    #[test]
    fn authorities_compare_by_host() {
        assert_eq!(authority_host("API.Example.org:443"), "api.example.org");
        assert_eq!(authority_host("api.example.org."), "api.example.org");
        assert_eq!(authority_host("api.example.org"), "api.example.org");
    }
}
