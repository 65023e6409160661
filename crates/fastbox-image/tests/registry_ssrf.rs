//! Pulls cannot be aimed at the inside: a registry, a token realm or a redirect in a private,
//! loopback or link-local network is refused before any connection unless the operator
//! allows it; nothing of a registry's error body reaches an error message; what a registry
//! sends is bounded.
//!
//! Everything here runs on loopback. Addresses outside the machine (10.x, 169.254.169.254)
//! appear only as targets that must be refused before a connection is attempted.

mod common;

use std::collections::HashMap;
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::fake_http::{FakeServer, Request, Response};
use common::{OCI_MANIFEST, TestImage, cache_with, sha256};
use fastbox_image::{ImageConfig, ImageError, NoProgress, RegistryAuth};

const MARKER: &str = "INTERNAL-SECRET-7f3a9c";

/// A loopback port that records every connection made to it (and answers none).
struct Tripwire {
    port: u16,
    hits: Arc<AtomicUsize>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Tripwire {
    fn start() -> Tripwire {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let hits = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (h, s) = (hits.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok(_) => {
                        h.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Tripwire {
            port,
            hits,
            stop,
            thread: Some(thread),
        }
    }

    fn hits(&self) -> usize {
        // Let a connection in flight be accepted before counting.
        std::thread::sleep(Duration::from_millis(50));
        self.hits.load(Ordering::SeqCst)
    }
}

impl Drop for Tripwire {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn config(allow: &[&str], insecure: &[&str]) -> ImageConfig {
    ImageConfig {
        registry_allow_private: allow.iter().map(|a| a.parse().unwrap()).collect(),
        insecure_registries: insecure.iter().map(|s| s.to_string()).collect(),
        registry_timeout_secs: 10,
        ..ImageConfig::default()
    }
}

/// A registry serving `image` as `team/app:v1`; blob requests go to `blob` (which may
/// redirect), every request is counted.
fn image_registry(
    image: &TestImage,
    blob: impl Fn(&str, &[u8]) -> Response + Send + Sync + 'static,
) -> (FakeServer, Arc<AtomicUsize>) {
    let requests = Arc::new(AtomicUsize::new(0));
    let counted = requests.clone();
    let manifest = image.manifest.clone();
    let blobs: HashMap<String, Vec<u8>> = image
        .blobs()
        .into_iter()
        .map(|b| (sha256(b), b.to_vec()))
        .collect();
    let server = FakeServer::start(Arc::new(move |req: &Request| {
        counted.fetch_add(1, Ordering::SeqCst);
        if req.path() == "/v2/team/app/manifests/v1" {
            return Response::new(200, manifest.clone()).header("Content-Type", OCI_MANIFEST);
        }
        match req
            .path()
            .strip_prefix("/v2/team/app/blobs/")
            .and_then(|d| blobs.get(d).map(|b| (d, b)))
        {
            Some((digest, bytes)) => blob(digest, bytes),
            None => Response::new(404, ""),
        }
    }));
    (server, requests)
}

fn refused(err: &ImageError) -> (&str, &str) {
    match err {
        ImageError::AddressRefused { target, via, .. } => (target.as_str(), via.as_str()),
        other => panic!("expected a refusal, got: {other}"),
    }
}

#[test]
fn loopback_registry_is_refused_by_default_and_allowed_by_the_setting() {
    let image = TestImage::sample();
    let (registry, requests) = image_registry(&image, |_, b| Response::new(200, b.to_vec()));
    let reference = format!("{}/team/app:v1", registry.addr);

    let (_tmp, cache) = cache_with(config(&[], &[]));
    let err = cache.resolve(&reference, None, &NoProgress).unwrap_err();
    eprintln!("{err}");
    assert_eq!(refused(&err), ("127.0.0.1", "the registry"));
    let message = err.to_string();
    for needle in [
        "127.0.0.1",
        "loopback 127.0.0.0/8",
        "registry_allow_private",
        "--registry-allow-private",
    ] {
        assert!(message.contains(needle), "{needle:?} missing: {message}");
    }
    assert_eq!(requests.load(Ordering::SeqCst), 0, "no request reached it");

    // Allowed by the setting: a network, or the one address.
    for allow in ["127.0.0.0/8", "127.0.0.1"] {
        let (_tmp, cache) = cache_with(config(&[allow], &[]));
        let resolved = cache
            .resolve(&reference, None, &NoProgress)
            .unwrap_or_else(|e| panic!("allowed by {allow}: {e}"));
        TestImage::check_sample_rootfs(&resolved.rootfs);
    }
    // Another loopback address is still refused.
    let (_tmp, cache) = cache_with(config(&["127.0.0.2"], &[]));
    let err = cache.resolve(&reference, None, &NoProgress).unwrap_err();
    refused(&err);

    // A registry the operator configured (an insecure-registry entry) is allowed as such.
    let (_tmp, cache) = cache_with(config(&[], &[&registry.addr]));
    let resolved = cache.resolve(&reference, None, &NoProgress).unwrap();
    assert_eq!(resolved.digest, image.config_digest());
}

#[test]
fn loopback_in_other_spellings_is_refused_before_connecting() {
    let wire = Tripwire::start();
    let (_tmp, cache) = cache_with(config(&[], &[]));
    for (reference, target) in [
        // A name: refused on what it resolves to, when connecting.
        (format!("localhost:{}/x/y:1", wire.port), "localhost ("),
        // IPv6 loopback and IPv4-mapped loopback literals.
        (format!("[::1]:{}/x/y:1", wire.port), "::1"),
        (
            format!("[::ffff:7f00:1]:{}/x/y:1", wire.port),
            "::ffff:127.0.0.1",
        ),
    ] {
        let err = cache.resolve(&reference, None, &NoProgress).unwrap_err();
        eprintln!("{err}");
        let (got, via) = refused(&err);
        assert!(got.starts_with(target), "{reference}: {got}");
        assert_eq!(via, "the registry");
        assert!(err.to_string().contains("registry_allow_private"), "{err}");
    }
    assert_eq!(wire.hits(), 0, "no connection was made");
}

#[test]
fn redirects_into_private_networks_are_refused_at_the_hop() {
    let wire = Tripwire::start();
    let image = TestImage::sample();
    let targets = [
        // Loopback at another port than the configured registry's.
        (format!("http://127.0.0.1:{}/blob", wire.port), "127.0.0.1"),
        // A private address: only ever a target to refuse, never connected to.
        ("http://10.255.255.1:5000/blob".to_owned(), "10.255.255.1"),
        (
            "http://[::ffff:169.254.169.254]/latest/meta-data/".to_owned(),
            "::ffff:169.254.169.254",
        ),
        // A name resolving to loopback: refused when the hop connects.
        (
            format!("http://localhost:{}/blob", wire.port),
            "localhost (",
        ),
    ];
    for (location, target) in targets {
        let loc = location.clone();
        let (registry, _) = image_registry(&image, move |_, _| {
            Response::new(307, "").header("Location", &loc)
        });
        // The registry itself is configured (allowed as such); nothing else on loopback is.
        let (_tmp, cache) = cache_with(config(&[], &[&registry.addr]));
        let started = Instant::now();
        let err = cache
            .resolve(&format!("{}/team/app:v1", registry.addr), None, &NoProgress)
            .unwrap_err();
        eprintln!("{err}");
        let (got, via) = refused(&err);
        assert!(got.starts_with(target), "{location}: refused {got}");
        assert_eq!(via, "a redirect from the registry", "{location}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "refused at once, no connection attempt timed out"
        );
        assert!(
            !err.to_string().contains("/blob") && !err.to_string().contains("meta-data"),
            "the redirect's path is not echoed: {err}"
        );
    }
    assert_eq!(wire.hits(), 0, "no redirect target was connected to");

    // Once allowed, the same hop is followed.
    let image2 = TestImage::sample();
    let blobs: HashMap<String, Vec<u8>> = image2
        .blobs()
        .into_iter()
        .map(|b| (format!("/cdn/{}", sha256(b)), b.to_vec()))
        .collect();
    let cdn = FakeServer::start(Arc::new(move |req: &Request| match blobs.get(req.path()) {
        Some(b) => Response::new(200, b.clone()),
        None => Response::new(404, ""),
    }));
    let cdn_addr = cdn.addr.clone();
    let (registry, _) = image_registry(&image2, move |digest, _| {
        Response::new(307, "").header("Location", &format!("http://{cdn_addr}/cdn/{digest}"))
    });
    let (_tmp, cache) = cache_with(config(&["127.0.0.0/8"], &[]));
    let resolved = cache
        .resolve(&format!("{}/team/app:v1", registry.addr), None, &NoProgress)
        .unwrap();
    TestImage::check_sample_rootfs(&resolved.rootfs);
}

/// A registry on loopback whose bearer challenge names `realm`.
fn realm_registry(realm: String) -> FakeServer {
    FakeServer::start(Arc::new(move |_req: &Request| {
        Response::new(401, "").header(
            "WWW-Authenticate",
            &format!(r#"Bearer realm="{realm}",service="x",scope="repository:team/app:pull""#),
        )
    }))
}

#[test]
fn token_realms_in_private_networks_are_refused_without_a_connection() {
    for realm in [
        "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
        "https://[::ffff:a9fe:a9fe]/token",
        "http://10.0.0.5:8080/token",
    ] {
        let registry = realm_registry(realm.to_owned());
        let (_tmp, cache) = cache_with(config(&[], &[&registry.addr]));
        let reference = format!("{}/team/app:v1", registry.addr);
        for auth in [None, Some(RegistryAuth::new("bob", "pw"))] {
            let started = Instant::now();
            let err = cache
                .resolve(&reference, auth.as_ref(), &NoProgress)
                .unwrap_err();
            eprintln!("{err}");
            let (target, via) = refused(&err);
            assert_eq!(via, "its token realm");
            assert!(
                target.contains("169.254.169.254") || target.contains("10.0.0.5"),
                "{target}"
            );
            assert!(err.to_string().contains("registry_allow_private"), "{err}");
            assert!(!err.to_string().contains("pw"), "{err}");
            assert!(started.elapsed() < Duration::from_secs(5));
        }
    }
    // On loopback, observably: the realm's port sees no connection.
    let wire = Tripwire::start();
    let registry = realm_registry(format!("http://127.0.0.1:{}/token", wire.port));
    let (_tmp, cache) = cache_with(config(&[], &[&registry.addr]));
    let err = cache
        .resolve(&format!("{}/team/app:v1", registry.addr), None, &NoProgress)
        .unwrap_err();
    assert_eq!(refused(&err), ("127.0.0.1", "its token realm"));
    assert_eq!(wire.hits(), 0);
}

#[test]
fn registry_error_bodies_never_reach_the_error_message() {
    let hits: Arc<Mutex<Vec<String>>> = Arc::default();
    let seen = hits.clone();
    let json_errors = format!(
        r#"{{"errors":[{{"code":"MANIFEST_UNKNOWN","message":"{MARKER}","detail":"{MARKER}"}},{{"code":"{MARKER}"}}]}}"#
    );
    let registry = FakeServer::start(Arc::new(move |req: &Request| {
        seen.lock().unwrap().push(req.path().to_owned());
        match req.path() {
            "/v2/html/app/manifests/v1" => Response::new(
                500,
                format!(
                    "<html><h1>Admin console</h1><pre>{MARKER} db=postgres://u:p@10.0.0.3</pre></html>"
                ),
            ),
            "/v2/json/app/manifests/v1" => Response::new(404, json_errors.clone()),
            "/v2/odd/app/manifests/v1" => Response::new(418, format!("{MARKER}\n").repeat(50_000)),
            _ => Response::new(404, MARKER),
        }
    }));
    let (_tmp, cache) = cache_with(config(&["127.0.0.0/8"], &[]));
    for (repo, status) in [("html/app", "500"), ("json/app", ""), ("odd/app", "418")] {
        let err = cache
            .resolve(&format!("{}/{repo}:v1", registry.addr), None, &NoProgress)
            .unwrap_err();
        let message = err.to_string();
        eprintln!("{message}");
        assert!(!message.contains(MARKER), "body echoed: {message}");
        assert!(!message.contains("postgres"), "body echoed: {message}");
        assert!(message.contains(status), "status named: {message}");
        if repo == "json/app" {
            assert!(matches!(err, ImageError::NotFound { .. }), "{err}");
            assert!(
                message.contains("MANIFEST_UNKNOWN"),
                "known code kept: {message}"
            );
        } else {
            assert!(matches!(err, ImageError::Registry { .. }), "{err}");
            assert!(message.contains("not shown"), "{message}");
        }
    }
    assert_eq!(hits.lock().unwrap().len(), 3);
}

#[test]
fn token_realm_error_bodies_are_not_echoed() {
    for (status, body) in [
        (500, format!("stack trace: {MARKER}")),
        // Valid JSON of the wrong shape: serde would quote the value.
        (200, format!(r#"{{"token": {{"{MARKER}": "{MARKER}"}}}}"#)),
        (200, format!(r#"{{"token": "{MARKER}"#)),
    ] {
        let token_server = FakeServer::start(Arc::new(move |_: &Request| {
            Response::new(status, body.clone())
        }));
        let registry = realm_registry(format!("http://{}/token", token_server.addr));
        let (_tmp, cache) = cache_with(config(&["127.0.0.0/8"], &[]));
        let err = cache
            .resolve(
                &format!("{}/team/app:v1", registry.addr),
                Some(&RegistryAuth::new("bob", "pw")),
                &NoProgress,
            )
            .unwrap_err();
        eprintln!("{err}");
        assert!(matches!(err, ImageError::Registry { .. }), "{err}");
        assert!(!err.to_string().contains(MARKER), "{err}");
    }
}

#[test]
fn oversized_manifests_tokens_and_blobs_are_refused() {
    let big = 4 * 1024 * 1024 + 1;
    // A manifest one byte over 4 MiB.
    let mut manifest = br#"{"schemaVersion":2,"x":""#.to_vec();
    manifest.resize(big - 2, b'a');
    manifest.extend_from_slice(b"\"}");
    assert_eq!(manifest.len(), big);
    let registry = FakeServer::start(Arc::new(move |_: &Request| {
        Response::new(200, manifest.clone()).header("Content-Type", OCI_MANIFEST)
    }));
    let (_tmp, cache) = cache_with(config(&["127.0.0.0/8"], &[]));
    let err = cache
        .resolve(&format!("{}/team/app:v1", registry.addr), None, &NoProgress)
        .unwrap_err();
    eprintln!("{err}");
    assert!(matches!(err, ImageError::InvalidImage { .. }), "{err}");
    assert!(err.to_string().contains("larger than 4.0 MiB"), "{err}");

    // A token answer over 4 MiB.
    let token = format!(r#"{{"token":"{}"}}"#, "t".repeat(big));
    let token_server = FakeServer::start(Arc::new(move |_: &Request| {
        Response::new(200, token.clone())
    }));
    let registry = realm_registry(format!("http://{}/token", token_server.addr));
    let err = cache
        .resolve(
            &format!("{}/team/app:v1", registry.addr),
            Some(&RegistryAuth::new("bob", "pw")),
            &NoProgress,
        )
        .unwrap_err();
    eprintln!("{err}");
    assert!(
        err.to_string()
            .contains("token response larger than 4.0 MiB"),
        "{err}"
    );

    // A blob longer than its manifest says is cut off.
    let image = TestImage::sample();
    let config_digest = image.config_digest();
    let (registry, _) = image_registry(&image, move |digest, bytes| {
        let mut body = bytes.to_vec();
        if digest != config_digest {
            body.extend(std::iter::repeat_n(0u8, 8 * 1024 * 1024));
        }
        Response::new(200, body)
    });
    let err = cache
        .resolve(&format!("{}/team/app:v1", registry.addr), None, &NoProgress)
        .unwrap_err();
    eprintln!("{err}");
    assert!(
        err.to_string().contains("larger than the manifest's"),
        "{err}"
    );
}
