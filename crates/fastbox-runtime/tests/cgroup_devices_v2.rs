//! The cgroup v2 device program against the real kernel, on the host's unified hierarchy (on
//! this project's hybrid hosts, the empty cgroup2 mount beside the v1 controllers: device
//! programs need no controller).
//!
//! Needs root and a cgroup2 mount; otherwise every test prints why it is skipped and passes.
//! Cgroups are made under `{FASTBOX_TEST_PREFIX or fbt<hex>}9` (tag `9`, see
//! `fastbox_testkit::run_prefix`) and removed even when a test fails (the guard's `Drop`), so
//! nothing with the prefix is left. Device nodes are made on a tmpfs mounted without `nodev` in
//! a mount namespace of the test's own thread, unmounted at the end.

use std::ffi::CString;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;

use fastbox_runtime::cgroup::{Cgroup, CgroupLimits, CgroupRoot, ProcsFiles, remove_prefix};
use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::{CloneFlags, unshare};
use nix::sys::statvfs::{FsFlags, statvfs};

/// This suite's tag in the run prefix (`fastbox_testkit::run_prefix` lists every suite's).
const TAG: &str = "9";

/// Environment of the re-executed helper (`reattach_helper`): the cgroup to attach again.
const HELPER_PREFIX: &str = "FASTBOX_DEVBPF_HELPER_PREFIX";
const HELPER_ID: &str = "FASTBOX_DEVBPF_HELPER_ID";

fn prefix() -> &'static str {
    static PREFIX: OnceLock<String> = OnceLock::new();
    PREFIX.get_or_init(|| {
        let base = std::env::var("FASTBOX_TEST_PREFIX").unwrap_or_else(|_| {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos();
            format!("fbt{:04x}", (std::process::id() ^ nanos) & 0xffff)
        });
        format!("{base}{TAG}")
    })
}

/// The unified root and the test's cgroups; removes them and the prefix when dropped.
struct Env {
    root: CgroupRoot,
    prefix: String,
    cgroups: Vec<Cgroup>,
}

impl Env {
    fn new(test: &str) -> Option<Env> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            println!("skipped: {test} needs root to write cgroups and load BPF programs");
            return None;
        }
        let root = match CgroupRoot::unified() {
            Ok(Some(root)) => root,
            Ok(None) => {
                println!("skipped: {test}: no cgroup2 mount in /proc/self/mountinfo");
                return None;
            }
            Err(e) => {
                println!("skipped: {test}: {e}");
                return None;
            }
        };
        Some(Env {
            root,
            prefix: format!("{}/{test}", prefix()),
            cgroups: Vec::new(),
        })
    }

    fn create(&mut self, id: &str) -> Cgroup {
        let cg = Cgroup::create(&self.root, &self.prefix, id, &CgroupLimits::default())
            .unwrap_or_else(|e| panic!("create {id}: {e}"));
        self.cgroups.push(cg.clone());
        cg
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        for cg in &self.cgroups {
            let _ = cg.kill_all();
            if let Err(e) = cg.remove() {
                eprintln!("cleanup: {e}");
            }
        }
        // Up to the suite's own directory, once no other test has a cgroup under it.
        if let Err(e) = remove_prefix(&self.root, &self.prefix) {
            eprintln!("cleanup: {e}");
        }
    }
}

/// What the child does inside the cgroup, one result (0 or errno) each.
enum Op {
    Open(CString, libc::c_int),
    Mknod(CString, libc::mode_t, libc::dev_t),
}

fn cpath(path: &Path) -> CString {
    CString::new(path.as_os_str().as_bytes()).unwrap()
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(-1)
}

/// Runs `op` in this process: 0 or the errno.
fn perform(op: &Op) -> i32 {
    match op {
        Op::Open(path, flags) => {
            // SAFETY: a NUL-terminated path; the fd is closed right away.
            let fd = unsafe { libc::open(path.as_ptr(), flags | libc::O_CLOEXEC) };
            if fd < 0 {
                return errno();
            }
            // SAFETY: the fd was just opened here.
            unsafe { libc::close(fd) };
            0
        }
        Op::Mknod(path, mode, dev) => {
            // SAFETY: a NUL-terminated path.
            if unsafe { libc::mknod(path.as_ptr(), *mode, *dev) } < 0 {
                errno()
            } else {
                0
            }
        }
    }
}

const MAX_OPS: usize = 8;

/// Forks a child that joins the cgroup (the result of the join first), then performs `ops` and
/// reports one result each. The child makes only system calls (the parent has threads).
fn in_cgroup(procs: &ProcsFiles, ops: &[Op]) -> Vec<i32> {
    assert!(ops.len() < MAX_OPS);
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both fds were just created and are owned here only.
    let (read_end, write_end) =
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: the child only calls async-signal-safe functions (write, open, close, mknod,
    // _exit) on memory prepared before the fork.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let mut results = [0i32; MAX_OPS];
        results[0] = match procs.join_current() {
            Ok(()) => 0,
            Err(e) => e.raw_os_error().unwrap_or(-1),
        };
        if results[0] == 0 {
            for (i, op) in ops.iter().enumerate() {
                results[i + 1] = perform(op);
            }
        }
        let bytes = (ops.len() + 1) * 4;
        // SAFETY: `results` holds at least `bytes` bytes; _exit never returns.
        unsafe {
            libc::write(write_end.as_raw_fd(), results.as_ptr().cast(), bytes);
            libc::_exit(0);
        }
    }
    drop(write_end);
    let mut buf = Vec::new();
    File::from(read_end).read_to_end(&mut buf).unwrap();
    let mut status = 0;
    // SAFETY: waits for the child forked above.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
    let results: Vec<i32> = buf
        .chunks_exact(4)
        .map(|c| i32::from_ne_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(results.len(), ops.len() + 1, "child results {results:?}");
    assert_eq!(results[0], 0, "joining the cgroup: errno {}", results[0]);
    results[1..].to_vec()
}

/// Runs `f` on a thread of its own in a private mount namespace, with a tmpfs mounted
/// without `nodev` (removed afterwards), so device nodes made there can be opened.
fn with_dev_tmpfs(f: impl FnOnce(&Path) + Send) {
    std::thread::scope(|s| {
        s.spawn(|| {
            unshare(CloneFlags::CLONE_NEWNS).expect("unshare the mount namespace");
            mount(
                None::<&str>,
                "/",
                None::<&str>,
                MsFlags::MS_REC | MsFlags::MS_PRIVATE,
                None::<&str>,
            )
            .expect("make the mounts private");
            let dir = tempfile::Builder::new()
                .prefix(&format!("{}-dev", prefix()))
                .tempdir()
                .unwrap();
            mount(
                Some("tmpfs"),
                dir.path(),
                Some("tmpfs"),
                MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
                Some("mode=0700,size=1m"),
            )
            .expect("mount a tmpfs");
            struct Unmount<'a>(&'a Path);
            impl Drop for Unmount<'_> {
                fn drop(&mut self) {
                    if let Err(e) = umount2(self.0, MntFlags::MNT_DETACH) {
                        eprintln!("cleanup: umount {}: {e}", self.0.display());
                    }
                }
            }
            let _unmount = Unmount(dir.path());
            let flags = statvfs(dir.path()).unwrap().flags();
            assert!(!flags.contains(FsFlags::ST_NODEV), "the tmpfs is nodev");
            f(dir.path());
        });
    });
}

#[test]
fn devices_outside_the_allow_list_are_refused_on_v2() {
    let Some(mut env) = Env::new("devices") else {
        return;
    };
    let cg = env.create("d");
    assert_eq!(cg.device_programs().unwrap().len(), 1, "one device program");
    let procs = cg.open_procs().unwrap();
    with_dev_tmpfs(|dir| {
        // /dev/kmsg (c 1:11) and /dev/loop0 (b 7:0), made outside the cgroup; opened only.
        let kmsg = dir.join("kmsg");
        let loop0 = dir.join("loop0");
        for (path, mode, major, minor) in
            [(&kmsg, libc::S_IFCHR, 1, 11), (&loop0, libc::S_IFBLK, 7, 0)]
        {
            let op = Op::Mknod(cpath(path), mode | 0o600, libc::makedev(major, minor));
            assert_eq!(perform(&op), 0, "mknod {}", path.display());
        }
        let made = dir.join("made-inside");
        let ops = [
            Op::Open(c"/dev/null".into(), libc::O_WRONLY),
            Op::Open(c"/dev/zero".into(), libc::O_RDONLY),
            Op::Open(cpath(&kmsg), libc::O_RDONLY),
            Op::Open(cpath(&loop0), libc::O_RDONLY),
            // "m" rules: creating a node is allowed, opening it is not.
            Op::Mknod(cpath(&made), libc::S_IFCHR | 0o600, libc::makedev(1, 11)),
            Op::Open(cpath(&made), libc::O_RDONLY),
        ];
        let inside = in_cgroup(&procs, &ops);
        let outside: Vec<i32> = ops
            .iter()
            .map(|op| match op {
                Op::Mknod(..) => 0,
                op => perform(op),
            })
            .collect();
        println!("inside the cgroup: {inside:?}; outside: {outside:?}");
        let names = [
            "/dev/null w",
            "/dev/zero r",
            "kmsg r",
            "loop0 r",
            "mknod",
            "made r",
        ];
        assert_eq!(inside[0], 0, "{}", names[0]);
        assert_eq!(inside[1], 0, "{}", names[1]);
        assert_eq!(inside[4], 0, "mknod c 1:11 inside the cgroup");
        // Each opens outside, so neither nodev nor permissions refuse it inside: the program
        // does. A loop device may be missing here (no loop module): then only the others.
        for i in [2, 3, 5] {
            if i == 3 && outside[i] != 0 {
                println!(
                    "skipped loop0: cannot open it even outside the cgroup (errno {})",
                    outside[i]
                );
                continue;
            }
            assert_eq!(outside[i], 0, "{} outside the cgroup", names[i]);
            assert_eq!(inside[i], libc::EPERM, "{} inside the cgroup", names[i]);
        }
    });
    drop(procs);
    cg.kill_all().unwrap();
    cg.remove().unwrap();
    assert!(Cgroup::open(&env.root, &env.prefix, "d").is_none());
}

#[test]
fn attaching_again_keeps_one_program_and_a_restart_replaces_it() {
    let Some(mut env) = Env::new("again") else {
        return;
    };
    let cg = env.create("a");
    let first = cg.device_programs().unwrap();
    assert_eq!(first.len(), 1);
    cg.apply_device_policy().unwrap();
    cg.apply_device_policy().unwrap();
    assert_eq!(
        cg.device_programs().unwrap(),
        first,
        "attached again by this process"
    );
    // Another sandbox of this process shares the loaded program.
    let other = env.create("b");
    assert_eq!(other.device_programs().unwrap(), first);

    // Another process (fastbox after a restart) loads its own program and adopts the cgroup:
    // its program replaces this one.
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .args([
            "--exact",
            "reattach_helper",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(HELPER_PREFIX, &env.prefix)
        .env(HELPER_ID, "a")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("helper: attached"),
        "helper: {out:?}"
    );
    let after = cg.device_programs().unwrap();
    assert_eq!(after.len(), 1, "{after:?}");
    assert_ne!(
        after, first,
        "the restarted process's program replaced the old one"
    );
    println!("device program {first:?} replaced by {after:?}");
    assert_eq!(other.device_programs().unwrap(), first);
}

/// Not a test on its own: re-executed by the test above to attach from another process.
#[test]
#[ignore = "helper process of the device program reattach test"]
fn reattach_helper() {
    let (Ok(prefix), Ok(id)) = (std::env::var(HELPER_PREFIX), std::env::var(HELPER_ID)) else {
        return;
    };
    let root = CgroupRoot::unified().unwrap().unwrap();
    let cg = Cgroup::open(&root, &prefix, &id).expect("the cgroup to adopt");
    cg.apply_device_policy().unwrap();
    println!("helper: attached {:?}", cg.device_programs().unwrap());
}
