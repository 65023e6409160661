//! Clones of one golden checkpoint (`docs/clones.md`), end to end.
//!
//! Two sandboxes of one image are two restores of its template. Through each one's execd,
//! reached the way a client reaches it (the endpoint the API hands out), they must show their
//! own token, hostname, identity files, address, kernel randomness and writable layer, and the
//! memory they do share: execd's, frozen at checkpoint time. A second test checkpoints a
//! sandbox with a Python process running and shows what every clone of it inherits (its
//! `random` state and hash seed) and that `random.seed()` after the restore is the cure.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::Fixture;
use common::execd::Execd;
use common::server::UpServer;
use fastbox_cli::local_sandbox::{LocalHost, LocalSandbox, SlotSource, StartOptions};
use serde_json::Value;

/// Everything compared between the clones, one `key=value` line each (busybox sh).
const PROBE: &str = r#"
at_random() { od -A n -t x8 /proc/$1/auxv | awk '$1 == "0000000000000019" {print $2}'; }
random_bytes() { dd if=/proc/$1/mem bs=1 skip=$((0x$(at_random $1))) count=16 2>/dev/null | od -A n -t x1 | tr -d ' \n'; }
echo "hostname=$(hostname)"
echo "etc_hostname=$(cat /etc/hostname)"
echo "etc_hosts=$(awk '$1 == "127.0.1.1" {print $2}' /etc/hosts)"
echo "nameserver=$(awk '$1 == "nameserver" {print $2}' /etc/resolv.conf)"
echo "address=$(ip -4 -o addr show dev eth0 | awk '{print $4}')"
echo "gateway=$(ip -4 route show default | awk '{print $3}')"
echo "boot_id=$(cat /proc/sys/kernel/random/boot_id)"
echo "uuid=$(cat /proc/sys/kernel/random/uuid)"
echo "urandom=$(head -c 16 /dev/urandom | od -A n -t x1 | tr -d ' \n')"
echo "pid1=$(tr '\0' ' ' < /proc/1/cmdline)"
echo "pid1_environ=$(tr '\0' ' ' < /proc/1/environ)"
echo "pid1_start_ticks=$(cut -d ' ' -f 22 /proc/1/stat)"
echo "pid1_execd_base=$(awk '$6 == "/.fastbox/execd" {print $1; exit}' /proc/1/maps)"
echo "pid1_stack=$(awk '$6 == "[stack]" {print $1}' /proc/1/maps)"
echo "pid1_at_random=$(random_bytes 1)"
echo "shell_stack=$(awk '$6 == "[stack]" {print $1}' /proc/$$/maps)"
echo "shell_at_random=$(random_bytes $$)"
echo "shell_pid=$$"
echo "uptime=$(cut -d ' ' -f 1 /proc/uptime)"
echo "pid1_fd_paths=$(ls -l /proc/1/fd | awk '$NF ~ /^\// {print $NF}' | sort -u | tr '\n' ' ')"
echo "lower=$(awk '$5 == "/" {print $NF}' /proc/self/mountinfo | tr ',' '\n' | sed -n 's/^lowerdir=//p')"
echo "upper=$(awk '$5 == "/" {print $NF}' /proc/self/mountinfo | tr ',' '\n' | sed -n 's/^upperdir=//p')"
"#;

/// Creates a busybox sandbox (`pool_off`: restored for this request, not taken from the warm
/// pool), waits until it runs and returns its id.
fn create(server: &UpServer, pool_off: bool) -> String {
    let mut body = serde_json::json!({
        "image": {"uri": "fastbox/busybox"},
        "entrypoint": ["sleep", "100000"],
        "timeout": 3600,
        "resourceLimits": {"cpu": "1", "memory": "256Mi"},
    });
    if pool_off {
        body["extensions"] = serde_json::json!({"fastbox.io/pool": "off"});
    }
    let (status, created) = server.post("/v1/sandboxes", &body);
    assert_eq!(status, 202, "{created}");
    let id = created["id"].as_str().unwrap().to_string();
    server.wait_state(&id, "Running");
    id
}

/// Creates sandboxes until one comes from the warm pool (it fills in the background after
/// `fastbox up`); the others are deleted.
fn create_from_pool(server: &UpServer) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let id = create(server, false);
        if started_event(server, &id).contains("Started: pool:") {
            return id;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no create was served by the warm pool within 60 s"
        );
        assert_eq!(server.delete(&format!("/v1/sandboxes/{id}")), 204);
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The `Started` line of a sandbox's lifecycle events (how it was started, phase timings).
fn started_event(server: &UpServer, id: &str) -> String {
    let (_, events) = server.get(&format!("/v1/sandboxes/{id}/diagnostics/events"));
    events["content"]
        .as_str()
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("Started"))
        .collect::<Vec<_>>()
        .join(" | ")
}

/// The golden tokens recorded by the server's templates (`DATA_DIR/templates/*/template.json`).
fn golden_tokens(data_dir: &Path) -> Vec<String> {
    std::fs::read_dir(data_dir.join("templates"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("template.json")).ok())
        .filter_map(|b| serde_json::from_slice::<Value>(&b).ok())
        .filter_map(|t| t["golden_token"].as_str().map(str::to_string))
        .collect()
}

fn host_uptime() -> f64 {
    std::fs::read_to_string("/proc/uptime")
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn clones_of_one_checkpoint_get_their_own_identity_and_writable_layer() {
    let Some(server) = UpServer::start('u', &[]) else {
        return;
    };
    // A taken from the warm pool, B restored on demand: both are restores of the image's one
    // template, by the two start paths.
    let a = create_from_pool(&server);
    let b = create(&server, true);
    assert!(started_event(&server, &b).contains("Started: restore:"));
    let (ea, eb) = (Execd::of(&server, &a), Execd::of(&server, &b));

    // Tokens: each clone was claimed with its own; neither accepts the other's nor the
    // template's.
    assert_ne!(ea.token, eb.token);
    assert_eq!(ea.ping_with(&ea.token), 200);
    assert_eq!(eb.ping_with(&eb.token), 200);
    assert_eq!(eb.ping_with(&ea.token), 401, "B's execd refuses A's token");
    assert_eq!(ea.ping_with(&eb.token), 401, "A's execd refuses B's token");
    let golden = golden_tokens(&server.data_dir);
    assert!(!golden.is_empty(), "the image's template records its token");
    for token in &golden {
        assert_eq!(
            ea.ping_with(token),
            401,
            "a claimed clone refuses the template's token"
        );
        assert_eq!(
            eb.ping_with(token),
            401,
            "a claimed clone refuses the template's token"
        );
    }

    let host_before = host_uptime();
    let (id_a, fa) = ea.facts(PROBE);
    let (id_b, fb) = eb.facts(PROBE);
    let host_after = host_uptime();
    eprintln!("clone A {a}: {fa:#?}\nclone B {b}: {fb:#?}");
    let both = |key: &str| -> (String, String) {
        let get = |f: &BTreeMap<String, String>, n: &str| {
            f.get(key)
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| panic!("clone {n} printed no {key}"))
                .clone()
        };
        (get(&fa, "A"), get(&fb, "B"))
    };

    // execd is PID 1 in both, and both are the same checkpoint: execd's 16 AT_RANDOM bytes
    // (the kernel's per-exec randomness, from which glibc derives the stack-protector canary
    // and the pointer guard) and its memory layout are identical.
    for (n, f) in [("A", &fa), ("B", &fb)] {
        assert!(
            f["pid1"].starts_with("/.fastbox/execd"),
            "PID 1 of {n}: {}",
            f["pid1"]
        );
    }
    let (ra, rb) = both("pid1_at_random");
    assert_eq!(
        ra.len(),
        32,
        "16 bytes of AT_RANDOM read from /proc/1/mem: {ra}"
    );
    assert_eq!(
        ra, rb,
        "execd's AT_RANDOM bytes are the checkpoint's in every clone"
    );
    let (xa, xb) = both("pid1_execd_base");
    assert_eq!(xa, xb, "execd's load address (ASLR) is the checkpoint's");
    let (sa, sb) = both("pid1_stack");
    assert_eq!(sa, sb, "execd's stack address (ASLR) is the checkpoint's");
    let (env_a, env_b) = both("pid1_environ");
    assert_eq!(
        env_a, env_b,
        "execd's initial environment block is the checkpoint's"
    );
    // ... but execd blanked its token there before the checkpoint was taken.
    assert!(
        !golden.is_empty() && golden.iter().all(|t| !env_a.contains(t.as_str())),
        "the template's execd token is readable in /proc/1/environ of a clone"
    );
    // Its restored descriptors are new kernel objects; none is a file on the writable layer.
    let (fda, fdb) = both("pid1_fd_paths");
    assert_eq!(fda, fdb);
    assert_eq!(fda, "/dev/null", "execd's only open path is /dev/null");
    // A process started after the restore is a fresh exec: fresh layout, fresh AT_RANDOM.
    let (sra, srb) = both("shell_at_random");
    assert_ne!(sra, srb, "a new process gets new AT_RANDOM bytes");
    assert_ne!(sra, ra);
    let (ssa, ssb) = both("shell_stack");
    assert_ne!(ssa, ssb, "a new process gets a new stack address");
    // execd's ids come from getrandom(2) when used: the first command run in each clone after
    // the same checkpoint got a different id.
    assert!(!id_a.is_empty() && !id_b.is_empty());
    assert_ne!(id_a, id_b, "command ids differ between clones");

    // Identity: hostname (UTS and /etc), /etc/hosts, resolv.conf and address are the clone's.
    for (n, id, f) in [("A", &a, &fa), ("B", &b, &fb)] {
        assert_eq!(&f["hostname"], id, "hostname of {n} is its sandbox id");
        assert_eq!(&f["etc_hostname"], id, "/etc/hostname of {n}");
        assert_eq!(&f["etc_hosts"], id, "/etc/hosts of {n} names it");
        assert_eq!(
            f["nameserver"], f["gateway"],
            "resolv.conf of {n} names its gateway"
        );
    }
    let (aa, ab) = both("address");
    assert_ne!(aa, ab, "each clone has its own address");
    let (na, nb) = both("nameserver");
    assert_ne!(na, nb, "each clone's resolv.conf names its own gateway");

    // Kernel randomness is the host's and not part of any checkpoint.
    let (ua, ub) = both("uuid");
    assert_ne!(ua, ub, "/proc/sys/kernel/random/uuid differs");
    let (da, db) = both("urandom");
    assert_eq!(da.len(), 32);
    assert_ne!(da, db, "/dev/urandom differs");
    // boot_id is the host kernel's: the same in both clones and on the host.
    let host_boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    let (ba, bb) = both("boot_id");
    assert_eq!(ba, bb, "clones on one host share boot_id");
    assert_eq!(ba, host_boot_id.trim(), "boot_id is the host's");

    // Writable layers: each clone has its own filesystem, a private copy of the template's.
    let (la, lb) = both("lower");
    assert_eq!(
        la, lb,
        "the image rootfs is the shared read-only lower layer"
    );
    let (pa, pb) = both("upper");
    let (upper_a, upper_b) = (PathBuf::from(pa), PathBuf::from(pb));
    assert_ne!(upper_a, upper_b);
    let sandboxes = server.data_dir.join("sandboxes");
    for upper in [&upper_a, &upper_b] {
        assert!(
            upper.starts_with(&sandboxes),
            "{} is under {}",
            upper.display(),
            sandboxes.display()
        );
        let dir = upper.parent().and_then(Path::parent).unwrap();
        assert!(
            dir.join("layer.img").is_file(),
            "{} has its own layer.img",
            dir.display()
        );
    }
    let dev = |p: &Path| std::fs::metadata(p).unwrap().dev();
    assert_ne!(
        dev(&upper_a),
        dev(&upper_b),
        "the upper layers are different filesystems"
    );
    let marked = ea.sh("for f in /tmp/x /root/x /x /dev/shm/x; do echo A > $f; done; cat /tmp/x /root/x /x /dev/shm/x");
    assert_eq!(marked.stdout, "A\nA\nA\nA\n");
    let seen = eb.sh("for f in /tmp/x /root/x /x /dev/shm/x; do [ -e $f ] && echo $f; done; true");
    assert_eq!(seen.stdout, "", "B sees none of A's files");
    for f in ["tmp/x", "root/x", "x", ".fastbox/dev/shm/x"] {
        assert!(upper_a.join(f).is_file(), "A's {f} is in A's layer");
        assert!(!upper_b.join(f).exists(), "A's {f} is not in B's layer");
    }
    // `/dev` is a bind of the writable layer's `/.fastbox/dev` (no tmpfs for CRIU to `tar`),
    // with working devices and a private devpts.
    let devices = eb.sh(
        "awk '$5 == \"/dev\" || $5 == \"/dev/pts\" { for (i = 7; $i != \"-\"; i++); print $4, $5, $(i + 1) }' \
            /proc/self/mountinfo; \
         echo x > /dev/null && head -c 8 /dev/urandom | wc -c && head -c 3 /dev/zero | wc -c; \
         ls /dev/pts/ptmx",
    );
    assert_eq!(
        devices.stdout,
        "/.fastbox/dev /dev overlay\n/ /dev/pts devpts\n8\n3\n/dev/pts/ptmx\n"
    );

    // Recorded, not asserted: the clocks and pids the clones start from.
    let ticks =
        |f: &BTreeMap<String, String>| f["pid1_start_ticks"].parse::<f64>().unwrap() / 100.0;
    let up = |f: &BTreeMap<String, String>| f["uptime"].parse::<f64>().unwrap();
    eprintln!(
        "measured: boot_id {ba} (host's: {}); execd started at {:.2} s (A) and {:.2} s (B) of \
         clone boot time; clone uptime A {:.2} s, B {:.2} s, host {host_before:.2}..{host_after:.2} s; \
         probe shell pid A {} B {}; A started: {}; B started: {}",
        host_boot_id.trim(),
        ticks(&fa),
        ticks(&fb),
        up(&fa),
        up(&fb),
        fa["shell_pid"],
        fb["shell_pid"],
        started_event(&server, &a),
        started_event(&server, &b),
    );
    server.finish();
}

/// Sandboxes of a [`Fixture`] outside its own tracking (it starts busybox only): destroyed
/// when dropped, so a failing test leaves nothing behind.
struct Live<'a> {
    host: &'a LocalHost,
    sandboxes: Vec<LocalSandbox>,
}

impl Drop for Live<'_> {
    fn drop(&mut self) {
        for sb in self.sandboxes.drain(..) {
            let _ = self.host.destroy(&sb);
        }
    }
}

/// A warm-up process: on `/tmp/ask` it writes its next `random.getrandbits(64)` and
/// `hash('fastbox')` to `/tmp/answer`; on `/tmp/reseed` it calls `random.seed()`.
const WARM_UP: &str = r#"cat > /root/warm.py <<'PY'
import os, random, time
while True:
    if os.path.exists('/tmp/reseed'):
        os.remove('/tmp/reseed')
        random.seed()
    if os.path.exists('/tmp/ask'):
        os.remove('/tmp/ask')
        with open('/tmp/answer.new', 'w') as f:
            f.write('%d %d\n' % (random.getrandbits(64), hash('fastbox')))
        os.rename('/tmp/answer.new', '/tmp/answer')
    time.sleep(0.01)
PY
(python3 /root/warm.py </dev/null >/dev/null 2>&1 &)
echo started"#;

/// Asks the warm-up process (after `/tmp/reseed` when `reseed`): "random hash".
fn ask(sb: &LocalSandbox, reseed: bool) -> (String, String) {
    let script = format!(
        "rm -f /tmp/answer; {} touch /tmp/ask; i=0; \
         while [ ! -f /tmp/answer ] && [ $i -lt 1000 ]; do sleep 0.01; i=$((i+1)); done; cat /tmp/answer",
        if reseed { "touch /tmp/reseed;" } else { "" }
    );
    let (code, out, err) = Fixture::sh(sb, &script);
    assert_eq!(code, 0, "{err}");
    let (random, hash) = out
        .trim()
        .split_once(' ')
        .unwrap_or_else(|| panic!("answer: {out:?}"));
    (random.to_string(), hash.to_string())
}

#[test]
fn a_process_alive_at_checkpoint_time_hands_its_random_state_to_every_clone() {
    if let Some(reason) = common::unavailable() {
        eprintln!("skipped: {reason}");
        return;
    }
    let Some(criu_path) = fastbox_testkit::criu_path() else {
        eprintln!("skipped: no CRIU (run scripts/setup.sh)");
        return;
    };
    let criu = fastbox_runtime::criu::Criu::at(&criu_path).expect("CRIU >= 4.2");
    let cache = fastbox_image::ImageCache::try_new(fastbox_image::ImageConfig {
        cache_dir: common::server::test_cache_dir(),
        ..Default::default()
    })
    .expect("image cache");
    let python = match cache.resolve("python:3.12", None, &fastbox_image::NoProgress) {
        Ok(image) => image,
        Err(e) => {
            eprintln!("skipped: no python:3.12 image ({e})");
            return;
        }
    };
    let f = common::fixture("g", 7);
    let mut live = Live {
        host: f.host(),
        sandboxes: vec![],
    };
    let opts = |name: &str| StartOptions {
        id: format!("{}-{name}", f.prefix),
        ..Default::default()
    };
    let warm = f
        .host()
        .start(&python.rootfs, &f.execd, 0, &opts("warm"))
        .expect("python sandbox starts");
    let (code, _, err) = Fixture::sh(&warm, WARM_UP);
    assert_eq!(code, 0, "{err}");
    let before = ask(&warm, false);
    let checkpoint = f.dir.path().join("checkpoint");
    if let Err(e) = f.host().checkpoint(&criu, &warm, &checkpoint) {
        let _ = f.host().destroy(&warm);
        panic!("checkpoint: {e}");
    }
    for (slot, name) in [(1, "a"), (2, "b")] {
        let clone = f
            .host()
            .restore(
                &criu,
                &checkpoint,
                &python.rootfs,
                f.dir.path(),
                SlotSource::Fresh(slot),
                &opts(name),
            )
            .expect("restore");
        live.sandboxes.push(clone);
    }
    let (a, b) = (&live.sandboxes[0], &live.sandboxes[1]);

    // The warm-up process goes on from the same state in every clone: the same next numbers
    // and the same str hash seed.
    let (first_a, first_b) = (ask(a, false), ask(b, false));
    let (second_a, second_b) = (ask(a, false), ask(b, false));
    assert_eq!(
        first_a, first_b,
        "both clones draw the same next random number"
    );
    assert_eq!(second_a, second_b, "and the same one after that");
    assert_ne!(first_a.0, second_a.0);
    assert_eq!(first_a.1, before.1, "hash('fastbox') is the checkpoint's");
    // A Python started after the restore seeds itself from the kernel: different per clone.
    let fresh = "python3 -c 'import random; print(random.getrandbits(64), hash(\"fastbox\"))'";
    let (fresh_a, fresh_b) = (Fixture::sh(a, fresh).1, Fixture::sh(b, fresh).1);
    assert_ne!(fresh_a, fresh_b, "fresh interpreters differ");
    // random.seed() after the restore makes the clones diverge; the hash seed of a running
    // interpreter cannot change.
    let (reseeded_a, reseeded_b) = (ask(a, true), ask(b, true));
    assert_ne!(
        reseeded_a.0, reseeded_b.0,
        "random.seed() makes the clones diverge"
    );
    assert_eq!(reseeded_a.1, reseeded_b.1, "the hash seed stays shared");
    eprintln!(
        "measured: before checkpoint {before:?}; clone A {first_a:?} {second_a:?}, \
         B {first_b:?} {second_b:?}; fresh A {:?} B {:?}; after random.seed() A {reseeded_a:?} \
         B {reseeded_b:?}",
        fresh_a.trim(),
        fresh_b.trim()
    );
    drop(live);
    f.finish();
}
