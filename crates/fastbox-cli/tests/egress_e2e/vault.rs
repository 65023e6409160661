//! The Credential Vault end to end, through the API of the real `fastbox up` of
//! `egress_e2e`: a sandbox created with `credentialProxy.enabled`, its vault filled through
//! port 18080, and HTTPS requests made by Python inside the sandbox (trusting the system
//! store, as any client does) to TLS hosts of the test internet:
//! - `vault.test` (the real host, a certificate of a test CA the server is told to trust
//!   with `--credential-proxy-roots`) records each request's `Authorization` out of band:
//!   it gets the vault's secret, and the sandbox sees it redacted;
//! - an impostor host, with a certificate for the same names from a CA nobody trusts, gets
//!   nothing: neither when the sandbox aims the bound name at its address (the proxy goes
//!   to the name's own address), nor when DNS answers a bound name (`spoofed.test`) with it
//!   (the proxy's verification fails: 502);
//! - a pause's dump of the sandbox's memory and every file of the instance (its layers,
//!   checkpoints, state, logs) hold no trace of the secret, while the same dump does hold a
//!   marker the sandbox keeps in memory (so the search can fail);
//! - after the resume the vault is still there, and the request is injected again;
//! - after the server is killed and started again, the sandbox is adopted with its HTTPS
//!   through the proxy again and an empty vault (values lived in the last run's memory):
//!   unbound, its request reaches the real host untouched (whose certificate the sandbox
//!   does not trust); a new vault injects again.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fastbox_credential_proxy::testkit::{Received, TestCert, recording_host};
use fastbox_egress::testkit::TestInternet;
use reqwest::Method;
use serde_json::{Value, json};

use super::common::server::UpServer;
use super::{EGRESS_AUTH, EGRESS_PORT, IMAGE, Sandbox, inet};

/// The bound host, and a bound name whose DNS answer is the impostor's address.
pub const VAULT: (&str, u8) = ("vault.test", 30);
pub const SPOOFED: (&str, u8) = ("spoofed.test", 31);
/// The impostor's address (the same as `SPOOFED`'s).
const IMPOSTOR: u8 = 31;

/// Makes an HTTPS request to `argv[1]` (at `argv[2]` when given, the name still sent as SNI
/// and `Host`) with a placeholder credential of its own; prints `STATUS ECHO | BODY` or
/// `error ...` (shared with the SDK suite).
const HTTPS: &str = include_str!("../../../../tests/sdk/https_probe.py");

/// The test internet's TLS hosts, running for as long as this lives.
pub struct Hosts {
    _runtime: tokio::runtime::Runtime,
    real: Received,
    impostor: Received,
    roots: tempfile::TempDir,
}

impl Hosts {
    /// Starts the real host on `VAULT`'s address and the impostor on `IMPOSTOR`'s, inside
    /// `internet`'s namespace.
    pub fn start(internet: &TestInternet) -> Hosts {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let trusted = TestCert::new(&[VAULT.0, SPOOFED.0]);
        let untrusted = TestCert::new(&[VAULT.0, SPOOFED.0]);
        let listen = |n: u8| {
            let address: Ipv4Addr = inet(n).parse().unwrap();
            let listener = fastbox_runtime::net::in_netns(internet.netns_path(), move || {
                std::net::TcpListener::bind((address, 443))
            })
            .unwrap()
            .expect("a TLS host's listener");
            listener.set_nonblocking(true).unwrap();
            listener
        };
        let (real, impostor) = (listen(VAULT.1), listen(IMPOSTOR));
        let (real, impostor) = runtime.block_on(async {
            (
                recording_host(tokio::net::TcpListener::from_std(real).unwrap(), &trusted),
                recording_host(
                    tokio::net::TcpListener::from_std(impostor).unwrap(),
                    &untrusted,
                ),
            )
        });
        let roots = tempfile::tempdir().unwrap();
        std::fs::write(roots.path().join("roots.pem"), &trusted.ca_pem).unwrap();
        Hosts {
            _runtime: runtime,
            real,
            impostor,
            roots,
        }
    }

    /// The PEM file of the CA the real host's certificate chains to.
    pub fn roots_file(&self) -> PathBuf {
        self.roots.path().join("roots.pem")
    }

    fn real(&self) -> Vec<String> {
        self.real.lock().unwrap().clone()
    }

    fn impostor(&self) -> Vec<String> {
        self.impostor.lock().unwrap().clone()
    }
}

/// A value no file or process holds before the test gives it to the vault.
fn secret() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("fbv-{:x}-{nanos:x}", std::process::id())
}

/// A request to the vault routes of port 18080 through `base` (the node proxy's).
fn vault_call(
    base: &str,
    token: &str,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> (u16, String) {
    let mut req = reqwest::blocking::Client::new()
        .request(method, format!("{base}/credential-vault{path}"))
        .header(EGRESS_AUTH, token)
        .timeout(Duration::from_secs(30));
    if let Some(body) = body {
        req = req.json(&body);
    }
    let r = req.send().expect("vault request");
    (r.status().as_u16(), r.text().unwrap_or_default())
}

/// `POST /credential-vault`: credential `token` holding `secret`, bound as a bearer token for
/// `hosts`.
fn make_vault(node: &str, token: &str, secret: &str, hosts: &[&str]) -> (u16, String) {
    vault_call(
        node,
        token,
        Method::POST,
        "",
        Some(json!({
            "credentials": [{"name": "token", "source": {"type": "inline", "value": secret}}],
            "bindings": [{"name": "api", "match": {"hosts": hosts},
                          "auth": {"type": "bearer", "credential": "token"}}],
        })),
    )
}

/// Every file under `dir` holding `needle`: the sandboxes' writable layers, checkpoints
/// (their memory), the state store, everything, read where it holds data (sparse disk
/// images are mostly holes). Overlay mounts (a sandbox's root) are not entered: their
/// upper directories are searched where they live, and the rest is the image.
fn files_holding(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
    const OVERLAY: nix::sys::statfs::FsType = nix::sys::statfs::OVERLAYFS_SUPER_MAGIC;
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let (path, Ok(kind)) = (entry.path(), entry.file_type()) else {
                continue;
            };
            if kind.is_dir() {
                let overlay =
                    nix::sys::statfs::statfs(&path).is_ok_and(|s| s.filesystem_type() == OVERLAY);
                if !overlay {
                    stack.push(path);
                }
            } else if kind.is_file() && holds(&path, needle) {
                found.push(path);
            }
        }
    }
    found
}

/// Whether the data regions of file `path` hold `needle`.
fn holds(path: &Path, needle: &[u8]) -> bool {
    use nix::unistd::{Whence, lseek};
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    let Ok(file) = std::fs::File::open(path) else {
        return false;
    };
    let mut buf = vec![0u8; 1 << 20];
    let mut at: i64 = 0;
    // Each data region, read a chunk at a time; chunks overlap by the needle's length.
    while let Ok(start) = lseek(file.as_raw_fd(), at, Whence::SeekData) {
        let end = lseek(file.as_raw_fd(), start, Whence::SeekHole).unwrap_or(i64::MAX);
        let mut pos = start;
        while pos < end {
            let want = buf
                .len()
                .min(usize::try_from(end - pos).unwrap_or(usize::MAX));
            let Ok(n) = file.read_at(&mut buf[..want], pos as u64) else {
                return false;
            };
            if n == 0 {
                break;
            }
            if buf[..n].windows(needle.len()).any(|w| w == needle) {
                return true;
            }
            if n < needle.len() {
                break;
            }
            pos += (n - needle.len() + 1) as i64;
        }
        at = end;
    }
    false
}

pub fn credential_vault(server: &mut UpServer, hosts: &Hosts) {
    let secret = secret();
    // Built at run time: the sandbox's memory holds the joined marker, nothing else does.
    let marker = "fbv-memory-marker-1234567";
    let created = {
        let body = json!({
            "image": {"uri": IMAGE},
            "entrypoint": ["python3", "-c",
                "import time\nm = 'fbv-memory-' + 'marker-' + str(1234567)\ntime.sleep(10**7)"],
            "timeout": 3600,
            "resourceLimits": {"cpu": "1", "memory": "256Mi"},
            "networkPolicy": {"defaultAction": "deny", "egress": [
                {"action": "allow", "target": VAULT.0},
                {"action": "allow", "target": SPOOFED.0},
            ]},
            "credentialProxy": {"enabled": true},
        });
        let (status, created) = server.post("/v1/sandboxes", &body);
        assert_eq!(status, 202, "{created}");
        created["id"].as_str().unwrap().to_string()
    };
    server.wait_state(&created, "Running");
    let sandbox = Sandbox::attach(server, &created);
    sandbox
        .execd
        .upload(
            "/tmp/https.py",
            0o644,
            std::io::Cursor::new(HTTPS.as_bytes()),
            Some(HTTPS.len() as u64),
        )
        .expect("upload the request script");
    let (status, endpoint) =
        server.get(&format!("/v1/sandboxes/{created}/endpoints/{EGRESS_PORT}"));
    assert_eq!(status, 200, "{endpoint}");
    let token = endpoint["headers"][EGRESS_AUTH]
        .as_str()
        .unwrap()
        .to_string();
    let node = format!("http://{}", endpoint["endpoint"].as_str().unwrap());

    // --- the vault: made through port 18080; no answer carries the value
    let (status, body) = make_vault(&node, &token, &secret, &[VAULT.0, SPOOFED.0]);
    assert_eq!(status, 201, "{body}");
    assert!(!body.contains(&secret), "{body}");
    let https = |args: &str| sandbox.run(&format!("python3 /tmp/https.py {args}"));

    // --- a bound host gets the credential, out of band; the sandbox sees it redacted
    let redacted = "200 Bearer [REDACTED] | echo: Bearer [REDACTED]";
    assert_eq!(https(VAULT.0).trim(), redacted);
    let injected = format!("GET /user/repos?per_page=1 authorization=Bearer {secret}");
    assert_eq!(hosts.real(), vec![injected.clone()]);

    // --- the bound name aimed at the impostor's address: the proxy goes to the name's own
    let impostor = inet(IMPOSTOR);
    assert_eq!(https(&format!("{} {impostor}", VAULT.0)).trim(), redacted);
    assert_eq!(hosts.real().len(), 2);
    // --- a bound name DNS answers with the impostor: its certificate does not verify
    let spoofed = https(SPOOFED.0);
    assert!(spoofed.starts_with("502 "), "{spoofed}");
    assert!(!spoofed.contains(&secret), "{spoofed}");
    assert_eq!(
        hosts.impostor(),
        Vec::<String>::new(),
        "the impostor got a request"
    );
    assert_eq!(hosts.real().len(), 2);

    // --- a pause's dump of its memory, and every file of the instance: no secret
    let (status, body) = server.post(&format!("/v1/sandboxes/{created}/pause"), &json!({}));
    assert_eq!(status, 202, "pause: {body}");
    server.wait_state(&created, "Paused");
    let with_marker = files_holding(&server.data_dir, marker.as_bytes());
    assert!(
        !with_marker.is_empty(),
        "the pause's dump holds the sandbox's memory marker (else the search proves nothing)"
    );
    assert_eq!(
        files_holding(&server.data_dir, secret.as_bytes()),
        Vec::<PathBuf>::new(),
        "files holding the secret"
    );
    assert!(
        !server.log_text().contains(&secret),
        "the server's log holds the secret"
    );

    // --- resumed on its node: the vault is still there, and still injects
    let (status, body) = server.post(&format!("/v1/sandboxes/{created}/resume"), &json!({}));
    assert_eq!(status, 202, "resume: {body}");
    server.wait_state(&created, "Running");
    let (status, body) = vault_call(&node, &token, Method::GET, "/bindings", None);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"api\""), "{body}");
    let sandbox = Sandbox::attach(server, &created);
    let out = sandbox.run(&format!("python3 /tmp/https.py {}", VAULT.0));
    assert_eq!(out.trim(), redacted);
    assert_eq!(hosts.real().len(), 3);
    assert_eq!(hosts.real()[2], injected);

    // --- the server killed and started again: adopted, through the proxy, its vault empty
    server.kill9();
    server.spawn();
    server.wait_state(&created, "Running");
    let (status, body) = vault_call(&node, &token, Method::GET, "", None);
    assert_eq!(
        status, 404,
        "the vault did not outlive the node's memory: {body}"
    );
    let sandbox = Sandbox::attach(server, &created);
    let out = sandbox.run(&format!("python3 /tmp/https.py {}", VAULT.0));
    assert!(
        out.contains("CERTIFICATE_VERIFY_FAILED"),
        "unbound, untouched: {out}"
    );
    assert_eq!(
        hosts.real().len(),
        3,
        "the handshake failed before any request"
    );
    let (status, body) = make_vault(&node, &token, &secret, &[VAULT.0]);
    assert_eq!(status, 201, "{body}");
    let out = sandbox.run(&format!("python3 /tmp/https.py {}", VAULT.0));
    assert_eq!(out.trim(), redacted);
    assert_eq!(hosts.real().len(), 4);
    assert_eq!(server.delete(&format!("/v1/sandboxes/{created}")), 204);
}
