//! The fastbox side, a client of the lifecycle API: the source sandbox and its workload, and
//! the timed operations on it (live snapshot, pause, resume, create from a snapshot, fork).
//! Readiness is what `bench create` waits for: execd answering `/ping` through the endpoint
//! the API hands out. Everything it made (sandboxes, snapshots) is deleted through the API
//! when it is dropped, on failure too.

use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail, ensure};
use reqwest::blocking::Response;
use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use fastbox_api::lifecycle::{Sandbox, SandboxState};
use fastbox_api::snapshots::{ForkResponse, Snapshot, SnapshotState};
use fastbox_runtime::spec::EXECD_PORT;

use crate::bench_create::client::BenchClient;
use crate::bench_create::request::SANDBOX_TIMEOUT_S;
use crate::client::api::ApiClient;
use crate::client::execd::{CommandOutcome, CommandRequest, ExecdClient};
use crate::client::http::{self, HttpError};

use super::message::{Cost, parse_cost, vm_rss_kib};
use super::workload::{Workload, status_command, wait_for_rss};

/// Between two polls of a state (as `bench create` polls readiness).
const POLL: Duration = Duration::from_millis(10);
/// Between two reads of the workload's memory while it allocates.
const RSS_POLL: Duration = Duration::from_millis(200);
/// How long a request refused with 409 is sent again: the sandbox may still be busy with the
/// end of its last operation (a resume removes its pause checkpoint after it runs again).
const BUSY_RETRY: Duration = Duration::from_secs(10);
/// How long the clean-up waits for a snapshot still being taken before deleting it.
const CLEANUP_WAIT: Duration = Duration::from_secs(60);

/// A live snapshot: its id, `POST` until `Ready`, and what the server says it cost.
pub struct Taken {
    pub id: String,
    pub wall: Duration,
    pub cost: Cost,
}

pub struct Fastbox {
    bench: BenchClient,
    api: ApiClient,
    /// Longest wait for any one operation to finish.
    timeout: Duration,
    sandboxes: Vec<String>,
    snapshots: Vec<String>,
}

impl Fastbox {
    pub fn new(bench: BenchClient, api: ApiClient, timeout: Duration) -> Self {
        Self {
            bench,
            api,
            timeout,
            sandboxes: Vec::new(),
            snapshots: Vec::new(),
        }
    }

    /// Creates the source sandbox with `body` and waits until it is ready.
    pub fn create_source(&mut self, body: &Value) -> anyhow::Result<String> {
        let attempt = self.bench.create_until_ready(body, self.timeout);
        self.sandboxes.extend(attempt.sandbox.clone());
        attempt
            .result
            .map_err(|f| anyhow!("create the source sandbox: {f}"))?;
        attempt
            .sandbox
            .context("the create answered without a sandbox")
    }

    /// Starts `workload` holding `mib` MiB in sandbox `id` through its execd, and waits until
    /// the process's RSS is at least that; returns the RSS in MiB.
    pub fn start_workload(&self, id: &str, workload: Workload, mib: u64) -> anyhow::Result<f64> {
        let endpoint = self.api.endpoint(id, EXECD_PORT)?;
        let execd = ExecdClient::try_new(self.api.scheme(), &endpoint)?;
        let started = run(&execd, &workload.launch(mib))?;
        ensure!(
            started.contains("started"),
            "the workload's launch printed {started:?}"
        );
        wait_for_rss(mib, self.timeout, RSS_POLL, || {
            vm_rss_kib(&run(&execd, &status_command()).ok()?)
        })
    }

    /// A live snapshot of `id`: `POST /v1/sandboxes/{id}/snapshots`, then
    /// `GET /v1/snapshots/{sid}` until `Ready`.
    pub fn snapshot(&mut self, id: &str) -> anyhow::Result<Taken> {
        let (start, response) = self.post(&format!("/sandboxes/{id}/snapshots"), &json!({}))?;
        let snapshot: Snapshot = decode(response, "the snapshot")?;
        let sid = snapshot.id;
        self.snapshots.push(sid.clone());
        let path = format!("/snapshots/{sid}");
        let states = (SnapshotState::Ready, SnapshotState::Creating);
        let (wall, cost) = self.until_done(&path, start, states, |s: Snapshot| {
            (s.status.state, s.status.reason, s.status.message)
        })?;
        Ok(Taken {
            id: sid,
            wall,
            cost,
        })
    }

    /// Pauses `id`: `POST .../pause` until its state is `Paused`; the time and what the
    /// server says the checkpoint cost.
    pub fn pause(&self, id: &str) -> anyhow::Result<(Duration, Cost)> {
        let (start, _) = self.post(&format!("/sandboxes/{id}/pause"), &json!({}))?;
        let states = (SandboxState::Paused, SandboxState::Pausing);
        self.until_done(&format!("/sandboxes/{id}"), start, states, |s: Sandbox| {
            (s.status.state, s.status.reason, s.status.message)
        })
    }

    /// GETs `path` (a snapshot or a sandbox) every [`POLL`] until its state is `done`, as
    /// long as it is `pending`; the time from `start` until then and the cost its status
    /// message gives. `read` gives its state, and its status's reason and message.
    fn until_done<T: DeserializeOwned, S: PartialEq + std::fmt::Display>(
        &self,
        path: &str,
        start: Instant,
        (done, pending): (S, S),
        read: impl Fn(T) -> (S, Option<String>, Option<String>),
    ) -> anyhow::Result<(Duration, Cost)> {
        let deadline = start + self.timeout;
        loop {
            let (state, reason, message) =
                read(http::send_json(self.bench.api(Method::GET, path), path)?);
            let message = message.unwrap_or_default();
            if state == done {
                let wall = start.elapsed();
                let cost = parse_cost(&message)
                    .with_context(|| format!("{path} is {state} with the message {message:?}"))?;
                return Ok((wall, cost));
            }
            ensure!(
                state == pending,
                "{path} is {state}, not {done} ({}: {message})",
                reason.unwrap_or_default()
            );
            ensure!(
                Instant::now() < deadline,
                "{path} is still {state} after {:?}",
                self.timeout
            );
            std::thread::sleep(POLL);
        }
    }

    /// Resumes paused `id`: `POST .../resume` until execd answers `/ping` through a freshly
    /// fetched endpoint.
    pub fn resume(&self, id: &str) -> anyhow::Result<Duration> {
        let (start, _) = self.post(&format!("/sandboxes/{id}/resume"), &json!({}))?;
        self.bench
            .until_ready(id, start + self.timeout)
            .map_err(|f| anyhow!("the resume of {id}: {f}"))?;
        Ok(start.elapsed())
    }

    /// A sandbox created from snapshot `sid`, timed until ready, then deleted (untimed).
    pub fn create_from(&mut self, sid: &str) -> anyhow::Result<Duration> {
        let body = json!({"snapshotId": sid, "timeout": SANDBOX_TIMEOUT_S});
        let attempt = self.bench.create_until_ready(&body, self.timeout);
        self.sandboxes.extend(attempt.sandbox.clone());
        let took = attempt
            .result
            .map_err(|f| anyhow!("create from snapshot {sid}: {f}"))?;
        if let Some(id) = attempt.sandbox {
            self.delete_sandbox(&id)?;
        }
        Ok(took)
    }

    /// `POST .../fork {"count": count}` until every new sandbox answers `/ping`; then the new
    /// sandboxes and the fork's snapshot are deleted (untimed).
    pub fn fork(&mut self, id: &str, count: u32) -> anyhow::Result<Duration> {
        let (start, response) =
            self.post(&format!("/sandboxes/{id}/fork"), &json!({"count": count}))?;
        let forked: ForkResponse = decode(response, "the fork")?;
        self.snapshots.push(forked.snapshot_id.clone());
        let clones: Vec<String> = forked.items.into_iter().map(|item| item.id).collect();
        self.sandboxes.extend(clones.iter().cloned());
        ensure!(
            clones.len() == count as usize,
            "the fork made {} sandboxes, not {count}",
            clones.len()
        );
        let deadline = start + self.timeout;
        let bench = &self.bench;
        let ready: Vec<_> = std::thread::scope(|scope| {
            let waits: Vec<_> = clones
                .iter()
                .map(|clone| scope.spawn(move || bench.until_ready(clone, deadline)))
                .collect();
            waits
                .into_iter()
                .map(|wait| wait.join().expect("a readiness wait panicked"))
                .collect()
        });
        let wall = start.elapsed();
        for (clone, ready) in clones.iter().zip(ready) {
            ready.map_err(|f| anyhow!("fork clone {clone}: {f}"))?;
        }
        for clone in &clones {
            self.delete_sandbox(clone)?;
        }
        self.delete_snapshot(&forked.snapshot_id)?;
        Ok(wall)
    }

    pub fn delete_sandbox(&mut self, id: &str) -> anyhow::Result<()> {
        self.bench
            .delete(id)
            .map_err(|f| anyhow!("delete sandbox {id}: {f}"))?;
        self.sandboxes.retain(|s| s != id);
        Ok(())
    }

    /// `DELETE /v1/snapshots/{sid}`, sent again while the snapshot is still being taken
    /// (409) for at most `wait`.
    fn delete_snapshot_within(&self, sid: &str, wait: Duration) -> anyhow::Result<()> {
        let until = Instant::now() + wait;
        retry_conflicts(until, || {
            http::send(
                self.bench.api(Method::DELETE, &format!("/snapshots/{sid}")),
                "delete the snapshot",
            )
        })
        .with_context(|| format!("delete snapshot {sid}"))?;
        Ok(())
    }

    pub fn delete_snapshot(&mut self, sid: &str) -> anyhow::Result<()> {
        self.delete_snapshot_within(sid, BUSY_RETRY)?;
        self.snapshots.retain(|s| s != sid);
        Ok(())
    }

    /// POSTs `body` to `path` (under `/v1`), sent again while it is refused with 409 (for at
    /// most [`BUSY_RETRY`]); the answer and when the accepted request was sent.
    fn post(&self, path: &str, body: &Value) -> anyhow::Result<(Instant, Response)> {
        let until = Instant::now() + BUSY_RETRY;
        let mut start = Instant::now();
        let response = retry_conflicts(until, || {
            start = Instant::now();
            http::send(self.bench.api(Method::POST, path).json(body), path)
        })
        .with_context(|| format!("POST {path}"))?;
        Ok((start, response))
    }
}

impl Drop for Fastbox {
    /// Deletes what is left: sandboxes first (a snapshot being taken of one ends with it),
    /// then snapshots.
    fn drop(&mut self) {
        for id in std::mem::take(&mut self.sandboxes) {
            if let Err(e) = self.bench.delete(&id) {
                eprintln!("bench snapshot: could not delete sandbox {id}: {e}");
            }
        }
        for sid in std::mem::take(&mut self.snapshots) {
            if let Err(e) = self.delete_snapshot_within(&sid, CLEANUP_WAIT) {
                eprintln!("bench snapshot: {e:#}");
            }
        }
    }
}

/// Calls `send` until it is not refused with 409 or `until` has passed.
fn retry_conflicts(
    until: Instant,
    mut send: impl FnMut() -> Result<Response, HttpError>,
) -> Result<Response, HttpError> {
    loop {
        match send() {
            Err(e)
                if e.reply().is_some_and(|r| r.status == StatusCode::CONFLICT)
                    && Instant::now() < until =>
            {
                std::thread::sleep(POLL)
            }
            result => return result,
        }
    }
}

fn decode<T: DeserializeOwned>(response: Response, what: &str) -> anyhow::Result<T> {
    let body = response.bytes().with_context(|| format!("read {what}"))?;
    serde_json::from_slice(&body).with_context(|| format!("{what} is not the expected JSON"))
}

/// Runs `line` through execd; its stdout, unless it did not exit 0.
fn run(execd: &ExecdClient, line: &str) -> anyhow::Result<String> {
    let mut stdout = String::new();
    let command = CommandRequest {
        command: line.to_string(),
        ..Default::default()
    };
    let outcome = execd.run(&command, |event| {
        if event.kind == "stdout" {
            stdout.push_str(event.text.as_deref().unwrap_or_default());
            stdout.push('\n');
        }
    })?;
    match outcome {
        CommandOutcome::Exited(0) => Ok(stdout),
        other => bail!("{line:?} ended {other:?}"),
    }
}
