//! The node's fence guard for real: a shell loop in a real cgroup named like a sandbox of a
//! per-run prefix (`run_prefix_pair("ng")`), the guard started from the built `fastbox`
//! binary, real deadlines, real signals.
//!
//! - an agent killed with SIGKILL (its whole process group) leaves the guard running, and
//!   the guard freezes the group at the deadline, not before (the kernel reports it frozen
//!   and the workload makes no more progress), and leaves the marker (cgroup v1 as detected,
//!   and v2 on the unified hierarchy);
//! - renewals that keep coming prevent the fence; a release does not;
//! - a new agent's guard makes the old one exit without fencing;
//! - a guard never renewed exits with its agent.
//!
//! Needs root (otherwise each test prints `skipped: ...` and passes). The tests run one at a
//! time (a guard freezes every group of the prefix: [`serial`]); everything is thawed, killed and
//! removed even when a test fails (`Node`'s `Drop`).

use std::fs::File;
use std::io::Write;
use std::io::{BufRead, BufReader};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{OnceLock, mpsc};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fastbox_cli::node::fence_guard::{FenceGuard, FenceGuardConfig, FencedMarker, LOCK_FILE};
use fastbox_fastlet::fence::CgroupSource;
use fastbox_runtime::cgroup::{Cgroup, CgroupLimits, CgroupRoot, remove_prefix};
use nix::fcntl::{Flock, FlockArg};
use nix::libc;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

/// The deadline the tests renew with, from now.
const AHEAD: Duration = Duration::from_millis(1500);
/// The environment variable that makes [`agent_process`] an agent.
const AGENT_ENV: &str = "FASTBOX_FENCE_TEST_AGENT";

/// The tests run one at a time on a host, whatever runs them (nextest runs each in a process
/// of its own): a guard freezes every group of the prefix, which the processes of one run
/// share when `FASTBOX_TEST_PREFIX` is set.
fn serial() -> Flock<File> {
    let path = std::env::temp_dir().join("fastbox-fence-guard-tests.lock");
    let file = File::create(&path).unwrap();
    Flock::lock(file, FlockArg::LockExclusive)
        .unwrap_or_else(|(_, e)| panic!("flock {}: {e}", path.display()))
}

fn prefix() -> &'static str {
    static PREFIX: OnceLock<String> = OnceLock::new();
    PREFIX.get_or_init(|| fastbox_testkit::run_prefix_pair("ng"))
}

fn unix_millis(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

/// A process to end at clean-up, held by a pidfd (never a reused pid).
struct Watched(OwnedFd);

impl Watched {
    /// `pid` must be alive and not reaped (a child whose handle is held, or a guard that
    /// waits for its deadline).
    fn open(pid: u32) -> Watched {
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        assert!(
            fd >= 0,
            "pidfd_open {pid}: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: a descriptor the kernel just returned, owned by nobody else.
        Watched(unsafe { OwnedFd::from_raw_fd(fd as i32) })
    }

    /// Whether the process exited within `timeout`.
    fn exited_within(&self, timeout: Duration) -> bool {
        let mut fds = [PollFd::new(self.0.as_fd(), PollFlags::POLLIN)];
        let millis = u16::try_from(timeout.as_millis()).unwrap_or(u16::MAX);
        poll(&mut fds, PollTimeout::from(millis)).is_ok_and(|n| n > 0)
    }

    fn kill(&self) {
        // SAFETY: pidfd_send_signal with a valid pidfd, a signal number, no siginfo, no flags.
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.0.as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        self.exited_within(Duration::from_secs(5));
    }
}

/// One test's node: a sandbox-like group with a "workload" in it (a shell that appends to a
/// file every 20 ms), a data directory, and the processes to end.
struct Node {
    source: CgroupSource,
    group: Cgroup,
    workload: Child,
    ticks: PathBuf,
    data: tempfile::TempDir,
    watched: Vec<Watched>,
    agents: Vec<Child>,
    _serial: Flock<File>,
}

impl Node {
    fn new(test: &str, source: CgroupSource) -> Option<Node> {
        if let Some(why) = fastbox_testkit::privileged_unavailable() {
            eprintln!("skipped: {why}");
            return None;
        }
        let root = match source {
            CgroupSource::Detect => CgroupRoot::detect().ok(),
            CgroupSource::Unified => CgroupRoot::unified().ok().flatten(),
        };
        let Some(root) = root else {
            eprintln!("skipped: no {source} cgroup hierarchy on this host");
            return None;
        };
        let serial = serial();
        let group = Cgroup::create(
            &root,
            prefix(),
            &format!("sbx-{test}"),
            &CgroupLimits::default(),
        )
        .unwrap_or_else(|e| panic!("create the group: {e}"));
        let data = tempfile::tempdir().unwrap();
        let ticks = data.path().join("ticks");
        // It waits on stdin until it is in the group, so its children are too.
        let workload = Command::new("/bin/sh")
            .arg("-c")
            .arg(r#"read go; while :; do echo x >> "$0"; sleep 0.02; done"#)
            .arg(&ticks)
            .stdin(Stdio::piped())
            .spawn()
            .expect("spawn the workload");
        let mut node = Node {
            source,
            group,
            workload,
            ticks,
            data,
            watched: Vec::new(),
            agents: Vec::new(),
            _serial: serial,
        };
        node.group
            .add_pid(node.workload.id() as i32)
            .expect("the workload into the group");
        node.workload
            .stdin
            .take()
            .unwrap()
            .write_all(b"go\n")
            .expect("start the workload");
        assert!(node.runs(), "the workload does not run");
        Some(node)
    }

    fn config(&self) -> FenceGuardConfig {
        FenceGuardConfig {
            data_dir: self.data.path().to_path_buf(),
            prefix: prefix().to_string(),
            cgroups: self.source,
            exe: env!("CARGO_BIN_EXE_fastbox").into(),
        }
    }

    /// A guard driven from this process (the test is its agent).
    fn guard(&mut self) -> FenceGuard {
        let guard = FenceGuard::spawn(&self.config()).expect("spawn the guard");
        self.watched.push(Watched::open(guard.pid()));
        guard
    }

    fn frozen(&self) -> bool {
        self.group.is_frozen().expect("freezer state")
    }

    /// Whether the workload makes progress within half a second.
    fn runs(&self) -> bool {
        let size = || std::fs::metadata(&self.ticks).map_or(0, |m| m.len());
        let before = size();
        wait_until(Duration::from_millis(500), || size() > before)
    }

    fn marker(&self) -> Option<FencedMarker> {
        FencedMarker::read(self.data.path()).expect("read the marker")
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        for w in &self.watched {
            w.kill();
        }
        for agent in &mut self.agents {
            // SAFETY: kill(2) of the agent's own process group (it was made its leader).
            unsafe { libc::kill(-(agent.id() as libc::pid_t), libc::SIGKILL) };
            let _ = agent.wait();
        }
        let _ = self.group.thaw();
        if let Err(e) = self.group.kill_all() {
            eprintln!("cleanup: {e}");
        }
        let _ = self.workload.kill();
        let _ = self.workload.wait();
        if let Err(e) = self.group.remove() {
            eprintln!("cleanup: {e}");
        }
        for root in [
            CgroupRoot::detect().ok(),
            CgroupRoot::unified().ok().flatten(),
        ]
        .into_iter()
        .flatten()
        {
            let _ = remove_prefix(&root, prefix());
        }
    }
}

/// Waits until `done` or `limit`.
fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if done() {
            return true;
        }
        thread::sleep(Duration::from_millis(20));
    }
    done()
}

/// Not a test of its own: the agent side of the SIGKILL tests, run in a process of its own
/// when [`AGENT_ENV`] says so. It starts the guard, renews once ([`AHEAD`] from then), prints
/// the guard's pid and the deadline, and sleeps until killed.
#[test]
fn agent_process() {
    let Ok(spec) = std::env::var(AGENT_ENV) else {
        return;
    };
    let parts: Vec<&str> = spec.split('|').collect();
    let [data_dir, prefix, source] = parts[..] else {
        panic!("{AGENT_ENV}: {spec:?}");
    };
    let cfg = FenceGuardConfig {
        data_dir: data_dir.into(),
        prefix: prefix.into(),
        cgroups: source.parse().unwrap(),
        exe: env!("CARGO_BIN_EXE_fastbox").into(),
    };
    let guard = FenceGuard::spawn(&cfg).expect("spawn the guard");
    let fence_at = SystemTime::now() + AHEAD;
    guard.renew(fence_at).expect("renew");
    println!("guard {} {}", guard.pid(), unix_millis(fence_at));
    thread::sleep(Duration::from_secs(600));
}

/// Starts [`agent_process`] as an agent in a process group of its own; the deadline it
/// renewed with.
fn start_agent(node: &mut Node) -> SystemTime {
    let spec = format!(
        "{}|{}|{}",
        node.data.path().display(),
        prefix(),
        node.source
    );
    let mut agent = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "agent_process",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(AGENT_ENV, spec)
        .stdout(Stdio::piped())
        .process_group(0)
        .spawn()
        .expect("start the agent");
    let stdout = agent.stdout.take().unwrap();
    node.agents.push(agent);
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            // The harness may have written `test agent_process ... ` before it.
            if let Some((pid, at)) = line
                .split_once("guard ")
                .and_then(|(_, rest)| rest.split_once(' '))
            {
                let _ = tx.send((pid.parse::<u32>().unwrap(), at.parse::<u64>().unwrap()));
                return;
            }
        }
    });
    let (pid, fence_at) = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the agent names its guard");
    // The guard waits for its deadline: alive, so its pid is its own.
    node.watched.push(Watched::open(pid));
    UNIX_EPOCH + Duration::from_millis(fence_at)
}

fn kill9_agent_is_fenced_at_its_deadline(test: &str, source: CgroupSource) {
    let Some(mut node) = Node::new(test, source) else {
        return;
    };
    let fence_at = start_agent(&mut node);
    // (a) Armed, before the deadline: the sandbox runs.
    assert!(!node.frozen(), "frozen before the deadline");
    assert!(node.runs());
    assert!(node.marker().is_none());

    // SIGKILL to the agent's whole process group: the guard is in a session of its own.
    let agent = node.agents.last().unwrap().id() as libc::pid_t;
    // SAFETY: kill(2) of the agent's own process group.
    assert_eq!(unsafe { libc::kill(-agent, libc::SIGKILL) }, 0);
    let _ = node.agents.last_mut().unwrap().wait();
    let guard = node.watched.last().unwrap();
    assert!(
        !guard.exited_within(Duration::from_millis(200)),
        "the guard died with its agent"
    );
    // Still before the deadline: the guard waits for it.
    let early = fence_at - Duration::from_millis(300);
    thread::sleep(early.duration_since(SystemTime::now()).unwrap_or_default());
    assert!(!node.frozen(), "fenced before the deadline");

    // (b) At the deadline: frozen, marker left, the guard gone.
    assert!(
        guard.exited_within(AHEAD + Duration::from_secs(10)),
        "the guard did not fence and exit"
    );
    assert!(node.frozen(), "not frozen after the deadline");
    assert!(!node.runs(), "the workload runs after the fence");
    let marker = node.marker().expect("the fenced marker");
    assert_eq!(marker.deadline_unix_ms, unix_millis(fence_at));
    assert!(
        marker.fenced_at_unix_ms >= marker.deadline_unix_ms,
        "{marker:?}"
    );
    assert_eq!(marker.sandboxes, [node.group.id()]);
    assert_eq!(marker.frozen, 1);
    assert!(marker.errors.is_empty(), "{marker:?}");
    assert!(marker.reason.contains("ended"), "{marker:?}");
}

#[test]
fn an_agent_killed_with_sigkill_is_fenced_at_its_deadline() {
    kill9_agent_is_fenced_at_its_deadline("k9", CgroupSource::Detect);
}

#[test]
fn an_agent_killed_with_sigkill_is_fenced_at_its_deadline_on_cgroup_v2() {
    kill9_agent_is_fenced_at_its_deadline("k9v2", CgroupSource::Unified);
}

/// (c) Renewals that keep coming prevent the fence; after a release, the last deadline
/// still holds.
#[test]
fn renewals_prevent_the_fence_and_a_release_does_not() {
    let Some(mut node) = Node::new("renew", CgroupSource::Detect) else {
        return;
    };
    let guard = node.guard();
    let start = Instant::now();
    let mut last = SystemTime::now();
    while start.elapsed() < AHEAD * 3 {
        last = SystemTime::now() + AHEAD;
        guard.renew(last).expect("renew");
        thread::sleep(Duration::from_millis(200));
        assert!(!node.frozen(), "fenced while renewals kept coming");
    }
    assert!(node.runs());
    assert!(node.marker().is_none());
    guard.release();
    let watched = node.watched.last().unwrap();
    assert!(
        watched.exited_within(Duration::from_secs(10)),
        "a released guard did not fence"
    );
    assert!(node.frozen());
    assert!(!node.runs(), "the workload runs after the fence");
    let marker = node.marker().expect("the fenced marker");
    assert_eq!(marker.deadline_unix_ms, unix_millis(last));
    assert!(marker.reason.contains("stopped"), "{marker:?}");
}

/// (d) A new agent's guard, once renewed, makes the old guard exit without fencing; it then
/// holds the lock.
#[test]
fn a_new_agents_guard_takes_over_without_fencing() {
    let Some(mut node) = Node::new("takeover", CgroupSource::Detect) else {
        return;
    };
    let old = node.guard();
    let old_pid = old.pid();
    let old_deadline = SystemTime::now() + AHEAD;
    old.renew(old_deadline).expect("renew the old guard");
    // The old agent ends: its guard waits for the deadline.
    drop(old);
    let old_watched = node.watched.last().unwrap();
    assert!(!old_watched.exited_within(Duration::from_millis(100)));

    let new = node.guard();
    new.renew(SystemTime::now() + Duration::from_secs(60))
        .expect("renew the new guard");
    assert!(
        node.watched[0].exited_within(Duration::from_secs(1)),
        "the old guard did not exit on the takeover"
    );
    assert!(
        SystemTime::now() < old_deadline,
        "the takeover came too late to prove anything"
    );
    let lock = node.data.path().join(LOCK_FILE);
    assert!(
        wait_until(Duration::from_secs(5), || {
            std::fs::read_to_string(&lock).is_ok_and(|t| t.starts_with(&format!("{} ", new.pid())))
        }),
        "the new guard does not hold the lock"
    );
    thread::sleep(
        (old_deadline + Duration::from_millis(500))
            .duration_since(SystemTime::now())
            .unwrap_or_default(),
    );
    assert!(!node.frozen(), "the old guard fenced after a takeover");
    assert!(node.runs());
    assert!(node.marker().is_none());
    assert_ne!(old_pid, new.pid());
}

/// A guard never renewed exits with its agent and fences nothing.
#[test]
fn an_unarmed_guard_exits_with_its_agent() {
    let Some(mut node) = Node::new("unarmed", CgroupSource::Detect) else {
        return;
    };
    let guard = node.guard();
    // Running: it holds its lock (a guard dropped before that may exit before taking it).
    let lock = node.data.path().join(LOCK_FILE);
    assert!(
        wait_until(Duration::from_secs(5), || lock.exists()),
        "the guard took no lock"
    );
    drop(guard);
    assert!(
        node.watched[0].exited_within(Duration::from_secs(5)),
        "the unarmed guard stayed"
    );
    assert!(!node.frozen());
    assert!(node.marker().is_none());
}
