//! Pause, resume, snapshots and fork through a real `fastbox up` (DESIGN §4, §5): processes
//! and memory survive a pause, clones of a snapshot are their own sandboxes with the source's
//! memory, and `kill -9` of the server at any phase of a pause, a resume or a snapshot
//! converges (Running, Paused or Failed with a reason; Ready or Failed) with nothing leaked.

mod common;

use std::time::{Duration, Instant};

use common::execd::Execd;
use common::server::UpServer;
use fastbox_artifact::{ArtifactKind, ArtifactStore, IndexKey, LocalStore, read_manifest};
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use serde_json::{Value, json};

/// A shell that keeps a random value in memory only and hands it to whoever reads the FIFO
/// `/tmp/mem` (the FIFO holds no data on disk; a reader that leaves early is no reason to
/// die of SIGPIPE).
const MEMORY_SERVER: &str = r#"mkfifo /tmp/mem && setsid sh -c 'trap "" PIPE; v=$(head -c 12 /dev/urandom | od -A n -t x1 | tr -d " \n"); while :; do echo "$v" > /tmp/mem; done' </dev/null >/dev/null 2>&1 &
echo started"#;

/// The in-memory value, the uptime, the address and the entrypoint's pid.
const FACTS: &str = r#"echo secret=$(timeout 10 head -n 1 /tmp/mem)
echo uptime=$(cut -d ' ' -f 1 /proc/uptime)
echo address=$(ip -4 -o addr show | awk '$2 != "lo" {print $4}')
echo sleeper=$(pidof sleep)
echo hostname=$(hostname)"#;

fn start_memory_server(e: &Execd) {
    let run = e.sh(MEMORY_SERVER);
    assert!(run.stdout.contains("started"), "{}", run.stdout);
}

fn facts(e: &Execd) -> std::collections::BTreeMap<String, String> {
    eprintln!("facts of {}", e.base);
    let (_, facts) = e.facts(FACTS);
    assert_eq!(facts["secret"].len(), 24, "secret: {:.80}", facts["secret"]);
    facts
}

/// Polls `id` until its state is one of `done` (60 s at most); returns it and its reason.
fn settle(server: &UpServer, id: &str, done: &[&str]) -> (String, Option<String>) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (state, reason) = server.state(id);
        if done.contains(&state.as_str()) {
            return (state, reason);
        }
        assert!(Instant::now() < deadline, "{id} stuck in {state}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The kind of the artifact published under `key` in the server's artifact store, if any.
fn published_kind(server: &UpServer, key: &str) -> Option<ArtifactKind> {
    let store = LocalStore::open(server.data_dir.join("artifacts")).unwrap();
    let digest = store.index_get(&IndexKey::try_new(key).unwrap()).unwrap()?;
    let manifest = read_manifest(&store, &digest).unwrap();
    assert!(
        manifest.meta.rootfs.is_none(),
        "{key}: a checkpoint artifact carries no rootfs of its own"
    );
    Some(manifest.meta.kind)
}

/// The pause checkpoints of sandbox `id` on the node.
fn pause_checkpoints(server: &UpServer, id: &str) -> Vec<String> {
    std::fs::read_dir(server.data_dir.join("snapshots"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&format!("pause-{id}-")))
                .collect()
        })
        .unwrap_or_default()
}

/// Settles `id` among `done` and panics with its reason and the server's log unless it is
/// `want`.
fn expect_state(server: &UpServer, id: &str, done: &[&str], want: &str) {
    let (state, reason) = settle(server, id, done);
    if state != want {
        let (_, events) = server.get(&format!("/v1/sandboxes/{id}/diagnostics/events"));
        panic!(
            "{id} is {state} ({reason:?}), wanted {want}\nevents:\n{}\nlog:\n{}",
            events["content"].as_str().unwrap_or_default(),
            server.log_text()
        );
    }
}

fn uptime(facts: &std::collections::BTreeMap<String, String>) -> f64 {
    facts["uptime"].parse().unwrap()
}

#[test]
fn pause_and_resume_keep_processes_memory_and_address_through_crashes() {
    let Some(mut server) = UpServer::start('j', &[]) else {
        return;
    };
    let id = server.create_busybox();
    let (state, reason) = settle(&server, &id, &["Running", "Failed"]);
    assert_eq!(state, "Running", "{reason:?}\n{}", server.log_text());
    let e = Execd::of(&server, &id);
    start_memory_server(&e);
    let before = facts(&e);

    // Pause: Paused once durable; its endpoints are gone meanwhile.
    let (status, body) = server.post(&format!("/v1/sandboxes/{id}/pause"), &json!({}));
    assert_eq!(status, 202, "{body}");
    expect_state(&server, &id, &["Paused", "Failed", "Running"], "Paused");
    assert_eq!(server.ping(&id), 409, "a paused sandbox has no endpoint");
    let pauses = pause_checkpoints(&server, &id);
    assert_eq!(pauses.len(), 1, "one pause checkpoint: {pauses:?}");
    let pause_key = pauses[0].clone();
    assert_eq!(
        published_kind(&server, &pause_key),
        Some(ArtifactKind::Checkpoint),
        "a pause is durable in the artifact store"
    );
    let (status, _) = server.post(&format!("/v1/sandboxes/{id}/pause"), &json!({}));
    assert_eq!(status, 409, "pausing a paused sandbox");

    // Resume: the same processes, memory, address and hostname; uptime went on.
    let (status, body) = server.post(&format!("/v1/sandboxes/{id}/resume"), &json!({}));
    assert_eq!(status, 202, "{body}");
    expect_state(&server, &id, &["Running", "Paused", "Failed"], "Running");
    let e = Execd::of(&server, &id);
    let after = facts(&e);
    for key in ["secret", "address", "sleeper", "hostname"] {
        assert_eq!(before[key], after[key], "{key} across pause/resume");
    }
    assert!(uptime(&after) >= uptime(&before), "{before:?} {after:?}");
    let (status, _) = server.post(&format!("/v1/sandboxes/{id}/resume"), &json!({}));
    assert_eq!(status, 409, "resuming a running sandbox");
    // A resumed sandbox's pause checkpoint goes, in the background.
    let deadline = Instant::now() + Duration::from_secs(10);
    while published_kind(&server, &pause_key).is_some()
        || !pause_checkpoints(&server, &id).is_empty()
    {
        assert!(
            Instant::now() < deadline,
            "the pause checkpoint {pause_key} stayed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // kill -9 of the server at several points of a pause, then of a resume.
    let mut last = after;
    for delay_ms in [0u64, 30, 90, 250] {
        let (status, body) = server.post(&format!("/v1/sandboxes/{id}/pause"), &json!({}));
        assert_eq!(status, 202, "{body}");
        std::thread::sleep(Duration::from_millis(delay_ms));
        server.kill9();
        server.spawn();
        let (state, reason) = settle(&server, &id, &["Paused", "Running", "Failed"]);
        eprintln!("pause killed after {delay_ms} ms: {state} {reason:?}");
        assert_ne!(state, "Failed", "a pause lost the sandbox: {reason:?}");
        if state == "Paused" {
            let (status, body) = server.post(&format!("/v1/sandboxes/{id}/resume"), &json!({}));
            assert_eq!(status, 202, "{body}");
            std::thread::sleep(Duration::from_millis(delay_ms));
            server.kill9();
            server.spawn();
            let (state, reason) = settle(&server, &id, &["Paused", "Running", "Failed"]);
            eprintln!("resume killed after {delay_ms} ms: {state} {reason:?}");
            assert_ne!(state, "Failed", "a resume lost the sandbox: {reason:?}");
            if state == "Paused" {
                let (status, _) = server.post(&format!("/v1/sandboxes/{id}/resume"), &json!({}));
                assert_eq!(status, 202);
                expect_state(&server, &id, &["Running", "Failed"], "Running");
            }
        }
        let now = facts(&Execd::of(&server, &id));
        for key in ["secret", "address", "sleeper"] {
            assert_eq!(last[key], now[key], "{key} after a crash at {delay_ms} ms");
        }
        last = now;
    }

    // A paused sandbox that is deleted leaves nothing: no checkpoint, no slot.
    let (status, _) = server.post(&format!("/v1/sandboxes/{id}/pause"), &json!({}));
    assert_eq!(status, 202);
    expect_state(&server, &id, &["Paused", "Failed"], "Paused");
    assert_eq!(server.delete(&format!("/v1/sandboxes/{id}")), 204);
    expect_state(&server, &id, &["Terminated", "Failed"], "Terminated");
    let snapshots = server.data_dir.join("snapshots");
    let left: Vec<_> = std::fs::read_dir(&snapshots)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        left.is_empty(),
        "checkpoints left after the delete: {left:?}"
    );
    server.finish();
}

/// Polls snapshot `sid` until it is Ready or Failed.
fn settle_snapshot(server: &UpServer, sid: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, body) = server.get(&format!("/v1/snapshots/{sid}"));
        assert_eq!(status, 200, "{body}");
        if matches!(body["status"]["state"].as_str(), Some("Ready" | "Failed")) {
            return body;
        }
        assert!(Instant::now() < deadline, "snapshot {sid} stuck: {body}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Pings the sandbox's execd in a loop (new connection each time, through the node proxy)
/// while a live snapshot is taken; returns failures, the largest gap between two answers,
/// and how many pings were sent.
fn ping_during_snapshot(server: &UpServer, id: &str, e: &Execd) -> (usize, Duration, usize) {
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let monitor = scope.spawn(|| {
            let (mut failures, mut pings, mut max_gap) = (0, 0, Duration::ZERO);
            let mut last = Instant::now();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                pings += 1;
                if e.try_ping(&e.token).is_ok_and(|s| s == 200) {
                    max_gap = max_gap.max(last.elapsed());
                    last = Instant::now();
                } else {
                    failures += 1;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            (failures, max_gap, pings)
        });
        std::thread::sleep(Duration::from_millis(100));
        let (status, snap) = server.post(&format!("/v1/sandboxes/{id}/snapshots"), &json!({}));
        assert_eq!(status, 202, "{snap}");
        let sid = snap["id"].as_str().unwrap().to_string();
        let settled = settle_snapshot(server, &sid);
        std::thread::sleep(Duration::from_millis(100));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(settled["status"]["state"], "Ready", "{settled}");
        eprintln!("monitored snapshot: {}", settled["status"]["message"]);
        assert_eq!(server.delete(&format!("/v1/snapshots/{sid}")), 204);
        monitor.join().unwrap()
    })
}

#[test]
fn snapshots_make_independent_clones_and_survive_crashes() {
    let Some(mut server) = UpServer::start('l', &[]) else {
        return;
    };
    let id = server.create_busybox();
    server.wait_state(&id, "Running");
    let source = Execd::of(&server, &id);
    start_memory_server(&source);
    let original = facts(&source);

    let (status, snap) = server.post(
        &format!("/v1/sandboxes/{id}/snapshots"),
        &json!({"name": "first"}),
    );
    assert_eq!(status, 202, "{snap}");
    let sid = snap["id"].as_str().unwrap().to_string();
    let snap = settle_snapshot(&server, &sid);
    assert_eq!(snap["status"]["state"], "Ready", "{snap}");
    assert_eq!(snap["sandboxId"], id.as_str());
    assert_eq!(published_kind(&server, &sid), Some(ArtifactKind::Snapshot));
    // The source ran on.
    assert_eq!(facts(&source)["sleeper"], original["sleeper"]);

    // A ping monitor during a live snapshot: the sandbox keeps serving, frozen only briefly.
    let (failures, max_gap, pings) = ping_during_snapshot(&server, &id, &source);
    eprintln!(
        "ping monitor during a live snapshot: {pings} pings, {failures} failed, largest gap {max_gap:?}"
    );
    assert_eq!(failures, 0, "pings failed during a live snapshot");
    assert!(pings > 10, "the monitor ran ({pings} pings)");

    // A foreign entrypoint is refused and records nothing; the SDK's default is ignored.
    let before = server.ids().len();
    let (status, body) = server.post(
        "/v1/sandboxes",
        &json!({"snapshotId": sid, "entrypoint": ["/bin/sh", "-c", "echo other"]}),
    );
    assert_eq!(status, 400, "{body}");
    assert_eq!(
        server.ids().len(),
        before,
        "a refused create recorded a sandbox"
    );
    let (status, clone) = server.post(
        "/v1/sandboxes",
        &json!({"snapshotId": sid, "entrypoint": ["tail", "-f", "/dev/null"], "timeout": 600}),
    );
    assert_eq!(status, 202, "{clone}");
    let clone_id = clone["id"].as_str().unwrap().to_string();
    expect_state(&server, &clone_id, &["Running", "Failed"], "Running");
    let (_, got) = server.get(&format!("/v1/sandboxes/{clone_id}"));
    assert_eq!(got["snapshotId"], sid.as_str(), "{got}");

    // Fork: more clones of a new live snapshot, each with the source's memory.
    let (status, forked) = server.post(&format!("/v1/sandboxes/{id}/fork"), &json!({"count": 2}));
    assert_eq!(status, 202, "{forked}");
    let mut clones = vec![clone_id];
    clones.extend(
        forked["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["id"].as_str().unwrap().to_string()),
    );
    assert_eq!(clones.len(), 3);
    let mut hostnames = vec![original["hostname"].clone()];
    let mut addresses = vec![original["address"].clone()];
    for c in &clones {
        assert_eq!(
            settle(&server, c, &["Running", "Failed"]).0,
            "Running",
            "{c}"
        );
        let e = Execd::of(&server, c);
        assert_ne!(e.token, source.token, "a clone's execd has its own token");
        assert_eq!(
            source.ping_with(&e.token),
            401,
            "the source refuses a clone's token"
        );
        let f = facts(&e);
        assert_eq!(
            f["secret"], original["secret"],
            "{c} has the source's memory"
        );
        hostnames.push(f["hostname"].clone());
        addresses.push(f["address"].clone());
        // Its writable layer is its own.
        e.sh(&format!("echo {c} > /tmp/mark"));
    }
    for list in [&hostnames, &addresses] {
        let unique: std::collections::BTreeSet<_> = list.iter().collect();
        assert_eq!(unique.len(), list.len(), "clones share {list:?}");
    }
    let marks = source.sh("cat /tmp/mark 2>/dev/null || echo none").stdout;
    assert_eq!(
        marks.trim(),
        "none",
        "a clone wrote into the source's layer"
    );

    // A create may follow a snapshot's 202 at once: it waits for the snapshot.
    let (status, snap) = server.post(&format!("/v1/sandboxes/{id}/snapshots"), &json!({}));
    assert_eq!(status, 202, "{snap}");
    let quick_sid = snap["id"].as_str().unwrap().to_string();
    let quick = running_clone_of(&server, &quick_sid);
    assert_eq!(
        facts(&Execd::of(&server, &quick))["secret"],
        original["secret"]
    );
    assert_eq!(server.delete(&format!("/v1/snapshots/{quick_sid}")), 204);

    // kill -9 while a snapshot is taken: it ends Ready or Failed with a reason.
    for delay_ms in [0u64, 40, 150] {
        let (status, snap) = server.post(&format!("/v1/sandboxes/{id}/snapshots"), &json!({}));
        assert_eq!(status, 202, "{snap}");
        std::thread::sleep(Duration::from_millis(delay_ms));
        server.kill9();
        server.spawn();
        let sid = snap["id"].as_str().unwrap();
        let settled = settle_snapshot(&server, sid);
        eprintln!("snapshot killed after {delay_ms} ms: {}", settled["status"]);
        if settled["status"]["state"] == "Failed" {
            assert!(settled["status"]["reason"].is_string(), "{settled}");
        }
        assert_eq!(server.state(&id).0, "Running", "the source survives");
        assert_eq!(
            facts(&Execd::of(&server, &id))["secret"],
            original["secret"]
        );
        assert_eq!(server.delete(&format!("/v1/snapshots/{sid}")), 204);
        let (status, _) = server.get(&format!("/v1/snapshots/{sid}"));
        assert_eq!(status, 404);
    }

    // List, filter, delete.
    let (_, listed) = server.get(&format!("/v1/snapshots?sandboxId={id}&name=first"));
    assert_eq!(listed["items"].as_array().unwrap().len(), 1, "{listed}");
    // A state this server does not know matches nothing (SDKs may send any name).
    let (status, listed) = server.get("/v1/snapshots?state=Bogus");
    assert_eq!(status, 200, "{listed}");
    assert_eq!(listed["items"].as_array().unwrap().len(), 0, "{listed}");
    let (_, listed) = server.get(&format!(
        "/v1/snapshots?sandboxId={id}&name=first&state=Bogus&state=ready"
    ));
    assert_eq!(listed["items"].as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(server.delete(&format!("/v1/snapshots/{sid}")), 204);
    assert_eq!(
        published_kind(&server, &sid),
        None,
        "a deleted snapshot is unpublished"
    );
    let (status, body) = server.post("/v1/sandboxes", &json!({"snapshotId": sid}));
    assert_eq!(status, 404, "{body}");
    assert_eq!(server.delete("/v1/snapshots/snap_unknown"), 404);
    server.finish();
}

/// A shell holding 48 MiB of text in memory, so a snapshot of the sandbox is big enough to
/// be cloned lazily and its transfer takes a moment.
const MEMORY_BALLAST: &str = r#"setsid sh -c 'v=$(yes fastbox-lazy-clone | head -c 50331648); while :; do sleep 3600; done' </dev/null >/dev/null 2>&1 &
echo started"#;

/// `POST path body`, sent again while the sandbox is still busy finishing its previous
/// operation (409; 10 s at most); returns the status and body of the last answer.
fn post_when_idle(server: &UpServer, path: &str, body: &Value) -> (u16, Value) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, body) = server.post(path, body);
        if status != 409 || Instant::now() >= deadline {
            return (status, body);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether the server's log shows sandbox `id` restored lazily since it started logging.
fn restored_lazily(server: &UpServer, id: &str) -> bool {
    server
        .log_text()
        .lines()
        .any(|l| l.contains("sandbox restored") && l.contains(id) && l.contains("lazy.prepare"))
}

/// Resumes paused `id`, waits until it is `Running`, kills the server (`kill -9`) and starts
/// it again; the sandbox must end `Running`.
fn resume_then_kill9(server: &mut UpServer, id: &str) {
    let (status, body) = post_when_idle(server, &format!("/v1/sandboxes/{id}/resume"), &json!({}));
    assert_eq!(status, 202, "{body}");
    expect_state(server, id, &["Running", "Failed", "Paused"], "Running");
    assert!(restored_lazily(server, id), "the resume was not lazy");
    server.kill9();
    server.spawn();
    let (state, reason) = settle(server, id, &["Running", "Failed", "Paused"]);
    if state != "Running" {
        let (_, got) = server.get(&format!("/v1/sandboxes/{id}"));
        panic!("{state} {reason:?}: {got}\n{}", server.log_text());
    }
}

/// Whether the server's log shows that it did not adopt `id` after a restart.
fn not_adopted(server: &UpServer, id: &str) -> bool {
    server
        .log_text()
        .lines()
        .any(|l| l.contains("not adopted") && l.contains(id))
}

/// Stops the lazy-pages daemon of `id` (its process group: the guarding shell and CRIU) as
/// soon as the sandbox's transfer mark names it, if the transfer has not ended by then (20 s
/// at most); returns the group.
fn catch_daemon(server: &UpServer, id: &str) -> Option<i32> {
    let mark = server
        .data_dir
        .join("sandboxes")
        .join(id)
        .join("lazy-transfer");
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Some(group) = std::fs::read_to_string(&mark).ok().and_then(|text| {
            text.lines()
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse::<i32>()
                .ok()
        }) {
            let stopped = killpg(Pid::from_raw(group), Signal::SIGSTOP).is_ok();
            // Still marked, and CRIU still there, once stopped: the transfer had not ended.
            if stopped && mark.exists() && !live_children(group).is_empty() {
                return Some(group);
            }
            let _ = killpg(Pid::from_raw(group), Signal::SIGCONT);
            return None;
        }
        if server.state(id).0 == "Running" && !mark.exists() {
            return None;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    None
}

/// Kills CRIU in the stopped daemon group `group`, then the server (`kill -9`): the group,
/// orphaned, goes on, and its guarding shell, which outlives the server, freezes the sandbox
/// as after any failed daemon.
fn fail_daemon(group: i32, server: &mut UpServer) {
    let children = live_children(group);
    assert!(
        !children.is_empty(),
        "the daemon's shell {group} has no child"
    );
    for child in children {
        let _ = kill(Pid::from_raw(child), Signal::SIGKILL);
    }
    server.kill9();
    let _ = killpg(Pid::from_raw(group), Signal::SIGCONT);
    std::thread::sleep(Duration::from_millis(200));
}

/// The children of `parent` that have not exited (`pid (comm) state ppid ...` in
/// /proc/PID/stat).
fn live_children(parent: i32) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
                let mut fields = stat
                    .rsplit_once(')')
                    .map(|(_, rest)| rest.split_whitespace());
                let state = fields.as_mut().and_then(|f| f.next());
                let ppid = fields
                    .as_mut()
                    .and_then(|f| f.next())
                    .and_then(|p| p.parse::<i32>().ok());
                ppid == Some(parent) && !matches!(state, Some("Z" | "X"))
            })
        })
        .collect()
}

/// Freezes the cgroup of sandbox `id` (v1 freezer or v2 `cgroup.freeze`), as the guard of a
/// failed lazy-pages daemon does.
fn freeze(server: &UpServer, id: &str) {
    let v1 = format!(
        "/sys/fs/cgroup/freezer/{}/{id}/freezer.state",
        server.prefix
    );
    let v2 = format!("/sys/fs/cgroup/{}/{id}/cgroup.freeze", server.prefix);
    let written = std::fs::write(&v1, "FROZEN").or_else(|_| std::fs::write(&v2, "1"));
    assert!(written.is_ok(), "no freezer for {id}: {v1}, {v2}");
}

/// `POST /v1/sandboxes {"snapshotId": sid}` (202), then waits until the clone is `Running`;
/// returns its id.
fn running_clone_of(server: &UpServer, sid: &str) -> String {
    let (status, clone) = server.post("/v1/sandboxes", &json!({"snapshotId": sid}));
    assert_eq!(status, 202, "{clone}");
    let id = clone["id"].as_str().unwrap().to_string();
    expect_state(server, &id, &["Running", "Failed"], "Running");
    id
}

/// Pauses `id` and waits until it is `Paused`.
fn pause(server: &UpServer, id: &str) {
    let (status, body) = post_when_idle(server, &format!("/v1/sandboxes/{id}/pause"), &json!({}));
    assert_eq!(status, 202, "{body}");
    expect_state(server, id, &["Paused", "Failed", "Running"], "Paused");
}

#[test]
fn lazy_restores_keep_the_memory_and_a_restart_mid_transfer_converges() {
    // Every clone or resume of a checkpoint of 1 MiB or more starts before its memory is
    // in place.
    let Some(mut server) = UpServer::start('g', &["--lazy-restore-min-mib", "1"]) else {
        return;
    };
    let id = server.create_busybox();
    server.wait_state(&id, "Running");
    let source = Execd::of(&server, &id);
    start_memory_server(&source);
    assert!(source.sh(MEMORY_BALLAST).stdout.contains("started"));
    let original = facts(&source);

    // A lazy resume: the same processes, memory and address.
    pause(&server, &id);
    let (status, body) = post_when_idle(&server, &format!("/v1/sandboxes/{id}/resume"), &json!({}));
    assert_eq!(status, 202, "{body}");
    expect_state(&server, &id, &["Running", "Failed", "Paused"], "Running");
    assert!(restored_lazily(&server, &id), "the resume was not lazy");
    let resumed = facts(&Execd::of(&server, &id));
    // (Not the `sleep` pids: the ballast's own `sleep` may start after `original` was read.)
    for key in ["secret", "address"] {
        assert_eq!(resumed[key], original[key], "{key} across a lazy resume");
    }
    // kill -9 right after a lazy resume answers: the daemon reads the local checkpoint and
    // finishes on its own, so the restart adopts the sandbox with all of its memory.
    pause(&server, &id);
    resume_then_kill9(&mut server, &id);
    assert!(!not_adopted(&server, &id), "a finished transfer is adopted");
    let after = facts(&Execd::of(&server, &id));
    for key in ["secret", "address"] {
        assert_eq!(
            after[key], original[key],
            "{key} across a restart mid-transfer"
        );
    }
    let (status, snap) = post_when_idle(
        &server,
        &format!("/v1/sandboxes/{id}/snapshots"),
        &json!({}),
    );
    assert_eq!(status, 202, "{snap}");
    let sid = snap["id"].as_str().unwrap().to_string();
    assert_eq!(settle_snapshot(&server, &sid)["status"]["state"], "Ready");

    // Clones answer with the source's memory, copied in lazily (far fewer transfers run than
    // `LAZY_TRANSFERS_MAX`).
    let (status, forked) = post_when_idle(
        &server,
        &format!("/v1/sandboxes/{id}/fork"),
        &json!({"count": 2}),
    );
    assert_eq!(status, 202, "{forked}");
    let mut clones: Vec<String> = forked["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["id"].as_str().unwrap().to_string())
        .collect();
    let (status, clone) = server.post("/v1/sandboxes", &json!({"snapshotId": sid}));
    assert_eq!(status, 202, "{clone}");
    clones.push(clone["id"].as_str().unwrap().to_string());
    for c in &clones {
        expect_state(&server, c, &["Running", "Failed"], "Running");
        let f = facts(&Execd::of(&server, c));
        assert_eq!(
            f["secret"], original["secret"],
            "{c} has the source's memory"
        );
    }
    // The fork's clones were restored from its dump in the staging area, before the
    // snapshot was on disk; the snapshot is kept all the same, and the staged files go once
    // no clone copies its memory in from them.
    for c in &clones[..2] {
        assert!(
            server
                .log_text()
                .lines()
                .any(|l| l.contains("sandbox restored")
                    && l.contains(c.as_str())
                    && l.contains(".staged")),
            "{c} was not restored from the staged dump"
        );
    }
    let fork_snapshot = forked["snapshotId"].as_str().unwrap();
    assert_eq!(
        settle_snapshot(&server, fork_snapshot)["status"]["state"],
        "Ready"
    );
    let staging = fastbox_fastlet::staging::root(&server.data_dir);
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::fs::read_dir(&staging).is_ok_and(|mut d| d.next().is_some()) {
        assert!(
            Instant::now() < deadline,
            "staged files left: {:?}",
            std::fs::read_dir(&staging).map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // A snapshot of a lazy clone waits for its memory, so it holds all of it.
    let (status, again) = server.post(
        &format!("/v1/sandboxes/{}/snapshots", clones[0]),
        &json!({}),
    );
    assert_eq!(status, 202, "{again}");
    let again = again["id"].as_str().unwrap().to_string();
    assert_eq!(settle_snapshot(&server, &again)["status"]["state"], "Ready");
    let grandchild = running_clone_of(&server, &again);
    assert_eq!(
        facts(&Execd::of(&server, &grandchild))["secret"],
        original["secret"]
    );
    for c in clones.iter().chain([&grandchild]) {
        assert!(restored_lazily(&server, c), "{c} was not cloned lazily");
    }

    // kill -9 right after a clone answers, and its transfer failed while the server was
    // down (frozen by hand, as its daemon's guard does): it is Failed with the reason and
    // removed, never Running with pages missing.
    let victim = running_clone_of(&server, &sid);
    server.kill9();
    freeze(&server, &victim);
    server.spawn();
    let (state, reason) = settle(&server, &victim, &["Running", "Failed"]);
    let (_, got) = server.get(&format!("/v1/sandboxes/{victim}"));
    assert_eq!(state, "Failed", "{reason:?} {got}");
    assert!(
        got["status"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("memory")),
        "{got}"
    );
    // Deleting the snapshots waits for no transfer any more; the clones run on.
    for s in [&sid, &again] {
        assert_eq!(server.delete(&format!("/v1/snapshots/{s}")), 204);
    }
    assert_eq!(
        facts(&Execd::of(&server, &clones[1]))["secret"],
        original["secret"]
    );

    // A resume whose daemon fails while the server is down: caught mid-transfer (stopped
    // as soon as the mark names it), the server killed, then the daemon killed, so its
    // guard freezes the sandbox. Its checkpoint is still kept (the transfer never ended), so
    // the restart resumes it again from there: it runs with all of its memory.
    let caught = (0..10).any(|_| {
        pause(&server, &id);
        let (status, body) =
            post_when_idle(&server, &format!("/v1/sandboxes/{id}/resume"), &json!({}));
        assert_eq!(status, 202, "{body}");
        let daemon = catch_daemon(&server, &id);
        expect_state(&server, &id, &["Running", "Failed", "Paused"], "Running");
        let Some(group) = daemon else { return false };
        fail_daemon(group, &mut server);
        server.spawn();
        true
    });
    assert!(caught, "no lazy resume was caught mid-transfer in 10 tries");
    let (state, reason) = settle(&server, &id, &["Running", "Failed", "Paused"]);
    assert!(not_adopted(&server, &id), "a frozen sandbox is not adopted");
    if state != "Running" {
        let (_, got) = server.get(&format!("/v1/sandboxes/{id}"));
        panic!("{state} {reason:?}: {got}\n{}", server.log_text());
    }
    let after = facts(&Execd::of(&server, &id));
    for key in ["secret", "address"] {
        assert_eq!(after[key], original[key], "{key} after resuming again");
    }
    server.finish();
}
