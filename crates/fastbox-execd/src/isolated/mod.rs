//! Isolated sessions (`/v1/isolated`): namespaces inside the sandbox, each with its own view
//! of the sandbox's files, its own processes, and (unless shared) its own network.
//!
//! Offered only when execd runs with `--isolation` (a sandbox created with the extension
//! `bootstrap.execd.isolation=enable`, started with the seccomp variant that lets execd build
//! namespaces). [`build`] makes a session and starts a second execd in it, serving on a Unix
//! socket; every run and file route of the session is that execd's own `/command`, `/files`
//! and `/directories`, reached through [`upstream`]. So a session's processes and file
//! operations run with the session's view, uid and capabilities, under the default seccomp
//! filter, and a path in a file request is resolved inside the session's root by the kernel.
//!
//! The sessions' sockets are in [`SOCKET_DIR`] (root only, and covered in every session by
//! its own `/run`), so no session can reach another's execd, nor take a dead one's name.

pub mod build;
pub mod request;
pub mod upstream;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use futures::StreamExt;
use http_body_util::BodyExt;
use serde::{Deserialize, Serialize};

use crate::clock::rfc3339;
use crate::error::ApiError;
use crate::extract::JsonBody;
use crate::ids;
use crate::state::AppState;
use request::{CreateRequest, Layout};
use upstream::Upstream;

/// Sessions one sandbox may hold at once.
const MAX_SESSIONS: usize = 64;
/// Where the sessions' execd sockets are (a directory only root may enter).
pub const SOCKET_DIR: &str = "/run/fastbox-isolated";
/// How long a new session's execd has to answer.
const START_PATIENCE: Duration = Duration::from_secs(10);
/// How often idle sessions are looked for.
const IDLE_SWEEP: Duration = Duration::from_secs(2);
/// The header the session's execd names its log cursor with, and the one the isolated API
/// uses.
const COMMAND_CURSOR: &str = "EXECD-COMMANDS-TAIL-CURSOR";
const ISOLATED_CURSOR: &str = "EXECD-ISOLATED-TAIL-CURSOR";

#[derive(Debug, thiserror::Error)]
pub enum IsolatedError {
    #[error("invalid isolated session request: {0}")]
    Invalid(String),
    #[error("{0}")]
    Unsupported(String),
    #[error("isolated session {0} not found")]
    NotFound(String),
    #[error("isolated session {0} has ended (its processes are gone); delete it")]
    Ended(String),
    #[error("run {0} not found in this session")]
    RunNotFound(String),
    #[error("this sandbox already holds {MAX_SESSIONS} isolated sessions")]
    TooMany,
    #[error("cannot build the isolated session: {0}")]
    Setup(String),
    #[error("the isolated session's execd: {0}")]
    Upstream(String),
}

/// One session.
pub struct IsolatedSession {
    pub id: String,
    created_at: SystemTime,
    echo: CreateRequest,
    idle_timeout: Option<Duration>,
    upstream: Upstream,
    /// The session's keeper: its death kills the session's init.
    keeper: std::os::fd::OwnedFd,
    activity: Mutex<Activity>,
}

struct Activity {
    last_run_at: SystemTime,
    last_touch: Instant,
    /// Requests being served (a foreground run's stream counts until it ends).
    in_flight: usize,
    /// Background runs not yet seen finished.
    background: Vec<String>,
    dead: bool,
}

/// Counts a request against the session's activity until dropped.
struct Busy(Arc<IsolatedSession>);

impl Drop for Busy {
    fn drop(&mut self) {
        let mut a = self.0.lock();
        a.in_flight = a.in_flight.saturating_sub(1);
        a.last_touch = Instant::now();
    }
}

impl IsolatedSession {
    fn lock(&self) -> std::sync::MutexGuard<'_, Activity> {
        self.activity.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn busy(self: &Arc<Self>) -> Busy {
        let mut a = self.lock();
        a.in_flight += 1;
        a.last_touch = Instant::now();
        Busy(self.clone())
    }

    fn status(&self) -> &'static str {
        if self.lock().dead { "dead" } else { "active" }
    }

    fn idle_remaining(&self) -> Option<i64> {
        let idle = self.idle_timeout?;
        let a = self.lock();
        if a.in_flight > 0 || !a.background.is_empty() {
            return Some(idle.as_secs() as i64);
        }
        Some(idle.saturating_sub(a.last_touch.elapsed()).as_secs() as i64)
    }

    fn summary(&self) -> serde_json::Value {
        serde_json::json!({
            "session_id": self.id,
            "status": self.status(),
            "created_at": rfc3339(self.created_at),
            "last_run_at": rfc3339(self.lock().last_run_at),
            "idle_remaining_seconds": self.idle_remaining(),
        })
    }

    fn state(&self) -> serde_json::Value {
        let mut v = self.summary();
        if let (Some(map), Ok(serde_json::Value::Object(echo))) =
            (v.as_object_mut(), serde_json::to_value(&self.echo))
        {
            map.extend(echo);
        }
        v
    }

    /// Ends the session: its keeper, whose death kills the init and with it everything in
    /// its pid namespace. Through a pidfd: never another process that reused a pid.
    fn kill(&self) {
        build::kill(&self.keeper);
    }
}

pub struct IsolatedStore {
    map: Mutex<HashMap<String, Arc<IsolatedSession>>>,
    /// Sessions being built (counted against [`MAX_SESSIONS`]).
    starting: AtomicUsize,
    sweeper: Once,
}

impl Default for IsolatedStore {
    fn default() -> Self {
        Self {
            map: Mutex::default(),
            starting: AtomicUsize::new(0),
            sweeper: Once::new(),
        }
    }
}

/// A place among [`MAX_SESSIONS`] held while a session is built.
struct Reservation(AppState);

impl Drop for Reservation {
    fn drop(&mut self) {
        self.0.isolated.starting.fetch_sub(1, Ordering::SeqCst);
    }
}

impl IsolatedStore {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<IsolatedSession>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn get(&self, id: &str) -> Result<Arc<IsolatedSession>, IsolatedError> {
        self.map()
            .get(id)
            .cloned()
            .ok_or_else(|| IsolatedError::NotFound(id.to_string()))
    }

    /// A session whose processes still run (runs and files go to it).
    fn live_session(&self, id: &str) -> Result<Arc<IsolatedSession>, IsolatedError> {
        let session = self.get(id)?;
        if session.lock().dead {
            return Err(IsolatedError::Ended(id.to_string()));
        }
        Ok(session)
    }

    /// Holds a place for a new session, or says there is none.
    fn reserve(&self, state: &AppState) -> Result<Reservation, IsolatedError> {
        let map = self.map();
        let live = map.values().filter(|s| !s.lock().dead).count();
        if live + self.starting.load(Ordering::SeqCst) >= MAX_SESSIONS {
            return Err(IsolatedError::TooMany);
        }
        self.starting.fetch_add(1, Ordering::SeqCst);
        Ok(Reservation(state.clone()))
    }
}

/// The `/v1/isolated` routes of a sandbox offering sessions.
pub fn routes() -> Router<AppState> {
    let session = "/v1/isolated/session/{id}";
    Router::new()
        .route("/v1/isolated/capabilities", get(capabilities))
        .route("/v1/isolated/session", post(create))
        .route("/v1/isolated/sessions", get(list))
        .route(session, get(state_of).delete(remove))
        .route(&format!("{session}/run"), post(run))
        .route(&format!("{session}/runs/{{run}}"), get(run_status))
        .route(&format!("{session}/runs/{{run}}/logs"), get(run_logs))
        .route(&format!("{session}/diff"), any(not_offered))
        .route(&format!("{session}/commit"), any(not_offered))
        .route(&format!("{session}/files"), any(forward_files))
        .route(&format!("{session}/files/{{*rest}}"), any(forward_files))
        .route(&format!("{session}/directories"), any(forward_files))
        .route(
            &format!("{session}/directories/{{*rest}}"),
            any(forward_files),
        )
}

async fn capabilities() -> axum::Json<serde_json::Value> {
    axum::Json(serde_json::json!({
        "available": true,
        "isolator": "fastbox",
        "version": env!("CARGO_PKG_VERSION"),
        "setpriv_available": true,
        "userns_available": true,
        "commit_supported": false,
        "diff_supported": false,
        "hardening": {
            "init_mode": "pid1",
            "signal_shield": true,
            "cap_drop": {"state": "active"},
            "seccomp": {"state": "active"},
            "landlock": {"state": "unsupported", "message": "not used: the session's root is its own mount namespace"},
            "ebpf": {"state": "unsupported", "message": "not used"},
        },
    }))
}

async fn not_offered(uri: Uri) -> ApiError {
    IsolatedError::Unsupported(format!(
        "{}: diff and commit are not supported (a session's overlay changes stay in its memory)",
        uri.path()
    ))
    .into()
}

async fn create(
    State(state): State<AppState>,
    JsonBody(req): JsonBody<CreateRequest>,
) -> Result<Response, ApiError> {
    let accounts = crate::identity::Accounts::system();
    let layout = req.into_layout(|uid| accounts.user_by_uid(uid).map(|u| u.gid))?;
    let reservation = state.isolated.reserve(&state)?;
    // Built in a task of its own: a client that goes away mid-create leaves a session that
    // is listed (and can be deleted), never one nothing knows of.
    let session = tokio::spawn(start(state.clone(), layout, reservation))
        .await
        .map_err(|e| IsolatedError::Setup(e.to_string()))??;
    let mut body = session.state();
    if let Some(map) = body.as_object_mut() {
        map.retain(|k, _| {
            !matches!(
                k.as_str(),
                "status" | "last_run_at" | "idle_remaining_seconds"
            )
        });
    }
    Ok((StatusCode::CREATED, axum::Json(body)).into_response())
}

/// Builds a session, waits for its execd and lists it.
async fn start(
    state: AppState,
    layout: Layout,
    _reservation: Reservation,
) -> Result<Arc<IsolatedSession>, IsolatedError> {
    let id = ids::uuid_v4();
    let upstream = Upstream {
        socket: socket_path(&id)?,
        token: ids::random_hex(32),
    };
    let listener = std::os::unix::net::UnixListener::bind(&upstream.socket)
        .map_err(|e| IsolatedError::Setup(format!("{}: {e}", upstream.socket.display())))?;
    let exec = session_exec(&state, &layout, &upstream, listener.into())?;
    let built = {
        let (state, layout) = (state.clone(), layout.clone());
        tokio::task::spawn_blocking(move || build::build(&state.reaper, &layout, exec))
            .await
            .map_err(|e| IsolatedError::Setup(e.to_string()))
            .and_then(|built| built)
    };
    let built = match built {
        Ok(built) => built,
        Err(e) => {
            let _ = std::fs::remove_file(&upstream.socket);
            return Err(e);
        }
    };
    let now = SystemTime::now();
    let session = Arc::new(IsolatedSession {
        id: id.clone(),
        created_at: now,
        echo: layout.echo.clone(),
        idle_timeout: layout.idle_timeout,
        upstream,
        keeper: built.keeper,
        activity: Mutex::new(Activity {
            last_run_at: now,
            last_touch: Instant::now(),
            in_flight: 0,
            background: Vec::new(),
            dead: false,
        }),
    });
    {
        let session = session.clone();
        let ended = built.ended;
        tokio::spawn(async move {
            let status = ended.await;
            tracing::info!(session = %session.id, ?status, "isolated session ended");
            session.lock().dead = true;
            let _ = std::fs::remove_file(&session.upstream.socket);
        });
    }
    if let Err(e) = session.upstream.wait_serving(START_PATIENCE).await {
        session.kill();
        return Err(e);
    }
    state.isolated.map().insert(id.clone(), session.clone());
    state.isolated.sweeper.call_once(|| {
        tokio::spawn(sweep_idle(state.clone()));
    });
    tracing::info!(session = %id, "isolated session created");
    Ok(session)
}

/// The socket of session `id`, in [`SOCKET_DIR`] (made, root only, when missing).
fn socket_path(id: &str) -> Result<std::path::PathBuf, IsolatedError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let dir = std::path::Path::new(SOCKET_DIR);
    let setup = |e: std::io::Error| IsolatedError::Setup(format!("{SOCKET_DIR}: {e}"));
    match std::fs::symlink_metadata(dir) {
        Ok(m) if m.is_dir() => {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(setup)?
        }
        Ok(_) => {
            return Err(IsolatedError::Setup(format!(
                "{SOCKET_DIR} is not a directory"
            )));
        }
        Err(_) => std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(setup)?,
    }
    Ok(dir.join(format!("{id}.sock")))
}

/// The session's execd: argv, environment (the sandbox's, filtered as asked, and the
/// session's token), working directory and listening socket.
fn session_exec(
    state: &AppState,
    layout: &Layout,
    upstream: &Upstream,
    listener: std::os::fd::OwnedFd,
) -> Result<build::Exec, IsolatedError> {
    let c = |s: &str| {
        std::ffi::CString::new(s).map_err(|_| IsolatedError::Invalid(format!("NUL byte in {s:?}")))
    };
    let ctx = state
        .child_context(&HashMap::new(), None, None, None)
        .map_err(|e| IsolatedError::Invalid(e.to_string()))?;
    let mut env: Vec<(String, String)> = ctx.env;
    if let Some(pass) = &layout.env_passthrough {
        let listed = |k: &str| pass.keys.iter().any(|p| p == k);
        match pass.mode.as_str() {
            "allow" => env.retain(|(k, _)| listed(k) || k == "PATH"),
            _ => env.retain(|(k, _)| !listed(k)),
        }
    }
    env.retain(|(k, _)| k != "EXECD_ACCESS_TOKEN");
    let mut env: Vec<std::ffi::CString> = env
        .iter()
        .map(|(k, v)| c(&format!("{k}={v}")))
        .collect::<Result<_, _>>()?;
    env.push(c(&format!("EXECD_ACCESS_TOKEN={}", upstream.token))?);
    Ok(build::Exec {
        argv: ["fastbox-execd", "--listen-fd", "3", "--code-port", "0"]
            .iter()
            .map(|a| c(a))
            .collect::<Result<_, _>>()?,
        env,
        cwd: c(&layout.shown[0].dest)?,
        listener,
    })
}

async fn list(State(state): State<AppState>) -> axum::Json<serde_json::Value> {
    let mut sessions: Vec<Arc<IsolatedSession>> = state.isolated.map().values().cloned().collect();
    sessions.sort_by_key(|s| s.created_at);
    axum::Json(serde_json::json!({
        "sessions": sessions.iter().map(|s| s.summary()).collect::<Vec<_>>(),
    }))
}

async fn state_of(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<axum::Json<serde_json::Value>, ApiError> {
    Ok(axum::Json(state.isolated.get(&id)?.state()))
}

async fn remove(State(state): State<AppState>, Path(id): Path<String>) -> Result<(), ApiError> {
    let session = state
        .isolated
        .map()
        .remove(&id)
        .ok_or(IsolatedError::NotFound(id))?;
    end(&session).await;
    Ok(())
}

/// Kills the session and waits (briefly) until it is gone.
async fn end(session: &IsolatedSession) {
    session.kill();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !session.lock().dead && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tracing::info!(session = %session.id, "isolated session deleted");
}

#[derive(Debug, Deserialize)]
struct RunRequest {
    code: String,
    #[serde(default)]
    envs: HashMap<String, String>,
    timeout_seconds: Option<u64>,
    #[serde(default)]
    background: bool,
}

#[derive(Serialize)]
struct CommandRequest<'a> {
    command: &'a str,
    envs: &'a HashMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    timeout: Option<u64>,
    background: bool,
}

async fn run(
    State(state): State<AppState>,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<RunRequest>,
) -> Result<Response, ApiError> {
    let session = state.isolated.live_session(&id)?;
    if req.code.trim().is_empty() {
        return Err(IsolatedError::Invalid("code must not be empty".into()).into());
    }
    let busy = session.busy();
    session.lock().last_run_at = SystemTime::now();
    let command = CommandRequest {
        command: &req.code,
        envs: &req.envs,
        timeout: req
            .timeout_seconds
            .filter(|_| !req.background)
            .filter(|&s| s > 0)
            .map(|s| s.saturating_mul(1000)),
        background: req.background,
    };
    let body = serde_json::to_vec(&command).map_err(|e| IsolatedError::Invalid(e.to_string()))?;
    let mut headers = axum::http::HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let resp = session
        .upstream
        .send(Method::POST, "/command", headers, Body::from(body))
        .await?;
    if !resp.status().is_success() || !req.background {
        // The run's event stream, as `/command` streams it; the session counts as busy
        // until the stream ends.
        let (parts, body) = resp.into_parts();
        let stream = body.into_data_stream().map(move |chunk| {
            let _ = &busy;
            chunk
        });
        return Ok(Response::from_parts(parts, Body::from_stream(stream)));
    }
    let run_id = background_id(resp.into_body()).await?;
    session.lock().background.push(run_id.clone());
    Ok((
        StatusCode::ACCEPTED,
        axum::Json(serde_json::json!({
            "session_id": session.id,
            "run_id": run_id,
            "started_at": rfc3339(SystemTime::now()),
        })),
    )
        .into_response())
}

/// The command id in the `init` event of a background run's stream.
async fn background_id(body: hyper::body::Incoming) -> Result<String, IsolatedError> {
    let bytes = Upstream::bytes(body).await?;
    String::from_utf8_lossy(&bytes)
        .split("\n\n")
        .filter_map(|frame| serde_json::from_str::<serde_json::Value>(frame.trim()).ok())
        .find(|v| v["type"] == "init")
        .and_then(|v| v["text"].as_str().map(String::from))
        .ok_or_else(|| IsolatedError::Upstream("the background run reported no id".into()))
}

async fn run_status(
    State(state): State<AppState>,
    Path((id, run)): Path<(String, String)>,
) -> Result<axum::Json<serde_json::Value>, ApiError> {
    let session = state.isolated.live_session(&id)?;
    let _busy = session.busy();
    let (status, v) = session
        .upstream
        .json(Method::GET, &format!("/command/status/{run}"), None)
        .await?;
    if status == StatusCode::NOT_FOUND {
        return Err(IsolatedError::RunNotFound(run).into());
    }
    if v["running"] == false {
        session.lock().background.retain(|r| *r != run);
    }
    Ok(axum::Json(serde_json::json!({
        "session_id": session.id,
        "run_id": run,
        "running": v["running"],
        "exit_code": v["exit_code"],
        "error": v["error"],
        "started_at": v["started_at"],
        "finished_at": v["finished_at"],
    })))
}

async fn run_logs(
    State(state): State<AppState>,
    Path((id, run)): Path<(String, String)>,
    uri: Uri,
) -> Result<Response, ApiError> {
    let session = state.isolated.live_session(&id)?;
    let _busy = session.busy();
    let path = match uri.query() {
        Some(q) => format!("/command/{run}/logs?{q}"),
        None => format!("/command/{run}/logs"),
    };
    let resp = session
        .upstream
        .send(Method::GET, &path, Default::default(), Body::empty())
        .await?;
    if resp.status() == StatusCode::NOT_FOUND {
        return Err(IsolatedError::RunNotFound(run).into());
    }
    let (mut parts, body) = resp.into_parts();
    if let Some(cursor) = parts.headers.remove(COMMAND_CURSOR) {
        parts.headers.insert(ISOLATED_CURSOR, cursor);
    }
    let bytes = Upstream::bytes(body).await?;
    Ok(Response::from_parts(parts, Body::from(bytes)))
}

/// `/files...` and `/directories...` of a session: the session's execd serves them inside
/// the session.
async fn forward_files(
    State(state): State<AppState>,
    Path(params): Path<HashMap<String, String>>,
    req: Request,
) -> Result<Response, ApiError> {
    let id = params.get("id").cloned().unwrap_or_default();
    let session = state.isolated.live_session(&id)?;
    let busy = session.busy();
    let prefix = format!("/v1/isolated/session/{id}");
    let path = req
        .uri()
        .path()
        .strip_prefix(&prefix)
        .unwrap_or("/")
        .to_string();
    let path_and_query = match req.uri().query() {
        Some(q) => format!("{path}?{q}"),
        None => path,
    };
    let (mut parts, body) = req.into_parts();
    crate::proxy::strip_hop_by_hop(&mut parts.headers, false);
    parts.headers.remove(crate::auth::TOKEN_HEADER);
    let resp = session
        .upstream
        .send(parts.method, &path_and_query, parts.headers, body)
        .await?;
    let (mut parts, body) = resp.into_parts();
    crate::proxy::strip_hop_by_hop(&mut parts.headers, false);
    let stream = body.into_data_stream().map(move |chunk| {
        let _ = &busy;
        chunk
    });
    Ok(Response::from_parts(parts, Body::from_stream(stream)))
}

/// Deletes sessions idle longer than their timeout (a run streaming or a background run
/// still running keeps a session busy).
async fn sweep_idle(state: AppState) {
    loop {
        tokio::time::sleep(IDLE_SWEEP).await;
        let sessions: Vec<Arc<IsolatedSession>> = state.isolated.map().values().cloned().collect();
        for session in sessions {
            let Some(idle) = session.idle_timeout else {
                continue;
            };
            let background: Vec<String> = session.lock().background.clone();
            for run in background {
                let finished = matches!(
                    session.upstream.json(Method::GET, &format!("/command/status/{run}"), None).await,
                    Ok((_, v)) if v["running"] != true
                );
                if finished {
                    session.lock().background.retain(|r| *r != run);
                }
            }
            let expired = {
                let a = session.lock();
                a.in_flight == 0 && a.background.is_empty() && a.last_touch.elapsed() >= idle
            };
            if expired {
                tracing::info!(session = %session.id, "isolated session idle, deleting");
                state.isolated.map().remove(&session.id);
                end(&session).await;
            }
        }
    }
}
