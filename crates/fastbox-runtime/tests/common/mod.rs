//! What the runtime's CRIU tests share: CRIU (or why a test is skipped), a process holding
//! 32 MiB of pseudo-random memory to dump (the test binary itself, re-run as
//! [`memory_holder`] in its own pid namespace), and a host-wide lock.

#![allow(dead_code)]

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const HOLDER_PORT: &str = "FASTBOX_LAZY_TEST_HOLDER_PORT";

/// CRIU as the test suite finds it, or why the test cannot run.
pub fn criu() -> Result<PathBuf, String> {
    if !nix::unistd::geteuid().is_root() {
        return Err("needs root (CRIU)".into());
    }
    let path = std::env::var_os("FASTBOX_CRIU").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.deps/criu/bin/criu"),
        PathBuf::from,
    );
    let check = Command::new(&path)
        .args(["check", "--feature", "uffd-noncoop"])
        .output()
        .map_err(|e| format!("no CRIU at {} ({e}): run scripts/setup.sh", path.display()))?;
    if !check.status.success() {
        return Err(format!(
            "{} has no non-cooperative userfaultfd",
            path.display()
        ));
    }
    Ok(path)
}

/// CRIU, and the host-wide lock that makes these tests run one at a time: the processes
/// they dump and restore share the host's mount namespace, where CRIU's parasite makes a
/// directory named after the task's pid (1 in each holder's pid namespace), so concurrent
/// runs collide (nextest runs each test in a process of its own).
#[macro_export]
macro_rules! criu_or_skip {
    () => {
        match $crate::common::criu() {
            Ok(path) => (path, $crate::common::lock_host("fastbox-lazy-tests.lock")),
            Err(reason) => {
                eprintln!("skipped: {reason}");
                return;
            }
        }
    };
}

/// 32 MiB of xorshift words and their checksum.
pub fn memory() -> (Vec<u64>, u64) {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let words: Vec<u64> = (0..(32 << 20) / 8)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        })
        .collect();
    let sum = checksum(&words);
    (words, sum)
}

pub fn checksum(words: &[u64]) -> u64 {
    words
        .iter()
        .fold(0u64, |s, w| s.wrapping_mul(31).wrapping_add(*w))
}

/// Not a test: the process the tests dump (run with `HOLDER_PORT` set). Each connection
/// gets "<checksum now> <checksum at start>".
#[test]
#[ignore = "helper process of the lazy restore tests"]
pub fn memory_holder() {
    let Some(port) = std::env::var_os(HOLDER_PORT) else {
        return;
    };
    let (words, at_start) = memory();
    let listener =
        std::net::TcpListener::bind(("127.0.0.1", port.to_str().unwrap().parse().unwrap()))
            .unwrap();
    for conn in listener.incoming() {
        let Ok(mut conn) = conn else { continue };
        let _ = writeln!(conn, "{} {at_start}", checksum(&words));
    }
}

/// The `unshare` parent of a memory holder; killed and reaped when dropped.
pub struct Holder {
    unshare: Child,
    pub pid: i32,
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.unshare.kill();
        let _ = self.unshare.wait();
    }
}

/// Starts the holder, session leader in its own pid namespace, and waits until it answers.
pub fn start_holder(port: u16) -> Holder {
    let exe = std::env::current_exe().unwrap();
    let unshare = Command::new("unshare")
        .args(["--fork", "--pid", "setsid"])
        .arg(exe)
        .args(["--exact", "common::memory_holder"])
        .args(["--ignored", "--nocapture", "--test-threads", "1"])
        .env(HOLDER_PORT, port.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut holder = Holder { unshare, pid: 0 };
    let children = format!("/proc/{0}/task/{0}/children", holder.unshare.id());
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let pid = std::fs::read_to_string(&children)
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse().ok());
        if let Some(pid) = pid
            && ask(port).is_some()
        {
            holder.pid = pid;
            return holder;
        }
        assert!(
            Instant::now() < deadline,
            "the memory holder does not answer"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The holder's answer: (checksum now, checksum at start).
pub fn ask(port: u16) -> Option<(u64, u64)> {
    let mut conn = TcpStream::connect(("127.0.0.1", port)).ok()?;
    let mut text = String::new();
    conn.read_to_string(&mut text).ok()?;
    let mut parts = text.split_whitespace().map(|p| p.parse::<u64>().ok());
    Some((parts.next()??, parts.next()??))
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `criu ARGS --images-dir DIR/images --work-dir DIR/work`, started.
pub fn spawn(criu: &Path, args: &[&str], dir: &Path) -> Child {
    Command::new(criu)
        .args(args)
        .arg("--images-dir")
        .arg(dir.join("images"))
        .arg("--work-dir")
        .arg(dir.join("work"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// An exclusive lock on a file shared by every process running these tests (nextest runs
/// each test in a process of its own), held until the returned file is dropped.
pub fn lock_host(name: &str) -> std::fs::File {
    let file = std::fs::File::create(std::env::temp_dir().join(name)).unwrap();
    // SAFETY: flock on a descriptor this function owns.
    let rc = unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&file), libc::LOCK_EX) };
    assert_eq!(rc, 0, "flock: {}", std::io::Error::last_os_error());
    file
}

pub fn restored_pid(dir: &Path) -> Option<i32> {
    std::fs::read_to_string(dir.join("restored.pid"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

pub fn kill(pid: i32) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
}

pub fn is_alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        !stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z')
    })
}

/// Whether `pid` ends within a few seconds (a killed process takes a moment to exit).
pub fn ends(pid: i32) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while is_alive(pid) {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}
