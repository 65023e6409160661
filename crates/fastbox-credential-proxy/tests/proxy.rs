//! The proxy between a "sandbox" client and real TLS servers on loopback: a bound host gets
//! the credential (recorded by the host itself), the sandbox never sees it, a request
//! naming another host is refused, an unbound name is handed back untouched, and a host
//! whose certificate does not verify never receives a request.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, RwLock};

use bytes::Bytes;
use fastbox_credential_proxy::{Handled, Proxy, ProxyCa, Resolve, Upstream, VaultSource};
use fastbox_vault::Vault;
use fastbox_vault::wire::CreateRequest;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use serde_json::json;
use tokio::net::{TcpListener, TcpStream};

const HOST: &str = "api.vault.test";
const SECRET: &str = "ghp_s3cr3t_value";

/// What a host received: one line per request, `METHOD TARGET authorization=VALUE`.
type Received = Arc<Mutex<Vec<String>>>;

/// A CA and a certificate it signed for `names`.
fn ca_and_cert(
    names: &[&str],
) -> (
    CertificateDer<'static>,
    CertificateDer<'static>,
    PrivateKeyDer<'static>,
) {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
        .unwrap()
        .signed_by(&key, &ca, &ca_key)
        .unwrap();
    (
        ca.der().clone(),
        cert.der().clone(),
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
    )
}

/// A TLS host on loopback that records each request and echoes its Authorization header
/// back, in a header and in the body.
async fn host(
    cert: CertificateDer<'static>,
    key: PrivateKeyDer<'static>,
) -> (SocketAddr, Received) {
    let config =
        ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![cert], key)
            .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let received: Received = Arc::default();
    let log = received.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let acceptor = acceptor.clone();
            let log = log.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let log = log.clone();
                        async move {
                            let auth = req
                                .headers()
                                .get("authorization")
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or("")
                                .to_string();
                            log.lock().unwrap().push(format!(
                                "{} {} authorization={auth}",
                                req.method(),
                                req.uri()
                            ));
                            let response = hyper::Response::builder()
                                .header("x-echo", auth.clone())
                                .header("content-length", (auth.len() + 6).to_string())
                                .body(Full::new(Bytes::from(format!("echo: {auth}"))))
                                .unwrap();
                            Ok::<_, std::convert::Infallible>(response)
                        }
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    (address, received)
}

struct Fixed(HashMap<String, SocketAddr>);

impl Resolve for Fixed {
    fn resolve(&self, host: &str, _port: u16) -> io::Result<Vec<SocketAddr>> {
        self.0
            .get(host)
            .map(|a| vec![*a])
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no such host"))
    }
}

fn vault() -> VaultSource {
    let request: CreateRequest = serde_json::from_value(json!({
        "credentials": [{"name": "gh", "source": {"type": "inline", "value": SECRET}}],
        "bindings": [{"name": "api", "match": {"hosts": [HOST, "impostor.vault.test"]},
                      "auth": {"type": "bearer", "credential": "gh"}}]
    }))
    .unwrap();
    Arc::new(RwLock::new(Some(Arc::new(Vault::create(request).unwrap()))))
}

/// The proxy listening on loopback, its hosts resolved by `hosts`, roots `roots`; the
/// connections it hands back are sent on the channel.
async fn proxy(
    roots: RootCertStore,
    hosts: HashMap<String, SocketAddr>,
    vault: VaultSource,
) -> (
    SocketAddr,
    Arc<ProxyCa>,
    tokio::sync::mpsc::UnboundedReceiver<(Vec<u8>, Option<String>)>,
) {
    let ca = Arc::new(ProxyCa::generate("fastbox test proxy CA").unwrap());
    let proxy = Arc::new(Proxy::new(
        ca.clone(),
        Upstream {
            roots: Arc::new(roots),
            resolver: Arc::new(Fixed(hosts)),
            address_allowed: Arc::new(|ip: IpAddr| ip.is_loopback()),
            https_port: 443,
        },
    ));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let proxy = proxy.clone();
            let vault = vault.clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                if let Ok(Handled::NotBound {
                    prefix,
                    server_name,
                    ..
                }) = proxy.handle(tcp, vault).await
                {
                    let _ = tx.send((prefix, server_name));
                }
            });
        }
    });
    (address, ca, rx)
}

/// The sandbox's side: TLS to `proxy` for `name`, trusting the proxy's CA, then one request
/// with `Host: host_header`. Returns the status, the `x-echo` header and the body.
async fn request(
    proxy: SocketAddr,
    ca: &ProxyCa,
    name: &str,
    host_header: &str,
) -> (u16, String, String) {
    let mut roots = RootCertStore::empty();
    roots.add(ca.certificate_der()).unwrap();
    let config =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
    let tcp = TcpStream::connect(proxy).await.unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from(name.to_string()).unwrap(), tcp)
        .await
        .expect("the sandbox trusts the proxy's certificate for the name");
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(connection);
    let response = sender
        .send_request(
            hyper::Request::builder()
                .uri("/user/repos?per_page=1")
                .header("host", host_header)
                .header("authorization", "Bearer sandbox-placeholder")
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    let status = response.status().as_u16();
    let echo = response
        .headers()
        .get("x-echo")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, echo, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn a_bound_host_gets_the_credential_and_the_sandbox_never_sees_it() {
    let (ca, cert, key) = ca_and_cert(&[HOST]);
    let (host_address, received) = host(cert, key).await;
    let mut roots = RootCertStore::empty();
    roots.add(ca).unwrap();
    let (proxy_address, proxy_ca, _) = proxy(
        roots,
        HashMap::from([(HOST.to_string(), host_address)]),
        vault(),
    )
    .await;

    let (status, echo, body) = request(proxy_address, &proxy_ca, HOST, HOST).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        received.lock().unwrap().as_slice(),
        [format!(
            "GET /user/repos?per_page=1 authorization=Bearer {SECRET}"
        )],
        "the host got the vault's credential, not the sandbox's placeholder"
    );
    assert_eq!(echo, "Bearer [REDACTED]");
    assert_eq!(body, "echo: Bearer [REDACTED]");
    assert!(!body.contains(SECRET) && !echo.contains(SECRET));
}

#[tokio::test]
async fn a_request_naming_another_host_is_refused_and_nothing_is_sent() {
    let (ca, cert, key) = ca_and_cert(&[HOST]);
    let (host_address, received) = host(cert, key).await;
    let mut roots = RootCertStore::empty();
    roots.add(ca).unwrap();
    let (proxy_address, proxy_ca, _) = proxy(
        roots,
        HashMap::from([(HOST.to_string(), host_address)]),
        vault(),
    )
    .await;
    let (status, _, body) = request(proxy_address, &proxy_ca, HOST, "elsewhere.vault.test").await;
    assert_eq!(status, 421, "{body}");
    assert!(
        received.lock().unwrap().is_empty(),
        "nothing reached the host"
    );
}

#[tokio::test]
async fn a_host_whose_certificate_does_not_verify_never_gets_a_request() {
    // The name resolves to a server whose certificate another CA signed.
    let (trusted_ca, _, _) = ca_and_cert(&["unused.test"]);
    let (_, impostor_cert, impostor_key) = ca_and_cert(&["impostor.vault.test"]);
    let (impostor_address, impostor_received) = host(impostor_cert, impostor_key).await;
    let mut roots = RootCertStore::empty();
    roots.add(trusted_ca).unwrap();
    let (proxy_address, proxy_ca, _) = proxy(
        roots,
        HashMap::from([("impostor.vault.test".to_string(), impostor_address)]),
        vault(),
    )
    .await;
    let (status, _, body) = request(
        proxy_address,
        &proxy_ca,
        "impostor.vault.test",
        "impostor.vault.test",
    )
    .await;
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("TLS"), "{body}");
    assert!(impostor_received.lock().unwrap().is_empty());
    assert!(!body.contains(SECRET));
}

#[tokio::test]
async fn an_unbound_name_is_handed_back_untouched() {
    let (proxy_address, proxy_ca, mut handed_back) =
        proxy(RootCertStore::empty(), HashMap::new(), vault()).await;
    let ca = proxy_ca.clone();
    let client = tokio::spawn(async move {
        let mut roots = RootCertStore::empty();
        roots.add(ca.certificate_der()).unwrap();
        let config =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth();
        let tcp = TcpStream::connect(proxy_address).await.unwrap();
        // The proxy does not answer it: the handshake does not complete here.
        let _ = tokio::time::timeout(
            std::time::Duration::from_secs(2),
            tokio_rustls::TlsConnector::from(Arc::new(config))
                .connect(ServerName::try_from("free.test").unwrap(), tcp),
        )
        .await;
    });
    let (prefix, name) = handed_back.recv().await.expect("handed back");
    assert_eq!(name.as_deref(), Some("free.test"));
    assert_eq!(prefix[0], 0x16, "the ClientHello's record, as it came");
    client.abort();
}
