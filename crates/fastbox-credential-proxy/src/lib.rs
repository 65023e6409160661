//! The Credential Vault's proxy, on the node.
//!
//! The sandbox's TLS connections are handed to [`Proxy::handle`]. One whose ClientHello
//! names a host a binding of the sandbox's vault takes is ended here, with a certificate
//! for that name signed by the node's [`ProxyCa`] (which the sandbox trusts); every other
//! connection comes back untouched ([`Handled::NotBound`], with the bytes already read), for
//! the caller to pass on under the egress policy.
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

/// A future of the proxy's I/O.
pub type IoFuture<'a, T> = Pin<Box<dyn Future<Output = io::Result<T>> + Send + 'a>>;

/// How the proxy reaches the world on behalf of one sandbox: as the sandbox would, so its
/// egress policy and the private ranges decide (the node's connector resolves through the
/// sandbox's DNS forwarder and connects from the sandbox's network namespace).
pub trait Connector: Send + Sync {
    /// The addresses of host `name`'s HTTPS (port 443 unless a test moves it).
    fn resolve<'a>(&'a self, name: &'a str) -> IoFuture<'a, Vec<SocketAddr>>;
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
        let (prefix, server_name) = read_hello(&mut stream).await?;
        let bound = server_name.as_deref().is_some_and(|name| {
            session
                .vault
                .read()
                .expect("vault lock")
                .as_ref()
                .is_some_and(|v| v.binds_host("https", name))
        });
        let Some(name) = server_name.clone().filter(|_| bound) else {
            return Ok(Handled::NotBound {
                stream,
                prefix,
                server_name,
            });
        };
        let rewound = rewind::Rewind::new(prefix, stream);
        let tls = tokio_rustls::TlsAcceptor::from(self.tls.clone())
            .accept(rewound)
            .await
            .map_err(ProxyError::Tls)?;
        let exchange = Arc::new(exchange::Exchange {
            server_name: name,
            session,
            upstream: self.upstream.clone(),
        });
        hyper::server::conn::http1::Builder::new()
            .serve_connection(
                TokioIo::new(tls),
                hyper::service::service_fn(move |req| {
                    let exchange = exchange.clone();
                    async move { Ok::<_, std::convert::Infallible>(exchange.serve(req).await) }
                }),
            )
            .await?;
        Ok(Handled::Served)
    }
}

/// Reads until the ClientHello is whole: the bytes read, and the name it asks for (None
/// when it has none, or the stream is not TLS).
async fn read_hello<S: AsyncRead + Unpin>(
    stream: &mut S,
) -> Result<(Vec<u8>, Option<String>), ProxyError> {
    let mut acceptor = Acceptor::default();
    let mut prefix = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = stream.read(&mut buf).await.map_err(ProxyError::Hello)?;
        if n == 0 {
            return Ok((prefix, None));
        }
        prefix.extend_from_slice(&buf[..n]);
        if acceptor.read_tls(&mut &buf[..n]).is_err() {
            return Ok((prefix, None));
        }
        match acceptor.accept() {
            Ok(Some(accepted)) => {
                let name = accepted
                    .client_hello()
                    .server_name()
                    .map(|n| n.to_ascii_lowercase());
                return Ok((prefix, name));
            }
            Ok(None) if prefix.len() < MAX_HELLO => continue,
            Ok(None) | Err(_) => return Ok((prefix, None)),
        }
    }
}
