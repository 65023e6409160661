//! The processes of a `verify cluster` run: one `fastbox up --accept-nodes` and `fastbox node
//! --join` agents, each with its own prefix, address pool, data directory and loopback ports,
//! logging to a file in the run's directory. Dropping one kills it and purges its prefix.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// One `fastbox` child process of the run.
pub struct Instance {
    pub name: String,
    pub prefix: String,
    pub data_dir: PathBuf,
    pub log: PathBuf,
    args: Vec<String>,
    envs: Vec<(String, String)>,
    netns: Option<String>,
    /// The `fastbox` binary [default: this process's own].
    program: Option<PathBuf>,
    child: Option<Child>,
}

impl Instance {
    /// An instance named `name` (its log is `{dir}/{name}.log`) run with `args`.
    pub fn new(dir: &Path, name: &str, prefix: &str, data_dir: PathBuf, args: Vec<String>) -> Self {
        Self {
            name: name.to_string(),
            prefix: prefix.to_string(),
            data_dir,
            log: dir.join(format!("{name}.log")),
            args,
            envs: Vec::new(),
            netns: None,
            program: None,
            child: None,
        }
    }

    /// The same, with `name=value` in its environment.
    pub fn with_env(mut self, name: &str, value: &str) -> Self {
        self.envs.push((name.to_string(), value.to_string()));
        self
    }

    /// The same, run in network namespace `netns` (its host).
    pub fn in_netns(mut self, netns: &str) -> Self {
        self.netns = Some(netns.to_string());
        self
    }

    /// The same, run from `program` (a test, which is not `fastbox` itself).
    pub fn with_program(mut self, program: &Path) -> Self {
        self.program = Some(program.to_path_buf());
        self
    }

    /// Starts the process (again); its output goes to its log.
    pub fn spawn(&mut self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("log {}", self.log.display()))?;
        let mut cmd = Command::new(match &self.program {
            Some(program) => program.clone(),
            None => std::env::current_exe()?,
        });
        if let Some(netns) = &self.netns {
            crate::scenario_net::enter(netns, &mut cmd)?;
        }
        let child = cmd
            .args(&self.args)
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("start {}", self.name))?;
        self.child = Some(child);
        Ok(())
    }

    /// Waits until `ready` holds, at most `within`; fails early (with the log's tail) when
    /// the process exits.
    pub fn wait_until(
        &mut self,
        what: &str,
        within: Duration,
        mut ready: impl FnMut() -> bool,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        loop {
            if ready() {
                return Ok(());
            }
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                bail!(
                    "{} exited ({status}) before {what}:\n{}",
                    self.name,
                    self.log_tail()
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} was not {what} within {within:?}:\n{}",
                    self.name,
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Its process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL, as a crash.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, then waits (SIGKILL after 20 s).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pid = nix::unistd::Pid::from_raw(child.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The last lines of its log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        self.kill9();
        if let Err(e) = fastbox_fastlet::host::purge(&self.prefix, &self.data_dir) {
            eprintln!(
                "fastbox: warning: purge of {} ({}): {e}",
                self.name, self.prefix
            );
        }
    }
}
