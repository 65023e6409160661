//! The sandbox's entrypoint as a supervised child: `fastbox-execd -- ENTRYPOINT ARGV...` on a
//! cold start, or the `entrypoint` of `POST /fastbox/claim` on a restored clone.
//!
//! It runs in its own process group with the environment every child gets (execd's, the
//! claim's `envs`, `EXECD_ENVS`); its stdout and stderr go to an in-memory ring
//! ([`LogBuffer`]) and, with `--log-dir`, also to `DIR/entrypoint.log`. It is not restarted:
//! when it exits, the sandbox stays reachable and `GET /fastbox/entrypoint/status` says how it
//! ended, `GET /fastbox/entrypoint/logs` what it printed (fastbox extensions, not part of the
//! OpenSandbox API).

use std::collections::HashMap;
use std::ffi::OsString;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderValue, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Serialize;
use tokio::sync::watch;

use crate::clock::rfc3339;
use crate::error::ApiError;
use crate::extract::RequestError;
use crate::logbuf::{DEFAULT_BUDGET, LogBuffer};
use crate::output::{Sink, pump};
use crate::process::{self, Launch, Stdio3};
use crate::query::QueryPairs;
use crate::sse::Stream;
use crate::state::AppState;

pub struct Entrypoint {
    pub argv: Vec<String>,
    pub log: Arc<LogBuffer>,
    state: Mutex<EntrypointState>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct EntrypointState {
    pub configured: bool,
    pub running: bool,
    pub pid: Option<i32>,
    pub exit_code: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub started_at: Option<String>,
    pub finished_at: Option<String>,
    pub argv: Vec<String>,
}

impl Entrypoint {
    pub fn status(&self) -> EntrypointState {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The process group to signal, while it runs.
    pub fn running_pgid(&self) -> Option<i32> {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.running { s.pid } else { None }
    }

    fn update(&self, f: impl FnOnce(&mut EntrypointState)) {
        f(&mut self.state.lock().unwrap_or_else(|e| e.into_inner()));
    }
}

/// Starts `argv` and records it in `state`. Spawn failures are recorded, not fatal: execd must
/// stay up so the failure can be diagnosed. Only the first call is recorded; callers start at
/// most one entrypoint (`main` before serving, a claim only when none was started).
pub fn start(state: &AppState, argv: Vec<String>) -> Arc<Entrypoint> {
    let log = match state.config.log_dir.as_ref().map(|d| {
        std::fs::create_dir_all(d)?;
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(d.join("entrypoint.log"))
    }) {
        Some(Ok(file)) => LogBuffer::with_file(DEFAULT_BUDGET, file),
        Some(Err(e)) => {
            tracing::warn!(error = %e, "cannot open entrypoint log file");
            LogBuffer::new(DEFAULT_BUDGET)
        }
        None => LogBuffer::new(DEFAULT_BUDGET),
    };
    let ep = Arc::new(Entrypoint {
        argv: argv.clone(),
        log: Arc::new(log),
        state: Mutex::new(EntrypointState {
            configured: true,
            argv: argv.clone(),
            started_at: Some(rfc3339(SystemTime::now())),
            ..EntrypointState::default()
        }),
    });
    let _ = state.entrypoint.set(Arc::clone(&ep));
    let launched = state
        .child_context(&HashMap::new(), None, None, None)
        .map_err(|e| e.to_string())
        .and_then(|ctx| {
            process::launch(
                &state.reaper,
                Launch {
                    program: OsString::from(&argv[0]),
                    args: argv[1..].iter().map(OsString::from).collect(),
                    env: ctx.env,
                    cwd: None,
                    user: None,
                    stdio: Stdio3::Pipes { stdin: false },
                },
            )
            .map_err(|e| e.to_string())
        });
    match launched {
        Err(e) => {
            tracing::error!(error = %e, "entrypoint failed to start");
            ep.update(|s| {
                s.error = Some(e);
                s.finished_at = Some(rfc3339(SystemTime::now()));
            });
        }
        Ok(mut child) => {
            tracing::info!(pid = child.pid, argv = ?argv, "entrypoint started");
            ep.update(|s| {
                s.running = true;
                s.pid = Some(child.pid);
            });
            let ep = Arc::clone(&ep);
            tokio::spawn(async move {
                let sink = Sink::Log(Arc::clone(&ep.log));
                let (exited_tx, exited_rx) = watch::channel(false);
                let pumps = [
                    child.stdout.take().map(|r| {
                        tokio::spawn(pump(r, Stream::Stdout, sink.clone(), exited_rx.clone()))
                    }),
                    child
                        .stderr
                        .take()
                        .map(|r| tokio::spawn(pump(r, Stream::Stderr, sink, exited_rx))),
                ];
                let status = child.exit.await;
                let _ = exited_tx.send(true);
                for p in pumps.into_iter().flatten() {
                    let _ = p.await;
                }
                tracing::info!(code = status.code(), "entrypoint exited");
                ep.update(|s| {
                    s.running = false;
                    s.exit_code = Some(status.code());
                    s.finished_at = Some(rfc3339(SystemTime::now()));
                    if !status.success() {
                        s.error = Some(status.describe());
                    }
                });
            });
        }
    }
    ep
}

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/fastbox/entrypoint/status", get(entrypoint_status))
        .route("/fastbox/entrypoint/logs", get(entrypoint_logs))
}

async fn entrypoint_status(State(state): State<AppState>) -> Response {
    let status = state
        .entrypoint
        .get()
        .map(|e| e.status())
        .unwrap_or_default();
    axum::Json(status).into_response()
}

/// The entrypoint's output from line `cursor` on, with the next cursor in
/// `EXECD-COMMANDS-TAIL-CURSOR` as for background commands.
async fn entrypoint_logs(State(state): State<AppState>, uri: Uri) -> Result<Response, ApiError> {
    let q = QueryPairs::from_uri(&uri);
    let cursor = match q.get("cursor").filter(|s| !s.is_empty()) {
        None => 0,
        Some(c) => c.parse().map_err(|_| RequestError::BadQuery {
            name: "cursor",
            value: c.to_string(),
        })?,
    };
    let (text, next) = state
        .entrypoint
        .get()
        .map(|e| e.log.read_from(cursor))
        .unwrap_or_default();
    let mut resp = text.into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp.headers_mut()
        .insert(crate::command::TAIL_CURSOR_HEADER, HeaderValue::from(next));
    Ok(resp)
}
