//! `fastbox node --join`: the node registers with the server at every start, the first time
//! with the cluster's join token, later with its own credential (kept in
//! `DATA_DIR/node-credentials/joined`: the join token never takes over a registered name),
//! and gets two fresh credentials each time (the old ones stop working). It then renews its
//! lease with a heartbeat that carries its status. Each renewal moves the fencing deadline
//! ([`Fence::renew`]): the time, counted from the heartbeat's send, by which the node's
//! sandboxes are frozen unless another renewal comes, and by which the node API stops
//! starting sandboxes ([`LeaseClock`]). The server declares the node lost only later (its
//! lease plus a margin), so no sandbox runs on two nodes. A renewal whose answer came too
//! late to count is ignored.
//!
//! What a fence froze runs again only when the server's count of this node's losses is the
//! one the node knew before the fence (`DATA_DIR/node-losses`): otherwise the server failed
//! those sandboxes and removes them.
//!
//! A heartbeat the server refuses (the node was revoked, or the server forgot it) is not
//! followed by a new registration: revocation stands until an operator restarts the node.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use fastbox_node_api::NodeAgent;
use fastbox_node_api::membership::{
    Heartbeat, LeaseTerms, Registered, Registration, check_node_id, route_keys_digest,
};
use fastbox_node_api::remote::tls::CertPin;
use fastbox_node_api::remote::{ControlClient, Credential, MembershipCallError};
use fastbox_proxy::RouteKeys;

use super::fence_guard::{self, FenceGuard, FenceGuardConfig, FencedMarker};

/// What holds the node's sandboxes to its lease (the fencing guard). Its calls may block
/// briefly (a pipe write; a new guard's start).
pub trait Fence: Send + Sync {
    /// The lease was renewed: freeze the sandboxes at `fence_at` unless renewed again.
    fn renew(&self, fence_at: SystemTime);
    /// Whether a guard holds the sandboxes to the deadline (without one nothing starts
    /// and nothing is thawed).
    fn armed(&self) -> bool;
    /// After a renewal: what an earlier fence froze. When the server's count of this node's
    /// losses is the one the node knew before the fence, those sandboxes are still the
    /// node's and run again; otherwise they stay frozen and the server removes them.
    fn settle(&self, losses: u64);
}

/// When the node's lease (as the node counts it) ends: the node API starts nothing after it.
#[derive(Clone, Default)]
pub struct LeaseClock(Arc<Mutex<Option<Instant>>>);

impl LeaseClock {
    fn set(&self, until: Option<Instant>) {
        *self.0.lock().expect("lease clock lock") = until;
    }

    /// The lease holds for `left` from now.
    pub fn set_for(&self, left: Duration) {
        self.set(Some(Instant::now() + left));
    }

    /// Whether the lease holds now.
    pub fn holds(&self) -> bool {
        self.0
            .lock()
            .expect("lease clock lock")
            .is_some_and(|until| Instant::now() < until)
    }
}

/// The verbs of the node API that start processes: refused once the lease ran out.
const STARTS: [&str; 3] = ["place", "clone_snapshot", "resume"];

/// What the node API's gate holds: the lease as the node counts it, and the fence.
#[derive(Clone)]
pub struct Gate {
    pub lease: LeaseClock,
    pub fence: Arc<GuardFence>,
}

/// The node API's gate: a start after the node's own deadline is refused (503), so nothing
/// starts on a node that may be fenced and declared lost. A start that began in time but
/// ended after the deadline (a restore cut off from the server midway) may have made its
/// sandbox after the guard froze the node: the node is frozen again, that sandbox with it.
pub async fn gate(
    axum::extract::State(gate): axum::extract::State<Gate>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let verb = req.uri().path().rsplit('/').next().unwrap_or_default();
    let start = STARTS.contains(&verb);
    if start && !gate.lease.holds() {
        let body = serde_json::json!({
            "code": "NODE::LEASE_EXPIRED",
            "message": "this node's lease ran out: it starts nothing until the server renews it",
        });
        return (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(body),
        )
            .into_response();
    }
    let response = next.run(req).await;
    if start && !gate.lease.holds() {
        let fence = gate.fence.clone();
        let _ = tokio::task::spawn_blocking(move || fence.freeze_late()).await;
    }
    response
}

/// The fencing guard of `fastbox node` ([`FenceGuard`]), started again when one fenced (and
/// so exited) and the lease is renewed after all.
pub struct GuardFence {
    config: FenceGuardConfig,
    guard: Mutex<Option<FenceGuard>>,
}

impl GuardFence {
    /// Starts the guard of the node of `data_dir` and `prefix`.
    pub fn start(data_dir: &Path, prefix: &str) -> anyhow::Result<Self> {
        let guard = fence_guard::start_for_node(data_dir, prefix)?;
        Ok(Self {
            config: FenceGuardConfig::new(data_dir, prefix)?,
            guard: Mutex::new(Some(guard)),
        })
    }

    /// A clean stop: the guard still fences at a pending deadline unless a new node's guard
    /// takes over first.
    pub fn release(&self) {
        if let Some(guard) = self.guard.lock().expect("guard lock").take() {
            guard.release();
        }
    }
}

impl GuardFence {
    /// Freezes every sandbox of the node again, for a start that ended after the lease ran
    /// out, and adds what it froze to the fence marker (which the renewal that may still
    /// come thaws, or the server's removal ends).
    pub fn freeze_late(&self) {
        let config = &self.config;
        let cgroups = match fastbox_fastlet::fence::NodeCgroups::open(
            config.cgroups,
            &config.prefix,
        ) {
            Ok(cgroups) => cgroups,
            Err(e) => {
                tracing::error!(error = %e, "a start ended after the lease ran out, and the node's cgroups cannot be opened: its sandbox is not frozen");
                return;
            }
        };
        let report = cgroups.freeze_all();
        let now = unix_ms(SystemTime::now());
        let mut marker = match FencedMarker::read(&config.data_dir) {
            Ok(Some(marker)) => marker,
            _ => FencedMarker {
                fenced_at_unix_ms: now,
                deadline_unix_ms: now,
                frozen: 0,
                sandboxes: Vec::new(),
                errors: Vec::new(),
                reason: "a start ended after the lease ran out".into(),
            },
        };
        for id in report.frozen {
            if !marker.sandboxes.contains(&id) {
                marker.sandboxes.push(id);
            }
        }
        marker.sandboxes.sort();
        marker.frozen = marker.sandboxes.len();
        marker
            .errors
            .extend(report.errors.iter().map(ToString::to_string));
        tracing::error!(
            frozen = marker.frozen,
            errors = report.errors.len(),
            "FENCED: a start ended after the lease ran out; every sandbox of this node is frozen again"
        );
        if let Err(e) = marker.write(&config.data_dir) {
            tracing::error!(error = %e, "the fence marker could not be written");
        }
    }
}

fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Fence for GuardFence {
    fn armed(&self) -> bool {
        self.guard.lock().expect("guard lock").is_some()
    }

    fn renew(&self, fence_at: SystemTime) {
        let mut guard = self.guard.lock().expect("guard lock");
        if let Some(running) = guard.as_ref() {
            match running.renew(fence_at) {
                Ok(()) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "the fencing guard is gone (it fenced?); starting another")
                }
            }
        }
        match FenceGuard::spawn(&self.config) {
            Ok(fresh) => {
                if let Err(e) = fresh.renew(fence_at) {
                    tracing::error!(error = %e, "the new fencing guard refused its deadline");
                }
                *guard = Some(fresh);
            }
            Err(e) => {
                tracing::error!(error = %e, "no fencing guard: the sandboxes are not frozen if the lease runs out");
                *guard = None;
            }
        }
    }

    fn settle(&self, losses: u64) {
        let data_dir = &self.config.data_dir;
        let known = known_losses(data_dir);
        if known != Some(losses) {
            remember_losses(data_dir, losses);
        }
        let marker = match FencedMarker::read(data_dir) {
            Ok(Some(marker)) => marker,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(error = %e, "the fence marker cannot be read");
                return;
            }
        };
        if known != Some(losses) || !self.armed() {
            tracing::warn!(frozen = marker.frozen, known = ?known, losses, "the server declared this node lost since (or the count is unknown): the sandboxes the fence froze stay frozen until it removes them");
        } else {
            let cgroups =
                fastbox_fastlet::fence::NodeCgroups::open(self.config.cgroups, &self.config.prefix);
            match cgroups {
                Ok(cgroups) => {
                    let report = cgroups.thaw(&marker.sandboxes);
                    tracing::warn!(
                        thawed = report.thawed.len(),
                        errors = report.errors.len(),
                        "the lease was renewed before the server declared this node lost: the sandboxes the fence froze run again"
                    );
                    for e in &report.errors {
                        tracing::warn!(error = %e, "a fenced sandbox could not be thawed");
                    }
                    if !report.errors.is_empty() {
                        // Kept: the next renewal tries again.
                        return;
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, "the node's cgroups cannot be opened: fenced sandboxes stay frozen");
                    return;
                }
            }
        }
        if let Err(e) = std::fs::remove_file(FencedMarker::path(data_dir)) {
            tracing::warn!(error = %e, "the fence marker could not be removed");
        }
    }
}

/// The node's name: given, or the host name made a valid node id.
pub fn node_id(given: Option<&str>) -> anyhow::Result<String> {
    let id = match given {
        Some(id) => id.to_string(),
        None => nix::unistd::gethostname()
            .context("host name")?
            .to_string_lossy()
            .to_ascii_lowercase()
            .replace(['.', '_'], "-"),
    };
    check_node_id(&id).with_context(|| match given {
        Some(_) => "--node-id".to_string(),
        None => format!("the host name {id:?} is no node id: give --node-id"),
    })?;
    Ok(id)
}

/// Reads the join token the server keeps in its data directory (`node-join-token`).
pub fn join_token(path: &Path) -> anyhow::Result<Credential> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("join token {}", path.display()))?;
    text.parse()
        .with_context(|| format!("join token {}", path.display()))
}

/// The file a joined node keeps its own credential in (the one it presents to the server).
pub fn own_credential_path(data_dir: &Path) -> PathBuf {
    super::credentials::NodeCredentials::dir(data_dir).join("joined")
}

/// The count of this node's losses the server last told (`None`: never told).
fn known_losses(data_dir: &Path) -> Option<u64> {
    std::fs::read_to_string(data_dir.join("node-losses"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn remember_losses(data_dir: &Path, losses: u64) {
    let path = data_dir.join("node-losses");
    if let Err(e) = super::credentials::write_private(&path, &losses.to_string()) {
        tracing::error!(error = %e, "the count of this node's losses could not be kept");
    }
}

/// Registers `registration` with the control plane at `url`: with the node's own credential
/// when it registered before (kept in `data_dir`), else with the join token `token`; keeps
/// the new own credential. Tries for up to `patience` while the server does not answer (it
/// may be starting).
pub async fn register(
    url: &str,
    pin: CertPin,
    token: &Credential,
    data_dir: &Path,
    registration: &Registration,
    patience: Duration,
) -> anyhow::Result<Registered> {
    let own_path = own_credential_path(data_dir);
    let own: Option<Credential> = std::fs::read_to_string(&own_path)
        .ok()
        .and_then(|text| text.parse().ok());
    let registered = match &own {
        Some(own) => match register_with(url, pin, own, registration, patience).await {
            // The server does not know this credential (its state was reset): join anew.
            Err(MembershipCallError::Refused(e)) if e.to_string().contains("401") => {
                tracing::warn!(error = %e, "the server does not know this node's credential: joining with the join token");
                register_with(url, pin, token, registration, patience).await
            }
            other => other,
        },
        None => register_with(url, pin, token, registration, patience).await,
    }
    .with_context(|| format!("registration with {url}"))?;
    let own: Credential = registered.node_to_server.parse()?;
    super::credentials::write_private(&own_path, &format!("{own}\n"))
        .with_context(|| format!("keep {}", own_path.display()))?;
    Ok(registered)
}

async fn register_with(
    url: &str,
    pin: CertPin,
    credential: &Credential,
    registration: &Registration,
    patience: Duration,
) -> Result<Registered, MembershipCallError> {
    let deadline = Instant::now() + patience;
    loop {
        match ControlClient::register(url, Some(pin), credential, registration).await {
            Ok(registered) => return Ok(registered),
            Err(MembershipCallError::Unreachable(why)) if Instant::now() < deadline => {
                tracing::warn!(control = %url, error = %why, "the server did not answer the registration; trying again");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// The node's route signing keys: its key file, kept equal to the server's (the node proxy
/// verifies the routes the server signs with them; the file is followed as it changes).
#[derive(Clone)]
pub struct RouteKeyFile {
    pub keys: RouteKeys,
    pub path: PathBuf,
}

impl RouteKeyFile {
    /// What a heartbeat says of them.
    fn digest(&self) -> String {
        route_keys_digest(&self.keys.file_text())
    }

    /// Makes the file hold the server's keys `text`.
    pub fn install(&self, text: &str) {
        match fastbox_proxy::install_keys(&self.path, text) {
            Ok(true) => {
                tracing::info!(key_file = %self.path.display(), "the server's route signing keys installed")
            }
            Ok(false) => {}
            Err(e) => {
                tracing::error!(error = %e, "the server's route signing keys could not be installed")
            }
        }
    }
}

/// Renews the lease every `terms.heartbeat_ms` (as the server's last answer says) until the
/// server refuses; then returns why. Heartbeats the server did not answer are logged (once
/// per run of failures) and the next one goes out on time. Route signing keys the server
/// sends (rotated there) are installed.
pub async fn heartbeat(
    control: Arc<ControlClient>,
    node: Arc<dyn NodeAgent>,
    mut terms: LeaseTerms,
    fence: Arc<dyn Fence>,
    keys: RouteKeyFile,
    lease: LeaseClock,
) -> anyhow::Error {
    let mut failing_since: Option<Instant> = None;
    loop {
        let sent = Instant::now();
        let beat = Heartbeat {
            status: node.status().await,
            route_keys_sha256: Some(keys.digest()),
        };
        match control
            .heartbeat_within(&beat, per_server(&terms, control.servers()))
            .await
        {
            Ok(renewal)
                if sent.elapsed() < Duration::from_millis(renewal.terms.fence_after_ms()) =>
            {
                terms = renewal.terms;
                if let Some(text) = &renewal.route_keys {
                    keys.install(text);
                }
                // The deadline from this process's monotonic clock: a wall clock stepped
                // meanwhile does not move it.
                let left =
                    Duration::from_millis(terms.fence_after_ms()).saturating_sub(sent.elapsed());
                let fence = fence.clone();
                let losses = renewal.losses;
                let clock = lease.clone();
                let settled = tokio::task::spawn_blocking(move || {
                    // Taken before the guard's: the node's own deadline is never after the
                    // guard's, so a start that ended in time ended before the guard froze.
                    let from = Instant::now();
                    fence.renew(SystemTime::now() + left);
                    // Nothing starts without a guard holding the sandboxes to the lease.
                    clock.set(fence.armed().then(|| from + left));
                    fence.settle(losses);
                })
                .await;
                if let Err(e) = settled {
                    tracing::error!(error = %e, "the fence renewal failed");
                }
                if renewal.was_lost {
                    tracing::warn!(
                        "the server had declared this node lost: it removes the sandboxes that ran here"
                    );
                }
                if let Some(since) = failing_since.take() {
                    tracing::info!(after = ?since.elapsed(), "heartbeats answered again");
                }
            }
            Ok(_) => {
                tracing::warn!(after = ?sent.elapsed(), "a heartbeat answer came too late to count");
                failing_since.get_or_insert_with(Instant::now);
            }
            Err(MembershipCallError::Unreachable(why)) => {
                if failing_since.is_none() {
                    tracing::warn!(error = %why, "a heartbeat was not answered; the sandboxes freeze if none is before the lease runs out");
                    failing_since = Some(Instant::now());
                }
            }
            Err(MembershipCallError::Refused(why)) => {
                return anyhow::anyhow!(
                    "the server refused this node's heartbeat ({why}): it was revoked or forgotten; the sandboxes freeze when the lease runs out"
                );
            }
        }
        let every = Duration::from_millis(terms.heartbeat_ms);
        tokio::time::sleep(every.saturating_sub(sent.elapsed())).await;
    }
}

/// How long one server may take to answer a heartbeat before the next is asked: every
/// server of the control plane can be tried twice before the node must fence (a server that
/// is stopped or cut off, whose calls hang, must not use up the lease), within 300 ms..5 s.
fn per_server(terms: &LeaseTerms, servers: usize) -> Duration {
    let budget = Duration::from_millis(terms.fence_after_ms());
    (budget / (2 * servers.max(1)) as u32).clamp(Duration::from_millis(300), Duration::from_secs(5))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_heartbeat_tries_every_server_within_the_lease() {
        let terms = |lease_ms| LeaseTerms {
            lease_ms,
            heartbeat_ms: lease_ms / 10,
        };
        // Alone: up to 4 s of a 10 s lease (fenced after 8 s).
        assert_eq!(per_server(&terms(10_000), 1), Duration::from_secs(4));
        // Three servers: each twice within the 8 s.
        let each = per_server(&terms(10_000), 3);
        assert!(each * 6 <= Duration::from_millis(8_000), "{each:?}");
        assert!(each > Duration::from_millis(1_300), "{each:?}");
        // Never below 300 ms, never above 5 s.
        assert_eq!(per_server(&terms(1_000), 5), Duration::from_millis(300));
        assert_eq!(per_server(&terms(60_000), 1), Duration::from_secs(5));
    }

    #[test]
    fn node_ids_are_checked_and_the_host_name_is_a_default() {
        assert_eq!(node_id(Some("n-1")).unwrap(), "n-1");
        let e = node_id(Some("N_1")).unwrap_err();
        assert!(format!("{e:#}").contains("--node-id"), "{e:#}");
        // Whatever the host is called, the default is a valid id or says to give one.
        match node_id(None) {
            Ok(id) => assert!(check_node_id(&id).is_ok()),
            Err(e) => assert!(format!("{e:#}").contains("--node-id"), "{e:#}"),
        }
    }

    #[test]
    fn a_join_token_file_holds_one_credential() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        let token = Credential::generate().unwrap();
        std::fs::write(&path, format!("{token}\n")).unwrap();
        assert!(
            join_token(&path)
                .unwrap()
                .matches(token.to_string().as_bytes())
        );
        std::fs::write(&path, "nope").unwrap();
        let e = format!("{:#}", join_token(&path).unwrap_err());
        assert!(e.contains("join token") && !e.contains("nope"), "{e}");
    }
}
