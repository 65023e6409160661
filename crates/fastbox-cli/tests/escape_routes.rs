//! `secureAccess: true` against a real `fastbox up`: a secure sandbox's ports refuse every
//! request that carries neither its `OpenSandbox-Secure-Access` token nor a valid signed route,
//! through the node proxy and the server proxy alike; stripping a signed route's credential
//! segments does not open it; route keys rotate while the server runs; failed checks from one
//! address end in 429; clones of a secure sandbox are secure with their own token, kept across
//! pause and resume; sandboxes without `secureAccess` keep their open routes.
//!
//! Prefix tag `8` (`UP_SERVER_TAGS`). Needs root and the static execd; skips otherwise.

mod common;

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::execd::Execd;
use common::server::UpServer;
use fastbox_proxy::{RouteSigner, to_b36};
use reqwest::blocking::Client;
use serde_json::{Value, json};

const TAG: char = '8';
const EXECD_PORT: u16 = 44772;
const SECURE: &str = "OpenSandbox-Secure-Access";
const EXECD_TOKEN: &str = "X-EXECD-ACCESS-TOKEN";
const EGRESS_AUTH: &str = "OPENSANDBOX-EGRESS-AUTH";
const API_KEY: &str = "OPEN-SANDBOX-API-KEY";
const DENIED: &str = "SANDBOX::SECURE_ACCESS_DENIED";

/// Two one-shot HTTP listeners in the sandbox, on ports 8080 and 8081: each records the
/// request head it gets in `/tmp/request-PORT.txt` and answers `ok`. Returns once both listen.
const LISTENERS: &str = r#"
for p in 8080 8081; do
  printf '#!/bin/sh\nwhile IFS= read -r line; do echo "$line" >> /tmp/request-%s.txt; [ "$line" = "$(printf "\\r")" ] && break; done\nprintf "HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\nConnection: close\\r\\n\\r\\nok"\n' $p > /tmp/answer-$p.sh
  chmod +x /tmp/answer-$p.sh
  (timeout 30 nc -l -p $p -e /tmp/answer-$p.sh </dev/null >/dev/null 2>&1 &)
done
for i in $(seq 100); do
  [ "$(netstat -ltn | grep -c -E ':808[01] ')" = 2 ] && exit 0
  usleep 50000
done
echo "listeners did not start" >&2; exit 1
"#;

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A busybox sandbox, secure or not; waits until it runs.
fn create(server: &UpServer, secure: bool) -> String {
    let (status, body) = server.post(
        "/v1/sandboxes",
        &json!({
            "image": {"uri": "fastbox/busybox"},
            "entrypoint": ["sleep", "100000"],
            "timeout": 3600,
            "resourceLimits": {"cpu": "1", "memory": "256Mi"},
            "secureAccess": secure,
        }),
    );
    assert_eq!(status, 202, "{body}");
    let id = body["id"].as_str().unwrap().to_string();
    server.wait_state(&id, "Running");
    id
}

/// `GET /v1/sandboxes/{id}/endpoints/{port}{query}`: (endpoint, headers).
fn endpoint(
    server: &UpServer,
    id: &str,
    port: u16,
    query: &str,
) -> (String, Vec<(String, String)>) {
    let (status, ep) = server.get(&format!("/v1/sandboxes/{id}/endpoints/{port}{query}"));
    assert_eq!(status, 200, "endpoint {port}{query} of {id}: {ep}");
    let headers = ep["headers"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
        .collect();
    (ep["endpoint"].as_str().unwrap().to_string(), headers)
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// One GET: (status, JSON body or Null, Retry-After).
fn get(http: &Client, url: &str, headers: &[(&str, &str)]) -> (u16, Value, Option<String>) {
    let mut req = http.get(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let r = req.send().unwrap_or_else(|e| panic!("GET {url}: {e}"));
    let status = r.status().as_u16();
    let retry = r
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_string());
    (status, r.json().unwrap_or(Value::Null), retry)
}

/// Asserts a 401 in the `{code, message}` envelope of a refused secure access.
fn assert_denied(what: &str, (status, body, _): (u16, Value, Option<String>)) {
    assert_eq!(status, 401, "{what}: {body}");
    assert_eq!(body["code"], DENIED, "{what}: {body}");
    assert!(
        body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{what}: {body}"
    );
}

/// `fastbox route-key ARGS --data-dir DATA_DIR` of the instance: its stdout.
fn route_key(server: &UpServer, args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fastbox"))
        .arg("route-key")
        .args(args)
        .arg("--data-dir")
        .arg(&server.data_dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "route-key {args:?}: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// A signed route to `port` of `id` until `expires`, signed with the instance's own key (as a
/// route issued earlier, or a forgery by a key holder, would be).
fn sign(data_dir: &Path, id: &str, port: u16, expires: u64) -> String {
    let signer = RouteSigner::load(&data_dir.join("route-signing.key")).unwrap();
    format!("{}/{}", to_b36(expires), signer.sign(id, port, expires))
}

#[test]
fn secure_sandboxes_need_their_token_or_a_signed_route() {
    let Some(server) = UpServer::start(TAG, &[]) else {
        return;
    };
    let http = Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let id = create(&server, true);

    // The endpoint carries the execd token and the access token (43 url-safe characters).
    let (node_ep, headers) = endpoint(&server, &id, EXECD_PORT, "");
    assert_eq!(node_ep, format!("{}/{id}/{EXECD_PORT}", server.node_proxy));
    let execd_token = header(&headers, EXECD_TOKEN)
        .expect("execd token")
        .to_string();
    let access = header(&headers, SECURE)
        .unwrap_or_else(|| panic!("a secure sandbox's endpoint carries {SECURE}: {headers:?}"))
        .to_string();
    assert_eq!(access.len(), 43, "{access}");
    let (server_ep, server_headers) = endpoint(&server, &id, EXECD_PORT, "?use_server_proxy=true");
    assert_eq!(header(&server_headers, SECURE), Some(access.as_str()));
    let api_key = server.api_key.clone();

    // Both proxies: no credential is a 401, the endpoint's headers a 200, another token a 401.
    let node = format!("http://{node_ep}");
    let via_server = format!("http://{server_ep}");
    for (name, base, extra) in [
        ("node proxy", &node, vec![]),
        (
            "server proxy",
            &via_server,
            vec![(API_KEY, api_key.as_str())],
        ),
    ] {
        let ping = format!("{base}/ping");
        let mut with_token = extra.clone();
        with_token.push((EXECD_TOKEN, &execd_token));
        assert_denied(
            &format!("{name}, no credential"),
            get(&http, &ping, &with_token),
        );
        let mut wrong = with_token.clone();
        wrong.push((SECURE, "not-the-token"));
        assert_denied(&format!("{name}, a wrong token"), get(&http, &ping, &wrong));
        let mut right = with_token.clone();
        right.push((SECURE, &access));
        let (status, body, _) = get(&http, &ping, &right);
        assert_eq!(status, 200, "{name}, the endpoint's headers: {body}");
        // The access token does not replace execd's own.
        let mut no_execd = extra.clone();
        no_execd.push((SECURE, &access));
        let (status, _, _) = get(&http, &ping, &no_execd);
        assert_eq!(status, 401, "{name}: execd still wants its token");
    }

    // A command through the endpoint the API hands out, with its headers (as the SDK does).
    let execd = Execd::of(&server, &id);
    assert_eq!(execd.sh("echo inside").stdout.trim(), "inside");
    // The sandbox never sees the access token in a request: the proxies strip it (and the
    // server proxy the API key). Listeners in the sandbox record what arrives on ports 8080
    // (through the node proxy) and 8081 (through the server proxy).
    execd.sh(LISTENERS);
    let (app_ep, app_headers) = endpoint(&server, &id, 8080, "");
    assert_eq!(header(&app_headers, SECURE), Some(access.as_str()));
    let app_via_server = via_server.replace(&format!("/proxy/{EXECD_PORT}"), "/proxy/8081");
    for (url, key) in [
        (format!("http://{app_ep}/seen"), None),
        (format!("{app_via_server}/seen"), Some(&api_key)),
    ] {
        let mut req = http
            .get(&url)
            .header(SECURE, &access)
            .header("X-Marker", "arrived");
        if let Some(key) = key {
            req = req.header(API_KEY, key);
        }
        let r = req.send().unwrap_or_else(|e| panic!("GET {url}: {e}"));
        assert_eq!(r.status().as_u16(), 200, "{url}");
        assert_eq!(r.text().unwrap(), "ok", "{url}");
    }
    let seen = execd
        .sh("cat /tmp/request-8080.txt /tmp/request-8081.txt")
        .stdout;
    let arrived = seen
        .to_ascii_lowercase()
        .matches("x-marker: arrived")
        .count();
    assert_eq!(arrived, 2, "both requests reached the listeners: {seen}");
    assert!(
        !seen.contains(&access),
        "the access token reached the sandbox: {seen}"
    );
    assert!(
        !seen.contains(&api_key),
        "the API key reached the sandbox: {seen}"
    );

    // Port 18080 (egress, served by the node proxy) needs both its own token and the access
    // token.
    let (egress_ep, egress_headers) = endpoint(&server, &id, 18080, "");
    let egress_token = header(&egress_headers, EGRESS_AUTH).unwrap().to_string();
    assert_eq!(header(&egress_headers, SECURE), Some(access.as_str()));
    let policy = format!("http://{egress_ep}/policy");
    assert_denied(
        "egress without the access token",
        get(&http, &policy, &[(EGRESS_AUTH, &egress_token)]),
    );
    let (status, body, _) = get(
        &http,
        &policy,
        &[(EGRESS_AUTH, &egress_token), (SECURE, &access)],
    );
    assert_eq!(status, 200, "egress with both tokens: {body}");

    // A signed route is a credential by itself; its endpoint does not carry the access token.
    let expires = now() + 300;
    let (signed_ep, signed_headers) =
        endpoint(&server, &id, EXECD_PORT, &format!("?expires={expires}"));
    assert_eq!(header(&signed_headers, SECURE), None, "{signed_headers:?}");
    let credential = signed_ep
        .strip_prefix(&format!("{node_ep}/"))
        .unwrap_or_else(|| panic!("{signed_ep} extends {node_ep}"))
        .to_string();
    let execd_only = [(EXECD_TOKEN, execd_token.as_str())];
    let (status, body, _) = get(&http, &format!("http://{signed_ep}/ping"), &execd_only);
    assert_eq!(status, 200, "a valid signed route: {body}");
    // The server proxy takes the same route form, without the API key.
    let (status, body, _) = get(
        &http,
        &format!("{via_server}/{credential}/ping"),
        &execd_only,
    );
    assert_eq!(
        status, 200,
        "a valid signed route through the server proxy: {body}"
    );
    // Its credential segments stripped: the plain path, which needs the header.
    assert_denied(
        "a signed route without its signature segments",
        get(&http, &format!("{node}/ping"), &execd_only),
    );
    // Expired (signed with the instance's key), tampered, another port's: all 401.
    let expired = sign(&server.data_dir, &id, EXECD_PORT, now() - 10);
    assert_denied(
        "an expired signed route",
        get(&http, &format!("{node}/{expired}/ping"), &execd_only),
    );
    assert_denied(
        "an expired signed route (server proxy)",
        get(&http, &format!("{via_server}/{expired}/ping"), &execd_only),
    );
    let (exp_b36, sig) = credential.split_once('/').unwrap();
    let flipped = format!(
        "{}{}",
        if sig.starts_with('0') { '1' } else { '0' },
        &sig[1..]
    );
    assert_denied(
        "a tampered signed route",
        get(
            &http,
            &format!("{node}/{exp_b36}/{flipped}/ping"),
            &execd_only,
        ),
    );
    let other_port = sign(&server.data_dir, &id, 8080, expires);
    assert_denied(
        "another port's signed route",
        get(&http, &format!("{node}/{other_port}/ping"), &execd_only),
    );
    // Expiry beyond the bound (24 h by default): a 400 when asked for, a 401 when presented.
    let far = now() + 2 * 86_400;
    let (status, body) = server.get(&format!(
        "/v1/sandboxes/{id}/endpoints/{EXECD_PORT}?expires={far}"
    ));
    assert_eq!(status, 400, "{body}");
    let too_far = sign(&server.data_dir, &id, EXECD_PORT, far);
    assert_denied(
        "a signed route expiring beyond the bound",
        get(&http, &format!("{node}/{too_far}/ping"), &execd_only),
    );

    // A clone of a secure sandbox is secure, with its own token.
    let (status, fork) = server.post(&format!("/v1/sandboxes/{id}/fork"), &json!({"count": 1}));
    assert_eq!(status, 202, "{fork}");
    let clone = fork["items"][0]["id"].as_str().unwrap().to_string();
    server.wait_state(&clone, "Running");
    let (clone_ep, clone_headers) = endpoint(&server, &clone, EXECD_PORT, "");
    let clone_access = header(&clone_headers, SECURE)
        .unwrap_or_else(|| panic!("the clone of a secure sandbox is secure: {clone_headers:?}"))
        .to_string();
    assert_ne!(clone_access, access, "each clone has its own token");
    let clone_execd = header(&clone_headers, EXECD_TOKEN).unwrap().to_string();
    let clone_ping = format!("http://{clone_ep}/ping");
    assert_denied(
        "the clone without a credential",
        get(&http, &clone_ping, &[(EXECD_TOKEN, &clone_execd)]),
    );
    assert_denied(
        "the clone with its source's token",
        get(
            &http,
            &clone_ping,
            &[(EXECD_TOKEN, &clone_execd), (SECURE, &access)],
        ),
    );
    let (status, body, _) = get(
        &http,
        &clone_ping,
        &[(EXECD_TOKEN, &clone_execd), (SECURE, &clone_access)],
    );
    assert_eq!(status, 200, "the clone with its own headers: {body}");

    // Paused and resumed, a secure sandbox keeps its token and stays secure.
    let (status, body) = server.post(&format!("/v1/sandboxes/{clone}/pause"), &json!({}));
    assert_eq!(status, 202, "{body}");
    server.wait_state(&clone, "Paused");
    let (status, body) = server.post(&format!("/v1/sandboxes/{clone}/resume"), &json!({}));
    assert_eq!(status, 202, "{body}");
    server.wait_state(&clone, "Running");
    let (_, resumed_headers) = endpoint(&server, &clone, EXECD_PORT, "");
    assert_eq!(
        header(&resumed_headers, SECURE),
        Some(clone_access.as_str())
    );
    assert_denied(
        "the resumed clone without a credential",
        get(&http, &clone_ping, &[(EXECD_TOKEN, &clone_execd)]),
    );
    let (status, body, _) = get(
        &http,
        &clone_ping,
        &[(EXECD_TOKEN, &clone_execd), (SECURE, &clone_access)],
    );
    assert_eq!(status, 200, "the resumed clone with its headers: {body}");

    // Key rotation while the server runs: a new key signs, the old one's routes keep working
    // until it is retired.
    let old_route = format!("http://{signed_ep}/ping");
    let rotated = route_key(&server, &["rotate"]);
    assert!(rotated.contains("b\tsigns"), "{rotated}");
    std::thread::sleep(Duration::from_millis(1500)); // the server reads the file within 1 s
    let (new_ep, _) = endpoint(&server, &id, EXECD_PORT, &format!("?expires={expires}"));
    assert!(new_ep.ends_with('b'), "signed with the new key: {new_ep}");
    for url in [old_route.clone(), format!("http://{new_ep}/ping")] {
        let (status, body, _) = get(&http, &url, &execd_only);
        assert_eq!(status, 200, "{url} during the overlap: {body}");
    }
    route_key(&server, &["retire", "a"]);
    std::thread::sleep(Duration::from_millis(1500));
    assert_denied(
        "a route of a retired key",
        get(&http, &old_route, &execd_only),
    );
    let (status, body, _) = get(&http, &format!("http://{new_ep}/ping"), &execd_only);
    assert_eq!(status, 200, "the new key's route: {body}");

    // A sandbox without secureAccess keeps OpenSandbox's open route.
    let open = create(&server, false);
    let (open_ep, open_headers) = endpoint(&server, &open, EXECD_PORT, "");
    assert_eq!(header(&open_headers, SECURE), None, "{open_headers:?}");
    let open_execd = header(&open_headers, EXECD_TOKEN).unwrap().to_string();
    let open_ping = format!("http://{open_ep}/ping");
    let (status, body, _) = get(&http, &open_ping, &[(EXECD_TOKEN, &open_execd)]);
    assert_eq!(status, 200, "a non-secure sandbox's plain route: {body}");

    // A wrong token, again and again from 127.0.0.1: 401s, then 429 with Retry-After (20
    // failures a minute per address by default).
    let mut statuses = Vec::new();
    let mut limited = None;
    for _ in 0..30 {
        let (status, body, retry) = get(
            &http,
            &format!("{node}/ping"),
            &[(EXECD_TOKEN, &execd_token), (SECURE, "guess")],
        );
        statuses.push(status);
        if status == 429 {
            limited = Some((body, retry));
        }
    }
    assert!(
        statuses.iter().all(|s| *s == 401 || *s == 429) && statuses[0] == 401,
        "{statuses:?}"
    );
    let (body, retry) = limited.unwrap_or_else(|| panic!("never 429: {statuses:?}"));
    assert_eq!(body["code"], "SANDBOX::TOO_MANY_FAILED_ATTEMPTS", "{body}");
    assert!(retry.is_some_and(|r| r.parse::<u64>().is_ok_and(|s| s >= 1)));
    // The right token is never limited; a signature is not even checked while limited, on
    // either proxy.
    let (status, body, _) = get(
        &http,
        &format!("{node}/ping"),
        &[(EXECD_TOKEN, &execd_token), (SECURE, &access)],
    );
    assert_eq!(status, 200, "the right token while limited: {body}");
    let (status, body, _) = get(&http, &format!("http://{new_ep}/ping"), &execd_only);
    assert_eq!(status, 429, "a signed route while limited: {body}");
    let new_credential = new_ep.strip_prefix(&format!("{node_ep}/")).unwrap();
    let (status, body, _) = get(
        &http,
        &format!("{via_server}/{new_credential}/ping"),
        &execd_only,
    );
    assert_eq!(
        status, 429,
        "a signed route through the server proxy while limited: {body}"
    );
    // Open sandboxes' plain routes check nothing, so nothing limits them.
    let (status, body, _) = get(&http, &open_ping, &[(EXECD_TOKEN, &open_execd)]);
    assert_eq!(status, 200, "a non-secure sandbox while limited: {body}");

    server.finish();
}
