//! The instance's private scratch space, `DATA_DIR/run`: where live snapshots write their
//! files while the sandbox is frozen (`DATA_DIR/run/staging`, `docs/snapshots.md`) and CRIU's
//! private `/run` (`DATA_DIR/run/criu`, where it keeps its kernel-feature cache when the
//! host's `/run` is not a tmpfs: `fastbox_runtime::criu::Criu::with_private_run`).
//!
//! It is a tmpfs of its own, mounted at `DATA_DIR/run` (source `fastbox-<prefix>-run`,
//! `mode=0700`): CRIU splices every memory page of the sandbox into an image file there, so
//! the freeze never waits for a disk, and the kernel-feature cache is only written on a
//! tmpfs. Its size is bounded at half of the host's memory (`size=50%`, what `/dev/shm` and
//! an unbounded tmpfs get by default): staged snapshots hold about the memory of their
//! sandboxes until they are committed to disk, and pages are only used as files are written.
//! Where the mount cannot be made, the directory itself (on the data directory's disk) is
//! used, with a warning.
//!
//! Nothing of it has a fixed name in a world-writable directory (where any local user could
//! plant a symlink or a directory of their own and read or replace checkpoint images): the
//! data directory must belong to root and be writable by nobody else, and `run`, `staging`
//! and `criu` are made 0700 and checked before use through descriptors opened without
//! following a symlink (a symlink, another owner or a mode that lets group or others write
//! is refused, never followed or repaired). The mount is made on the descriptor of the
//! directory that was checked (`/proc/self/fd/N`), not on its name.
//!
//! Transparent huge pages (`huge=always`) were measured twice and left off:
//! - they lowered the median freeze of a 256 MiB dump (161-180 against 190-202 ms here), but
//!   the first dump of every new sandbox then froze it for about a second;
//! - fresh 2 MiB pages are slow to come by in this virtual machine: its kernel hands free
//!   memory back to the host (`page_reporting.page_reporting_order=11`), and touching it
//!   again costs about 3.5 ms per MiB;
//! - a reserve of warm huge pages, freed right before each dump and written again after it,
//!   cut CRIU's page writing of a plain 256 MiB process from 125-140 to about 85 ms, but in
//!   fastbox the freeze only went from 173-188 to 141-159 ms (p50 149), still with 0.7-1 s
//!   outliers, for 300 MiB of memory held at all times. Not worth it.
//!
//! The mount lives as long as the instance: it is made at start and removed by
//! [`Staging::unmount`] at shutdown and by [`purge`]; [`leftover_mounts`] lists it (by its
//! source, which carries the prefix) while it is there.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use fastbox_runtime::criu::{Criu, CriuError};
use nix::mount::{MntFlags, MsFlags, mount, umount2};

/// The instance's private directory under the data directory (the tmpfs' mount point).
pub const RUN_DIR: &str = "run";
/// Live snapshots' staging area, in [`RUN_DIR`].
pub const STAGING_DIR: &str = "staging";
/// CRIU's private `/run`, in [`RUN_DIR`].
pub const CRIU_RUN_DIR: &str = "criu";
/// The tmpfs' options: private to root, half of the memory at most, no huge pages (see the
/// module doc). Not `noexec`: CRIU runs the post-dump action script from beside the
/// checkpoint.
const TMPFS_OPTIONS: &str = "mode=0700,size=50%,huge=never";

/// Why the instance's private directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StagingError {
    #[error(
        "{path} is a symbolic link or not a directory: fastbox keeps checkpoint images there and follows no link (remove it)"
    )]
    NotADirectory { path: PathBuf },
    #[error(
        "{path} belongs to uid {uid}, not to root: fastbox keeps checkpoint images there (remove it)"
    )]
    Owner { path: PathBuf, uid: u32 },
    #[error(
        "{path} has mode {mode:04o}, writable by group or others: fastbox keeps checkpoint images there (remove it, or chmod go-w the data directory)"
    )]
    Mode { path: PathBuf, mode: u32 },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("CRIU's private /run: {0}")]
    Criu(#[from] CriuError),
}

/// The private directory of one instance.
#[derive(Debug)]
pub struct Staging {
    prefix: String,
    run: PathBuf,
    root: PathBuf,
    criu_run: PathBuf,
    mounted: bool,
}

/// The staging area of the instance whose data directory is `data_dir`.
pub fn root(data_dir: &Path) -> PathBuf {
    data_dir.join(RUN_DIR).join(STAGING_DIR)
}

/// The source of instance `prefix`'s tmpfs, as `/proc/self/mountinfo` shows it.
fn mount_source(prefix: &str) -> String {
    format!("fastbox-{prefix}-run")
}

impl Staging {
    /// The private directory of instance `prefix` in `data_dir`: made where missing and
    /// checked, its tmpfs mounted now unless it already is (a crashed run left it).
    pub fn open(data_dir: &Path, prefix: &str) -> Result<Self, StagingError> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(data_dir)
            .map_err(io_err("create", data_dir))?;
        let data = open_data_dir(data_dir)?;
        let data_dev = fstat(data.as_raw_fd())
            .map_err(io_err("stat", data_dir))?
            .st_dev;
        let run_path = data_dir.join(RUN_DIR);
        let run = private_dir(data.as_raw_fd(), c"run", &run_path)?;
        let already = fstat(run.as_raw_fd())
            .map_err(io_err("stat", &run_path))?
            .st_dev
            != data_dev;
        let mounted = already || mount_tmpfs(&run, &run_path, prefix);
        let run = if mounted && !already {
            // The tmpfs now covers the directory: checked again, from the data directory.
            private_dir(data.as_raw_fd(), c"run", &run_path)?
        } else {
            run
        };
        let root = run_path.join(STAGING_DIR);
        let criu_run = run_path.join(CRIU_RUN_DIR);
        let opened = private_dir(run.as_raw_fd(), c"staging", &root)
            .and_then(|_| private_dir(run.as_raw_fd(), c"criu", &criu_run));
        let staging = Self {
            prefix: prefix.to_string(),
            run: run_path,
            root,
            criu_run,
            mounted,
        };
        if let Err(e) = opened {
            staging.unmount_if_made(already);
            return Err(e);
        }
        Ok(staging)
    }

    /// `criu`, run with this instance's private `/run` where the host's is not a tmpfs.
    pub fn criu(&self, criu: Criu) -> Result<Criu, StagingError> {
        Ok(criu.with_private_run(&self.criu_run)?)
    }

    /// Where the snapshot `key` stages its files.
    pub fn dir(&self, key: &str) -> PathBuf {
        self.root.join(key)
    }

    /// CRIU's private `/run`.
    pub fn criu_run(&self) -> &Path {
        &self.criu_run
    }

    /// Whether the tmpfs is mounted (or the directory is used as it is).
    pub fn is_mounted(&self) -> bool {
        self.mounted
    }

    /// Removes what interrupted snapshots left; returns how many.
    pub fn purge_entries(&self) -> usize {
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return 0;
        };
        entries
            .flatten()
            .filter(|e| std::fs::remove_dir_all(e.path()).is_ok())
            .count()
    }

    /// Removes the mount and the directory (at shutdown: nothing is staged then).
    pub fn unmount(&self) {
        release(&self.prefix, &self.run);
    }

    /// On a failed open: undo the mount this open made, not one a crashed run left.
    fn unmount_if_made(&self, already: bool) {
        if self.mounted && !already {
            release(&self.prefix, &self.run);
        }
    }
}

/// Removes the private directory of a stopped instance `prefix` whose data directory is
/// `data_dir`: its tmpfs (wherever it is mounted) and the directory.
pub fn purge(prefix: &str, data_dir: &Path) {
    release(prefix, &data_dir.join(RUN_DIR));
}

/// Mount points of tmpfs mounts made for instance `prefix` (by their source) whose path does
/// not show the prefix (those are listed by mount point already).
pub fn leftover_mounts(prefix: &str) -> Vec<String> {
    mounts()
        .into_iter()
        .filter(|(point, fstype, source)| {
            fstype == "tmpfs"
                && source.starts_with("fastbox-")
                && source.contains(prefix)
                && !point.contains(prefix)
        })
        .map(|(point, _, _)| point)
        .collect()
}

fn release(prefix: &str, run: &Path) {
    // Every mount of the instance's tmpfs (stacked ones too), found by its source; none when
    // an earlier release (a drain before the shutdown) ran.
    let source = mount_source(prefix);
    for _ in 0..16 {
        let points: Vec<String> = mounts()
            .into_iter()
            .filter(|(_, fstype, s)| fstype == "tmpfs" && *s == source)
            .map(|(point, _, _)| point)
            .collect();
        if points.is_empty() {
            break;
        }
        for point in points {
            if let Err(e) = umount2(
                Path::new(&point),
                MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW,
            ) {
                tracing::warn!(dir = %point, error = %e, "could not unmount the instance's private tmpfs");
                return;
            }
        }
    }
    // A symlink planted there is removed itself, never followed.
    let _ = std::fs::remove_dir_all(run);
}

/// Mounts the instance's tmpfs on `run` (the descriptor of the directory just checked);
/// false, with a warning, where it cannot be made.
fn mount_tmpfs(run: &OwnedFd, shown: &Path, prefix: &str) -> bool {
    let target = fastbox_runtime::confine::fd_proc_path(std::os::fd::AsFd::as_fd(run));
    match mount(
        Some(mount_source(prefix).as_str()),
        &target,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(TMPFS_OPTIONS),
    ) {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(dir = %shown.display(), error = %e, "no tmpfs for the staging area: live snapshots are staged on the data directory's disk");
            false
        }
    }
}

/// The data directory, given by the operator (a symlink to it is followed): it must belong to
/// this process's user (root) and be writable by nobody else, or what is made in it could be
/// swapped.
fn open_data_dir(path: &Path) -> Result<OwnedFd, StagingError> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|e| StagingError::Io {
        what: "open",
        path: path.to_path_buf(),
        source: e.into(),
    })?;
    // SAFETY: open(2) with a NUL-terminated path; the result is checked.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io_err("open the data directory", path)(
            io::Error::last_os_error(),
        ));
    }
    // SAFETY: a descriptor just returned by open(2), owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let st = fstat(fd.as_raw_fd()).map_err(io_err("stat", path))?;
    check_owner_and_mode(&st, path)?;
    Ok(fd)
}

/// The directory `name` of the directory `parent` (`shown` for messages): made 0700 where
/// missing, opened without following a symlink, and refused unless it is a directory of this
/// process's user (root) that group and others cannot write. Group or other read and search
/// bits are taken away.
fn private_dir(parent: RawFd, name: &CStr, shown: &Path) -> Result<OwnedFd, StagingError> {
    // SAFETY: mkdirat(2) on a descriptor we hold with a NUL-terminated name.
    if unsafe { libc::mkdirat(parent, name.as_ptr(), 0o700) } != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EEXIST) {
            return Err(io_err("create", shown)(e));
        }
    }
    // SAFETY: openat(2) on a descriptor we hold with a NUL-terminated name.
    let fd = unsafe {
        libc::openat(
            parent,
            name.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        let e = io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::ELOOP | libc::ENOTDIR) => StagingError::NotADirectory {
                path: shown.to_path_buf(),
            },
            _ => io_err("open", shown)(e),
        });
    }
    // SAFETY: a descriptor just returned by openat(2), owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let st = fstat(fd.as_raw_fd()).map_err(io_err("stat", shown))?;
    check_owner_and_mode(&st, shown)?;
    if st.st_mode & 0o077 != 0 {
        // SAFETY: fchmod(2) on the descriptor just checked.
        if unsafe { libc::fchmod(fd.as_raw_fd(), 0o700) } != 0 {
            return Err(io_err("chmod", shown)(io::Error::last_os_error()));
        }
    }
    Ok(fd)
}

fn check_owner_and_mode(st: &libc::stat, path: &Path) -> Result<(), StagingError> {
    let me = nix::unistd::geteuid().as_raw();
    if st.st_uid != me {
        return Err(StagingError::Owner {
            path: path.to_path_buf(),
            uid: st.st_uid,
        });
    }
    if st.st_mode & 0o022 != 0 {
        return Err(StagingError::Mode {
            path: path.to_path_buf(),
            mode: st.st_mode & 0o7777,
        });
    }
    Ok(())
}

fn fstat(fd: RawFd) -> io::Result<libc::stat> {
    // SAFETY: an all-zero `stat` is a valid value for fstat(2) to fill in.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat(2) on a descriptor we hold into a struct we own.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> StagingError {
    let path = path.to_path_buf();
    move |source| StagingError::Io { what, path, source }
}

/// `(mount point, file system type, source)` of every mount of this mount namespace.
fn mounts() -> Vec<(String, String, String)> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let point = left.split(' ').nth(4)?;
            let mut right = right.split(' ');
            let (fstype, source) = (right.next()?, right.next()?);
            Some((unescape(point), fstype.to_string(), unescape(source)))
        })
        .collect()
}

/// A `/proc/self/mountinfo` field with its octal escapes (`\040` for a space) decoded.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && let Some(v) = std::str::from_utf8(&bytes[i + 1..i + 4])
                .ok()
                .and_then(|octal| u8::from_str_radix(octal, 8).ok())
        {
            out.push(v);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests;
