//! The cgroup code against the real kernel: limits enforced, freeze, kill, removal, leaks.
//!
//! Needs root and a cgroup filesystem; otherwise every test prints why it is skipped and
//! passes. Cgroups are made under `{FASTBOX_TEST_PREFIX or fbt<hex>}/{test}` and removed
//! even when a test fails (the guard's `Drop`), so a leak check of the prefix after the run
//! finds nothing.

use std::io::{Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use fastbox_runtime::cgroup::{
    Cgroup, CgroupLimits, CgroupRoot, CgroupVersion, Controller, leaked, remove_prefix,
};

const MI: u64 = 1 << 20;

/// CPU-heavy tests run one at a time so their measurements do not disturb each other.
static BUSY: Mutex<()> = Mutex::new(());

fn base_prefix() -> &'static str {
    static PREFIX: OnceLock<String> = OnceLock::new();
    PREFIX.get_or_init(|| {
        std::env::var("FASTBOX_TEST_PREFIX").unwrap_or_else(|_| {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos();
            format!("fbt{:x}{:x}", std::process::id(), nanos & 0xffff)
        })
    })
}

/// A test's cgroup root and prefix; removes everything under the prefix when dropped.
struct Env {
    root: CgroupRoot,
    prefix: String,
    cgroups: Vec<Cgroup>,
    children: Vec<Child>,
}

impl Env {
    fn new(test: &str) -> Option<Env> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            println!("skipped: {test} needs root to write cgroups");
            return None;
        }
        let root = match CgroupRoot::detect() {
            Ok(root) => root,
            Err(e) => {
                println!("skipped: {test}: no cgroup filesystem: {e}");
                return None;
            }
        };
        Some(Env {
            root,
            prefix: format!("{}/{test}", base_prefix()),
            cgroups: Vec::new(),
            children: Vec::new(),
        })
    }

    /// Skips (returns false) when a controller the test needs is not mounted.
    fn has(&self, controllers: &[Controller]) -> bool {
        for c in controllers {
            if self.root.mount_of(*c).is_none() {
                println!("skipped: controller {c} is not available");
                return false;
            }
        }
        true
    }

    fn create(&mut self, id: &str, limits: CgroupLimits) -> Cgroup {
        let cg = Cgroup::create(&self.root, &self.prefix, id, &limits)
            .unwrap_or_else(|e| panic!("create {id}: {e}"));
        self.cgroups.push(cg.clone());
        cg
    }

    /// Starts `script` under `sh -c` inside `cg`: the shell waits on stdin until its pid has
    /// been added from here, so nothing runs outside the cgroup.
    fn spawn_in(&mut self, cg: &Cgroup, script: &str) -> usize {
        let mut child = Command::new("/bin/sh")
            .arg("-c")
            .arg(format!("read go; {script}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn sh");
        cg.add_pid(child.id() as i32).expect("add pid");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(b"go\n")
            .expect("release the child");
        self.children.push(child);
        self.children.len() - 1
    }

    fn child(&mut self, i: usize) -> &mut Child {
        &mut self.children[i]
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        for cg in &self.cgroups {
            let _ = cg.kill_all();
        }
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
        for cg in &self.cgroups {
            if let Err(e) = cg.remove() {
                eprintln!("cleanup: {e}");
            }
        }
        if let Err(e) = remove_prefix(&self.root, &self.prefix) {
            eprintln!("cleanup: {e}");
        }
    }
}

fn wait_timeout(child: &mut Child, limit: Duration) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("child still running after {limit:?}");
        }
        thread::sleep(Duration::from_millis(10));
    }
}

fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        thread::sleep(Duration::from_millis(10));
    }
}

fn stderr_of(child: &mut Child) -> String {
    let mut s = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut s);
    }
    s
}

#[test]
fn memory_limit_oom_kills_inside_the_group_only() {
    let Some(mut env) = Env::new("oom") else {
        return;
    };
    if !env.has(&[Controller::Memory]) {
        return;
    }
    let cg = env.create(
        "oom",
        CgroupLimits {
            memory_bytes: Some(64 * MI),
            pids: Some(64),
            ..Default::default()
        },
    );
    let before = cg.memory_events_oom_kills().unwrap();
    // tail keeps a line until it ends; /dev/zero has no newline, so it buffers everything.
    let i = env.spawn_in(&cg, "head -c 200M /dev/zero | tail > /dev/null");
    let status = wait_timeout(env.child(i), Duration::from_secs(60));
    assert!(
        !status.success(),
        "the 200 MiB pipeline survived a 64 MiB limit"
    );
    let after = cg.memory_events_oom_kills().unwrap();
    assert!(after > before, "oom_kill count {before} -> {after}");
    // This process, outside the group, is untouched (it is still running this line), and
    // the group never held more than the limit.
    assert!(cg.memory_current().unwrap() <= 64 * MI);
    println!("oom kills: {before} -> {after}, status {status:?}");
}

#[test]
fn memory_limit_can_be_raised_and_lowered() {
    let Some(mut env) = Env::new("memset") else {
        return;
    };
    if !env.has(&[Controller::Memory]) {
        return;
    }
    let cg = env.create(
        "m",
        CgroupLimits {
            memory_bytes: Some(64 * MI),
            ..Default::default()
        },
    );
    let file = match cg.version() {
        CgroupVersion::V1 => "memory.limit_in_bytes",
        CgroupVersion::V2 => "memory.max",
    };
    let dir = env.root.mount_of(Controller::Memory).unwrap().to_path_buf();
    let limit_file = dir.join(&env.prefix).join("m").join(file);
    for bytes in [256 * MI, 32 * MI, 128 * MI] {
        cg.set_limits(&CgroupLimits {
            memory_bytes: Some(bytes),
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("set memory to {bytes}: {e}"));
        let got = std::fs::read_to_string(&limit_file).unwrap();
        assert_eq!(got.trim(), bytes.to_string());
    }
    cg.set_limits(&CgroupLimits::default()).unwrap();
}

#[test]
fn pids_limit_stops_a_fork_bomb() {
    let Some(mut env) = Env::new("pids") else {
        return;
    };
    if !env.has(&[Controller::Pids]) {
        return;
    }
    let cg = env.create(
        "bomb",
        CgroupLimits {
            pids: Some(20),
            ..Default::default()
        },
    );
    let i = env.spawn_in(
        &cg,
        "for i in $(seq 100); do sleep 30 & done; echo all-started >&2",
    );
    // The shell gives up (dash exits on a failed fork) or finishes the loop.
    let _ = wait_timeout(env.child(i), Duration::from_secs(20));
    let procs = cg.procs().unwrap();
    assert!(
        procs.len() <= 20,
        "{} processes under pids.max 20",
        procs.len()
    );
    assert!(procs.len() >= 10, "only {} processes started", procs.len());
    cg.kill_all().unwrap();
    let stderr = stderr_of(env.child(i));
    assert!(
        stderr.to_lowercase().contains("fork") && !stderr.contains("all-started"),
        "expected fork failures, got {stderr:?}"
    );
    println!(
        "pids: {} processes, shell said {:?}",
        procs.len(),
        stderr.trim()
    );
}

#[test]
fn cpu_quota_limits_a_busy_loop() {
    let Some(mut env) = Env::new("cpu") else {
        return;
    };
    let accounting = match env.root.version() {
        CgroupVersion::V1 => Controller::Cpuacct,
        CgroupVersion::V2 => Controller::Cpu,
    };
    if !env.has(&[Controller::Cpu, accounting]) {
        return;
    }
    let _busy = BUSY.lock().unwrap_or_else(|e| e.into_inner());
    let limited = env.create(
        "limited",
        CgroupLimits {
            cpu_millis: Some(200),
            ..Default::default()
        },
    );
    let free = env.create("free", CgroupLimits::default());
    let spin = "exec timeout 1 sh -c 'while :; do :; done'";
    // Both spin at the same time, so a busy machine slows both alike.
    let a = env.spawn_in(&limited, spin);
    let b = env.spawn_in(&free, spin);
    wait_timeout(env.child(a), Duration::from_secs(10));
    wait_timeout(env.child(b), Duration::from_secs(10));
    let used_limited = limited.cpu_usage().unwrap();
    let used_free = free.cpu_usage().unwrap();
    println!("1 s of spinning: {used_limited:?} at 200m, {used_free:?} unlimited");
    assert!(
        used_limited < Duration::from_millis(400),
        "{used_limited:?} at 200m"
    );
    assert!(
        used_limited > Duration::from_millis(50),
        "{used_limited:?}: did it spin?"
    );
    // Unlimited, the same loop gets more than the quota allows (on an idle machine, about
    // a full second; on a loaded one, still well above the limited group's share).
    assert!(
        used_free > used_limited.mul_f64(1.3) && used_free > Duration::from_millis(250),
        "{used_free:?} unlimited vs {used_limited:?} at 200m"
    );
}

#[test]
fn freeze_stops_and_thaw_resumes_the_group() {
    let Some(mut env) = Env::new("freeze") else {
        return;
    };
    let accounting = match env.root.version() {
        CgroupVersion::V1 => Controller::Cpuacct,
        CgroupVersion::V2 => Controller::Cpu,
    };
    let needed = match env.root.version() {
        CgroupVersion::V1 => vec![Controller::Freezer, accounting],
        CgroupVersion::V2 => vec![accounting],
    };
    if !env.has(&needed) {
        return;
    }
    let _busy = BUSY.lock().unwrap_or_else(|e| e.into_inner());
    let cg = env.create("f", CgroupLimits::default());
    let i = env.spawn_in(&cg, "while :; do :; done");
    thread::sleep(Duration::from_millis(100));
    let start = Instant::now();
    cg.freeze().unwrap();
    let freeze_took = start.elapsed();
    assert!(cg.is_frozen().unwrap());
    let u1 = cg.cpu_usage().unwrap();
    thread::sleep(Duration::from_millis(300));
    let u2 = cg.cpu_usage().unwrap();
    assert!(
        u2 - u1 < Duration::from_millis(20),
        "frozen but used {:?}",
        u2 - u1
    );
    cg.thaw().unwrap();
    assert!(!cg.is_frozen().unwrap());
    thread::sleep(Duration::from_millis(300));
    let u3 = cg.cpu_usage().unwrap();
    assert!(
        u3 - u2 > Duration::from_millis(100),
        "thawed but used {:?}",
        u3 - u2
    );
    println!(
        "freeze took {freeze_took:?}; frozen {:?}, thawed {:?}",
        u2 - u1,
        u3 - u2
    );

    // A paused sandbox can be killed.
    cg.freeze().unwrap();
    cg.kill_all().unwrap();
    assert!(cg.procs().unwrap().is_empty());
    let status = wait_timeout(env.child(i), Duration::from_secs(5));
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
}

#[test]
fn kill_all_and_remove_leave_no_leak() {
    let Some(mut env) = Env::new("kill") else {
        return;
    };
    let cg = env.create(
        "k",
        CgroupLimits {
            pids: Some(100),
            ..Default::default()
        },
    );
    let i = env.spawn_in(&cg, "sleep 100 & sleep 100 & sleep 100 & wait");
    wait_until("4 processes in the group", Duration::from_secs(5), || {
        cg.procs().unwrap().len() == 4
    });
    assert_eq!(leaked(&env.root, &env.prefix), {
        let mut p = cg.paths();
        p.sort();
        p
    });
    cg.kill_all().unwrap();
    assert!(cg.procs().unwrap().is_empty());
    let status = wait_timeout(env.child(i), Duration::from_secs(5));
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    cg.remove().unwrap();
    assert!(leaked(&env.root, &env.prefix).is_empty());
    assert!(Cgroup::open(&env.root, &env.prefix, "k").is_none());
    remove_prefix(&env.root, &env.prefix).unwrap();
    for dir in cg.paths() {
        assert!(!dir.parent().unwrap().exists(), "{} left", dir.display());
    }
}

#[test]
fn a_child_joins_in_pre_exec_and_criu_paths_match_proc() {
    let Some(mut env) = Env::new("join") else {
        return;
    };
    let cg = env.create("j", CgroupLimits::default());
    let files = cg.open_procs().unwrap();
    let mut cmd = Command::new("cat");
    cmd.arg("/proc/self/cgroup");
    // SAFETY: the hook only writes to files opened before the fork; no allocation.
    unsafe { cmd.pre_exec(move || files.join_current()) };
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let proc_cgroup = String::from_utf8(out.stdout).unwrap();
    for root in cg.criu_cgroup_roots() {
        let want = match &root.controller {
            Some(c) => format!(":{c}:{}", root.path.display()),
            None => format!("0::{}", root.path.display()),
        };
        assert!(
            proc_cgroup.lines().any(|l| l.ends_with(&want)),
            "{want} not in {proc_cgroup}"
        );
    }
    // The devices controller (v1) lets the standard pseudo-devices through.
    let out = run_in(&cg, "head -c 16 /dev/urandom | wc -c; echo x > /dev/null");
    assert_eq!(out.trim(), "16");
}

/// Runs `script` in `cg` (joined in pre_exec) and returns its stdout.
fn run_in(cg: &Cgroup, script: &str) -> String {
    let files = cg.open_procs().unwrap();
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-c").arg(script);
    // SAFETY: the hook only writes to files opened before the fork; no allocation.
    unsafe { cmd.pre_exec(move || files.join_current()) };
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn devices_outside_the_allow_list_are_refused_on_v1() {
    let Some(mut env) = Env::new("devices") else {
        return;
    };
    if env.root.version() != CgroupVersion::V1 || !env.has(&[Controller::Devices]) {
        println!("skipped: the devices controller is cgroup v1 only");
        return;
    }
    let cg = env.create("d", CgroupLimits::default());
    let dir = tempfile::tempdir().unwrap();
    // /dev/kmsg (c 1:11) and /dev/loop0 (b 7:0): creating the nodes is allowed, opening them
    // is not. They are only opened, never read.
    for (name, kind, major, minor) in [("kmsg", "c", "1", "11"), ("loop0", "b", "7", "0")] {
        let node: PathBuf = dir.path().join(name);
        let script = format!(
            "if ( exec 3<{n} ) 2>/dev/null; then echo opened; else echo refused; fi",
            n = node.display()
        );
        assert_eq!(
            run_in(
                &cg,
                &format!(
                    "mknod {} {kind} {major} {minor} && echo made",
                    node.display()
                )
            )
            .trim(),
            "made"
        );
        let outside = Command::new("/bin/sh")
            .arg("-c")
            .arg(&script)
            .output()
            .unwrap();
        if String::from_utf8_lossy(&outside.stdout).trim() != "opened" {
            println!("skipped {name}: cannot open it even outside the cgroup here");
            continue;
        }
        assert_eq!(run_in(&cg, &script).trim(), "refused", "{name}");
    }
}

/// The v2 code paths on the real kernel. On a hybrid host (this project's VMs) the unified
/// hierarchy has no cpu, memory or pids controller, but creating (with the device program,
/// see `tests/cgroup_devices_v2.rs`), joining, freezing (`cgroup.freeze`), killing
/// (`cgroup.kill`), accounting (`cpu.stat`) and removing work.
#[test]
fn v2_lifecycle_on_the_unified_hierarchy() {
    let Some(mut env) = Env::new("v2") else {
        return;
    };
    if env.root.version() == CgroupVersion::V1 {
        let Some(unified) = CgroupRoot::unified().unwrap() else {
            println!("skipped: no cgroup2 hierarchy on this v1 host");
            return;
        };
        env.root = unified;
    }
    let controllers = std::fs::read_to_string(
        env.root
            .mount_of(Controller::Memory)
            .unwrap()
            .join("cgroup.controllers"),
    )
    .unwrap();
    if !controllers.split_whitespace().any(|c| c == "memory") {
        let err = Cgroup::create(
            &env.root,
            &env.prefix,
            "nomem",
            &CgroupLimits {
                memory_bytes: Some(64 * MI),
                ..Default::default()
            },
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("controller memory is not available"),
            "{err}"
        );
    }
    let _busy = BUSY.lock().unwrap_or_else(|e| e.into_inner());
    let cg = env.create("life", CgroupLimits::default());
    assert_eq!(cg.device_programs().unwrap().len(), 1, "one device program");
    let i = env.spawn_in(&cg, "sleep 100 & while :; do :; done");
    wait_until("2 processes", Duration::from_secs(5), || {
        cg.procs().unwrap().len() == 2
    });
    cg.freeze().unwrap();
    assert!(cg.is_frozen().unwrap());
    let u1 = cg.cpu_usage().unwrap();
    thread::sleep(Duration::from_millis(200));
    let u2 = cg.cpu_usage().unwrap();
    assert!(
        u2 - u1 < Duration::from_millis(20),
        "frozen but used {:?}",
        u2 - u1
    );
    cg.thaw().unwrap();
    thread::sleep(Duration::from_millis(200));
    assert!(cg.cpu_usage().unwrap() - u2 > Duration::from_millis(50));
    let path = cg.paths().remove(0);
    assert!(
        path.join("cgroup.kill").exists(),
        "kernel without cgroup.kill"
    );
    cg.kill_all().unwrap();
    assert!(cg.procs().unwrap().is_empty());
    let status = wait_timeout(env.child(i), Duration::from_secs(5));
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    cg.remove().unwrap();
    assert!(leaked(&env.root, &env.prefix).is_empty());
}
