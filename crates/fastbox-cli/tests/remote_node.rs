//! A node in its own process: `fastbox node` runs the sandboxes, `fastbox up --remote-node`
//! runs the lifecycle server with no node of its own, and everything a client does passes
//! between them over the node API and the control API.
//!
//! Root and CRIU (skipped with the reason otherwise). Prefixes `rn` (the node), `rs` (the
//! server) and `rw` (a server given a wrong credential); `jn` (a node that joins) and `js`
//! (the server it joins, with a node of its own): from `fastbox_testkit::run_prefix_pair`.

mod common;

use std::process::Command;
use std::time::Duration;

use common::execd::Execd;
use common::node::NodeProcess;
use common::server::{UpServer, busybox_request};
use serde_json::json;

/// `fastbox leftovers --prefix PREFIX`: whether it found nothing, and what it printed.
fn no_leftovers(prefix: &str) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fastbox"))
        .args(["leftovers", "--prefix", prefix])
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn the_server_runs_its_sandboxes_on_a_node_in_another_process() {
    if let Some(reason) = common::unavailable() {
        eprintln!("skipped: {reason}");
        return;
    }
    let (node_prefix, server_prefix, wrong_prefix) = (
        fastbox_testkit::run_prefix_pair("rn"),
        fastbox_testkit::run_prefix_pair("rs"),
        fastbox_testkit::run_prefix_pair("rw"),
    );
    let control = format!("127.0.0.1:{}", fastbox_testkit::server_port());
    let mut node = NodeProcess::start(
        &node_prefix,
        "10.218.110.0/24",
        &["--control-url", &format!("http://{control}")],
    );
    assert!(
        node.log_text().contains("node credentials made in"),
        "{}",
        node.log_text()
    );
    let credentials = node.dir.path().join("credentials");
    std::fs::write(&credentials, node.credentials()).unwrap();
    let server = UpServer::start_prefixed(
        &server_prefix,
        "10.218.115.0/24",
        &[
            "--remote-node",
            &node.api,
            "--remote-node-credentials",
            credentials.to_str().unwrap(),
            "--control-listen",
            &control,
            "--node-proxy-public",
            &node.proxy,
        ],
    )
    .expect("prerequisites checked above");

    // A create runs on the node; its endpoint is the node's proxy.
    let id = server.create_busybox();
    server.wait_state(&id, "Running");
    let (status, ep) = server.get(&format!("/v1/sandboxes/{id}/endpoints/44772"));
    assert_eq!(status, 200, "{ep}");
    let endpoint = ep["endpoint"].as_str().unwrap();
    assert!(
        endpoint.starts_with(&format!("{}/{id}/44772", node.proxy)),
        "{endpoint}"
    );
    let run = Execd::of(&server, &id).sh("echo remote-$((6 * 7))");
    assert!(run.stdout.contains("remote-42"), "{}", run.stdout);

    // Port 18080 on the node asks the server's control API: a change made there is the
    // server's to validate, apply (on the node) and record.
    let (status, egress) = server.get(&format!("/v1/sandboxes/{id}/endpoints/18080"));
    assert_eq!(status, 200, "{egress}");
    let egress_url = format!("http://{}/policy", egress["endpoint"].as_str().unwrap());
    assert!(egress_url.starts_with(&format!("http://{}/", node.proxy)));
    let patched = reqwest::blocking::Client::new()
        .patch(&egress_url)
        .header(
            "OPENSANDBOX-EGRESS-AUTH",
            egress["headers"]["OPENSANDBOX-EGRESS-AUTH"]
                .as_str()
                .unwrap(),
        )
        .json(&json!([{"action": "allow", "target": "example.com"}]))
        .send()
        .unwrap();
    let status = patched.status();
    let text = patched.text().unwrap_or_default();
    assert_eq!(status, 200, "{text}");
    let (status, policy) = server.get(&format!("/v1/sandboxes/{id}/networkpolicy"));
    assert_eq!(status, 200, "{policy}");
    assert!(policy.to_string().contains("example.com"), "{policy}");

    // A secure sandbox: the node proxy asks the server's control API for its access rule.
    let secure = server.create_busybox_with(json!({"secureAccess": true}));
    server.wait_state(&secure, "Running");
    assert_eq!(server.ping(&secure), 200);
    let (_, secure_ep) = server.get(&format!("/v1/sandboxes/{secure}/endpoints/44772"));
    let bare = reqwest::blocking::Client::new()
        .get(format!(
            "http://{}/ping",
            secure_ep["endpoint"].as_str().unwrap()
        ))
        .header(
            "X-EXECD-ACCESS-TOKEN",
            secure_ep["headers"]["X-EXECD-ACCESS-TOKEN"]
                .as_str()
                .unwrap(),
        )
        .send()
        .unwrap()
        .status()
        .as_u16();
    assert!(
        matches!(bare, 401 | 403),
        "without the access token: {bare}"
    );
    assert_eq!(server.delete(&format!("/v1/sandboxes/{secure}")), 204);
    server.wait_state(&secure, "Terminated");

    // Both restart: the node keeps the sandbox running (and its slot held), the server takes
    // it back through the node API.
    let mut server = server;
    server.stop();
    node.stop();
    node.spawn();
    server.spawn();
    assert_eq!(server.state(&id).0, "Running");
    let run = Execd::of(&server, &id).sh("echo still-$((6 * 7))");
    assert!(run.stdout.contains("still-42"), "{}", run.stdout);
    let restarted = node.log_text();
    assert!(
        restarted.contains("network slot(s) of the previous run for the server to take back"),
        "{restarted}"
    );
    // The server proxy reaches it through the node API's proxy route.
    let token = ep["headers"]["X-EXECD-ACCESS-TOKEN"].as_str().unwrap();
    let through_server = reqwest::blocking::Client::new()
        .get(server.url(&format!("/v1/sandboxes/{id}/proxy/44772/ping")))
        .header("OPEN-SANDBOX-API-KEY", &server.api_key)
        .header("X-EXECD-ACCESS-TOKEN", token)
        .send()
        .unwrap();
    let status = through_server.status();
    let text = through_server.text().unwrap_or_default();
    assert_eq!(status, 200, "{text}");

    // Pause and resume: the checkpoint is on the node.
    let (status, body) = server.post(&format!("/v1/sandboxes/{id}/pause"), &json!({}));
    assert_eq!(status, 202, "{body}");
    server.wait_state(&id, "Paused");
    let on_node = std::fs::read_dir(node.data_dir.join("snapshots"))
        .unwrap()
        .flatten()
        .any(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(&format!("pause-{id}-"))
        });
    assert!(on_node, "no pause checkpoint of {id} on the node");
    let (status, body) = server.post(&format!("/v1/sandboxes/{id}/resume"), &json!({}));
    assert_eq!(status, 202, "{body}");
    server.wait_state(&id, "Running");
    let run = Execd::of(&server, &id).sh("echo resumed");
    assert!(run.stdout.contains("resumed"), "{}", run.stdout);

    assert_eq!(server.delete(&format!("/v1/sandboxes/{id}")), 204);
    server.wait_state(&id, "Terminated");

    // The node did the work; the server has no node of its own.
    let node_log = node.log_text();
    assert!(
        node_log.contains(&id) && node_log.contains("sandbox removed"),
        "{node_log}"
    );
    assert!(
        !server.data_dir.join("sandboxes").exists(),
        "the server made sandboxes of its own"
    );
    let server_host = fastbox_cli::local_sandbox::leftovers(&server_prefix);
    assert!(
        server_host.is_empty(),
        "the server has host state: {server_host:?}"
    );

    // A server given a wrong server-to-node credential: its node calls fail, a create is 503.
    let wrong = node.dir.path().join("wrong-credentials");
    let real = node.credentials();
    let node_to_server = real
        .lines()
        .find(|l| l.starts_with("node-to-server="))
        .unwrap();
    std::fs::write(
        &wrong,
        format!(
            "server-to-node={}\n{node_to_server}\n",
            fastbox_node_api::remote::Credential::generate().unwrap()
        ),
    )
    .unwrap();
    let refused = UpServer::start_prefixed(
        &wrong_prefix,
        "10.218.119.0/24",
        &[
            "--remote-node",
            &node.api,
            "--remote-node-credentials",
            wrong.to_str().unwrap(),
            "--control-listen",
            &format!("127.0.0.1:{}", fastbox_testkit::server_port()),
            "--node-proxy-public",
            &node.proxy,
            "--no-default-images",
        ],
    )
    .expect("prerequisites checked above");
    let (status, body) = refused.post("/v1/sandboxes", &busybox_request(json!({})));
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["code"], "SANDBOX::NODE_UNAVAILABLE", "{body}");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("refused this server's credential")),
        "{body}"
    );
    refused.finish();
    server.finish();

    // The node stops with nothing of its own running but its nft table; a purge takes that.
    node.stop();
    let table = format!("nft table inet {node_prefix}");
    let left: Vec<String> = fastbox_cli::local_sandbox::leftovers(&node_prefix)
        .into_iter()
        .filter(|l| *l != table)
        .collect();
    assert!(
        left.is_empty(),
        "the node left: {left:?}\n{}",
        node.log_text()
    );
    fastbox_fastlet::host::purge(&node_prefix, &node.data_dir).unwrap();
    for prefix in [&node_prefix, &server_prefix, &wrong_prefix] {
        let (clean, found) = no_leftovers(prefix);
        assert!(clean, "fastbox leftovers --prefix {prefix}: {found}");
    }
}

/// A `fastbox up --accept-nodes` (`server`: its prefix and pool) with a lease of `lease_ms`,
/// and node `n1` (`node`: its prefix and pool) joined to it; `both` go to each.
fn joined(
    server: (&str, &str),
    node: (&str, &str),
    lease_ms: u64,
    both: &[&str],
) -> (UpServer, NodeProcess) {
    let control = format!("127.0.0.1:{}", fastbox_testkit::server_port());
    let lease = lease_ms.to_string();
    let mut server_args = vec![
        "--accept-nodes",
        "--control-listen",
        &control,
        "--node-lease-ms",
        &lease,
    ];
    server_args.extend(both);
    let server = UpServer::start_prefixed(server.0, server.1, &server_args)
        .expect("prerequisites checked by the caller");
    let token = server.data_dir.join("node-join-token");
    let cert = server.data_dir.join("control-tls/cert.pem");
    let join = format!("https://{control}");
    let mut node_args = vec![
        "--join",
        &join,
        "--join-token-file",
        token.to_str().unwrap(),
        "--server-cert",
        cert.to_str().unwrap(),
        "--node-name",
        "n1",
    ];
    node_args.extend(both);
    let node = NodeProcess::start(node.0, node.1, &node_args);
    (server, node)
}

#[test]
fn a_node_joins_a_server_shares_its_creates_and_is_lost_when_killed() {
    if let Some(reason) = common::unavailable() {
        eprintln!("skipped: {reason}");
        return;
    }
    let (node_prefix, server_prefix) = (
        fastbox_testkit::run_prefix_pair("jn"),
        fastbox_testkit::run_prefix_pair("js"),
    );
    let (server, mut node) = joined(
        (&server_prefix, "10.218.121.0/24"),
        (&node_prefix, "10.218.122.0/24"),
        5000,
        &[],
    );
    assert!(
        node.log_text().contains("joined") && node.log_text().contains("as node n1"),
        "{}",
        node.log_text()
    );
    server.wait_node("n1", "ready", Duration::from_secs(10));
    // The node API of a joined node is TLS: plain HTTP gets no answer.
    assert!(node.api.starts_with("https://"), "{}", node.api);
    assert!(
        node.log_text().contains("node API on https://"),
        "{}",
        node.log_text()
    );
    let plain = format!("{}/node/v1/status", node.api.replacen("https", "http", 1));
    assert!(
        reqwest::blocking::Client::new()
            .post(&plain)
            .timeout(Duration::from_secs(5))
            .send()
            .is_err(),
        "{plain} answered plain HTTP"
    );
    // Both nodes report (the server's own by its refresh, n1 by its heartbeats).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while server.nodes().values().any(|n| n["freeSlots"].is_null()) {
        assert!(std::time::Instant::now() < deadline, "{:?}", server.nodes());
        std::thread::sleep(Duration::from_millis(100));
    }

    // Creates spread over both nodes; each endpoint is its own node's proxy, and execd
    // answers through it.
    let mut on_n1 = Vec::new();
    let mut on_local = Vec::new();
    for _ in 0..6 {
        let id = server.create_busybox();
        server.wait_state(&id, "Running");
        let (status, ep) = server.get(&format!("/v1/sandboxes/{id}/endpoints/44772"));
        assert_eq!(status, 200, "{ep}");
        let endpoint = ep["endpoint"].as_str().unwrap().to_string();
        let run = Execd::of(&server, &id).sh("echo here-$((6 * 7))");
        assert!(run.stdout.contains("here-42"), "{id}: {}", run.stdout);
        if endpoint.starts_with(&format!("{}/", node.proxy)) {
            on_n1.push(id);
        } else {
            on_local.push(id);
        }
    }
    assert!(
        !on_n1.is_empty() && !on_local.is_empty(),
        "both nodes take creates: n1 {on_n1:?}, local {on_local:?}"
    );
    // A signed route (the server's key) passes the joined node's proxy: the node was given
    // the server's route signing keys when it registered.
    let expires = chrono::Utc::now().timestamp() + 300;
    let (status, signed) = server.get(&format!(
        "/v1/sandboxes/{}/endpoints/44772?expires={expires}",
        on_n1[0]
    ));
    assert_eq!(status, 200, "{signed}");
    let (_, plain) = server.get(&format!("/v1/sandboxes/{}/endpoints/44772", on_n1[0]));
    // The node proxy reads its key file again at most once a second.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let status = loop {
        let status = reqwest::blocking::Client::new()
            .get(format!(
                "http://{}/ping",
                signed["endpoint"].as_str().unwrap()
            ))
            .header(
                "X-EXECD-ACCESS-TOKEN",
                plain["headers"]["X-EXECD-ACCESS-TOKEN"].as_str().unwrap(),
            )
            .send()
            .unwrap()
            .status();
        if status == 200 || std::time::Instant::now() > deadline {
            break status;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(
        status,
        200,
        "a signed route on the joined node\n{}\n{}",
        node.log_text(),
        server.log_text()
    );

    // The node is killed: its lease runs out (5 s), half a lease later it is lost and what
    // ran there failed (NODE_LOST); the server's own sandboxes run on.
    let killed = std::time::Instant::now();
    if let Some(mut child) = node.child.take() {
        let _ = child.kill();
        let _ = child.wait();
    }
    server.wait_node("n1", "expired", Duration::from_secs(15));
    // Its guard (a process that outlived it) froze every sandbox before the lease ran out.
    let marker: serde_json::Value = serde_json::from_slice(
        &std::fs::read(node.data_dir.join("fenced")).expect("the fence marker"),
    )
    .unwrap();
    let fenced: Vec<String> = marker["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect();
    assert!(fenced.len() >= on_n1.len(), "{marker}");
    for group in &fenced {
        assert!(
            fastbox_cli::verify_cluster::frozen(&node_prefix, group),
            "{group} is not frozen: {marker}"
        );
    }
    server.wait_node("n1", "lost", Duration::from_secs(15));
    let lost_after = killed.elapsed();
    assert!(
        lost_after >= Duration::from_millis(5000),
        "declared lost after {lost_after:?}, before its lease could run out"
    );
    // The node shows lost as soon as it is declared so; its sandboxes fail right after (a
    // write each), so they are waited for.
    let failed = ("Failed".to_string(), Some("NODE_LOST".to_string()));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    for id in &on_n1 {
        while server.state(id) != failed && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(server.state(id), failed, "{id}");
    }
    for id in &on_local {
        assert_eq!(server.state(id).0, "Running", "{id}");
    }
    // A create now goes to the server's own node.
    let later = server.create_busybox();
    server.wait_state(&later, "Running");
    let (_, ep) = server.get(&format!("/v1/sandboxes/{later}/endpoints/44772"));
    assert!(
        !ep["endpoint"]
            .as_str()
            .unwrap()
            .starts_with(&format!("{}/", node.proxy)),
        "{ep}"
    );

    // It comes back: it registers again, and the server removes what it ran while lost (the
    // node thaws nothing: the server had declared it lost).
    node.spawn();
    server.wait_node("n1", "ready", Duration::from_secs(20));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while node.data_dir.join("fenced").exists() {
        assert!(std::time::Instant::now() < deadline, "{}", node.log_text());
        std::thread::sleep(Duration::from_millis(100));
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    for id in &on_n1 {
        loop {
            let (_, events) =
                server.get_text(&format!("/v1/sandboxes/{id}/diagnostics/events?scope=all"));
            if events.contains("Removed") {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{id} was not removed from the node: {events}\n{}",
                node.log_text()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    for id in on_local.iter().chain([&later]) {
        assert_eq!(server.delete(&format!("/v1/sandboxes/{id}")), 204);
        server.wait_state(id, "Terminated");
    }
    server.finish();
    node.stop();
    fastbox_fastlet::host::purge(&node_prefix, &node.data_dir).unwrap();
    for prefix in [&node_prefix, &server_prefix] {
        let (clean, found) = no_leftovers(prefix);
        assert!(clean, "fastbox leftovers --prefix {prefix}: {found}");
    }
}
/// A busybox awk that fills its heap with 300 000 pseudo-random numbers, records their sum
/// in `/tmp/sum0`, then writes `<pass> <sum>` to `/tmp/sums` every second.
const MEMORY_HOLDER: &str = "awk 'BEGIN { srand(7); for (i = 0; i < 300000; i++) { a[i] = int(rand() * 1000000000); s += a[i] }; printf \"%.0f\\n\", s > \"/tmp/sum0\"; close(\"/tmp/sum0\"); while (1) { t = 0; for (i in a) t += a[i]; n++; printf \"%d %.0f\\n\", n, t > \"/tmp/sums.new\"; close(\"/tmp/sums.new\"); system(\"mv /tmp/sums.new /tmp/sums; sleep 1\") } }'";

/// The memory holder's latest `(pass, sum)` once its pass is past `after`; its sum must
/// be the one it recorded at start.
fn held_sums(server: &UpServer, id: &str, after: u64) -> (u64, String) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let run = Execd::of(server, id).sh("cat /tmp/sum0 /tmp/sums 2>/dev/null || true");
        let lines: Vec<&str> = run.stdout.lines().collect();
        if let [start, latest] = lines[..]
            && let Some((pass, sum)) = latest.split_once(' ')
            && let Ok(pass) = pass.parse::<u64>()
            && pass > after
        {
            assert_eq!(
                sum.trim(),
                start.trim(),
                "the holder's sum changed: {}",
                run.stdout
            );
            return (pass, sum.trim().to_string());
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the memory holder did not sum past pass {after}: {}",
            run.stdout
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

#[test]
fn a_paused_sandbox_resumes_on_another_node_when_its_node_is_lost() {
    if let Some(reason) = common::unavailable() {
        eprintln!("skipped: {reason}");
        return;
    }
    let (node_prefix, server_prefix) = (
        fastbox_testkit::run_prefix_pair("jm"),
        fastbox_testkit::run_prefix_pair("jt"),
    );
    // One artifact store for the cluster: a directory both see.
    let shared = tempfile::Builder::new()
        .prefix(&format!("{server_prefix}-store-"))
        .tempdir()
        .unwrap();
    let store = shared.path().display().to_string();
    // Lazy restores from 1 MiB: the moved sandbox's memory (about 20 MiB, under the default
    // minimum, which a move would fetch whole first) is fetched while it runs.
    let (server, mut node) = joined(
        (&server_prefix, "10.218.125.0/24"),
        (&node_prefix, "10.218.126.0/24"),
        5000,
        &["--artifact-store", &store, "--lazy-restore-min-mib", "1"],
    );
    server.wait_node("n1", "ready", Duration::from_secs(10));

    // A sandbox on n1 with a file and a process of its own.
    let id = loop {
        let id = server.create_busybox();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while server.state(&id).0 == "Pending" && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let (_, sandbox) = server.get(&format!("/v1/sandboxes/{id}"));
        assert_eq!(
            sandbox["status"]["state"],
            "Running",
            "{sandbox}\n{}",
            node.log_text()
        );
        let (_, ep) = server.get(&format!("/v1/sandboxes/{id}/endpoints/44772"));
        if ep["endpoint"]
            .as_str()
            .unwrap()
            .starts_with(&format!("{}/", node.proxy))
        {
            break id;
        }
        assert_eq!(server.delete(&format!("/v1/sandboxes/{id}")), 204);
    };
    Execd::of(&server, &id).sh("echo kept-$((6 * 7)) > /tmp/mark; (sleep 100000 &)");
    // Counted by a command line that does not hold what it looks for.
    const COUNT_SLEEPERS: &str = "ps | grep -c \"[s]leep 10000[0]\"";
    let sleepers = Execd::of(&server, &id)
        .sh(COUNT_SLEEPERS)
        .stdout
        .trim()
        .to_string();
    // A process holding tens of MiB of pseudo-random numbers in its heap, which it sums again
    // every second: after the resume, its sums say whether its memory came back intact.
    Execd::of(&server, &id).sh(&format!("({MEMORY_HOLDER} > /dev/null 2>&1 &)"));
    let before = held_sums(&server, &id, 0);
    let (status, body) = server.post(&format!("/v1/sandboxes/{id}/pause"), &json!({}));
    assert_eq!(status, 202, "{body}");
    server.wait_state(&id, "Paused");

    // n1 is killed and lost; the resume runs on the server's own node, from the checkpoint
    // n1 published to the shared store.
    if let Some(mut child) = node.child.take() {
        let _ = child.kill();
        let _ = child.wait();
    }
    server.wait_node("n1", "lost", Duration::from_secs(20));
    let (status, body) = server.post(&format!("/v1/sandboxes/{id}/resume"), &json!({}));
    assert_eq!(status, 202, "{body}");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let resumed = loop {
        let (_, sandbox) = server.get(&format!("/v1/sandboxes/{id}"));
        if sandbox["status"]["state"] != "Resuming" || std::time::Instant::now() > deadline {
            break sandbox;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        resumed["status"]["state"],
        "Running",
        "{resumed}\n{}",
        server.log_text()
    );
    let (_, ep) = server.get(&format!("/v1/sandboxes/{id}/endpoints/44772"));
    assert!(
        ep["endpoint"]
            .as_str()
            .unwrap()
            .starts_with(&format!("{}/", server.node_proxy)),
        "resumed on the server's node: {ep}\n{}",
        server.log_text()
    );
    let run = Execd::of(&server, &id).sh(&format!("cat /tmp/mark; {COUNT_SLEEPERS}"));
    let lines: Vec<&str> = run.stdout.lines().collect();
    assert_eq!(lines.first(), Some(&"kept-42"), "{}", run.stdout);
    assert_eq!(
        lines.get(1).map(|l| l.trim()),
        Some(sleepers.as_str()),
        "its processes came along: {}",
        run.stdout
    );
    let (_, events) = server.get_text(&format!("/v1/sandboxes/{id}/diagnostics/events?scope=all"));
    assert!(events.contains("Moved"), "{events}");
    // Its memory came from the store while it ran (fetched on its faults and in the
    // background), and it is what it was.
    let now = held_sums(&server, &id, 0);
    let after = held_sums(&server, &id, now.0);
    assert_eq!(
        after.1, before.1,
        "the held memory sums as before the pause"
    );
    let log = fastbox_cli::verify_cluster::moves::without_colors(&server.log_text());
    let remote_bytes: u64 = log
        .lines()
        .filter(|l| l.contains("materialized from an artifact"))
        .filter_map(|l| l.split("remote_bytes=").nth(1))
        .filter_map(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    assert!(
        remote_bytes > 16 << 20,
        "the checkpoint's memory ({remote_bytes} bytes) was left in the store:\n{log}"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !server.log_text().contains("memory copied in") {
        assert!(
            std::time::Instant::now() < deadline,
            "no lazy memory transfer finished on the server's node:\n{}",
            server.log_text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // n1 comes back: what the sandbox left there goes.
    node.spawn();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (_, events) =
            server.get_text(&format!("/v1/sandboxes/{id}/diagnostics/events?scope=all"));
        if events.contains("Cleaned") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{events}\n{}",
            node.log_text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(server.delete(&format!("/v1/sandboxes/{id}")), 204);
    server.wait_state(&id, "Terminated");
    server.finish();
    node.stop();
    fastbox_fastlet::host::purge(&node_prefix, &node.data_dir).unwrap();
    for prefix in [&node_prefix, &server_prefix] {
        let (clean, found) = no_leftovers(prefix);
        assert!(clean, "fastbox leftovers --prefix {prefix}: {found}");
    }
}

/// A start claimed from the warm pool runs in the pooled sandbox's slot, not in the one
/// admitted for it. When its server died before it recorded the placement, the server that
/// finishes the create knows only the sandbox's id and the admitted slot: a release by
/// those alone must stop the claimed sandbox and free its slot (it ran on, as the sandbox,
/// after the sandbox was deleted: found by the real-process chaos test). And a stale release
/// of a slot that holds a running sandbox must not free it.
#[test]
fn a_claim_whose_placement_was_never_recorded_goes_with_a_release_by_id() {
    use fastbox_node_api::NodeAgent;
    use fastbox_node_api::remote::{Credential, NodeClient, Timeouts};
    use fastbox_node_api::wire::{PlaceSpec, SandboxSettings, SandboxTokens};

    if let Some(reason) = common::unavailable() {
        eprintln!("skipped: {reason}");
        return;
    }
    let prefix = fastbox_testkit::run_prefix_pair("rc");
    let control = format!("http://127.0.0.1:{}", fastbox_testkit::server_port());
    let mut node = NodeProcess::start(&prefix, "10.218.117.0/24", &["--control-url", &control]);
    let credentials = node.credentials();
    let credential: Credential = credentials
        .lines()
        .find_map(|l| l.strip_prefix("server-to-node="))
        .and_then(|c| c.parse().ok())
        .expect("the server-to-node credential");
    let client = NodeClient::new("rc", &node.api, credential, Timeouts::default()).unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (claimed, first) = runtime.block_on(async {
        let image = client
            .resolve_image("fastbox/busybox", None)
            .await
            .expect("resolve the image");
        let spec = |id: &str| PlaceSpec {
            id: id.to_string(),
            image: image.clone(),
            template: None,
            use_pool: true,
            entrypoint: vec!["sleep".into(), "100000".into()],
            env: Vec::new(),
            volumes: Vec::new(),
            volume_keys: Default::default(),
            isolation: false,
            common: SandboxSettings {
                limits: Default::default(),
                disk_bytes: None,
                tokens: SandboxTokens {
                    execd: "e".repeat(32),
                    egress: "g".repeat(32),
                },
                policy: Default::default(),
                credential_proxy: false,
            },
        };
        // The first start makes the template; the warm pool fills after it.
        let first_slot = client.admit().await.expect("admit");
        let first = client
            .place(spec("first"), first_slot)
            .await
            .expect("the first start");
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        while client.status().await.pools.values().sum::<usize>() == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the warm pool never filled"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let admitted = client.admit().await.expect("admit");
        let claimed = client
            .place(spec("claimed"), admitted)
            .await
            .expect("the claim");
        assert_ne!(
            claimed.placement.slot, admitted,
            "not claimed from the warm pool: {:?}",
            claimed.report
        );
        assert!(client.is_alive(&claimed.placement).await);
        // What the server finishing the create does: the id and the admitted slot only.
        client
            .release_keeping_address("claimed", None, admitted)
            .await
            .expect("the release");
        let alive = client.is_alive(&claimed.placement).await;
        // A stale release of the slot a running sandbox holds (a server that woke up after
        // another took its work over) does not free it: the next admission is another slot.
        client.release_slot(first.placement.slot).await;
        let next = client.admit().await.expect("admit");
        assert_ne!(
            next, first.placement.slot,
            "a slot holding a running sandbox was released and admitted again"
        );
        client.release_slot(next).await;
        client
            .remove("claimed", None, Some(admitted))
            .await
            .expect("the removal");
        client
            .remove("first", Some(&first.placement), None)
            .await
            .expect("the removal");
        (alive, first)
    });
    drop(first);
    node.stop();
    fastbox_fastlet::host::purge(&prefix, &node.data_dir).unwrap();
    let (clean, found) = no_leftovers(&prefix);
    assert!(
        !claimed,
        "the sandbox claimed from the pool ran on after its release by id"
    );
    assert!(clean, "fastbox leftovers --prefix {prefix}: {found}");
}
