//! The one way the host reaches into a tree a tenant controls.
//!
//! Everything under a sandbox's root, writable layer, image, snapshot or checkpoint is the
//! tenant's, and hostile: any directory in it may be a symlink to `/`, any file a FIFO, a
//! device node or a symlink to a host file, and a running sandbox may swap one for another
//! between two of the host's calls. So the host never resolves a string path into such a
//! tree. It holds a directory descriptor of the tree's root ([`Dir::open_root`]) and:
//!
//! - resolves paths inside it with `openat2(2)` and `RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS
//!   | RESOLVE_NO_XDEV`: `..` and absolute symlinks stay inside the tree, `/proc` magic links
//!   are refused and no mount is crossed ([`Dir::resolve_dir`]);
//! - or refuses every symlink on the way where a directory of fastbox's own is expected
//!   ([`Dir::own_dir`]);
//! - acts on the last component through its directory's descriptor without following it:
//!   files are written to a fresh name and renamed over the old one (a symlink, FIFO or
//!   device there is replaced, never opened), nodes and links are made with `*at` calls.
//!
//! There is no check-then-use on a string path, so a swap between two steps can only move
//! the write to another place inside the tree: the unit tests swap a directory for a symlink
//! to a host directory between the steps (through [`testing::between_steps`]) and check the
//! host directory is untouched.

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Component, Path, PathBuf};

/// What went wrong reaching into a confined tree.
#[derive(Debug, thiserror::Error)]
pub enum ConfineError {
    /// The path, or the last component, is not allowed here (empty, `..`, absolute where a
    /// name is expected).
    #[error("{path}: not a plain path inside the tree")]
    BadPath { path: String },
    /// A directory fastbox owns inside the tree is something else (a symlink, a file, a node).
    #[error("{path}: not a directory inside the tree (a symlink or another kind of file)")]
    NotADirectory { path: String },
    /// The resolution would leave the tree's mount.
    #[error("{path}: resolves across a mount of the tree")]
    CrossesMount { path: String },
    /// A system call failed.
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        source: io::Error,
    },
}

type Result<T> = std::result::Result<T, ConfineError>;

/// A directory inside a confined tree (or its root), held open.
#[derive(Debug)]
pub struct Dir {
    fd: OwnedFd,
    /// For messages only: where this directory was opened, relative to the tree's root.
    shown: PathBuf,
}

impl Dir {
    /// The root of a tree at `path`, a path fastbox chose (the sandbox's mounted root, its
    /// writable layer, a checkpoint's copy), never one inside another tenant tree.
    pub fn open_root(path: &Path) -> Result<Dir> {
        let c = cstring(path.as_os_str(), &path.to_string_lossy())?;
        // SAFETY: open(2) with a valid C string; the result is checked.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_DIRECTORY | libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NOFOLLOW,
            )
        };
        if fd < 0 {
            return Err(io_err("open the tree root", path.display().to_string()));
        }
        Ok(Dir {
            // SAFETY: a descriptor just returned by open(2), owned by nobody else.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            shown: PathBuf::from("/"),
        })
    }

    /// The directory `rel` of this tree, resolved as if this directory were `/`: symlinks on
    /// the way are followed but stay inside, `..` stops at the root, magic links and mount
    /// crossings are refused.
    pub fn resolve_dir(&self, rel: impl AsRef<Path>) -> Result<Dir> {
        let rel = relative(rel.as_ref())?;
        self.openat2(
            &rel,
            libc::O_DIRECTORY | libc::O_RDONLY,
            libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS | libc::RESOLVE_NO_XDEV,
        )
        .map(|fd| self.child(fd, &rel))
    }

    /// The directory `rel` of this tree (every component created with `mode` when missing),
    /// resolved like [`Dir::resolve_dir`].
    pub fn create_dir_all(&self, rel: impl AsRef<Path>, mode: u32) -> Result<Dir> {
        let rel = relative(rel.as_ref())?;
        let mut dir = self.resolve_dir(".")?;
        let mut prefix = PathBuf::new();
        for name in rel.components() {
            let name = name.as_os_str();
            dir.mkdir_if_missing(name, mode)?;
            prefix.push(name);
            between_steps(&prefix);
            // From the tree's root again: a symlink met on the way resolves as the sandbox
            // would resolve it, inside the tree.
            dir = self.resolve_dir(&prefix)?;
        }
        Ok(dir)
    }

    /// The directory `rel` of fastbox's own (a mount point, `/.fastbox/...`): created with
    /// `mode` where missing, and refused if any component is a symlink or not a directory.
    pub fn own_dir(&self, rel: impl AsRef<Path>, mode: u32) -> Result<Dir> {
        let rel = relative(rel.as_ref())?;
        let mut dir = self.resolve_dir(".")?;
        for name in rel.components() {
            let name = name.as_os_str();
            dir.mkdir_if_missing(name, mode)?;
            between_steps(&dir.shown.join(name));
            let fd = dir
                .openat2(
                    Path::new(name),
                    libc::O_DIRECTORY | libc::O_RDONLY,
                    libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_XDEV | libc::RESOLVE_BENEATH,
                )
                .map_err(|e| match e {
                    ConfineError::Io { source, .. }
                        if matches!(source.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) =>
                    {
                        ConfineError::NotADirectory {
                            path: dir.shown.join(name).display().to_string(),
                        }
                    }
                    other => other,
                })?;
            dir = dir.child(fd, Path::new(name));
        }
        Ok(dir)
    }

    /// `name` in this directory holds exactly `bytes` with `mode`, as a new regular file:
    /// written under a fresh name and renamed over whatever was there (a symlink, FIFO or
    /// device node is replaced, never followed or opened; a directory there is an error).
    pub fn write_file(&self, name: &str, bytes: &[u8], mode: u32) -> Result<()> {
        let name = plain_name(name)?;
        let temp = format!(".{}.fastbox-{:016x}", name.to_string_lossy(), random_u64());
        let (fd, _) = self.open_entry(
            OsStr::new(&temp),
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW,
            mode,
            "create",
        )?;
        let file = std::fs::File::from(fd);
        let written = (|| {
            use std::io::Write;
            (&file).write_all(bytes)?;
            // The umask narrowed the mode at creation.
            // SAFETY: fchmod(2) on a descriptor we own.
            if unsafe { libc::fchmod(file.as_raw_fd(), mode as libc::mode_t) } != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        })();
        drop(file);
        let result = written
            .map_err(|source| ConfineError::Io {
                what: "write",
                path: self.shown_name(name),
                source,
            })
            .and_then(|()| {
                between_steps(&self.shown.join(name));
                self.rename(OsStr::new(&temp), name)
            });
        if result.is_err() {
            let _ = self.unlink(OsStr::new(&temp), 0);
        }
        result
    }

    /// A character device node `name` (`major:minor`, `mode`), replacing whatever non-directory
    /// was there.
    pub fn make_char_device(&self, name: &str, major: u64, minor: u64, mode: u32) -> Result<()> {
        let name = plain_name(name)?;
        self.replace_with(name, "mknod", |dir, c| {
            // SAFETY: mknodat(2) on our directory fd with a valid C string.
            unsafe {
                libc::mknodat(
                    dir,
                    c,
                    libc::S_IFCHR | (mode & 0o777),
                    libc::makedev(major as u32, minor as u32),
                )
            }
        })?;
        // mknod honours the umask.
        self.chmod_entry(name, mode)
    }

    /// A symbolic link `name` -> `target`, replacing whatever non-directory was there.
    pub fn make_symlink(&self, name: &str, target: &str) -> Result<()> {
        let name = plain_name(name)?;
        let target_c = cstring(OsStr::new(target), target)?;
        self.replace_with(name, "symlink", |dir, c| {
            // SAFETY: symlinkat(2) with valid C strings on our directory fd.
            unsafe { libc::symlinkat(target_c.as_ptr(), dir, c) }
        })
    }

    /// An empty regular file `name` (created if missing, its contents kept if it is one),
    /// returned as an `O_PATH` descriptor, e.g. a bind mount's target. Anything else there
    /// (a symlink, a directory, a node) is an error.
    pub fn regular_file(&self, name: &str, mode: u32) -> Result<OwnedFd> {
        let name = plain_name(name)?;
        // O_NONBLOCK: a FIFO swapped in never blocks the open.
        let (fd, meta) = self.open_entry(
            name,
            libc::O_WRONLY | libc::O_CREAT | libc::O_NOFOLLOW | libc::O_NONBLOCK,
            mode,
            "create",
        )?;
        if meta.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(ConfineError::Io {
                what: "expect a regular file at",
                path: self.shown_name(name),
                source: io::Error::from_raw_os_error(libc::EINVAL),
            });
        }
        Ok(fd)
    }

    /// The directory's own mode (`fchmod`, nothing resolved).
    pub fn set_mode(&self, mode: u32) -> Result<()> {
        // SAFETY: fchmod(2) on a descriptor we own.
        if unsafe { libc::fchmod(self.fd.as_raw_fd(), mode as libc::mode_t) } != 0 {
            return Err(io_err("chmod", self.shown.display().to_string()));
        }
        Ok(())
    }

    /// `/proc/self/fd/N` of this directory: a path mount(2) resolves to exactly this
    /// directory, whatever the tree's names point at by now.
    pub fn proc_path(&self) -> PathBuf {
        fd_proc_path(self.fd.as_fd())
    }

    /// Where this directory was opened, relative to the tree's root (for messages).
    pub fn shown(&self) -> &Path {
        &self.shown
    }

    fn child(&self, fd: OwnedFd, rel: &Path) -> Dir {
        Dir {
            fd,
            shown: self.shown.join(rel),
        }
    }

    fn shown_name(&self, name: &OsStr) -> String {
        self.shown.join(name).display().to_string()
    }

    fn openat2(&self, rel: &Path, flags: libc::c_int, resolve: u64) -> Result<OwnedFd> {
        let shown = self.shown.join(rel).display().to_string();
        let c = cstring(rel.as_os_str(), &shown)?;
        // SAFETY: `open_how` is plain integers; all-zero is its documented default.
        let mut how: libc::open_how = unsafe { std::mem::zeroed() };
        how.flags = (flags | libc::O_CLOEXEC | libc::O_NOCTTY) as u64;
        how.resolve = resolve;
        loop {
            // SAFETY: openat2(2) with our directory fd, a valid C string and an `open_how` of
            // the size we pass; the result is checked.
            let fd = unsafe {
                libc::syscall(
                    libc::SYS_openat2,
                    self.fd.as_raw_fd(),
                    c.as_ptr(),
                    &how as *const libc::open_how,
                    std::mem::size_of::<libc::open_how>(),
                )
            };
            if fd >= 0 {
                // SAFETY: a descriptor just returned by openat2(2).
                return Ok(unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) });
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                // openat2 asks for a retry when a rename raced the resolution.
                Some(libc::EAGAIN) | Some(libc::EINTR) => continue,
                Some(libc::EXDEV) => return Err(ConfineError::CrossesMount { path: shown }),
                _ => {
                    return Err(ConfineError::Io {
                        what: "open",
                        path: shown,
                        source: e,
                    });
                }
            }
        }
    }

    fn mkdir_if_missing(&self, name: &OsStr, mode: u32) -> Result<()> {
        let c = cstring(name, &self.shown_name(name))?;
        // SAFETY: mkdirat(2) on our directory fd with a valid C string.
        if unsafe { libc::mkdirat(self.fd.as_raw_fd(), c.as_ptr(), mode as libc::mode_t) } != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EEXIST) {
                return Err(ConfineError::Io {
                    what: "create the directory",
                    path: self.shown_name(name),
                    source: e,
                });
            }
        }
        Ok(())
    }

    /// Remove the non-directory `name` if present, then make it with `make`.
    fn replace_with(
        &self,
        name: &OsStr,
        what: &'static str,
        make: impl Fn(libc::c_int, *const libc::c_char) -> libc::c_int,
    ) -> Result<()> {
        let c = cstring(name, &self.shown_name(name))?;
        for _ in 0..3 {
            match self.unlink(name, 0) {
                Err(ConfineError::Io { source, .. })
                    if source.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err(e),
                Ok(()) => {}
            }
            between_steps(&self.shown.join(name));
            if make(self.fd.as_raw_fd(), c.as_ptr()) == 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EEXIST) {
                return Err(ConfineError::Io {
                    what,
                    path: self.shown_name(name),
                    source: e,
                });
            }
            // Something was put there in between: remove it again.
        }
        Err(ConfineError::Io {
            what,
            path: self.shown_name(name),
            source: io::Error::from_raw_os_error(libc::EEXIST),
        })
    }

    /// `name` of this directory opened with `flags` (close-on-exec, never a controlling
    /// terminal), and what `fstat` says of the very inode opened.
    fn open_entry(
        &self,
        name: &OsStr,
        flags: libc::c_int,
        mode: u32,
        what: &'static str,
    ) -> Result<(OwnedFd, libc::stat)> {
        let c = cstring(name, &self.shown_name(name))?;
        // SAFETY: openat(2) on our directory fd with a valid C string; checked below.
        let fd = unsafe {
            libc::openat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                flags | libc::O_NOCTTY | libc::O_CLOEXEC,
                mode as libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(io_err(what, self.shown_name(name)));
        }
        // SAFETY: a descriptor just returned by openat(2), owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let meta = fstat(fd.as_fd()).map_err(|source| ConfineError::Io {
            what: "stat",
            path: self.shown_name(name),
            source,
        })?;
        Ok((fd, meta))
    }

    fn unlink(&self, name: &OsStr, flags: libc::c_int) -> Result<()> {
        let c = cstring(name, &self.shown_name(name))?;
        // SAFETY: unlinkat(2) on our directory fd with a valid C string.
        if unsafe { libc::unlinkat(self.fd.as_raw_fd(), c.as_ptr(), flags) } != 0 {
            return Err(io_err("remove", self.shown_name(name)));
        }
        Ok(())
    }

    fn rename(&self, from: &OsStr, to: &OsStr) -> Result<()> {
        let from_c = cstring(from, &self.shown_name(from))?;
        let to_c = cstring(to, &self.shown_name(to))?;
        // SAFETY: renameat(2) within our directory fd with valid C strings.
        let r = unsafe {
            libc::renameat(
                self.fd.as_raw_fd(),
                from_c.as_ptr(),
                self.fd.as_raw_fd(),
                to_c.as_ptr(),
            )
        };
        if r != 0 {
            return Err(io_err("replace", self.shown_name(to)));
        }
        Ok(())
    }

    fn chmod_entry(&self, name: &OsStr, mode: u32) -> Result<()> {
        // fchmodat cannot refuse to follow a symlink (AT_SYMLINK_NOFOLLOW is not supported
        // for it), so chmod through an O_PATH descriptor opened without following.
        let (fd, meta) = self.open_entry(name, libc::O_PATH | libc::O_NOFOLLOW, 0, "open")?;
        if meta.st_mode & libc::S_IFMT == libc::S_IFLNK {
            return Err(ConfineError::NotADirectory {
                path: self.shown_name(name),
            });
        }
        let path = CString::new(fd_proc_path(fd.as_fd()).into_os_string().into_vec())
            .expect("a /proc path has no NUL");
        // SAFETY: chmod(2) of our own O_PATH descriptor's /proc/self/fd path.
        if unsafe { libc::chmod(path.as_ptr(), mode as libc::mode_t) } != 0 {
            return Err(io_err("chmod", self.shown_name(name)));
        }
        Ok(())
    }
}

impl AsFd for Dir {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// `/proc/self/fd/N` of a descriptor.
pub fn fd_proc_path(fd: BorrowedFd<'_>) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

fn fstat(fd: BorrowedFd<'_>) -> io::Result<libc::stat> {
    // SAFETY: an all-zero `stat` is a valid value for fstat(2) to fill in.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat(2) on a descriptor we borrow, into a struct we own.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

/// `rel` as a relative path of normal components (a leading `/` is dropped: paths inside a
/// tree are written as the sandbox sees them).
fn relative(rel: &Path) -> Result<PathBuf> {
    let mut out = PathBuf::new();
    for c in rel.components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(name) => out.push(name),
            Component::ParentDir | Component::Prefix(_) => {
                return Err(ConfineError::BadPath {
                    path: rel.display().to_string(),
                });
            }
        }
    }
    if out.as_os_str().is_empty() {
        out.push(".");
    }
    Ok(out)
}

/// A single directory entry's name: no `/`, not `.` or `..`, not empty.
fn plain_name(name: &str) -> Result<&OsStr> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') {
        return Err(ConfineError::BadPath {
            path: name.to_string(),
        });
    }
    Ok(OsStr::new(name))
}

fn cstring(s: &OsStr, shown: &str) -> Result<CString> {
    CString::new(s.as_bytes()).map_err(|_| ConfineError::BadPath {
        path: shown.to_string(),
    })
}

fn io_err(what: &'static str, path: String) -> ConfineError {
    ConfineError::Io {
        what,
        path,
        source: io::Error::last_os_error(),
    }
}

fn random_u64() -> u64 {
    let mut bytes = [0u8; 8];
    // SAFETY: getrandom(2) into a buffer we own, of the length we pass.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n != bytes.len() as isize {
        // Uniqueness, not secrecy, is what the name needs; O_EXCL catches a collision.
        return std::process::id() as u64
            ^ (std::time::UNIX_EPOCH
                .elapsed()
                .unwrap_or_default()
                .as_nanos() as u64);
    }
    u64::from_ne_bytes(bytes)
}

#[cfg(not(test))]
fn between_steps(_: &Path) {}

#[cfg(test)]
fn between_steps(at: &Path) {
    testing::HOOK.with(|h| {
        if let Some(hook) = h.borrow_mut().as_mut() {
            hook(at)
        }
    })
}

/// The test-only hook called between the steps of every operation (after a directory is
/// opened or an entry removed, before the next call acts), where a racing tenant would swap
/// a name.
#[cfg(test)]
pub(crate) mod testing {
    use std::cell::RefCell;
    use std::path::Path;

    type Hook = Box<dyn FnMut(&Path)>;

    thread_local! {
        pub(super) static HOOK: RefCell<Option<Hook>> = RefCell::new(None);
    }

    /// Run `f` with `hook` called between the steps of every confined operation on this
    /// thread.
    pub(crate) fn between_steps<T>(hook: impl FnMut(&Path) + 'static, f: impl FnOnce() -> T) -> T {
        HOOK.with(|h| *h.borrow_mut() = Some(Box::new(hook)));
        let out = f();
        HOOK.with(|h| *h.borrow_mut() = None);
        out
    }
}

#[cfg(test)]
mod tests;
