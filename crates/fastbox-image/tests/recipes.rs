//! The built-in recipes: busybox (fast, always run when busybox-static is installed) and
//! debootstrap (minutes; run only with FASTBOX_TEST_DEBOOTSTRAP=1).

mod common;

use std::fs;
use std::path::Path;
use std::sync::Mutex;
use std::time::Instant;

use common::cache;
use fastbox_image::{ImageConfig, ImageError, NoProgress, Progress, Recipe, StderrProgress};

/// Records progress lines.
#[derive(Default)]
struct Recorder(Mutex<Vec<String>>);

impl Progress for Recorder {
    fn message(&self, message: &str) {
        self.0.lock().unwrap().push(message.to_owned());
    }
    fn bytes(&self, _done: u64, _total: Option<u64>) {}
}

fn busybox_available() -> bool {
    let ok = fs::read("/bin/busybox").is_ok_and(|b| !b.is_empty());
    if !ok {
        eprintln!("SKIPPED: /bin/busybox missing; install busybox-static (scripts/setup.sh)");
    }
    ok
}

#[test]
fn busybox_recipe_builds_a_minimal_rootfs_once() {
    if !busybox_available() {
        return;
    }
    let (_tmp, cache) = cache();
    let progress = Recorder::default();
    let first = cache.resolve("fastbox/busybox", None, &progress).unwrap();
    assert!(!first.cached);
    assert!(
        first
            .served_by
            .as_deref()
            .is_some_and(|s| s.starts_with("busybox-")),
        "{:?}",
        first.served_by
    );
    assert_eq!(first.canonical_reference, "recipe:busybox");
    let root = &first.rootfs;
    assert!(root.join("bin/busybox").is_file());
    assert_eq!(
        fs::read_link(root.join("bin/sh")).unwrap(),
        Path::new("/bin/busybox")
    );
    assert!(root.join("bin/ls").symlink_metadata().is_ok());
    assert!(
        fs::read_to_string(root.join("etc/passwd"))
            .unwrap()
            .starts_with("root:x:0:0:")
    );
    assert!(
        fs::read_to_string(root.join("etc/group"))
            .unwrap()
            .starts_with("root:x:0:")
    );
    assert_eq!(first.config.cmd, ["/bin/sh"]);
    assert!(
        progress
            .0
            .lock()
            .unwrap()
            .iter()
            .any(|m| m.contains("applets"))
    );

    let second = cache.resolve("recipe:busybox", None, &NoProgress).unwrap();
    assert!(second.cached);
    assert_eq!(
        (second.rootfs.clone(), second.digest.clone()),
        (first.rootfs.clone(), first.digest.clone())
    );

    // The rootfs runs: chroot into it as root.
    if common::is_root() {
        let out = std::process::Command::new("chroot")
            .arg(root)
            .args(["/bin/sh", "-c", "echo ok; ls /etc"])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.starts_with("ok\n") && stdout.contains("passwd"),
            "{stdout}"
        );
    }
}

#[test]
fn busybox_recipe_rejects_a_dynamic_binary() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = ImageConfig {
        cache_dir: tmp.path().join("cache"),
        busybox: "/bin/ls".into(),
        ..ImageConfig::default()
    };
    let cache = fastbox_image::ImageCache::try_new(cfg).unwrap();
    let err = cache
        .resolve("fastbox/busybox", None, &NoProgress)
        .unwrap_err();
    assert!(matches!(err, ImageError::Recipe { .. }), "{err}");
    assert!(err.to_string().contains("busybox-static"), "{err}");
}

#[test]
fn debootstrap_failure_reports_the_log_tail() {
    if !common::is_root() {
        eprintln!("SKIPPED: debootstrap needs root");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // A stand-in debootstrap that fails the way the real one does.
    let fake = tmp.path().join("debootstrap");
    fs::write(&fake, "#!/bin/sh\necho 'I: Retrieving InRelease'\necho 'E: Failed getting release file' >&2\nexit 1\n").unwrap();
    fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let cfg = ImageConfig {
        cache_dir: tmp.path().join("cache"),
        debootstrap: fake,
        debian_mirror: Some("http://mirror.invalid/debian".into()),
        ..ImageConfig::default()
    };
    let cache = fastbox_image::ImageCache::try_new(cfg).unwrap();
    let progress = Recorder::default();
    let err = cache.resolve("python:3.12", None, &progress).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, ImageError::Debootstrap { .. }), "{msg}");
    assert!(msg.contains("E: Failed getting release file"), "{msg}");
    assert!(
        progress
            .0
            .lock()
            .unwrap()
            .iter()
            .any(|m| m.contains("I: Retrieving InRelease"))
    );
    assert!(
        fs::read_dir(tmp.path().join("cache/images/sha256"))
            .unwrap()
            .next()
            .is_none()
    );
    assert!(
        fs::read_dir(tmp.path().join("cache/tmp"))
            .unwrap()
            .next()
            .is_none()
    );
}

/// The real thing: minutes and a few hundred MiB from the machine's Debian mirror.
#[test]
fn debootstrap_recipe_serves_python_aliases() {
    if std::env::var("FASTBOX_TEST_DEBOOTSTRAP").as_deref() != Ok("1") {
        eprintln!(
            "SKIPPED: debootstrap recipe takes minutes; set FASTBOX_TEST_DEBOOTSTRAP=1 to run it"
        );
        return;
    }
    if !common::is_root() {
        eprintln!("SKIPPED: debootstrap needs root");
        return;
    }
    // A persistent cache dir may be given to reuse a build across runs.
    let tmp = tempfile::tempdir().unwrap();
    let cache_dir = std::env::var("FASTBOX_TEST_CACHE_DIR")
        .map(Into::into)
        .unwrap_or_else(|_| tmp.path().join("cache"));
    let cache = fastbox_image::ImageCache::try_new(ImageConfig {
        cache_dir,
        ..ImageConfig::default()
    })
    .unwrap();
    let started = Instant::now();
    let first = cache
        .resolve("python:3.12", None, &StderrProgress::new())
        .unwrap();
    let build = started.elapsed();
    assert_eq!(
        first.canonical_reference,
        format!("recipe:{}", Recipe::DebianBookwormPython3.name())
    );
    assert_eq!(
        first.served_by.as_deref(),
        Some("debian-bookworm-python3.11")
    );
    // What users of the python image expect on the path.
    for tool in [
        "bin/bash",
        "usr/bin/python3",
        "usr/bin/pip3",
        "usr/bin/pip",
        "usr/bin/curl",
        "usr/bin/wget",
        "usr/bin/git",
        "usr/bin/ps",
        "bin/ls",
        "etc/ssl/certs/ca-certificates.crt",
    ] {
        assert!(first.rootfs.join(tool).exists(), "{tool} missing");
    }
    assert!(
        !first
            .rootfs
            .join("usr/lib/python3.11/EXTERNALLY-MANAGED")
            .exists(),
        "pip install would be refused"
    );
    let out = std::process::Command::new("chroot")
        .arg(&first.rootfs)
        .args([
            "/usr/bin/python3",
            "-c",
            "import sys, ssl, json; print(sys.version_info[:2])",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "(3, 11)");
    // pip goes as far as looking for the package (no index here), never refusing to install
    // into the system's Python.
    let pip = std::process::Command::new("chroot")
        .arg(&first.rootfs)
        .args([
            "/usr/bin/pip",
            "install",
            "--no-index",
            "fastbox-no-such-package",
        ])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&pip.stderr);
    assert!(!said.contains("externally-managed"), "{said}");
    assert!(said.contains("No matching distribution"), "{said}");

    let started = Instant::now();
    let second = cache.resolve("debian", None, &NoProgress).unwrap();
    let hit = started.elapsed();
    assert!(second.cached);
    assert_eq!(second.rootfs, first.rootfs);
    assert!(hit.as_millis() < 500, "cache hit took {hit:?}");
    let du = std::process::Command::new("du")
        .args(["-sm"])
        .arg(&first.rootfs)
        .output()
        .unwrap();
    eprintln!(
        "debootstrap recipe: build {:.1}s (cached: {}), cache hit {:?}, rootfs {}",
        build.as_secs_f64(),
        first.cached,
        hit,
        String::from_utf8_lossy(&du.stdout).trim()
    );
}
