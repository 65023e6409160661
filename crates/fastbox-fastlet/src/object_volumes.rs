//! Object-storage volumes (the spec's `ossfs`): a bucket of S3-compatible storage, mounted
//! on the host by a FUSE client (`s3fs`) at a point of fastbox's own,
//! `DATA_DIR/object-volumes/<sandbox>/<volume>`; its prefix (the volume's `subPath`) is a
//! directory of it, made when missing and bound alone into the sandbox like any volume's
//! ([`crate::volumes`]).
//!
//! The client is confined to what the sandbox itself may reach: it runs in the sandbox's
//! network namespace, so the endpoint is resolved through the sandbox's DNS forwarder and
//! connected to under its egress policy and the private-range denies (whatever a name
//! resolves to later). Its keys are written to a file only it reads (0600, under the data
//! directory), which is removed as soon as the client has read it and mounted: they are
//! never kept by fastbox, on disk or in any record.
//!
//! The mount goes with the sandbox ([`unmount_all`]). A checkpoint cannot hold it, so the
//! server refuses pause, snapshot and fork of such a sandbox.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use fastbox_node_api::wire::{ObjectStorageKeys, VolumeMount, VolumeSource};

/// Where the mounts are, under the data directory.
pub const DIR: &str = "object-volumes";
/// The FUSE client.
const CLIENT: &str = "s3fs";
/// How long the client may take to check the bucket and mount it.
const MOUNT_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum ObjectVolumeError {
    #[error(
        "volume {0}: no keys were given for it (a create restarted after a server restart has none)"
    )]
    NoKeys(String),
    #[error("volume {name}: {what}: {source}")]
    Io {
        name: String,
        what: String,
        source: std::io::Error,
    },
    #[error("volume {name}: the bucket could not be mounted: {message}")]
    Mount { name: String, message: String },
}

/// The mount point of `sandbox`'s volume `name`.
pub fn point(data_dir: &Path, sandbox: &str, name: &str) -> PathBuf {
    data_dir.join(DIR).join(sandbox).join(name)
}

/// Mounts object-storage volume `volume` of `sandbox` with `keys`, its client in network
/// namespace `netns` (the sandbox's); its mount point. Other volumes: `None`.
pub fn mount(
    data_dir: &Path,
    sandbox: &str,
    netns: &Path,
    volume: &VolumeMount,
    keys: Option<&ObjectStorageKeys>,
) -> Result<Option<PathBuf>, ObjectVolumeError> {
    let VolumeSource::ObjectStorage {
        bucket,
        endpoint,
        options,
    } = &volume.source
    else {
        return Ok(None);
    };
    let name = volume.name.clone();
    let keys = keys.ok_or_else(|| ObjectVolumeError::NoKeys(name.clone()))?;
    let io = |what: &str| {
        let (name, what) = (name.clone(), what.to_string());
        move |source| ObjectVolumeError::Io { name, what, source }
    };
    let dir = data_dir.join(DIR).join(sandbox);
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(io("make its directory"))?;
    let point = dir.join(&volume.name);
    make_dir(&point, 0o755).map_err(io("make its mount point"))?;
    let passwd = dir.join(format!(".keys-{}", volume.name));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&passwd)
        .and_then(|mut f| writeln!(f, "{}:{}", keys.access_key_id, keys.secret_access_key));
    let mounted = written
        .map_err(io("write its keys for the client"))
        .and_then(|()| {
            run_client(
                &name, netns, bucket, endpoint, options, volume, &point, &passwd,
            )
        });
    // The client read the keys at its start: they go now, mounted or not.
    let _ = std::fs::remove_file(&passwd);
    mounted.map(|()| Some(point))
}

#[allow(clippy::too_many_arguments)]
fn run_client(
    name: &str,
    netns: &Path,
    bucket: &str,
    endpoint: &str,
    options: &[String],
    volume: &VolumeMount,
    point: &Path,
    passwd: &Path,
) -> Result<(), ObjectVolumeError> {
    let failed = |message: String| ObjectVolumeError::Mount {
        name: name.to_string(),
        message,
    };
    // The whole bucket: its prefix (the volume's `sub_path`) is made as a directory in it and
    // bound alone into the sandbox (`crate::volumes`), as with any volume.
    let target = bucket.to_string();
    // In the foreground, as a child of its own session: its errors go to a log fastbox
    // reads (a daemonized client checks the bucket after mounting, and says nothing).
    let mut command = Command::new(CLIENT);
    command.arg(&target).arg(point).arg("-f");
    check_resolver(endpoint).map_err(&failed)?;
    // Its staging files live in a directory of the sandbox's own under the data directory,
    // and it keeps 1 GiB of that disk free.
    let tmp = point.with_file_name(format!(".tmp-{name}"));
    make_dir(&tmp, 0o700).map_err(|e| failed(format!("make its staging directory: {e}")))?;
    let mut opts = vec![
        format!("url={endpoint}"),
        format!("passwd_file={}", passwd.display()),
        format!("tmpdir={}", tmp.display()),
        "ensure_diskfree=1024".to_string(),
        "nosuid".to_string(),
        "nodev".to_string(),
        // The sandbox's processes are other users of the mount.
        "allow_other".to_string(),
        "mp_umask=022".to_string(),
        "retries=2".to_string(),
        "connect_timeout=10".to_string(),
        "readwrite_timeout=30".to_string(),
        "dbglevel=err".to_string(),
    ];
    if volume.read_only {
        opts.push("ro".into());
    }
    opts.extend(options.iter().cloned());
    for opt in opts {
        command.arg("-o").arg(opt);
    }
    let log_path = point.with_file_name(format!(".log-{name}"));
    let log = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&log_path)
        .map_err(|e| failed(format!("open its log: {e}")))?;
    let log_err = log
        .try_clone()
        .map_err(|e| failed(format!("open its log: {e}")))?;
    let ns = std::fs::File::open(netns)
        .map_err(|e| failed(format!("open the sandbox's network namespace: {e}")))?;
    let ns_fd = ns.as_raw_fd();
    // SAFETY: between fork and exec only async-signal-safe calls: setns(2), prctl(2),
    // setsid(2).
    unsafe {
        command.pre_exec(move || {
            if libc::setns(ns_fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            libc::setsid();
            Ok(())
        });
    }
    // Nothing of the node's environment (its API keys, its store's credentials).
    command
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log_err));
    let mut child = command.spawn().map_err(|e| {
        failed(match e.kind() {
            std::io::ErrorKind::NotFound => {
                format!("{CLIENT} is not installed on this node (scripts/setup.sh installs it)")
            }
            _ => format!("start {CLIENT}: {e}"),
        })
    })?;
    let said = || {
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        // Its critical line says why (the bucket, the keys, the endpoint); an error line
        // after it only says that it exits.
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        let pick = |tag: &str| lines.iter().rev().find(|l| l.contains(tag)).copied();
        let line = pick("[CRT]")
            .or_else(|| pick("[ERR]"))
            .or_else(|| lines.last().copied())
            .unwrap_or("");
        // Without its timestamp and source location.
        let line = line.split_once("): ").map_or(line, |(_, said)| said);
        line.trim().to_string()
    };
    let deadline = std::time::Instant::now() + MOUNT_TIMEOUT;
    let give_up = |child: &mut std::process::Child, message: String| {
        let _ = child.kill();
        let _ = child.wait();
        let _ = unmount(point);
        failed(message)
    };
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                let _ = unmount(point);
                let said = said();
                return Err(failed(match said.is_empty() {
                    true => format!("{CLIENT} ended with {status}"),
                    false => format!("{CLIENT}: {said}"),
                }));
            }
            Ok(None) if is_mounted(point) => break,
            Ok(None) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Ok(None) => {
                let message = format!(
                    "{CLIENT} did not mount within {} s",
                    MOUNT_TIMEOUT.as_secs()
                );
                return Err(give_up(&mut child, message));
            }
            Err(e) => return Err(give_up(&mut child, format!("wait for {CLIENT}: {e}"))),
        }
    }
    // Mounted: the client checks the bucket when the mount's first request comes. A stat of
    // its root waits for that, on a thread of its own (a client that hangs is given up on).
    let (tx, rx) = std::sync::mpsc::channel();
    let root = point.to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(std::fs::metadata(&root).map(drop));
    });
    let left = deadline.saturating_duration_since(std::time::Instant::now());
    match rx.recv_timeout(left.max(Duration::from_secs(1))) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            std::thread::sleep(Duration::from_millis(100));
            let said = said();
            let message = match said.is_empty() {
                true => format!("the mount does not answer: {e}"),
                false => format!("{CLIENT}: {said}"),
            };
            return Err(give_up(&mut child, message));
        }
        Err(_) => {
            let message = format!(
                "{CLIENT} did not answer within {} s",
                MOUNT_TIMEOUT.as_secs()
            );
            return Err(give_up(&mut child, message));
        }
    }
    // It serves until the mount goes; its exit is collected then.
    std::thread::Builder::new()
        .name("fastbox-s3fs".into())
        .spawn(move || {
            let _ = child.wait();
        })
        .map_err(|e| failed(format!("watch {CLIENT}: {e}")))?;
    Ok(())
}

/// Makes directory `path` with `mode`, unless it is there already.
fn make_dir(path: &Path, mode: u32) -> std::io::Result<()> {
    match std::fs::DirBuilder::new().mode(mode).create(path) {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        made => made,
    }
}

/// Whether the client, which runs in the sandbox's network namespace but reads the node's
/// resolver settings, asks the sandbox's DNS forwarder for `endpoint`'s name: a name server
/// on loopback would be the sandbox's own loopback there (a sandbox process could answer),
/// and a resolver other than `files`/`dns` (systemd's `resolve`) would go around the
/// forwarder. Such a node takes endpoints given as addresses only.
fn check_resolver(endpoint: &str) -> Result<(), String> {
    let resolv = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    let nss = std::fs::read_to_string("/etc/nsswitch.conf").unwrap_or_default();
    resolver_reaches_the_forwarder(endpoint, &resolv, &nss)
}

/// [`check_resolver`] for the node's `resolv.conf` and `nsswitch.conf` texts.
fn resolver_reaches_the_forwarder(endpoint: &str, resolv: &str, nss: &str) -> Result<(), String> {
    let authority = endpoint
        .split_once("://")
        .map_or(endpoint, |(_, rest)| rest);
    let host = match authority.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => authority,
    };
    if host.parse::<std::net::IpAddr>().is_ok() {
        return Ok(());
    }
    let loopback = resolv
        .lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|a| a.trim().parse::<std::net::IpAddr>().ok())
        .find(|a| a.is_loopback() || a.is_unspecified());
    let other = nss
        .lines()
        .find_map(|l| l.trim().strip_prefix("hosts:"))
        .and_then(|sources| {
            sources
                .split_whitespace()
                .filter(|s| !s.starts_with('['))
                // `myhostname` answers only the machine's own names.
                .find(|s| !matches!(*s, "files" | "dns" | "myhostname"))
                .map(str::to_string)
        });
    match (loopback, other) {
        (Some(ns), _) => Err(format!(
            "this node's resolver is {ns}, on loopback: give the endpoint as an address"
        )),
        (None, Some(source)) => Err(format!(
            "this node resolves host names through {source:?}, around the sandbox's DNS: give the endpoint as an address"
        )),
        (None, None) => Ok(()),
    }
}

/// `path` as `/proc/self/mountinfo` writes it (space, tab, newline and backslash octal).
fn mountinfo_escaped(path: &Path) -> String {
    let mut out = String::new();
    for c in path.to_string_lossy().chars() {
        match c {
            ' ' => out.push_str("\\040"),
            '\t' => out.push_str("\\011"),
            '\n' => out.push_str("\\012"),
            '\\' => out.push_str("\\134"),
            c => out.push(c),
        }
    }
    out
}

/// Whether a FUSE file system is mounted at `point`.
fn is_mounted(point: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let point = mountinfo_escaped(point);
    info.lines().any(|line| {
        let mut fields = line.split(" - ");
        let (Some(head), Some(tail)) = (fields.next(), fields.next()) else {
            return false;
        };
        head.split(' ').nth(4) == Some(point.as_ref()) && tail.starts_with("fuse")
    })
}

fn unmount(point: &Path) -> nix::Result<()> {
    nix::mount::umount2(point, nix::mount::MntFlags::MNT_DETACH)
}

/// Unmounts every object-storage volume of `sandbox` and removes its points (each client
/// ends once the sandbox's own binds are gone with it). Idempotent.
pub fn unmount_all(data_dir: &Path, sandbox: &str) {
    let dir = data_dir.join(DIR).join(sandbox);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        // Its keys (gone already unless a crash came between), its client's log and staging
        // directory: fastbox's own files, never the bucket's.
        let file_name = entry.file_name().to_string_lossy().into_owned();
        if file_name.starts_with(".tmp-") {
            let _ = std::fs::remove_dir_all(&path);
            continue;
        }
        if file_name.starts_with('.') {
            let _ = std::fs::remove_file(&path);
            continue;
        }
        // Only ever a mount point: unmounted, then removed empty (never recursively, which
        // would reach into the bucket).
        let _ = unmount(&path);
        if let Err(e) = std::fs::remove_dir(&path) {
            tracing::warn!(sandbox, point = %path.display(), error = %e, "object-storage volume: mount point not removed");
        }
    }
    let _ = std::fs::remove_dir(&dir);
}

/// Unmounts a sandbox's object-storage volumes when dropped, unless [`UnmountOnDrop::keep`]
/// was called: for a start that fails after mounting them.
pub struct UnmountOnDrop<'a> {
    data_dir: &'a Path,
    sandbox: &'a str,
    armed: bool,
}

impl<'a> UnmountOnDrop<'a> {
    pub fn new(data_dir: &'a Path, sandbox: &'a str) -> Self {
        Self {
            data_dir,
            sandbox,
            armed: true,
        }
    }

    /// The start succeeded: the mounts stay with the sandbox.
    pub fn keep(&mut self) {
        self.armed = false;
    }
}

impl Drop for UnmountOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            unmount_all(self.data_dir, self.sandbox);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_are_per_sandbox_and_volume_and_unmounting_nothing_is_fine() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            point(dir.path(), "sbx", "data"),
            dir.path().join("object-volumes/sbx/data")
        );
        let p = point(dir.path(), "sbx", "data");
        std::fs::create_dir_all(&p).unwrap();
        std::fs::write(p.parent().unwrap().join(".keys-data"), "k:s").unwrap();
        unmount_all(dir.path(), "sbx");
        assert!(!dir.path().join("object-volumes/sbx").exists());
        unmount_all(dir.path(), "gone");
    }

    #[test]
    fn names_are_taken_only_when_the_nodes_resolver_asks_the_sandboxs_dns() {
        let debian = ("nameserver 10.255.255.53\n", "hosts: files dns\n");
        let resolved = (
            "nameserver 127.0.0.53\noptions edns0\n",
            "hosts: files dns\n",
        );
        let nss_resolve = (
            "nameserver 10.0.0.2\n",
            "hosts: files resolve [!UNAVAIL=return] dns\n",
        );
        let ok = |(resolv, nss): (&str, &str), endpoint: &str| {
            resolver_reaches_the_forwarder(endpoint, resolv, nss)
        };
        assert!(ok(debian, "https://s3.example.com").is_ok());
        assert!(
            ok(
                ("nameserver 10.0.0.2\n", "hosts: files myhostname dns\n"),
                "s3.test"
            )
            .is_ok()
        );
        let err = ok(resolved, "http://s3.test:9000").unwrap_err();
        assert!(
            err.contains("127.0.0.53") && err.contains("address"),
            "{err}"
        );
        let err = ok(nss_resolve, "https://s3.example.com").unwrap_err();
        assert!(err.contains("resolve"), "{err}");
        // An address needs no resolver.
        assert!(ok(resolved, "http://198.18.1.20:9000").is_ok());
        assert!(ok(nss_resolve, "https://203.0.113.7").is_ok());
    }

    #[test]
    fn mount_points_compare_as_mountinfo_writes_them() {
        assert_eq!(
            mountinfo_escaped(Path::new("/data dir/a\\b")),
            "/data\\040dir/a\\134b"
        );
    }

    #[test]
    fn a_volume_without_keys_is_refused_before_anything_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let volume = VolumeMount {
            name: "data".into(),
            source: VolumeSource::ObjectStorage {
                bucket: "b".into(),
                endpoint: "http://s3.test".into(),
                options: Vec::new(),
            },
            mount_path: "/data".into(),
            read_only: false,
            sub_path: None,
        };
        let err = mount(dir.path(), "sbx", Path::new("/nonexistent"), &volume, None).unwrap_err();
        assert!(matches!(err, ObjectVolumeError::NoKeys(_)), "{err}");
        assert!(!dir.path().join(DIR).exists());
    }
}
