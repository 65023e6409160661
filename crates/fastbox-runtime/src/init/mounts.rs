//! The sandbox's mount table, built by its init inside the new mount namespace: `/proc`,
//! read-only `/sys`, a minimal `/dev` (a bind of a directory of the root), the read-only
//! execd, then `pivot_root` into the overlay and the kernel interfaces masked or made
//! read-only as runc's default spec does.

use std::fs;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::Path;

use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sys::stat::{Mode, SFlag, makedev, mknod};

use super::InitConfig;
use crate::spec::EXECD_SANDBOX_PATH;

/// Files hidden behind `/dev/null` (runc's default `maskedPaths`, files).
const MASKED_FILES: &[&str] = &[
    "/proc/kcore",
    "/proc/keys",
    "/proc/timer_list",
    "/proc/sched_debug",
    "/proc/latency_stats",
    "/proc/interrupts",
];
/// Directories hidden behind an empty read-only directory (runc's `maskedPaths`,
/// directories; runc mounts an empty tmpfs, but every tmpfs costs a restore a `tar` process,
/// so fastbox binds [`EMPTY_DIR`] read-only instead).
const MASKED_DIRS: &[&str] = &[
    "/proc/acpi",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];
/// An empty, read-only directory of the sandbox root, bound over the masked directories.
const EMPTY_DIR: &str = "/.fastbox/empty";
/// runc's default `readonlyPaths`.
const READONLY_PATHS: &[&str] = &[
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

/// Character devices of the minimal `/dev`: (name, major, minor).
const DEVICES: &[(&str, u64, u64)] = &[
    ("null", 1, 3),
    ("zero", 1, 5),
    ("full", 1, 7),
    ("random", 1, 8),
    ("urandom", 1, 9),
    ("tty", 5, 0),
];

pub(super) fn setup_root(config: &InitConfig) -> Result<(), String> {
    let root = config.root.as_path();
    mount_at(
        None,
        Path::new("/"),
        None,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None,
    )?;

    let nosuid_noexec_nodev = MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC | MsFlags::MS_NODEV;
    mount_at(
        Some("proc"),
        &dir_in(root, "proc")?,
        Some("proc"),
        nosuid_noexec_nodev,
        None,
    )?;
    mount_at(
        Some("sysfs"),
        &dir_in(root, "sys")?,
        Some("sysfs"),
        nosuid_noexec_nodev | MsFlags::MS_RDONLY,
        None,
    )?;
    setup_dev(root)?;

    let tmp = dir_in(root, "tmp")?;
    fs::set_permissions(&tmp, fs::Permissions::from_mode(0o1777))
        .map_err(|e| format!("chmod /tmp: {e}"))?;

    bind_execd(root, &config.execd_host)?;
    let empty = root.join(EMPTY_DIR.trim_start_matches('/'));
    fs::create_dir_all(&empty).map_err(|e| format!("create {EMPTY_DIR}: {e}"))?;
    fs::set_permissions(&empty, fs::Permissions::from_mode(0o555))
        .map_err(|e| format!("chmod {EMPTY_DIR}: {e}"))?;

    std::env::set_current_dir(root).map_err(|e| format!("chdir {}: {e}", root.display()))?;
    nix::unistd::pivot_root(".", ".").map_err(|e| format!("pivot_root: {e}"))?;
    umount2(".", MntFlags::MNT_DETACH).map_err(|e| format!("detach old root: {e}"))?;
    std::env::set_current_dir("/").map_err(|e| format!("chdir /: {e}"))?;

    mask_and_protect()
}

/// The directory of the sandbox root that is bound at `/dev`: `/dev` lives on the writable
/// layer, so a restore gets it back with the layer (a bind mount), not from a `tar` of a
/// tmpfs that CRIU would otherwise run at every restore (about 5 ms).
const DEV_DIR: &str = "/.fastbox/dev";

fn setup_dev(root: &Path) -> Result<(), String> {
    let source = root.join(DEV_DIR.trim_start_matches('/'));
    fs::create_dir_all(&source).map_err(|e| format!("create {DEV_DIR}: {e}"))?;
    fs::set_permissions(&source, fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("chmod {DEV_DIR}: {e}"))?;
    for (name, major, minor) in DEVICES {
        let path = source.join(name);
        let _ = fs::remove_file(&path);
        mknod(
            &path,
            SFlag::S_IFCHR,
            Mode::from_bits_truncate(0o666),
            makedev(*major, *minor),
        )
        .map_err(|e| format!("mknod /dev/{name}: {e}"))?;
        // mknod honours the umask; the nodes must be usable by every user.
        fs::set_permissions(&path, fs::Permissions::from_mode(0o666))
            .map_err(|e| format!("chmod /dev/{name}: {e}"))?;
    }
    // `/dev/shm` is a directory (on the writable layer, bounded by its size) rather than a
    // tmpfs of its own: every tmpfs costs a restore a `tar` process.
    let shm = dir_in(&source, "shm")?;
    fs::set_permissions(&shm, fs::Permissions::from_mode(0o1777))
        .map_err(|e| format!("chmod /dev/shm: {e}"))?;
    dir_in(&source, "pts")?;
    for (link, target) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        let path = source.join(link);
        let _ = fs::remove_file(&path);
        symlink(target, &path).map_err(|e| format!("symlink /dev/{link}: {e}"))?;
    }
    let dev = dir_in(root, "dev")?;
    mount_at(
        Some(source.to_str().unwrap_or_default()),
        &dev,
        None,
        MsFlags::MS_BIND,
        None,
    )?;
    mount_at(
        None,
        &dev,
        None,
        MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_NOSUID,
        None,
    )?;
    mount_at(
        Some("devpts"),
        &dev.join("pts"),
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    )
}

/// Bind the host's execd binary read-only at `EXECD_SANDBOX_PATH`.
fn bind_execd(root: &Path, execd_host: &Path) -> Result<(), String> {
    let target = root.join(EXECD_SANDBOX_PATH.trim_start_matches('/'));
    if let Some(parent) = target.parent() {
        fs::create_dir_all(parent).map_err(|e| format!("create {}: {e}", parent.display()))?;
    }
    if !target.exists() {
        fs::write(&target, b"").map_err(|e| format!("create {}: {e}", target.display()))?;
    }
    bind_read_only(execd_host, &target)
}

fn mask_and_protect() -> Result<(), String> {
    for file in MASKED_FILES {
        if Path::new(file).exists() {
            mount_at(
                Some("/dev/null"),
                Path::new(file),
                None,
                MsFlags::MS_BIND,
                None,
            )?;
        }
    }
    for dir in MASKED_DIRS {
        if Path::new(dir).is_dir() {
            bind_read_only(Path::new(EMPTY_DIR), Path::new(dir))?;
        }
    }
    for path in READONLY_PATHS {
        if Path::new(path).exists() {
            bind_read_only(Path::new(path), Path::new(path))?;
        }
    }
    Ok(())
}

fn bind_read_only(source: &Path, target: &Path) -> Result<(), String> {
    mount_at(
        Some(source.to_str().unwrap_or_default()),
        target,
        None,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None,
    )?;
    mount_at(
        None,
        target,
        None,
        MsFlags::MS_BIND
            | MsFlags::MS_REMOUNT
            | MsFlags::MS_RDONLY
            | MsFlags::MS_NOSUID
            | MsFlags::MS_NODEV,
        None,
    )
}

/// `root/name`, created as a directory when missing.
fn dir_in(root: &Path, name: &str) -> Result<std::path::PathBuf, String> {
    let path = root.join(name);
    fs::create_dir_all(&path).map_err(|e| format!("create {}: {e}", path.display()))?;
    Ok(path)
}

fn mount_at(
    source: Option<&str>,
    target: &Path,
    fstype: Option<&str>,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<(), String> {
    mount(source, target, fstype, flags, data).map_err(|e| {
        format!(
            "mount {} on {}: {e}",
            source.unwrap_or("-"),
            target.display()
        )
    })
}
