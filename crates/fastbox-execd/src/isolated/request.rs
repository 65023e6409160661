//! `CreateIsolatedSessionRequest`: the wire shape, and its validation into a [`Layout`] the
//! builder can mount without further checks.

use std::path::{Component, Path};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::IsolatedError;

/// Longest idle timeout a session may ask for (a week).
const MAX_IDLE_SECS: i64 = 7 * 24 * 3600;

/// Where sessions get their own empty file systems; a workspace or bind may sit below them
/// (its mount point is made there), never on them.
pub const PRIVATE_DIRS: &[&str] = &["/tmp", "/var/tmp", "/run", "/dev/shm"];

/// What no session may mount over or bind from: the session's own kernel interfaces and
/// fastbox's files.
const RESERVED: &[&str] = &["/proc", "/sys", "/dev", "/.fastbox", super::SOCKET_DIR];

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
pub struct CreateRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace: Option<WorkspaceSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlays: Option<Vec<OverlaySpec>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra_writable: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub binds: Option<Vec<BindMount>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_net: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env_passthrough: Option<EnvPassthrough>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid_mode: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_seconds: Option<i64>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct WorkspaceSpec {
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct OverlaySpec {
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persist: Option<bool>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct BindMount {
    pub source: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dest: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readonly: Option<bool>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct EnvPassthrough {
    #[serde(default = "deny")]
    pub mode: String,
    #[serde(default)]
    pub keys: Vec<String>,
}

fn deny() -> String {
    "deny".into()
}

/// How a directory of the sandbox appears in a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The sandbox's directory itself, writable.
    Rw,
    /// A copy-on-write view: writes land in the session's memory and go with it.
    Overlay,
    /// The sandbox's directory, read-only.
    Ro,
}

impl Mode {
    fn parse(given: Option<&str>, default: Mode) -> Result<Mode, IsolatedError> {
        match given {
            None => Ok(default),
            Some("rw") => Ok(Mode::Rw),
            Some("overlay") => Ok(Mode::Overlay),
            Some("ro") => Ok(Mode::Ro),
            Some(other) => Err(invalid(format!(
                "mode must be rw, overlay or ro, not {other:?}"
            ))),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Rw => "rw",
            Mode::Overlay => "overlay",
            Mode::Ro => "ro",
        }
    }
}

/// One directory of the sandbox shown in the session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shown {
    /// Path in the sandbox.
    pub source: String,
    /// Path in the session.
    pub dest: String,
    pub mode: Mode,
}

/// A validated session: what the builder mounts, in order, and who runs in it.
#[derive(Debug, Clone)]
pub struct Layout {
    /// Workspaces first (the first one is the session's working directory), then binds.
    pub shown: Vec<Shown>,
    pub share_net: bool,
    pub uid: u32,
    pub gid: u32,
    pub idle_timeout: Option<Duration>,
    pub env_passthrough: Option<EnvPassthrough>,
    /// The request with its defaults filled in, echoed by `GET /session/{id}`.
    pub echo: CreateRequest,
}

fn invalid(message: impl Into<String>) -> IsolatedError {
    IsolatedError::Invalid(message.into())
}

impl CreateRequest {
    /// Validates the request against this sandbox's file system; `primary_gid` finds a
    /// user's group when only `uid` is given.
    pub fn into_layout(
        self,
        primary_gid: impl Fn(u32) -> Option<u32>,
    ) -> Result<Layout, IsolatedError> {
        let profile = self.profile.clone().unwrap_or_else(|| "strict".into());
        let share_net = match profile.as_str() {
            "strict" => self.share_net.unwrap_or(false),
            "balanced" => self.share_net.unwrap_or(true),
            other => {
                return Err(invalid(format!(
                    "profile must be strict or balanced, not {other:?}"
                )));
            }
        };
        let uid_mode = self.uid_mode.clone().unwrap_or_else(|| "setpriv".into());
        if uid_mode != "setpriv" && uid_mode != "userns" {
            return Err(invalid(format!(
                "uid_mode must be setpriv or userns, not {uid_mode:?}"
            )));
        }
        if self.gid.is_some() && self.uid.is_none() {
            return Err(invalid("gid requires uid"));
        }
        if self.uid == Some(u32::MAX) || self.gid == Some(u32::MAX) {
            return Err(invalid("uid and gid must be below 4294967295"));
        }
        let uid = self.uid.unwrap_or(0);
        let gid = self.gid.or_else(|| primary_gid(uid)).unwrap_or(uid);
        let idle_timeout = match self.idle_timeout_seconds {
            None | Some(0) => None,
            Some(s) if !(1..=MAX_IDLE_SECS).contains(&s) => {
                return Err(invalid(format!(
                    "idle_timeout_seconds must be 0 (none) to {MAX_IDLE_SECS}, not {s}"
                )));
            }
            Some(s) => Some(Duration::from_secs(s as u64)),
        };
        if let Some(env) = &self.env_passthrough
            && env.mode != "allow"
            && env.mode != "deny"
        {
            return Err(invalid(format!(
                "env_passthrough.mode must be allow or deny, not {:?}",
                env.mode
            )));
        }

        let mut workspaces = Vec::new();
        if let Some(w) = &self.workspace {
            workspaces.push((w.path.clone(), Mode::parse(w.mode.as_deref(), Mode::Rw)?));
        }
        for o in self.overlays.iter().flatten() {
            let mode = Mode::parse(o.mode.as_deref(), Mode::Overlay)?;
            match (mode, o.persist) {
                (_, None) | (Mode::Overlay, Some(false)) => {}
                (Mode::Overlay, Some(true)) => {
                    return Err(IsolatedError::Unsupported(format!(
                        "overlay {}: persist=true is not supported (a session's overlay changes are kept in its memory and go with it)",
                        o.path
                    )));
                }
                (_, Some(_)) => {
                    return Err(invalid(format!(
                        "overlay {}: persist applies to mode overlay only",
                        o.path
                    )));
                }
            }
            workspaces.push((o.path.clone(), mode));
        }
        if workspaces.is_empty() {
            return Err(invalid("workspace or overlays is required"));
        }
        let mut shown = Vec::new();
        for (path, mode) in workspaces {
            check_path("workspace", &path)?;
            if !Path::new(&path).is_dir() {
                return Err(invalid(format!(
                    "workspace {path} is not a directory in the sandbox"
                )));
            }
            shown.push(Shown {
                source: path.clone(),
                dest: path,
                mode,
            });
        }
        let binds = self.binds.iter().flatten().map(|b| {
            let mode = match b.readonly {
                Some(true) => Mode::Ro,
                _ => Mode::Rw,
            };
            (b.source.clone(), b.dest.clone(), mode)
        });
        let writable = self
            .extra_writable
            .iter()
            .flatten()
            .map(|p| (p.clone(), None, Mode::Rw));
        for (source, dest, mode) in binds.chain(writable) {
            check_path("bind source", &source)?;
            let dest = dest.unwrap_or_else(|| source.clone());
            check_path("bind destination", &dest)?;
            if std::fs::metadata(&source).is_err() {
                return Err(invalid(format!(
                    "bind source {source} does not exist in the sandbox"
                )));
            }
            shown.push(Shown { source, dest, mode });
        }
        let mut dests: Vec<&str> = shown.iter().map(|s| s.dest.as_str()).collect();
        dests.sort_unstable();
        if let Some(w) = dests.windows(2).find(|w| w[0] == w[1]) {
            return Err(invalid(format!("{} is mounted twice", w[0])));
        }

        let mut echo = self;
        echo.profile = Some(profile);
        echo.share_net = Some(share_net);
        echo.uid = Some(uid);
        echo.gid = Some(gid);
        echo.uid_mode = Some(uid_mode);
        echo.idle_timeout_seconds = Some(idle_timeout.map_or(0, |d| d.as_secs() as i64));
        Ok(Layout {
            shown,
            share_net,
            uid,
            gid,
            idle_timeout,
            env_passthrough: echo.env_passthrough.clone(),
            echo,
        })
    }
}

/// An absolute, normalized path that names no reserved or private directory itself and can
/// travel in an overlay option string.
fn check_path(what: &str, path: &str) -> Result<(), IsolatedError> {
    let bad = |why: &str| Err(invalid(format!("{what} {path:?}: {why}")));
    if !path.starts_with('/') {
        return bad("must be absolute");
    }
    if path.len() > 1024 {
        return bad("is too long");
    }
    if path.contains(['\0', ',', ':', '\\', '\n']) {
        return bad("must not contain NUL, ',', ':', '\\' or a newline");
    }
    let normal = Path::new(path)
        .components()
        .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
    if !normal || path.contains("//") || (path.len() > 1 && path.ends_with('/')) {
        return bad("must be normalized (no '.', '..', '//' or trailing '/')");
    }
    if path == "/" {
        return bad("the root cannot be mounted over");
    }
    let under = |dir: &str| path == dir || path.starts_with(&format!("{dir}/"));
    if RESERVED.iter().any(|d| under(d)) {
        return bad("names a directory the session builds itself");
    }
    if PRIVATE_DIRS.contains(&path) {
        return bad("is the session's own empty directory");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: serde_json::Value) -> Result<Layout, IsolatedError> {
        serde_json::from_value::<CreateRequest>(json)
            .unwrap()
            .into_layout(|_| Some(100))
    }

    #[test]
    fn defaults_are_strict_and_root() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_str().unwrap();
        let l = parse(serde_json::json!({"workspace": {"path": path}})).unwrap();
        assert!(!l.share_net);
        assert_eq!((l.uid, l.gid), (0, 100));
        assert_eq!(l.shown[0].mode, Mode::Rw);
        assert_eq!(l.echo.profile.as_deref(), Some("strict"));
        let l =
            parse(serde_json::json!({"workspace": {"path": path}, "profile": "balanced"})).unwrap();
        assert!(l.share_net);
        let l =
            parse(serde_json::json!({"overlays": [{"path": path}], "uid": 5, "gid": 6})).unwrap();
        assert_eq!(l.shown[0].mode, Mode::Overlay);
        assert_eq!((l.uid, l.gid), (5, 6));
    }

    #[test]
    fn bad_requests_say_why() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_str().unwrap();
        let cases = [
            (serde_json::json!({}), "workspace or overlays"),
            (
                serde_json::json!({"workspace": {"path": "rel"}}),
                "absolute",
            ),
            (
                serde_json::json!({"workspace": {"path": "/a/../b"}}),
                "normalized",
            ),
            (
                serde_json::json!({"workspace": {"path": "/proc/1"}}),
                "builds itself",
            ),
            (
                serde_json::json!({"workspace": {"path": "/tmp"}}),
                "own empty",
            ),
            (serde_json::json!({"workspace": {"path": "/a,b"}}), "','"),
            (
                serde_json::json!({"workspace": {"path": "/nonexistent-dir"}}),
                "not a directory",
            ),
            (
                serde_json::json!({"workspace": {"path": path, "mode": "x"}}),
                "mode must be",
            ),
            (
                serde_json::json!({"workspace": {"path": path}, "profile": "x"}),
                "profile",
            ),
            (
                serde_json::json!({"workspace": {"path": path}, "gid": 1}),
                "gid requires uid",
            ),
            (
                serde_json::json!({"workspace": {"path": path}, "idle_timeout_seconds": -1}),
                "idle_timeout",
            ),
            (
                serde_json::json!({"workspace": {"path": path}, "binds": [{"source": "/nonexistent-x"}]}),
                "does not exist",
            ),
            (
                serde_json::json!({"workspace": {"path": path}, "binds": [{"source": "/sys"}]}),
                "builds itself",
            ),
            (
                serde_json::json!({"workspace": {"path": path}, "binds": [{"source": path}]}),
                "twice",
            ),
            (
                serde_json::json!({"overlays": [{"path": path, "mode": "rw", "persist": false}]}),
                "persist applies",
            ),
        ];
        for (json, want) in cases {
            let err = parse(json.clone()).unwrap_err().to_string();
            assert!(err.contains(want), "{json}: {err}");
        }
        let err =
            parse(serde_json::json!({"overlays": [{"path": path, "persist": true}]})).unwrap_err();
        assert!(matches!(err, IsolatedError::Unsupported(_)), "{err}");
    }
}
