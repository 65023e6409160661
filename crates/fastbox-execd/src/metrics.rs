//! `/metrics` and `/metrics/watch`: CPU and memory of the sandbox.
//!
//! Inside a sandbox the interesting numbers are the cgroup's, not the host's: the CPU count is
//! the `cpu.max` quota when there is one, memory is `memory.max`/`memory.current` (minus
//! reclaimable page cache). Without a cgroup v2 hierarchy the values fall back to `/proc`.
//! CPU usage is a rate, so it is measured between two samples: against the previous request's
//! sample when it is recent, else over a short window.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Serialize;

use crate::clock::now_ms;
use crate::state::AppState;

/// Sampling window when no recent previous sample exists.
const MIN_WINDOW: Duration = Duration::from_millis(100);
/// A previous sample older than this is not reused.
const MAX_WINDOW: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Metrics {
    pub cpu_count: f64,
    pub cpu_used_pct: f64,
    pub mem_total_mib: f64,
    pub mem_used_mib: f64,
    pub timestamp: u64,
}

/// Where the numbers come from: `/` in production, a fake tree in tests.
pub struct MetricsSource {
    root: PathBuf,
    last: Mutex<Option<(Instant, u64)>>,
    limits: Mutex<Limits>,
}

/// Limits the runtime announces when the sandbox cannot read its own cgroup (cgroup v1
/// hosts): `EXECD_MEMORY_LIMIT` (bytes) and `EXECD_CPU_LIMIT` (CPUs, e.g. `0.5`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Limits {
    pub memory_bytes: Option<u64>,
    pub cpus: Option<f64>,
}

impl Limits {
    /// The limits an environment announces (execd's own, or the one a claim installed).
    pub fn from_env(env: &crate::env::EnvList) -> Self {
        Limits {
            memory_bytes: crate::env::get(env, "EXECD_MEMORY_LIMIT").and_then(|v| v.parse().ok()),
            cpus: crate::env::get(env, "EXECD_CPU_LIMIT")
                .and_then(|v| v.parse().ok())
                .filter(|c: &f64| *c > 0.0),
        }
    }
}

impl Default for MetricsSource {
    fn default() -> Self {
        Self::new(PathBuf::from("/"))
    }
}

impl MetricsSource {
    pub fn new(root: PathBuf) -> Self {
        MetricsSource {
            root,
            last: Mutex::new(None),
            limits: Mutex::new(Limits::default()),
        }
    }

    pub fn with_limits(self, limits: Limits) -> Self {
        self.announce(limits);
        self
    }

    /// Sets the limits reported when no cgroup says otherwise (they follow the claim).
    pub fn announce(&self, limits: Limits) {
        *self.limits.lock().unwrap_or_else(|e| e.into_inner()) = limits;
    }

    fn limits(&self) -> Limits {
        *self.limits.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Resident memory of every process this `/proc` shows (in a sandbox: its own).
    fn resident_bytes(&self) -> u64 {
        const PAGE: u64 = 4096;
        let Ok(entries) = std::fs::read_dir(self.root.join("proc")) else {
            return 0;
        };
        entries
            .flatten()
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .bytes()
                    .all(|b| b.is_ascii_digit())
            })
            .filter_map(|e| std::fs::read_to_string(e.path().join("statm")).ok())
            .filter_map(|t| t.split_whitespace().nth(1)?.parse::<u64>().ok())
            .sum::<u64>()
            * PAGE
    }

    fn read(&self, rel: &str) -> Option<String> {
        std::fs::read_to_string(self.root.join(rel.trim_start_matches('/'))).ok()
    }

    /// The process's cgroup v2 directory relative to the root, if there is one.
    fn cgroup_dir(&self) -> Option<PathBuf> {
        let text = self.read("proc/self/cgroup")?;
        let rel = text.lines().find_map(|l| l.strip_prefix("0::"))?;
        let dir = Path::new("sys/fs/cgroup").join(rel.trim_start_matches('/'));
        self.root
            .join(&dir)
            .join("cgroup.controllers")
            .exists()
            .then_some(dir)
    }

    fn cg(&self, dir: &Option<PathBuf>, file: &str) -> Option<String> {
        dir.as_ref()
            .and_then(|d| self.read(&d.join(file).to_string_lossy()))
    }

    pub fn cpu_count(&self, cg: &Option<PathBuf>) -> f64 {
        self.cg(cg, "cpu.max")
            .and_then(|t| parse_cpu_max(&t))
            .or(self.limits().cpus)
            .unwrap_or_else(|| {
                std::thread::available_parallelism()
                    .map(|n| n.get() as f64)
                    .unwrap_or(1.0)
            })
    }

    /// CPU time used so far, in microseconds.
    fn cpu_usage_usec(&self, cg: &Option<PathBuf>) -> Option<u64> {
        self.cg(cg, "cpu.stat")
            .and_then(|t| stat_value(&t, "usage_usec"))
            .or_else(|| {
                self.read("proc/stat")
                    .and_then(|t| parse_proc_stat_busy_usec(&t))
            })
    }

    /// `(total, used)` in bytes.
    pub fn memory(&self, cg: &Option<PathBuf>) -> (u64, u64) {
        let meminfo = self.read("proc/meminfo").unwrap_or_default();
        let host_total = meminfo_kib(&meminfo, "MemTotal").unwrap_or(0) * 1024;
        let limit = self
            .cg(cg, "memory.max")
            .and_then(|t| t.trim().parse::<u64>().ok());
        let current = self
            .cg(cg, "memory.current")
            .and_then(|t| t.trim().parse::<u64>().ok());
        match current {
            Some(cur) => {
                let inactive = self
                    .cg(cg, "memory.stat")
                    .and_then(|t| stat_value(&t, "inactive_file"))
                    .unwrap_or(0);
                let total = limit.unwrap_or(host_total).min(host_total.max(1));
                (total, cur.saturating_sub(inactive))
            }
            None => match self.limits().memory_bytes {
                Some(limit) => (limit.min(host_total.max(1)), self.resident_bytes()),
                None => {
                    let available = meminfo_kib(&meminfo, "MemAvailable").unwrap_or(0) * 1024;
                    (host_total, host_total.saturating_sub(available))
                }
            },
        }
    }

    /// One metrics snapshot.
    pub async fn sample(&self) -> Metrics {
        let cg = self.cgroup_dir();
        let cpu_count = self.cpu_count(&cg);
        let now = Instant::now();
        let usage = self.cpu_usage_usec(&cg).unwrap_or(0);
        let previous = {
            let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
            last.replace((now, usage))
        };
        let (t0, u0) = match previous {
            Some((t, u))
                if now.duration_since(t) >= MIN_WINDOW && now.duration_since(t) <= MAX_WINDOW =>
            {
                (t, u)
            }
            _ => {
                tokio::time::sleep(MIN_WINDOW).await;
                let later = self.cpu_usage_usec(&cg).unwrap_or(0);
                let t1 = Instant::now();
                *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some((t1, later));
                return self.snapshot(cpu_count, (now, usage), (t1, later), &cg);
            }
        };
        self.snapshot(cpu_count, (t0, u0), (now, usage), &cg)
    }

    fn snapshot(
        &self,
        cpu_count: f64,
        a: (Instant, u64),
        b: (Instant, u64),
        cg: &Option<PathBuf>,
    ) -> Metrics {
        let wall_us = b.0.duration_since(a.0).as_micros() as f64;
        let used = b.1.saturating_sub(a.1) as f64;
        let pct = if wall_us > 0.0 && cpu_count > 0.0 {
            (used / (wall_us * cpu_count) * 100.0).clamp(0.0, 100.0)
        } else {
            0.0
        };
        let (total, used_mem) = self.memory(cg);
        const MIB: f64 = 1024.0 * 1024.0;
        Metrics {
            cpu_count,
            cpu_used_pct: (pct * 100.0).round() / 100.0,
            mem_total_mib: total as f64 / MIB,
            mem_used_mib: (used_mem.min(total)) as f64 / MIB,
            timestamp: now_ms(),
        }
    }
}

/// `"50000 100000"` -> 0.5 CPUs; `"max ..."` -> none.
pub fn parse_cpu_max(text: &str) -> Option<f64> {
    let mut it = text.split_whitespace();
    let quota: f64 = it.next()?.parse().ok()?;
    let period: f64 = it.next().and_then(|p| p.parse().ok()).unwrap_or(100_000.0);
    (period > 0.0).then(|| quota / period)
}

/// A `key value` line of a cgroup stat file.
pub fn stat_value(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

pub fn meminfo_kib(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(key)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// Busy time (everything but idle and iowait) of the `cpu` line, in microseconds, assuming
/// the usual 100 Hz clock tick.
pub fn parse_proc_stat_busy_usec(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let busy: u64 = v
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4 && *i < 8)
        .map(|(_, x)| x)
        .sum();
    Some(busy * 10_000)
}

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/metrics", get(get_metrics))
        .route("/metrics/watch", get(watch_metrics))
}

/// The limits the current environment announces (changed by a claim).
fn announce_limits(state: &AppState) {
    state
        .metrics
        .announce(Limits::from_env(&state.tenancy.current().env));
}

async fn get_metrics(State(state): State<AppState>) -> Response {
    announce_limits(&state);
    axum::Json(state.metrics.sample().await).into_response()
}

/// One JSON object plus `\n` per second until the client goes away.
async fn watch_metrics(State(state): State<AppState>) -> Response {
    let stream = futures::stream::unfold((state, true), |(state, first)| async move {
        if !first {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        announce_limits(&state);
        let mut line = serde_json::to_vec(&state.metrics.sample().await).unwrap_or_default();
        line.push(b'\n');
        Some((
            Ok::<_, std::convert::Infallible>(bytes::Bytes::from(line)),
            (state, false),
        ))
    });
    let mut resp = Body::from_stream(stream).into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parsers() {
        assert_eq!(parse_cpu_max("50000 100000\n"), Some(0.5));
        assert_eq!(parse_cpu_max("max 100000\n"), None);
        assert_eq!(
            stat_value("usage_usec 1234\nuser_usec 1\n", "usage_usec"),
            Some(1234)
        );
        assert_eq!(
            meminfo_kib(
                "MemTotal:  2048 kB\nMemAvailable: 1024 kB\n",
                "MemAvailable"
            ),
            Some(1024)
        );
        assert_eq!(
            parse_proc_stat_busy_usec("cpu  1 2 3 100 5 6 7 8 9 10\ncpu0 1\n"),
            Some((1 + 2 + 3 + 6 + 7 + 8) * 10_000)
        );
    }

    #[tokio::test]
    async fn announced_limits_apply_without_a_cgroup() {
        let root = tempfile::tempdir().unwrap();
        let w = |p: &str, c: &str| {
            let path = root.path().join(p);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, c).unwrap();
        };
        w(
            "proc/meminfo",
            "MemTotal: 4194304 kB\nMemAvailable: 1048576 kB\n",
        );
        w("proc/1/statm", "1000 256 10 1 0 100 0\n");
        w("proc/42/statm", "1000 512 10 1 0 100 0\n");
        w("proc/self/statm", "1 99999 1 1 0 1 0\n");
        let m = MetricsSource::new(root.path().to_path_buf())
            .with_limits(Limits {
                memory_bytes: Some(512 << 20),
                cpus: Some(0.5),
            })
            .sample()
            .await;
        assert_eq!(m.cpu_count, 0.5);
        assert_eq!(m.mem_total_mib, 512.0);
        assert_eq!(m.mem_used_mib, 3.0, "768 resident pages of 4 KiB");
    }

    #[tokio::test]
    async fn cgroup_values_win_over_proc() {
        let root = tempfile::tempdir().unwrap();
        let w = |p: &str, c: &str| {
            let path = root.path().join(p);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, c).unwrap();
        };
        w("proc/self/cgroup", "0::/sbx\n");
        w(
            "proc/meminfo",
            "MemTotal: 8388608 kB\nMemAvailable: 4194304 kB\n",
        );
        w("sys/fs/cgroup/sbx/cgroup.controllers", "cpu memory\n");
        w("sys/fs/cgroup/sbx/cpu.max", "200000 100000\n");
        w("sys/fs/cgroup/sbx/cpu.stat", "usage_usec 0\n");
        w("sys/fs/cgroup/sbx/memory.max", "1073741824\n");
        w("sys/fs/cgroup/sbx/memory.current", "536870912\n");
        w("sys/fs/cgroup/sbx/memory.stat", "inactive_file 268435456\n");
        let m = MetricsSource::new(root.path().to_path_buf()).sample().await;
        assert_eq!(m.cpu_count, 2.0);
        assert_eq!(m.mem_total_mib, 1024.0);
        assert_eq!(m.mem_used_mib, 256.0);
        assert_eq!(m.cpu_used_pct, 0.0);
    }
}
