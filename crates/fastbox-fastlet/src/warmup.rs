//! The readiness gate of a golden checkpoint's build, run on the node. Every sandbox of a
//! template is a restore of the moment the gate passed, so the warm-up processes (a server
//! that has loaded its models, an interpreter with its imports done) are already running when
//! a create claims one.
//!
//! The recipe itself ([`GoldenRecipe`]: environment, warm-up command, [`Readiness`]) and its
//! validation are data of the node boundary (`fastbox_node_api::recipe`, re-exported here):
//! the server refuses a bad template before any node sees it. Here is what runs the gate
//! ([`wait_ready`]):
//! - `tcp://HOST:PORT`: a TCP connect from inside the sandbox's network namespace
//!   (`127.0.0.1` is the sandbox's own loopback) succeeds;
//! - `cmd://COMMAND`: `/bin/sh -c COMMAND`, run by execd in the sandbox, exits 0;
//! - a probe is polled until it passes; the window bounds the wait, and a probe that never
//!   passes fails the build with its last answer;
//! - without a probe, the window is a fixed warm-up time, waited in full.

use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

pub use fastbox_node_api::recipe::{
    DEFAULT_WARMUP_SECS, GoldenRecipe, MAX_WARMUP_SECS, Probe, Readiness, RecipeError,
};

use crate::execd_client::ExecdClient;

/// Between two attempts of a probe.
const PROBE_INTERVAL: Duration = Duration::from_millis(50);
/// One TCP connect attempt.
const TCP_ATTEMPT: Duration = Duration::from_secs(1);
/// Longest single run of a `cmd://` probe.
const CMD_ATTEMPT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum WarmUpError {
    /// A probe or window that does not parse.
    #[error(transparent)]
    Recipe(#[from] RecipeError),
    #[error("readiness probe {probe} did not pass within {window:?} (last attempt: {last})")]
    NotReady {
        probe: String,
        window: Duration,
        last: String,
    },
}

/// Waits until `readiness` passes for the sandbox whose network namespace is `netns` and
/// whose execd is `execd`; returns how long it waited.
pub fn wait_ready(
    readiness: &Readiness,
    netns: &Path,
    execd: &ExecdClient,
) -> Result<Duration, WarmUpError> {
    let start = Instant::now();
    let Some(probe) = &readiness.probe else {
        std::thread::sleep(readiness.window);
        return Ok(start.elapsed());
    };
    loop {
        let last = match attempt(probe, netns, execd) {
            Ok(()) => return Ok(start.elapsed()),
            Err(last) => last,
        };
        if start.elapsed() >= readiness.window {
            return Err(WarmUpError::NotReady {
                probe: probe.to_string(),
                window: readiness.window,
                last,
            });
        }
        std::thread::sleep(PROBE_INTERVAL);
    }
}

/// One attempt of `probe`: `Ok` when it passes, otherwise what it answered.
fn attempt(probe: &Probe, netns: &Path, execd: &ExecdClient) -> Result<(), String> {
    match probe {
        Probe::Tcp(address) => {
            let address = *address;
            fastbox_runtime::net::netns::in_netns(netns, move || {
                TcpStream::connect_timeout(&address, TCP_ATTEMPT).map(drop)
            })
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())
        }
        Probe::Cmd(command) => match execd.run_shell(command, CMD_ATTEMPT) {
            Ok(0) => Ok(()),
            Ok(code) => Err(format!("exit status {code}")),
            Err(e) => Err(e.to_string()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_without_a_probe_is_waited_in_full() {
        let readiness = Readiness::parse(None, Some(0)).unwrap();
        let execd = ExecdClient::new("http://127.0.0.1:9".into(), None).unwrap();
        let waited = wait_ready(&readiness, Path::new("/nonexistent"), &execd).unwrap();
        assert!(waited < Duration::from_secs(1), "{waited:?}");
    }

    #[test]
    fn parse_errors_read_as_the_recipe_says() {
        let e: WarmUpError = Probe::parse("http://x").unwrap_err().into();
        assert!(e.to_string().contains("tcp://HOST:PORT"), "{e}");
    }
}
