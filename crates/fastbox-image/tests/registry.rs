//! Pulling from OCI distribution registries: a real `docker-registry` on loopback (anonymous
//! and htpasswd basic auth), and a fake registry + token server for the bearer-token dance.

mod common;

use std::collections::HashMap;
use std::fs;
use std::sync::{Arc, Mutex};

use base64::Engine as _;
use common::fake_http::{FakeServer, Request, Response};
use common::{OCI_CONFIG, OCI_INDEX, OCI_MANIFEST, Registry, TestImage, cache, sha256};
use fastbox_image::{ImageError, NoProgress, Progress, RegistryAuth};

#[derive(Default)]
struct Recorder {
    messages: Mutex<Vec<String>>,
    bytes: Mutex<u64>,
}

impl Progress for Recorder {
    fn message(&self, message: &str) {
        self.messages.lock().unwrap().push(message.to_owned());
    }
    fn bytes(&self, done: u64, _total: Option<u64>) {
        *self.bytes.lock().unwrap() = done;
    }
}

#[test]
fn anonymous_pull_unpacks_the_pushed_image() {
    let Some(registry) = Registry::start(None) else {
        return;
    };
    let image = TestImage::sample();
    registry.push("team/app", "v1", &image);
    let (_tmp, cache) = cache();
    let reference = format!("{}/team/app:v1", registry.addr);
    let progress = Recorder::default();
    let resolved = cache
        .resolve(&reference, None, &progress)
        .unwrap_or_else(|e| panic!("{e}\n{}", registry.log()));
    TestImage::check_sample_rootfs(&resolved.rootfs);
    assert_eq!(resolved.digest, image.config_digest());
    assert_eq!(
        resolved.manifest_digest.as_deref(),
        Some(image.manifest_digest().as_str())
    );
    assert_eq!(resolved.canonical_reference, reference);
    assert_eq!(resolved.config.entrypoint, ["/bin/tool"]);
    assert!(!resolved.cached);
    assert!(
        progress
            .messages
            .lock()
            .unwrap()
            .iter()
            .any(|m| m.contains("fetching manifest"))
    );
    assert!(
        *progress.bytes.lock().unwrap() > 0,
        "download progress reported"
    );
    // Layers are kept, verified, in the blob store.
    for layer in &image.layers {
        let stored = cache
            .cache_dir()
            .join("blobs/sha256")
            .join(&sha256(layer)[7..]);
        assert_eq!(fs::read(stored).unwrap(), *layer);
    }

    let again = cache.resolve(&reference, None, &NoProgress).unwrap();
    assert!(again.cached);
    assert_eq!(again.rootfs, resolved.rootfs);

    // Pinned by digest, and served from the cache once the registry is gone.
    let pinned = format!("{}/team/app@{}", registry.addr, image.manifest_digest());
    assert_eq!(
        cache.resolve(&pinned, None, &NoProgress).unwrap().rootfs,
        resolved.rootfs
    );
    let addr = registry.addr.clone();
    drop(registry);
    let offline = cache
        .resolve(
            &format!("{addr}/team/app@{}", image.manifest_digest()),
            None,
            &NoProgress,
        )
        .unwrap();
    assert_eq!(offline.rootfs, resolved.rootfs);
    let progress = Recorder::default();
    let by_tag = cache.resolve(&reference, None, &progress).unwrap();
    assert_eq!(by_tag.rootfs, resolved.rootfs);
    assert!(
        progress
            .messages
            .lock()
            .unwrap()
            .iter()
            .any(|m| m.contains("registry unreachable"))
    );
}

#[test]
fn missing_tags_and_repositories_are_not_found() {
    let Some(registry) = Registry::start(None) else {
        return;
    };
    registry.push("team/app", "v1", &TestImage::sample());
    let (_tmp, cache) = cache();
    for reference in [
        format!("{}/team/app:v2", registry.addr),
        format!("{}/team/nothing:v1", registry.addr),
    ] {
        let err = cache.resolve(&reference, None, &NoProgress).unwrap_err();
        assert!(
            matches!(err, ImageError::NotFound { .. }),
            "{reference}: {err}"
        );
        assert!(
            err.to_string().contains("UNKNOWN"),
            "registry error code carried: {err}"
        );
    }
}

#[test]
fn index_resolution_picks_linux_amd64() {
    let Some(registry) = Registry::start(None) else {
        return;
    };
    let amd64 = TestImage::sample();
    // The arm64 image has another config (and so another digest) over the same layers.
    let mut arm64 = TestImage::sample();
    let mut config: serde_json::Value = serde_json::from_slice(&arm64.config).unwrap();
    config["architecture"] = "arm64".into();
    arm64.config = serde_json::to_vec(&config).unwrap();
    arm64.manifest = arm64.manifest_with(OCI_CONFIG, common::OCI_LAYER_GZIP);
    registry.push("multi/app", "amd64-only", &amd64);
    registry.push("multi/app", "arm64-only", &arm64);
    let index = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [
            {"mediaType": OCI_MANIFEST, "digest": arm64.manifest_digest(), "size": arm64.manifest.len(),
             "platform": {"os": "linux", "architecture": "arm64", "variant": "v8"}},
            {"mediaType": OCI_MANIFEST, "digest": amd64.manifest_digest(), "size": amd64.manifest.len(),
             "platform": {"os": "linux", "architecture": "amd64"}},
        ],
    }))
    .unwrap();
    registry.push_manifest("multi/app", "latest", OCI_INDEX, &index);
    let (_tmp, cache) = cache();
    let resolved = cache
        .resolve(&format!("{}/multi/app", registry.addr), None, &NoProgress)
        .unwrap();
    let expected = if fastbox_image::host_platform() == "linux/arm64" {
        &arm64
    } else {
        &amd64
    };
    assert_eq!(resolved.digest, expected.config_digest());
    assert_eq!(
        resolved.manifest_digest.as_deref(),
        Some(expected.manifest_digest().as_str())
    );
    TestImage::check_sample_rootfs(&resolved.rootfs);

    // A single-platform image for another architecture resolves, with a warning.
    if fastbox_image::host_platform() == "linux/amd64" {
        let progress = Recorder::default();
        let other = cache
            .resolve(
                &format!("{}/multi/app:arm64-only", registry.addr),
                None,
                &progress,
            )
            .unwrap();
        assert_eq!(other.digest, arm64.config_digest());
        let messages = progress.messages.lock().unwrap();
        assert!(
            messages
                .iter()
                .any(|m| m.contains("built for linux/arm64, not linux/amd64")),
            "{messages:?}"
        );
    }
}

#[test]
fn basic_auth_registry_needs_the_right_credentials() {
    let Some(registry) = Registry::start(Some(("alice", "s3cret-pw"))) else {
        return;
    };
    registry.push("private/app", "v1", &TestImage::sample());
    let (_tmp, cache) = cache();
    let reference = format!("{}/private/app:v1", registry.addr);

    let err = cache.resolve(&reference, None, &NoProgress).unwrap_err();
    assert!(matches!(err, ImageError::AuthRequired { .. }), "{err}");
    assert!(err.to_string().contains("image.auth"), "{err}");

    let wrong = RegistryAuth::new("alice", "wrong");
    let err = cache
        .resolve(&reference, Some(&wrong), &NoProgress)
        .unwrap_err();
    eprintln!("{err}");
    assert!(
        matches!(err, ImageError::AuthFailed { status: 401, .. }),
        "{err}"
    );
    assert!(
        !err.to_string().contains("wrong"),
        "the password is never printed: {err}"
    );

    let right = RegistryAuth::new("alice", "s3cret-pw");
    let resolved = cache
        .resolve(&reference, Some(&right), &NoProgress)
        .unwrap();
    TestImage::check_sample_rootfs(&resolved.rootfs);
}

#[test]
fn unreachable_registry_is_reported_as_such() {
    let (_tmp, cache) = cache();
    let port = common::free_port();
    let err = cache
        .resolve(&format!("127.0.0.1:{port}/x/y:1"), None, &NoProgress)
        .unwrap_err();
    eprintln!("{err}");
    assert!(matches!(err, ImageError::Unreachable { .. }), "{err}");
    assert!(
        err.to_string().contains("Connection refused"),
        "the cause is in the message: {err}"
    );
    assert!(
        err.to_string()
            .contains(&format!("127.0.0.1:{port} is unreachable")),
        "{err}"
    );
}

/// A registry that wants bearer tokens from a realm on another port, as Docker Hub and GHCR do.
struct BearerRegistry {
    registry: FakeServer,
    _token_server: FakeServer,
    token_requests: Arc<Mutex<Vec<Request>>>,
}

fn bearer_registry(image: &TestImage, manifest: Vec<u8>, corrupt_layer: bool) -> BearerRegistry {
    bearer_registry_with_budget(image, manifest, corrupt_layer, u32::MAX)
}

/// Each issued token is good for `token_budget` registry requests (then "expires").
fn bearer_registry_with_budget(
    image: &TestImage,
    manifest: Vec<u8>,
    corrupt_layer: bool,
    token_budget: u32,
) -> BearerRegistry {
    let token_requests = Arc::new(Mutex::new(Vec::new()));
    let seen = token_requests.clone();
    // (current token, requests it may still serve)
    let current: Arc<Mutex<(String, u32)>> = Arc::new(Mutex::new((String::new(), 0)));
    let issuer = current.clone();
    let expected_basic = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode("bob:hunter2")
    );
    let token_server = FakeServer::start(Arc::new(move |req: &Request| {
        seen.lock().unwrap().push(req.clone());
        if req.path() != "/token" {
            return Response::new(404, "");
        }
        match req.header("authorization") {
            Some(a) if a == expected_basic => {
                let token = format!("tok-{}", seen.lock().unwrap().len());
                *issuer.lock().unwrap() = (token.clone(), token_budget);
                Response::new(200, format!(r#"{{"token":"{token}","expires_in":300}}"#))
            }
            Some(_) => Response::new(401, r#"{"details":"incorrect username or password"}"#),
            // Anonymous tokens exist, but grant nothing on this private repository.
            None => Response::new(200, r#"{"token":"anonymous"}"#),
        }
    }));
    let realm = format!("http://{}/token", token_server.addr);
    let mut content: HashMap<String, (String, Vec<u8>)> = HashMap::new();
    let manifest_digest = sha256(&manifest);
    content.insert(
        "/v2/private/app/manifests/v1".into(),
        (OCI_MANIFEST.into(), manifest.clone()),
    );
    content.insert(
        format!("/v2/private/app/manifests/{manifest_digest}"),
        (OCI_MANIFEST.into(), manifest),
    );
    for blob in image.blobs() {
        let mut body = blob.to_vec();
        if corrupt_layer && blob != image.config.as_slice() {
            body[20] ^= 0x55;
        }
        content.insert(
            format!("/v2/private/app/blobs/{}", sha256(blob)),
            ("application/octet-stream".into(), body),
        );
    }
    let registry = FakeServer::start(Arc::new(move |req: &Request| {
        let challenge = format!(
            r#"Bearer realm="{realm}",service="fake-registry",scope="repository:private/app:pull""#
        );
        let valid = {
            let mut cur = current.lock().unwrap();
            let ok = !cur.0.is_empty()
                && cur.1 > 0
                && req.header("authorization") == Some(&format!("Bearer {}", cur.0));
            if ok {
                cur.1 -= 1;
            }
            ok
        };
        if !valid {
            return Response::new(
                401,
                r#"{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}"#,
            )
            .header("WWW-Authenticate", &challenge);
        }
        match content.get(req.path()) {
            Some((ct, body)) => Response::new(200, body.clone()).header("Content-Type", ct),
            None => Response::new(
                404,
                r#"{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown"}]}"#,
            ),
        }
    }));
    BearerRegistry {
        registry,
        _token_server: token_server,
        token_requests,
    }
}

#[test]
fn bearer_token_dance_with_credentials() {
    let image = TestImage::sample();
    let fake = bearer_registry(&image, image.manifest.clone(), false);
    let (_tmp, cache) = cache();
    let reference = format!("{}/private/app:v1", fake.registry.addr);
    let auth = RegistryAuth::new("bob", "hunter2");
    let resolved = cache.resolve(&reference, Some(&auth), &NoProgress).unwrap();
    TestImage::check_sample_rootfs(&resolved.rootfs);
    assert_eq!(resolved.digest, image.config_digest());
    let requests = fake.token_requests.lock().unwrap();
    assert_eq!(requests.len(), 1, "one token serves the whole pull");
    let target = &requests[0].target;
    assert!(target.contains("service=fake-registry"), "{target}");
    assert!(
        target.contains("scope=repository%3Aprivate%2Fapp%3Apull"),
        "{target}"
    );
}

#[test]
fn expired_bearer_token_is_renewed_mid_pull() {
    let image = TestImage::sample();
    let fake = bearer_registry_with_budget(&image, image.manifest.clone(), false, 2);
    let (_tmp, cache) = cache();
    let reference = format!("{}/private/app:v1", fake.registry.addr);
    let resolved = cache
        .resolve(
            &reference,
            Some(&RegistryAuth::new("bob", "hunter2")),
            &NoProgress,
        )
        .unwrap();
    TestImage::check_sample_rootfs(&resolved.rootfs);
    // manifest + config + 2 layers = 4 requests at 2 per token.
    assert_eq!(fake.token_requests.lock().unwrap().len(), 2);
}

#[test]
fn bearer_token_failures_are_auth_errors() {
    let image = TestImage::sample();
    let fake = bearer_registry(&image, image.manifest.clone(), false);
    let (_tmp, cache) = cache();
    let reference = format!("{}/private/app:v1", fake.registry.addr);
    let err = cache.resolve(&reference, None, &NoProgress).unwrap_err();
    assert!(
        matches!(err, ImageError::AuthRequired { .. }),
        "anonymous token refused: {err}"
    );
    let err = cache
        .resolve(
            &reference,
            Some(&RegistryAuth::new("bob", "nope")),
            &NoProgress,
        )
        .unwrap_err();
    assert!(
        matches!(err, ImageError::AuthFailed { ref username, .. } if username == "bob"),
        "{err}"
    );
}

#[test]
fn corrupted_blob_fails_verification_and_publishes_nothing() {
    let image = TestImage::sample();
    let fake = bearer_registry(&image, image.manifest.clone(), true);
    let (_tmp, cache) = cache();
    let reference = format!("{}/private/app:v1", fake.registry.addr);
    let err = cache
        .resolve(
            &reference,
            Some(&RegistryAuth::new("bob", "hunter2")),
            &NoProgress,
        )
        .unwrap_err();
    assert!(matches!(err, ImageError::DigestMismatch { .. }), "{err}");
    assert!(err.to_string().contains("expected sha256:"), "{err}");
    let dir = cache.cache_dir();
    assert!(
        fs::read_dir(dir.join("images/sha256"))
            .unwrap()
            .next()
            .is_none()
    );
    assert!(fs::read_dir(dir.join("tmp")).unwrap().next().is_none());
    let partial = fs::read_dir(dir.join("blobs/sha256"))
        .unwrap()
        .flatten()
        .any(|e| e.file_name().to_string_lossy().ends_with(".partial"));
    assert!(!partial, "no partial download left");
}

#[test]
fn artifacts_and_unknown_layer_types_are_unsupported() {
    let image = TestImage::sample();
    for (config_type, layer_type, needle) in [
        (
            "application/vnd.cncf.helm.config.v1+json",
            common::OCI_LAYER_GZIP,
            "helm",
        ),
        (
            OCI_CONFIG,
            "application/vnd.example.layer.v1+weird",
            "weird",
        ),
    ] {
        let fake = bearer_registry(&image, image.manifest_with(config_type, layer_type), false);
        let (_tmp, cache) = cache();
        let reference = format!("{}/private/app:v1", fake.registry.addr);
        let err = cache
            .resolve(
                &reference,
                Some(&RegistryAuth::new("bob", "hunter2")),
                &NoProgress,
            )
            .unwrap_err();
        assert!(
            matches!(err, ImageError::UnsupportedMediaType { .. }),
            "{err}"
        );
        assert!(err.to_string().contains(needle), "{err}");
    }
}

#[test]
fn digest_pinned_reference_must_match_the_manifest() {
    let image = TestImage::sample();
    let fake = bearer_registry(&image, image.manifest.clone(), false);
    let (_tmp, cache) = cache();
    let auth = RegistryAuth::new("bob", "hunter2");
    let ok = format!(
        "{}/private/app@{}",
        fake.registry.addr,
        image.manifest_digest()
    );
    assert_eq!(
        cache.resolve(&ok, Some(&auth), &NoProgress).unwrap().digest,
        image.config_digest()
    );
    let other = sha256(b"some other manifest");
    let err = cache
        .resolve(
            &format!("{}/private/app@{other}", fake.registry.addr),
            Some(&auth),
            &NoProgress,
        )
        .unwrap_err();
    assert!(matches!(err, ImageError::NotFound { .. }), "{err}");
}

#[test]
fn blob_redirects_to_another_host_do_not_carry_credentials() {
    let image = TestImage::sample();
    let cdn_auth_headers = Arc::new(Mutex::new(Vec::new()));
    let seen = cdn_auth_headers.clone();
    let blobs: HashMap<String, Vec<u8>> = image
        .blobs()
        .into_iter()
        .map(|b| (format!("/cdn/{}", sha256(b)), b.to_vec()))
        .collect();
    let cdn = FakeServer::start(Arc::new(move |req: &Request| {
        seen.lock()
            .unwrap()
            .push(req.header("authorization").map(str::to_owned));
        match blobs.get(req.path()) {
            Some(b) => Response::new(200, b.clone()),
            None => Response::new(404, ""),
        }
    }));
    let cdn_addr = cdn.addr.clone();
    let manifest = image.manifest.clone();
    let expected = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode("carol:pw")
    );
    let registry = FakeServer::start(Arc::new(move |req: &Request| {
        if req.header("authorization") != Some(expected.as_str()) {
            return Response::new(401, "").header("WWW-Authenticate", r#"Basic realm="fake""#);
        }
        if req.path() == "/v2/team/app/manifests/v1" {
            return Response::new(200, manifest.clone()).header("Content-Type", OCI_MANIFEST);
        }
        match req.path().strip_prefix("/v2/team/app/blobs/") {
            Some(digest) => Response::new(307, "")
                .header("Location", &format!("http://{cdn_addr}/cdn/{digest}")),
            None => Response::new(404, ""),
        }
    }));
    let (_tmp, cache) = cache();
    let reference = format!("{}/team/app:v1", registry.addr);
    let resolved = cache
        .resolve(
            &reference,
            Some(&RegistryAuth::new("carol", "pw")),
            &NoProgress,
        )
        .unwrap();
    TestImage::check_sample_rootfs(&resolved.rootfs);
    let headers = cdn_auth_headers.lock().unwrap();
    assert_eq!(headers.len(), 3, "config and two layers came from the cdn");
    assert!(
        headers.iter().all(Option::is_none),
        "credentials leaked to the cdn: {headers:?}"
    );
}
