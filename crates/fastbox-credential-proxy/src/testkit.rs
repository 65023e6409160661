//! For tests of the proxy (feature `testkit`): a test CA and a certificate it signs, a TLS
//! (or plain HTTP) host that records every request it gets (its `Authorization` header, out
//! of band) and echoes that header back, and a client's one request over TLS.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::net::{TcpListener, TcpStream};

/// What a host received: one line per request, `METHOD TARGET authorization=VALUE`.
pub type Received = Arc<Mutex<Vec<String>>>;

/// A CA, and a certificate it signed for some names with its key.
pub struct TestCert {
    pub ca: CertificateDer<'static>,
    /// The CA's certificate, PEM (for a trust store file).
    pub ca_pem: String,
    pub cert: CertificateDer<'static>,
    pub key: PrivateKeyDer<'static>,
}

impl TestCert {
    /// A new CA and its certificate for `names`.
    pub fn new(names: &[&str]) -> Self {
        let ca_key = KeyPair::generate().expect("a key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("params");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = ca.self_signed(&ca_key).expect("the CA");
        let key = KeyPair::generate().expect("a key");
        let cert = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .expect("params")
            .signed_by(&key, &ca, &ca_key)
            .expect("the certificate");
        Self {
            ca: ca.der().clone(),
            ca_pem: ca.pem(),
            cert: cert.der().clone(),
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        }
    }

    /// Roots holding this CA only.
    pub fn roots(&self) -> RootCertStore {
        let mut roots = RootCertStore::empty();
        roots.add(self.ca.clone()).expect("the CA");
        roots
    }
}

/// Serves TLS with `cert` on `listener`: each request is recorded and answered with its
/// `Authorization` header, in the header `x-echo` and in the body (`echo: VALUE`).
pub fn recording_host(listener: TcpListener, cert: &TestCert) -> Received {
    let config =
        ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(vec![cert.cert.clone()], cert.key.clone_key())
            .expect("the certificate");
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let received: Received = Arc::default();
    let log = received.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let (acceptor, log) = (acceptor.clone(), log.clone());
            tokio::spawn(async move {
                if let Ok(tls) = acceptor.accept(tcp).await {
                    serve_recording(tls, log).await;
                }
            });
        }
    });
    received
}

/// [`recording_host`] in plain HTTP.
pub fn recording_plain_host(listener: TcpListener) -> Received {
    let received: Received = Arc::default();
    let log = received.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(serve_recording(tcp, log.clone()));
        }
    });
    received
}

/// Serves HTTP/1.1 on `io`: each request recorded in `log` and its `Authorization` echoed.
async fn serve_recording<IO>(io: IO, log: Received)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        let log = log.clone();
        async move {
            let auth = req
                .headers()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            log.lock().expect("log lock").push(format!(
                "{} {} authorization={auth}",
                req.method(),
                req.uri()
            ));
            let response = hyper::Response::builder()
                .header("x-echo", auth.clone())
                .header("content-length", (auth.len() + 6).to_string())
                .body(Full::new(Bytes::from(format!("echo: {auth}"))))
                .expect("a response");
            Ok::<_, std::convert::Infallible>(response)
        }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(io), service)
        .await;
}

/// What a [`get`] got back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    /// The `x-echo` header.
    pub echo: String,
    pub body: String,
}

/// Over `tcp`: TLS for `name` trusting `roots`, then `GET /user/repos?per_page=1` with
/// `Host: host_header` and a placeholder `Authorization` of the sandbox's own.
pub async fn get(tcp: TcpStream, roots: RootCertStore, name: &str, host_header: &str) -> Answer {
    let config =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from(name.to_string()).expect("a name"), tcp)
        .await
        .expect("the certificate verifies for the name");
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .expect("an HTTP connection");
    tokio::spawn(connection);
    let response = sender
        .send_request(
            hyper::Request::builder()
                .uri("/user/repos?per_page=1")
                .header("host", host_header)
                .header("authorization", "Bearer sandbox-placeholder")
                .body(Full::new(Bytes::new()))
                .expect("a request"),
        )
        .await
        .expect("an answer");
    let status = response.status().as_u16();
    let echo = response
        .headers()
        .get("x-echo")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let body = response
        .into_body()
        .collect()
        .await
        .expect("the body")
        .to_bytes();
    Answer {
        status,
        echo,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}
