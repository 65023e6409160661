//! Volumes: a directory of the host bound into a running sandbox, at a path inside its root.
//!
//! The caller opens the source directory confined to what it may bind (an operator's allowed
//! directory, a named volume's own tree: [`crate::confine::Dir`]). [`DetachedMount::of_dir`]
//! clones the mount at that directory as a detached mount (`open_tree(OPEN_TREE_CLONE)`, not
//! recursive: mounts below the directory are not carried) and sets its flags before anyone
//! can reach it: `nosuid` and `nodev` always (the tenant's root must not plant a set-id program
//! or a device node the host would honour), read-only when asked, and private propagation (no
//! mount event crosses between the host and the sandbox through it).
//!
//! [`attach`] then moves each detached mount into the sandbox from a thread that joined the
//! sandbox's mount namespace, onto the mount path resolved inside the sandbox's root
//! ([`crate::confine::Dir::create_dir_all`]: missing directories are created; a symlink the
//! tenant planted on the way resolves inside its root, never to the host's). The thread exits
//! afterwards: nothing else ever runs in the sandbox's namespace.
//!
//! The sandbox can neither unmount, remount nor move a volume: it has no `CAP_SYS_ADMIN` and
//! its seccomp filter refuses the mount system calls.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::Path;

use crate::confine::{ConfineError, Dir};

/// What went wrong binding a volume.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// A system call on the volume's mount failed.
    #[error("volume at {mount_path}: {what}: {source}")]
    Mount {
        mount_path: String,
        what: &'static str,
        source: io::Error,
    },
    /// The mount path is not a directory that can be reached inside the sandbox's root.
    #[error("volume at {mount_path}: {source}")]
    MountPath {
        mount_path: String,
        source: ConfineError,
    },
    /// The sandbox's mount namespace could not be joined.
    #[error("join the mount namespace of process {pid}: {source}")]
    Namespace { pid: i32, source: io::Error },
}

/// A clone of a directory's mount, detached (attached nowhere yet), its flags set.
#[derive(Debug)]
pub struct DetachedMount {
    fd: OwnedFd,
    /// For messages: where it will be mounted.
    mount_path: String,
}

impl DetachedMount {
    /// A detached clone of directory `dir` (held open by the caller, who resolved it confined
    /// to what may be bound), to be mounted at `mount_path` inside a sandbox: `nosuid`,
    /// `nodev`, private, and read-only when `read_only`.
    pub fn of_dir(
        dir: BorrowedFd<'_>,
        mount_path: &str,
        read_only: bool,
    ) -> Result<Self, VolumeError> {
        let failed = |what: &'static str| VolumeError::Mount {
            mount_path: mount_path.to_string(),
            what,
            source: io::Error::last_os_error(),
        };
        let empty = c"";
        // SAFETY: open_tree(2) on a descriptor we borrow, with an empty path and
        // AT_EMPTY_PATH (the descriptor itself); the result is checked.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_open_tree,
                dir.as_raw_fd(),
                empty.as_ptr(),
                libc::OPEN_TREE_CLONE
                    | libc::OPEN_TREE_CLOEXEC
                    | libc::AT_EMPTY_PATH as libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(failed("clone the source directory's mount (open_tree)"));
        }
        // SAFETY: a descriptor just returned by open_tree(2), owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) };
        let mut set = libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV;
        if read_only {
            set |= libc::MOUNT_ATTR_RDONLY;
        }
        // SAFETY: `mount_attr` is plain integers; all-zero is "change nothing".
        let mut attr: libc::mount_attr = unsafe { std::mem::zeroed() };
        attr.attr_set = set;
        attr.propagation = libc::MS_PRIVATE;
        // SAFETY: mount_setattr(2) on the detached mount we own, with an attribute struct of
        // the size we pass; the result is checked.
        let done = unsafe {
            libc::syscall(
                libc::SYS_mount_setattr,
                fd.as_raw_fd(),
                empty.as_ptr(),
                libc::AT_EMPTY_PATH,
                &attr as *const libc::mount_attr,
                std::mem::size_of::<libc::mount_attr>(),
            )
        };
        if done != 0 {
            return Err(failed("set nosuid, nodev and read-only (mount_setattr)"));
        }
        Ok(Self {
            fd,
            mount_path: mount_path.to_string(),
        })
    }

    /// Where it will be mounted inside the sandbox.
    pub fn mount_path(&self) -> &str {
        &self.mount_path
    }

    /// Mounts it on directory `target` of the calling thread's mount namespace (a directory
    /// of fastbox's own: a restore's staging point, [`attach`] for a sandbox's paths).
    pub fn mount_on(&self, target: BorrowedFd<'_>) -> Result<(), VolumeError> {
        move_onto(self, target)
    }
}

/// Mounts each of `mounts` at its path inside the root of the mount namespace of process
/// `pid` (a sandbox's init), in order, from a thread of its own. Missing directories on a
/// mount path are created (mode 0755); the path resolves inside the sandbox's root and never
/// across one of its mounts (a path under another volume, or under `/proc`, is refused).
pub fn attach(pid: i32, mounts: Vec<DetachedMount>) -> Result<(), VolumeError> {
    if mounts.is_empty() {
        return Ok(());
    }
    let ns = File::open(format!("/proc/{pid}/ns/mnt"))
        .map_err(|source| VolumeError::Namespace { pid, source })?;
    std::thread::Builder::new()
        .name("fastbox-volumes".into())
        .spawn(move || attach_here(pid, &ns, &mounts))
        .map_err(|source| VolumeError::Namespace { pid, source })?
        .join()
        .expect("the volume thread panicked")
}

/// In a thread that exits afterwards: join `ns`, then mount each of `mounts`.
fn attach_here(pid: i32, ns: &File, mounts: &[DetachedMount]) -> Result<(), VolumeError> {
    let join_failed = |source| VolumeError::Namespace { pid, source };
    // A thread shares its root and working directory with the process unless it unshares
    // them; setns(CLONE_NEWNS) refuses a thread that shares them.
    // SAFETY: unshare(2) and setns(2) with valid flags and a descriptor we hold.
    if unsafe { libc::unshare(libc::CLONE_FS) } != 0 {
        return Err(join_failed(io::Error::last_os_error()));
    }
    // SAFETY: as above.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNS) } != 0 {
        return Err(join_failed(io::Error::last_os_error()));
    }
    // setns put this thread's root at the namespace's root: the sandbox's.
    let root = Dir::open_root(Path::new("/")).map_err(|source| VolumeError::MountPath {
        mount_path: "/".into(),
        source,
    })?;
    for mount in mounts {
        let target = root
            .create_dir_all(&mount.mount_path, 0o755)
            .map_err(|source| VolumeError::MountPath {
                mount_path: mount.mount_path.clone(),
                source,
            })?;
        move_onto(mount, target.as_fd())?;
    }
    Ok(())
}

fn move_onto(mount: &DetachedMount, target: BorrowedFd<'_>) -> Result<(), VolumeError> {
    let empty = c"";
    // SAFETY: move_mount(2) of our detached mount onto a directory descriptor we borrow, both
    // by AT_EMPTY_PATH; the result is checked.
    let done = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            mount.fd.as_raw_fd(),
            empty.as_ptr(),
            target.as_raw_fd(),
            empty.as_ptr(),
            libc::MOVE_MOUNT_F_EMPTY_PATH | libc::MOVE_MOUNT_T_EMPTY_PATH,
        )
    };
    if done != 0 {
        return Err(VolumeError::Mount {
            mount_path: mount.mount_path.clone(),
            what: "mount (move_mount)",
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}
