//! Interpreter code contexts: one interpreter per context running an embedded driver
//! (`driver_python.py` under `python3`, `driver_javascript.js` under `node` for javascript
//! and typescript,
//! `driver_sql.py` under `python3` against the sandbox's SQLite database, `driver_go.py`
//! under `python3`, building and running each cell with `go run`, `driver_java.java` under
//! `java`, a JShell per context), which keeps its
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
use crate::state::{AppState, ChildContext};

/// An interpreter with an embedded driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Driver {
    Python,
    JavaScript,
    TypeScript,
    Sql,
    Go,
    Java,
}

impl Driver {
    /// The driver's source (the Python-run ones after their shared request loop).
    pub fn source(self) -> String {
        const LOOP: &str = include_str!("driver_loop.py");
        match self {
            Driver::Python => [LOOP, include_str!("driver_python.py")].concat(),
            Driver::Sql => [LOOP, include_str!("driver_sql.py")].concat(),
            Driver::Go => [LOOP, include_str!("driver_go.py")].concat(),
            Driver::JavaScript | Driver::TypeScript => include_str!("driver_javascript.js").into(),
            Driver::Java => include_str!("driver_java.java").into(),
        }
    }

    /// The interpreters that run it, the first found on the sandbox's `PATH` wins.
    fn programs(self) -> &'static [&'static str] {
        match self {
            Driver::Python | Driver::Sql | Driver::Go => &["python3", "python"],
            Driver::JavaScript | Driver::TypeScript => &["node", "nodejs"],
            Driver::Java => &["java"],
        }
    }

    /// The arguments that run `source` (unbuffered, for python; in typescript mode for the
    /// javascript driver). Java runs a source file: written here into a directory of its own,
    /// which the driver removes as it starts.
    fn args(self) -> std::io::Result<Vec<OsString>> {
        let (run, mode): (&[&str], &[&str]) = match self {
            Driver::Python | Driver::Sql | Driver::Go => (&["-u", "-c"], &[]),
            Driver::JavaScript => (&["-e"], &[]),
            Driver::TypeScript => (&["-e"], &["typescript"]),
            Driver::Java => {
                let file = java_source_file(&self.source())?;
                return Ok(vec![file.clone().into_os_string(), file.into_os_string()]);
            }
        };
        Ok(run
            .iter()
            .map(OsString::from)
            .chain([OsString::from(self.source())])
            .chain(mode.iter().map(OsString::from))
            .collect())
    }

    pub fn name(self) -> &'static str {
        match self {
            Driver::Python | Driver::Sql | Driver::Go => "python",
            Driver::JavaScript | Driver::TypeScript => "node",
            Driver::Java => "java",
        }
    }
}

/// The environment and directory a driver started now in `cwd` gets.
pub fn context(state: &AppState, cwd: Option<&str>) -> Result<ChildContext, CodeError> {
    state
        .child_context(&HashMap::new(), cwd, None, None)
        .map_err(|e| CodeError::Invalid(e.to_string()))
}

/// Starts `driver` with `ctx` ([`context`]).
pub fn spawn(state: &AppState, driver: Driver, ctx: ChildContext) -> Result<Repl, CodeError> {
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
            args: driver
                .args()
                .map_err(|e| CodeError::Spawn(format!("the {} driver: {e}", driver.name())))?,
            env: ctx.env,
            cwd: ctx.cwd.map(PathBuf::from),
            user: None,
            stdio: Stdio3::Pipes { stdin: true },
        },
    )
    .map_err(|e| CodeError::Spawn(e.to_string()))?;
    Repl::new(child, true).map_err(|e| CodeError::Spawn(e.to_string()))
}

/// Hands a running driver to a context: its environment and directory become `env` and
/// `cwd` (the drivers' `adopt` request; nothing runs and no execution is counted).
pub async fn adopt(repl: &Repl, env: &crate::env::EnvList, cwd: Option<&str>) -> bool {
    let sentinel = Repl::sentinel();
    let env: serde_json::Map<String, serde_json::Value> = env
        .iter()
        .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
        .collect();
    let mut request = serde_json::to_vec(&serde_json::json!({
        "adopt": {"env": env, "cwd": cwd},
        "sentinel": sentinel,
    }))
    .unwrap_or_default();
    request.push(b'\n');
    // Nothing is read from the events: sends fail at once instead of filling the channel.
    let (tx, _) = crate::sse::channel();
    let patience = Some(std::time::Duration::from_secs(30));
    match repl.run(&request, &sentinel, &tx, patience).await {
        RunEnd::Done(trailer) => serde_json::from_str::<serde_json::Value>(&trailer)
            .is_ok_and(|t| t.get("error").is_none()),
        _ => false,
    }
}

/// Writes the java driver's source as `FastboxJavaDriver.java` (the name its class needs) in
/// a new directory only root can enter, under the sandbox's temporary directory.
fn java_source_file(source: &str) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let dir = std::env::temp_dir().join(format!(
        "fastbox-java-driver-{}",
        crate::ids::random_hex(16)
    ));
    std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
    let file = dir.join("FastboxJavaDriver.java");
    std::fs::write(&file, source)?;
    Ok(file)
}

#[derive(Debug, Deserialize)]
struct Trailer {
    execution_count: u64,
    /// What the run displayed (python: `display()` calls, figures), MIME type to data, in
    /// order; before `result`.
    #[serde(default)]
    displays: Vec<std::collections::BTreeMap<String, String>>,
    /// The last expression's value as text.
    result: Option<String>,
    /// Its other representations (`text/html`, `image/png`, ...), when it has any.
    #[serde(default)]
    result_bundle: Option<std::collections::BTreeMap<String, String>>,
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
                events.extend(t.displays.into_iter().map(StreamEvent::result_bundle));
                match (t.result_bundle, t.result) {
                    (Some(bundle), _) => events.push(StreamEvent::result_bundle(bundle)),
                    (None, Some(r)) => events.push(StreamEvent::result(r)),
                    (None, None) => {}
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
