//! Building a session's namespaces and root, and starting its own execd in them.
//!
//! execd (the parent, multi-threaded) forks a *keeper*. The keeper unshares a user namespace
//! owning new mount, pid, ipc and uts namespaces (and a network namespace unless the session
//! shares the sandbox's); the parent writes its identity uid and gid maps (a uid inside is the
//! same uid in the sandbox, so files keep their owners). The keeper then builds the session's
//! root in a staging tmpfs, which only its mount namespace sees:
//!
//! - the sandbox's `/` with everything mounted in it (`/dev`, `/sys`, volumes), read-only;
//! - a new devpts instance at `/dev/pts`, a new `/proc` (below);
//! - fresh tmpfs at `/tmp`, `/var/tmp`, `/run`, `/dev/shm`, and an empty read-only one over
//!   `/.fastbox`;
//! - each workspace and bind, shallow first: `rw` and `ro` are bind mounts of the sandbox's
//!   directory, `overlay` an overlayfs whose upper layer is in the staging tmpfs;
//!
//! and forks the session's init (PID 1 of the new pid namespace). The init mounts a read-only
//! `/proc` of its pid namespace (the kernel allows it because the sandbox keeps a fully
//! visible one, hidden, at `/.fastbox/iso/proc`), pivots into the root (which detaches the
//! sandbox's tree, the hidden `/proc` with it), drops the capability bounding
//! set and the effective set to the sandbox's, switches to the session's uid and gid, stacks
//! the default seccomp filter and executes execd (from a descriptor: the binary is not in the
//! session's root) serving on an inherited Unix socket. The keeper waits for the init and exits
//! with its status; killing the init ends the session (its pid namespace goes with it).
//!
//! Between `fork` and `exec` only system calls on memory prepared before the fork are made
//! (no allocation, no locks): the parent is multi-threaded. Errors travel back as text on a
//! socket pair.

use std::ffi::{CStr, CString};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use super::IsolatedError;
use super::request::{Layout, Mode, PRIVATE_DIRS};
use crate::reaper::{ExitWaiter, Reaper};

/// Where the keeper mounts its staging tmpfs (over the sandbox's cover of the hidden
/// `/proc`; only the session's mount namespace sees it).
const STAGE: &str = "/.fastbox/iso";
const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;
/// How long the parent waits for the keeper at each step.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);

/// A mount operation of the keeper, all strings prepared.
enum Op {
    /// `mkdir -p` of the path's missing parents and itself (failures ignored: the mount
    /// that follows reports a missing mount point).
    MkdirAll(CString),
    Mount {
        source: Option<CString>,
        target: CString,
        fstype: Option<CString>,
        flags: libc::c_ulong,
        data: Option<CString>,
    },
    /// Make the mount at the path and every mount below it read-only.
    ReadOnly(CString),
    /// Make the mount at the path and every mount below it `nosuid,nodev`.
    NoSuidNoDev(CString),
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
    ops: Vec<Op>,
    new_root: CString,
    share_net: bool,
    uid: libc::uid_t,
    gid: libc::gid_t,
    /// The capabilities the session's processes keep (execd's own effective set).
    caps: u64,
    cap_last: u32,
    seccomp: &'static fastbox_seccomp::BpfProgram,
    exe: OwnedFd,
    listener: OwnedFd,
    argv: Vec<CString>,
    argv_ptrs: Vec<*const libc::c_char>,
    env: Vec<CString>,
    env_ptrs: Vec<*const libc::c_char>,
    cwd: CString,
    proc_dir: CString,
}

/// A session that is running: its init's pid (in execd's pid namespace) and the keeper's
/// exit, which comes when the init is gone.
pub struct Built {
    pub init_pid: i32,
    pub keeper: ExitWaiter,
}

fn c(s: &str) -> Result<CString, IsolatedError> {
    CString::new(s).map_err(|_| IsolatedError::Invalid(format!("NUL byte in {s:?}")))
}

fn setup_err(what: impl std::fmt::Display) -> IsolatedError {
    IsolatedError::Setup(what.to_string())
}

/// The mount operations for `layout`, in order.
fn ops_for(layout: &Layout) -> Result<Vec<Op>, IsolatedError> {
    let root = format!("{STAGE}/root");
    let at = |p: &str| c(&format!("{root}{p}"));
    let mount =
        |source: Option<&str>, target: CString, fstype: Option<&str>, flags, data: Option<&str>| {
            Ok::<_, IsolatedError>(Op::Mount {
                source: source.map(c).transpose()?,
                target,
                fstype: fstype.map(c).transpose()?,
                flags,
                data: data.map(c).transpose()?,
            })
        };
    let nosuid_nodev = libc::MS_NOSUID | libc::MS_NODEV;
    let mut ops = vec![
        mount(None, c("/")?, None, libc::MS_REC | libc::MS_PRIVATE, None)?,
        mount(
            Some("tmpfs"),
            c(STAGE)?,
            Some("tmpfs"),
            nosuid_nodev,
            Some("mode=0700"),
        )?,
        Op::MkdirAll(c(&root)?),
        Op::MkdirAll(c(&format!("{STAGE}/upper"))?),
        // Recursive: the kernel refuses to bind a mount alone when mounts it cannot unmount
        // (the sandbox's masks) are on it. Its sandbox-made mounts (/proc, /dev, /sys,
        // volumes) come along read-only; the session's own go on top.
        mount(
            Some("/"),
            c(&root)?,
            None,
            libc::MS_BIND | libc::MS_REC,
            None,
        )?,
        Op::ReadOnly(c(&root)?),
        mount(
            Some("devpts"),
            at("/dev/pts")?,
            Some("devpts"),
            libc::MS_NOSUID | libc::MS_NOEXEC,
            Some("newinstance,ptmxmode=0666,mode=0620"),
        )?,
    ];
    for dir in PRIVATE_DIRS {
        if std::path::Path::new(dir).is_dir() {
            let mode = if *dir == "/run" {
                "mode=0755"
            } else {
                "mode=1777"
            };
            ops.push(mount(
                Some("tmpfs"),
                at(dir)?,
                Some("tmpfs"),
                nosuid_nodev,
                Some(mode),
            )?);
        }
    }
    ops.push(mount(
        Some("tmpfs"),
        at("/.fastbox")?,
        Some("tmpfs"),
        nosuid_nodev | libc::MS_NOEXEC | libc::MS_RDONLY,
        Some("size=4k,mode=0555"),
    )?);
    let mut shown: Vec<(usize, &super::request::Shown)> = layout.shown.iter().enumerate().collect();
    shown.sort_by_key(|(_, s)| s.dest.matches('/').count());
    for (i, s) in shown {
        let target = at(&s.dest)?;
        ops.push(Op::MkdirAll(target.clone()));
        match s.mode {
            Mode::Rw | Mode::Ro => {
                ops.push(mount(
                    Some(&s.source),
                    target.clone(),
                    None,
                    libc::MS_BIND | libc::MS_REC,
                    None,
                )?);
                ops.push(Op::NoSuidNoDev(target.clone()));
                if s.mode == Mode::Ro {
                    ops.push(Op::ReadOnly(target));
                }
            }
            Mode::Overlay => {
                let upper = format!("{STAGE}/upper/{i}");
                ops.push(Op::MkdirAll(c(&format!("{upper}/data"))?));
                ops.push(Op::MkdirAll(c(&format!("{upper}/work"))?));
                ops.push(mount(
                    Some("overlay"),
                    target,
                    Some("overlay"),
                    nosuid_nodev,
                    Some(&format!(
                        "lowerdir={},upperdir={upper}/data,workdir={upper}/work,userxattr",
                        s.source
                    )),
                )?);
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
    let mut plan = Plan {
        flags,
        ops: ops_for(layout)?,
        new_root: c(&format!("{STAGE}/root"))?,
        share_net: layout.share_net,
        uid: layout.uid,
        gid: layout.gid,
        caps: own_caps()?,
        cap_last: cap_last(),
        seccomp,
        exe: OwnedFd::from(exe),
        listener: exec.listener,
        argv: exec.argv,
        argv_ptrs: Vec::new(),
        env: exec.env,
        env_ptrs: Vec::new(),
        cwd: exec.cwd,
        proc_dir: c(&format!("{STAGE}/root/proc"))?,
    };
    plan.argv_ptrs = plan.argv.iter().map(|a| a.as_ptr()).collect();
    plan.argv_ptrs.push(std::ptr::null());
    plan.env_ptrs = plan.env.iter().map(|a| a.as_ptr()).collect();
    plan.env_ptrs.push(std::ptr::null());

    let (mut ctl, child_ctl) = UnixStream::pair().map_err(setup_err)?;
    let (keeper_pid, keeper) = reaper
        .fork_registered(|| {
            // SAFETY: the child only runs `keeper_main`, which makes system calls on the
            // prepared plan and never returns.
            match unsafe { libc::fork() } {
                -1 => Err(std::io::Error::last_os_error()),
                0 => keeper_main(&plan, child_ctl.as_raw_fd()),
                pid => Ok(pid),
            }
        })
        .map_err(|e| setup_err(format!("fork: {e}")))?;
    drop(child_ctl);
    let kill_keeper = || {
        // SAFETY: plain kill of our own child.
        unsafe { libc::kill(keeper_pid, libc::SIGKILL) };
    };
    let result = talk(&mut ctl, keeper_pid);
    match result {
        Ok(init_pid) => Ok(Built { init_pid, keeper }),
        Err(e) => {
            kill_keeper();
            Err(e)
        }
    }
}

/// The parent's side: wait for the unshare, write the maps, then read the init's pid (or an
/// error) until the keeper and the init have closed their ends (the init's at its exec).
fn talk(ctl: &mut UnixStream, keeper: i32) -> Result<i32, IsolatedError> {
    ctl.set_read_timeout(Some(STEP_TIMEOUT))
        .map_err(setup_err)?;
    let mut byte = [0u8; 1];
    let mut text = String::new();
    match ctl.read(&mut byte) {
        Ok(1) if byte[0] == b'U' => {}
        _ => {
            let _ = ctl.read_to_string(&mut text);
            return Err(setup_err(if text.is_empty() {
                "the session's keeper ended before its namespaces were made".to_string()
            } else {
                text
            }));
        }
    }
    for (file, line) in [
        ("uid_map", "0 0 4294967295\n"),
        ("gid_map", "0 0 4294967295\n"),
    ] {
        std::fs::write(format!("/proc/{keeper}/{file}"), line)
            .map_err(|e| setup_err(format!("write the session's {file}: {e}")))?;
    }
    ctl.write_all(b"M").map_err(setup_err)?;
    let _ = ctl.read_to_string(&mut text);
    let mut pid = None;
    let mut errors = Vec::new();
    for line in text.lines() {
        match line.strip_prefix("pid ") {
            Some(p) => pid = p.trim().parse::<i32>().ok(),
            None => errors.push(line.to_string()),
        }
    }
    match (pid, errors.is_empty()) {
        (Some(pid), true) => Ok(pid),
        _ if !errors.is_empty() => Err(setup_err(errors.join("; "))),
        _ => Err(setup_err(
            "the session's keeper ended without starting the session",
        )),
    }
}

// ---- after the fork: system calls on prepared memory only ----

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
        push(b": errno ");
        let mut digits = [0u8; 12];
        let (mut v, mut i) = (errno.unsigned_abs(), digits.len());
        loop {
            i -= 1;
            digits[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        push(&digits[i..]);
        push(b" (");
        let mut msg = [0u8; 128];
        // SAFETY: strerror_r writes at most the given length into our stack buffer.
        unsafe { libc::strerror_r(errno, msg.as_mut_ptr().cast(), msg.len()) };
        let len = msg.iter().position(|&b| b == 0).unwrap_or(0);
        push(&msg[..len]);
        push(b")");
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
    match path {
        Some(p) => report(fd, &[what, b" ", p.to_bytes()], e),
        None => report(fd, &[what], e),
    }
    // SAFETY: _exit is always safe.
    unsafe { libc::_exit(1) }
}

fn opt_ptr(s: &Option<CString>) -> *const libc::c_char {
    s.as_ref().map_or(std::ptr::null(), |s| s.as_ptr())
}

/// `mkdir -p` on a prepared path, in place (a copy on the stack).
fn mkdir_all(path: &CStr) {
    let bytes = path.to_bytes();
    let mut buf = [0u8; 2048];
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

/// Sets `attr` (`MOUNT_ATTR_*`) on the mount at `target` and every mount below it.
fn set_tree_attr(target: &CStr, attr_set: u64) -> libc::c_long {
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
            target.as_ptr(),
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

fn keeper_main(plan: &Plan, ctl: RawFd) -> ! {
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
        for op in &plan.ops {
            match op {
                Op::MkdirAll(path) => mkdir_all(path),
                Op::Mount {
                    source,
                    target,
                    fstype,
                    flags,
                    data,
                } => {
                    let rc = libc::mount(
                        opt_ptr(source),
                        target.as_ptr(),
                        opt_ptr(fstype),
                        *flags,
                        opt_ptr(data).cast(),
                    );
                    if rc != 0 {
                        fail(ctl, b"mount", Some(target));
                    }
                }
                Op::ReadOnly(target) => {
                    if set_tree_attr(target, MOUNT_ATTR_RDONLY) != 0 {
                        fail(ctl, b"remount read-only", Some(target));
                    }
                }
                Op::NoSuidNoDev(target) => {
                    if set_tree_attr(target, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV) != 0 {
                        fail(ctl, b"remount nosuid,nodev", Some(target));
                    }
                }
            }
        }
        match libc::fork() {
            -1 => fail(ctl, b"fork the session's init", None),
            0 => init_main(plan, ctl),
            pid => {
                let mut digits = [0u8; 12];
                let (mut v, mut i) = (pid as u32, digits.len());
                loop {
                    i -= 1;
                    digits[i] = b'0' + (v % 10) as u8;
                    v /= 10;
                    if v == 0 {
                        break;
                    }
                }
                report(ctl, &[b"pid ", &digits[i..]], 0);
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

fn init_main(plan: &Plan, ctl: RawFd) -> ! {
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
        let dot = c".".as_ptr();
        if libc::chdir(plan.new_root.as_ptr()) != 0
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
        libc::syscall(
            libc::SYS_close_range,
            4u32,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        );
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

/// Descriptor helper for the caller: a listening Unix socket bound to an abstract name in
/// execd's network namespace (sessions with their own network namespace cannot reach it).
pub fn listen_abstract(name: &str) -> Result<OwnedFd, IsolatedError> {
    use std::os::linux::net::SocketAddrExt;
    let addr =
        std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).map_err(setup_err)?;
    let listener = std::os::unix::net::UnixListener::bind_addr(&addr).map_err(setup_err)?;
    Ok(OwnedFd::from(listener))
}
