//! The proxy between a "sandbox" client and real TLS servers on loopback: a bound host gets
//! the credential (recorded by the host itself), the sandbox never sees it, a request
//! naming another host is refused, an unbound name is handed back untouched, and a host
//! whose certificate does not verify never receives a request; plain HTTP is injected only
//! for a binding that asks for the `http` scheme.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use fastbox_credential_proxy::testkit::{
    Answer, TestCert, get, recording_host, recording_plain_host,
};
use fastbox_credential_proxy::{
    Connector, Handled, IoFuture, Proxy, ProxyCa, Scheme, Session, Upstream, VaultSource,
};
use fastbox_vault::Vault;
use fastbox_vault::wire::CreateRequest;
use rustls::pki_types::ServerName;
use rustls::{ClientConfig, RootCertStore};
use serde_json::json;
use tokio::net::{TcpListener, TcpStream};

const HOST: &str = "api.vault.test";
const SECRET: &str = "ghp_s3cr3t_value";

/// Names resolved from a table; connections from the host, to loopback only.
struct Fixed(HashMap<String, SocketAddr>);

impl Connector for Fixed {
    fn resolve<'a>(&'a self, name: &'a str, _: Scheme) -> IoFuture<'a, Vec<SocketAddr>> {
        Box::pin(async move {
            self.0
                .get(name)
                .map(|a| vec![*a])
                .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no such host"))
        })
    }

    fn connect(&self, address: SocketAddr) -> IoFuture<'_, TcpStream> {
        Box::pin(async move {
            assert!(address.ip().is_loopback(), "the test reaches loopback only");
            TcpStream::connect(address).await
        })
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

/// A recording TLS host with `cert` on loopback.
async fn host(cert: &TestCert) -> (SocketAddr, fastbox_credential_proxy::testkit::Received) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    (address, recording_host(listener, cert))
}

/// The proxy listening on loopback, its hosts resolved by `hosts`, roots `roots`; the
/// connections it hands back are sent on the channel.
async fn proxy(
    roots: RootCertStore,
    hosts: HashMap<String, SocketAddr>,
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
        },
    ));
    let session = Session {
        vault: vault(),
        connector: Arc::new(Fixed(hosts)),
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let (proxy, session, tx) = (proxy.clone(), session.clone(), tx.clone());
            tokio::spawn(async move {
                if let Ok(Handled::NotBound {
                    prefix,
                    server_name,
                    ..
                }) = proxy.handle(tcp, session).await
                {
                    let _ = tx.send((prefix, server_name));
                }
            });
        }
    });
    (address, ca, rx)
}

/// The sandbox's request through the proxy: TLS for `name`, trusting the proxy's CA.
async fn request(proxy: SocketAddr, ca: &ProxyCa, name: &str, host_header: &str) -> Answer {
    let mut roots = RootCertStore::empty();
    roots.add(ca.certificate_der()).unwrap();
    get(
        TcpStream::connect(proxy).await.unwrap(),
        roots,
        name,
        host_header,
    )
    .await
}

#[tokio::test]
async fn a_bound_host_gets_the_credential_and_the_sandbox_never_sees_it() {
    let cert = TestCert::new(&[HOST]);
    let (host_address, received) = host(&cert).await;
    let (proxy_address, proxy_ca, _) = proxy(
        cert.roots(),
        HashMap::from([(HOST.to_string(), host_address)]),
    )
    .await;

    let answer = request(proxy_address, &proxy_ca, HOST, HOST).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(
        received.lock().unwrap().as_slice(),
        [format!(
            "GET /user/repos?per_page=1 authorization=Bearer {SECRET}"
        )],
        "the host got the vault's credential, not the sandbox's placeholder"
    );
    assert_eq!(answer.echo, "Bearer [REDACTED]");
    assert_eq!(answer.body, "echo: Bearer [REDACTED]");
}

#[tokio::test]
async fn a_request_naming_another_host_is_refused_and_nothing_is_sent() {
    let cert = TestCert::new(&[HOST]);
    let (host_address, received) = host(&cert).await;
    let (proxy_address, proxy_ca, _) = proxy(
        cert.roots(),
        HashMap::from([(HOST.to_string(), host_address)]),
    )
    .await;
    let answer = request(proxy_address, &proxy_ca, HOST, "elsewhere.vault.test").await;
    assert_eq!(answer.status, 421, "{answer:?}");
    assert!(
        received.lock().unwrap().is_empty(),
        "nothing reached the host"
    );
}

#[tokio::test]
async fn a_host_whose_certificate_does_not_verify_never_gets_a_request() {
    // The name resolves to a server whose certificate another CA signed.
    let trusted = TestCert::new(&["unused.test"]);
    let impostor = TestCert::new(&["impostor.vault.test"]);
    let (impostor_address, impostor_received) = host(&impostor).await;
    let (proxy_address, proxy_ca, _) = proxy(
        trusted.roots(),
        HashMap::from([("impostor.vault.test".to_string(), impostor_address)]),
    )
    .await;
    let answer = request(
        proxy_address,
        &proxy_ca,
        "impostor.vault.test",
        "impostor.vault.test",
    )
    .await;
    assert_eq!(answer.status, 502, "{answer:?}");
    assert!(answer.body.contains("TLS"), "{answer:?}");
    assert!(impostor_received.lock().unwrap().is_empty());
    assert!(!answer.body.contains(SECRET));
}

#[tokio::test]
async fn an_unbound_name_is_handed_back_untouched() {
    let (proxy_address, proxy_ca, mut handed_back) =
        proxy(RootCertStore::empty(), HashMap::new()).await;
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

/// A session whose vault binds `HOST` for `schemes`, its names resolved by `hosts`.
fn plain_session(schemes: &[&str], hosts: HashMap<String, SocketAddr>) -> Session {
    let request: CreateRequest = serde_json::from_value(json!({
        "credentials": [{"name": "gh", "source": {"type": "inline", "value": SECRET}}],
        "bindings": [{"name": "api", "match": {"hosts": [HOST], "schemes": schemes},
                      "auth": {"type": "bearer", "credential": "gh"}}]
    }))
    .unwrap();
    Session {
        vault: Arc::new(RwLock::new(Some(Arc::new(Vault::create(request).unwrap())))),
        connector: Arc::new(Fixed(hosts)),
    }
}

/// One plain HTTP request for `host_header` through `proxy.handle_plain`; the answer's
/// bytes, or the bytes handed back when the proxy does not take the connection.
async fn plain_request(session: Session, host_header: &str) -> Result<String, Vec<u8>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let proxy = Proxy::new(
        Arc::new(ProxyCa::generate("fastbox test proxy CA").unwrap()),
        Upstream {
            roots: Arc::new(RootCertStore::empty()),
        },
    );
    let (mut client, sandbox_side) = tokio::io::duplex(1 << 16);
    let request = format!(
        "GET /user/repos?per_page=1 HTTP/1.1\r\nHost: {host_header}\r\n\
         Authorization: Bearer sandbox-placeholder\r\nConnection: close\r\n\r\n"
    );
    client.write_all(request.as_bytes()).await.unwrap();
    let served = tokio::spawn(async move { proxy.handle_plain(sandbox_side, session).await });
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), client.read_to_end(&mut answer));
    match served.await.unwrap().unwrap() {
        Handled::Served => {
            read.await.unwrap().unwrap();
            Ok(String::from_utf8_lossy(&answer).into_owned())
        }
        Handled::NotBound { prefix, .. } => Err(prefix),
    }
}

#[tokio::test]
async fn plain_http_is_injected_only_for_a_binding_that_asks_for_it() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let received = recording_plain_host(listener);
    let hosts = || HashMap::from([(HOST.to_string(), address)]);

    // The default binding (https only) leaves plain HTTP alone: handed back, bytes intact.
    let untouched = plain_request(plain_session(&["https"], hosts()), HOST).await;
    let prefix = untouched.expect_err("not taken");
    assert!(
        String::from_utf8_lossy(&prefix).starts_with("GET /user/repos?per_page=1 HTTP/1.1\r\n")
    );
    assert!(received.lock().unwrap().is_empty());

    // A binding with `http`: injected on the way out, redacted on the way back.
    let answer = plain_request(plain_session(&["http"], hosts()), HOST)
        .await
        .expect("served");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("echo: Bearer [REDACTED]"), "{answer}");
    assert!(!answer.contains(SECRET), "{answer}");
    assert_eq!(
        received.lock().unwrap().as_slice(),
        [format!(
            "GET /user/repos?per_page=1 authorization=Bearer {SECRET}"
        )]
    );
}

#[tokio::test]
async fn a_connection_whose_host_speaks_first_is_handed_back() {
    // The sandbox sends nothing (it waits for the host's greeting): after the proxy's wait
    // for a request head, the connection comes back to be passed on as it is.
    let proxy = Proxy::new(
        Arc::new(ProxyCa::generate("fastbox test proxy CA").unwrap()),
        Upstream {
            roots: Arc::new(RootCertStore::empty()),
        },
    );
    for plain in [true, false] {
        let (_client, sandbox_side) = tokio::io::duplex(1024);
        let session = plain_session(&["http", "https"], HashMap::new());
        let handled = tokio::time::timeout(Duration::from_secs(10), async {
            match plain {
                true => proxy.handle_plain(sandbox_side, session).await,
                false => proxy.handle(sandbox_side, session).await,
            }
        })
        .await
        .expect("handed back within the proxy's wait");
        let Ok(Handled::NotBound { prefix, .. }) = handled else {
            panic!("not handed back (plain: {plain})");
        };
        assert!(prefix.is_empty());
    }
}
