//! The Credential Vault's proxy, on the node.
//!
//! The sandbox's TLS connections are handed to [`Proxy::handle`]. One whose ClientHello
//! names a host a binding of the sandbox's vault takes is ended here, with a certificate
//! for that name signed by the node's [`ProxyCa`] (which the sandbox trusts); every other
//! connection comes back untouched ([`Handled::NotBound`], with the bytes already read), for
//! the caller to pass on under the egress policy.
//!
//! Plain HTTP connections go to [`Proxy::handle_plain`]: one whose first request names (in
//! `Host`) a host a binding takes *for the `http` scheme* is served the same way, without
//! TLS either side (a binding must ask for `http`; none does by default); any other comes
//! back untouched.
//!
//! On an ended connection each HTTP/1.1 request ([`exchange`]):
//! - must name, in its `Host`, the name the ClientHello asked for (else 421, nothing sent);
//! - gets the credentials of the binding it falls under (`fastbox_vault::inject`);
//! - goes to the host itself: the name resolved and connected to through the sandbox's
//!   [`Connector`] (so its egress policy decides), TLS verified against the roots given
//!   (the host's trust store) for that name; never to where the sandbox aimed the
//!   connection;
//! - comes back with every credential value and placeholder redacted, headers and body.
//!
//! Values never leave this process except towards the verified host.

mod body;
pub mod ca;
mod exchange;
pub mod node;
mod rewind;
#[cfg(feature = "testkit")]
pub mod testkit;

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, RwLock};

use fastbox_vault::Vault;
use hyper_util::rt::TokioIo;
use rustls::RootCertStore;
use rustls::server::{Acceptor, ServerConfig};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::TcpStream;

pub use ca::{CaError, ProxyCa};

/// The largest ClientHello read before giving up on finding a name in it.
const MAX_HELLO: usize = 16 * 1024;
/// The largest first request head read before giving up on finding its `Host`.
const MAX_HEAD: usize = 16 * 1024;
/// How long the proxy waits for a connection's first bytes (a ClientHello, a request head).
/// A sandbox speaking a protocol where the host speaks first gets its connection passed on
/// untouched after this.
const FIRST_BYTES_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);
/// How long a request's head may take to come on a served connection, the first one and each
/// after (an idle keep-alive connection is closed after this).
const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// A future of the proxy's I/O.
pub type IoFuture<'a, T> = Pin<Box<dyn Future<Output = io::Result<T>> + Send + 'a>>;

/// The scheme of a sandbox's connection: which bindings take it, and how the host is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    Http,
    Https,
}

impl Scheme {
    pub fn as_str(self) -> &'static str {
        match self {
            Scheme::Http => "http",
            Scheme::Https => "https",
        }
    }
}

/// How the proxy reaches the world on behalf of one sandbox: as the sandbox would, so its
/// egress policy and the private ranges decide (the node's connector resolves through the
/// sandbox's DNS forwarder and connects from the sandbox's network namespace).
pub trait Connector: Send + Sync {
    /// The addresses of host `name`'s `scheme` port (80 or 443, unless a test moves them).
    fn resolve<'a>(&'a self, name: &'a str, scheme: Scheme) -> IoFuture<'a, Vec<SocketAddr>>;
    /// A TCP connection to `address`.
    fn connect(&self, address: SocketAddr) -> IoFuture<'_, TcpStream>;
}

/// How the proxy verifies bound hosts.
#[derive(Clone)]
pub struct Upstream {
    /// The roots a host's certificate must chain to (the host's trust store).
    pub roots: Arc<RootCertStore>,
}

/// A sandbox's vault as the proxy reads it: the current one at each request.
pub type VaultSource = Arc<RwLock<Option<Arc<Vault>>>>;

/// What the proxy needs of the sandbox a connection comes from.
#[derive(Clone)]
pub struct Session {
    pub vault: VaultSource,
    pub connector: Arc<dyn Connector>,
}

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("reading the ClientHello: {0}")]
    Hello(io::Error),
    #[error("TLS with the sandbox: {0}")]
    Tls(io::Error),
    #[error("serving HTTP to the sandbox: {0}")]
    Http(#[from] hyper::Error),
}

/// What became of a connection.
pub enum Handled<S> {
    /// Ended here and served.
    Served,
    /// Not for the proxy: no name, a name no binding takes, or not TLS. `prefix` holds the
    /// bytes already read from `stream`, to send on first.
    NotBound {
        stream: S,
        prefix: Vec<u8>,
        server_name: Option<String>,
    },
}

/// The proxy of one node.
pub struct Proxy {
    tls: Arc<ServerConfig>,
    upstream: Upstream,
}

impl Proxy {
    pub fn new(ca: Arc<ProxyCa>, upstream: Upstream) -> Self {
        let mut tls =
            ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .expect("ring supports the default versions")
                .with_no_client_auth()
                .with_cert_resolver(Arc::new(ca::HostCertificates(ca)));
        // HTTP/1.1 only: each request is read whole before it goes on.
        tls.alpn_protocols = vec![b"http/1.1".to_vec()];
        Self {
            tls: Arc::new(tls),
            upstream,
        }
    }

    /// Takes a TLS connection the sandbox opened (to port 443 of any address).
    pub async fn handle<S>(&self, mut stream: S, session: Session) -> Result<Handled<S>, ProxyError>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let mut prefix = Vec::new();
        let server_name = first_bytes(read_hello(&mut stream, &mut prefix)).await?;
        let (name, rewound) =
            match take_if_bound(stream, prefix, server_name, Scheme::Https, &session) {
                Ok(taken) => taken,
                Err(untouched) => return Ok(untouched),
            };
        let tls = tokio_rustls::TlsAcceptor::from(self.tls.clone())
            .accept(rewound)
            .await
            .map_err(ProxyError::Tls)?;
        self.serve(tls, name, Scheme::Https, session).await?;
        Ok(Handled::Served)
    }

    /// Takes a plain HTTP connection the sandbox opened (to port 80 of any address). Only a
    /// host bound for the `http` scheme is served here; each request of the connection must
    /// name the first one's host (else 421).
    pub async fn handle_plain<S>(
        &self,
        mut stream: S,
        session: Session,
    ) -> Result<Handled<S>, ProxyError>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let mut prefix = Vec::new();
        let host = first_bytes(read_head(&mut stream, &mut prefix)).await?;
        let (name, rewound) = match take_if_bound(stream, prefix, host, Scheme::Http, &session) {
            Ok(taken) => taken,
            Err(untouched) => return Ok(untouched),
        };
        self.serve(rewound, name, Scheme::Http, session).await?;
        Ok(Handled::Served)
    }

    /// Serves HTTP/1.1 on `io`, every request for host `name` over `scheme`.
    async fn serve<S>(
        &self,
        io: S,
        name: String,
        scheme: Scheme,
        session: Session,
    ) -> Result<(), ProxyError>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let exchange = Arc::new(exchange::Exchange {
            server_name: name,
            scheme,
            session,
            upstream: self.upstream.clone(),
        });
        hyper::server::conn::http1::Builder::new()
            // A request's head must come whole within this (a client that trickles, or
            // keeps an idle connection, is closed).
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(HEADER_READ_TIMEOUT)
            .serve_connection(
                TokioIo::new(io),
                hyper::service::service_fn(move |req| {
                    let exchange = exchange.clone();
                    async move { Ok::<_, std::convert::Infallible>(exchange.serve(req).await) }
                }),
            )
            .await?;
        Ok(())
    }
}

/// The name a connection's first bytes asked for, when a binding takes it for `scheme`, and
/// the stream that replays those bytes; otherwise the connection back, untouched.
fn take_if_bound<S>(
    stream: S,
    prefix: Vec<u8>,
    name: Option<String>,
    scheme: Scheme,
    session: &Session,
) -> Result<(String, rewind::Rewind<S>), Handled<S>> {
    match name {
        Some(name) if session.binds_host(scheme, &name) => {
            Ok((name, rewind::Rewind::new(prefix, stream)))
        }
        server_name => Err(Handled::NotBound {
            stream,
            prefix,
            server_name,
        }),
    }
}

impl Session {
    /// Whether the sandbox's vault binds `name` for `scheme` now.
    fn binds_host(&self, scheme: Scheme, name: &str) -> bool {
        self.vault
            .read()
            .expect("vault lock")
            .as_ref()
            .is_some_and(|v| v.binds_host(scheme.as_str(), name))
    }
}

/// What `read` found (None when it did not finish within [`FIRST_BYTES_TIMEOUT`]).
async fn first_bytes(
    read: impl Future<Output = Result<Option<String>, ProxyError>>,
) -> Result<Option<String>, ProxyError> {
    match tokio::time::timeout(FIRST_BYTES_TIMEOUT, read).await {
        Ok(found) => found,
        Err(_) => Ok(None),
    }
}

/// Reads once into `buf` and appends what came to `prefix`; 0 at the end of the stream.
async fn read_more<S: AsyncRead + Unpin>(
    stream: &mut S,
    prefix: &mut Vec<u8>,
    buf: &mut [u8],
) -> Result<usize, ProxyError> {
    let n = stream.read(buf).await.map_err(ProxyError::Hello)?;
    prefix.extend_from_slice(&buf[..n]);
    Ok(n)
}

/// Reads into `prefix` until the first request's head is whole: the host its `Host` names
/// (None when it names none, or the stream is not HTTP).
async fn read_head<S: AsyncRead + Unpin>(
    stream: &mut S,
    prefix: &mut Vec<u8>,
) -> Result<Option<String>, ProxyError> {
    let mut buf = [0u8; 4096];
    loop {
        if read_more(stream, prefix, &mut buf).await? == 0 {
            return Ok(None);
        }
        if let Some(end) = prefix.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&prefix[..end]).into_owned();
            let host = head
                .split("\r\n")
                .skip(1)
                .filter_map(|line| line.split_once(':'))
                .find(|(name, _)| name.trim().eq_ignore_ascii_case("host"))
                .map(|(_, value)| exchange::authority_host(value.trim()));
            return Ok(host.filter(|h| !h.is_empty()));
        }
        if prefix.len() >= MAX_HEAD {
            return Ok(None);
        }
    }
}

/// Reads into `prefix` until the ClientHello is whole: the name it asks for (None when it
/// has none, or the stream is not TLS).
async fn read_hello<S: AsyncRead + Unpin>(
    stream: &mut S,
    prefix: &mut Vec<u8>,
) -> Result<Option<String>, ProxyError> {
    let mut acceptor = Acceptor::default();
    let mut buf = [0u8; 4096];
    loop {
        let n = read_more(stream, prefix, &mut buf).await?;
        if n == 0 {
            return Ok(None);
        }
        if acceptor.read_tls(&mut &buf[..n]).is_err() {
            return Ok(None);
        }
        match acceptor.accept() {
            Ok(Some(accepted)) => {
                let name = accepted
                    .client_hello()
                    .server_name()
                    .map(|n| n.to_ascii_lowercase());
                return Ok(name);
            }
            Ok(None) if prefix.len() < MAX_HELLO => continue,
            Ok(None) | Err(_) => return Ok(None),
        }
    }
}
