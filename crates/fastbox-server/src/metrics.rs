//! `GET /metrics`: the phases of every sandbox start (pool claims and restores) and of every
//! create request as Prometheus histograms, so the timings that logs and sandbox events show
//! one by one can be watched in aggregate; and the node's artifact store ([`NodeMetrics`]):
//! the node block cache, what was fetched from where (the DART counters with peers), and
//! the artifact garbage collections. `fastbox up` appends the latter to the route's answer with
//! [`append_node_metrics`], a middleware around the lifecycle router.
//!
//! | metric | kind | when |
//! |---|---|---|
//! | `fastbox_start_phase_seconds{source,phase}` | histogram | always |
//! | `fastbox_create_phase_seconds{phase}` | histogram | always |
//! | `fastbox_block_cache_{hits,misses,inserts,evictions,corrupt_dropped}_total` | counter | remote store |
//! | `fastbox_block_cache_{bytes,blocks,probation_bytes,protected_bytes,pinned_bytes,budget_bytes,over_budget}` | gauge | remote store |
//! | `fastbox_artifact_reads_{block_hits,block_fetches,fetched_bytes,manifest_hits,manifest_fetches,cache_errors}_total` | counter | remote store without peers |
//! | `fastbox_dart_<counter>_total{node}` (`docs/dart.md`) | counter | DART peers |
//! | `fastbox_artifact_gc_{runs,failures,deleted_manifests,deleted_blocks,deleted_bytes}_total` | counter | always |
//! | `fastbox_artifact_gc_pinned_manifests`, `fastbox_artifact_gc_last_success_timestamp_seconds` | gauge | always |

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use fastbox_artifact::{CacheStats, CachedStoreStats};
use fastbox_node_api::wire::StartReport;

use crate::artifact_gc::{ArtifactCollector, GcStats};

/// Upper bounds of the histogram buckets, in seconds.
const BUCKETS: [f64; 11] = [
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0,
];

#[derive(Debug, Default, Clone)]
struct Histogram {
    buckets: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, took: Duration) {
        let seconds = took.as_secs_f64();
        for (bound, n) in BUCKETS.iter().zip(self.buckets.iter_mut()) {
            if seconds <= *bound {
                *n += 1;
            }
        }
        self.count += 1;
        self.sum += seconds;
    }
}

/// Start phases by (source, phase); `total` is the whole start.
#[derive(Debug, Default)]
pub struct StartMetrics {
    phases: Histograms,
}

impl StartMetrics {
    pub fn record(&self, report: &StartReport) {
        let seconds = |ms: f64| Duration::from_secs_f64(ms.max(0.0) / 1000.0);
        for phase in &report.phases {
            self.phases
                .observe(&report.source, &phase.name, seconds(phase.ms));
        }
        self.phases
            .observe(&report.source, "total", seconds(report.total_ms));
    }

    /// The Prometheus text exposition format (version 0.0.4).
    pub fn render(&self) -> String {
        self.phases.render(
            "fastbox_start_phase_seconds",
            "Phases of sandbox starts (source pool: a warm-pool claim; restore: a restore of a golden checkpoint; phase total: the whole start).",
        )
    }
}

/// What a create request waits for on the server, by phase: `admit` (a slot on a node),
/// `intent` (the durable `Pending` record: one state-store write), `start` (the node call,
/// until the request may answer) and `total`.
#[derive(Debug, Default)]
pub struct CreateMetrics {
    phases: Histograms,
}

impl CreateMetrics {
    pub fn observe(&self, phase: &str, took: Duration) {
        self.phases.observe("", phase, took);
    }

    /// The Prometheus text exposition format (version 0.0.4).
    pub fn render(&self) -> String {
        self.phases.render(
            "fastbox_create_phase_seconds",
            "What create requests wait for on the server (admit: a slot on a node; intent: the durable Pending record; start: the node call; total: the whole request).",
        )
    }
}

/// Histograms by (source, phase); an empty source is left out of the labels.
#[derive(Debug, Default)]
struct Histograms(Mutex<BTreeMap<(String, String), Histogram>>);

impl Histograms {
    fn observe(&self, source: &str, phase: &str, took: Duration) {
        self.0
            .lock()
            .expect("metrics lock")
            .entry((source.to_string(), phase.to_string()))
            .or_default()
            .observe(took);
    }

    fn render(&self, name: &str, help: &str) -> String {
        let phases = self.0.lock().expect("metrics lock");
        let mut out = String::new();
        writeln!(out, "# HELP {name} {help}").unwrap();
        writeln!(out, "# TYPE {name} histogram").unwrap();
        for ((source, phase), h) in phases.iter() {
            let labels = match source.is_empty() {
                true => format!("phase=\"{phase}\""),
                false => format!("source=\"{source}\",phase=\"{phase}\""),
            };
            for (bound, n) in BUCKETS.iter().zip(h.buckets.iter()) {
                writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {n}").unwrap();
            }
            writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", h.count).unwrap();
            writeln!(out, "{name}_sum{{{labels}}} {}", h.sum).unwrap();
            writeln!(out, "{name}_count{{{labels}}} {}", h.count).unwrap();
        }
        out
    }
}

/// The routes whose answer [`append_node_metrics`] extends.
const METRICS_PATHS: [&str; 2] = ["/metrics", "/v1/metrics"];
/// The largest answer of the metrics route the middleware reads.
const MAX_METRICS_BYTES: usize = 4 << 20;

/// What a node's artifact store reports: its block cache, its reads from the origin, and
/// the DART counters (each `None` where the store has no such layer).
pub trait StoreStats: Send + Sync {
    fn cache_stats(&self) -> Option<CacheStats>;
    fn fetch_stats(&self) -> Option<CachedStoreStats>;
    /// The DART counters in the Prometheus text format.
    fn dart_text(&self) -> Option<String>;
}

/// What `/metrics` shows of the node's artifact store and its garbage collection.
pub struct NodeMetrics {
    store: Arc<dyn StoreStats>,
    collector: Arc<ArtifactCollector>,
}

impl NodeMetrics {
    pub fn new(store: Arc<dyn StoreStats>, collector: Arc<ArtifactCollector>) -> Self {
        NodeMetrics { store, collector }
    }

    /// The Prometheus text of the store's layers and the collections.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if let Some(stats) = self.store.cache_stats() {
            render_cache(&mut out, &stats);
        }
        if let Some(stats) = self.store.fetch_stats() {
            render_reads(&mut out, &stats);
        }
        if let Some(text) = self.store.dart_text() {
            out.push_str(&text);
        }
        render_gc(&mut out, &self.collector.stats());
        out
    }
}

/// One sample of a metric, after its `# TYPE` line.
fn sample(out: &mut String, name: &str, kind: &str, value: u64) {
    // Writing to a String cannot fail.
    let _ = writeln!(out, "# TYPE {name} {kind}");
    let _ = writeln!(out, "{name} {value}");
}

fn render_cache(out: &mut String, s: &CacheStats) {
    for (name, value) in [
        ("hits", s.hits),
        ("misses", s.misses),
        ("inserts", s.inserts),
        ("evictions", s.evictions),
        ("corrupt_dropped", s.corrupt_dropped),
    ] {
        sample(
            out,
            &format!("fastbox_block_cache_{name}_total"),
            "counter",
            value,
        );
    }
    for (name, value) in [
        ("bytes", s.bytes),
        ("blocks", s.blocks),
        ("probation_bytes", s.probation_bytes),
        ("protected_bytes", s.protected_bytes),
        ("pinned_bytes", s.pinned_bytes),
        ("budget_bytes", s.budget),
        ("over_budget", u64::from(s.over_budget)),
    ] {
        sample(out, &format!("fastbox_block_cache_{name}"), "gauge", value);
    }
}

fn render_reads(out: &mut String, s: &CachedStoreStats) {
    for (name, value) in [
        ("block_hits", s.block_hits),
        ("block_fetches", s.block_fetches),
        ("fetched_bytes", s.fetched_bytes),
        ("manifest_hits", s.manifest_hits),
        ("manifest_fetches", s.manifest_fetches),
        ("cache_errors", s.cache_errors),
    ] {
        sample(
            out,
            &format!("fastbox_artifact_reads_{name}_total"),
            "counter",
            value,
        );
    }
}

fn render_gc(out: &mut String, s: &GcStats) {
    for (name, value) in [
        ("runs", s.runs),
        ("failures", s.failures),
        ("deleted_manifests", s.deleted_manifests),
        ("deleted_blocks", s.deleted_blocks),
        ("deleted_bytes", s.deleted_bytes),
    ] {
        sample(
            out,
            &format!("fastbox_artifact_gc_{name}_total"),
            "counter",
            value,
        );
    }
    sample(
        out,
        "fastbox_artifact_gc_pinned_manifests",
        "gauge",
        s.pinned,
    );
    sample(
        out,
        "fastbox_artifact_gc_last_success_timestamp_seconds",
        "gauge",
        s.last_success_unix,
    );
}

/// Middleware around the lifecycle router: a successful `GET /metrics` (or `/v1/metrics`)
/// gets [`NodeMetrics::render`] appended; every other request passes untouched (an
/// unauthenticated one is refused inside, before this adds anything).
pub async fn append_node_metrics(
    State(node): State<Arc<NodeMetrics>>,
    request: Request,
    next: Next,
) -> Response {
    let is_metrics =
        request.method() == Method::GET && METRICS_PATHS.contains(&request.uri().path());
    let response = next.run(request).await;
    if !is_metrics || response.status() != StatusCode::OK {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let Ok(start) = axum::body::to_bytes(body, MAX_METRICS_BYTES).await else {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            "metrics: the answer was unreadable\n",
        )
            .into_response();
    };
    let mut text = start.to_vec();
    text.extend_from_slice(node.render().as_bytes());
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(text))
}

#[cfg(test)]
mod tests {
    use super::*;
    use fastbox_node_api::wire::PhaseTiming;

    #[test]
    fn phases_and_totals_become_cumulative_histograms() {
        let metrics = StartMetrics::default();
        let phase = |name: &str, ms: f64| PhaseTiming {
            name: name.into(),
            ms,
            detail: false,
        };
        let report = StartReport {
            source: "pool".into(),
            phases: vec![phase("acquire", 0.01), phase("claim", 3.0)],
            total_ms: 3.01,
            summary: String::new(),
        };
        metrics.record(&report);
        metrics.record(&report);
        let text = metrics.render();
        assert!(text.contains("# TYPE fastbox_start_phase_seconds histogram"));
        assert!(text.contains(
            "fastbox_start_phase_seconds_bucket{source=\"pool\",phase=\"claim\",le=\"0.002\"} 0"
        ));
        assert!(text.contains(
            "fastbox_start_phase_seconds_bucket{source=\"pool\",phase=\"claim\",le=\"0.005\"} 2"
        ));
        assert!(
            text.contains("fastbox_start_phase_seconds_count{source=\"pool\",phase=\"total\"} 2")
        );
        assert!(text.contains(
            "fastbox_start_phase_seconds_bucket{source=\"pool\",phase=\"acquire\",le=\"+Inf\"} 2"
        ));
    }
    #[test]
    fn cache_reads_and_gc_render_as_typed_samples() {
        let mut out = String::new();
        render_cache(
            &mut out,
            &CacheStats {
                hits: 7,
                budget: 64 << 20,
                over_budget: true,
                ..CacheStats::default()
            },
        );
        render_reads(
            &mut out,
            &CachedStoreStats {
                block_fetches: 3,
                ..CachedStoreStats::default()
            },
        );
        render_gc(
            &mut out,
            &GcStats {
                runs: 2,
                deleted_blocks: 5,
                ..GcStats::default()
            },
        );
        for line in [
            "# TYPE fastbox_block_cache_hits_total counter\nfastbox_block_cache_hits_total 7",
            "# TYPE fastbox_block_cache_budget_bytes gauge\nfastbox_block_cache_budget_bytes 67108864",
            "fastbox_block_cache_over_budget 1",
            "fastbox_artifact_reads_block_fetches_total 3",
            "fastbox_artifact_gc_runs_total 2",
            "fastbox_artifact_gc_deleted_blocks_total 5",
            "fastbox_artifact_gc_last_success_timestamp_seconds 0",
        ] {
            assert!(out.contains(line), "{line:?} not in:\n{out}");
        }
    }

    /// A real server on loopback: the router's own `/metrics` answer, then the node's lines;
    /// other routes and failed answers untouched.
    #[tokio::test]
    async fn the_middleware_extends_only_a_successful_metrics_answer() {
        /// A local store: no cache, no reads from an origin, no peers.
        struct LocalStore;
        impl StoreStats for LocalStore {
            fn cache_stats(&self) -> Option<CacheStats> {
                None
            }
            fn fetch_stats(&self) -> Option<CachedStoreStats> {
                None
            }
            fn dart_text(&self) -> Option<String> {
                None
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let origin = fastbox_artifact::LocalStore::open(dir.path()).unwrap();
        let collector = Arc::new(ArtifactCollector::new(Arc::new(origin), Duration::ZERO));
        let node = Arc::new(NodeMetrics::new(Arc::new(LocalStore), collector));
        let router = axum::Router::new()
            .route("/metrics", axum::routing::get(|| async { "start 1\n" }))
            .route(
                "/v1/metrics",
                axum::routing::get(|| async { StatusCode::UNAUTHORIZED }),
            )
            .route("/health", axum::routing::get(|| async { "ok" }))
            .layer(axum::middleware::from_fn_with_state(
                node,
                append_node_metrics,
            ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await });
        let get = |path: &str| {
            let url = format!("http://{addr}{path}");
            async move {
                let r = reqwest::get(url).await.unwrap();
                (r.status().as_u16(), r.text().await.unwrap())
            }
        };
        let (status, text) = get("/metrics").await;
        assert_eq!(status, 200);
        assert!(
            text.starts_with("start 1\n# TYPE fastbox_artifact_gc_"),
            "{text}"
        );
        assert!(text.contains("fastbox_artifact_gc_runs_total 0"), "{text}");
        assert!(
            !text.contains("fastbox_block_cache"),
            "a local store has no cache: {text}"
        );
        assert_eq!(get("/v1/metrics").await, (401, String::new()));
        assert_eq!(get("/health").await, (200, "ok".to_string()));
    }
}
