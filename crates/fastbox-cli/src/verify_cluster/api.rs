//! The lifecycle API as the scenario uses it: JSON in and out, the API key on every call.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::Value;

pub struct Api {
    pub base: String,
    key: String,
    http: reqwest::blocking::Client,
}

impl Api {
    pub fn new(base: String, key: String) -> anyhow::Result<Self> {
        Ok(Self {
            base,
            key,
            http: reqwest::blocking::Client::builder()
                .timeout(Duration::from_secs(60))
                .build()?,
        })
    }

    /// The same, each call given up after `timeout`.
    pub fn with_timeout(mut self, timeout: Duration) -> anyhow::Result<Self> {
        self.http = reqwest::blocking::Client::builder()
            .timeout(timeout)
            .build()?;
        Ok(self)
    }

    /// `POST {path}` with JSON `body` and the headers `headers`: the status and the body.
    pub fn post_with(
        &self,
        path: &str,
        body: &Value,
        headers: &[(&str, &str)],
    ) -> anyhow::Result<(u16, Value)> {
        let mut request = self.http.post(format!("{}{path}", self.base)).json(body);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        self.send(request)
    }

    fn send(&self, request: reqwest::blocking::RequestBuilder) -> anyhow::Result<(u16, Value)> {
        let response = request.header("OPEN-SANDBOX-API-KEY", &self.key).send()?;
        let status = response.status().as_u16();
        let text = response.text().unwrap_or_default();
        Ok((
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        ))
    }

    pub fn get(&self, path: &str) -> anyhow::Result<(u16, Value)> {
        self.send(self.http.get(format!("{}{path}", self.base)))
    }

    pub fn delete(&self, path: &str) -> anyhow::Result<u16> {
        Ok(self
            .send(self.http.delete(format!("{}{path}", self.base)))?
            .0)
    }

    /// Whether `/health` answers 200.
    pub fn healthy(&self) -> bool {
        self.get("/health").is_ok_and(|(status, _)| status == 200)
    }

    /// `GET /v1/nodes`: `(id, node)` in the server's order.
    pub fn nodes(&self) -> anyhow::Result<Vec<(String, Value)>> {
        let (status, body) = self.get("/v1/nodes")?;
        if status != 200 {
            bail!("GET /v1/nodes: {status} {body}");
        }
        Ok(body["items"]
            .as_array()
            .context("GET /v1/nodes: no items")?
            .iter()
            .map(|n| (n["id"].as_str().unwrap_or_default().to_string(), n.clone()))
            .collect())
    }

    /// Node `id`'s entry.
    /// `host:port` of registered node `id`'s proxy.
    pub fn node_proxy(&self, id: &str) -> anyhow::Result<String> {
        self.node(id)?
            .and_then(|n| n["proxy"].as_str().map(str::to_string))
            .with_context(|| format!("node {id}'s proxy"))
    }

    pub fn node(&self, id: &str) -> anyhow::Result<Option<Value>> {
        Ok(self
            .nodes()?
            .into_iter()
            .find(|(n, _)| n == id)
            .map(|(_, v)| v))
    }

    /// A new sandbox of `image` (sleeping), once `Running`; its id.
    pub fn running(&self, image: &str) -> anyhow::Result<String> {
        self.running_with(image, 256)
    }

    /// [`Api::running`] with a memory limit of `memory_mib`.
    pub fn running_with(&self, image: &str, memory_mib: u64) -> anyhow::Result<String> {
        self.create(&serde_json::json!({
            "image": {"uri": image},
            "entrypoint": ["sleep", "100000"],
            "timeout": 3600,
            "resourceLimits": {"cpu": "250m", "memory": format!("{memory_mib}Mi")},
        }))
    }

    /// `POST /v1/sandboxes` with `body`; the new sandbox's id once it is `Running`.
    pub fn create(&self, body: &Value) -> anyhow::Result<String> {
        let (status, created) = self.send(
            self.http
                .post(format!("{}/v1/sandboxes", self.base))
                .json(body),
        )?;
        if status != 202 {
            bail!("create: {status} {created}");
        }
        let id = created["id"].as_str().context("create: no id")?.to_string();
        self.wait_state(&id, "Running", Duration::from_secs(120))?;
        Ok(id)
    }

    /// `(state, reason)` of sandbox `id`.
    pub fn state(&self, id: &str) -> anyhow::Result<(String, Option<String>)> {
        let (status, body) = self.get(&format!("/v1/sandboxes/{id}"))?;
        if status != 200 {
            bail!("GET sandbox {id}: {status} {body}");
        }
        Ok((
            body["status"]["state"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            body["status"]["reason"].as_str().map(str::to_string),
        ))
    }

    /// Sandbox `id`'s status message (why it is in its state), if it has one.
    pub fn message(&self, id: &str) -> anyhow::Result<String> {
        let (status, body) = self.get(&format!("/v1/sandboxes/{id}"))?;
        if status != 200 {
            bail!("GET sandbox {id}: {status} {body}");
        }
        Ok(body["status"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string())
    }

    pub fn wait_state(&self, id: &str, state: &str, within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        loop {
            let (now, reason) = self.state(id)?;
            if now == state {
                return Ok(());
            }
            if now == "Failed" || Instant::now() >= deadline {
                let message = self
                    .get(&format!("/v1/sandboxes/{id}"))
                    .ok()
                    .and_then(|(_, b)| b["status"]["message"].as_str().map(str::to_string))
                    .unwrap_or_default();
                bail!("sandbox {id} is {now} ({reason:?}: {message}), not {state}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The endpoint of execd (port 44772) of sandbox `id` and its token.
    pub fn execd(&self, id: &str) -> anyhow::Result<(String, String)> {
        let (status, ep) = self.get(&format!("/v1/sandboxes/{id}/endpoints/44772"))?;
        if status != 200 {
            bail!("endpoint of {id}: {status} {ep}");
        }
        Ok((
            ep["endpoint"].as_str().context("no endpoint")?.to_string(),
            ep["headers"]["X-EXECD-ACCESS-TOKEN"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        ))
    }

    /// Whether execd of sandbox `id` answers `/ping` through its endpoint.
    pub fn pings(&self, id: &str) -> bool {
        let Ok((endpoint, token)) = self.execd(id) else {
            return false;
        };
        self.http
            .get(format!("http://{endpoint}/ping"))
            .header("X-EXECD-ACCESS-TOKEN", token)
            .timeout(Duration::from_secs(5))
            .send()
            .is_ok_and(|r| r.status().is_success())
    }

    /// `POST {path}` with an empty JSON object: the status and the body.
    pub fn post(&self, path: &str) -> anyhow::Result<(u16, Value)> {
        self.post_with(path, &serde_json::json!({}), &[])
    }

    /// Runs `script` in sandbox `id` through execd (`POST /command`): its standard output.
    pub fn sh(&self, id: &str, script: &str) -> anyhow::Result<String> {
        let (endpoint, token) = self.execd(id)?;
        let response = self
            .http
            .post(format!("http://{endpoint}/command"))
            .header("X-EXECD-ACCESS-TOKEN", token)
            .json(&serde_json::json!({ "command": script }))
            .send()?;
        let status = response.status();
        let body = response.text()?;
        if !status.is_success() {
            bail!("{id}: POST /command: {status} {body}");
        }
        let mut stdout = String::new();
        for line in body.lines() {
            let json = line.trim().trim_start_matches("data:").trim();
            let Ok(event) = serde_json::from_str::<Value>(json) else {
                continue;
            };
            match event["type"].as_str().unwrap_or_default() {
                "stdout" => {
                    stdout.push_str(event["text"].as_str().unwrap_or_default());
                    stdout.push('\n');
                }
                "error" => bail!("{id}: {script:?} failed: {event}"),
                _ => {}
            }
        }
        Ok(stdout)
    }

    /// The lifecycle events of sandbox `id`, as text.
    pub fn events(&self, id: &str) -> anyhow::Result<String> {
        let (_, body) = self.get(&format!("/v1/sandboxes/{id}/diagnostics/events?scope=all"))?;
        Ok(body["content"].as_str().unwrap_or_default().to_string())
    }
}
