//! A real `fastbox up` for end-to-end tests: the binary under test as a child process, on
//! free loopback ports, with its own prefix, address pool and data directory. Dropping it
//! deletes every sandbox through the API, stops the server, checks that nothing but the
//! instance's nft table remained, purges the instance and checks the host is clean.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use reqwest::blocking::Client;
use serde_json::Value;

pub struct UpServer {
    /// `http://127.0.0.1:PORT`.
    pub api: String,
    /// `127.0.0.1:PORT` of the node proxy.
    pub node_proxy: String,
    pub api_key: String,
    pub prefix: String,
    pub dir: tempfile::TempDir,
    pub data_dir: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
    log: PathBuf,
    http: Client,
}

/// Prefix letters of `fastbox up` tests; each test uses its own. Other suites own others:
/// `a`-`e` (sandbox_e2e), `h` (fastlet template_artifact), `n`, `o` (runtime network
/// tests), `s` (tests/sdk); `8` is escape_routes.
pub const UP_SERVER_TAGS: &str = "gijklmpqrtuvwxyz68";

/// The image cache the tests share (`FASTBOX_TEST_CACHE_DIR` when set).
pub fn test_cache_dir() -> PathBuf {
    std::env::var_os("FASTBOX_TEST_CACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("fastbox-test-cache"))
}

/// The create request of a busybox sandbox running `sleep`, with the fields of `extra` (an
/// object) added or replaced.
pub fn busybox_request(extra: Value) -> Value {
    let mut request = serde_json::json!({
        "image": {"uri": "fastbox/busybox"},
        "entrypoint": ["sleep", "100000"],
        "timeout": 3600,
        "resourceLimits": {"cpu": "1", "memory": "256Mi"},
    });
    if let (Some(request), Value::Object(extra)) = (request.as_object_mut(), extra) {
        request.extend(extra);
    }
    request
}

/// `fastbox ARGS` with its output appended to `log`, at the log level
/// `FASTBOX_TEST_SERVER_LOG` (else `info`).
pub fn spawn_logged(args: &[String], log: &Path) -> Child {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    Command::new(env!("CARGO_BIN_EXE_fastbox"))
        .args(args)
        .env(
            "FASTBOX_LOG",
            std::env::var("FASTBOX_TEST_SERVER_LOG").unwrap_or_else(|_| "info".into()),
        )
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn fastbox {args:?}: {e}"))
}

/// Polls `ready` until it holds; panics with `log` when `child` (`what`) exits first (and
/// takes it) or after `patience`.
pub fn wait_ready(
    child: &mut Option<Child>,
    log: &Path,
    what: &str,
    patience: Duration,
    ready: impl Fn() -> bool,
) {
    let text = || std::fs::read_to_string(log).unwrap_or_default();
    let deadline = Instant::now() + patience;
    loop {
        if let Some(status) = child.as_mut().unwrap().try_wait().unwrap() {
            *child = None;
            panic!("{what} exited with {status}:\n{}", text());
        }
        if ready() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what} not ready after {patience:?}:\n{}",
            text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

impl UpServer {
    /// Starts `fastbox up` for the test tagged `tag` (its own prefix and pool
    /// 10.217.<tag>.0/24) and waits until it is healthy. None, with the reason printed, when
    /// this machine cannot run it.
    pub fn start(tag: char, extra_args: &[&str]) -> Option<UpServer> {
        let extra_args = extra_args.iter().map(|a| a.to_string()).collect();
        Self::start_with(tag, |_| ((), extra_args)).map(|(server, ())| server)
    }

    /// Like [`UpServer::start`], but `setup` first gets the instance's prefix and returns
    /// something the test keeps (e.g. a test internet named after the prefix, so a purge
    /// removes it too) and the extra arguments of `fastbox up` (e.g. `--dns-upstream`
    /// pointing at that internet).
    pub fn start_with<T>(
        tag: char,
        setup: impl FnOnce(&str) -> (T, Vec<String>),
    ) -> Option<(UpServer, T)> {
        assert!(
            UP_SERVER_TAGS.contains(tag),
            "tag {tag:?}: UpServer tests use one of {UP_SERVER_TAGS:?} (see fastbox_testkit::run_prefix)"
        );
        if let Some(reason) = super::unavailable() {
            eprintln!("skipped: {reason}");
            return None;
        }
        let prefix = fastbox_testkit::run_prefix(&tag.to_string());
        let (kept, extra_args) = setup(&prefix);
        let server = Self::launch(prefix, &format!("10.217.{}.0/24", tag as u8), extra_args);
        Some((server, kept))
    }

    /// Starts `fastbox up` with host-wide names under `prefix` (a suite's own, e.g. from
    /// `fastbox_testkit::run_prefix_pair`) and sandbox addresses in `pool`, and waits until
    /// it is healthy. None, with the reason printed, when this machine cannot run it.
    pub fn start_prefixed(prefix: &str, pool: &str, extra_args: &[&str]) -> Option<UpServer> {
        if let Some(reason) = super::unavailable() {
            eprintln!("skipped: {reason}");
            return None;
        }
        let extra_args = extra_args.iter().map(|a| a.to_string()).collect();
        Some(Self::launch(prefix.to_string(), pool, extra_args))
    }

    fn launch(prefix: String, pool: &str, extra_args: Vec<String>) -> UpServer {
        let dir = tempfile::Builder::new()
            .prefix(&format!("{prefix}-"))
            .tempdir()
            .expect("tempdir");
        let data_dir = dir.path().join("data");
        let (api_port, node_port) = (
            fastbox_testkit::server_port(),
            fastbox_testkit::server_port(),
        );
        let api_key = format!("key-{prefix}");
        let mut args: Vec<String> = vec![
            "up".into(),
            "--listen".into(),
            format!("127.0.0.1:{api_port}"),
            "--node-proxy-listen".into(),
            format!("127.0.0.1:{node_port}"),
            "--api-key".into(),
            api_key.clone(),
            "--data-dir".into(),
            data_dir.display().to_string(),
            "--prefix".into(),
            prefix.clone(),
            "--pool".into(),
            pool.into(),
            "--execd".into(),
            fastbox_testkit::execd_path().unwrap().display().to_string(),
        ];
        if !extra_args.iter().any(|a| a == "--cache-dir") {
            args.extend(["--cache-dir".into(), test_cache_dir().display().to_string()]);
        }
        if !extra_args.iter().any(|a| a.contains("default-image")) {
            args.extend(["--default-image".into(), "fastbox/busybox".into()]);
        }
        args.extend(extra_args);
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert("OPEN-SANDBOX-API-KEY", api_key.parse().unwrap());
        let http = Client::builder()
            .default_headers(headers)
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap();
        let log = dir.path().join("server.log");
        let mut server = UpServer {
            api: format!("http://127.0.0.1:{api_port}"),
            node_proxy: format!("127.0.0.1:{node_port}"),
            api_key,
            prefix,
            data_dir,
            dir,
            args,
            child: None,
            log,
            http,
        };
        server.spawn();
        server
    }

    /// Starts the server process (again) and waits for `/health`. Its log level is
    /// `FASTBOX_TEST_SERVER_LOG` (e.g. `info,fastbox_egress=debug`), else `info`.
    pub fn spawn(&mut self) {
        self.child = Some(spawn_logged(&self.args, &self.log));
        let (http, health) = (&self.http, format!("{}/health", self.api));
        // No server to clean up through when it exits: the drop purges by prefix.
        wait_ready(
            &mut self.child,
            &self.log,
            "fastbox up",
            Duration::from_secs(300),
            || {
                http.get(&health)
                    .timeout(Duration::from_secs(2))
                    .send()
                    .is_ok_and(|r| r.status() == 200)
            },
        );
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM and wait: a clean stop.
    pub fn stop(&mut self) {
        terminate(&mut self.child);
    }

    /// `kill -9`: a crash.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.api)
    }

    /// GET a lifecycle path: (status, JSON body or Null).
    pub fn get(&self, path: &str) -> (u16, Value) {
        let r = self.http.get(self.url(path)).send().expect("GET");
        let status = r.status().as_u16();
        (status, r.json().unwrap_or(Value::Null))
    }

    /// POST JSON with extra headers: the whole response.
    pub fn post_with(
        &self,
        path: &str,
        body: &Value,
        headers: &[(&str, &str)],
    ) -> reqwest::blocking::Response {
        let mut request = self.http.post(self.url(path)).json(body);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.send().expect("POST")
    }

    /// `GET /v1/nodes`: node id -> its JSON.
    pub fn nodes(&self) -> std::collections::BTreeMap<String, Value> {
        let (status, body) = self.get("/v1/nodes");
        assert_eq!(status, 200, "{body}");
        body["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| (n["id"].as_str().unwrap().to_string(), n.clone()))
            .collect()
    }

    /// Waits until node `id` is in `state` (`GET /v1/nodes`).
    pub fn wait_node(&self, id: &str, state: &str, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let now = self.nodes().get(id).map(|n| n["state"].clone());
            if now.as_ref().and_then(|s| s.as_str()) == Some(state) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "node {id} is {now:?}, not {state}:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// GET a path: the whole response (headers too).
    pub fn raw_get(&self, path: &str) -> reqwest::blocking::Response {
        self.http.get(self.url(path)).send().expect("GET")
    }

    /// GET a path whose body is text: (status, body).
    pub fn get_text(&self, path: &str) -> (u16, String) {
        let r = self.http.get(self.url(path)).send().expect("GET");
        let status = r.status().as_u16();
        (status, r.text().unwrap_or_default())
    }

    /// POST JSON to a lifecycle path.
    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = self
            .http
            .post(self.url(path))
            .json(body)
            .send()
            .expect("POST");
        let status = r.status().as_u16();
        (status, r.json().unwrap_or(Value::Null))
    }

    /// Any method on a lifecycle path, with an optional JSON body: (status, JSON body or Null).
    pub fn send(&self, method: reqwest::Method, path: &str, body: Option<&Value>) -> (u16, Value) {
        let mut req = self.http.request(method, self.url(path));
        if let Some(body) = body {
            req = req.json(body);
        }
        let r = req.send().expect("request");
        let status = r.status().as_u16();
        (status, r.json().unwrap_or(Value::Null))
    }

    pub fn delete(&self, path: &str) -> u16 {
        self.http
            .delete(self.url(path))
            .send()
            .expect("DELETE")
            .status()
            .as_u16()
    }

    /// Creates a busybox sandbox running `sleep` and returns its id.
    pub fn create_busybox(&self) -> String {
        self.create_busybox_with(serde_json::json!({}))
    }

    /// Creates a busybox sandbox running `sleep`, with `extra` fields in its request, and
    /// returns its id.
    pub fn create_busybox_with(&self, extra: Value) -> String {
        let (status, body) = self.post("/v1/sandboxes", &busybox_request(extra));
        assert_eq!(status, 202, "{body}");
        body["id"].as_str().unwrap().to_string()
    }

    pub fn state(&self, id: &str) -> (String, Option<String>) {
        let (status, body) = self.get(&format!("/v1/sandboxes/{id}"));
        assert_eq!(status, 200, "{body}");
        (
            body["status"]["state"].as_str().unwrap().to_string(),
            body["status"]["reason"].as_str().map(str::to_string),
        )
    }

    /// Polls until `id` is in `state` (panics after 60 s).
    pub fn wait_state(&self, id: &str, state: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let (now, _) = self.state(id);
            if now == state {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{id} stayed {now}, wanted {state}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// execd `/ping` of `id` through the node proxy endpoint the API hands out: the status.
    pub fn ping(&self, id: &str) -> u16 {
        self.ping_answer(id).0
    }

    /// [`Self::ping`], with the answer's body (what a refusal says).
    pub fn ping_answer(&self, id: &str) -> (u16, String) {
        let (status, ep) = self.get(&format!("/v1/sandboxes/{id}/endpoints/44772"));
        if status != 200 {
            return (status, ep.to_string());
        }
        let mut req =
            Client::new().get(format!("http://{}/ping", ep["endpoint"].as_str().unwrap()));
        for (k, v) in ep["headers"].as_object().into_iter().flatten() {
            req = req.header(k.as_str(), v.as_str().unwrap());
        }
        match req.send() {
            Ok(answer) => (answer.status().as_u16(), answer.text().unwrap_or_default()),
            Err(e) => (0, e.to_string()),
        }
    }

    /// Ids of every listed sandbox.
    pub fn ids(&self) -> Vec<String> {
        let (_, body) = self.get("/v1/sandboxes?pageSize=200");
        body["items"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|s| s["id"].as_str().unwrap().to_string())
            .collect()
    }

    fn cleanup(&mut self) -> Vec<String> {
        if self.child.is_some() {
            let ids = self.ids();
            for id in &ids {
                self.delete(&format!("/v1/sandboxes/{id}"));
            }
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline
                && ids.iter().any(|id| {
                    let (s, _) = self.state(id);
                    s != "Terminated" && s != "Failed"
                })
            {
                std::thread::sleep(Duration::from_millis(100));
            }
            // Failed sandboxes are cleaned by the reconciler: give it a pass.
            std::thread::sleep(Duration::from_millis(2500));
        }
        self.stop();
        let table = format!("nft table inet {}", self.prefix);
        let leaked: Vec<String> = fastbox_cli::local_sandbox::leftovers(&self.prefix)
            .into_iter()
            .filter(|l| *l != table)
            .collect();
        let _ = fastbox_fastlet::host::purge(&self.prefix, &self.data_dir);
        leaked
    }

    /// Deletes everything, stops, and asserts that no sandbox state outlived its deletion and
    /// that the purge left the host clean.
    pub fn finish(mut self) {
        let leaked = self.cleanup();
        assert!(
            leaked.is_empty(),
            "deleted sandboxes left host state: {leaked:?}\n{}",
            self.log_text()
        );
        let after = fastbox_cli::local_sandbox::leftovers(&self.prefix);
        assert!(after.is_empty(), "purge left host state: {after:?}");
    }
}

impl Drop for UpServer {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = self.cleanup();
        }
        let _ = fastbox_fastlet::host::purge(&self.prefix, &self.data_dir);
    }
}

/// SIGTERM to `child` (when there is one) and wait for it.
pub fn terminate(child: &mut Option<Child>) {
    if let Some(mut child) = child.take() {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = child.wait();
    }
}
