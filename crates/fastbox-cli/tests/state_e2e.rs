//! `fastbox up --state etcd://...`: the server's records in a real etcd. They survive a
//! restart of the server; with etcd gone, mutations answer 503 and nothing is half done,
//! reads go on from what the server knows, running sandboxes keep running; with etcd back,
//! everything works again.

mod common;

use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use common::node::NodeProcess;
use common::server::{UpServer, busybox_request};
use fastbox_state::{EtcdBackend, EtcdOptions, StateBackend, StateUrl};
use fastbox_testkit::etcd::{EtcdCluster, etcd_unavailable};

/// How many sandbox records etcd holds under `prefix`.
fn records_in_etcd(etcd: &EtcdCluster, prefix: &str) -> u64 {
    let key = format!("{prefix}/sandboxes/");
    let mut end = key.clone().into_bytes();
    *end.last_mut().unwrap() += 1;
    let body = etcd
        .post(
            0,
            "/v3/kv/range",
            &format!(
                r#"{{"key":"{}","range_end":"{}","count_only":true}}"#,
                B64.encode(&key),
                B64.encode(&end)
            ),
        )
        .expect("range");
    let value: serde_json::Value = serde_json::from_str(&body).unwrap();
    value["count"]
        .as_str()
        .map(|c| c.parse().unwrap())
        .unwrap_or(0)
}

#[test]
fn records_live_in_etcd_and_etcd_faults_are_503s() {
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let mut etcd = EtcdCluster::start(1).expect("etcd starts");
    let prefix = "/fbt-state-e2e";
    let url = format!("{}{prefix}", etcd.state_url());
    let run = fastbox_testkit::run_prefix_pair("st");
    let Some(mut server) = UpServer::start_prefixed(
        &run,
        "10.217.51.0/24",
        // Deleted sandboxes are listed for a second only: the test sees their records go.
        &[
            "--state",
            &url,
            "--state-timeout-ms",
            "1500",
            "--retention-seconds",
            "1",
        ],
    ) else {
        return;
    };
    assert!(
        server.log_text().contains("etcd etcd://"),
        "{}",
        server.log_text()
    );

    let id = server.create_busybox();
    server.wait_state(&id, "Running");
    assert_eq!(records_in_etcd(&etcd, prefix), 1);
    // Sealed: etcd holds no token, no id, nothing of the record in clear.
    let StateUrl::Etcd(target) = StateUrl::parse(&url).unwrap() else {
        unreachable!()
    };
    let raw = EtcdBackend::connect(target, EtcdOptions::default())
        .expect("etcd")
        .get("sandboxes", &id)
        .unwrap()
        .expect("the record")
        .value;
    assert_eq!(&raw[..4], b"fbs1");
    for clear in [&b"execd"[..], b"busybox", id.as_bytes()] {
        assert!(!raw.windows(clear.len()).any(|w| w == clear), "in clear");
    }
    assert!(
        !server.data_dir.join("state.redb").exists(),
        "no redb file next to etcd"
    );

    // A create sent twice with one Idempotency-Key makes one sandbox.
    let request = busybox_request(serde_json::json!({}));
    let first = server.post_with("/v1/sandboxes", &request, &[("Idempotency-Key", "k-1")]);
    assert_eq!(first.status(), 202);
    assert!(!first.headers().contains_key("idempotent-replayed"));
    let first: serde_json::Value = first.json().unwrap();
    let again = server.post_with("/v1/sandboxes", &request, &[("Idempotency-Key", "k-1")]);
    assert_eq!(again.status(), 202);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    let again: serde_json::Value = again.json().unwrap();
    assert_eq!(first["id"], again["id"]);
    let other = server.post_with(
        "/v1/sandboxes",
        &busybox_request(serde_json::json!({"metadata": {"x": "y"}})),
        &[("Idempotency-Key", "k-1")],
    );
    assert_eq!(other.status(), 409, "the key with another request");
    let keyed = first["id"].as_str().unwrap().to_string();
    server.wait_state(&keyed, "Running");
    assert_eq!(server.delete(&format!("/v1/sandboxes/{keyed}")), 204);
    let deadline = Instant::now() + Duration::from_secs(30);
    while records_in_etcd(&etcd, prefix) > 1 {
        assert!(
            Instant::now() < deadline,
            "the deleted sandbox stayed in etcd"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // A restarted server finds its sandbox in etcd and adopts it.
    server.stop();
    server.spawn();
    assert_eq!(server.state(&id).0, "Running");
    assert_eq!(server.ping(&id), 200);

    // etcd gone: a create is a clear 503 and leaves nothing behind; reads go on; the
    // sandbox keeps running.
    etcd.kill(0);
    let started = Instant::now();
    let (status, body) = server.post("/v1/sandboxes", &busybox_request(serde_json::json!({})));
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["code"], "GENERAL::STATE_STORE_UNAVAILABLE", "{body}");
    assert!(
        body["message"].as_str().unwrap().contains("did not answer"),
        "{body}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    let list = server.raw_get("/v1/sandboxes");
    assert_eq!(list.status(), 200);
    assert_eq!(
        list.headers()
            .get("x-fastbox-stale")
            .map(|v| v.to_str().unwrap()),
        Some("true"),
        "a read answered from the server's last known state says so"
    );
    let list: serde_json::Value = list.json().unwrap();
    assert_eq!(list["items"].as_array().unwrap().len(), 1, "{list}");
    assert_eq!(server.ping(&id), 200);
    let status = server.delete(&format!("/v1/sandboxes/{id}"));
    assert_eq!(status, 503, "a delete is refused too");
    assert_eq!(server.state(&id).0, "Running");

    // etcd back: the create works, and the refused one left no record.
    etcd.restart(0).expect("etcd starts again");
    let deadline = Instant::now() + Duration::from_secs(15);
    while server
        .raw_get("/v1/sandboxes")
        .headers()
        .contains_key("x-fastbox-stale")
    {
        assert!(Instant::now() < deadline, "still stale with etcd back");
        std::thread::sleep(Duration::from_millis(200));
    }
    let second = server.create_busybox();
    server.wait_state(&second, "Running");
    assert_eq!(records_in_etcd(&etcd, prefix), 2);
    for id in [&id, &second] {
        assert_eq!(server.delete(&format!("/v1/sandboxes/{id}")), 204);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while records_in_etcd(&etcd, prefix) > 0 {
        assert!(Instant::now() < deadline, "records left in etcd");
        std::thread::sleep(Duration::from_millis(200));
    }
    server.finish();
}

#[test]
fn two_servers_share_one_etcd_and_the_leadership_moves_when_the_leader_dies() {
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let etcd = EtcdCluster::start(1).expect("etcd starts");
    let url = format!("{}/fbt-two-servers", etcd.state_url());
    // Every server of one state holds the same seal key; one with another is refused.
    let keys = tempfile::tempdir().unwrap();
    let seal_key = keys.path().join("seal.key").display().to_string();
    let args = |id: &'static str| {
        vec![
            "--accept-nodes".to_string(),
            "--control-listen".into(),
            format!("127.0.0.1:{}", fastbox_testkit::server_port()),
            "--state".to_string(),
            url.clone(),
            "--state-seal-key".into(),
            seal_key.clone(),
            "--server-id".into(),
            id.into(),
            "--server-lease-ms".into(),
            "4000".into(),
            "--retention-seconds".into(),
            "1".into(),
        ]
    };
    let start = |tag: &str, pool: &str, id: &'static str| {
        let args = args(id);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        UpServer::start_prefixed(&fastbox_testkit::run_prefix_pair(tag), pool, &args)
    };
    let Some(mut a) = start("sb", "10.217.52.0/24", "srv-a") else {
        return;
    };
    let mut alien = std::process::Command::new(env!("CARGO_BIN_EXE_fastbox"))
        .args(["up", "--data-dir"])
        .arg(keys.path().join("alien"))
        .args([
            "--state",
            &url,
            "--server-id",
            "alien",
            "--prefix",
            "fbtalien",
        ])
        .output()
        .expect("run fastbox up");
    assert!(!alien.status.success());
    alien.stderr.extend_from_slice(&alien.stdout);
    let said = String::from_utf8_lossy(&alien.stderr);
    assert!(said.contains("same seal key"), "{said}");
    let Some(b) = start("sc", "10.217.53.0/24", "srv-b") else {
        return;
    };
    assert!(
        a.log_text().contains("it leads the reconcilers"),
        "{}",
        a.log_text()
    );
    assert!(
        b.log_text().contains("another server leads"),
        "{}",
        b.log_text()
    );

    // Nodes may join either: both servers hold the same join token and control identity.
    for file in [
        "node-join-token",
        "control-tls/cert.pem",
        "control-tls/key.pem",
    ] {
        let read = |server: &UpServer| std::fs::read(server.data_dir.join(file)).unwrap();
        assert_eq!(read(&a), read(&b), "{file}");
    }

    // One state: what a creates, b lists.
    let on_a = a.create_busybox();
    a.wait_state(&on_a, "Running");
    // (b follows a's writes a moment later: Pending first, then Running.)
    let deadline = Instant::now() + Duration::from_secs(10);
    while !b.ids().contains(&on_a) || b.state(&on_a).0 != "Running" {
        assert!(Instant::now() < deadline, "b never saw a's sandbox running");
        std::thread::sleep(Duration::from_millis(50));
    }
    let on_b = b.create_busybox();
    b.wait_state(&on_b, "Running");
    assert_eq!(b.ping(&on_b), 200);

    // The leader dies: b leads within the lease.
    a.kill9();
    let killed = Instant::now();
    let leads = |log: String| {
        log.lines()
            .any(|l| l.contains("leads the reconcilers") && !l.contains("another server"))
    };
    while !leads(b.log_text()) {
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "b never took the lead: {}",
            b.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("b leads {:?} after the leader's kill -9", killed.elapsed());

    // a comes back (after its old presence ran out) and takes back its node's sandbox.
    a.spawn();
    a.wait_state(&on_a, "Running");
    assert_eq!(a.ping(&on_a), 200);
    assert!(
        a.log_text().contains("another server leads"),
        "{}",
        a.log_text()
    );

    for (server, id) in [(&a, &on_a), (&b, &on_b)] {
        assert_eq!(server.delete(&format!("/v1/sandboxes/{id}")), 204);
        server.wait_state(id, "Terminated");
    }
    a.finish();
    b.finish();
}

#[test]
fn a_node_that_joins_two_servers_keeps_serving_when_the_leader_dies() {
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let etcd = EtcdCluster::start(1).expect("etcd starts");
    let url = format!("{}/fbt-joined", etcd.state_url());
    let keys = tempfile::tempdir().unwrap();
    let seal_key = keys.path().join("seal.key").display().to_string();
    let controls = [
        format!("127.0.0.1:{}", fastbox_testkit::server_port()),
        format!("127.0.0.1:{}", fastbox_testkit::server_port()),
    ];
    let start = |tag: &str, pool: &str, id: &str, control: &str| {
        let args = [
            "--accept-nodes",
            "--control-listen",
            control,
            "--state",
            &url,
            "--state-seal-key",
            &seal_key,
            "--server-id",
            id,
            "--server-lease-ms",
            "4000",
        ];
        UpServer::start_prefixed(&fastbox_testkit::run_prefix_pair(tag), pool, &args)
    };
    let Some(mut a) = start("se", "10.217.55.0/24", "srv-a", &controls[0]) else {
        return;
    };
    let Some(b) = start("sf", "10.217.56.0/24", "srv-b", &controls[1]) else {
        return;
    };
    let join = format!("https://{},https://{}", controls[0], controls[1]);
    let token = a.data_dir.join("node-join-token").display().to_string();
    let cert = a
        .data_dir
        .join("control-tls/cert.pem")
        .display()
        .to_string();
    let mut node = NodeProcess::start(
        &fastbox_testkit::run_prefix_pair("sg"),
        "10.217.57.0/24",
        &[
            "--join",
            &join,
            "--join-token-file",
            &token,
            "--server-cert",
            &cert,
            "--node-name",
            "n1",
        ],
    );
    // Registered with a (the first URL), reached by b, which asks it for its reports.
    b.wait_node("n1", "ready", Duration::from_secs(20));
    let deadline = Instant::now() + Duration::from_secs(10);
    while b.nodes().values().any(|n| n["freeSlots"].is_null()) {
        assert!(Instant::now() < deadline, "{:?}", b.nodes());
        std::thread::sleep(Duration::from_millis(100));
    }

    // A create through b that lands on n1 (its endpoint is n1's proxy).
    let on_n1 = (0..8)
        .find_map(|_| {
            let id = b.create_busybox();
            let deadline = Instant::now() + Duration::from_secs(60);
            while b.state(&id).0 != "Running" {
                let (_, sandbox) = b.get(&format!("/v1/sandboxes/{id}"));
                assert!(
                    Instant::now() < deadline && sandbox["status"]["state"] != "Failed",
                    "{sandbox}\n{}\n{}",
                    b.get(&format!("/v1/sandboxes/{id}/diagnostics/events")).1,
                    node.log_text()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
            let (_, ep) = b.get(&format!("/v1/sandboxes/{id}/endpoints/44772"));
            if ep["endpoint"]
                .as_str()
                .is_some_and(|e| e.starts_with(&node.proxy))
            {
                return Some(id);
            }
            assert_eq!(b.delete(&format!("/v1/sandboxes/{id}")), 204);
            None
        })
        .unwrap_or_else(|| panic!("no create through b on n1: {:?}", b.nodes()));
    let (status, answer) = b.ping_answer(&on_n1);
    assert_eq!(
        status,
        200,
        "{answer}\n--- a:\n{}\n--- b:\n{}\n--- n1:\n{}",
        a.log_text(),
        b.log_text(),
        node.log_text()
    );

    // The leader dies: n1 heartbeats to b from then on, and is never lost.
    a.kill9();
    let killed = Instant::now();
    while killed.elapsed() < Duration::from_secs(12) {
        let state = b.nodes()["n1"]["state"].clone();
        assert_eq!(state, "ready", "{}\n{}", b.log_text(), node.log_text());
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(b.state(&on_n1).0, "Running");
    assert_eq!(b.ping(&on_n1), 200);

    assert_eq!(b.delete(&format!("/v1/sandboxes/{on_n1}")), 204);
    b.wait_state(&on_n1, "Terminated");
    node.stop();
    b.finish();
    a.spawn();
    a.finish();
}
