//! Egress policies end to end through the API of a real `fastbox up`: sandboxes created with
//! policies, live changes through the lifecycle `networkpolicy` routes and through port 18080
//! (node proxy and server proxy), refusals, and a server restart. Every reachability check is
//! a real connection or name lookup made by Python inside the sandbox (through execd) to a
//! test internet (`fastbox_egress::testkit`) whose DNS server is the forwarder's upstream.
//! Also the private ranges: a private test host inside `--sandbox-reach` and one outside,
//! and that a removed sandbox's tracked connections are forgotten.
//!
//! Prefix tag `m`: the instance's pool is 10.217.109.0/24 (see `common/server.rs`), the test
//! internet's uplink 10.218.109.252/30, its hosts 203.0.113.0/26 (`testkit::hosts_block`,
//! DNS on .1) and two private test hosts in its namespace: 10.218.109.10 (inside
//! `--sandbox-reach 10.218.109.0/28`) and 10.218.109.100 (outside).

mod common;
#[path = "egress_e2e/vault.rs"]
mod vault;

use std::io::Cursor;
use std::net::Ipv4Addr;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::server::UpServer;
use fastbox_api::lifecycle::Endpoint;
use fastbox_cli::client::execd::{CommandOutcome, CommandRequest, ExecdClient};
use fastbox_egress::testkit::{TestInternet, Zone, hosts_block};
use reqwest::Method;
use serde_json::{Value, json};

const TAG: char = 'm';
const IMAGE: &str = "python:3.12";
const EGRESS_PORT: u16 = 18080;
const EGRESS_AUTH: &str = "OPENSANDBOX-EGRESS-AUTH";

/// Names of the test internet and the host each resolves to.
const ALLOWED: (&str, u8) = ("allowed.test", 10);
const OTHER: (&str, u8) = ("other.test", 11);
/// Hosts reached by address only.
const DENIED_IP: u8 = 20;
const FREE_IP: u8 = 21;
const KEPT_IP: u8 = 22;
const OPENED_IP: u8 = 23;

/// Internet host `n` (`TestInternet::host`, known before the internet exists).
fn inet(n: u8) -> String {
    Ipv4Addr::from(u32::from(hosts_block(TAG)) + u32::from(n)).to_string()
}

/// The test's own network (the internet's uplink and the private test hosts).
const NET: [u8; 3] = [10, 218, TAG as u8];
/// What the server is started with: `--sandbox-reach` of this network.
const REACH_LEN: u8 = 28;
/// A private test host inside the reach, and one outside it (both in the internet's
/// namespace).
const REACHED_HOST: u8 = 10;
const PRIVATE_HOST: u8 = 100;
/// Names answered with them.
const REACHED_NAME: &str = "reached.test";
const PRIVATE_NAME: &str = "private.test";

fn private_host(last: u8) -> Ipv4Addr {
    Ipv4Addr::new(NET[0], NET[1], NET[2], last)
}

/// What the sandbox runs: `reach TARGET...` prints `TARGET ok|blocked|unresolved` per target
/// (a connection to port 80 within 2 s, reading the echo server's greeting line); `hold
/// GOFILE TARGET...` opens a connection to each target, prints `ready`, waits for GOFILE,
/// then sends a line on each and prints `TARGET echo|cut` (no echo within 2 s: cut). Lines
/// are read whole: the greeting may arrive in pieces, and a leftover piece is no echo.
const PROBE: &str = r#"
import os, socket, sys, time

def line(s):
    data = b""
    while not data.endswith(b"\n"):
        chunk = s.recv(64)
        if not chunk:
            break
        data += chunk
    return data

def reach(target):
    try:
        s = socket.create_connection((target, 80), timeout=2)
    except socket.gaierror:
        return "unresolved"
    except OSError:
        return "blocked"
    with s:
        s.settimeout(2)
        return "ok" if line(s) else "blocked"

def hold(go, targets):
    socks = []
    for t in targets:
        s = socket.create_connection((t, 80), timeout=2)
        s.settimeout(2)
        line(s)
        socks.append((t, s))
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.05)
    for t, s in socks:
        try:
            s.sendall(b"x\n")
            print(t, "echo" if line(s) == b"x\n" else "cut", flush=True)
        except OSError:
            print(t, "cut", flush=True)

if sys.argv[1] == "reach":
    for t in sys.argv[2:]:
        print(t, reach(t), flush=True)
elif sys.argv[1] == "addr":
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect(("198.51.100.1", 9))  # no packet: only picks the source address
    print(s.getsockname()[0])
else:
    hold(sys.argv[2], sys.argv[3:])
"#;

struct Sandbox {
    id: String,
    execd: ExecdClient,
}

impl Sandbox {
    /// Creates a sandbox with `policy` (`None`: no `networkPolicy`) and uploads the probe.
    fn create(server: &UpServer, policy: Option<Value>) -> Sandbox {
        let mut body = json!({
            "image": {"uri": IMAGE},
            "entrypoint": ["tail", "-f", "/dev/null"],
            "timeout": 3600,
            "resourceLimits": {"cpu": "1", "memory": "256Mi"},
        });
        if let Some(policy) = policy {
            body["networkPolicy"] = policy;
        }
        let (status, created) = server.post("/v1/sandboxes", &body);
        assert_eq!(status, 202, "{created}");
        let id = created["id"].as_str().unwrap().to_string();
        server.wait_state(&id, "Running");
        let sandbox = Sandbox::attach(server, &id);
        let probe = PROBE.as_bytes();
        sandbox
            .execd
            .upload(
                "/tmp/probe.py",
                0o644,
                Cursor::new(probe),
                Some(probe.len() as u64),
            )
            .expect("upload the probe");
        sandbox
    }

    /// An execd client of running sandbox `id` through the endpoint the API hands out.
    fn attach(server: &UpServer, id: &str) -> Sandbox {
        let (status, endpoint) = server.get(&format!("/v1/sandboxes/{id}/endpoints/44772"));
        assert_eq!(status, 200, "{endpoint}");
        let endpoint: Endpoint = serde_json::from_value(endpoint).unwrap();
        Sandbox {
            id: id.to_string(),
            execd: ExecdClient::try_new("http", &endpoint).unwrap(),
        }
    }

    /// Runs `command`; its stdout (the command must succeed).
    fn run(&self, command: &str) -> String {
        run_command(&self.execd, command, |_| {})
    }

    /// `target -> ok|blocked|unresolved` for each target, checked against `want`.
    fn expect_reach(&self, what: &str, want: &[(&str, &str)]) {
        let targets: Vec<&str> = want.iter().map(|(t, _)| *t).collect();
        let out = self.run(&format!(
            "python3 /tmp/probe.py reach {}",
            targets.join(" ")
        ));
        let got: Vec<(String, String)> = out
            .lines()
            .filter_map(|l| l.split_once(' '))
            .map(|(t, r)| (t.to_string(), r.to_string()))
            .collect();
        let want: Vec<(String, String)> = want
            .iter()
            .map(|(t, r)| (t.to_string(), r.to_string()))
            .collect();
        assert_eq!(got, want, "{what} (sandbox {})", self.id);
    }

    /// Opens a connection to `target` and holds it until the sandbox goes (whatever happens
    /// to the command then is ignored).
    fn hold_detached(&self, target: &str) -> std::thread::JoinHandle<()> {
        let (tx, rx) = mpsc::channel();
        let execd = self.execd.clone();
        let request = CommandRequest {
            command: format!("python3 /tmp/probe.py hold /tmp/never {target}"),
            ..Default::default()
        };
        let thread = std::thread::spawn(move || {
            let _ = execd.run(&request, |event| {
                if event.kind == "stdout" {
                    let _ = tx.send(event.text.clone().unwrap_or_default());
                }
            });
        });
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(30)).as_deref(),
            Ok("ready"),
            "the held connection did not open"
        );
        thread
    }

    /// Opens a connection to each target and keeps them open until [`Held::release`].
    fn hold(&self, go: &str, targets: &[&str]) -> Held {
        let (tx, rx) = mpsc::channel();
        let execd = self.execd.clone();
        let command = format!("python3 /tmp/probe.py hold {go} {}", targets.join(" "));
        let thread = std::thread::spawn(move || {
            run_command(&execd, &command, |line| {
                let _ = tx.send(line.to_string());
            })
        });
        let ready = rx.recv_timeout(Duration::from_secs(30));
        assert_eq!(
            ready.as_deref(),
            Ok("ready"),
            "the held connections did not open"
        );
        Held {
            go: go.to_string(),
            thread,
        }
    }
}

/// Connections a sandbox holds open.
struct Held {
    go: String,
    thread: std::thread::JoinHandle<String>,
}

impl Held {
    /// Lets the holder use its connections; what became of each (`TARGET echo|cut` lines).
    fn release(self, sandbox: &Sandbox) -> String {
        sandbox.run(&format!("touch {}", self.go));
        let out = self.thread.join().expect("hold thread");
        out.lines()
            .filter(|l| *l != "ready")
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Runs `command` through `execd`, handing each stdout line to `on_line` as it arrives (execd
/// sends one event per line, without its terminator); its stdout.
fn run_command(execd: &ExecdClient, command: &str, mut on_line: impl FnMut(&str)) -> String {
    let (mut stdout, mut stderr) = (String::new(), String::new());
    let request = CommandRequest {
        command: command.to_string(),
        ..Default::default()
    };
    let outcome = execd
        .run(&request, |event| {
            let text = event.text.as_deref().unwrap_or_default();
            match event.kind.as_str() {
                "stdout" => {
                    on_line(text);
                    stdout.push_str(text);
                    stdout.push('\n');
                }
                "stderr" => {
                    stderr.push_str(text);
                    stderr.push('\n');
                }
                _ => {}
            }
        })
        .expect("run the command");
    assert_eq!(
        outcome,
        CommandOutcome::Exited(0),
        "{command}: stdout {stdout:?} stderr {stderr:?}"
    );
    stdout
}

/// The test internet's zone.
fn zone() -> Zone {
    let host = |n: u8| inet(n).parse::<Ipv4Addr>().unwrap();
    Zone::new()
        .with(ALLOWED.0, &[host(ALLOWED.1)], 300)
        .with(OTHER.0, &[host(OTHER.1)], 300)
        .with(REACHED_NAME, &[private_host(REACHED_HOST)], 300)
        .with(PRIVATE_NAME, &[private_host(PRIVATE_HOST)], 300)
        .with(vault::VAULT.0, &[host(vault::VAULT.1)], 300)
        .with(vault::SPOOFED.0, &[host(vault::SPOOFED.1)], 300)
}

/// A `fastbox up` (python image, warm pool of 2) whose DNS forwarder asks the test internet,
/// whose sandboxes may reach the first 16 addresses of the test's own network, and whose
/// credential proxy trusts the test internet's TLS hosts ([`vault::Hosts`]).
fn start() -> Option<(UpServer, (TestInternet, vault::Hosts))> {
    UpServer::start_with(TAG, |prefix| {
        let internet =
            TestInternet::start(prefix, NET, hosts_block(TAG), zone()).expect("test internet");
        for last in [REACHED_HOST, PRIVATE_HOST] {
            internet
                .add_host(private_host(last))
                .expect("private test host");
        }
        let hosts = vault::Hosts::start(&internet);
        let roots = hosts.roots_file().display().to_string();
        let args = [
            "--dns-upstream",
            &internet.dns_addr().to_string(),
            "--sandbox-reach",
            &format!("{}/{REACH_LEN}", private_host(0)),
            "--default-image",
            IMAGE,
            "--pool-size",
            "2",
            "--credential-proxy-roots",
            &roots,
        ]
        .map(str::to_string)
        .to_vec();
        ((internet, hosts), args)
    })
}

/// The conntrack entries whose original source is `addr` (`conntrack -L` lines).
fn tracked_from(addr: &str) -> Vec<String> {
    let out = std::process::Command::new("conntrack")
        .args(["-L", "-f", "ipv4", "-s", addr])
        .output()
        .expect("run conntrack");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

fn policy_of(server: &UpServer, id: &str) -> Value {
    let (status, body) = server.get(&format!("/v1/sandboxes/{id}/networkpolicy"));
    assert_eq!(status, 200, "{body}");
    body
}

fn events_of(server: &UpServer, id: &str) -> String {
    let (status, body) = server.get(&format!(
        "/v1/sandboxes/{id}/diagnostics/events?scope=runtime"
    ));
    assert_eq!(status, 200, "{body}");
    body["content"].as_str().unwrap_or_default().to_string()
}

/// A request to port 18080 of `id` through `base` (`http://node-proxy/{id}/18080` or the
/// server proxy), with the egress token when given.
fn egress_call(
    base: &str,
    api_key: Option<&str>,
    token: Option<&str>,
    method: Method,
    body: Option<Value>,
) -> (u16, Value) {
    let mut req = reqwest::blocking::Client::new()
        .request(method, format!("{base}/policy"))
        .timeout(Duration::from_secs(30));
    if let Some(key) = api_key {
        req = req.header("OPEN-SANDBOX-API-KEY", key);
    }
    if let Some(token) = token {
        req = req.header(EGRESS_AUTH, token);
    }
    if let Some(body) = body {
        req = req.json(&body);
    }
    let r = req.send().expect("egress request");
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

#[test]
fn egress_policies_through_the_api() {
    let Some((mut server, (internet, hosts))) = start() else {
        return;
    };
    let started = Instant::now();

    let (allowed, other) = (ALLOWED.0, OTHER.0);
    let (denied_ip, free_ip, kept_ip, opened_ip) = (
        inet(DENIED_IP),
        inet(FREE_IP),
        inet(KEPT_IP),
        inet(OPENED_IP),
    );

    // --- creates with policies, checked by real connections
    let deny_default = Sandbox::create(
        &server,
        Some(json!({"defaultAction": "deny", "egress": [{"action": "allow", "target": allowed}]})),
    );
    let allow_default = Sandbox::create(
        &server,
        Some(
            json!({"defaultAction": "allow", "egress": [{"action": "deny", "target": denied_ip}]}),
        ),
    );
    let deny_all = Sandbox::create(&server, Some(json!({"defaultAction": "deny"})));
    let (reached_ip, private_ip) = (
        private_host(REACHED_HOST).to_string(),
        private_host(PRIVATE_HOST).to_string(),
    );
    deny_default.expect_reach(
        "deny default, allowed FQDN",
        &[
            (allowed, "ok"),
            (other, "unresolved"),
            (&free_ip, "blocked"),
            // --sandbox-reach lifts the private deny only: the policy still decides.
            (&reached_ip, "blocked"),
        ],
    );
    allow_default.expect_reach(
        "allow default, denied IP",
        &[
            (&denied_ip, "blocked"),
            (&free_ip, "ok"),
            (other, "ok"),
            // Private ranges: only what --sandbox-reach lists, by address and by name; a
            // name answered with a private address outside it resolves to nothing.
            (&reached_ip, "ok"),
            (REACHED_NAME, "ok"),
            (&private_ip, "blocked"),
            (PRIVATE_NAME, "unresolved"),
        ],
    );
    deny_all.expect_reach(
        "deny all",
        &[(allowed, "unresolved"), (&free_ip, "blocked")],
    );
    let body = policy_of(&server, &deny_all.id);
    assert_eq!(
        body,
        json!({"status": "ok", "mode": "deny_all", "enforcementMode": "dns+nft",
               "policy": {"defaultAction": "deny"}})
    );
    // Served at the root too.
    let (status, root) = server.get(&format!("/sandboxes/{}/networkpolicy", deny_default.id));
    assert_eq!(
        (status, &root["mode"]),
        (200, &json!("enforcing")),
        "{root}"
    );

    // --- a live PATCH through the lifecycle API cuts the connection it denies
    let held = allow_default.hold("/tmp/go1", &[&free_ip, &kept_ip]);
    let (status, patched) = server.send(
        Method::PATCH,
        &format!("/v1/sandboxes/{}/networkpolicy", allow_default.id),
        Some(&json!([{"action": "deny", "target": free_ip}])),
    );
    assert_eq!(status, 200, "{patched}");
    assert_eq!(patched["mode"], "enforcing");
    assert_eq!(
        patched["policy"],
        json!({"defaultAction": "allow", "egress": [
            {"action": "deny", "target": free_ip}, {"action": "deny", "target": denied_ip}]})
    );
    assert_eq!(
        held.release(&allow_default),
        format!("{free_ip} cut\n{kept_ip} echo"),
        "the open connection to the newly denied address must be cut, the other kept"
    );
    allow_default.expect_reach("after PATCH", &[(&free_ip, "blocked"), (&kept_ip, "ok")]);
    assert_eq!(
        policy_of(&server, &allow_default.id)["policy"],
        patched["policy"]
    );
    assert!(
        events_of(&server, &allow_default.id)
            .contains("EgressPolicyChanged: PATCH through the lifecycle API")
    );

    // --- port 18080 through the node proxy: the token the endpoint hands out, or 401
    let (status, endpoint) = server.get(&format!(
        "/v1/sandboxes/{}/endpoints/{EGRESS_PORT}",
        deny_default.id
    ));
    assert_eq!(status, 200, "{endpoint}");
    let token = endpoint["headers"][EGRESS_AUTH]
        .as_str()
        .expect("egress token")
        .to_string();
    let node = format!("http://{}", endpoint["endpoint"].as_str().unwrap());
    assert_eq!(
        node,
        format!(
            "http://{}/{}/{EGRESS_PORT}",
            server.node_proxy, deny_default.id
        )
    );
    assert_eq!(egress_call(&node, None, None, Method::GET, None).0, 401);
    assert_eq!(
        egress_call(&node, None, Some("wrong"), Method::GET, None).0,
        401
    );
    let (status, _) = egress_call(
        &node,
        None,
        Some("wrong"),
        Method::PATCH,
        Some(json!([{"action": "allow", "target": opened_ip}])),
    );
    assert_eq!(status, 401);
    // Another sandbox's token opens nothing here.
    let (_, other_endpoint) = server.get(&format!(
        "/v1/sandboxes/{}/endpoints/{EGRESS_PORT}",
        allow_default.id
    ));
    let other_token = other_endpoint["headers"][EGRESS_AUTH].as_str().unwrap();
    assert_ne!(other_token, token);
    assert_eq!(
        egress_call(&node, None, Some(other_token), Method::GET, None).0,
        401
    );
    let (status, got) = egress_call(&node, None, Some(&token), Method::GET, None);
    assert_eq!(status, 200, "{got}");
    assert_eq!(got, policy_of(&server, &deny_default.id));

    let held = deny_default.hold("/tmp/go2", &[allowed]);
    let (status, patched) = egress_call(
        &node,
        None,
        Some(&token),
        Method::PATCH,
        Some(json!([{"action": "allow", "target": opened_ip}])),
    );
    assert_eq!(status, 200, "{patched}");
    deny_default.expect_reach(
        "after PATCH /policy",
        &[(&opened_ip, "ok"), (&free_ip, "blocked")],
    );
    let (status, deleted) = egress_call(
        &node,
        None,
        Some(&token),
        Method::DELETE,
        Some(json!([allowed])),
    );
    assert_eq!(status, 200, "{deleted}");
    let expected =
        json!({"defaultAction": "deny", "egress": [{"action": "allow", "target": opened_ip}]});
    assert_eq!(deleted["policy"], expected);
    assert_eq!(
        held.release(&deny_default),
        format!("{allowed} cut"),
        "DELETE /policy must cut the open connection to the name it no longer allows"
    );
    deny_default.expect_reach("after DELETE /policy", &[(allowed, "unresolved")]);
    // Recorded by the server although the node proxy took the change.
    assert_eq!(policy_of(&server, &deny_default.id)["policy"], expected);
    let events = events_of(&server, &deny_default.id);
    assert!(
        events.contains("PATCH through port 18080") && events.contains("DELETE through port 18080"),
        "{events}"
    );

    // --- port 18080 through the server proxy: API key and egress token
    let proxied = format!(
        "{}/v1/sandboxes/{}/proxy/{EGRESS_PORT}",
        server.api, deny_default.id
    );
    let key = server.api_key.clone();
    assert_eq!(
        egress_call(&proxied, Some(&key), None, Method::GET, None).0,
        401
    );
    assert_eq!(
        egress_call(&proxied, None, Some(&token), Method::GET, None).0,
        401
    );
    let (status, got) = egress_call(&proxied, Some(&key), Some(&token), Method::GET, None);
    assert_eq!((status, &got["policy"]), (200, &expected), "{got}");

    // --- refusals record nothing
    let before = policy_of(&server, &deny_default.id);
    let events_before = events_of(&server, &deny_default.id);
    for (method, body) in [
        (
            Method::PUT,
            json!({"defaultAction": "deny", "egress": [{"action": "allow", "target": "10.0.0.1/24"}]}),
        ),
        (Method::PUT, json!({"defaultAction": "block"})),
        (
            Method::PATCH,
            json!([{"action": "allow", "target": "https://x.test"}]),
        ),
        (Method::PATCH, json!([])),
        (Method::DELETE, json!([])),
        (Method::PATCH, json!({"not": "a list"})),
    ] {
        let (status, error) = server.send(
            method.clone(),
            &format!("/v1/sandboxes/{}/networkpolicy", deny_default.id),
            Some(&body),
        );
        assert_eq!(status, 400, "{method} {body}: {error}");
        assert_eq!(error["code"], "SANDBOX::INVALID_PARAMETER", "{error}");
    }
    let (status, error) = egress_call(
        &node,
        None,
        Some(&token),
        Method::PATCH,
        Some(json!([{"action": "allow", "target": "*.*.test"}])),
    );
    assert_eq!(status, 400, "{error}");
    assert!(
        error["message"].as_str().unwrap().contains("egress[0]"),
        "{error}"
    );
    assert_eq!(policy_of(&server, &deny_default.id), before);
    assert_eq!(events_of(&server, &deny_default.id), events_before);
    let ids_before = server.ids().len();
    let (status, error) = server.post(
        "/v1/sandboxes",
        &json!({"image": {"uri": IMAGE}, "entrypoint": ["tail", "-f", "/dev/null"],
                "networkPolicy": {"egress": [{"action": "allow", "target": "bad target!"}]}}),
    );
    assert_eq!(status, 400, "{error}");
    assert_eq!(
        server.ids().len(),
        ids_before,
        "a refused create recorded a sandbox"
    );
    // Unknown sandboxes, and sandboxes that do not run.
    let (status, error) = server.get("/v1/sandboxes/no-such-sandbox/networkpolicy");
    assert_eq!(
        (status, error["code"].as_str()),
        (404, Some("SANDBOX::NOT_FOUND"))
    );
    assert_eq!(
        server.delete(&format!("/v1/sandboxes/{}", deny_all.id)),
        204
    );
    server.wait_state(&deny_all.id, "Terminated");
    let (status, error) = server.send(
        Method::PATCH,
        &format!("/v1/sandboxes/{}/networkpolicy", deny_all.id),
        Some(&json!([{"action": "allow", "target": allowed}])),
    );
    assert_eq!(
        (status, error["code"].as_str()),
        (409, Some("SANDBOX::NOT_RUNNING")),
        "{error}"
    );

    // --- a PUT replaces the whole policy (allow-all is recorded as no policy)
    let (status, replaced) = server.send(
        Method::PUT,
        &format!("/v1/sandboxes/{}/networkpolicy", allow_default.id),
        Some(&json!({})),
    );
    assert_eq!(
        (status, &replaced["mode"]),
        (200, &json!("allow_all")),
        "{replaced}"
    );
    allow_default.expect_reach("after PUT {}", &[(&denied_ip, "ok"), (&free_ip, "ok")]);
    let (status, replaced) = server.send(
        Method::PUT,
        &format!("/v1/sandboxes/{}/networkpolicy", allow_default.id),
        Some(&json!({"egress": [{"action": "allow", "target": other}]})),
    );
    assert_eq!(status, 200, "{replaced}");
    assert_eq!(
        replaced["policy"]["defaultAction"], "deny",
        "rules without a default deny the rest"
    );

    // --- a removed sandbox's tracked connections are forgotten with its slot (the next
    // sandbox given its address must not inherit them)
    let leaver = Sandbox::create(&server, None);
    let address = leaver.run("python3 /tmp/probe.py addr").trim().to_string();
    let held = leaver.hold_detached(&free_ip);
    let tracked = tracked_from(&address);
    assert!(
        tracked
            .iter()
            .any(|l| l.contains(&format!("dst={free_ip} "))),
        "no tracked connection of {address} to {free_ip}: {tracked:?}"
    );
    assert_eq!(server.delete(&format!("/v1/sandboxes/{}", leaver.id)), 204);
    server.wait_state(&leaver.id, "Terminated");
    // Without the flush the closed connection would stay listed (TIME_WAIT: 120 s); the
    // slot's release runs in the background, so wait a little.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !tracked_from(&address).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        tracked_from(&address),
        Vec::<String>::new(),
        "tracked connections of the removed sandbox's address"
    );
    drop(held);

    // --- a restart keeps the policies and applies them again
    let recorded = [
        policy_of(&server, &deny_default.id),
        policy_of(&server, &allow_default.id),
    ];
    server.stop();
    server.spawn();
    assert_eq!(
        [
            policy_of(&server, &deny_default.id),
            policy_of(&server, &allow_default.id)
        ],
        recorded
    );
    let deny_default = Sandbox::attach(&server, &deny_default.id);
    let allow_default = Sandbox::attach(&server, &allow_default.id);
    deny_default.expect_reach(
        "deny default after a restart",
        &[
            (&opened_ip, "ok"),
            (allowed, "unresolved"),
            (&free_ip, "blocked"),
        ],
    );
    allow_default.expect_reach(
        "allow-listed name after a restart",
        &[
            (other, "ok"),
            (allowed, "unresolved"),
            (&denied_ip, "blocked"),
        ],
    );
    // The token survives the restart too.
    assert_eq!(
        egress_call(&node, None, Some(&token), Method::GET, None).0,
        200
    );

    // --- a resume on its own node keeps the sandbox's open connections: CRIU connects each
    // again during the restore, which needs the sandbox's way out (its policy goes in
    // before the restore; without a route the resume failed with "Network is unreachable")
    deny_default.run(&format!(
        "nohup python3 /tmp/probe.py hold /tmp/go-resume {opened_ip} > /tmp/held-resume 2>&1 &"
    ));
    let held_says = |want: &str| {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = deny_default.run("cat /tmp/held-resume");
            if out.contains(want) {
                return out;
            }
            assert!(
                Instant::now() < deadline,
                "the holder says {out:?}, not {want:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    held_says("ready");
    for (verb, state) in [("pause", "Paused"), ("resume", "Running")] {
        let (status, body) = server.post(
            &format!("/v1/sandboxes/{}/{verb}", deny_default.id),
            &json!({}),
        );
        assert_eq!(status, 202, "{verb}: {body}");
        server.wait_state(&deny_default.id, state);
    }
    deny_default.run("touch /tmp/go-resume");
    let out = held_says(&format!("{opened_ip} "));
    assert!(
        out.contains(&format!("{opened_ip} echo")),
        "the connection held across the pause: {out:?}"
    );
    eprintln!("egress e2e: {:.1} s", started.elapsed().as_secs_f64());

    // --- the Credential Vault
    let vault_started = Instant::now();
    vault::credential_vault(&mut server, &hosts);
    eprintln!(
        "credential vault e2e: {:.1} s",
        vault_started.elapsed().as_secs_f64()
    );

    drop(hosts);
    drop(internet);
    server.finish();
}
