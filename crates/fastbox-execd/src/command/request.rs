//! `RunCommandRequest`: parsing and validation into something launchable.
//!
//! Validation happens before the stream starts so that a bad request is a plain
//! `400 {code, message}` rather than a half-open event stream.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::process::{Launch, Stdio3};
use crate::state::AppState;

use super::CommandError;

#[derive(Debug, Default, Deserialize)]
pub struct RunCommandRequest {
    pub command: Option<String>,
    pub argv: Option<Vec<String>>,
    pub cwd: Option<String>,
    #[serde(default)]
    pub background: bool,
    /// Milliseconds.
    pub timeout: Option<u64>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    #[serde(default)]
    pub envs: HashMap<String, String>,
}

/// A validated command, ready to spawn.
pub struct CommandSpec {
    /// What `GET /command/status` reports as `content`.
    pub content: String,
    pub launch: Launch,
    pub background: bool,
    pub timeout: Option<Duration>,
}

impl RunCommandRequest {
    pub fn into_spec(self, state: &AppState) -> Result<CommandSpec, CommandError> {
        let (content, program, args) = match (self.command, self.argv) {
            (Some(_), Some(_)) => {
                return Err(CommandError::Invalid(
                    "command and argv are mutually exclusive".into(),
                ));
            }
            (None, None) => {
                return Err(CommandError::Invalid(
                    "one of command or argv is required".into(),
                ));
            }
            (Some(cmd), None) => {
                if cmd.trim().is_empty() {
                    return Err(CommandError::Invalid("command must not be empty".into()));
                }
                (
                    cmd.clone(),
                    None,
                    vec![OsString::from("-c"), OsString::from(cmd)],
                )
            }
            (None, Some(argv)) => {
                if argv.first().is_none_or(|a| a.is_empty()) {
                    return Err(CommandError::Invalid("argv[0] must be non-empty".into()));
                }
                if argv.iter().any(|a| a.contains('\0')) {
                    return Err(CommandError::Invalid("argv must not contain NUL".into()));
                }
                let program = OsString::from(&argv[0]);
                let args = argv[1..].iter().map(OsString::from).collect();
                (argv.join(" "), Some(program), args)
            }
        };
        if self.gid.is_some() && self.uid.is_none() {
            return Err(CommandError::Invalid("gid requires uid".into()));
        }
        let ctx = state
            .child_context(&self.envs, self.cwd.as_deref(), self.uid, self.gid)
            .map_err(|e| CommandError::Invalid(e.to_string()))?;
        let program = program.unwrap_or_else(|| crate::process::shell(&ctx.env));
        Ok(CommandSpec {
            content,
            launch: Launch {
                program,
                args,
                env: ctx.env,
                cwd: ctx.cwd.map(PathBuf::from),
                user: ctx.user,
                stdio: Stdio3::Pipes { stdin: false },
            },
            background: self.background,
            timeout: self.timeout.filter(|&ms| ms > 0).map(Duration::from_millis),
        })
    }
}
