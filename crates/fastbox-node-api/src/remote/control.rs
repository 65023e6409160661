//! The control API: [`control_router`] serves the server's [`EgressApi`] and [`AccessApi`]
//! to remote nodes, [`ControlClient`] is a node's [`EgressApi`] and [`AccessApi`] over it
//! (wire format: the module docs of [`super`]).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use fastbox_api::egress::PolicyStatusResponse;
use fastbox_api::lifecycle::{NetworkPolicy, NetworkRule};
use http::{StatusCode, header};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::MAX_BODY;
use super::credential::Credential;
use super::http_util::{envelope, post_json, refusal_text};
use super::node_client::{ClientError, base_url, http_client};
use super::tls::CertPin;
use crate::control::{
    AccessApi, AccessToken, EgressApi, EgressApiError, PolicyChange, SandboxAccess,
};
use crate::membership::{
    Caller, ControlPlane, Heartbeat, MembershipError, Registered, Registration, Renewal,
};

/// How long a node keeps an answer of the access route by default: a sandbox's access rule
/// is fixed at its create, and a proxied request should not wait for the server every time.
pub const DEFAULT_ACCESS_TTL: Duration = Duration::from_secs(5);

/// Answers of the access route kept at most (the oldest go first once full).
const MAX_CACHED: usize = 4096;

/// The egress operations: a change is applied on the sandbox's node (the server calls this
/// node back) before it answers.
const EGRESS_TIMEOUT: Duration = Duration::from_secs(60);
/// The access check, on a proxied request's path.
const ACCESS_TIMEOUT: Duration = Duration::from_secs(10);
/// A registration or a heartbeat (a heartbeat late by this much is as good as lost).
const MEMBERSHIP_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The code of an [`EgressApiError`] the wire cannot name.
const UNKNOWN_CODE: &str = "GENERAL::UNKNOWN_ERROR";

// The wire forms.

#[derive(Serialize, Deserialize)]
struct IdArgs {
    id: String,
}

#[derive(Serialize, Deserialize)]
struct ChangeArgs {
    id: String,
    change: WireChange,
    via: String,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum WireChange {
    Replace(NetworkPolicy),
    Patch(Vec<NetworkRule>),
    Delete(Vec<String>),
}

impl From<PolicyChange> for WireChange {
    fn from(change: PolicyChange) -> Self {
        match change {
            PolicyChange::Replace(policy) => Self::Replace(policy),
            PolicyChange::Patch(rules) => Self::Patch(rules),
            PolicyChange::Delete(targets) => Self::Delete(targets),
        }
    }
}

impl From<WireChange> for PolicyChange {
    fn from(change: WireChange) -> Self {
        match change {
            WireChange::Replace(policy) => Self::Replace(policy),
            WireChange::Patch(rules) => Self::Patch(rules),
            WireChange::Delete(targets) => Self::Delete(targets),
        }
    }
}

#[derive(Serialize, Deserialize)]
struct WireEgressError {
    status: u16,
    code: String,
    message: String,
}

impl From<EgressApiError> for WireEgressError {
    fn from(e: EgressApiError) -> Self {
        Self {
            status: e.status.as_u16(),
            code: e.code.to_string(),
            message: e.message,
        }
    }
}

impl From<WireEgressError> for EgressApiError {
    fn from(e: WireEgressError) -> Self {
        Self {
            status: StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_GATEWAY),
            code: static_code(&e.code),
            message: e.message,
        }
    }
}

type EgressAnswer = Result<PolicyStatusResponse, WireEgressError>;

/// A sandbox's access rule on the wire: the only place a sandbox's access token is written
/// out, as its text.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum WireAccess {
    Open,
    Secure(String),
}

/// `code` as the `&'static str` of [`EgressApiError`]: the codes are a short, fixed list (the
/// lifecycle API's), each kept once; anything unlike one is [`UNKNOWN_CODE`].
fn static_code(code: &str) -> &'static str {
    const MAX_CODES: usize = 64;
    const MAX_LEN: usize = 64;
    static CODES: OnceLock<Mutex<HashSet<&'static str>>> = OnceLock::new();
    if code.is_empty() || code.len() > MAX_LEN || !code.bytes().all(|b| b.is_ascii_graphic()) {
        return UNKNOWN_CODE;
    }
    let mut codes = CODES
        .get_or_init(Default::default)
        .lock()
        .expect("codes lock");
    if let Some(known) = codes.get(code) {
        return known;
    }
    if codes.len() >= MAX_CODES {
        return UNKNOWN_CODE;
    }
    let kept: &'static str = Box::leak(code.to_string().into_boxed_str());
    codes.insert(kept);
    kept
}

// The server side.

#[derive(Clone)]
struct Control {
    egress: Arc<dyn EgressApi>,
    access: Arc<dyn AccessApi>,
    plane: Arc<dyn ControlPlane>,
}

/// The control API of `egress` and `access`, every route behind `plane`'s authentication
/// (the credential a node presents: its own, not the one the server presents to it; or the
/// join token, for the registration route only). A node is answered about its own
/// sandboxes only ([`ControlPlane::holds`]): another's are not found.
pub fn control_router(
    egress: Arc<dyn EgressApi>,
    access: Arc<dyn AccessApi>,
    plane: Arc<dyn ControlPlane>,
) -> Router {
    Router::new()
        .route("/control/v1/egress/policy", post(policy))
        .route("/control/v1/egress/change", post(change))
        .route("/control/v1/access", post(access_rule))
        .route("/control/v1/register", post(register))
        .route("/control/v1/heartbeat", post(heartbeat))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .fallback(async || {
            envelope(
                StatusCode::NOT_FOUND,
                "NODE::UNKNOWN_VERB",
                "no such route of the control API",
            )
        })
        .layer(axum::middleware::from_fn_with_state(
            plane.clone(),
            identify,
        ))
        .with_state(Control {
            egress,
            access,
            plane,
        })
}

/// One node with one credential, registering nobody: a server with a node given by its
/// configuration, and tests.
pub struct SingleNode {
    pub node_id: String,
    pub credential: Credential,
}

#[async_trait]
impl ControlPlane for SingleNode {
    fn authenticate(&self, presented: &[u8]) -> Option<Caller> {
        self.credential
            .matches(presented)
            .then(|| Caller::Node(self.node_id.clone()))
    }

    fn holds(&self, node_id: &str, _sandbox_id: &str) -> bool {
        node_id == self.node_id
    }

    async fn register(&self, _: &Caller, _: Registration) -> Result<Registered, MembershipError> {
        Err(MembershipError::Refused(
            "this server takes no registrations".into(),
        ))
    }

    async fn heartbeat(&self, node_id: &str, _: Heartbeat) -> Result<Renewal, MembershipError> {
        Err(MembershipError::Unknown(node_id.to_string()))
    }
}

/// A node's call about sandbox `id` that is not its own: answered as if there were no such
/// sandbox.
fn not_held(id: &str) -> EgressApiError {
    EgressApiError {
        status: StatusCode::NOT_FOUND,
        code: "SANDBOX::NOT_FOUND",
        message: format!("sandbox {id} not found"),
    }
}

/// The node calling (the registered node's id), or `None` for the join token.
fn node_of(caller: &Caller) -> Option<&str> {
    match caller {
        Caller::Node(id) => Some(id),
        Caller::Joining => None,
    }
}

/// The route a joining caller may use (and a node may not).
const REGISTER_ROUTE: &str = "/control/v1/register";

/// The check in front of every route: a request whose credential is nobody's never reaches
/// a handler; the join token reaches the registration route only.
async fn identify(
    State(plane): State<Arc<dyn ControlPlane>>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let caller = req
        .headers()
        .get(super::CREDENTIAL_HEADER)
        .map(|v| plane.authenticate(v.as_bytes()));
    let registering = req.uri().path() == REGISTER_ROUTE;
    match caller {
        // A registered node registers again (with its own credential) and calls the rest.
        Some(Some(caller)) if caller != Caller::Joining || registering => {
            req.extensions_mut().insert(caller);
            next.run(req).await
        }
        Some(Some(_)) => envelope(
            StatusCode::FORBIDDEN,
            "NODE::JOIN_TOKEN_ONLY_REGISTERS",
            "the join token may only register a node",
        ),
        Some(None) => envelope(
            StatusCode::UNAUTHORIZED,
            "INVALID_CREDENTIAL",
            "wrong credential in X-Fastbox-Credential",
        ),
        None => envelope(
            StatusCode::UNAUTHORIZED,
            "MISSING_CREDENTIAL",
            "this route needs a credential in X-Fastbox-Credential",
        ),
    }
}

/// A [`MembershipError`] as the wire carries it.
type MembershipAnswer<T> = Result<T, MembershipError>;

async fn register(
    State(control): State<Control>,
    axum::Extension(caller): axum::Extension<Caller>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let registration: Registration = match parse(body) {
        Ok(args) => args,
        Err(refused) => return *refused,
    };
    let answer: MembershipAnswer<Registered> = control.plane.register(&caller, registration).await;
    membership_json(&answer)
}

/// A membership answer: 200 with the answer, or 503 when the server could not decide now
/// (the node tries again, as after an unanswered call).
fn membership_json<T: Serialize>(answer: &MembershipAnswer<T>) -> Response {
    match answer {
        Err(MembershipError::Unavailable(why)) => envelope(
            StatusCode::SERVICE_UNAVAILABLE,
            "NODE::CONTROL_PLANE_UNAVAILABLE",
            why,
        ),
        answer => json(answer),
    }
}

async fn heartbeat(
    State(control): State<Control>,
    axum::Extension(caller): axum::Extension<Caller>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let beat: Heartbeat = match parse(body) {
        Ok(args) => args,
        Err(refused) => return *refused,
    };
    let Some(node) = node_of(&caller) else {
        return json(&MembershipAnswer::<Renewal>::Err(MembershipError::Refused(
            "not a node".into(),
        )));
    };
    if beat.status.node_id != node {
        return json(&MembershipAnswer::<Renewal>::Err(MembershipError::Invalid(
            format!(
                "a heartbeat of node {node} names node {}",
                beat.status.node_id
            ),
        )));
    }
    let answer: MembershipAnswer<Renewal> = control.plane.heartbeat(node, beat).await;
    membership_json(&answer)
}

/// The arguments in `body`, or the 400 (or 413) that refuses them.
fn parse<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, Box<Response>> {
    let body =
        body.map_err(|e| Box::new(envelope(e.status(), "NODE::BAD_REQUEST", e.body_text())))?;
    serde_json::from_slice(&body).map_err(|e| {
        Box::new(envelope(
            StatusCode::BAD_REQUEST,
            "NODE::BAD_REQUEST",
            format!("the arguments: {e}"),
        ))
    })
}

fn json<T: Serialize>(answer: &T) -> Response {
    match serde_json::to_vec(answer) {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => envelope(
            StatusCode::INTERNAL_SERVER_ERROR,
            "GENERAL::UNKNOWN_ERROR",
            format!("the answer could not be written: {e}"),
        ),
    }
}

impl Control {
    /// Whether `caller` may ask about sandbox `id`.
    fn may_ask(&self, caller: &Caller, id: &str) -> bool {
        node_of(caller).is_some_and(|node| self.plane.holds(node, id))
    }
}

async fn policy(
    State(control): State<Control>,
    axum::Extension(caller): axum::Extension<Caller>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let args: IdArgs = match parse(body) {
        Ok(args) => args,
        Err(refused) => return *refused,
    };
    let answer: EgressAnswer = match control.may_ask(&caller, &args.id) {
        true => control.egress.policy(&args.id).await.map_err(Into::into),
        false => Err(not_held(&args.id).into()),
    };
    json(&answer)
}

async fn change(
    State(control): State<Control>,
    axum::Extension(caller): axum::Extension<Caller>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let args: ChangeArgs = match parse(body) {
        Ok(args) => args,
        Err(refused) => return *refused,
    };
    let answer: EgressAnswer = match control.may_ask(&caller, &args.id) {
        true => control
            .egress
            .change(&args.id, args.change.into(), &args.via)
            .await
            .map_err(Into::into),
        false => Err(not_held(&args.id).into()),
    };
    json(&answer)
}

async fn access_rule(
    State(control): State<Control>,
    axum::Extension(caller): axum::Extension<Caller>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let args: IdArgs = match parse(body) {
        Ok(args) => args,
        Err(refused) => return *refused,
    };
    if !control.may_ask(&caller, &args.id) {
        return json(&None::<WireAccess>);
    }
    let answer = control
        .access
        .access(&args.id)
        .await
        .map(|access| match access {
            SandboxAccess::Open => WireAccess::Open,
            SandboxAccess::Secure(token) => WireAccess::Secure(token.expose().to_string()),
        });
    json(&answer)
}

// The node side.

/// A registration or heartbeat that did not succeed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MembershipCallError {
    /// No answer (or one that is not the control API's): try again.
    #[error("the control plane did not answer: {0}")]
    Unreachable(String),
    /// The control plane refused.
    #[error(transparent)]
    Refused(MembershipError),
}

/// The control plane at a URL (or several: the servers sharing one state, any of which
/// answers; calls go to the last one that did and move on when it does not), as a node's
/// [`EgressApi`] and [`AccessApi`].
#[derive(Debug)]
pub struct ControlClient {
    bases: Vec<String>,
    /// The base that answered last.
    current: std::sync::atomic::AtomicUsize,
    credential: Credential,
    http: reqwest::Client,
    access_ttl: Duration,
    /// Answers of the access route: sandbox id -> (when, rule).
    cached: Mutex<HashMap<String, (Instant, SandboxAccess)>>,
}

impl ControlClient {
    /// A client of the server serving [`control_router`] at `url` (`URL,URL,...`: any of
    /// several servers), presenting `credential` (this node's own).
    pub fn new(url: &str, credential: Credential) -> Result<Self, ClientError> {
        Ok(Self {
            bases: url
                .split(',')
                .map(|u| base_url(u.trim()))
                .collect::<Result<_, _>>()?,
            current: std::sync::atomic::AtomicUsize::new(0),
            credential,
            http: http_client(CONNECT_TIMEOUT, None)?,
            access_ttl: DEFAULT_ACCESS_TTL,
            cached: Mutex::new(HashMap::new()),
        })
    }

    /// Calls the server over TLS, accepting only the certificate `pin` names (the URL must
    /// be `https://`).
    pub fn with_pinned_cert(mut self, pin: CertPin) -> Result<Self, ClientError> {
        self.http = http_client(CONNECT_TIMEOUT, Some(pin))?;
        Ok(self)
    }

    /// Registers a node with the control plane at `url` (over TLS pinned to `pin`, when
    /// given), presenting `credential`: the cluster's join token (a name not registered
    /// yet), or the node's own credential (its name again). The node's (new) credentials and
    /// lease terms.
    pub async fn register(
        url: &str,
        pin: Option<CertPin>,
        credential: &Credential,
        registration: &Registration,
    ) -> Result<Registered, MembershipCallError> {
        let invalid =
            |e: ClientError| MembershipCallError::Refused(MembershipError::Invalid(e.to_string()));
        let mut client = Self::new(url, credential.clone()).map_err(invalid)?;
        if let Some(pin) = pin {
            client = client.with_pinned_cert(pin).map_err(invalid)?;
        }
        client.membership("register", registration).await
    }

    /// Renews this node's lease with `status`.
    pub async fn heartbeat(&self, heartbeat: &Heartbeat) -> Result<Renewal, MembershipCallError> {
        self.membership("heartbeat", heartbeat).await
    }

    /// [`Self::heartbeat`], giving each server at most `per_server` to answer before the
    /// next is asked (a stopped server must not use up the lease).
    pub async fn heartbeat_within(
        &self,
        heartbeat: &Heartbeat,
        per_server: Duration,
    ) -> Result<Renewal, MembershipCallError> {
        self.membership_within("heartbeat", heartbeat, per_server)
            .await
    }

    /// How many servers this client asks (in turn, the last that answered first).
    pub fn servers(&self) -> usize {
        self.bases.len()
    }

    /// Keeps answers of the access route for `ttl` instead ([`Duration::ZERO`]: asks every
    /// time).
    pub fn with_access_ttl(mut self, ttl: Duration) -> Self {
        self.access_ttl = ttl;
        self
    }

    /// Posts `args` to `route`; the answer, or why there is none.
    async fn post<A: Serialize, T: DeserializeOwned>(
        &self,
        route: &str,
        args: &A,
        timeout: Duration,
    ) -> Result<T, String> {
        self.post_answered(route, args, timeout)
            .await
            .map_err(|(_, why)| why)
    }

    /// [`Self::post`], with the status of an answer that is not 200.
    async fn post_answered<A: Serialize, T: DeserializeOwned>(
        &self,
        route: &str,
        args: &A,
        timeout: Duration,
    ) -> Result<T, (Option<StatusCode>, String)> {
        use std::sync::atomic::Ordering;
        let body = serde_json::to_vec(args).map_err(|e| (None, e.to_string()))?;
        let first = self.current.load(Ordering::Relaxed);
        let mut answered = None;
        let mut unanswered = Vec::new();
        for k in 0..self.bases.len() {
            let i = (first + k) % self.bases.len();
            let base = &self.bases[i];
            match post_json(
                &self.http,
                base,
                &format!("/control/v1/{route}"),
                &self.credential,
                body.clone(),
                timeout,
                MAX_BODY,
            )
            .await
            {
                // Another server may answer: it shares the state.
                Err(why) => unanswered.push(format!("{base}: {why}")),
                Ok((StatusCode::SERVICE_UNAVAILABLE, _)) if k + 1 < self.bases.len() => {
                    unanswered.push(format!("{base}: answered 503"));
                }
                Ok(answer) => {
                    self.current.store(i, Ordering::Relaxed);
                    answered = Some(answer);
                    break;
                }
            }
        }
        let Some((status, body)) = answered else {
            return Err((None, unanswered.join("; ")));
        };
        if status != StatusCode::OK {
            return Err((
                Some(status),
                format!("answered {status}: {}", refusal_text(&body)),
            ));
        }
        serde_json::from_slice(&body)
            .map_err(|e| (None, format!("an answer that does not parse: {e}")))
    }

    /// A membership call's answer: a refused credential (401) is the control plane's
    /// refusal (the node is not registered there), anything else without an answer is
    /// [`MembershipCallError::Unreachable`].
    async fn membership<A: Serialize, T: DeserializeOwned>(
        &self,
        route: &str,
        args: &A,
    ) -> Result<T, MembershipCallError> {
        self.membership_within(route, args, MEMBERSHIP_TIMEOUT)
            .await
    }

    /// [`Self::membership`], each server given at most `timeout`.
    async fn membership_within<A: Serialize, T: DeserializeOwned>(
        &self,
        route: &str,
        args: &A,
        timeout: Duration,
    ) -> Result<T, MembershipCallError> {
        match self
            .post_answered::<_, MembershipAnswer<T>>(route, args, timeout)
            .await
        {
            Ok(answer) => answer.map_err(MembershipCallError::Refused),
            Err((Some(StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN), why)) => {
                Err(MembershipCallError::Refused(MembershipError::Refused(why)))
            }
            Err((_, why)) => Err(MembershipCallError::Unreachable(why)),
        }
    }

    /// An egress operation the control plane did not answer.
    fn unavailable(&self, route: &str, why: String) -> EgressApiError {
        tracing::warn!(control = %self.bases.join(","), route, error = %why, "the control plane did not answer");
        EgressApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            code: "SANDBOX::CONTROL_PLANE_UNAVAILABLE",
            message: format!("the control plane did not answer: {why}"),
        }
    }

    fn cached(&self, id: &str) -> Option<SandboxAccess> {
        let cached = self.cached.lock().expect("access cache lock");
        let (at, access) = cached.get(id)?;
        (at.elapsed() < self.access_ttl).then(|| access.clone())
    }

    fn keep(&self, id: &str, access: &SandboxAccess) {
        if self.access_ttl.is_zero() {
            return;
        }
        let mut cached = self.cached.lock().expect("access cache lock");
        if cached.len() >= MAX_CACHED {
            cached.retain(|_, (at, _)| at.elapsed() < self.access_ttl);
        }
        if cached.len() >= MAX_CACHED {
            cached.clear();
        }
        cached.insert(id.to_string(), (Instant::now(), access.clone()));
    }
}

#[async_trait]
impl EgressApi for ControlClient {
    async fn policy(&self, id: &str) -> Result<PolicyStatusResponse, EgressApiError> {
        let args = IdArgs { id: id.to_string() };
        match self
            .post::<_, EgressAnswer>("egress/policy", &args, EGRESS_TIMEOUT)
            .await
        {
            Ok(answer) => answer.map_err(Into::into),
            Err(why) => Err(self.unavailable("egress/policy", why)),
        }
    }

    async fn change(
        &self,
        id: &str,
        change: PolicyChange,
        via: &str,
    ) -> Result<PolicyStatusResponse, EgressApiError> {
        let args = ChangeArgs {
            id: id.to_string(),
            change: change.into(),
            via: via.to_string(),
        };
        match self
            .post::<_, EgressAnswer>("egress/change", &args, EGRESS_TIMEOUT)
            .await
        {
            Ok(answer) => answer.map_err(Into::into),
            Err(why) => Err(self.unavailable("egress/change", why)),
        }
    }
}

#[async_trait]
impl AccessApi for ControlClient {
    async fn access(&self, id: &str) -> Option<SandboxAccess> {
        if let Some(access) = self.cached(id) {
            return Some(access);
        }
        let args = IdArgs { id: id.to_string() };
        let answer = match self
            .post::<_, Option<WireAccess>>("access", &args, ACCESS_TIMEOUT)
            .await
        {
            Ok(answer) => answer?,
            Err(why) => {
                // Refused as not running: a port is never opened on a guess.
                tracing::warn!(control = %self.bases.join(","), sandbox = %id, error = %why, "the control plane did not answer an access check");
                return None;
            }
        };
        let access = match answer {
            WireAccess::Open => SandboxAccess::Open,
            WireAccess::Secure(token) => SandboxAccess::Secure(AccessToken::from_recorded(token)),
        };
        self.keep(id, &access);
        Some(access)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_come_back_static_and_strange_ones_do_not() {
        let code = static_code("SANDBOX::NOT_FOUND");
        assert_eq!(code, "SANDBOX::NOT_FOUND");
        assert!(std::ptr::eq(code, static_code("SANDBOX::NOT_FOUND")));
        for strange in ["", "a b", &"X".repeat(65), "é"] {
            assert_eq!(static_code(strange), UNKNOWN_CODE, "{strange:?}");
        }
    }

    #[test]
    fn changes_travel_as_one_tagged_object() {
        let change = PolicyChange::Delete(vec!["example.com".into()]);
        let json = serde_json::to_string(&WireChange::from(change.clone())).unwrap();
        assert_eq!(json, r#"{"delete":["example.com"]}"#);
        let back: WireChange = serde_json::from_str(&json).unwrap();
        assert_eq!(PolicyChange::from(back), change);
        let secure = serde_json::to_string(&Some(WireAccess::Secure("t".into()))).unwrap();
        assert_eq!(secure, r#"{"secure":"t"}"#);
        let open = serde_json::to_string(&Some(WireAccess::Open)).unwrap();
        assert_eq!(open, r#""open""#);
    }
}
