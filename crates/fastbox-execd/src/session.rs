//! Bash sessions (`/session`): a shell that keeps its working directory and exported variables
//! across runs. Each run streams the same events as `/command`; `init` carries the session id.
//! If the shell exits (`exit 3`) or a run times out, that run ends with the `CommandExecError`
//! for its status and the next run starts a fresh shell in the session's original directory.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, post};
use serde::Deserialize;

use crate::error::ApiError;
use crate::extract::{JsonBody, OptionalJson};
use crate::ids;
use crate::process::{self, Launch, LaunchError, Stdio3};
use crate::reaper::ExitStatus;
use crate::repl::{Repl, RunEnd, shell_script};
use crate::sse::{self, StreamEvent};
use crate::state::AppState;

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("session {0} not found")]
    NotFound(String),
    #[error("invalid session request: {0}")]
    Invalid(String),
    #[error("cannot start shell: {0}")]
    Spawn(#[from] LaunchError),
}

pub struct Session {
    pub id: String,
    shell: ShellSlot,
}

#[derive(Default)]
pub struct SessionStore {
    map: Mutex<HashMap<String, Arc<Session>>>,
}

impl SessionStore {
    fn get(&self, id: &str) -> Option<Arc<Session>> {
        self.map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()
    }
}

/// Starts a persistent shell (bash without rc files, or `sh`) in `cwd`.
pub fn spawn_shell(
    state: &AppState,
    cwd: Option<&str>,
    keep_terminators: bool,
) -> Result<Repl, SessionError> {
    let ctx = state
        .child_context(&HashMap::new(), cwd, None, None)
        .map_err(|e| SessionError::Invalid(e.to_string()))?;
    let program = process::shell(&ctx.env);
    let args = if program.to_string_lossy().ends_with("bash") {
        vec![OsString::from("--noprofile"), OsString::from("--norc")]
    } else {
        Vec::new()
    };
    let child = process::launch(
        &state.reaper,
        Launch {
            program,
            args,
            env: ctx.env,
            cwd: ctx.cwd.map(PathBuf::from),
            user: None,
            stdio: Stdio3::Pipes { stdin: true },
        },
    )?;
    Ok(Repl::new(child, keep_terminators)?)
}

/// A persistent shell that is (re)started on demand: the state behind a session or a bash
/// code context.
pub struct ShellSlot {
    /// Where a new shell starts.
    home_cwd: Option<String>,
    /// Code contexts keep line terminators, sessions strip them.
    keep_terminators: bool,
    shell: tokio::sync::Mutex<Option<Repl>>,
    /// Process group of the current shell, for killing it while a run holds the lock.
    pgid: AtomicI32,
}

impl ShellSlot {
    pub fn new(home_cwd: Option<String>, keep_terminators: bool) -> Self {
        ShellSlot {
            home_cwd,
            keep_terminators,
            shell: tokio::sync::Mutex::new(None),
            pgid: AtomicI32::new(0),
        }
    }

    /// Starts the shell now so that a bad directory or a missing shell is reported at creation.
    pub async fn start(&self, state: &AppState) -> Result<(), SessionError> {
        let repl = spawn_shell(state, self.home_cwd.as_deref(), self.keep_terminators)?;
        self.pgid.store(repl.pid, Ordering::SeqCst);
        *self.shell.lock().await = Some(repl);
        Ok(())
    }

    /// Runs one command, replacing the shell first if it has died; streams output to `tx` and
    /// returns the terminal event.
    pub async fn run(
        &self,
        state: &AppState,
        command: &str,
        cwd: Option<&str>,
        timeout: Option<Duration>,
        tx: &sse::EventTx,
    ) -> StreamEvent {
        let started = Instant::now();
        let mut guard = self.shell.lock().await;
        if !guard.as_ref().is_some_and(Repl::is_alive) {
            match spawn_shell(state, self.home_cwd.as_deref(), self.keep_terminators) {
                Ok(r) => {
                    self.pgid.store(r.pid, Ordering::SeqCst);
                    *guard = Some(r);
                }
                Err(e) => {
                    return StreamEvent::error(
                        "CommandExecError",
                        e.to_string(),
                        vec![e.to_string()],
                    );
                }
            }
        }
        let Some(shell) = guard.as_ref() else {
            return StreamEvent::error("CommandExecError", "no shell", Vec::new());
        };
        let sentinel = Repl::sentinel();
        let script = shell_script(command, cwd, &sentinel);
        match shell.run(script.as_bytes(), &sentinel, tx, timeout).await {
            RunEnd::Done(trailer) => {
                let code = trailer.parse::<i32>().unwrap_or(-1);
                StreamEvent::finished(ExitStatus::Exited(code), started.elapsed())
            }
            RunEnd::Died(status) => {
                *guard = None;
                StreamEvent::exit_error(status)
            }
            RunEnd::TimedOut => {
                *guard = None;
                StreamEvent::error(
                    "CommandExecError",
                    (128 + libc::SIGKILL).to_string(),
                    vec!["timeout: signal: killed".to_string()],
                )
            }
        }
    }

    /// Kills the shell and everything it started, even in the middle of a run.
    pub fn kill(&self) {
        crate::process::signal_group(
            self.pgid.load(Ordering::SeqCst),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/session", post(create_session))
        .route("/session/{id}/run", post(run_in_session))
        .route("/session/{id}", delete(delete_session))
}

#[derive(Debug, Default, Deserialize)]
struct CreateSessionRequest {
    cwd: Option<String>,
}

async fn create_session(
    State(state): State<AppState>,
    OptionalJson(req): OptionalJson<CreateSessionRequest>,
) -> Result<Response, ApiError> {
    let cwd = req.cwd.filter(|c| !c.is_empty());
    let id = ids::uuid_v4();
    let session = Arc::new(Session {
        id: id.clone(),
        shell: ShellSlot::new(cwd, false),
    });
    session.shell.start(&state).await?;
    state
        .sessions
        .map
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(id.clone(), session);
    Ok(axum::Json(serde_json::json!({ "session_id": id })).into_response())
}

#[derive(Debug, Deserialize)]
struct RunInSessionRequest {
    command: String,
    cwd: Option<String>,
    /// Milliseconds.
    timeout: Option<u64>,
}

async fn run_in_session(
    State(state): State<AppState>,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<RunInSessionRequest>,
) -> Result<Response, ApiError> {
    let session = state
        .sessions
        .get(&id)
        .ok_or_else(|| SessionError::NotFound(id.clone()))?;
    if req.command.trim().is_empty() {
        return Err(SessionError::Invalid("command must not be empty".into()).into());
    }
    let (tx, rx) = sse::channel();
    tx.send(StreamEvent::init(&id)).await;
    tokio::spawn(async move {
        let end = session
            .shell
            .run(
                &state,
                &req.command,
                req.cwd.as_deref().filter(|c| !c.is_empty()),
                req.timeout.filter(|&t| t > 0).map(Duration::from_millis),
                &tx,
            )
            .await;
        tx.send(end).await;
    });
    Ok(sse::response(rx))
}

async fn delete_session(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<(), ApiError> {
    let session = state
        .sessions
        .map
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&id)
        .ok_or(SessionError::NotFound(id))?;
    session.shell.kill();
    Ok(())
}
