//! `fastbox up` end to end, as a real process: sandboxes outlive the server, a restart (clean
//! or `kill -9`) re-adopts the live ones and fails the lost ones with `PROCESS_LOST`, an
//! interrupted create converges, and nothing is leaked.

mod common;

use common::server::UpServer;
use fastbox_runtime::cgroup::{Cgroup, CgroupRoot};

/// `127.0.0.1:PORT` of a registry that answers every request with 404 after 300 ms.
fn slow_404_registry() -> String {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                let _ = conn.read(&mut buf);
                std::thread::sleep(std::time::Duration::from_millis(300));
                let _ = conn.write_all(
                    b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                );
            });
        }
    });
    addr.to_string()
}

/// Kills every process of sandbox `id` behind the server's back (the server is stopped: its
/// state store says which cgroup the sandbox runs in; a pooled one keeps its pool name).
fn kill_sandbox_processes(server: &UpServer, id: &str) {
    let store = fastbox_server::store::Store::open(&server.data_dir.join("state.redb")).unwrap();
    let record = store
        .load()
        .unwrap()
        .into_iter()
        .find(|r| r.id == id)
        .unwrap();
    // The node's handle, opaque to the server, is the runtime's.
    let placement = record.placement.expect("placed");
    let runtime_id = fastbox_fastlet::local_node::to_placement(&placement)
        .expect("the in-process node's handle")
        .handle
        .id;
    let root = CgroupRoot::detect().unwrap();
    let cgroup = Cgroup::open(&root, &server.prefix, &runtime_id).expect("the sandbox's cgroup");
    cgroup.kill_all().unwrap();
}

#[test]
fn restarts_readopt_live_sandboxes_and_fail_lost_ones() {
    let Some(mut server) = UpServer::start('r', &[]) else {
        return;
    };
    let a = server.create_busybox();
    let b = server.create_busybox();
    for id in [&a, &b] {
        assert_eq!(server.state(id).0, "Running");
        assert_eq!(server.ping(id), 200);
    }

    // A clean stop leaves sandboxes running.
    server.stop();
    kill_sandbox_processes(&server, &b);
    server.spawn();
    assert_eq!(server.state(&a).0, "Running");
    assert_eq!(server.ping(&a), 200, "re-adopted sandbox answers");
    assert_eq!(
        server.state(&b),
        ("Failed".to_string(), Some("PROCESS_LOST".to_string()))
    );
    let (_, events) = server.get(&format!("/v1/sandboxes/{a}/diagnostics/events"));
    assert!(
        events["content"].as_str().unwrap().contains("Adopted"),
        "{events}"
    );

    // A crash too.
    server.kill9();
    server.spawn();
    assert_eq!(server.ping(&a), 200, "survives kill -9 of the server");

    // New sandboxes get other slots than the adopted one.
    let c = server.create_busybox();
    assert_eq!(server.ping(&c), 200);
    assert_eq!(server.ping(&a), 200);
    server.finish();
}

#[test]
fn an_interrupted_create_converges_and_leaves_nothing_behind() {
    let Some(mut server) = UpServer::start('i', &[]) else {
        return;
    };
    // kill -9 at several points of creates in flight; every sandbox must end Running or
    // Failed with a reason, and deleting them must leave nothing on the host.
    for delay_ms in [0u64, 20, 60, 150] {
        let api = server.url("/v1/sandboxes");
        let key = server.api_key.clone();
        let request = std::thread::spawn(move || {
            let _ = reqwest::blocking::Client::new()
                .post(api)
                .header("OPEN-SANDBOX-API-KEY", key)
                .json(&serde_json::json!({
                    "image": {"uri": "fastbox/busybox"},
                    "entrypoint": ["sleep", "100000"],
                }))
                .send();
        });
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        server.kill9();
        let _ = request.join();
        server.spawn();
    }
    let ids = server.ids();
    for id in &ids {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let (state, reason) = server.state(id);
            match state.as_str() {
                "Running" => {
                    assert_eq!(server.ping(id), 200);
                    break;
                }
                "Failed" => {
                    assert!(reason.is_some(), "{id} failed without a reason");
                    break;
                }
                _ => {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "{id} stuck in {state}"
                    );
                    std::thread::sleep(std::time::Duration::from_millis(100));
                }
            }
        }
    }
    eprintln!("{} creates were recorded before the crashes", ids.len());
    server.finish();
}

#[test]
fn expired_sandboxes_are_terminated_then_forgotten() {
    let Some(server) = UpServer::start('x', &["--retention-seconds", "2"]) else {
        return;
    };
    let id = server.create_busybox();
    let soon = chrono::Utc::now() + chrono::Duration::seconds(1);
    let (status, body) = server.post(
        &format!("/v1/sandboxes/{id}/renew-expiration"),
        &serde_json::json!({"expiresAt": soon.to_rfc3339()}),
    );
    assert_eq!(status, 200, "{body}");
    server.wait_state(&id, "Terminated");
    let (_, events) = server.get(&format!("/v1/sandboxes/{id}/diagnostics/events"));
    assert!(
        events["content"].as_str().unwrap().contains("EXPIRED"),
        "{events}"
    );
    // Garbage-collected after the retention period.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while server.get(&format!("/v1/sandboxes/{id}")).0 != 404 {
        assert!(
            std::time::Instant::now() < deadline,
            "never garbage-collected"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    server.finish();
}

#[test]
fn creates_answer_pending_while_the_image_is_prepared() {
    // Waiting 0 ms for the image, and an image cache of its own with nothing prepared: the
    // first create answers before its image is built.
    let cache = tempfile::tempdir().unwrap();
    let cache_dir = cache.path().display().to_string();
    let Some(server) = UpServer::start(
        'p',
        &[
            "--create-image-wait-ms",
            "0",
            "--no-default-images",
            "--cache-dir",
            &cache_dir,
            // The slow registry below is on loopback.
            "--registry-allow-private",
            "127.0.0.1/32",
        ],
    ) else {
        return;
    };
    let (status, body) = server.post(
        "/v1/sandboxes",
        &serde_json::json!({"image": {"uri": "fastbox/busybox"}, "entrypoint": ["sleep", "1000"]}),
    );
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["status"]["state"], "Pending", "{body}");
    let id = body["id"].as_str().unwrap().to_string();
    // The SDK polls the endpoint; until the sandbox runs it must get exactly this 404.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let (status, ep) = server.get(&format!("/v1/sandboxes/{id}/endpoints/44772"));
        if status == 200 {
            break;
        }
        assert_eq!(
            (status, ep["code"].as_str()),
            (404, Some("KUBERNETES::POD_IP_NOT_AVAILABLE")),
            "{ep} {}",
            server.get(&format!("/v1/sandboxes/{id}")).1
        );
        assert!(
            std::time::Instant::now() < deadline,
            "never became reachable"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(server.ping(&id), 200);

    // An image that fails after the answer (a registry that answers 404, slowly): the
    // sandbox fails with the reason, and the endpoint lookup stops the SDK's polling with it.
    let registry = slow_404_registry();
    let (status, body) = server.post(
        "/v1/sandboxes",
        &serde_json::json!({"image": {"uri": format!("{registry}/fastbox-test/missing:1")}, "entrypoint": ["sh"]}),
    );
    assert_eq!(status, 202, "{body}");
    let bad = body["id"].as_str().unwrap().to_string();
    server.wait_state(&bad, "Failed");
    assert_eq!(
        server.state(&bad).1.as_deref(),
        Some("IMAGE_RESOLUTION_FAILED")
    );
    let (status, ep) = server.get(&format!("/v1/sandboxes/{bad}/endpoints/44772"));
    assert_eq!(status, 409, "{ep}");
    assert!(
        ep["message"]
            .as_str()
            .unwrap()
            .contains("IMAGE_RESOLUTION_FAILED"),
        "{ep}"
    );
    server.finish();
}

#[test]
fn an_image_that_fails_quickly_is_a_400_and_records_nothing() {
    // No warm pool: the next create restores into the lowest free slot.
    let Some(server) = UpServer::start('q', &["--pool-size", "0"]) else {
        return;
    };
    let (status, body) = server.post(
        "/v1/sandboxes",
        &serde_json::json!({"image": {"uri": "oci:/nonexistent/fastbox-test-image"}, "entrypoint": ["sh"]}),
    );
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["code"], "SANDBOX::INVALID_PARAMETER");
    assert!(server.ids().is_empty());
    // The slot it had reserved is free again: the next create gets the first address.
    let id = server.create_busybox();
    let (_, events) = server.get(&format!("/v1/sandboxes/{id}/diagnostics/events"));
    let first = format!("started at 10.217.{}.1\n", b'q');
    assert!(
        events["content"].as_str().unwrap().contains(&first),
        "{events}"
    );
    server.finish();
}

#[test]
fn pooled_sandboxes_have_no_route_out_until_claimed() {
    let Some(server) = UpServer::start('v', &["--pool-size", "2"]) else {
        return;
    };
    // Wait for the pool to fill (its sandboxes record their slots).
    let sandboxes = server.data_dir.join("sandboxes");
    let pooled_slots = || -> Vec<u32> {
        std::fs::read_dir(&sandboxes)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path().join("pool-slot")).ok())
            .filter_map(|s| s.trim().parse().ok())
            .collect()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while pooled_slots().len() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the pool never filled"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let routes = |slot: u32| {
        let netns = fastbox_runtime::net::names::slot_name(&server.prefix, slot);
        let out = std::process::Command::new("ip")
            .args(["-netns", &netns, "route", "show"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    for slot in pooled_slots() {
        let table = routes(slot);
        assert!(!table.contains("default"), "pooled slot {slot}: {table}");
    }
    // What an idle pooled sandbox costs: execd alone, well under a few MiB of its own.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fastbox"))
        .args(["bench", "pool-memory", "--json", "--prefix", &server.prefix])
        .arg("--data-dir")
        .arg(&server.data_dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let memory: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(memory["pooled"], 2, "{memory}");
    let private = memory["median_private_bytes"].as_u64().unwrap();
    assert!(private > 0 && private < 32 << 20, "{memory}");
    // A create claims one: its sandbox has its way out again.
    let id = server.create_busybox();
    let store_slot = {
        let (_, body) = server.get(&format!("/v1/sandboxes/{id}/diagnostics/events"));
        assert!(
            body["content"].as_str().unwrap().contains("pool: acquire"),
            "{body}"
        );
        body
    };
    let _ = store_slot;
    // The claim's phases are in the start metrics.
    let (status, metrics) = server.get_text("/metrics");
    assert_eq!(status, 200);
    assert!(
        metrics.contains("fastbox_start_phase_seconds_count{source=\"pool\",phase=\"claim\"} 1"),
        "{metrics}"
    );
    // So are the create requests' own phases, one sample each per create.
    let create_count = |phase: &str| -> u64 {
        let line = format!("fastbox_create_phase_seconds_count{{phase=\"{phase}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(line.as_str()))
            .unwrap_or_else(|| panic!("no {line}in {metrics}"))
            .parse()
            .unwrap()
    };
    let creates = create_count("total");
    assert!(creates >= 1, "{metrics}");
    for phase in ["admit", "intent", "start"] {
        assert_eq!(create_count(phase), creates, "{phase}: {metrics}");
    }
    let claimed: Vec<u32> = (0..8)
        .filter(|s| routes(*s).contains("default via"))
        .collect();
    assert_eq!(
        claimed.len(),
        1,
        "exactly the claimed sandbox routes out: {claimed:?}"
    );
    server.finish();
}

#[test]
fn a_pooled_sandbox_that_does_not_take_its_claim_is_discarded_and_the_create_restores() {
    // Its own prefix and pool (`k`, the tag it had, is client_cli's: the two ran at once).
    let Some(server) = UpServer::start_prefixed(
        &fastbox_testkit::run_prefix_pair("kp"),
        "10.217.60.0/24",
        &["--pool-size", "1"],
    ) else {
        return;
    };
    let sandboxes = server.data_dir.join("sandboxes");
    let pooled = || -> Vec<String> {
        std::fs::read_dir(&sandboxes)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().join("pool-slot").exists())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while pooled().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the pool never filled"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // Its processes stopped: the claim reaches its execd's socket and gets no answer.
    let stuck = pooled().remove(0);
    let root = CgroupRoot::detect().unwrap();
    let cgroup = Cgroup::open(&root, &server.prefix, &stuck).expect("the pooled sandbox's cgroup");
    let pids = cgroup.procs().unwrap();
    assert!(!pids.is_empty());
    for pid in &pids {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), nix::sys::signal::SIGSTOP)
            .unwrap();
    }
    let id = server.create_busybox();
    server.wait_state(&id, "Running");
    assert_eq!(
        server.ping(&id),
        200,
        "the create restored a sandbox that answers"
    );
    let (_, body) = server.get(&format!("/v1/sandboxes/{id}/diagnostics/events"));
    let events = body["content"].as_str().unwrap();
    assert!(
        events.contains("restore:"),
        "restored, not claimed: {events}"
    );
    // The stopped pooled sandbox is gone, processes and all.
    assert!(!sandboxes.join(&stuck).exists(), "its directory went");
    for pid in pids {
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        assert!(
            state.is_empty() || state.split(' ').nth(2) == Some("Z"),
            "process {pid} of the discarded sandbox lives on: {state}"
        );
    }
    assert!(
        server.log_text().contains("did not take its claim"),
        "the discarded claim is logged"
    );
    server.finish();
}

#[test]
fn golden_checkpoints_and_their_artifacts_hold_no_golden_token() {
    let Some(server) = UpServer::start('w', &[]) else {
        return;
    };
    let templates = server.data_dir.join("templates");
    let template_dir = std::fs::read_dir(&templates)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.join("template.json").exists())
        .unwrap_or_else(|| {
            let listing: Vec<_> = walk(&templates);
            panic!(
                "the default image's template: {listing:#?}\n{}",
                server.log_text()
            )
        });
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(template_dir.join("template.json")).unwrap())
            .unwrap();
    let token = meta["golden_token"].as_str().unwrap().as_bytes().to_vec();
    // The artifact is published in the background: wait for its manifest.
    let manifests = server.data_dir.join("artifacts/manifests");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while std::fs::read_dir(&manifests).map_or(true, |mut d| d.next().is_none()) {
        assert!(
            std::time::Instant::now() < deadline,
            "no artifact published"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let mut checked = 0;
    for root in [
        template_dir.join("checkpoint"),
        server.data_dir.join("artifacts"),
    ] {
        let mut stack = vec![root];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).unwrap().flatten() {
                let path = entry.path();
                let kind = entry.file_type().unwrap();
                if kind.is_dir() {
                    stack.push(path);
                } else if kind.is_file()
                    && let Ok(bytes) = std::fs::read(&path)
                {
                    checked += 1;
                    assert!(
                        !bytes.windows(token.len()).any(|w| w == token.as_slice()),
                        "the golden token is in {}",
                        path.display()
                    );
                }
            }
        }
    }
    assert!(checked > 5, "only {checked} files checked");
    server.finish();
}

/// Every path under `dir` (for failure messages).
fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            found.extend(walk(&path));
        }
        found.push(path);
    }
    found
}
