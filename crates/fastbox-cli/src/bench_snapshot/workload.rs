//! The workload whose memory is snapshotted: one process that allocates M MiB of non-zero
//! data, keeps it, and sleeps for ever. The same argv runs in the sandbox (started in the
//! background through execd) and as the runc baseline's container process.

use std::time::{Duration, Instant};

use anyhow::bail;

use crate::client::quote::shell_join;

/// Where the sandbox's workload records its pid (inside the sandbox).
pub const PID_FILE: &str = "/tmp/fastbox-bench-workload.pid";

/// What allocates the memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    /// `python3`: `bytes(range(256)) * (M * 4096)` kept in a variable.
    Python,
    /// `sh` (busybox too): M MiB of `yes` output kept in a shell variable; for images
    /// without python3.
    Shell,
}

impl std::fmt::Display for Workload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Python => "python",
            Self::Shell => "shell",
        })
    }
}

impl Workload {
    /// The process: allocates `mib` MiB of non-zero data, keeps it, sleeps for ever.
    pub fn argv(self, mib: u64) -> Vec<String> {
        let (program, script) = match self {
            Self::Python => (
                "python3",
                format!(
                    "import time\nb = bytes(range(256)) * ({mib} * 4096)\nwhile True:\n    time.sleep(3600)\n"
                ),
            ),
            Self::Shell => (
                "sh",
                format!(
                    "v=$(yes abcdefghijklmnopqrstuvwxyz01234 | head -c {}); while :; do sleep 3600; done",
                    mib * 1024 * 1024
                ),
            ),
        };
        vec![program.to_string(), "-c".to_string(), script]
    }

    /// The command line (run by execd with `sh -c`) that starts the workload in the
    /// background, in a session of its own with no tie to the command's output, having
    /// written its pid to [`PID_FILE`]; it prints `started`.
    pub fn launch(self, mib: u64) -> String {
        format!(
            "setsid sh -c 'echo $$ > {PID_FILE}; exec \"$@\"' workload {} </dev/null >/dev/null 2>&1 &\necho started",
            shell_join(&self.argv(mib))
        )
    }
}

/// The command line that prints the workload's `/proc/PID/status`.
pub fn status_command() -> String {
    format!("cat /proc/$(cat {PID_FILE})/status")
}

/// Reads the workload's RSS in KiB with `read` every `every` until it is at least `mib` MiB
/// (at most `timeout`); returns it in MiB.
pub fn wait_for_rss(
    mib: u64,
    timeout: Duration,
    every: Duration,
    mut read: impl FnMut() -> Option<u64>,
) -> anyhow::Result<f64> {
    let deadline = Instant::now() + timeout;
    loop {
        let rss = read();
        match rss {
            Some(kib) if kib >= mib * 1024 => return Ok(kib as f64 / 1024.0),
            _ if Instant::now() >= deadline => {
                bail!("the workload has {rss:?} KiB resident, not {mib} MiB, after {timeout:?}")
            }
            _ => std::thread::sleep(every),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_python_workload_allocates_m_mib_of_non_zero_bytes() {
        let argv = Workload::Python.argv(256);
        assert_eq!(argv[..2], ["python3", "-c"]);
        assert!(
            argv[2].contains("bytes(range(256)) * (256 * 4096)"),
            "{}",
            argv[2]
        );
        // 256 bytes times 4096 is one MiB.
        assert_eq!(256 * 4096, 1024 * 1024);
    }

    #[test]
    fn the_shell_workload_keeps_m_mib_in_a_variable() {
        let argv = Workload::Shell.argv(16);
        assert_eq!(argv[..2], ["sh", "-c"]);
        assert!(argv[2].contains("head -c 16777216"), "{}", argv[2]);
    }

    #[test]
    fn the_launch_records_the_pid_and_quotes_the_argv() {
        let line = Workload::Python.launch(8);
        assert!(
            line.starts_with("setsid sh -c 'echo $$ > /tmp/fastbox-bench-workload.pid; exec \"$@\"' workload python3 -c 'import time"),
            "{line}"
        );
        assert!(
            line.ends_with("</dev/null >/dev/null 2>&1 &\necho started"),
            "{line}"
        );
        assert_eq!(
            status_command(),
            "cat /proc/$(cat /tmp/fastbox-bench-workload.pid)/status"
        );
    }

    #[test]
    fn the_wait_ends_once_the_rss_is_reached_or_the_time_is_up() {
        let mut reads = [None, Some(1000), Some(2048), Some(9999)].into_iter();
        let rss = wait_for_rss(2, Duration::from_secs(5), Duration::ZERO, || {
            reads.next().flatten()
        });
        assert_eq!(rss.unwrap(), 2.0);
        let short = wait_for_rss(2, Duration::ZERO, Duration::ZERO, || Some(1));
        assert!(short.unwrap_err().to_string().contains("Some(1) KiB"));
    }
}
