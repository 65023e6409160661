//! `cp -a SRC/. DST` in process: the seed of a restored sandbox's writable layer is copied
//! at every restore, and a `cp` process costs about 3 ms of a 30 ms restore.
//!
//! Like `cp -a` (GNU coreutils) it keeps file types (directories, regular files, symbolic
//! links, character and block devices, FIFOs, sockets), owners, modes (set-id bits
//! included), access and modification times, extended attributes of every namespace the
//! caller may read (`trusted.overlay.*` marks overlayfs opaque directories; overlay whiteouts
//! are character devices 0:0), hard links within the tree, and holes of sparse files.
//!
//! The source is a sandbox's writable layer or a copy of one: the tenant's, so any entry in
//! it may be a symbolic link (to `/`, to a host file), a FIFO, a socket or a device node, and
//! a tree that is not frozen may change between two calls. Both trees are therefore walked
//! through directory descriptors only, never through a path below the two roots (which are
//! fastbox's own):
//!
//! - every directory is opened from its parent's descriptor with
//!   `O_DIRECTORY | O_NOFOLLOW` and listed from that descriptor;
//! - an entry is looked at with `fstatat(AT_SYMLINK_NOFOLLOW)`; a regular file is then
//!   opened with `O_NOFOLLOW | O_NONBLOCK` (a FIFO swapped in never blocks the open) and must
//!   be the very inode the look showed (same device and inode, still a regular file), and a
//!   directory likewise; anything else is an error, never followed;
//! - symbolic links are read with `readlinkat` and made with `symlinkat`, nodes with
//!   `mknodat` (a FIFO, socket or device of the source is never opened), directories with
//!   `mkdirat`, hard links with `linkat` from the first copy (found again below the target's
//!   root with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`);
//! - owners, modes, times and attributes of files and directories go through the
//!   descriptors the copy opened (`fchown`, `fchmod`, `futimens`, `f*xattr`); those of
//!   symbolic links and nodes through `*at` calls that do not follow (`fchownat`,
//!   `utimensat` with `AT_SYMLINK_NOFOLLOW`) and, for modes and attributes, through
//!   `/proc/self/fd/N` of an `O_PATH | O_NOFOLLOW` descriptor of the entry itself (which
//!   acts on the link or node, not on what a link points at).
//!
//! A directory held open costs two descriptors (source and target) while its subtree is
//! copied, so a tree deeper than [`MAX_DEPTH`] is refused (a path name could not reach that
//! deep either: `PATH_MAX` is 4096 bytes); the walk keeps its own stack, not the thread's.

use std::collections::HashMap;
use std::ffi::{CStr, CString, OsStr};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// The deepest directory nesting copied.
pub const MAX_DEPTH: usize = 2048;
/// The most bytes one read moves.
const BUFFER_BYTES: usize = 256 * 1024;

/// Copies the contents of directory `from` into the existing directory `to` (which gets
/// `from`'s owner, mode, times and attributes too). Both are fastbox's own paths; nothing
/// below them is resolved by path.
pub fn copy_contents(from: &Path, to: &Path) -> io::Result<()> {
    let source = open_root(from)?;
    let target = open_root(to)?;
    let meta = fstat(source.as_raw_fd()).map_err(|e| context(e, "stat", from))?;
    let entries = nix::dir::Dir::from(source)
        .map_err(|e| context(e.into(), "list", from))?
        .into_iter();
    let mut copy = Copy {
        links: HashMap::new(),
        buf: Vec::new(),
        rel: PathBuf::new(),
    };
    copy.walk(Frame {
        entries,
        target,
        meta,
    })
}

/// A directory being copied: its source listing (whose descriptor the entries are reached
/// through), its target and its source's metadata (applied once its entries are in).
struct Frame {
    entries: nix::dir::OwningIter,
    target: OwnedFd,
    meta: libc::stat,
}

struct Copy {
    /// Where the first copy of a file with several links went, relative to the target root.
    links: HashMap<(u64, u64), PathBuf>,
    /// The bytes of regular files pass through here (allocated at the first file).
    buf: Vec<u8>,
    /// The directory being copied, relative to the roots (messages and hard links).
    rel: PathBuf,
}

impl Copy {
    fn walk(&mut self, root: Frame) -> io::Result<()> {
        let target_root = root.target.as_raw_fd();
        let mut stack = vec![root];
        // `stack[0]` holds `target_root` open until the loop ends.
        while let Some(frame) = stack.last_mut() {
            let (source, target) = (frame.entries.as_raw_fd(), frame.target.as_raw_fd());
            match frame.entries.next() {
                None => {
                    let done = stack.pop().expect("a frame");
                    self.finish_fd(done.entries.as_raw_fd(), target, &done.meta)?;
                    self.rel.pop();
                }
                Some(Err(e)) => return Err(self.error(e.into(), "list", None)),
                Some(Ok(entry)) => {
                    let name = entry.file_name();
                    if name == c"." || name == c".." {
                        continue;
                    }
                    if let Some(child) = self.entry(source, target, target_root, name)? {
                        if stack.len() >= MAX_DEPTH {
                            return Err(self.error(
                                io::Error::other(format!("deeper than {MAX_DEPTH} directories")),
                                "copy",
                                None,
                            ));
                        }
                        stack.push(child);
                    }
                }
            }
        }
        Ok(())
    }

    /// Copies entry `name` of the source directory `sdir` into the target directory `tdir`;
    /// a directory is made and opened, and returned to be walked.
    fn entry(
        &mut self,
        sdir: RawFd,
        tdir: RawFd,
        target_root: RawFd,
        name: &CStr,
    ) -> io::Result<Option<Frame>> {
        let st = fstatat(sdir, name).map_err(|e| self.error(e, "stat", Some(name)))?;
        between_steps(Step::Looked, || self.shown(Some(name)));
        let kind = st.st_mode & libc::S_IFMT;
        if kind != libc::S_IFDIR && st.st_nlink > 1 {
            let key = (st.st_dev, st.st_ino);
            if let Some(first) = self.links.get(&key) {
                return link(target_root, first, tdir, name)
                    .map(|()| None)
                    .map_err(|e| self.error(e, "link", Some(name)));
            }
            self.links
                .insert(key, self.rel.join(OsStr::from_bytes(name.to_bytes())));
        }
        match kind {
            libc::S_IFDIR => self
                .dir(sdir, tdir, name, &st)
                .map(Some)
                .map_err(|e| self.error(e, "copy the directory", Some(name))),
            libc::S_IFREG => self
                .file(sdir, tdir, name, &st)
                .map(|()| None)
                .map_err(|e| self.error(e, "copy the file", Some(name))),
            libc::S_IFLNK => self
                .symlink(sdir, tdir, name, &st)
                .map(|()| None)
                .map_err(|e| self.error(e, "copy the symbolic link", Some(name))),
            _ => self
                .node(sdir, tdir, name, &st)
                .map(|()| None)
                .map_err(|e| self.error(e, "copy the node", Some(name))),
        }
    }

    fn dir(&mut self, sdir: RawFd, tdir: RawFd, name: &CStr, st: &libc::stat) -> io::Result<Frame> {
        let source = openat(
            sdir,
            name,
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
        )?;
        let meta = fstat(source.as_raw_fd())?;
        same_inode(st, &meta, libc::S_IFDIR)?;
        // Private until its mode is set, after its entries.
        // SAFETY: mkdirat(2) on our directory descriptor with a NUL-terminated name.
        cvt(unsafe { libc::mkdirat(tdir, name.as_ptr(), 0o700) })?;
        between_steps(Step::Made, || self.shown(Some(name)));
        let target = openat(
            tdir,
            name,
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
        )?;
        let entries = nix::dir::Dir::from(source)?.into_iter();
        self.rel.push(OsStr::from_bytes(name.to_bytes()));
        Ok(Frame {
            entries,
            target,
            meta,
        })
    }

    /// A regular file's bytes (holes kept) and metadata.
    fn file(&mut self, sdir: RawFd, tdir: RawFd, name: &CStr, st: &libc::stat) -> io::Result<()> {
        let source = openat(
            sdir,
            name,
            libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY,
        )?;
        let meta = fstat(source.as_raw_fd())?;
        same_inode(st, &meta, libc::S_IFREG)?;
        // SAFETY: openat(2) on our directory descriptor with a NUL-terminated name.
        let fd = unsafe {
            libc::openat(
                tdir,
                name.as_ptr(),
                libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                0o600 as libc::c_uint,
            )
        };
        // SAFETY: a descriptor just returned by openat(2), owned by nobody else.
        let target = unsafe { OwnedFd::from_raw_fd(cvt(fd)?) };
        self.bytes(source.as_raw_fd(), target.as_raw_fd(), meta.st_size)?;
        self.finish_fd(source.as_raw_fd(), target.as_raw_fd(), &meta)
    }

    /// Bytes `0..len` of `source` into `target`, holes kept.
    fn bytes(&mut self, source: RawFd, target: RawFd, len: i64) -> io::Result<()> {
        let mut at: i64 = 0;
        let mut written_to: i64 = 0;
        while at < len {
            // SAFETY: lseek(2) on a descriptor we hold.
            let data = unsafe { libc::lseek(source, at, libc::SEEK_DATA) };
            if data < 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::ENXIO) {
                    break; // only a hole remains
                }
                return Err(e);
            }
            if data >= len {
                break;
            }
            // SAFETY: as above.
            let hole = cvt_off(unsafe { libc::lseek(source, data, libc::SEEK_HOLE) })?.min(len);
            written_to = self.range(source, target, data, hole)?;
            at = hole;
        }
        if written_to < len {
            // A trailing hole, or a file that shrank meanwhile.
            // SAFETY: ftruncate(2) on a descriptor we hold.
            cvt(unsafe { libc::ftruncate(target, len) })?;
        }
        Ok(())
    }

    /// Bytes `from..to` of `source` at the same offsets of `target`; returns where they
    /// ended (earlier than `to` when the file shrank meanwhile).
    fn range(&mut self, source: RawFd, target: RawFd, from: i64, to: i64) -> io::Result<i64> {
        if self.buf.is_empty() {
            self.buf = vec![0u8; BUFFER_BYTES];
        }
        let mut at = from;
        while at < to {
            let want = self.buf.len().min((to - at) as usize);
            // SAFETY: pread(2) into our buffer of at least `want` bytes.
            let n = unsafe { libc::pread(source, self.buf.as_mut_ptr().cast(), want, at) };
            let n = match n {
                0 => break,
                n if n < 0 => {
                    let e = io::Error::last_os_error();
                    if e.kind() == io::ErrorKind::Interrupted {
                        continue;
                    }
                    return Err(e);
                }
                n => n as usize,
            };
            let mut done = 0;
            while done < n {
                // SAFETY: pwrite(2) of initialized bytes of our buffer.
                let w = unsafe {
                    libc::pwrite(
                        target,
                        self.buf[done..n].as_ptr().cast(),
                        n - done,
                        at + done as i64,
                    )
                };
                if w < 0 {
                    let e = io::Error::last_os_error();
                    if e.kind() == io::ErrorKind::Interrupted {
                        continue;
                    }
                    return Err(e);
                }
                if w == 0 {
                    return Err(io::ErrorKind::WriteZero.into());
                }
                done += w as usize;
            }
            at += n as i64;
        }
        Ok(at)
    }

    fn symlink(
        &mut self,
        sdir: RawFd,
        tdir: RawFd,
        name: &CStr,
        st: &libc::stat,
    ) -> io::Result<()> {
        // The link itself (never what it points at): its target and its attributes.
        let source = openat(sdir, name, libc::O_PATH | libc::O_NOFOLLOW)?;
        let points_to = readlink(source.as_raw_fd())?;
        // SAFETY: symlinkat(2) with NUL-terminated strings on our directory descriptor.
        cvt(unsafe { libc::symlinkat(points_to.as_ptr(), tdir, name.as_ptr()) })?;
        self.finish_at(source.as_raw_fd(), tdir, name, st, false)
    }

    fn node(&mut self, sdir: RawFd, tdir: RawFd, name: &CStr, st: &libc::stat) -> io::Result<()> {
        let kind = st.st_mode & libc::S_IFMT;
        if !matches!(
            kind,
            libc::S_IFCHR | libc::S_IFBLK | libc::S_IFIFO | libc::S_IFSOCK
        ) {
            return Err(io::Error::other(format!("unknown file type {kind:o}")));
        }
        // SAFETY: mknodat(2) on our directory descriptor with a NUL-terminated name.
        cvt(unsafe {
            libc::mknodat(tdir, name.as_ptr(), kind | (st.st_mode & 0o777), st.st_rdev)
        })?;
        let source = openat(sdir, name, libc::O_PATH | libc::O_NOFOLLOW)?;
        self.finish_at(source.as_raw_fd(), tdir, name, st, true)
    }

    /// Owner, then mode (a chown clears set-id bits), attributes and times of `target`, as
    /// `meta` (of `source`) has them: a file or directory, both held open.
    fn finish_fd(&self, source: RawFd, target: RawFd, meta: &libc::stat) -> io::Result<()> {
        // SAFETY: fchown(2) on a descriptor we hold.
        cvt(unsafe { libc::fchown(target, meta.st_uid, meta.st_gid) })?;
        // SAFETY: fchmod(2) on a descriptor we hold.
        cvt(unsafe { libc::fchmod(target, meta.st_mode & 0o7777) })?;
        let names = xattr_buffer(|buf, len| {
            // SAFETY: `buf` has room for `len` bytes.
            unsafe { libc::flistxattr(source, buf, len) }
        })?;
        for name in xattr_names(&names) {
            let value = xattr_buffer(|buf, len| {
                // SAFETY: as above; `name` is NUL-terminated.
                unsafe { libc::fgetxattr(source, name.as_ptr(), buf.cast(), len) }
            })?;
            // SAFETY: `value` holds `value.len()` bytes; `name` is NUL-terminated.
            cvt(unsafe {
                libc::fsetxattr(target, name.as_ptr(), value.as_ptr().cast(), value.len(), 0)
            })
            .map_err(|e| set_xattr_error(e, name))?;
        }
        let times = times(meta);
        // SAFETY: futimens(2) on a descriptor we hold with two timespecs.
        cvt(unsafe { libc::futimens(target, times.as_ptr()) })?;
        Ok(())
    }

    /// [`Copy::finish_fd`] for a symbolic link or node `name` of `tdir` (made by this copy),
    /// whose source is the `O_PATH` descriptor `source`. The mode is set for nodes only
    /// (a link has none of its own).
    fn finish_at(
        &self,
        source: RawFd,
        tdir: RawFd,
        name: &CStr,
        meta: &libc::stat,
        with_mode: bool,
    ) -> io::Result<()> {
        // SAFETY: fchownat(2) on our directory descriptor, not following a link.
        cvt(unsafe {
            libc::fchownat(
                tdir,
                name.as_ptr(),
                meta.st_uid,
                meta.st_gid,
                libc::AT_SYMLINK_NOFOLLOW,
            )
        })?;
        let source_path = proc_path(source);
        let names = xattr_buffer(|buf, len| {
            // SAFETY: `buf` has room for `len` bytes; the path is NUL-terminated. The magic
            // link of an O_PATH descriptor of a link or node leads to that entry itself.
            unsafe { libc::listxattr(source_path.as_ptr(), buf, len) }
        })?;
        // A whiteout (0:0, mode 0) and a node without attributes need nothing more.
        let mode = meta.st_mode & 0o7777;
        let chmod = with_mode && mode != 0;
        if chmod || !names.is_empty() {
            let target = openat(tdir, name, libc::O_PATH | libc::O_NOFOLLOW)?;
            let target_path = proc_path(target.as_raw_fd());
            if chmod {
                // SAFETY: chmod(2) of our own O_PATH descriptor's /proc/self/fd path: the
                // node this copy made (fchmod refuses O_PATH descriptors).
                cvt(unsafe { libc::chmod(target_path.as_ptr(), mode) })?;
            }
            for name in xattr_names(&names) {
                let value = xattr_buffer(|buf, len| {
                    // SAFETY: as above; `name` is NUL-terminated.
                    unsafe { libc::getxattr(source_path.as_ptr(), name.as_ptr(), buf.cast(), len) }
                })?;
                // SAFETY: `value` holds `value.len()` bytes; both strings are NUL-terminated.
                cvt(unsafe {
                    libc::setxattr(
                        target_path.as_ptr(),
                        name.as_ptr(),
                        value.as_ptr().cast(),
                        value.len(),
                        0,
                    )
                })
                .map_err(|e| set_xattr_error(e, name))?;
            }
        }
        let times = times(meta);
        // SAFETY: utimensat(2) on our directory descriptor, not following a link.
        cvt(unsafe {
            libc::utimensat(
                tdir,
                name.as_ptr(),
                times.as_ptr(),
                libc::AT_SYMLINK_NOFOLLOW,
            )
        })?;
        Ok(())
    }

    /// `name` (or the directory itself) relative to the roots, for messages.
    fn shown(&self, name: Option<&CStr>) -> PathBuf {
        match name {
            Some(name) => self.rel.join(OsStr::from_bytes(name.to_bytes())),
            None => self.rel.clone(),
        }
    }

    fn error(&self, e: io::Error, what: &str, name: Option<&CStr>) -> io::Error {
        let shown = self.shown(name);
        let shown = if shown.as_os_str().is_empty() {
            Path::new(".")
        } else {
            &shown
        };
        io::Error::new(e.kind(), format!("{what} {}: {e}", shown.display()))
    }
}

/// A hard link `name` in `tdir` to the file copied first to `first` (relative to the target
/// root), whose directories this copy made: found again without following any link.
fn link(target_root: RawFd, first: &Path, tdir: RawFd, name: &CStr) -> io::Result<()> {
    let file = first.file_name().unwrap_or_default();
    let file = CString::new(file.as_bytes())?;
    let parent = first.parent().filter(|p| !p.as_os_str().is_empty());
    let held;
    let dir = match parent {
        None => target_root,
        Some(parent) => {
            held = openat2_beneath(target_root, parent)?;
            held.as_raw_fd()
        }
    };
    // SAFETY: linkat(2) between two directory descriptors with NUL-terminated names; the
    // last component is not followed (no AT_SYMLINK_FOLLOW).
    cvt(unsafe { libc::linkat(dir, file.as_ptr(), tdir, name.as_ptr(), 0) })?;
    Ok(())
}

/// The directory `rel` below `root`, refusing symbolic links, `..` out of it and mounts.
fn openat2_beneath(root: RawFd, rel: &Path) -> io::Result<OwnedFd> {
    let c = CString::new(rel.as_os_str().as_bytes())?;
    // SAFETY: `open_how` is plain integers; all-zero is its documented default.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) as u64;
    how.resolve = libc::RESOLVE_BENEATH
        | libc::RESOLVE_NO_SYMLINKS
        | libc::RESOLVE_NO_MAGICLINKS
        | libc::RESOLVE_NO_XDEV;
    loop {
        // SAFETY: openat2(2) with a valid C string and an `open_how` of the size passed.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                root,
                c.as_ptr(),
                &how as *const libc::open_how,
                std::mem::size_of::<libc::open_how>(),
            )
        };
        if fd >= 0 {
            // SAFETY: a descriptor just returned by openat2(2).
            return Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) });
        }
        let e = io::Error::last_os_error();
        if !matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EINTR)) {
            return Err(e);
        }
    }
}

/// One of the two roots (fastbox's own directories).
fn open_root(path: &Path) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: open(2) with a NUL-terminated path; the result is checked.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    let fd = cvt(fd).map_err(|e| context(e, "open", path))?;
    // SAFETY: a descriptor just returned by open(2), owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn openat(dir: RawFd, name: &CStr, flags: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: openat(2) on a directory descriptor we hold with a NUL-terminated name.
    let fd = unsafe { libc::openat(dir, name.as_ptr(), flags | libc::O_CLOEXEC) };
    // SAFETY: a descriptor just returned by openat(2), owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(cvt(fd)?) })
}

fn fstatat(dir: RawFd, name: &CStr) -> io::Result<libc::stat> {
    // SAFETY: an all-zero `stat` is a valid value for the call to fill in.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstatat(2) on our directory descriptor into a struct we own.
    cvt(unsafe { libc::fstatat(dir, name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) })?;
    Ok(st)
}

fn fstat(fd: RawFd) -> io::Result<libc::stat> {
    // SAFETY: as in `fstatat`.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat(2) on a descriptor we hold into a struct we own.
    cvt(unsafe { libc::fstat(fd, &mut st) })?;
    Ok(st)
}

/// The entry opened is the one looked at: same device and inode, still of type `kind`.
fn same_inode(looked: &libc::stat, opened: &libc::stat, kind: libc::mode_t) -> io::Result<()> {
    if opened.st_mode & libc::S_IFMT != kind
        || (opened.st_dev, opened.st_ino) != (looked.st_dev, looked.st_ino)
    {
        return Err(io::Error::other("replaced while it was copied"));
    }
    Ok(())
}

/// The target of the symbolic link held by the `O_PATH` descriptor `fd`.
fn readlink(fd: RawFd) -> io::Result<CString> {
    let mut buf = vec![0u8; 256];
    loop {
        // SAFETY: readlinkat(2) with an empty path acts on the O_PATH descriptor's link;
        // `buf` has room for `buf.len()` bytes.
        let n = unsafe { libc::readlinkat(fd, c"".as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        let n = cvt_size(n)?;
        if n < buf.len() {
            buf.truncate(n);
            return Ok(CString::new(buf)?);
        }
        buf.resize(buf.len() * 2, 0);
    }
}

/// `/proc/self/fd/N` of `fd`, NUL-terminated.
fn proc_path(fd: RawFd) -> CString {
    CString::new(format!("/proc/self/fd/{fd}")).expect("no NUL in a /proc path")
}

/// Access and modification times of `meta`, for `utimensat`/`futimens`.
fn times(meta: &libc::stat) -> [libc::timespec; 2] {
    [
        libc::timespec {
            tv_sec: meta.st_atime,
            tv_nsec: meta.st_atime_nsec,
        },
        libc::timespec {
            tv_sec: meta.st_mtime,
            tv_nsec: meta.st_mtime_nsec,
        },
    ]
}

/// The NUL-terminated names of a `*listxattr` answer.
fn xattr_names(names: &[u8]) -> impl Iterator<Item = &CStr> {
    names
        .split_inclusive(|b| *b == 0)
        .filter_map(|n| CStr::from_bytes_with_nul(n).ok())
        .filter(|n| !n.is_empty())
}

fn set_xattr_error(e: io::Error, name: &CStr) -> io::Error {
    io::Error::new(
        e.kind(),
        format!("set {}: {e}", OsStr::from_bytes(name.to_bytes()).display()),
    )
}

/// Calls `get(buffer, len)` (a `*listxattr`/`*getxattr`) with a buffer of the size it asks
/// for; an attribute that grows in between is asked for again.
fn xattr_buffer(get: impl Fn(*mut libc::c_char, usize) -> isize) -> io::Result<Vec<u8>> {
    loop {
        let size = get(std::ptr::null_mut(), 0);
        if size < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ENOTSUP) => Ok(Vec::new()),
                _ => Err(e),
            };
        }
        if size == 0 {
            return Ok(Vec::new());
        }
        let mut buf = vec![0u8; size as usize];
        let got = get(buf.as_mut_ptr().cast(), buf.len());
        if got >= 0 {
            buf.truncate(got as usize);
            return Ok(buf);
        }
        if io::Error::last_os_error().raw_os_error() != Some(libc::ERANGE) {
            return Err(io::Error::last_os_error());
        }
    }
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r)
}

fn cvt_off(r: libc::off_t) -> io::Result<libc::off_t> {
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r)
}

fn cvt_size(r: isize) -> io::Result<usize> {
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r as usize)
}

fn context(e: io::Error, what: &str, path: &Path) -> io::Error {
    io::Error::new(e.kind(), format!("{what} {}: {e}", path.display()))
}

/// Where the walk is, for the test hook: an entry was looked at (`fstatat`) and is about to
/// be opened or read, or a target directory was made and is about to be opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Looked,
    Made,
}

#[cfg(not(test))]
#[inline(always)]
fn between_steps(_: Step, _: impl FnOnce() -> PathBuf) {}

#[cfg(test)]
fn between_steps(step: Step, at: impl FnOnce() -> PathBuf) {
    testing::HOOK.with(|h| {
        if let Some(hook) = h.borrow_mut().as_mut() {
            hook(step, &at())
        }
    })
}

/// The test-only hook called between the steps of the copy (where a racing tenant would
/// swap a name), with the entry's path relative to the roots.
#[cfg(test)]
mod testing {
    use std::cell::RefCell;
    use std::path::Path;

    type Hook = Box<dyn FnMut(super::Step, &Path)>;

    thread_local! {
        pub(super) static HOOK: RefCell<Option<Hook>> = RefCell::new(None);
    }

    /// Runs `f` with `hook` called between the steps of every copy on this thread.
    pub(super) fn between_steps<T>(
        hook: impl FnMut(super::Step, &Path) + 'static,
        f: impl FnOnce() -> T,
    ) -> T {
        HOOK.with(|h| *h.borrow_mut() = Some(Box::new(hook)));
        let out = f();
        HOOK.with(|h| *h.borrow_mut() = None);
        out
    }
}

#[cfg(test)]
mod tests;
