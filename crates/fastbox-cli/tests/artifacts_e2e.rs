//! `fastbox up` with an S3 origin (an `s3s-fs` the test starts), its node block cache and a
//! DART peer server, and `fastbox artifacts gc` on that origin: snapshots and pause
//! checkpoints land in the bucket, the peer server serves their blocks, `/metrics` shows the
//! cache, DART and garbage-collection figures, a deleted snapshot loses its index entry and
//! then its blocks, while the template's and the paused sandbox's stay. A start whose origin
//! is unreachable fails with the store's message before it touches the host.

mod common;

use std::collections::BTreeSet;
use std::process::Command;
use std::time::{Duration, Instant};

use common::execd::Execd;
use common::server::UpServer;
use fastbox_artifact::{ArtifactKind, ArtifactStore, Digest, IndexKey, Manifest, read_manifest};
use fastbox_s3::{S3Config, S3Store};
use fastbox_testkit::s3::{S3Server, S3ServerKind};
use serde_json::{Value, json};

/// The DART group secret of the test's one-node group.
const DART_KEY: &str = "artifacts-e2e-group-secret";
/// The image every sandbox of the test runs (prepared by `UpServer`).
const IMAGE: &str = "fastbox/busybox";

/// A running s3s-fs with a bucket, and the `--artifact-store` URL of a prefix in it.
struct Origin {
    server: S3Server,
    url: String,
}

impl Origin {
    /// None, after printing why, when s3s-fs is not installed.
    fn start() -> Option<Origin> {
        if let Some(reason) = S3ServerKind::S3sFs.unavailable() {
            eprintln!("skipped: {reason}");
            return None;
        }
        let server = S3Server::start(S3ServerKind::S3sFs).expect("start s3s-fs");
        let url = format!(
            "s3://{}/fastbox?endpoint={}",
            server.bucket(),
            server.endpoint()
        );
        let origin = Origin { server, url };
        fastbox_s3::create_bucket(&origin.config()).expect("create the bucket");
        Some(origin)
    }

    /// The credentials as environment variables.
    fn env(&self) -> [(&'static str, String); 2] {
        [
            ("AWS_ACCESS_KEY_ID", self.server.access_key().to_string()),
            (
                "AWS_SECRET_ACCESS_KEY",
                self.server.secret_key().to_string(),
            ),
        ]
    }

    fn config(&self) -> S3Config {
        let env = self.env();
        S3Config::from_url(&self.url).unwrap().with_env(|name| {
            env.iter()
                .find(|(key, _)| *key == name)
                .map(|(_, value)| value.clone())
        })
    }

    /// The bucket as the test sees it, past the server.
    fn store(&self) -> S3Store {
        S3Store::open(self.config()).expect("open the origin")
    }

    /// Runs `fastbox artifacts gc` on the origin with `args`; its JSON report.
    fn gc(&self, args: &[&str]) -> Value {
        let out = Command::new(env!("CARGO_BIN_EXE_fastbox"))
            .args(["artifacts", "gc", "--artifact-store", &self.url, "--json"])
            .args(args)
            .envs(self.env())
            .output()
            .expect("run fastbox artifacts gc");
        assert!(
            out.status.success(),
            "fastbox artifacts gc {args:?}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("a JSON report")
    }
}

/// The manifest `key` points at in `store`, waiting up to 60 s for the entry to appear.
fn indexed(store: &S3Store, key: &str) -> (Digest, Manifest) {
    let key = IndexKey::try_new(key).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(digest) = store.index_get(&key).unwrap() {
            return (digest, read_manifest(store, &digest).unwrap());
        }
        assert!(
            Instant::now() < deadline,
            "no index entry {key} in the bucket"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn blocks(manifest: &Manifest) -> BTreeSet<Digest> {
    manifest.blocks().into_iter().collect()
}

/// Polls `id` until it is in `want` (or Failed, which fails the test), 60 s at most.
fn settle(server: &UpServer, id: &str, want: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (state, reason) = server.state(id);
        if state == want {
            return;
        }
        assert!(
            state != "Failed" && Instant::now() < deadline,
            "{id} is {state} ({reason:?}), wanted {want}\n{}",
            server.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Takes a snapshot of `id` and waits until it is Ready; its id.
fn snapshot(server: &UpServer, id: &str) -> String {
    let (status, snap) = server.post(&format!("/v1/sandboxes/{id}/snapshots"), &json!({}));
    assert_eq!(status, 202, "{snap}");
    let sid = snap["id"].as_str().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, body) = server.get(&format!("/v1/snapshots/{sid}"));
        match body["status"]["state"].as_str() {
            Some("Ready") => return sid,
            Some("Failed") => panic!("snapshot failed: {body}\n{}", server.log_text()),
            _ => assert!(Instant::now() < deadline, "snapshot {sid} stuck: {body}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The value of the sample `name` (with its labels) in a Prometheus text.
fn sample(metrics: &str, name: &str) -> Option<u64> {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// `GET /metrics` until `done` holds for it (10 s at most); the text.
fn metrics_until(server: &UpServer, what: &str, done: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, text) = server.get_text("/metrics");
        assert_eq!(status, 200, "{text}");
        if done(&text) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "/metrics never showed {what}:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn snapshots_and_pauses_land_in_s3_and_gc_keeps_what_is_in_use() {
    if let Some(reason) = common::unavailable() {
        eprintln!("skipped: {reason}");
        return;
    }
    let Some(origin) = Origin::start() else {
        return;
    };
    // SAFETY: nextest runs each test in a process of its own and this runs before the test
    // starts any thread; `fastbox up` inherits the variables.
    unsafe {
        for (name, value) in origin.env() {
            std::env::set_var(name, value);
        }
        std::env::set_var("FASTBOX_DART_KEY", DART_KEY);
    }
    let dart = format!("127.0.0.1:{}", fastbox_testkit::server_port());
    let Some(server) = UpServer::start(
        'z',
        &[
            "--artifact-store",
            &origin.url,
            "--block-cache-mib",
            "256",
            "--node-id",
            "n1",
            "--dart-listen",
            &dart,
            "--dart-peers",
            &format!("n1={dart}"),
            "--artifact-gc-interval",
            "2s",
            "--pool-size",
            "0",
        ],
    ) else {
        return;
    };
    assert!(
        server.log_text().contains(&format!(
            "DART node n1 serving peers on {dart} (1 members); garbage collection every 2s (grace 24h)"
        )),
        "{}",
        server.log_text()
    );
    let s3 = origin.store();
    let (template, template_manifest) = indexed(&s3, IMAGE);

    // A snapshot of a sandbox holding bytes of its own, and another sandbox paused.
    let kept = server.create_busybox();
    settle(&server, &kept, "Running");
    let unique =
        Execd::of(&server, &kept).sh("head -c 300000 /dev/urandom > /tmp/unique && echo written");
    assert!(unique.stdout.contains("written"), "{}", unique.stdout);
    let sid = snapshot(&server, &kept);
    let paused = server.create_busybox();
    settle(&server, &paused, "Running");
    let (status, body) = server.post(&format!("/v1/sandboxes/{paused}/pause"), &json!({}));
    assert_eq!(status, 202, "{body}");
    settle(&server, &paused, "Paused");
    let pause_key = std::fs::read_dir(server.data_dir.join("snapshots"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|name| name.starts_with(&format!("pause-{paused}-")))
        .expect("the pause checkpoint on the node");

    // Both are in the bucket: manifests, every block, the template as parent.
    let (snap, snap_manifest) = indexed(&s3, &sid);
    let (pause, pause_manifest) = indexed(&s3, &pause_key);
    assert_eq!(snap_manifest.meta.kind, ArtifactKind::Snapshot);
    assert_eq!(pause_manifest.meta.kind, ArtifactKind::Checkpoint);
    for manifest in [&snap_manifest, &pause_manifest] {
        assert_eq!(manifest.meta.lineage.parent, Some(template));
        for block in blocks(manifest) {
            assert!(
                s3.has_block(&block).unwrap(),
                "block {block} is not in the bucket"
            );
        }
    }

    // The node's peer server hands a snapshot block to a peer of the group (this node owns
    // every block of its one-member group: it fetches it from the origin once).
    let block = *blocks(&snap_manifest).iter().next().unwrap();
    let peer = fastbox_dart::PeerClient::new(
        fastbox_dart::NodeId::try_new("n2").unwrap(),
        fastbox_dart::GroupSecret::try_new(DART_KEY).unwrap(),
        fastbox_dart::PeerTimeouts::default(),
    );
    let member: fastbox_dart::Member = format!("n1={dart}").parse().unwrap();
    let served = peer
        .fetch(&member, &block, fastbox_dart::FetchMode::AsOwner)
        .expect("the peer server answers");
    assert_eq!(served, Some(s3.get_block(&block).unwrap()));

    // /metrics: the node block cache, the DART counters, the server's collections (every
    // 2 s, grace 24 h: nothing deleted) with the template, snapshot and pause pinned.
    let metrics = metrics_until(&server, "a collection pinning 3 manifests", |text| {
        sample(text, "fastbox_artifact_gc_pinned_manifests").is_some_and(|n| n >= 3)
    });
    assert_eq!(
        sample(&metrics, "fastbox_block_cache_budget_bytes"),
        Some(256 << 20)
    );
    assert!(
        sample(&metrics, "fastbox_dart_peer_served_total{node=\"n1\"}").is_some_and(|n| n >= 1),
        "{metrics}"
    );
    assert!(
        sample(&metrics, "fastbox_dart_origin_fetches_total{node=\"n1\"}").is_some_and(|n| n >= 1),
        "{metrics}"
    );
    assert_eq!(
        sample(&metrics, "fastbox_artifact_gc_failures_total"),
        Some(0),
        "{metrics}"
    );
    assert_eq!(
        sample(&metrics, "fastbox_artifact_gc_deleted_blocks_total"),
        Some(0),
        "{metrics}"
    );
    assert!(metrics.contains("fastbox_start_phase_seconds"), "{metrics}");

    // Deleting the snapshot removes its index entry; its blocks stay until a collection.
    assert_eq!(server.delete(&format!("/v1/snapshots/{sid}")), 204);
    assert_eq!(
        s3.index_get(&IndexKey::try_new(&sid).unwrap()).unwrap(),
        None
    );
    let in_use: BTreeSet<Digest> = blocks(&template_manifest)
        .union(&blocks(&pause_manifest))
        .copied()
        .collect();
    let snapshot_only: BTreeSet<Digest> = blocks(&snap_manifest)
        .difference(&in_use)
        .copied()
        .collect();
    assert!(
        !snapshot_only.is_empty(),
        "the snapshot has blocks of its own"
    );

    // A dry run reports, deletes nothing.
    let dry = origin.gc(&["--grace", "0s", "--dry-run"]);
    assert_eq!(dry["dry_run"], true);
    assert!(
        dry["blocks"]["deleted"]["count"].as_u64().unwrap() >= snapshot_only.len() as u64,
        "{dry}"
    );
    assert!(s3.has_manifest(&snap).unwrap());

    // The collection: the snapshot's manifest and blocks go; the template's (indexed) and
    // the paused sandbox's checkpoint (indexed, its parent the template) stay, whole.
    let report = origin.gc(&["--grace", "0s"]);
    eprintln!(
        "collected: manifests {}, blocks {}",
        report["manifests"], report["blocks"]
    );
    assert!(
        report["manifests"]["deleted"]["count"].as_u64().unwrap() >= 1,
        "{report}"
    );
    assert!(
        report["blocks"]["deleted"]["count"].as_u64().unwrap() >= snapshot_only.len() as u64,
        "{report}"
    );
    assert_eq!(report["missing_blocks"], json!([]), "{report}");
    assert!(!s3.has_manifest(&snap).unwrap(), "{report}");
    for block in &snapshot_only {
        assert!(
            !s3.has_block(block).unwrap(),
            "block {block} of the deleted snapshot stayed"
        );
    }
    for (digest, manifest) in [(template, &template_manifest), (pause, &pause_manifest)] {
        assert_eq!(
            read_manifest(&s3, &digest).unwrap().blocks(),
            manifest.blocks()
        );
        for block in blocks(manifest) {
            assert!(
                s3.has_block(&block).unwrap(),
                "block {block} in use was collected"
            );
        }
    }

    // The paused sandbox still resumes, and the server's own collections still succeed.
    let (status, body) = server.post(&format!("/v1/sandboxes/{paused}/resume"), &json!({}));
    assert_eq!(status, 202, "{body}");
    settle(&server, &paused, "Running");
    let runs = sample(
        &server.get_text("/metrics").1,
        "fastbox_artifact_gc_runs_total",
    )
    .unwrap_or(0);
    let metrics = metrics_until(&server, "another collection", |text| {
        sample(text, "fastbox_artifact_gc_runs_total").is_some_and(|n| n > runs)
    });
    assert_eq!(
        sample(&metrics, "fastbox_artifact_gc_failures_total"),
        Some(0),
        "{metrics}"
    );
    server.finish();
}

#[test]
fn a_start_with_an_unreachable_origin_fails_with_the_stores_message() {
    if let Some(reason) = common::unavailable() {
        eprintln!("skipped: {reason}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("data");
    let endpoint = format!("http://127.0.0.1:{}", fastbox_testkit::server_port());
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_fastbox"))
        .args(["up", "--no-default-images"])
        .args([
            "--listen",
            &format!("127.0.0.1:{}", fastbox_testkit::server_port()),
        ])
        .args([
            "--node-proxy-listen",
            &format!("127.0.0.1:{}", fastbox_testkit::server_port()),
        ])
        .args(["--data-dir", &data_dir.display().to_string()])
        .args(["--prefix", &fastbox_testkit::run_prefix("z")])
        .args(["--api-key", "unused"])
        .args([
            "--artifact-store",
            &format!("s3://nowhere/fastbox?endpoint={endpoint}"),
        ])
        .env("AWS_ACCESS_KEY_ID", "id")
        .env("AWS_SECRET_ACCESS_KEY", "secret")
        .output()
        .expect("run fastbox up");
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("fastbox up said: {stderr}");
    assert!(!out.status.success(), "fastbox up started:\n{stderr}");
    assert!(
        stderr.contains("artifact store: ")
            && stderr.contains(&endpoint)
            && stderr.contains("nowhere")
            && stderr.contains("unreachable"),
        "{stderr}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "took {:?}",
        started.elapsed()
    );
    // It stopped before the node agent made anything on the host or in the data directory.
    assert!(data_dir.join("state.redb").exists());
    for made_by_the_node in ["sandboxes", "templates", "block-cache"] {
        assert!(
            !data_dir.join(made_by_the_node).exists(),
            "{made_by_the_node} exists: the start went past the store"
        );
    }
}
