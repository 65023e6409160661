//! Code contexts (`/code`): stateful interpreters per context, `python`, `javascript`,
//! `typescript`, `java`, `sql` and `go` (the embedded drivers, see [`driver`]; go keeps no
//! state) and `bash` (a persistent shell, as sessions
//! use). A run without a context id
//! uses the language's default context, created on first use; a run with no context at all is
//! a plain shell command. Streams carry `init` (the context id), output with line terminators
//! kept (as Jupyter streams them), `execution_count`, `result`, then `execution_complete` or
//! `error`.

pub mod driver;
pub mod warm;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{Path, State};
use axum::http::Uri;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};

use crate::command::request::RunCommandRequest;
use crate::error::ApiError;
use crate::extract::{JsonBody, OptionalJson, RequestError};
use crate::ids;
use crate::query::QueryPairs;
use crate::repl::Repl;
use crate::session::ShellSlot;
use crate::sse::{self, StreamEvent};
use crate::state::AppState;
use driver::Driver;

#[derive(Debug, thiserror::Error)]
pub enum CodeError {
    #[error("context {0} not found")]
    NotFound(String),
    #[error(
        "language {0:?} is not supported (python, javascript, typescript, java, go, sql, bash)"
    )]
    UnsupportedLanguage(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("invalid code request: {0}")]
    Invalid(String),
    #[error("cannot start interpreter: {0}")]
    Spawn(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Language {
    Python,
    JavaScript,
    TypeScript,
    Sql,
    Go,
    Java,
    Bash,
}

impl Language {
    pub fn parse(s: &str) -> Result<Self, CodeError> {
        match s.to_ascii_lowercase().as_str() {
            "python" | "python3" => Ok(Language::Python),
            "javascript" | "js" | "node" | "nodejs" => Ok(Language::JavaScript),
            "typescript" | "ts" => Ok(Language::TypeScript),
            "sql" => Ok(Language::Sql),
            "go" | "golang" => Ok(Language::Go),
            "java" => Ok(Language::Java),
            "bash" | "shell" | "sh" => Ok(Language::Bash),
            other => Err(CodeError::UnsupportedLanguage(other.to_string())),
        }
    }

    /// The embedded driver that runs the language (None: bash, a persistent shell).
    fn driver(self) -> Option<Driver> {
        match self {
            Language::Python => Some(Driver::Python),
            Language::JavaScript => Some(Driver::JavaScript),
            Language::TypeScript => Some(Driver::TypeScript),
            Language::Sql => Some(Driver::Sql),
            Language::Go => Some(Driver::Go),
            Language::Java => Some(Driver::Java),
            Language::Bash => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Language::Python => "python",
            Language::JavaScript => "javascript",
            Language::TypeScript => "typescript",
            Language::Sql => "sql",
            Language::Go => "go",
            Language::Java => "java",
            Language::Bash => "bash",
        }
    }
}

enum Engine {
    Driver(Driver, tokio::sync::Mutex<Option<Repl>>),
    Bash(ShellSlot),
}

pub struct CodeContext {
    pub id: String,
    pub language: Language,
    cwd: Option<String>,
    engine: Engine,
    /// Executions so far (bash; a driver counts itself).
    runs: AtomicU64,
    /// Pid of the driver's interpreter, for interrupts while a run holds the lock.
    driver_pid: Mutex<Option<i32>>,
}

#[derive(Debug, Serialize)]
struct ContextView {
    id: String,
    language: &'static str,
}

impl CodeContext {
    fn view(&self) -> ContextView {
        ContextView {
            id: self.id.clone(),
            language: self.language.name(),
        }
    }

    /// Interrupts the running execution: SIGINT to a driver (python's KeyboardInterrupt, the
    /// end of a javascript script), or kills the shell (its state is lost, as with a
    /// timeout).
    fn interrupt(&self) {
        match &self.engine {
            Engine::Driver(..) => {
                if let Some(pid) = *self.driver_pid.lock().unwrap_or_else(|e| e.into_inner()) {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGINT,
                    );
                }
            }
            Engine::Bash(shell) => shell.kill(),
        }
    }

    fn kill(&self) {
        match &self.engine {
            Engine::Driver(..) => {
                if let Some(pid) = *self.driver_pid.lock().unwrap_or_else(|e| e.into_inner()) {
                    crate::process::signal_group(pid, nix::sys::signal::Signal::SIGKILL);
                }
            }
            Engine::Bash(shell) => shell.kill(),
        }
    }

    async fn run(&self, state: &AppState, code: &str, tx: &sse::EventTx) -> Vec<StreamEvent> {
        match &self.engine {
            Engine::Driver(driver, slot) => {
                let mut guard = slot.lock().await;
                if !guard.as_ref().is_some_and(Repl::is_alive) {
                    match driver::context(state, self.cwd.as_deref())
                        .and_then(|ctx| driver::spawn(state, *driver, ctx))
                    {
                        Ok(r) => {
                            *self.driver_pid.lock().unwrap_or_else(|e| e.into_inner()) =
                                Some(r.pid);
                            *guard = Some(r);
                        }
                        Err(e) => {
                            return vec![StreamEvent::error(
                                "RuntimeError",
                                e.to_string(),
                                Vec::new(),
                            )];
                        }
                    }
                }
                let Some(repl) = guard.as_ref() else {
                    return Vec::new();
                };
                let (events, alive) = driver::execute(*driver, repl, code, tx).await;
                if !alive {
                    *guard = None;
                }
                events
            }
            Engine::Bash(shell) => {
                let end = shell.run(state, code, None, None, tx).await;
                let n = self.runs.fetch_add(1, Ordering::SeqCst) + 1;
                vec![StreamEvent::count(n), end]
            }
        }
    }
}

#[derive(Default)]
pub struct CodeStore {
    contexts: Mutex<HashMap<String, Arc<CodeContext>>>,
    defaults: Mutex<HashMap<Language, String>>,
    /// Warm interpreters for new contexts ([`warm`]).
    pub spares: warm::Spares,
}

impl CodeStore {
    fn get(&self, id: &str) -> Option<Arc<CodeContext>> {
        self.contexts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()
    }

    fn remove(&self, id: &str) -> Option<Arc<CodeContext>> {
        let ctx = self
            .contexts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id)?;
        self.defaults
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|_, v| v != id);
        ctx.kill();
        Some(ctx)
    }

    fn list(&self, language: Option<Language>) -> Vec<Arc<CodeContext>> {
        let mut v: Vec<_> = self
            .contexts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter(|c| language.is_none_or(|l| c.language == l))
            .cloned()
            .collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    /// Creates a context and starts its interpreter.
    async fn create(
        &self,
        state: &AppState,
        language: Language,
        cwd: Option<String>,
    ) -> Result<Arc<CodeContext>, CodeError> {
        let id = ids::uuid_v4();
        state.code.spares.wanted(state);
        let (engine, pid) = match language.driver() {
            Some(driver) => {
                let ctx = driver::context(state, cwd.as_deref())?;
                let warm = state
                    .code
                    .spares
                    .take(state, driver, &ctx.env, ctx.cwd.as_deref())
                    .await;
                let repl = match warm {
                    Some(repl) => repl,
                    None => driver::spawn(state, driver, ctx)?,
                };
                let pid = repl.pid;
                (
                    Engine::Driver(driver, tokio::sync::Mutex::new(Some(repl))),
                    Some(pid),
                )
            }
            None => {
                let shell = ShellSlot::new(cwd.clone(), true);
                shell
                    .start(state)
                    .await
                    .map_err(|e| CodeError::Spawn(e.to_string()))?;
                (Engine::Bash(shell), None)
            }
        };
        let ctx = Arc::new(CodeContext {
            id: id.clone(),
            language,
            cwd,
            engine,
            runs: AtomicU64::new(0),
            driver_pid: Mutex::new(pid),
        });
        self.contexts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, Arc::clone(&ctx));
        Ok(ctx)
    }

    /// The language's default context, created on first use.
    async fn default_for(
        &self,
        state: &AppState,
        language: Language,
    ) -> Result<Arc<CodeContext>, CodeError> {
        let existing = self
            .defaults
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&language)
            .cloned();
        if let Some(ctx) = existing.and_then(|id| self.get(&id)) {
            return Ok(ctx);
        }
        let ctx = self.create(state, language, None).await?;
        self.defaults
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(language, ctx.id.clone());
        Ok(ctx)
    }
}

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/code", post(run_code).delete(interrupt_code))
        .route("/code/context", post(create_context))
        .route("/code/contexts", get(list_contexts).delete(delete_contexts))
        .route(
            "/code/contexts/{id}",
            get(get_context).delete(delete_context),
        )
}

#[derive(Debug, Default, Deserialize)]
struct CreateContextRequest {
    language: Option<String>,
    cwd: Option<String>,
}

async fn create_context(
    State(state): State<AppState>,
    OptionalJson(req): OptionalJson<CreateContextRequest>,
) -> Result<Response, ApiError> {
    let language = Language::parse(req.language.as_deref().unwrap_or("python"))?;
    let ctx = state
        .code
        .create(&state, language, req.cwd.filter(|c| !c.is_empty()))
        .await?;
    Ok(axum::Json(ctx.view()).into_response())
}

fn language_filter(uri: &Uri) -> Result<Option<Language>, CodeError> {
    QueryPairs::from_uri(uri)
        .get("language")
        .filter(|s| !s.is_empty())
        .map(Language::parse)
        .transpose()
}

async fn list_contexts(State(state): State<AppState>, uri: Uri) -> Result<Response, ApiError> {
    let views: Vec<_> = state
        .code
        .list(language_filter(&uri)?)
        .iter()
        .map(|c| c.view())
        .collect();
    Ok(axum::Json(views).into_response())
}

async fn delete_contexts(State(state): State<AppState>, uri: Uri) -> Result<(), ApiError> {
    let language = language_filter(&uri)?.ok_or(RequestError::MissingQuery("language"))?;
    for ctx in state.code.list(Some(language)) {
        state.code.remove(&ctx.id);
    }
    Ok(())
}

async fn get_context(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let ctx = state.code.get(&id).ok_or(CodeError::NotFound(id))?;
    Ok(axum::Json(ctx.view()).into_response())
}

async fn delete_context(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<(), ApiError> {
    state.code.remove(&id).ok_or(CodeError::NotFound(id))?;
    Ok(())
}

async fn interrupt_code(State(state): State<AppState>, uri: Uri) -> Result<(), ApiError> {
    let q = QueryPairs::from_uri(&uri);
    let id = q
        .get("id")
        .filter(|s| !s.is_empty())
        .ok_or(RequestError::MissingQuery("id"))?;
    let ctx = state
        .code
        .get(id)
        .ok_or_else(|| CodeError::NotFound(id.to_string()))?;
    ctx.interrupt();
    Ok(())
}

#[derive(Debug, Deserialize)]
struct RunCodeRequest {
    code: String,
    context: Option<ContextRef>,
}

#[derive(Debug, Deserialize)]
struct ContextRef {
    id: Option<String>,
    language: Option<String>,
}

async fn run_code(
    State(state): State<AppState>,
    JsonBody(req): JsonBody<RunCodeRequest>,
) -> Result<Response, ApiError> {
    if req.code.trim().is_empty() {
        return Err(CodeError::Invalid("code must not be empty".into()).into());
    }
    let ctx = match &req.context {
        Some(ContextRef { id: Some(id), .. }) if !id.is_empty() => state
            .code
            .get(id)
            .ok_or_else(|| CodeError::NotFound(id.clone()))?,
        Some(ContextRef {
            language: Some(lang),
            ..
        }) if !lang.is_empty() && lang != "command" => {
            state
                .code
                .default_for(&state, Language::parse(lang)?)
                .await?
        }
        _ => {
            // No context: a one-shot shell command, as the reference execd does.
            let spec = RunCommandRequest {
                command: Some(req.code),
                ..RunCommandRequest::default()
            }
            .into_spec(&state)?;
            return Ok(crate::command::runner::run(&state, spec).await);
        }
    };
    let (tx, rx) = sse::channel();
    tx.send(StreamEvent::init(&ctx.id)).await;
    tokio::spawn(async move {
        for event in ctx.run(&state, &req.code, &tx).await {
            tx.send(event).await;
        }
    });
    Ok(sse::response(rx))
}
