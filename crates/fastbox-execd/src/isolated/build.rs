//! Building a session's namespaces and root, and starting its own execd in them.
//!
//! execd (the parent, multi-threaded) forks a *keeper*. The keeper closes every descriptor it
//! does not need, unshares a user namespace owning new mount, pid, ipc and uts namespaces (and
//! a network namespace unless the session shares the sandbox's); the parent writes its
//! identity uid and gid maps (a uid inside is the same uid in the sandbox, so files keep their
//! owners). The keeper then builds the session's root in a staging tmpfs, which only its
//! mount namespace sees:
//!
//! - the sandbox's `/` with everything mounted in it (`/dev`, `/sys`, volumes), read-only and
//!   `nosuid,nodev`;
//! - fresh tmpfs at `/tmp`, `/var/tmp`, `/run`, `/dev/shm`, a new devpts instance at
//!   `/dev/pts`, and an empty read-only tmpfs over `/.fastbox`;
//! - each workspace and bind, shallow first: `rw` and `ro` are bind mounts of the sandbox's
//!   directory, `overlay` an overlayfs whose upper layer is in the staging tmpfs.
//!
//! Every source and mount point is opened without following symlinks (`openat2` with
//! `RESOLVE_NO_SYMLINKS`; a session may have planted links in a directory it could write) and
//! mounted through its descriptor; a source on `/proc`, `/sys` or a devpts is refused.
//!
//! The keeper forks the session's init (PID 1 of the new pid namespace). The init mounts a
//! read-only `/proc` of its pid namespace with the sandbox's masks (the kernel allows the mount
//! because the sandbox keeps a fully visible one, hidden, at `/.fastbox/iso/proc`), pivots into
//! the root (which detaches the sandbox's tree, the hidden `/proc` with it), drops the
//! capability bounding set and the effective set to the sandbox's, switches to the session's
//! uid and gid, asks for SIGKILL when the keeper dies, stacks the default seccomp filter and
//! executes execd (from a descriptor: the binary is not in the session's root) serving on an
//! inherited Unix socket. The keeper waits for the init; killing the keeper (through its
//! pidfd, so a reused pid is never hit) ends the session.
//!
//! Between `fork` and `exec` only system calls on memory prepared before the fork are made
//! (no allocation, no locks): the parent is multi-threaded. Errors travel back as text with
//! an errno number on a socket pair.

use std::ffi::{CStr, CString};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use fastbox_seccomp::masks::{EMPTY_DIR, MASKED_DIRS, MASKED_FILES};

use super::IsolatedError;
use super::request::{Layout, Mode, PRIVATE_DIRS};
use crate::reaper::{ExitWaiter, Reaper};

/// Where the keeper mounts its staging tmpfs (over the sandbox's cover of the hidden
/// `/proc`; only the session's mount namespace sees it).
const STAGE: &str = "/.fastbox/iso";
/// How long the parent waits for the keeper at each step.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);

const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;
const PROC_SUPER_MAGIC: i64 = 0x9fa0;
const SYSFS_MAGIC: i64 = 0x6265_6572;
const DEVPTS_SUPER_MAGIC: i64 = 0x1cd1;
const RESOLVE_NO_MAGICLINKS: u64 = 0x02;
const RESOLVE_NO_SYMLINKS: u64 = 0x04;
const RESOLVE_BENEATH: u64 = 0x08;

/// A mount operation of the keeper, all strings prepared. `Target`s are relative to the
/// session's root (`STAGE/root`).
enum Op {
    Tmpfs {
        target: CString,
        flags: libc::c_ulong,
        data: CString,
    },
    Devpts {
        target: CString,
    },
    /// A recursive bind of the sandbox's `source` at `target` (made when missing), then
    /// `nosuid,nodev` (and read-only when asked).
    Bind {
        source: CString,
        target: CString,
        read_only: bool,
    },
    /// An overlay of the sandbox's `source` at `target`, its upper layer in `upper`.
    Overlay {
        source: CString,
        target: CString,
        /// `,upperdir=...,workdir=...,userxattr` (the lower directory goes before it).
        rest: CString,
        upper: CString,
        work: CString,
    },
    /// The sandbox's `/`, recursively, at the session's root: read-only and `nosuid` (not
    /// `nodev`: its `/dev` is where the devices are).
    Root,
}

/// What the session's init becomes.
pub struct Exec {
    pub argv: Vec<CString>,
    pub env: Vec<CString>,
    /// The working directory (in the session's root).
    pub cwd: CString,
    /// The listening socket the session's execd serves on (descriptor 3 in it).
    pub listener: OwnedFd,
}

/// Everything the keeper and the init need, prepared before the fork.
struct Plan {
    flags: libc::c_int,
    stage: CString,
    stage_data: CString,
    root: CString,
    ops: Vec<Op>,
    share_net: bool,
    uid: libc::uid_t,
    gid: libc::gid_t,
    /// The capabilities the session's processes keep (execd's own effective set).
    caps: u64,
    cap_last: u32,
    seccomp: &'static fastbox_seccomp::BpfProgram,
    exe: OwnedFd,
    listener: OwnedFd,
    argv_ptrs: Vec<*const libc::c_char>,
    env_ptrs: Vec<*const libc::c_char>,
    cwd: CString,
    proc_dir: CString,
    /// The masks of the session's `/proc` (targets under `STAGE/root`).
    masked_files: Vec<CString>,
    masked_dirs: Vec<CString>,
    dev_null: CString,
    empty_dir: CString,
    // The strings `argv_ptrs` and `env_ptrs` point into.
    _argv: Vec<CString>,
    _env: Vec<CString>,
}

/// A session that is running.
pub struct Built {
    /// The keeper: killing it kills the session (its init has the keeper's death signal).
    pub keeper: OwnedFd,
    /// The keeper's exit, which comes when the session's init is gone.
    pub ended: ExitWaiter,
}

fn c(s: &str) -> Result<CString, IsolatedError> {
    CString::new(s).map_err(|_| IsolatedError::Invalid(format!("NUL byte in {s:?}")))
}

fn setup_err(what: impl std::fmt::Display) -> IsolatedError {
    IsolatedError::Setup(what.to_string())
}

/// `path` (absolute) as a path relative to the session's root.
fn rel(path: &str) -> Result<CString, IsolatedError> {
    c(path.trim_start_matches('/'))
}

/// The mount operations for `layout`, in order.
fn ops_for(layout: &Layout) -> Result<Vec<Op>, IsolatedError> {
    let nosuid_nodev = libc::MS_NOSUID | libc::MS_NODEV;
    let mut ops = vec![
        // Recursive: the kernel refuses to bind a mount alone when mounts it cannot unmount
        // (the sandbox's masks) are on it. The sandbox's own mounts come along read-only; the
        // session's go on top.
        Op::Root,
        Op::Devpts {
            target: rel("/dev/pts")?,
        },
    ];
    for dir in PRIVATE_DIRS {
        // A symlinked one (`/var/tmp -> /tmp`) resolves into the session's own anyway.
        if std::fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir()) {
            let mode = if *dir == "/run" {
                "mode=0755"
            } else {
                "mode=1777"
            };
            ops.push(Op::Tmpfs {
                target: rel(dir)?,
                flags: nosuid_nodev,
                data: c(mode)?,
            });
        }
    }
    ops.push(Op::Tmpfs {
        target: rel("/.fastbox")?,
        flags: nosuid_nodev | libc::MS_NOEXEC | libc::MS_RDONLY,
        data: c("size=4k,mode=0555")?,
    });
    let mut shown: Vec<(usize, &super::request::Shown)> = layout.shown.iter().enumerate().collect();
    shown.sort_by_key(|(_, s)| s.dest.matches('/').count());
    for (i, s) in shown {
        let (source, target) = (c(&s.source)?, rel(&s.dest)?);
        match s.mode {
            Mode::Rw | Mode::Ro => ops.push(Op::Bind {
                source,
                target,
                read_only: s.mode == Mode::Ro,
            }),
            Mode::Overlay => {
                let upper = format!("{STAGE}/upper/{i}");
                ops.push(Op::Overlay {
                    source,
                    target,
                    rest: c(&format!(
                        ",upperdir={upper}/data,workdir={upper}/work,userxattr"
                    ))?,
                    upper: c(&format!("{upper}/data"))?,
                    work: c(&format!("{upper}/work"))?,
                });
            }
        }
    }
    Ok(ops)
}

/// execd's own effective capabilities, from `/proc/self/status`.
fn own_caps() -> Result<u64, IsolatedError> {
    let status = std::fs::read_to_string("/proc/self/status").map_err(setup_err)?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .ok_or_else(|| setup_err("no CapEff in /proc/self/status"))
}

fn cap_last() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(40)
}

/// Builds the session described by `layout` and starts `exec` in it.
pub fn build(reaper: &Reaper, layout: &Layout, exec: Exec) -> Result<Built, IsolatedError> {
    let seccomp = crate::process::stacked_filter().ok_or_else(|| {
        setup_err("execd holds no filter to stack (not started with --isolation)")
    })?;
    let exe = std::fs::File::open("/proc/self/exe")
        .map_err(|e| setup_err(format!("open execd's own binary: {e}")))?;
    let mut flags = libc::CLONE_NEWUSER
        | libc::CLONE_NEWNS
        | libc::CLONE_NEWPID
        | libc::CLONE_NEWIPC
        | libc::CLONE_NEWUTS;
    if !layout.share_net {
        flags |= libc::CLONE_NEWNET;
    }
    let root = format!("{STAGE}/root");
    let mut plan = Plan {
        flags,
        stage: c(STAGE)?,
        stage_data: c("mode=0700")?,
        root: c(&root)?,
        ops: ops_for(layout)?,
        share_net: layout.share_net,
        uid: layout.uid,
        gid: layout.gid,
        caps: own_caps()?,
        cap_last: cap_last(),
        seccomp,
        exe: OwnedFd::from(exe),
        listener: exec.listener,
        argv_ptrs: Vec::new(),
        env_ptrs: Vec::new(),
        cwd: exec.cwd,
        proc_dir: c(&format!("{root}/proc"))?,
        masked_files: MASKED_FILES
            .iter()
            .filter(|p| p.starts_with("/proc/"))
            .map(|p| c(&format!("{root}{p}")))
            .collect::<Result<_, _>>()?,
        masked_dirs: MASKED_DIRS
            .iter()
            .filter(|p| p.starts_with("/proc/"))
            .map(|p| c(&format!("{root}{p}")))
            .collect::<Result<_, _>>()?,
        dev_null: c("/dev/null")?,
        empty_dir: c(EMPTY_DIR)?,
        _argv: exec.argv,
        _env: exec.env,
    };
    plan.argv_ptrs = plan._argv.iter().map(|a| a.as_ptr()).collect();
    plan.argv_ptrs.push(std::ptr::null());
    plan.env_ptrs = plan._env.iter().map(|a| a.as_ptr()).collect();
    plan.env_ptrs.push(std::ptr::null());

    let (mut ctl, child_ctl) = UnixStream::pair().map_err(setup_err)?;
    let mut pidfd: libc::c_int = -1;
    let (keeper_pid, ended) = reaper
        .fork_registered(|| {
            // A fork that also gives the child's pidfd (clone(2) with CLONE_PIDFD; clone3 is
            // ENOSYS under the sandbox's policy), so the keeper is never named by a pid that
            // could be reused.
            // SAFETY: as fork(2): the child only runs `keeper_main`, which makes system calls
            // on the prepared plan and never returns; `pidfd` outlives the call.
            let pid = unsafe {
                libc::syscall(
                    libc::SYS_clone,
                    (libc::CLONE_PIDFD | libc::SIGCHLD) as libc::c_ulong,
                    0usize,
                    &mut pidfd as *mut libc::c_int,
                    0usize,
                    0usize,
                )
            };
            match pid {
                -1 => Err(std::io::Error::last_os_error()),
                0 => keeper_main(&plan, child_ctl.as_raw_fd()),
                pid => Ok(pid as i32),
            }
        })
        .map_err(|e| setup_err(format!("fork: {e}")))?;
    drop(child_ctl);
    // SAFETY: the descriptor CLONE_PIDFD just gave us, ours alone.
    let keeper = unsafe { OwnedFd::from_raw_fd(pidfd) };
    match talk(&mut ctl, keeper_pid) {
        Ok(()) => Ok(Built { keeper, ended }),
        Err(e) => {
            kill(&keeper);
            Err(e)
        }
    }
}

/// SIGKILL to the process behind `pidfd` (nothing when it is gone).
pub fn kill(pidfd: &OwnedFd) {
    // SAFETY: pidfd_send_signal on a pidfd we own; no siginfo.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
}

/// The parent's side: wait for the unshare, write the maps, then read until the keeper and
/// the init have closed their ends (the init's at its exec): `ok` from the keeper, or errors.
fn talk(ctl: &mut UnixStream, keeper: i32) -> Result<(), IsolatedError> {
    ctl.set_read_timeout(Some(STEP_TIMEOUT))
        .map_err(setup_err)?;
    let mut byte = [0u8; 1];
    let first = ctl.read(&mut byte);
    if !matches!(first, Ok(1) if byte[0] == b'U') {
        let mut text = match first {
            Ok(1) => String::from_utf8_lossy(&byte).into_owned(),
            _ => String::new(),
        };
        let _ = ctl.read_to_string(&mut text);
        return Err(setup_err(if text.trim().is_empty() {
            "the session's keeper ended before its namespaces were made".to_string()
        } else {
            text.trim().to_string()
        }));
    }
    for (file, line) in [
        ("uid_map", "0 0 4294967295\n"),
        ("gid_map", "0 0 4294967295\n"),
    ] {
        std::fs::write(format!("/proc/{keeper}/{file}"), line)
            .map_err(|e| setup_err(format!("write the session's {file}: {e}")))?;
    }
    ctl.write_all(b"M").map_err(setup_err)?;
    let mut text = String::new();
    ctl.read_to_string(&mut text).map_err(|e| {
        setup_err(format!(
            "the session did not start within {STEP_TIMEOUT:?}: {e}"
        ))
    })?;
    let errors: Vec<&str> = text
        .lines()
        .filter(|l| *l != "ok" && !l.trim().is_empty())
        .collect();
    match (errors.is_empty(), text.lines().any(|l| l == "ok")) {
        (true, true) => Ok(()),
        (false, _) => Err(setup_err(errors.join("; "))),
        (true, false) => Err(setup_err(
            "the session's keeper ended without starting the session",
        )),
    }
}

// ---- after the fork: system calls on prepared memory only ----

/// A few errno names for messages (strerror may take locks).
fn errno_name(errno: i32) -> &'static [u8] {
    match errno {
        libc::EPERM => b"EPERM",
        libc::ENOENT => b"ENOENT (no such file or directory)",
        libc::EACCES => b"EACCES",
        libc::EEXIST => b"EEXIST",
        libc::ENOTDIR => b"ENOTDIR (not a directory)",
        libc::EINVAL => b"EINVAL",
        libc::EROFS => b"EROFS (read-only file system)",
        libc::ELOOP => b"ELOOP (a symlink on the way, which is not followed)",
        libc::EXDEV => b"EXDEV",
        libc::ENOSPC => b"ENOSPC",
        libc::ENOMEM => b"ENOMEM",
        libc::EBUSY => b"EBUSY",
        _ => b"",
    }
}

/// Decimal digits of `v` into `buf`; returns them.
fn decimal(mut v: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    &buf[i..]
}

/// Writes `parts` and `errno` (when non-zero) as one line to `fd`.
fn report(fd: RawFd, parts: &[&[u8]], errno: i32) {
    let mut buf = [0u8; 1024];
    let mut n = 0;
    let mut push = |bytes: &[u8]| {
        for &b in bytes {
            if n < buf.len() - 1 {
                buf[n] = b;
                n += 1;
            }
        }
    };
    for p in parts {
        push(p);
    }
    if errno != 0 {
        let mut digits = [0u8; 20];
        push(b": errno ");
        push(decimal(errno.unsigned_abs().into(), &mut digits));
        push(b" ");
        push(errno_name(errno));
    }
    push(b"\n");
    // SAFETY: writing our own buffer to a descriptor we hold.
    unsafe { libc::write(fd, buf.as_ptr().cast(), n) };
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn fail(fd: RawFd, what: &[u8], path: Option<&CStr>) -> ! {
    let e = errno();
    match path.map(CStr::to_bytes) {
        Some(p) if p.starts_with(b"/") => report(fd, &[what, b" ", p], e),
        Some(p) => report(fd, &[what, b" /", p], e),
        None => report(fd, &[what], e),
    }
    // SAFETY: _exit is always safe.
    unsafe { libc::_exit(1) }
}

/// `/proc/self/fd/N` of `fd`, NUL-terminated in `buf`.
fn fd_path(fd: RawFd, buf: &mut [u8; 40]) -> *const libc::c_char {
    let prefix = b"/proc/self/fd/";
    buf[..prefix.len()].copy_from_slice(prefix);
    let mut digits = [0u8; 20];
    let d = decimal(fd as u64, &mut digits);
    buf[prefix.len()..prefix.len() + d.len()].copy_from_slice(d);
    buf[prefix.len() + d.len()] = 0;
    buf.as_ptr().cast()
}

#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

fn openat2(dir: RawFd, path: *const libc::c_char, flags: libc::c_int, resolve: u64) -> RawFd {
    let how = OpenHow {
        flags: (flags | libc::O_CLOEXEC) as u64,
        mode: 0,
        resolve,
    };
    // SAFETY: a NUL-terminated path and an open_how of the size passed.
    unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir,
            path,
            &how,
            std::mem::size_of::<OpenHow>(),
        ) as RawFd
    }
}

/// Opens the sandbox's `source` without following symlinks, refusing `/proc`, `/sys` and
/// devpts file systems: a session must not get the sandbox's processes or kernel files.
fn open_source(source: &CStr) -> Result<(RawFd, bool), &'static [u8]> {
    let fd = openat2(
        libc::AT_FDCWD,
        source.as_ptr(),
        libc::O_PATH,
        RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS,
    );
    if fd < 0 {
        return Err(b"open the bind source");
    }
    // SAFETY: fstatfs and fstat write into zeroed structs we own.
    let (fs, st) = unsafe {
        let mut fs: libc::statfs = std::mem::zeroed();
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstatfs(fd, &mut fs) != 0 || libc::fstat(fd, &mut st) != 0 {
            libc::close(fd);
            return Err(b"inspect the bind source");
        }
        (fs, st)
    };
    // `f_type`'s C type differs between architectures.
    #[allow(clippy::unnecessary_cast)]
    let kind = fs.f_type as i64;
    if kind == PROC_SUPER_MAGIC || kind == SYSFS_MAGIC || kind == DEVPTS_SUPER_MAGIC {
        // SAFETY: closing our own descriptor.
        unsafe { libc::close(fd) };
        // SAFETY: setting errno for the report.
        unsafe { *libc::__errno_location() = libc::EPERM };
        return Err(b"refuse a bind source on /proc, /sys or devpts");
    }
    Ok((fd, st.st_mode & libc::S_IFMT == libc::S_IFDIR))
}

/// Opens `target` (relative, components separated by `/`) under `root`, making missing
/// directories (or, for a file, the last component as an empty file) when `create`; a
/// symlink on the way fails (ELOOP), and nothing resolves outside `root`.
fn open_target(root: RawFd, target: &CStr, dir: bool, create: bool) -> RawFd {
    let bytes = target.to_bytes();
    let mut buf = [0u8; 2048];
    if bytes.len() >= buf.len() {
        return -1;
    }
    buf[..bytes.len()].copy_from_slice(bytes);
    // SAFETY: dup of a descriptor we hold.
    let mut cur = unsafe { libc::fcntl(root, libc::F_DUPFD_CLOEXEC, 0) };
    let mut start = 0;
    while start < bytes.len() && cur >= 0 {
        let end = bytes[start..]
            .iter()
            .position(|&b| b == b'/')
            .map_or(bytes.len(), |i| start + i);
        let last = end == bytes.len();
        buf[end] = 0;
        let name: *const libc::c_char = buf[start..].as_ptr().cast();
        // SAFETY: `name` is NUL-terminated at `end`; `cur` is a directory we hold. Nothing
        // that exists is opened for writing (a FIFO would block).
        unsafe {
            if create && (dir || !last) {
                libc::mkdirat(cur, name, 0o755);
            } else if create {
                libc::mknodat(cur, name, libc::S_IFREG | 0o644, 0);
            }
        }
        let flags = if dir || !last {
            libc::O_PATH | libc::O_DIRECTORY
        } else {
            libc::O_PATH
        };
        let next = openat2(
            cur,
            name,
            flags | libc::O_NOFOLLOW,
            RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH,
        );
        let saved = errno();
        // SAFETY: closing the directory we walked through.
        unsafe { libc::close(cur) };
        // SAFETY: keeping the errno of the open for the report.
        unsafe { *libc::__errno_location() = saved };
        cur = next;
        buf[end] = b'/';
        start = end + 1;
    }
    cur
}

/// Sets `attr` (`MOUNT_ATTR_*`) on the mount at `path` and every mount below it.
fn set_tree_attr(path: *const libc::c_char, attr_set: u64) -> libc::c_long {
    #[repr(C)]
    struct MountAttr {
        attr_set: u64,
        attr_clr: u64,
        propagation: u64,
        userns_fd: u64,
    }
    let attr = MountAttr {
        attr_set,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    // SAFETY: a NUL-terminated path and a mount_attr of the size passed.
    unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            path,
            libc::AT_RECURSIVE as libc::c_uint,
            &attr,
            std::mem::size_of::<MountAttr>(),
        )
    }
}

/// Brings the new network namespace's loopback up.
fn loopback_up() -> libc::c_int {
    // SAFETY: a socket, an ioctl on a zeroed ifreq naming "lo", a close.
    unsafe {
        let s = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if s < 0 {
            return -1;
        }
        let mut req: libc::ifreq = std::mem::zeroed();
        req.ifr_name[0] = b'l' as libc::c_char;
        req.ifr_name[1] = b'o' as libc::c_char;
        req.ifr_ifru.ifru_flags = (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
        let rc = libc::ioctl(s, libc::SIOCSIFFLAGS, &req);
        libc::close(s);
        rc
    }
}

/// Closes every descriptor but 0-2 and `keep` (the keeper holds nothing of execd's: client
/// connections, PTY masters, other commands' pipes).
fn close_all_but(keep: [RawFd; 3]) {
    let mut keep = keep;
    keep.sort_unstable();
    let mut from: u32 = 3;
    for fd in keep {
        let fd = fd as u32;
        if fd > from {
            // SAFETY: close_range only closes descriptors.
            unsafe { libc::syscall(libc::SYS_close_range, from, fd - 1, 0u32) };
        }
        from = from.max(fd + 1);
    }
    // SAFETY: close_range only closes descriptors.
    unsafe { libc::syscall(libc::SYS_close_range, from, u32::MAX, 0u32) };
}

/// Runs one mount operation under the session's root (`root`, opened from `root_path`);
/// `Err` names what failed (errno is set).
fn run_op<'a>(
    root: RawFd,
    root_path: &CStr,
    op: &'a Op,
) -> Result<(), (&'static [u8], Option<&'a CStr>)> {
    let mut tbuf = [0u8; 40];
    let mut sbuf = [0u8; 40];
    let null = std::ptr::null::<libc::c_char>();
    // SAFETY: every pointer below is NUL-terminated prepared data, a path buffer on this
    // stack, or NULL where mount(2) allows it.
    unsafe {
        match op {
            Op::Tmpfs {
                target,
                flags,
                data,
            } => {
                let t = open_target(root, target, true, true);
                if t < 0 {
                    return Err((b"make the mount point", Some(target)));
                }
                let rc = libc::mount(
                    c"tmpfs".as_ptr(),
                    fd_path(t, &mut tbuf),
                    c"tmpfs".as_ptr(),
                    *flags,
                    data.as_ptr().cast(),
                );
                libc::close(t);
                if rc != 0 {
                    return Err((b"mount a tmpfs at", Some(target)));
                }
            }
            Op::Devpts { target } => {
                let t = open_target(root, target, true, true);
                if t < 0
                    || libc::mount(
                        c"devpts".as_ptr(),
                        fd_path(t, &mut tbuf),
                        c"devpts".as_ptr(),
                        libc::MS_NOSUID | libc::MS_NOEXEC,
                        c"newinstance,ptmxmode=0666,mode=0620".as_ptr().cast(),
                    ) != 0
                {
                    return Err((b"mount devpts at", Some(target)));
                }
                libc::close(t);
            }
            Op::Root => {
                let (src, _) = open_source(c"/").map_err(|w| (w, None))?;
                let rc = libc::mount(
                    fd_path(src, &mut sbuf),
                    root_path.as_ptr(),
                    null,
                    libc::MS_BIND | libc::MS_REC,
                    null.cast(),
                );
                libc::close(src);
                if rc != 0
                    || set_tree_attr(root_path.as_ptr(), MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID) != 0
                {
                    return Err((b"bind the sandbox's root read-only", None));
                }
            }
            Op::Bind {
                source,
                target,
                read_only,
            } => {
                let (s, is_dir) = open_source(source).map_err(|w| (w, Some(source.as_c_str())))?;
                let t = open_target(root, target, is_dir, true);
                if t < 0 {
                    let e = errno();
                    libc::close(s);
                    *libc::__errno_location() = e;
                    return Err((b"make the mount point", Some(target)));
                }
                let rc = libc::mount(
                    fd_path(s, &mut sbuf),
                    fd_path(t, &mut tbuf),
                    null,
                    libc::MS_BIND | libc::MS_REC,
                    null.cast(),
                );
                libc::close(s);
                libc::close(t);
                if rc != 0 {
                    return Err((b"bind", Some(source)));
                }
                // Opened again: the descriptor from before the mount names what it covers.
                let t = open_target(root, target, is_dir, false);
                if t < 0 {
                    return Err((b"open the mount", Some(target)));
                }
                let attrs = MOUNT_ATTR_NOSUID
                    | MOUNT_ATTR_NODEV
                    | if *read_only { MOUNT_ATTR_RDONLY } else { 0 };
                let rc = set_tree_attr(fd_path(t, &mut tbuf), attrs);
                libc::close(t);
                if rc != 0 {
                    return Err((b"set nosuid,nodev (read-only) on", Some(target)));
                }
            }
            Op::Overlay {
                source,
                target,
                rest,
                upper,
                work,
            } => {
                let (s, is_dir) = open_source(source).map_err(|w| (w, Some(source.as_c_str())))?;
                if !is_dir {
                    libc::close(s);
                    *libc::__errno_location() = libc::ENOTDIR;
                    return Err((b"overlay", Some(source)));
                }
                mkdir_all(upper);
                mkdir_all(work);
                let t = open_target(root, target, true, true);
                if t < 0 {
                    let e = errno();
                    libc::close(s);
                    *libc::__errno_location() = e;
                    return Err((b"make the mount point", Some(target)));
                }
                // "lowerdir=/proc/self/fd/N" + rest.
                let mut data = [0u8; 4096];
                let mut n = 0;
                let lower = fd_path(s, &mut sbuf);
                let lower = CStr::from_ptr(lower).to_bytes();
                for part in [b"lowerdir=".as_slice(), lower, rest.to_bytes()] {
                    if n + part.len() >= data.len() {
                        break;
                    }
                    data[n..n + part.len()].copy_from_slice(part);
                    n += part.len();
                }
                data[n] = 0;
                let rc = libc::mount(
                    c"overlay".as_ptr(),
                    fd_path(t, &mut tbuf),
                    c"overlay".as_ptr(),
                    libc::MS_NOSUID | libc::MS_NODEV,
                    data.as_ptr().cast(),
                );
                libc::close(s);
                libc::close(t);
                if rc != 0 {
                    return Err((b"mount an overlay of", Some(source)));
                }
            }
        }
    }
    Ok(())
}

/// `mkdir -p` of a prepared absolute path in the staging tmpfs (fastbox's own names).
fn mkdir_all(path: &CStr) {
    let bytes = path.to_bytes();
    let mut buf = [0u8; 512];
    if bytes.len() >= buf.len() {
        return;
    }
    buf[..bytes.len()].copy_from_slice(bytes);
    for i in 1..=bytes.len() {
        if i == bytes.len() || buf[i] == b'/' {
            let saved = buf[i];
            buf[i] = 0;
            // SAFETY: `buf` is NUL-terminated at `i`.
            unsafe { libc::mkdir(buf.as_ptr().cast(), 0o755) };
            buf[i] = saved;
        }
    }
}

fn keeper_main(plan: &Plan, ctl: RawFd) -> ! {
    close_all_but([ctl, plan.exe.as_raw_fd(), plan.listener.as_raw_fd()]);
    // SAFETY: the whole function makes system calls on memory prepared before the fork.
    unsafe {
        if libc::unshare(plan.flags) != 0 {
            fail(ctl, b"unshare the session's namespaces", None);
        }
        if libc::write(ctl, b"U".as_ptr().cast(), 1) != 1 {
            libc::_exit(1);
        }
        let mut byte = 0u8;
        if libc::read(ctl, (&mut byte as *mut u8).cast(), 1) != 1 || byte != b'M' {
            libc::_exit(1);
        }
        if libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ) != 0
        {
            fail(ctl, b"make the mounts private", None);
        }
        if libc::mount(
            c"tmpfs".as_ptr(),
            plan.stage.as_ptr(),
            c"tmpfs".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            plan.stage_data.as_ptr().cast(),
        ) != 0
        {
            fail(ctl, b"mount the staging tmpfs", None);
        }
        mkdir_all(&plan.root);
        let open_root = || {
            let root = openat2(
                libc::AT_FDCWD,
                plan.root.as_ptr(),
                libc::O_PATH | libc::O_DIRECTORY,
                RESOLVE_NO_SYMLINKS,
            );
            if root < 0 {
                fail(ctl, b"open the session's root", None);
            }
            root
        };
        // The root bind comes first; what follows is opened in it.
        let mut root = open_root();
        for op in &plan.ops {
            if let Err((what, path)) = run_op(root, &plan.root, op) {
                fail(ctl, what, path);
            }
            if let Op::Root = op {
                // Reopen the root: the bind is now mounted on it.
                libc::close(root);
                root = open_root();
            }
        }
        libc::close(root);
        // The init watches it: a keeper that dies before the init's death signal is set
        // still takes the init with it.
        let keeper = libc::syscall(libc::SYS_pidfd_open, libc::getpid(), 0) as RawFd;
        if keeper < 0 {
            fail(ctl, b"open the keeper's pidfd", None);
        }
        match libc::fork() {
            -1 => fail(ctl, b"fork the session's init", None),
            0 => init_main(plan, ctl, keeper),
            pid => {
                report(ctl, &[b"ok"], 0);
                libc::close(ctl);
                let mut status = 0;
                while libc::waitpid(pid, &mut status, 0) < 0 && errno() == libc::EINTR {}
                let code = if libc::WIFEXITED(status) {
                    libc::WEXITSTATUS(status)
                } else {
                    128 + libc::WTERMSIG(status)
                };
                libc::_exit(code)
            }
        }
    }
}

fn init_main(plan: &Plan, ctl: RawFd, keeper: RawFd) -> ! {
    // SAFETY: the whole function makes system calls on memory prepared before the fork.
    unsafe {
        // Before the pivot: the kernel lets this namespace mount a /proc only while a fully
        // visible one (the sandbox's hidden one) is in it, and the pivot detaches that.
        if libc::mount(
            c"proc".as_ptr(),
            plan.proc_dir.as_ptr(),
            c"proc".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC | libc::MS_RDONLY,
            std::ptr::null(),
        ) != 0
        {
            fail(ctl, b"mount the session's /proc", None);
        }
        // The sandbox's masks, on the session's /proc too.
        for file in &plan.masked_files {
            if libc::access(file.as_ptr(), libc::F_OK) == 0
                && libc::mount(
                    plan.dev_null.as_ptr(),
                    file.as_ptr(),
                    std::ptr::null(),
                    libc::MS_BIND,
                    std::ptr::null(),
                ) != 0
            {
                fail(ctl, b"mask", Some(file));
            }
        }
        for dir in &plan.masked_dirs {
            if libc::access(dir.as_ptr(), libc::F_OK) == 0
                && (libc::mount(
                    plan.empty_dir.as_ptr(),
                    dir.as_ptr(),
                    std::ptr::null(),
                    libc::MS_BIND,
                    std::ptr::null(),
                ) != 0
                    || set_tree_attr(dir.as_ptr(), MOUNT_ATTR_RDONLY) != 0)
            {
                fail(ctl, b"mask", Some(dir));
            }
        }
        let dot = c".".as_ptr();
        if libc::chdir(plan.root.as_ptr()) != 0
            || libc::syscall(libc::SYS_pivot_root, dot, dot) != 0
            || libc::umount2(dot, libc::MNT_DETACH) != 0
            || libc::chdir(c"/".as_ptr()) != 0
        {
            fail(ctl, b"pivot into the session's root", None);
        }
        if !plan.share_net && loopback_up() != 0 {
            fail(ctl, b"bring the session's loopback up", None);
        }
        for cap in 0..=plan.cap_last {
            if plan.caps & (1u64 << cap) == 0
                && libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) != 0
            {
                fail(ctl, b"drop a capability from the bounding set", None);
            }
        }
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        );
        let groups = [plan.gid];
        if libc::setgroups(1, groups.as_ptr()) != 0
            || libc::setresgid(plan.gid, plan.gid, plan.gid) != 0
            || libc::setresuid(plan.uid, plan.uid, plan.uid) != 0
        {
            fail(ctl, b"switch to the session's uid and gid", None);
        }
        if plan.uid == 0 {
            // Root of the session keeps the sandbox's capabilities (of the session's user
            // namespace), not the full set the namespace's creator has.
            #[repr(C)]
            struct Header {
                version: u32,
                pid: i32,
            }
            #[repr(C)]
            struct Data {
                effective: u32,
                permitted: u32,
                inheritable: u32,
            }
            let header = Header {
                version: 0x2008_0522, // _LINUX_CAPABILITY_VERSION_3
                pid: 0,
            };
            let (lo, hi) = (plan.caps as u32, (plan.caps >> 32) as u32);
            let data = [
                Data {
                    effective: lo,
                    permitted: lo,
                    inheritable: 0,
                },
                Data {
                    effective: hi,
                    permitted: hi,
                    inheritable: 0,
                },
            ];
            if libc::syscall(libc::SYS_capset, &header, data.as_ptr()) != 0 {
                fail(ctl, b"set the session's capabilities", None);
            }
        }
        if libc::chdir(plan.cwd.as_ptr()) != 0 {
            libc::chdir(c"/".as_ptr());
        }
        // After the uid switch, which clears it: the session dies with its keeper.
        if libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        ) != 0
        {
            fail(ctl, b"set the parent-death signal", None);
        }
        let mut watch = libc::pollfd {
            fd: keeper,
            events: libc::POLLIN,
            revents: 0,
        };
        if libc::poll(&mut watch, 1, 0) != 0 {
            // The keeper is gone (or cannot be watched): no session without it.
            libc::_exit(1);
        }
        // The listener becomes descriptor 3; everything else closes at exec.
        let exe = libc::fcntl(plan.exe.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 10);
        let report_fd = libc::fcntl(ctl, libc::F_DUPFD_CLOEXEC, 10);
        let listener = plan.listener.as_raw_fd();
        let placed = if listener == 3 {
            libc::fcntl(3, libc::F_SETFD, 0)
        } else {
            libc::dup2(listener, 3)
        };
        if exe < 0 || report_fd < 0 || placed < 0 {
            fail(ctl, b"arrange the session's descriptors", None);
        }
        if libc::syscall(
            libc::SYS_close_range,
            4u32,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        ) != 0
        {
            fail(report_fd, b"mark descriptors close-on-exec", None);
        }
        if fastbox_seccomp::install(plan.seccomp).is_err() {
            fail(report_fd, b"stack the default seccomp filter", None);
        }
        libc::syscall(
            libc::SYS_execveat,
            exe,
            c"".as_ptr(),
            plan.argv_ptrs.as_ptr(),
            plan.env_ptrs.as_ptr(),
            libc::AT_EMPTY_PATH,
        );
        fail(report_fd, b"exec the session's execd", None)
    }
}
