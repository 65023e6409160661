//! Python code contexts: one `python3` per context running the embedded driver
//! (`driver.py`), which keeps a persistent namespace and reports each execution's result,
//! error and count in the trailer after the run's sentinel.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Instant;

use serde::Deserialize;

use super::CodeError;
use crate::process::{self, Launch, Stdio3};
use crate::repl::{Repl, RunEnd};
use crate::sse::{EventTx, StreamEvent};
use crate::state::AppState;

pub const DRIVER: &str = include_str!("driver.py");

/// Starts a driver in `cwd`.
pub fn spawn(state: &AppState, cwd: Option<&str>) -> Result<Repl, CodeError> {
    let ctx = state
        .child_context(&HashMap::new(), cwd, None, None)
        .map_err(|e| CodeError::Invalid(e.to_string()))?;
    let python = process::which("python3", &ctx.env)
        .or_else(|| process::which("python", &ctx.env))
        .ok_or_else(|| CodeError::Unavailable("python3 is not installed in this sandbox".into()))?;
    let child = process::launch(
        &state.reaper,
        Launch {
            program: python.into_os_string(),
            args: vec![
                OsString::from("-u"),
                OsString::from("-c"),
                OsString::from(DRIVER),
            ],
            env: ctx.env,
            cwd: ctx.cwd.map(PathBuf::from),
            user: None,
            stdio: Stdio3::Pipes { stdin: true },
        },
    )
    .map_err(|e| CodeError::Spawn(e.to_string()))?;
    Repl::new(child, true).map_err(|e| CodeError::Spawn(e.to_string()))
}

#[derive(Debug, Deserialize)]
struct Trailer {
    execution_count: u64,
    result: Option<String>,
    error: Option<TrailerError>,
}

#[derive(Debug, Deserialize)]
struct TrailerError {
    ename: String,
    evalue: String,
    #[serde(default)]
    traceback: Vec<String>,
}

/// Executes `code`, streaming output to `tx`; returns the events that close the run.
pub async fn execute(repl: &Repl, code: &str, tx: &EventTx) -> (Vec<StreamEvent>, bool) {
    let started = Instant::now();
    let sentinel = Repl::sentinel();
    let mut request =
        serde_json::to_vec(&serde_json::json!({ "code": code, "sentinel": sentinel }))
            .unwrap_or_default();
    request.push(b'\n');
    match repl.run(&request, &sentinel, tx, None).await {
        RunEnd::Done(trailer) => match serde_json::from_str::<Trailer>(&trailer) {
            Ok(t) => {
                let mut events = vec![StreamEvent::count(t.execution_count)];
                if let Some(r) = t.result {
                    events.push(StreamEvent::result(r));
                }
                events.push(match t.error {
                    Some(e) => StreamEvent::error(&e.ename, e.evalue, e.traceback),
                    None => StreamEvent::complete(started.elapsed()),
                });
                (events, true)
            }
            Err(e) => (
                vec![StreamEvent::error(
                    "RuntimeError",
                    format!("bad driver reply: {e}"),
                    Vec::new(),
                )],
                true,
            ),
        },
        RunEnd::Died(status) => (
            vec![StreamEvent::error(
                "DeadKernelError",
                format!("python exited: {}", status.describe()),
                vec![status.describe()],
            )],
            false,
        ),
        RunEnd::TimedOut => (
            vec![StreamEvent::error(
                "TimeoutError",
                "execution timed out",
                Vec::new(),
            )],
            false,
        ),
    }
}
