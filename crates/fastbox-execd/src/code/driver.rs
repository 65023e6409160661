//! Interpreter code contexts: one interpreter per context running an embedded driver
//! (`driver_python.py` under `python3`, `driver_javascript.js` under `node` for javascript
//! and typescript,
//! `driver_sql.py` under `python3` against the sandbox's SQLite database), which keeps its
//! state and reports each execution's result, error and count in the trailer after the
//! run's sentinel. Every driver speaks the same protocol.

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

/// An interpreter with an embedded driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Driver {
    Python,
    JavaScript,
    TypeScript,
    Sql,
}

impl Driver {
    /// The driver's source.
    pub fn source(self) -> &'static str {
        match self {
            Driver::Python => include_str!("driver_python.py"),
            Driver::JavaScript | Driver::TypeScript => include_str!("driver_javascript.js"),
            Driver::Sql => include_str!("driver_sql.py"),
        }
    }

    /// The interpreters that run it, the first found on the sandbox's `PATH` wins.
    fn programs(self) -> &'static [&'static str] {
        match self {
            Driver::Python | Driver::Sql => &["python3", "python"],
            Driver::JavaScript | Driver::TypeScript => &["node", "nodejs"],
        }
    }

    /// The arguments that run `source` (unbuffered, for python; in typescript mode for the
    /// javascript driver).
    fn args(self) -> Vec<OsString> {
        let (run, mode): (&[&str], &[&str]) = match self {
            Driver::Python | Driver::Sql => (&["-u", "-c"], &[]),
            Driver::JavaScript => (&["-e"], &[]),
            Driver::TypeScript => (&["-e"], &["typescript"]),
        };
        run.iter()
            .map(OsString::from)
            .chain([OsString::from(self.source())])
            .chain(mode.iter().map(OsString::from))
            .collect()
    }

    fn name(self) -> &'static str {
        match self {
            Driver::Python | Driver::Sql => "python",
            Driver::JavaScript | Driver::TypeScript => "node",
        }
    }
}

/// Starts `driver` in `cwd`.
pub fn spawn(state: &AppState, driver: Driver, cwd: Option<&str>) -> Result<Repl, CodeError> {
    let ctx = state
        .child_context(&HashMap::new(), cwd, None, None)
        .map_err(|e| CodeError::Invalid(e.to_string()))?;
    let program = driver
        .programs()
        .iter()
        .find_map(|p| process::which(p, &ctx.env))
        .ok_or_else(|| {
            CodeError::Unavailable(format!(
                "{} is not installed in this sandbox",
                driver.programs()[0]
            ))
        })?;
    let child = process::launch(
        &state.reaper,
        Launch {
            program: program.into_os_string(),
            args: driver.args(),
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

/// Executes `code` on `driver`'s `repl`, streaming output to `tx`; returns the events that
/// close the run, and whether the interpreter lives on.
pub async fn execute(
    driver: Driver,
    repl: &Repl,
    code: &str,
    tx: &EventTx,
) -> (Vec<StreamEvent>, bool) {
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
                format!("{} exited: {}", driver.name(), status.describe()),
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
