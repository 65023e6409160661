//! What a golden checkpoint is built with beyond its image ([`GoldenRecipe`]), as the server
//! hands it to a node: environment, a warm-up command started cold next to execd, and a
//! readiness gate that must pass before the dump. The node runs the gate; here are the data
//! and their validation, so the server refuses a bad template with a 400 before any node
//! sees it.
//!
//! The gate is the templates API's `readiness` (OpenSandbox 1.1.1 `FsbTemplateReadiness`):
//! - `probe: "tcp://HOST:PORT"`: a TCP connect from inside the sandbox's network namespace
//!   (`127.0.0.1` is the sandbox's own loopback) succeeds;
//! - `probe: "cmd://COMMAND"`: `/bin/sh -c COMMAND`, run by execd in the sandbox, exits 0;
//! - a probe is polled until it passes; `warmupSeconds` (default 60) bounds the wait, and a
//!   probe that never passes fails the build with its last answer;
//! - without a probe, `warmupSeconds` (default 60) is a fixed warm-up window, waited in full.
//!
//! Without `readiness` the gate is execd answering `/ping`, which every start waits for.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The window of a `readiness` without `warmupSeconds` (the SDK's documented default).
pub const DEFAULT_WARMUP_SECS: u32 = 60;
/// Longest `warmupSeconds` accepted: a build holds a slot and a build lock while it waits.
pub const MAX_WARMUP_SECS: u32 = 3600;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecipeError {
    #[error("readiness probe {probe:?}: {why}")]
    BadProbe { probe: String, why: String },
    #[error("warmupSeconds {0} is out of range (0..={MAX_WARMUP_SECS})")]
    BadWindow(u32),
}

/// A readiness probe of a template build.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum Probe {
    /// Connect to this address from inside the sandbox's network namespace.
    Tcp(SocketAddr),
    /// Run this shell command in the sandbox; exit status 0 passes.
    Cmd(String),
}

impl Probe {
    /// Parses `tcp://HOST:PORT` (HOST an IPv4 address or `localhost`) or `cmd://COMMAND`.
    pub fn parse(text: &str) -> Result<Self, RecipeError> {
        let bad = |why: &str| RecipeError::BadProbe {
            probe: text.to_string(),
            why: why.to_string(),
        };
        if let Some(command) = text.strip_prefix("cmd://") {
            if command.trim().is_empty() {
                return Err(bad("cmd:// needs a command"));
            }
            if command.contains('\0') {
                return Err(bad("the command contains NUL"));
            }
            return Ok(Self::Cmd(command.to_string()));
        }
        let Some(address) = text.strip_prefix("tcp://") else {
            return Err(bad("give tcp://HOST:PORT or cmd://COMMAND"));
        };
        let address = address.trim_end_matches('/');
        let address = match address.strip_prefix("localhost:") {
            Some(port) => format!("127.0.0.1:{port}"),
            None => address.to_string(),
        };
        let parsed: SocketAddr = address
            .parse()
            .map_err(|_| bad("tcp:// needs an IPv4 address or localhost and a port"))?;
        if !parsed.is_ipv4() {
            return Err(bad("IPv6 is not available in sandboxes"));
        }
        if parsed.port() == 0 {
            return Err(bad("port 0"));
        }
        Ok(Self::Tcp(parsed))
    }
}

impl std::fmt::Display for Probe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Tcp(address) => write!(f, "tcp://{address}"),
            Self::Cmd(command) => write!(f, "cmd://{command}"),
        }
    }
}

impl From<Probe> for String {
    fn from(probe: Probe) -> String {
        probe.to_string()
    }
}

impl TryFrom<String> for Probe {
    type Error = RecipeError;
    fn try_from(text: String) -> Result<Self, RecipeError> {
        Probe::parse(&text)
    }
}

/// The readiness gate of a template build.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Readiness {
    pub probe: Option<Probe>,
    /// Bounds a probe's wait; without a probe, waited in full.
    pub window: Duration,
}

impl Readiness {
    /// From the templates API's `probe` and `warmupSeconds`.
    pub fn parse(probe: Option<&str>, warmup_seconds: Option<u32>) -> Result<Self, RecipeError> {
        let secs = warmup_seconds.unwrap_or(DEFAULT_WARMUP_SECS);
        if secs > MAX_WARMUP_SECS {
            return Err(RecipeError::BadWindow(secs));
        }
        Ok(Self {
            probe: probe.map(Probe::parse).transpose()?,
            window: Duration::from_secs(secs.into()),
        })
    }
}

/// How a golden checkpoint is built beyond its image. The default (an image's own template):
/// execd only, ready when it answers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GoldenRecipe {
    /// `KEY=VALUE` pairs baked in, after the image's own.
    pub env: Vec<String>,
    /// Started cold by execd next to itself and checkpointed running (empty: none).
    pub warm_up: Vec<String>,
    /// Waited for after execd answers, before the dump.
    pub readiness: Option<Readiness>,
    /// Built to offer isolated sessions (the seccomp variant and execd `--isolation`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub isolation: bool,
}

/// What the node names the isolation variant of template `key`.
pub fn isolation_key(key: &str) -> String {
    format!("{key}+isolation")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_parse_or_say_why_not() {
        assert_eq!(
            Probe::parse("tcp://127.0.0.1:44772").unwrap(),
            Probe::Tcp("127.0.0.1:44772".parse().unwrap())
        );
        assert_eq!(
            Probe::parse("tcp://localhost:8080/").unwrap(),
            Probe::Tcp("127.0.0.1:8080".parse().unwrap())
        );
        assert_eq!(
            Probe::parse("cmd://test -f /tmp/ready").unwrap(),
            Probe::Cmd("test -f /tmp/ready".into())
        );
        for (bad, why) in [
            ("http://127.0.0.1:80", "tcp://HOST:PORT or cmd://COMMAND"),
            ("tcp://127.0.0.1", "a port"),
            ("tcp://example.com:80", "IPv4 address or localhost"),
            ("tcp://[::1]:80", "IPv6"),
            ("tcp://127.0.0.1:0", "port 0"),
            ("cmd://  ", "needs a command"),
        ] {
            let e = Probe::parse(bad).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains(bad), "{bad}: {e}");
        }
    }

    #[test]
    fn the_window_defaults_to_a_minute_and_is_bounded() {
        let r = Readiness::parse(Some("tcp://127.0.0.1:1"), None).unwrap();
        assert_eq!(r.window, Duration::from_secs(60));
        let r = Readiness::parse(None, Some(0)).unwrap();
        assert_eq!((r.probe, r.window), (None, Duration::ZERO));
        assert!(matches!(
            Readiness::parse(None, Some(MAX_WARMUP_SECS + 1)),
            Err(RecipeError::BadWindow(_))
        ));
    }

    #[test]
    fn probes_print_as_given_and_travel_as_text() {
        for text in ["tcp://127.0.0.1:44772", "cmd://test -f /tmp/x"] {
            assert_eq!(Probe::parse(text).unwrap().to_string(), text);
        }
        let recipe = GoldenRecipe {
            env: vec!["A=1".into()],
            warm_up: vec!["sleep".into(), "9".into()],
            readiness: Some(Readiness::parse(Some("cmd://true"), Some(5)).unwrap()),
            isolation: true,
        };
        let json = serde_json::to_string(&recipe).unwrap();
        assert!(json.contains("\"cmd://true\""), "{json}");
        assert_eq!(serde_json::from_str::<GoldenRecipe>(&json).unwrap(), recipe);
        let forged = json.replace("cmd://true", "tcp://[::1]:1");
        assert!(serde_json::from_str::<GoldenRecipe>(&forged).is_err());
    }
}
