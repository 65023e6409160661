//! The sandbox's mount table, built by its init inside the new mount namespace: `/proc`,
//! read-only `/sys`, a minimal `/dev` (a bind of a directory of the root), the read-only
//! execd, then `pivot_root` into the overlay and the kernel interfaces masked or made
//! read-only as runc's default spec does.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;

use nix::mount::{MntFlags, MsFlags, mount, umount2};

use super::InitConfig;
use crate::confine::{Dir, fd_proc_path};
use crate::spec::EXECD_SANDBOX_PATH;

use fastbox_seccomp::masks::{EMPTY_DIR, MASKED_DIRS, MASKED_FILES};
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
    mount_at(
        None,
        Path::new("/"),
        None,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None,
    )?;

    // The root is the image and the writable layer: the tenant's. Until `pivot_root` every
    // name in it is reached through the confinement module, and every mount target is the
    // `/proc/self/fd` path of a directory opened without following symlinks; afterwards the
    // host's tree is gone from this mount namespace and plain paths resolve inside the root.
    let tree = Dir::open_root(&config.root).map_err(|e| e.to_string())?;
    let nosuid_noexec_nodev = MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC | MsFlags::MS_NODEV;
    mount_at(
        Some("proc"),
        &own_dir(&tree, "proc", 0o555)?.proc_path(),
        Some("proc"),
        nosuid_noexec_nodev,
        None,
    )?;
    mount_at(
        Some("sysfs"),
        &own_dir(&tree, "sys", 0o555)?.proc_path(),
        Some("sysfs"),
        nosuid_noexec_nodev | MsFlags::MS_RDONLY,
        None,
    )?;
    populate_dev(&tree)?;
    let tmp = tree
        .create_dir_all("tmp", 0o1777)
        .map_err(|e| e.to_string())?;
    tmp.set_mode(0o1777).map_err(|e| e.to_string())?;
    let execd = bind_execd(&tree, &config.execd_host)?;
    own_dir(&tree, EMPTY_DIR, 0o555)?
        .set_mode(0o555)
        .map_err(|e| e.to_string())?;
    if config.isolation {
        own_dir(&tree, super::ISOLATION_PROC, 0o555)?;
    }

    nix::unistd::fchdir(tree.as_fd().as_raw_fd()).map_err(|e| format!("chdir to the root: {e}"))?;
    nix::unistd::pivot_root(".", ".").map_err(|e| format!("pivot_root: {e}"))?;
    umount2(".", MntFlags::MNT_DETACH).map_err(|e| format!("detach old root: {e}"))?;
    std::env::set_current_dir("/").map_err(|e| format!("chdir /: {e}"))?;
    drop(execd);

    finish_dev()?;
    read_only(Path::new(EXECD_SANDBOX_PATH))?;
    mask_and_protect()?;
    if config.isolation {
        hidden_proc()?;
    }
    Ok(())
}

/// The isolation variant's fully visible `/proc` ([`super::ISOLATION_PROC`]), read-only and
/// covered by an empty read-only tmpfs.
fn hidden_proc() -> Result<(), String> {
    mount_at(
        Some("proc"),
        Path::new(super::ISOLATION_PROC),
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC | MsFlags::MS_NODEV | MsFlags::MS_RDONLY,
        None,
    )?;
    mount_at(
        Some("tmpfs"),
        Path::new(super::ISOLATION_DIR),
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC | MsFlags::MS_NODEV | MsFlags::MS_RDONLY,
        Some("size=4k,mode=000"),
    )
}

/// The directory of the sandbox root that is bound at `/dev`: `/dev` lives on the writable
/// layer, so a restore gets it back with the layer (a bind mount), not from a `tar` of a
/// tmpfs that CRIU would otherwise run at every restore (about 5 ms).
const DEV_DIR: &str = "/.fastbox/dev";

/// `name` of the root as a directory of fastbox's own: made if missing, refused if it is a
/// symlink or not a directory (an image that makes `/proc` a symlink does not start).
fn own_dir(tree: &Dir, name: &str, mode: u32) -> Result<Dir, String> {
    tree.own_dir(name, mode)
        .map_err(|e| format!("the sandbox root: {e}"))
}

/// The device nodes and links of `/.fastbox/dev`, bound at `/dev`.
fn populate_dev(tree: &Dir) -> Result<(), String> {
    let source = own_dir(tree, DEV_DIR, 0o755)?;
    let fail = |e: crate::confine::ConfineError| format!("populate /dev: {e}");
    source.set_mode(0o755).map_err(fail)?;
    for (name, major, minor) in DEVICES {
        source
            .make_char_device(name, *major, *minor, 0o666)
            .map_err(fail)?;
    }
    // `/dev/shm` is a directory (on the writable layer, bounded by its size) rather than a
    // tmpfs of its own: every tmpfs costs a restore a `tar` process.
    own_dir(&source, "shm", 0o1777)?
        .set_mode(0o1777)
        .map_err(fail)?;
    own_dir(&source, "pts", 0o755)?;
    for (link, target) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        source.make_symlink(link, target).map_err(fail)?;
    }
    let dev = own_dir(tree, "dev", 0o755)?;
    mount_at(
        Some(source.proc_path().to_str().unwrap_or_default()),
        &dev.proc_path(),
        None,
        MsFlags::MS_BIND,
        None,
    )
}

/// After `pivot_root`: `/dev` without set-id programs (its nodes are the only ones that work
/// in a sandbox, every other mount is `nodev`), and its own devpts instance.
fn finish_dev() -> Result<(), String> {
    let dev = Path::new("/dev");
    mount_at(
        None,
        dev,
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

/// Bind the host's execd binary at `EXECD_SANDBOX_PATH` (made read-only after `pivot_root`);
/// the target is a regular file of the root opened without following it. Returns the
/// target's descriptor, to be kept until the bind is read-only.
fn bind_execd(tree: &Dir, execd_host: &Path) -> Result<OwnedFd, String> {
    let path = Path::new(EXECD_SANDBOX_PATH);
    let (parent, name) = (
        path.parent().unwrap_or(Path::new("/")),
        path.file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default(),
    );
    let target = own_dir(tree, &parent.to_string_lossy(), 0o755)?
        .regular_file(name, 0o755)
        .map_err(|e| format!("the execd mount point: {e}"))?;
    mount_at(
        Some(execd_host.to_str().unwrap_or_default()),
        &fd_proc_path(target.as_fd()),
        None,
        MsFlags::MS_BIND,
        None,
    )?;
    Ok(target)
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
    read_only(target)
}

/// Remount the bind mount at `target` read-only, without set-id programs or devices.
fn read_only(target: &Path) -> Result<(), String> {
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
