//! The enforcer's lifecycle on the real nft table: what DNS answers put in a slot's learned
//! set (and for how long), that learned addresses are per slot, what a replace keeps, what
//! fails closed, and that removal leaves nothing.
//!
//! Privileged (root, `ip`, `nft`, `conntrack`); skipped with the reason printed otherwise.

mod common;

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use fastbox_egress::learned::{MIN_HOLD, SLACK};
use fastbox_egress::nft::{chain_name, learned_set_name};
use fastbox_egress::testkit::{Resolution, echo};
use fastbox_egress::{Action, EgressEnforcer, EgressError, EgressPolicy, Mode, SlotRef};
use fastbox_runtime::net::dns_forwarder::{DnsHook, QueryVerdict};

fn policy(default: Action, rules: &[(&str, &str)]) -> EgressPolicy {
    EgressPolicy::from_pairs(default, rules).unwrap()
}

fn nft(args: &[&str]) -> Result<String, String> {
    let out = Command::new("nft").args(args).output().unwrap();
    if out.status.success() {
        Ok(String::from_utf8(out.stdout).unwrap())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// The elements of a slot's learned set: address and timeout in seconds, from `nft -j`.
fn learned_set(lab: &Lab, ifname: &str) -> Vec<(Ipv4Addr, u64)> {
    let json = nft(&[
        "-j",
        "list",
        "set",
        "inet",
        &lab.prefix,
        &learned_set_name(ifname),
    ])
    .expect("list set");
    let doc: serde_json::Value = serde_json::from_str(&json).unwrap();
    let set = doc["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|item| item.get("set"))
        .expect("a set");
    let mut elements: Vec<(Ipv4Addr, u64)> = set["elem"]
        .as_array()
        .map(|elems| {
            elems
                .iter()
                .map(|e| {
                    let e = &e["elem"];
                    (
                        e["val"].as_str().unwrap().parse().unwrap(),
                        e["timeout"].as_u64().unwrap(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    elements.sort();
    elements
}

#[test]
fn enforcement_lifecycle_on_the_real_table() {
    // The credential proxy's port: a listener of the test's on the host.
    let proxy = TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0)).unwrap();
    let Some(lab) = Lab::start_custom(LabSetup {
        prefix: fastbox_testkit::run_prefix("0"),
        net: [10, 219, b'0'],
        hosts: fastbox_egress::testkit::hosts_block('0'),
        reach: Vec::new(),
        extra: fastbox_egress::testkit::Zone::new(),
        slot_limits: Default::default(),
        credential_proxy_port: Some(proxy.local_addr().unwrap().port()),
    }) else {
        return;
    };
    let first = policy(
        Action::Deny,
        &[("allow", ALLOWED.0), ("allow", SHORT.0), ("allow", NEVER.0)],
    );
    let a = lab.slot(0, &first);
    let b = lab.slot(1, &first);
    let ref_a = SlotRef::from(&a);

    // Answers open their addresses for max(TTL, 60 s), plus the write slack.
    let mut pa = Probe::new("slot a", &lab, &a);
    let started = Instant::now();
    pa.resolves(ALLOWED);
    let learning = started.elapsed();
    let started = Instant::now();
    pa.resolves(ALLOWED);
    eprintln!(
        "resolve through the proxy: {learning:?} when the answer is written to the set, {:?} when the set holds it already",
        started.elapsed()
    );
    pa.resolves(SHORT);
    assert_eq!(pa.failures, Vec::<String>::new());
    let hold = |ttl: u64| ttl.max(MIN_HOLD.as_secs()) + SLACK.as_secs();
    assert_eq!(
        learned_set(&lab, &a.host_if),
        [
            (lab.inet(ALLOWED.1), hold(300)),
            (lab.inet(SHORT.1), hold(5))
        ]
    );
    // Learned addresses are the slot's own: b learned nothing.
    assert!(learned_set(&lab, &b.host_if).is_empty());
    let mut pb = Probe::new("slot b", &lab, &b);
    pb.dropped(lab.inet(ALLOWED.1), PORT);
    let mut open = pa
        .connects(lab.inet(ALLOWED.1), PORT)
        .expect("a reaches ALLOWED");
    assert_eq!(pb.failures, Vec::<String>::new());

    // A replace keeps what the new policy still allows (open connection included) and
    // forgets the rest.
    let second = policy(
        Action::Deny,
        &[("allow", ALLOWED.0), ("allow", "*.wild.test")],
    );
    lab.enforcer.apply(&ref_a, &second).unwrap();
    assert_eq!(echo(&mut open, "still\n").unwrap(), "still\n");
    assert_eq!(
        learned_set(&lab, &a.host_if)
            .iter()
            .map(|e| e.0)
            .collect::<Vec<_>>(),
        [lab.inet(ALLOWED.1)]
    );
    pa.connects(lab.inet(ALLOWED.1), PORT);
    pa.dropped(lab.inet(SHORT.1), PORT);
    pa.refused(SHORT.0);
    assert_eq!(pa.failures, Vec::<String>::new());
    assert_eq!(lab.enforcer.policy(a.address), Some(second.clone()));
    assert_eq!(
        lab.enforcer.policy(a.address).unwrap().mode(),
        Mode::Enforcing
    );

    // Names that are not slot interfaces of the instance are refused before nft runs.
    for ifname in ["eth0", "lo", &format!("{}_up", lab.prefix), "x-0"] {
        let err = lab
            .enforcer
            .apply(
                &SlotRef {
                    ifname: ifname.into(),
                    address: a.address,
                },
                &second,
            )
            .unwrap_err();
        assert!(
            matches!(err, EgressError::NotASlot { .. }),
            "{ifname}: {err}"
        );
    }
    // Another slot cannot take an address that still has a policy.
    let err = lab
        .enforcer
        .apply(
            &SlotRef {
                ifname: b.host_if.clone(),
                address: a.address,
            },
            &second,
        )
        .unwrap_err();
    assert!(matches!(err, EgressError::AddressInUse { .. }), "{err}");

    // Fail closed: without the instance table, apply of a policy that needs rules fails,
    // and the slot stays without a policy: its DNS is refused. (Allow-all needs no rules.)
    let orphan_prefix = "fbzq0x9y";
    let orphan = Arc::new(EgressEnforcer::try_new(orphan_prefix).unwrap());
    let orphan_slot = SlotRef {
        ifname: format!("{orphan_prefix}-0"),
        address: Ipv4Addr::new(10, 219, 0, 1),
    };
    let err = orphan
        .apply(&orphan_slot, &EgressPolicy::deny_all())
        .unwrap_err();
    assert!(matches!(err, EgressError::Nft { .. }), "{err}");
    assert_eq!(orphan.policy(orphan_slot.address), None);
    assert_eq!(
        orphan.on_query(orphan_slot.address.into(), ALLOWED.0),
        QueryVerdict::Refuse
    );

    // Removal: chain, set and map element go; the slot's DNS is refused; twice is fine.
    lab.enforcer.remove(&ref_a).unwrap();
    lab.enforcer.remove(&ref_a).unwrap();
    assert!(
        nft(&[
            "list",
            "chain",
            "inet",
            &lab.prefix,
            &chain_name(&a.host_if)
        ])
        .is_err()
    );
    assert!(
        nft(&[
            "list",
            "set",
            "inet",
            &lab.prefix,
            &learned_set_name(&a.host_if)
        ])
        .is_err()
    );
    let map = nft(&["list", "map", "inet", &lab.prefix, "slot_egress"]).unwrap();
    assert!(!map.contains(&format!("\"{}\"", a.host_if)), "{map}");
    assert!(map.contains(&format!("\"{}\"", b.host_if)), "{map}");
    assert_eq!(pa.resolve(ALLOWED.0), Resolution::NXDOMAIN);
    assert_eq!(lab.enforcer.policy(a.address), None);
    // And a fresh apply works again.
    lab.apply(&a, &EgressPolicy::allow_all()).unwrap();
    pa.resolves(ALLOWED);
    pa.connects(lab.inet(NEVER.1), PORT);
    assert_eq!(pa.failures, Vec::<String>::new());

    drop(open);
    credential_proxy_redirect(&lab, &proxy);
    credential_proxy_end_to_end(&lab, proxy);
    lab.close();
}

/// The whole way, on the real table: a sandbox's HTTPS to a bound name is redirected to the
/// proxy, which resolves and connects as the sandbox and injects the vault's credential
/// (the host in the lab's internet records it); the sandbox never sees it back. A name no
/// binding takes passes untouched to where the sandbox aimed it, under its policy.
fn credential_proxy_end_to_end(lab: &Lab, proxy_listener: TcpListener) {
    use fastbox_credential_proxy::node::{Sandboxes, SlotConnector, serve};
    use fastbox_credential_proxy::testkit::{TestCert, get, recording_host};
    use fastbox_credential_proxy::{Proxy, ProxyCa, Session, Upstream};
    use std::sync::RwLock;

    const SECRET: &str = "lab-s3cr3t-token";
    struct OneSandbox(Ipv4Addr, Session);
    impl Sandboxes for OneSandbox {
        fn session(&self, address: Ipv4Addr) -> Option<Session> {
            (address == self.0).then(|| self.1.clone())
        }
    }

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let cert = TestCert::new(&[ALLOWED.0, NEVER.0]);
    let slot = lab.slot(
        3,
        &policy(Action::Deny, &[("allow", ALLOWED.0), ("allow", NEVER.0)]),
    );
    let slot_ref = SlotRef::from(&slot);
    lab.enforcer
        .route_https_to_credential_proxy(&slot_ref, true)
        .unwrap();
    let vault: fastbox_credential_proxy::VaultSource = Arc::new(RwLock::new(Some(Arc::new(
        fastbox_vault::Vault::create(
            serde_json::from_value(serde_json::json!({
                "credentials": [{"name": "t", "source": {"type": "inline", "value": SECRET}}],
                "bindings": [{"name": "b", "match": {"hosts": [ALLOWED.0]},
                              "auth": {"type": "bearer", "credential": "t"}}]
            }))
            .unwrap(),
        )
        .unwrap(),
    ))));
    let session = Session {
        vault,
        connector: Arc::new(SlotConnector::for_slot(&slot)),
    };
    let proxy_ca = Arc::new(ProxyCa::generate("fastbox test proxy CA").unwrap());
    let netns = slot.netns_path.clone();
    // From inside the sandbox: a TCP connection to `to`.
    let sandbox_connect = move |to: SocketAddr| {
        let stream = fastbox_runtime::net::in_netns(&netns, move || {
            std::net::TcpStream::connect_timeout(&to, Duration::from_secs(3))
        })
        .unwrap()
        .expect("the sandbox connects");
        stream.set_nonblocking(true).unwrap();
        tokio::net::TcpStream::from_std(stream).unwrap()
    };
    runtime.block_on(async {
        // The hosts: port 443 of every address of the lab's internet.
        let host = fastbox_runtime::net::in_netns(lab.internet.netns_path(), || {
            std::net::TcpListener::bind((Ipv4Addr::UNSPECIFIED, 443))
        })
        .unwrap()
        .unwrap();
        host.set_nonblocking(true).unwrap();
        let received = recording_host(tokio::net::TcpListener::from_std(host).unwrap(), &cert);
        proxy_listener.set_nonblocking(true).unwrap();
        tokio::spawn(serve(
            tokio::net::TcpListener::from_std(proxy_listener).unwrap(),
            Arc::new(Proxy::new(
                proxy_ca.clone(),
                Upstream {
                    roots: Arc::new(cert.roots()),
                },
            )),
            Arc::new(OneSandbox(slot.address, session)),
        ));

        // Bound: the sandbox trusts the proxy's CA; the host gets the credential.
        let mut proxy_roots = rustls::RootCertStore::empty();
        proxy_roots.add(proxy_ca.certificate_der()).unwrap();
        let to = SocketAddr::from((lab.inet(ALLOWED.1), 443));
        let answer = get(sandbox_connect(to), proxy_roots, ALLOWED.0, ALLOWED.0).await;
        assert_eq!(answer.status, 200, "{answer:?}");
        assert_eq!(answer.body, "echo: Bearer [REDACTED]");
        assert_eq!(
            received.lock().unwrap().as_slice(),
            [format!(
                "GET /user/repos?per_page=1 authorization=Bearer {SECRET}"
            )]
        );

        // Unbound, and reached as the sandbox: first resolved by the sandbox (its policy
        // opens the address), then the real host's own certificate, nothing injected.
        let mut probe = Probe::new("credential proxy", lab, &slot);
        probe.resolves(NEVER);
        assert_eq!(probe.failures, Vec::<String>::new());
        let to = SocketAddr::from((lab.inet(NEVER.1), 443));
        let answer = get(sandbox_connect(to), cert.roots(), NEVER.0, NEVER.0).await;
        assert_eq!(answer.status, 200, "{answer:?}");
        assert_eq!(answer.body, "echo: Bearer sandbox-placeholder");
        assert_eq!(received.lock().unwrap().len(), 2);
    });
    lab.enforcer.remove(&slot_ref).unwrap();
}

/// A slot put through the credential proxy has its HTTPS arrive at the proxy's port, its
/// original destination readable there; the proxy's own source ports pass by; taken out,
/// nothing arrives. (An unredirected connection goes to the lab's internet, where nothing
/// listens on 443: it is refused there.)
fn credential_proxy_redirect(lab: &Lab, proxy: &TcpListener) {
    let slot = lab.slot(2, &EgressPolicy::allow_all());
    let slot_ref = SlotRef::from(&slot);
    let target = SocketAddr::from((lab.inet(ALLOWED.1), 443));
    proxy.set_nonblocking(true).unwrap();
    let arrived = |source_port: Option<u16>| {
        let connect = fastbox_runtime::net::in_netns(&slot.netns_path, move || {
            let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
            if let Some(port) = source_port {
                socket.bind(&SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)).into())?;
            }
            socket.connect_timeout(&target.into(), Duration::from_secs(2))
        })
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            match proxy.accept() {
                Ok((stream, peer)) => {
                    let original: SocketAddr = nix::sys::socket::getsockopt(
                        &stream,
                        nix::sys::socket::sockopt::OriginalDst,
                    )
                    .map(|a| {
                        SocketAddr::from((
                            Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                            u16::from_be(a.sin_port),
                        ))
                    })
                    .unwrap();
                    return Some((peer.ip(), original, connect.is_ok()));
                }
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(_) => return None,
            }
        }
    };
    assert_eq!(arrived(None), None, "not redirected before");
    lab.enforcer
        .route_https_to_credential_proxy(&slot_ref, true)
        .unwrap();
    assert_eq!(
        arrived(None),
        Some((std::net::IpAddr::from(slot.address), target, true)),
        "redirected, its destination kept"
    );
    let first = *fastbox_runtime::net::nft::PROXY_SOURCE_PORTS.start();
    assert_eq!(
        arrived(Some(first + 7)),
        None,
        "the proxy's own source ports pass"
    );
    lab.enforcer
        .route_https_to_credential_proxy(&slot_ref, false)
        .unwrap();
    lab.enforcer
        .route_https_to_credential_proxy(&slot_ref, false)
        .unwrap();
    assert_eq!(arrived(None), None, "taken out");
    lab.enforcer.remove(&slot_ref).unwrap();
}
