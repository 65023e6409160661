//! Privileged end-to-end tests of the runtime: real namespaces, cgroups, overlay, seccomp,
//! network slots and execd, driven through execd's HTTP API like a user would.

mod common;

use common::{Fixture, fixture, unavailable};
use fastbox_cli::local_sandbox::StartOptions;
use fastbox_runtime::cgroup::CgroupLimits;
use fastbox_testkit::skip_unless;

#[test]
fn sandbox_runs_execd_as_pid1_and_sees_only_itself() {
    skip_unless!(unavailable());
    let f = fixture("a", 1);
    let sb = f.start(0, StartOptions::default());
    let (code, out, err) = Fixture::sh(
        &sb,
        "cat /proc/1/cmdline | tr '\\0' ' '; echo; hostname; ls /proc | grep -c '^[0-9]'",
    );
    assert_eq!(code, 0, "{out}{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines[0].starts_with("/.fastbox/execd"),
        "pid 1 is {:?}",
        lines[0]
    );
    assert_eq!(lines[1], sb.handle.id, "hostname");
    let pids: u32 = lines[2].trim().parse().unwrap();
    assert!(
        pids <= 5,
        "the sandbox sees only its own processes, saw {pids}"
    );
    let (code, out, _) = Fixture::sh(
        &sb,
        "cat /etc/hostname; cat /proc/self/oom_score_adj; cat /proc/1/oom_score_adj; touch /.fastbox/execd 2>/dev/null && echo writable || echo readonly",
    );
    assert_eq!(code, 0);
    // Lowering execd's OOM score needs CAP_SYS_RESOURCE, which some hosts withhold.
    let execd_oom = if host_has_cap_sys_resource() {
        "-1000"
    } else {
        "0"
    };
    assert_eq!(out, format!("{}\n0\n{execd_oom}\nreadonly\n", sb.handle.id));
    // Idle execd holds no open file on the writable layer (a checkpoint must not depend on
    // one): its descriptors are /dev/null, pipes, sockets and anonymous inodes only.
    let (code, out, _) = Fixture::sh(&sb, "for fd in /proc/1/fd/*; do readlink $fd; done");
    assert_eq!(code, 0);
    let files: Vec<&str> = out
        .lines()
        .filter(|t| t.starts_with('/') && *t != "/dev/null")
        .collect();
    assert!(files.is_empty(), "execd holds files open: {files:?}");
    f.destroy(&sb);
    f.finish();
}

fn host_has_cap_sys_resource() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .unwrap()
        .trim();
    u64::from_str_radix(eff, 16).unwrap() & (1 << 24) != 0
}

#[test]
fn kernel_interfaces_are_masked_and_escapes_fail() {
    skip_unless!(unavailable());
    let f = fixture("b", 2);
    let sb = f.start(0, StartOptions::default());
    // Each escape must fail, and for the reason the hardening gives (not a missing tool).
    const EPERM: &str = "not permitted|permission denied";
    const EROFS: &str = "Read-only file system";
    let checks = [
        (
            "echo '|/tmp/x' > /proc/sys/kernel/core_pattern",
            EROFS,
            "core_pattern is read-only",
        ),
        (
            "echo 1 > /proc/sysrq-trigger",
            EROFS,
            "sysrq-trigger is read-only",
        ),
        ("unshare -n true", EPERM, "no new network namespace"),
        ("unshare -m true", EPERM, "no new mount namespace"),
        (
            "mkdir -p /mnt; mount -t tmpfs none /mnt",
            EPERM,
            "no mounts",
        ),
        (
            "head -c 4096 /dev/zero > /tmp/m.ko; insmod /tmp/m.ko",
            EPERM,
            "no module loading",
        ),
        ("touch /sys/kernel/x", EROFS, "/sys is read-only"),
        (
            "mknod /tmp/sda b 8 0 && head -c1 /tmp/sda",
            "",
            "no host block devices",
        ),
    ];
    for (script, reason, what) in checks {
        if script.contains("sysrq") && !std::path::Path::new("/proc/sysrq-trigger").exists() {
            eprintln!("not checked: this kernel has no /proc/sysrq-trigger");
            continue;
        }
        let (code, out, err) = Fixture::sh(&sb, script);
        assert_ne!(code, 0, "{what}: `{script}` succeeded: {out}{err}");
        let lower = err.to_lowercase();
        assert!(
            reason.split('|').any(|r| lower.contains(&r.to_lowercase())),
            "{what}: `{script}` failed for another reason: {err}"
        );
    }
    let (code, out, _) = Fixture::sh(
        &sb,
        "wc -c < /proc/keys; wc -c < /proc/timer_list; ls /sys/firmware | wc -l",
    );
    assert_eq!(
        (code, out.as_str()),
        (0, "0\n0\n0\n"),
        "/proc/keys, /proc/timer_list and /sys/firmware are masked"
    );
    let (code, out, _) = Fixture::sh(
        &sb,
        "grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status",
    );
    assert_eq!(code, 0);
    assert!(out.contains("NoNewPrivs:\t1"), "{out}");
    assert!(out.contains("Seccomp:\t2"), "{out}");
    // Docker's default set (0xa80425fb) minus NET_RAW (bit 13).
    assert!(out.contains("CapEff:\t00000000a80405fb"), "{out}");
    f.destroy(&sb);
    f.finish();
}

#[test]
fn memory_pids_and_disk_limits_hold_inside_the_sandbox() {
    skip_unless!(unavailable());
    let f = fixture("c", 3);
    let limits = CgroupLimits {
        cpu_millis: Some(500),
        memory_bytes: Some(64 << 20),
        pids: Some(32),
    };
    let sb = f.start(
        0,
        StartOptions {
            limits,
            disk_bytes: Some(32 << 20),
            ..Default::default()
        },
    );
    // A memory hog (a shell variable grown past the limit) is OOM-killed; execd survives.
    let (code, _, _) = Fixture::sh(
        &sb,
        "x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo ${#x}",
    );
    assert_ne!(code, 0, "the memory hog must be killed");
    let alive = Fixture::sh(&sb, "echo alive");
    assert_eq!(alive.0, 0, "execd survives the OOM kill: {alive:?}");
    let cgroup = fastbox_runtime::cgroup::Cgroup::open(&f.host().cgroups, &f.prefix, &sb.handle.id)
        .expect("the sandbox's cgroup");
    assert!(
        cgroup.memory_events_oom_kills().unwrap() >= 1,
        "the kernel OOM-killed inside the cgroup"
    );
    // A disk filler gets ENOSPC inside; the host is untouched.
    let (code, _, err) = Fixture::sh(&sb, "dd if=/dev/zero of=/fill bs=1M count=100");
    assert_ne!(code, 0);
    assert!(err.contains("No space left"), "{err}");
    let rm = Fixture::sh(&sb, "rm /fill && echo ok");
    assert_eq!(rm.0, 0, "{rm:?}");
    // A fork bomb hits the pids limit.
    let (_, out, err) = Fixture::sh(
        &sb,
        // Count with builtins only: at the limit, nothing can fork.
        "(for i in $(seq 60); do sleep 2 & done) 2>/dev/null; set -- /proc/[0-9]*; echo $#",
    );
    let running: u32 = out
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("bad output {out:?} {err:?}"));
    assert!(
        (20..=32).contains(&running),
        "60 sleeps asked for, the pids limit of 32 let {running} processes run"
    );
    f.destroy(&sb);
    f.finish();
}

/// The CRIU the checkpoint tests use; `None` (the test skipped, with the reason) without one.
fn criu_or_skip() -> Option<(std::path::PathBuf, fastbox_runtime::criu::Criu)> {
    let Some(path) = fastbox_testkit::criu_path() else {
        eprintln!("skipped: no CRIU (run scripts/setup.sh)");
        return None;
    };
    let criu = fastbox_runtime::criu::Criu::at(&path).expect("CRIU >= 4.2");
    Some((path, criu))
}

/// A sandbox in slot 0 with state to carry across a checkpoint: a file in the writable
/// layer (`/marker`) and a process holding a value in memory only (`while sleep`).
fn start_with_state(f: &Fixture) -> fastbox_cli::local_sandbox::LocalSandbox {
    let sb = f.start(0, StartOptions::default());
    let (code, _, _) = Fixture::sh(
        &sb,
        "echo on-disk > /marker; (secret=in-memory-$$; while sleep 1; do :; done) >/dev/null 2>&1 & echo started",
    );
    assert_eq!(code, 0);
    sb
}

#[test]
fn a_checkpointed_sandbox_restores_into_a_new_root_and_network_namespace() {
    skip_unless!(unavailable());
    let Some((_, criu)) = criu_or_skip() else {
        return;
    };
    let f = fixture("d", 4);
    let sb = start_with_state(&f);
    // The loop's subshell alone (the shell that started it may not have exited yet).
    let count = || {
        Fixture::sh(
            &sb,
            "ps -o pid,args | grep 'while sleep' | grep -v grep | wc -l",
        )
        .1
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let mut before = count();
    while before.trim() != "1" && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
        before = count();
    }
    assert_eq!(before.trim(), "1", "one background loop");
    let checkpoint = f.dir.path().join("ckpt");
    let old_address = sb.slot.address;
    f.checkpoint(&criu, &sb, &checkpoint);

    let restored = f.restore(&criu, &checkpoint, 1, &format!("{}-r", f.prefix));
    assert_ne!(
        restored.slot.address, old_address,
        "restored into another slot"
    );
    let (code, out, _) = Fixture::sh(
        &restored,
        "cat /marker; ps -o pid,args | grep 'while sleep' | grep -v grep | wc -l; cat /proc/1/cmdline | tr '\\0' ' '",
    );
    assert_eq!(code, 0);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "on-disk");
    assert_eq!(
        lines[1].trim(),
        before.trim(),
        "the background process was restored"
    );
    assert!(lines[2].starts_with("/.fastbox/execd"), "{}", lines[2]);
    f.destroy(&restored);
    f.finish();
}

#[test]
fn a_checkpoint_naming_the_network_namespace_as_external_still_restores() {
    // Checkpoints taken before CRIU joined the slot's namespace name it as external
    // (`net[<inode>]:fastbox-net`): paused sandboxes and snapshots of an older fastbox.
    skip_unless!(unavailable());
    let Some((criu_path, criu)) = criu_or_skip() else {
        return;
    };
    let f = fixture("f", 8);
    let sb = start_with_state(&f);
    // A checkpoint as today's (metadata, writable layer), the sandbox left running; then its
    // images replaced by a dump the way fastbox made them before.
    let checkpoint = f.dir.path().join("old-ckpt");
    let opts = fastbox_runtime::checkpoint::CheckpointOptions {
        leave_running: true,
        ..Default::default()
    };
    fastbox_runtime::checkpoint::checkpoint_with(&criu, &sb.handle, &checkpoint, opts)
        .expect("checkpoint");
    let images = fastbox_runtime::checkpoint::images_dir(&checkpoint);
    std::fs::remove_dir_all(&images).unwrap();
    std::fs::create_dir(&images).unwrap();
    let inode = sb.slot.netns_inode().unwrap();
    let dumped = std::process::Command::new(&criu_path)
        .args([
            "dump",
            "--tree",
            &sb.handle.init_pid.to_string(),
            "--images-dir",
        ])
        .arg(&images)
        .args(["--log-file", "dump.log", "-v2", "--external"])
        .arg(format!("net[{inode}]:fastbox-net"))
        .arg("--external")
        .arg(format!(
            "mnt[{}]:fastbox-execd",
            fastbox_runtime::spec::EXECD_SANDBOX_PATH
        ))
        .args([
            "--manage-cgroups=ignore",
            "--tcp-established",
            "--file-locks",
            "--network-lock",
            "skip",
        ])
        .status()
        .unwrap();
    assert!(
        dumped.success(),
        "{}",
        std::fs::read_to_string(images.join("dump.log")).unwrap_or_default()
    );
    let names: Vec<String> = std::fs::read_dir(&images)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names.iter().any(|n| n.starts_with("netns-")),
        "the old dump holds the namespace: {names:?}"
    );
    f.destroy(&sb);

    let restored = f.restore(&criu, &checkpoint, 1, &format!("{}-r", f.prefix));
    let (code, out, _) = Fixture::sh(
        &restored,
        "cat /marker; ps -o args | grep 'while sleep' | grep -v grep | wc -l",
    );
    assert_eq!(code, 0);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "on-disk");
    assert_eq!(lines[1].trim(), "1", "the background process was restored");
    f.destroy(&restored);
    f.finish();
}

#[test]
fn sandboxes_cannot_reach_the_host_or_each_other() {
    skip_unless!(unavailable());
    let f = fixture("e", 5);
    let a = f.start(0, StartOptions::default());
    let b = f.start(1, StartOptions::default());
    // A host server on every address.
    let listener = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = std::thread::spawn(move || {
        listener.set_nonblocking(true).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
        let mut accepted = 0;
        while std::time::Instant::now() < deadline {
            if listener.accept().is_ok() {
                accepted += 1;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        accepted
    });
    let targets = [
        (
            a.slot.gateway.to_string(),
            port,
            "the host through the gateway",
        ),
        (
            b.slot.gateway.to_string(),
            port,
            "the host through another slot's gateway",
        ),
        (
            b.slot.address.to_string(),
            fastbox_runtime::spec::EXECD_PORT,
            "another sandbox's execd",
        ),
        (
            "169.254.169.254".to_string(),
            80,
            "the link-local metadata address",
        ),
    ];
    for (addr, port, what) in &targets {
        let (code, out, err) = Fixture::sh(
            &a,
            &format!("timeout 3 nc -w 2 {addr} {port} </dev/null && echo connected"),
        );
        assert!(
            !out.contains("connected"),
            "{what} ({addr}:{port}) was reachable: {out}{err} (exit {code})"
        );
    }
    // The host itself can reach b's execd (positive control: the drops are the filter's).
    assert!(
        std::net::TcpStream::connect((b.slot.address, fastbox_runtime::spec::EXECD_PORT)).is_ok()
    );
    let (_, resolv, _) = Fixture::sh(&a, "cat /etc/resolv.conf");
    assert_eq!(resolv.trim(), format!("nameserver {}", a.slot.gateway));
    let (_, v6, _) = Fixture::sh(&a, "cat /proc/sys/net/ipv6/conf/all/disable_ipv6");
    assert_eq!(v6.trim(), "1", "IPv6 is off inside");
    assert_eq!(
        server.join().unwrap(),
        0,
        "the host server saw no connection"
    );
    f.destroy(&a);
    f.destroy(&b);
    f.finish();
}
