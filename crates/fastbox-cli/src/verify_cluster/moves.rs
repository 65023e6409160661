//! The cross-node resume of `verify cluster`: a sandbox holding M MiB of pseudo-random memory,
//! paused and resumed on its own node, paused again, its node killed and lost, then resumed
//! on another node from the checkpoint in the shared store (nothing of it cached there), with
//! every block read from the origin delayed as a remote origin would be.
//!
//! Each resume is timed from the request until execd answers `/ping` through the sandbox's
//! endpoint (`ready`), and until the node that runs it logged that every page of its memory
//! was in place (`memory local`: a resume whose memory is copied in while it runs). The memory
//! holder is a busybox shell keeping base64 of random bytes in a variable; asked (a file
//! appears), it writes the MD5 of that variable, so every page is read, and the sum must be
//! the one it took before the first pause.

use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail};
use serde::Serialize;

use super::api::Api;

/// How long a pause, a resume or the holder's sum may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(600);
/// What the node logs when a restore's memory is in place.
const MEMORY_LOCAL_LINE: &str = "memory copied in";

/// One resume, timed.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ResumeTiming {
    /// From the request until execd answered `/ping`.
    pub ready_ms: u64,
    /// From the request until every page was in place.
    pub memory_local_ms: u64,
}

/// What the cross-node resume found.
#[derive(Debug, Serialize)]
pub struct MoveReport {
    pub memory_mib: u64,
    pub origin_block_delay_ms: u64,
    pub from: String,
    pub to: String,
    /// Resumed on its own node.
    pub local: ResumeTiming,
    /// Resumed on `to` once `from` was lost.
    pub moved: ResumeTiming,
    /// Whether the held memory summed as before after each resume.
    pub memory_intact: bool,
}

/// The memory limit of a sandbox whose holder keeps `mib` MiB, MiB.
pub(super) fn memory_limit(mib: u64) -> u64 {
    2 * mib + 128
}

/// The shell that holds about `mib` MiB (see the module docs).
fn holder(mib: u64) -> String {
    let random = mib * 3 / 4 * 1024 * 1024;
    format!(
        "(x=$(head -c {random} /dev/urandom | base64); echo \"$x\" | md5sum > /tmp/vh.sum0; \
         while :; do if [ -e /tmp/vh.ask ]; then rm -f /tmp/vh.ask; \
         echo \"$x\" | md5sum > /tmp/vh.sum.new; mv /tmp/vh.sum.new /tmp/vh.sum; fi; \
         sleep 0.2; done) > /dev/null 2>&1 &"
    )
}

/// Starts the memory holder in sandbox `id` and waits until its memory is filled.
pub(super) fn start_holder(api: &Api, id: &str, mib: u64) -> anyhow::Result<()> {
    api.sh(id, &holder(mib))?;
    wait_for(api, id, "cat /tmp/vh.sum0 2>/dev/null || true")?;
    Ok(())
}

/// Whether the holder's memory sums as when it was filled (every page read).
pub(super) fn memory_intact(api: &Api, id: &str) -> anyhow::Result<bool> {
    api.sh(id, "rm -f /tmp/vh.sum; touch /tmp/vh.ask")?;
    let now = wait_for(api, id, "cat /tmp/vh.sum 2>/dev/null || true")?;
    let start = api.sh(id, "cat /tmp/vh.sum0")?;
    Ok(!now.trim().is_empty() && now.trim() == start.trim())
}

/// The output of `script` in sandbox `id` once it is not empty.
fn wait_for(api: &Api, id: &str, script: &str) -> anyhow::Result<String> {
    let deadline = Instant::now() + STEP_TIMEOUT;
    loop {
        let out = api.sh(id, script)?;
        if !out.trim().is_empty() {
            return Ok(out);
        }
        if Instant::now() >= deadline {
            bail!("{id}: {script:?} printed nothing within {STEP_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Pauses sandbox `id` and waits until it is `Paused`.
pub(super) fn pause(api: &Api, id: &str) -> anyhow::Result<()> {
    let (status, body) = api.post(&format!("/v1/sandboxes/{id}/pause"))?;
    if status != 202 {
        bail!("pause {id}: {status} {body}");
    }
    api.wait_state(id, "Paused", STEP_TIMEOUT)
}

/// Resumes sandbox `id`, timed until execd answers and until the node whose log
/// `log_of(node id)` names logged its memory in place.
pub(super) fn timed_resume(
    api: &Api,
    id: &str,
    log_of: &dyn Fn(&str) -> Option<std::path::PathBuf>,
) -> anyhow::Result<(ResumeTiming, String)> {
    let (requested, clock) = (SystemTime::now(), Instant::now());
    let (status, body) = api.post(&format!("/v1/sandboxes/{id}/resume"))?;
    if status != 202 {
        bail!("resume {id}: {status} {body}");
    }
    let deadline = clock + STEP_TIMEOUT;
    while !api.pings(id) {
        let (state, reason) = api.state(id)?;
        // Failed, or Paused again (the resume failed and the checkpoint is kept): it ends
        // here, with the sandbox's own account of why.
        let given_up = state == "Failed" || (state == "Paused" && reason.is_some());
        if given_up || Instant::now() >= deadline {
            let message = api.message(id).unwrap_or_default();
            bail!("resume {id}: {state} ({reason:?}), execd does not answer: {message}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let ready = clock.elapsed();
    let node = node_of(api, id)?;
    let log = log_of(&node).with_context(|| format!("no log of node {node}"))?;
    let local_at = loop {
        if let Some(at) = memory_local_at(&log, id, requested) {
            break at;
        }
        if Instant::now() >= deadline {
            bail!(
                "resume {id}: node {node} never logged its memory in place ({})",
                log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let memory_local = local_at.duration_since(requested).unwrap_or_default();
    Ok((
        ResumeTiming {
            ready_ms: ready.as_millis() as u64,
            memory_local_ms: memory_local.as_millis() as u64,
        },
        node,
    ))
}

/// The node sandbox `id` runs on, by its proxy in the sandbox's endpoint: a joined node's
/// (`/v1/nodes` lists it), else the server's own node (listed without one).
pub(super) fn node_of(api: &Api, id: &str) -> anyhow::Result<String> {
    let (endpoint, _) = api.execd(id)?;
    let nodes = api.nodes()?;
    let by_proxy = nodes.iter().find(|(_, n)| {
        n["proxy"]
            .as_str()
            .is_some_and(|p| endpoint.starts_with(&format!("{p}/")))
    });
    by_proxy
        .or_else(|| nodes.iter().find(|(_, n)| n["proxy"].is_null()))
        .map(|(node, _)| node.clone())
        .with_context(|| format!("no node serves endpoint {endpoint}"))
}

/// When the node logging to `log` last logged the memory of sandbox `id` in place, if it
/// did after `after`.
fn memory_local_at(log: &Path, id: &str, after: SystemTime) -> Option<SystemTime> {
    let text = std::fs::read_to_string(log).ok()?;
    let needle = format!("sandbox={id} ");
    text.lines()
        .rev()
        .map(without_colors)
        .filter(|l| l.contains(MEMORY_LOCAL_LINE) && l.contains(&needle))
        .filter_map(|l| {
            let stamp = l.split_whitespace().next()?;
            let at = chrono::DateTime::parse_from_rfc3339(stamp).ok()?;
            Some(SystemTime::from(at))
        })
        .find(|at| *at >= after)
}

/// `line` without terminal color sequences (`ESC [ ... m`), as a log file holds them.
pub fn without_colors(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            chars.by_ref().find(|c| *c == 'm');
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memory_line_of_a_sandbox_is_found_after_a_time_colors_and_all() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("n1.log");
        std::fs::write(
            &log,
            "2026-12-02T06:04:38.667175Z  INFO fastbox_fastlet::transfers: memory copied in sandbox=abc ms=101\n\
             \u{1b}[2m2026-12-02T06:05:00.000000Z\u{1b}[0m \u{1b}[32m INFO\u{1b}[0m memory copied in \u{1b}[3msandbox\u{1b}[0m\u{1b}[2m=\u{1b}[0mabc ms=5\n\
             2026-12-02T06:06:00.000000Z  INFO memory copied in sandbox=other ms=5\n",
        )
        .unwrap();
        let at = |s: &str| SystemTime::from(chrono::DateTime::parse_from_rfc3339(s).unwrap());
        assert_eq!(
            memory_local_at(&log, "abc", at("2026-12-02T06:04:00Z")),
            Some(at("2026-12-02T06:05:00Z"))
        );
        assert_eq!(
            memory_local_at(&log, "abc", at("2026-12-02T06:05:30Z")),
            None
        );
        assert_eq!(
            memory_local_at(&dir.path().join("none"), "abc", at("2026-12-02T06:00:00Z")),
            None
        );
    }

    #[test]
    fn the_holder_keeps_about_the_memory_asked_for() {
        let script = holder(256);
        assert!(
            script.contains(&format!("head -c {} ", 192 << 20)),
            "{script}"
        );
        assert!(script.ends_with('&'));
    }
}
