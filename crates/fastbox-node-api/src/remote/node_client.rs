//! [`NodeClient`]: the server's [`NodeAgent`] for a node in another process, over the node
//! API (wire format, error kinds and timeouts: the module docs of [`super`]).

use std::net::SocketAddr;
use std::time::Duration;

use async_trait::async_trait;
use axum::body::{Body, HttpBody};
use axum::extract::ConnectInfo;
use axum::response::Response;
use fastbox_egress_policy::EgressPolicy;
use fastbox_image::{ImageConfig, ImageSource};
use http::{HeaderName, HeaderValue, Request, StatusCode, header};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::credential::Credential;
use super::http_util::{
    chain, encode_segment, is_upgrade, post_json, read_bounded, refusal_text, remove_hop_by_hop,
};
use super::node_server::PROXY_PREFIX;
use super::tls::{self, CertPin};
use super::verbs::*;
use super::{CLIENT_HEADER, CREDENTIAL_HEADER, MAX_BODY, REFUSAL_HEADER, UNSIGNED_HEADER};
use crate::recipe::GoldenRecipe;
use crate::wire::{
    Adoption, CheckpointFetch, ImageInfo, NodePlacement, NodeStatus, PlaceSpec, Placed,
    ProxyRefusal, RegistryCredentials, RemoveReport, RestoreSpec, SandboxTokens, SnapshotReport,
    SnapshotSource, TemplateBuilt, Unsigned,
};
use crate::{NodeAgent, NodeError, NodeErrorKind, NodeResult};

/// Longest refusal of the proxy route read (a [`ProxyRefusal`] or an envelope).
const MAX_REFUSAL: usize = 64 << 10;

/// How long each kind of call may take, connection included.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// Connecting to the node (every call, the proxy route's too).
    pub connect: Duration,
    /// Questions the node answers from memory: `status`, `is_alive`, `admit` (which waits up
    /// to 5 s for a slot a teardown is releasing), slots, `has_snapshot`, `snapshot_keys`.
    pub quick: Duration,
    /// Removals, releases, `adopt`, policies.
    pub moderate: Duration,
    /// Starts (`place`, `clone_snapshot`, `resume`), checkpoints (`pause`, `stage_snapshot`,
    /// `commit_snapshot`, `finish_interrupted_pause`) and `resolve_image` (a pull).
    pub long: Duration,
    /// `build_template`: a build waits for its readiness gate (up to an hour) besides its
    /// dump and publish.
    pub build: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(5),
            quick: Duration::from_secs(15),
            moderate: Duration::from_secs(120),
            long: Duration::from_secs(30 * 60),
            build: Duration::from_secs(2 * 3600),
        }
    }
}

impl Timeouts {
    pub(super) fn of(&self, pace: Pace) -> Duration {
        match pace {
            Pace::Quick => self.quick,
            Pace::Moderate => self.moderate,
            Pace::Long => self.long,
            Pace::Build => self.build,
        }
    }
}

/// A client that cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("URL {url:?}: {why}")]
    BadUrl { url: String, why: String },
    #[error("HTTP client: {0}")]
    Http(String),
}

/// `url` as a base the routes are appended to: `http` or `https`, a host, no credentials,
/// query or fragment.
pub(super) fn base_url(url: &str) -> Result<String, ClientError> {
    let bad = |why: &str| ClientError::BadUrl {
        url: url.to_string(),
        why: why.to_string(),
    };
    let parsed = reqwest::Url::parse(url).map_err(|e| bad(&e.to_string()))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(bad("the scheme must be http or https"));
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(bad("no host"));
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(bad("credentials do not belong in the URL"));
    }
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return Err(bad("no query or fragment"));
    }
    Ok(parsed.as_str().trim_end_matches('/').to_string())
}

/// The HTTP client of either direction: connections kept and reused, no proxy from the
/// environment (these are direct links inside a cluster), no redirects (the credential
/// would follow them); with `pin`, TLS that accepts only the certificate it names.
pub(super) fn http_client(
    connect: Duration,
    pin: Option<CertPin>,
) -> Result<reqwest::Client, ClientError> {
    client_builder(connect, pin)?
        .pool_idle_timeout(Duration::from_secs(90))
        .build()
        .map_err(|e| ClientError::Http(chain(&e)))
}

/// The client of protocol upgrades to a node: as [`http_client`], but every request on a
/// connection of its own, never returned to a pool (an upgrade the node declines must not
/// leave a connection in a state the next call would inherit).
fn upgrade_client(connect: Duration, pin: Option<CertPin>) -> Result<reqwest::Client, ClientError> {
    client_builder(connect, pin)?
        .pool_max_idle_per_host(0)
        .build()
        .map_err(|e| ClientError::Http(chain(&e)))
}

fn client_builder(
    connect: Duration,
    pin: Option<CertPin>,
) -> Result<reqwest::ClientBuilder, ClientError> {
    let mut builder = reqwest::Client::builder()
        .connect_timeout(connect)
        .tcp_nodelay(true)
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none());
    if let Some(pin) = pin {
        let config =
            tls::pinned_client_config(pin).map_err(|e| ClientError::Http(e.to_string()))?;
        builder = builder.use_preconfigured_tls(config).https_only(true);
    }
    Ok(builder)
}

/// A transport failure as text: a timeout says so.
pub(super) fn transport_error(e: &reqwest::Error, timeout: Duration) -> String {
    if e.is_timeout() {
        format!("no answer within {} s", timeout.as_secs_f64())
    } else {
        chain(e)
    }
}

/// The node `node_id` at `url`, called over the node API.
#[derive(Debug)]
pub struct NodeClient {
    node_id: String,
    base: String,
    credential: Credential,
    http: reqwest::Client,
    /// Protocol upgrades only ([`upgrade_client`]).
    upgrades: reqwest::Client,
    timeouts: Timeouts,
    images: ImageConfig,
}

impl NodeClient {
    /// A client of node `node_id` serving [`super::node_router`] at `url`
    /// (`http://10.0.0.2:7070`), presenting `credential` (the one that node's router
    /// checks).
    pub fn new(
        node_id: impl Into<String>,
        url: &str,
        credential: Credential,
        timeouts: Timeouts,
    ) -> Result<Self, ClientError> {
        Ok(Self {
            node_id: node_id.into(),
            base: base_url(url)?,
            credential,
            http: http_client(timeouts.connect, None)?,
            upgrades: upgrade_client(timeouts.connect, None)?,
            timeouts,
            images: ImageConfig::default(),
        })
    }

    /// Calls the node over TLS, accepting only the certificate `pin` names (the URL must be
    /// `https://`).
    pub fn with_pinned_cert(mut self, pin: CertPin) -> Result<Self, ClientError> {
        self.http = http_client(self.timeouts.connect, Some(pin))?;
        self.upgrades = upgrade_client(self.timeouts.connect, Some(pin))?;
        Ok(self)
    }

    /// Image references are checked against `images` (the node's own configuration: its
    /// aliases) instead of the default one.
    pub fn with_image_config(mut self, images: ImageConfig) -> Self {
        self.images = images;
        self
    }

    /// The node's base URL.
    pub fn url(&self) -> &str {
        &self.base
    }

    fn error(&self, kind: NodeErrorKind, verb: &str, what: impl std::fmt::Display) -> NodeError {
        NodeError::new(kind, format!("node {}: {verb}: {what}", self.node_id))
    }

    /// Calls `verb` with `args`; the node's answer, or why there is none.
    async fn call<A: Serialize, T: DeserializeOwned>(&self, verb: Verb, args: &A) -> NodeResult<T> {
        let name = verb.name();
        let body = serde_json::to_vec(args).map_err(|e| {
            self.error(
                NodeErrorKind::Failed,
                name,
                format_args!("the arguments could not be written: {e}"),
            )
        })?;
        if body.len() > MAX_BODY {
            return Err(self.error(
                NodeErrorKind::Failed,
                name,
                format_args!("the arguments are over {MAX_BODY} bytes"),
            ));
        }
        let timeout = self.timeouts.of(verb.pace());
        let (status, body) = post_json(
            &self.http,
            &self.base,
            &format!("/node/v1/{name}"),
            &self.credential,
            body,
            timeout,
            MAX_BODY,
        )
        .await
        .map_err(|why| self.error(NodeErrorKind::Unreachable, name, why))?;
        if status == StatusCode::OK {
            return serde_json::from_slice::<NodeResult<T>>(&body).unwrap_or_else(|e| {
                Err(self.error(
                    NodeErrorKind::Unreachable,
                    name,
                    format_args!("an answer that does not parse: {e}"),
                ))
            });
        }
        if status == StatusCode::UNAUTHORIZED {
            // The node refused this server's credential: nothing was done, and the node is
            // of no use to this server until its configuration is fixed.
            return Err(self.error(
                NodeErrorKind::Unreachable,
                name,
                format_args!(
                    "the node refused this server's credential ({}): check the server-to-node credential the server was given",
                    refusal_text(&body)
                ),
            ));
        }
        // The router's own refusal (nothing was done), or something in the way.
        let kind = if status.is_client_error() {
            NodeErrorKind::Failed
        } else {
            NodeErrorKind::Unreachable
        };
        Err(self.error(
            kind,
            name,
            format_args!("answered {status}: {}", refusal_text(&body)),
        ))
    }

    /// The answer of an infallible verb, or, when there is none, `fallback` (logged).
    fn or_fallback<T>(&self, verb: Verb, result: NodeResult<T>, fallback: T) -> T {
        result.unwrap_or_else(|e| {
            tracing::warn!(node = %self.node_id, verb = verb.name(), error = %e, "no answer from the node: assuming what destroys nothing");
            fallback
        })
    }
}

#[async_trait]
impl NodeAgent for NodeClient {
    fn node_id(&self) -> &str {
        &self.node_id
    }

    async fn admit(&self) -> NodeResult<u32> {
        self.call(Verb::Admit, &NoArgs {}).await
    }

    async fn release_slot(&self, slot: u32) {
        let result = self.call(Verb::ReleaseSlot, &SlotArgs { slot }).await;
        self.or_fallback(Verb::ReleaseSlot, result, ());
    }

    async fn claim_slot(&self, slot: u32) {
        let result = self.call(Verb::ClaimSlot, &SlotArgs { slot }).await;
        self.or_fallback(Verb::ClaimSlot, result, ());
    }

    async fn release_unused_admission(&self, slot: u32, min_age_ms: u64) -> bool {
        let args = UnusedAdmissionArgs { slot, min_age_ms };
        let result = self.call(Verb::ReleaseUnusedAdmission, &args).await;
        self.or_fallback(Verb::ReleaseUnusedAdmission, result, false)
    }

    fn check_image(&self, reference: &str) -> NodeResult<()> {
        ImageSource::parse(reference, &self.images)
            .map(drop)
            .map_err(|e| NodeError::new(NodeErrorKind::BadImage, e.to_string()))
    }

    async fn resolve_image(
        &self,
        reference: &str,
        auth: Option<RegistryCredentials>,
    ) -> NodeResult<ImageInfo> {
        let args = ResolveImageArgs {
            reference: reference.to_string(),
            auth,
        };
        self.call(Verb::ResolveImage, &args).await
    }

    async fn place(&self, spec: PlaceSpec, slot: u32) -> NodeResult<Placed> {
        self.call(Verb::Place, &PlaceArgs { spec, slot }).await
    }

    async fn clone_snapshot(&self, key: &str, spec: RestoreSpec, slot: u32) -> NodeResult<Placed> {
        let args = RestoreArgs {
            key: key.to_string(),
            spec,
            slot,
        };
        self.call(Verb::CloneSnapshot, &args).await
    }

    async fn resume(&self, key: &str, spec: RestoreSpec, slot: u32) -> NodeResult<Placed> {
        let args = RestoreArgs {
            key: key.to_string(),
            spec,
            slot,
        };
        self.call(Verb::Resume, &args).await
    }

    async fn is_alive(&self, placement: &NodePlacement) -> bool {
        let args = IsAliveArgs {
            placement: placement.clone(),
        };
        let result = self.call(Verb::IsAlive, &args).await;
        self.or_fallback(Verb::IsAlive, result, true)
    }

    async fn adopt(
        &self,
        id: &str,
        placement: &NodePlacement,
        tokens: &SandboxTokens,
        policy: &EgressPolicy,
        credential_proxy: bool,
    ) -> Adoption {
        let args = AdoptArgs {
            id: id.to_string(),
            placement: placement.clone(),
            tokens: tokens.clone(),
            policy: policy.clone(),
            credential_proxy,
        };
        let result = self.call(Verb::Adopt, &args).await;
        self.or_fallback(Verb::Adopt, result, Adoption::Adopted)
    }

    async fn remove(
        &self,
        id: &str,
        placement: Option<&NodePlacement>,
        slot: Option<u32>,
    ) -> NodeResult<RemoveReport> {
        let args = RemoveArgs {
            id: id.to_string(),
            placement: placement.cloned(),
            slot,
        };
        self.call(Verb::Remove, &args).await
    }

    async fn release_keeping_address(
        &self,
        id: &str,
        placement: Option<&NodePlacement>,
        slot: u32,
    ) -> NodeResult<()> {
        let args = ReleaseKeepingAddressArgs {
            id: id.to_string(),
            placement: placement.cloned(),
            slot,
        };
        self.call(Verb::ReleaseKeepingAddress, &args).await
    }

    async fn pause(&self, id: &str, source: &SnapshotSource) -> NodeResult<SnapshotReport> {
        let args = PauseArgs {
            id: id.to_string(),
            source: source.clone(),
        };
        self.call(Verb::Pause, &args).await
    }

    async fn finish_interrupted_pause(&self, source: &SnapshotSource) -> bool {
        let args = SourceArgs {
            source: source.clone(),
        };
        let result = self.call(Verb::FinishInterruptedPause, &args).await;
        self.or_fallback(Verb::FinishInterruptedPause, result, false)
    }

    async fn stage_snapshot(&self, source: &SnapshotSource, short_freeze: bool) -> NodeResult<()> {
        let args = StageArgs {
            source: source.clone(),
            short_freeze,
        };
        self.call(Verb::StageSnapshot, &args).await
    }

    async fn commit_snapshot(
        &self,
        key: &str,
        placement: &NodePlacement,
    ) -> NodeResult<SnapshotReport> {
        let args = CommitArgs {
            key: key.to_string(),
            placement: placement.clone(),
        };
        self.call(Verb::CommitSnapshot, &args).await
    }

    async fn has_snapshot(&self, key: &str) -> bool {
        let args = KeyArgs {
            key: key.to_string(),
        };
        let result = self.call(Verb::HasSnapshot, &args).await;
        self.or_fallback(Verb::HasSnapshot, result, false)
    }

    async fn remove_snapshot(&self, key: &str) -> NodeResult<()> {
        let args = KeyArgs {
            key: key.to_string(),
        };
        self.call(Verb::RemoveSnapshot, &args).await
    }

    async fn fetch_checkpoint(
        &self,
        key: &str,
        manifest: &str,
        execd_token: &str,
        fetch: CheckpointFetch,
    ) -> NodeResult<()> {
        let args = FetchArgs {
            key: key.to_string(),
            manifest: manifest.to_string(),
            execd_token: execd_token.to_string(),
            fetch,
        };
        self.call(Verb::FetchCheckpoint, &args).await
    }

    async fn discard_interrupted_snapshot(&self, key: &str) {
        let args = KeyArgs {
            key: key.to_string(),
        };
        let result = self.call(Verb::DiscardInterruptedSnapshot, &args).await;
        self.or_fallback(Verb::DiscardInterruptedSnapshot, result, ());
    }

    async fn snapshot_keys(&self) -> Vec<String> {
        let result = self.call(Verb::SnapshotKeys, &NoArgs {}).await;
        self.or_fallback(Verb::SnapshotKeys, result, Vec::new())
    }

    async fn build_template(
        &self,
        key: &str,
        image: &str,
        recipe: &GoldenRecipe,
    ) -> NodeResult<TemplateBuilt> {
        let args = BuildArgs {
            key: key.to_string(),
            image: image.to_string(),
            recipe: recipe.clone(),
        };
        self.call(Verb::BuildTemplate, &args).await
    }

    async fn remove_template(&self, key: &str) -> NodeResult<()> {
        let args = KeyArgs {
            key: key.to_string(),
        };
        self.call(Verb::RemoveTemplate, &args).await
    }

    async fn set_egress_policy(&self, id: &str, policy: &EgressPolicy) -> NodeResult<()> {
        let args = PolicyArgs {
            id: id.to_string(),
            policy: policy.clone(),
        };
        self.call(Verb::SetEgressPolicy, &args).await
    }

    async fn proxy(
        &self,
        id: &str,
        port: u16,
        path: &str,
        unsigned: Unsigned,
        strip: &[HeaderName],
        req: Request<Body>,
    ) -> Result<Response, ProxyRefusal> {
        // A lone `.` or `..` segment would be resolved away by the URL parser.
        if id.is_empty() || id == "." || id == ".." {
            return Err(ProxyRefusal::BadRoute(format!("/{id}/{port}{path}")));
        }
        if !path.is_empty() && !path.starts_with('/') {
            return Err(ProxyRefusal::BadRoute(format!("/{id}/{port}{path}")));
        }
        let (mut parts, body) = req.into_parts();
        let mut route = format!("{PROXY_PREFIX}{}/{port}", encode_segment(id));
        if !path.is_empty() {
            route.push('/');
            route.push_str(&encode_segment(path));
        }
        if let Some(query) = parts.uri.query() {
            route.push('?');
            route.push_str(query);
        }
        let upgrade = is_upgrade(&parts.headers);
        let mut headers = std::mem::take(&mut parts.headers);
        if !upgrade {
            remove_hop_by_hop(&mut headers);
        }
        for name in strip {
            headers.remove(name);
        }
        for ours in [
            CREDENTIAL_HEADER,
            UNSIGNED_HEADER,
            CLIENT_HEADER,
            REFUSAL_HEADER,
        ] {
            headers.remove(ours);
        }
        if let Some(host) = headers.remove(header::HOST)
            && !headers.contains_key("x-forwarded-host")
        {
            headers.insert("x-forwarded-host", host);
        }
        headers.insert(CREDENTIAL_HEADER, self.credential.header_value());
        headers.insert(
            UNSIGNED_HEADER,
            HeaderValue::from_static(match unsigned {
                Unsigned::Allowed => "allowed",
                Unsigned::Refused => "refused",
            }),
        );
        if let Some(ConnectInfo(client)) = parts.extensions.get::<ConnectInfo<SocketAddr>>()
            && let Ok(value) = HeaderValue::from_str(&client.to_string())
        {
            headers.insert(CLIENT_HEADER, value);
        }
        if upgrade {
            parts.headers = headers;
            return self
                .proxy_upgrade(route, Request::from_parts(parts, body))
                .await;
        }
        let url = format!("{}{route}", self.base);
        let mut request = self.http.request(parts.method, url).headers(headers);
        // A request without a body goes without one (not as an empty chunked stream).
        if body.size_hint().exact() != Some(0) {
            request = request.body(reqwest::Body::wrap_stream(body.into_data_stream()));
        }
        let response = request.send().await.map_err(|e| {
            ProxyRefusal::Upstream(format!(
                "node {} unreachable at {}: {}",
                self.node_id,
                self.base,
                chain(&e)
            ))
        })?;
        if response.headers().contains_key(REFUSAL_HEADER) {
            return Err(self.refusal(response).await);
        }
        let status = response.status();
        let mut headers = response.headers().clone();
        remove_hop_by_hop(&mut headers);
        let mut answer = Response::new(Body::from_stream(response.bytes_stream()));
        *answer.status_mut() = status;
        *answer.headers_mut() = headers;
        Ok(answer)
    }

    async fn status(&self) -> NodeStatus {
        let result = self.call(Verb::Status, &NoArgs {}).await;
        self.or_fallback(
            Verb::Status,
            result,
            NodeStatus {
                node_id: self.node_id.clone(),
                ..NodeStatus::default()
            },
        )
    }
}

impl NodeClient {
    /// The refusal a node's proxy route answered instead of the sandbox (`X-Fastbox-Refusal`).
    async fn refusal(&self, response: reqwest::Response) -> ProxyRefusal {
        let status = response.status();
        let body = read_bounded(response, MAX_REFUSAL, self.timeouts.quick)
            .await
            .unwrap_or_default();
        serde_json::from_slice::<ProxyRefusal>(&body).unwrap_or_else(|_| {
            ProxyRefusal::Upstream(format!(
                "node {} refused the request ({status}): {}",
                self.node_id,
                refusal_text(&body)
            ))
        })
    }

    /// [`NodeAgent::proxy`] of a protocol upgrade (WebSocket): `req` (its headers already the
    /// node's, `Connection` and `Upgrade` kept) goes to the node's `route` with this client
    /// (TLS as for every call), and when the node switches protocols the caller's connection
    /// and the node's are spliced, as the node proxy does for a sandbox.
    async fn proxy_upgrade(
        &self,
        route: String,
        req: Request<Body>,
    ) -> Result<Response, ProxyRefusal> {
        let unreachable = |why: String| {
            ProxyRefusal::Upstream(format!(
                "node {} unreachable at {}: {why}",
                self.node_id, self.base
            ))
        };
        let (mut parts, _) = req.into_parts();
        let caller = parts
            .extensions
            .remove::<hyper::upgrade::OnUpgrade>()
            .ok_or_else(|| unreachable("the caller's connection cannot be upgraded".into()))?;
        // An upgrade carries no body: none is sent, and no header says otherwise.
        parts.headers.remove(header::CONTENT_LENGTH);
        parts.headers.remove(header::TRANSFER_ENCODING);
        let sent = self
            .upgrades
            .request(parts.method, format!("{}{route}", self.base))
            .headers(parts.headers)
            .send();
        let response = tokio::time::timeout(self.timeouts.moderate, sent)
            .await
            .map_err(|_| {
                unreachable(format!(
                    "no answer to the upgrade within {} s",
                    self.timeouts.moderate.as_secs_f64()
                ))
            })?
            .map_err(|e| unreachable(chain(&e)))?;
        if response.headers().contains_key(REFUSAL_HEADER) {
            return Err(self.refusal(response).await);
        }
        let status = response.status();
        let mut headers = response.headers().clone();
        let mut answer = if status == StatusCode::SWITCHING_PROTOCOLS {
            let node_id = self.node_id.clone();
            tokio::spawn(async move {
                let (node, caller) = match tokio::join!(response.upgrade(), caller) {
                    (Ok(node), Ok(caller)) => (node, caller),
                    (node, caller) => {
                        tracing::debug!(node = %node_id, node_side = ?node.err(), caller_side = ?caller.err(), "an upgrade ended before it began");
                        return;
                    }
                };
                let (mut node, mut caller) = (node, hyper_util::rt::TokioIo::new(caller));
                let _ = tokio::io::copy_bidirectional(&mut caller, &mut node).await;
            });
            Response::new(Body::empty())
        } else {
            // The node declined the upgrade: its answer, as for any other request.
            remove_hop_by_hop(&mut headers);
            Response::new(Body::from_stream(response.bytes_stream()))
        };
        *answer.status_mut() = status;
        *answer.headers_mut() = headers;
        Ok(answer)
    }
}
