//! A `fastbox node` process for the end-to-end tests (remote_node.rs, state_e2e.rs).

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

use serde_json::json;

use super::server::{spawn_logged, test_cache_dir, wait_ready};

/// A `fastbox node` child process with its own prefix, pool and data directory.
pub struct NodeProcess {
    pub prefix: String,
    pub dir: tempfile::TempDir,
    pub data_dir: PathBuf,
    /// `http://127.0.0.1:PORT` of the node API.
    pub api: String,
    /// `127.0.0.1:PORT` of the node proxy.
    pub proxy: String,
    pub log: PathBuf,
    pub args: Vec<String>,
    pub child: Option<Child>,
}

impl NodeProcess {
    /// Starts the node and waits until its node API answers; `meeting` says how it meets the
    /// server (`--control-url URL`, or `--join URL --join-token-file FILE ...`).
    pub fn start(prefix: &str, pool: &str, meeting: &[&str]) -> NodeProcess {
        let dir = tempfile::Builder::new()
            .prefix(&format!("{prefix}-"))
            .tempdir()
            .unwrap();
        let data_dir = dir.path().join("data");
        let (api_port, proxy_port) = (
            fastbox_testkit::server_port(),
            fastbox_testkit::server_port(),
        );
        let proxy = format!("127.0.0.1:{proxy_port}");
        let args = [
            "node",
            "--listen",
            &format!("127.0.0.1:{api_port}"),
            "--node-proxy-listen",
            &proxy,
            "--node-proxy-public",
            &proxy,
            "--prefix",
            prefix,
            "--pool",
            pool,
            "--data-dir",
            &data_dir.display().to_string(),
            "--cache-dir",
            &test_cache_dir().display().to_string(),
            "--execd",
            &fastbox_testkit::execd_path().unwrap().display().to_string(),
        ]
        .map(String::from)
        .into_iter()
        .chain(meeting.iter().map(|a| a.to_string()))
        .collect();
        let mut node = NodeProcess {
            prefix: prefix.to_string(),
            log: dir.path().join("node.log"),
            dir,
            data_dir,
            // A node that joins serves its API over TLS.
            api: match meeting.contains(&"--join") {
                true => format!("https://127.0.0.1:{api_port}"),
                false => format!("http://127.0.0.1:{api_port}"),
            },
            proxy,
            args,
            child: None,
        };
        node.spawn();
        node
    }

    /// Starts the process (again) and waits until its node API answers (401 without a
    /// credential).
    pub fn spawn(&mut self) {
        self.child = Some(spawn_logged(&self.args, &self.log));
        // Only a readiness probe: the server's own client pins the node's certificate.
        let (http, status) = (
            reqwest::blocking::Client::builder()
                .danger_accept_invalid_certs(true)
                .build()
                .unwrap(),
            format!("{}/node/v1/status", self.api),
        );
        wait_ready(
            &mut self.child,
            &self.log,
            "fastbox node",
            Duration::from_secs(120),
            || {
                http.post(&status)
                    .json(&json!({}))
                    .timeout(Duration::from_secs(2))
                    .send()
                    .is_ok_and(|r| r.status() == 401)
            },
        );
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `fastbox node --print-credentials`: the two lines the server is given.
    pub fn credentials(&self) -> String {
        let out = Command::new(env!("CARGO_BIN_EXE_fastbox"))
            .args(["node", "--print-credentials", "--data-dir"])
            .arg(&self.data_dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    }

    /// SIGTERM and wait.
    pub fn stop(&mut self) {
        super::server::terminate(&mut self.child);
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = fastbox_fastlet::host::purge(&self.prefix, &self.data_dir);
    }
}
