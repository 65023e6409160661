//! The API cannot aim fastbox at the host's files or at unbounded resources, against a real
//! `fastbox up`: local image references (`dir:`, paths, `oci:`, `oci-archive:`,
//! `docker-archive:`) outside `--allow-local-images` are 400s on `/v1/sandboxes` and
//! `/v1/templates` that record nothing, while one under the allowed directory becomes a real
//! sandbox (and a real template); limits above the maximums or the free disk are 400s, and a
//! create that names no limit runs with the defaults.
//!
//! Prefix tag `p`: the instance's pool is 10.217.112.0/24 (see `common/server.rs`).

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::server::{UpServer, test_cache_dir};
use fastbox_runtime::cgroup::{CgroupRoot, CgroupVersion, Controller};
use serde_json::{Value, json};

const TAG: char = 'p';

/// The host the test aims at: `allowed/` (given to `--allow-local-images`) and `outside/`
/// (not allowed, with a marker file, a rootfs, an OCI layout and archives).
struct Host {
    _dir: tempfile::TempDir,
    allowed: PathBuf,
    outside: PathBuf,
}

fn host() -> Host {
    let dir = tempfile::tempdir().expect("tempdir");
    let allowed = dir.path().join("allowed");
    let outside = dir.path().join("outside");
    for d in [
        outside.join("rootfs"),
        outside.join("layout"),
        allowed.clone(),
    ] {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::write(
        outside.join("marker"),
        b"a host file the caller must not reach\n",
    )
    .unwrap();
    std::fs::write(
        outside.join("layout/oci-layout"),
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .unwrap();
    std::fs::write(outside.join("image.tar"), b"").unwrap();
    std::os::unix::fs::symlink(&outside, allowed.join("escape")).unwrap();
    Host {
        _dir: dir,
        allowed,
        outside,
    }
}

fn start() -> Option<(UpServer, Host)> {
    UpServer::start_with(TAG, |_prefix| {
        let host = host();
        let args = [
            "--allow-local-images",
            host.allowed.to_str().unwrap(),
            // No warm pool and no spare slots: the instance's only cgroups with processes are
            // its sandboxes'.
            "--pool-size",
            "0",
            "--spare-slots",
            "0",
            // Room for a disk request above the free space but under the maximum.
            "--max-disk",
            "1Ei",
        ]
        .map(str::to_string)
        .to_vec();
        (host, args)
    })
}

/// Asserts a 400 `SANDBOX::INVALID_PARAMETER` whose message has every one of `parts`.
fn assert_refused(what: &str, (status, body): (u16, Value), parts: &[&str]) {
    assert_eq!(status, 400, "{what}: {body}");
    assert_eq!(body["code"], "SANDBOX::INVALID_PARAMETER", "{what}: {body}");
    let message = body["message"].as_str().unwrap_or_default();
    for part in parts {
        assert!(
            message.contains(part),
            "{what}: {part:?} not in {message:?}"
        );
    }
}

fn templates(server: &UpServer) -> Vec<Value> {
    let (status, body) = server.get("/v1/templates?pageSize=200");
    assert_eq!(status, 200, "{body}");
    body["items"].as_array().cloned().unwrap_or_default()
}

/// The memory limit and pids limit of each cgroup of instance `prefix` that has processes.
fn sandbox_cgroup_limits(prefix: &str) -> Vec<(u64, u64)> {
    let root = CgroupRoot::detect().expect("cgroups");
    let memory = root
        .mount_of(Controller::Memory)
        .expect("memory controller");
    let pids = root.mount_of(Controller::Pids).expect("pids controller");
    let memory_file = match root.version() {
        CgroupVersion::V1 => "memory.limit_in_bytes",
        CgroupVersion::V2 => "memory.max",
    };
    let read = |path: PathBuf| std::fs::read_to_string(&path).unwrap_or_default();
    let mut limits = Vec::new();
    for entry in std::fs::read_dir(memory.join(prefix))
        .into_iter()
        .flatten()
        .flatten()
    {
        let dir = entry.path();
        if !dir.is_dir() || read(dir.join("cgroup.procs")).trim().is_empty() {
            continue;
        }
        let id = entry.file_name();
        let number = |text: String| text.trim().parse::<u64>().unwrap_or(u64::MAX);
        limits.push((
            number(read(dir.join(memory_file))),
            number(read(pids.join(prefix).join(&id).join("pids.max"))),
        ));
    }
    limits
}

/// A copy of the busybox rootfs the server prepared, at `to`.
fn copy_busybox_rootfs(to: &Path) {
    let cache = fastbox_image::ImageCache::try_new(fastbox_image::ImageConfig {
        cache_dir: test_cache_dir(),
        ..Default::default()
    })
    .expect("image cache");
    let rootfs = cache
        .resolve("fastbox/busybox", None, &fastbox_image::NoProgress)
        .expect("busybox rootfs (the server's default image)")
        .rootfs;
    std::fs::create_dir_all(to).unwrap();
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg(rootfs.join("."))
        .arg(to)
        .status()
        .expect("cp");
    assert!(
        status.success(),
        "cp -a {} {}",
        rootfs.display(),
        to.display()
    );
}

fn wait_template(server: &UpServer, id: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (status, body) = server.get(&format!("/v1/templates/{id}"));
        assert_eq!(status, 200, "{body}");
        match body["status"]["phase"].as_str() {
            Some("Succeeded") => return body,
            Some("Failed") => panic!("template build failed: {body}"),
            _ => {}
        }
        assert!(
            Instant::now() < deadline,
            "template not built in 120 s: {body}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn local_images_and_limits_are_the_operators() {
    let Some((server, host)) = start() else {
        return;
    };
    let (a, o) = (host.allowed.display(), host.outside.display());

    // Every kind of local reference outside the allowed directory, and ways out of it.
    let refused = [
        format!("dir:{o}"),
        format!("{o}"),
        format!("{o}/rootfs"),
        format!("oci:{o}/layout"),
        format!("oci:{o}/layout:latest"),
        format!("oci-archive:{o}/image.tar"),
        format!("docker-archive:{o}/image.tar"),
        format!("docker-archive:{o}/image.tar:app:1"),
        format!("dir:{a}/../outside"),
        format!("{a}/../outside/rootfs"),
        format!("dir:{a}/escape"),
        format!("oci-archive:{a}/escape/image.tar"),
        format!("dir:{a}/missing"),
        "dir:/root".to_string(),
        "/".to_string(),
        "./rootfs".to_string(),
        "../outside".to_string(),
    ];
    for reference in &refused {
        let create = server.post(
            "/v1/sandboxes",
            &json!({
                "image": {"uri": reference},
                "entrypoint": ["cat", "/marker"],
                "timeout": 600,
            }),
        );
        assert_refused(reference, create, &["--allow-local-images"]);
        let template = server.post(
            "/v1/templates",
            &json!({"image": reference, "publish": "local"}),
        );
        assert_refused(reference, template, &["--allow-local-images"]);
    }
    assert!(server.ids().is_empty(), "refused creates recorded nothing");
    assert!(
        templates(&server).is_empty(),
        "refused templates recorded nothing"
    );

    // Limits above the maximums, and a disk above the free space, are 400s.
    let create = |limits: Value| {
        server.post(
            "/v1/sandboxes",
            &json!({
                "image": {"uri": "fastbox/busybox"},
                "entrypoint": ["sleep", "100000"],
                "timeout": 600,
                "resourceLimits": limits,
            }),
        )
    };
    assert_refused(
        "memory 1Ti",
        create(json!({"memory": "1Ti"})),
        &[
            "resourceLimits.memory",
            "\"1Ti\"",
            "maximum of 16Gi",
            "--max-memory",
        ],
    );
    assert_refused(
        "cpu 64",
        create(json!({"cpu": "64"})),
        &["resourceLimits.cpu", "\"64\"", "maximum of 4", "--max-cpu"],
    );
    assert_refused(
        "pids",
        create(json!({"pids": "100000"})),
        &["resourceLimits.pids", "maximum of 4096", "--max-pids"],
    );
    assert_refused(
        "disk 1Pi",
        create(json!({"disk": "1Pi"})),
        &["resourceLimits.disk", "\"1Pi\"", "free"],
    );
    assert_refused(
        "template memory 1Ti",
        server.post(
            "/v1/templates",
            &json!({"image": "fastbox/busybox", "publish": "local", "resourceLimits": {"memory": "1Ti"}}),
        ),
        &["resourceLimits.memory", "--max-memory"],
    );
    assert!(server.ids().is_empty(), "refused creates recorded nothing");
    assert!(
        templates(&server).is_empty(),
        "refused templates recorded nothing"
    );

    // A rootfs under the allowed directory is a real sandbox, with the default limits.
    let rootfs = host.allowed.join("images/busybox");
    copy_busybox_rootfs(&rootfs);
    let reference = format!("dir:{}", rootfs.display());
    let (status, body) = server.post(
        "/v1/sandboxes",
        &json!({
            "image": {"uri": reference},
            "entrypoint": ["sleep", "100000"],
            "timeout": 600,
        }),
    );
    assert_eq!(status, 202, "{body}");
    let id = body["id"].as_str().unwrap().to_string();
    server.wait_state(&id, "Running");
    assert_eq!(server.ping(&id), 200);
    assert_eq!(
        sandbox_cgroup_limits(&server.prefix),
        vec![(512 << 20, fastbox_runtime::spec::DEFAULT_PIDS)],
        "the default memory and pids limits"
    );

    // And a template, through a path that resolves into the allowed directory.
    let (status, body) = server.post(
        "/v1/templates",
        &json!({"image": format!("{a}/images/../images/busybox"), "publish": "local"}),
    );
    assert_eq!(status, 201, "{body}");
    let template = body["templateId"].as_str().unwrap().to_string();
    wait_template(&server, &template);
    assert_eq!(server.delete(&format!("/v1/templates/{template}")), 204);

    server.finish();
}
