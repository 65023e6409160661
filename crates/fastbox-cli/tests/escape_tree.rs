//! Escape attempts through the trees a tenant controls: its image and its writable layer.
//!
//! Each test aims fastbox's own writes (identity files, init's mount points and `/dev`) at a
//! "host" probe directory outside every sandbox, through absolute symlinks, FIFOs and device
//! nodes, then checks that the attempt failed for the right reason and that the probe is
//! byte for byte, mode for mode, what it was.

mod common;

use std::os::unix::fs::{MetadataExt, symlink};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::execd::Execd;
use common::server::UpServer;
use common::{fixture, unavailable};
use fastbox_cli::local_sandbox::StartOptions;
use fastbox_testkit::skip_unless;
use serde_json::json;

/// A directory of the host that no sandbox may write: its files' names, kinds, modes, owners
/// and contents before the attack.
struct Probe {
    dir: PathBuf,
    before: String,
}

impl Probe {
    fn new(parent: &Path) -> Probe {
        let dir = parent.join("probe");
        std::fs::create_dir_all(&dir).unwrap();
        for name in ["hostname", "hosts", "resolv.conf"] {
            std::fs::write(dir.join(name), format!("the host's own {name}\n")).unwrap();
        }
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        let before = digest(&dir);
        Probe { dir, before }
    }

    fn assert_untouched(&self, after: &str) {
        assert_eq!(
            digest(&self.dir),
            self.before,
            "the host probe directory changed after {after}"
        );
    }
}

fn digest(dir: &Path) -> String {
    let mut lines = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let meta = std::fs::symlink_metadata(&d).unwrap();
        lines.push(format!("{} {:o} {}", d.display(), meta.mode(), meta.uid()));
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            if meta.is_dir() {
                stack.push(path);
                continue;
            }
            let content = if meta.is_file() {
                format!("{:?}", std::fs::read(&path).unwrap())
            } else {
                String::new()
            };
            lines.push(format!(
                "{} {:o} {} {content}",
                path.display(),
                meta.mode(),
                meta.uid()
            ));
        }
    }
    lines.sort();
    lines.join("\n")
}

/// A copy of the busybox rootfs at `dir`, changed by `trick`.
fn hostile_image(busybox: &Path, dir: &Path, trick: impl FnOnce(&Path)) -> PathBuf {
    let status = Command::new("cp")
        .arg("-a")
        .arg(busybox)
        .arg(dir)
        .status()
        .unwrap();
    assert!(status.success(), "cp -a the busybox rootfs");
    trick(dir);
    dir.to_path_buf()
}

fn replace_with_symlink(path: &Path, target: &Path) {
    let _ = std::fs::remove_dir_all(path);
    let _ = std::fs::remove_file(path);
    symlink(target, path).unwrap();
}

#[test]
fn hostile_images_cannot_aim_the_hosts_writes_outside_their_root() {
    skip_unless!(unavailable());
    let mut f = fixture("5", 9);
    let probe = Probe::new(f.dir.path());
    let busybox = f.rootfs.clone();
    // (the directory made a symlink to the probe, what the start must say)
    let tricks = [
        ("etc", "/etc"),
        ("tmp", "/tmp"),
        (".fastbox", "/.fastbox: not a directory"),
        ("dev", "/dev: not a directory"),
        ("proc", "/proc: not a directory"),
        ("sys", "/sys: not a directory"),
    ];
    for (slot, (name, says)) in tricks.iter().enumerate() {
        let image = hostile_image(
            &busybox,
            &f.dir.path().join(format!("img-{name}")),
            |root| replace_with_symlink(&root.join(name), &probe.dir),
        );
        f.rootfs = image;
        let opts = StartOptions {
            id: format!("{}-{slot}", f.prefix),
            ..Default::default()
        };
        let started = f.host().start(&f.rootfs, &f.execd, slot as u32, &opts);
        match started {
            Ok(sb) => {
                f.destroy(&sb);
                panic!("an image whose /{name} is a symlink out of it started");
            }
            Err(e) => {
                let message = format!("{e:#}");
                assert!(
                    message.contains(says),
                    "/{name} as a symlink: {message:?} does not say {says:?}"
                );
            }
        }
        probe.assert_untouched(&format!("a start with /{name} a symlink to it"));
    }

    // Files fastbox writes that are symlinks to the host, a FIFO and a device node: the
    // sandbox starts, the names are regular files of its own, the host is untouched.
    let image = hostile_image(&busybox, &f.dir.path().join("img-files"), |root| {
        for name in ["hostname", "hosts"] {
            replace_with_symlink(&root.join("etc").join(name), &probe.dir.join(name));
        }
        nix::unistd::mkfifo(
            &root.join("etc/resolv.conf"),
            nix::sys::stat::Mode::from_bits_truncate(0o644),
        )
        .unwrap();
        // The same node as /dev/null (1:3), which the device cgroup allows: only the
        // image's `nodev` mount stands between the sandbox and it.
        nix::sys::stat::mknod(
            &root.join("null-node"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o666),
            nix::sys::stat::makedev(1, 3),
        )
        .unwrap();
    });
    f.rootfs = image;
    let sb = f.start(7, StartOptions::default());
    let (code, out, err) = common::Fixture::sh(
        &sb,
        "for f in hostname hosts resolv.conf; do [ -f /etc/$f ] && [ ! -L /etc/$f ] && echo $f=file; done
         grep -c 'the host' /etc/hostname /etc/hosts
         echo x > /null-node && echo node=opened || echo node=refused
         echo x > /dev/null && echo dev_null=opened",
    );
    assert_eq!(code, 0, "{out}{err}");
    for expected in [
        "hostname=file",
        "hosts=file",
        "resolv.conf=file",
        "/etc/hostname:0",
        "/etc/hosts:0",
        "node=refused",
        "dev_null=opened",
    ] {
        assert!(
            out.lines().any(|l| l == expected),
            "{expected:?} missing in {out}{err}"
        );
    }
    assert!(
        err.contains("Permission denied"),
        "the image's device node is refused by nodev: {err}"
    );
    f.destroy(&sb);
    probe.assert_untouched("a start with symlinked identity files");
    f.finish();
}

/// Polls `id` until its state is one of `done`; returns it.
fn settle(server: &UpServer, id: &str, done: &[&str]) -> String {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let (state, _) = server.state(id);
        if done.contains(&state.as_str()) {
            return state;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{id} stuck in {state}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// The events of sandbox `id` as text.
fn events(server: &UpServer, id: &str) -> String {
    let (_, events) = server.get(&format!("/v1/sandboxes/{id}/diagnostics/events"));
    events["content"].as_str().unwrap_or_default().to_string()
}

/// Every way a running sandbox's layer reaches a host write of its identity files: a fork,
/// a clone of a snapshot, a pause and resume. `/etc` (or each file in it) is a symlink to
/// the probe.
#[test]
fn a_tenants_symlinks_never_take_an_identity_write_to_the_host() {
    let Some(server) = UpServer::start('6', &[]) else {
        return;
    };
    let probe = Probe::new(server.dir.path());
    let p = probe.dir.display();
    // (what the tenant does, whether its clones still start)
    let attacks = [
        (format!("rm -rf /etc && ln -s {p} /etc"), false),
        (
            format!(
                "for f in hostname hosts resolv.conf; do rm -f /etc/$f; ln -s {p}/$f /etc/$f; done"
            ),
            true,
        ),
        (
            format!("rm -rf /etc && mkdir /etc && ln -s {p} /etc/hosts && mkfifo /etc/hostname"),
            true,
        ),
    ];
    for (attack, clones_start) in &attacks {
        let id = server.create_busybox();
        assert_eq!(settle(&server, &id, &["Running", "Failed"]), "Running");
        Execd::of(&server, &id).sh(attack);

        // Fork.
        let (status, forked) =
            server.post(&format!("/v1/sandboxes/{id}/fork"), &json!({"count": 1}));
        assert_eq!(status, 202, "{forked}");
        let fork = forked["items"][0]["id"].as_str().unwrap().to_string();
        check_clone(&server, &fork, *clones_start, attack);
        probe.assert_untouched(&format!("a fork after {attack:?}"));

        // A clone of a snapshot.
        let (status, snap) = server.post(&format!("/v1/sandboxes/{id}/snapshots"), &json!({}));
        assert_eq!(status, 202, "{snap}");
        let sid = snap["id"].as_str().unwrap().to_string();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while server.get(&format!("/v1/snapshots/{sid}")).1["status"]["state"] != "Ready" {
            assert!(std::time::Instant::now() < deadline, "snapshot {sid}");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let (status, clone) = server.post(
            "/v1/sandboxes",
            &json!({"snapshotId": sid, "entrypoint": ["sleep", "100000"], "timeout": 600}),
        );
        assert_eq!(status, 202, "{clone}");
        check_clone(
            &server,
            clone["id"].as_str().unwrap(),
            *clones_start,
            attack,
        );
        probe.assert_untouched(&format!("a snapshot clone after {attack:?}"));

        // Pause and resume: the sandbox keeps its identity; nothing is written outside.
        let (status, body) = server.post(&format!("/v1/sandboxes/{id}/pause"), &json!({}));
        assert_eq!(status, 202, "{body}");
        settle(&server, &id, &["Paused", "Failed"]);
        let (status, body) = server.post(&format!("/v1/sandboxes/{id}/resume"), &json!({}));
        assert!(status == 202 || status == 409, "{status} {body}");
        settle(&server, &id, &["Running", "Failed"]);
        probe.assert_untouched(&format!("a pause and resume after {attack:?}"));
    }
    server.finish();
}

/// A clone either runs with identity files of its own in its own `/etc`, or (when `/etc`
/// leads nowhere inside it) fails saying so.
fn check_clone(server: &UpServer, id: &str, starts: bool, attack: &str) {
    let state = settle(server, id, &["Running", "Failed"]);
    if !starts {
        assert_eq!(state, "Failed", "{attack}: {}", events(server, id));
        let events = events(server, id);
        assert!(
            events.contains("/etc"),
            "{attack}: the failure names /etc: {events}"
        );
        return;
    }
    assert_eq!(state, "Running", "{attack}: {}", events(server, id));
    let run = Execd::of(server, id).sh(
        "for f in hostname hosts resolv.conf; do [ -f /etc/$f ] && [ ! -L /etc/$f ] && echo $f=file; done; echo name=$(cat /etc/hostname)",
    );
    for f in ["hostname", "hosts", "resolv.conf"] {
        assert!(
            run.stdout.contains(&format!("{f}={}", "file")),
            "{attack}: /etc/{f} of the clone is its own file: {}",
            run.stdout
        );
    }
    assert!(
        !run.stdout.contains("the host's own"),
        "{attack}: {}",
        run.stdout
    );
}
