//! What the runc baselines of the benchmarks share: runc run with a run's own state directory,
//! log file and CRIU, the containers and mounts (overlay roots, a tmpfs) it made, removed
//! again when it is dropped (containers first, then mounts), on failure too; and the bundle
//! configuration of a container on an image rootfs.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::mount::{MntFlags, MsFlags};

/// CRIU's work directory of a clone's restore, inside its bundle.
pub const CLONE_WORK: &str = "criu-work";

/// runc with a state directory (`DIR/state`), a log file (`DIR/runc.log`) and a CRIU of a
/// run's own, and what the run made with it.
pub struct RuncRun {
    dir: PathBuf,
    criu: PathBuf,
    containers: Vec<String>,
    mounts: Vec<PathBuf>,
}

impl RuncRun {
    /// runc for a run whose runc state and log live in `dir` (which must exist).
    pub fn new(dir: &Path, criu: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
            criu: criu.to_path_buf(),
            containers: Vec::new(),
            mounts: Vec::new(),
        }
    }

    /// `runc` with this run's state directory, log file and CRIU.
    pub fn command(&self) -> Command {
        let mut cmd = Command::new("runc");
        cmd.arg("--root")
            .arg(self.dir.join("state"))
            .arg("--log")
            .arg(self.dir.join("runc.log"))
            .arg("--criu")
            .arg(&self.criu)
            // The container inherits these: nothing may point at a file that changes later.
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        cmd
    }

    /// Runs `cmd`; on failure, the end of runc's log.
    pub fn status(&self, mut cmd: Command, what: &str) -> anyhow::Result<()> {
        let status = cmd.status().with_context(|| format!("runc {what}"))?;
        if !status.success() {
            let log = std::fs::read_to_string(self.dir.join("runc.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(5).collect();
            bail!(
                "runc {what} failed ({status}); runc.log ends:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        Ok(())
    }

    /// Records container `id` as this run's (before the command that makes it), so that it
    /// is deleted at the end whatever happens.
    pub fn track(&mut self, id: &str) {
        self.containers.push(id.to_string());
    }

    /// `runc delete -f id`.
    pub fn delete(&mut self, id: &str) {
        let _ = self.command().args(["delete", "-f", id]).status();
        self.containers.retain(|c| c != id);
    }

    /// Starts container `id` of `bundle` with `runc run -d`.
    pub fn run_detached(&mut self, bundle: &Path, id: &str) -> anyhow::Result<()> {
        let mut run = self.command();
        run.args(["run", "-d", "--bundle"]).arg(bundle).arg(id);
        self.track(id);
        self.status(run, "run")
    }

    /// `runc checkpoint` of container `id` into `images`, CRIU's work directory (with its
    /// `stats-dump`) in `work`; with `leave_running`, the container runs on afterwards.
    pub fn checkpoint(
        &self,
        id: &str,
        images: &Path,
        work: &Path,
        leave_running: bool,
    ) -> anyhow::Result<()> {
        let mut checkpoint = self.command();
        checkpoint.arg("checkpoint");
        if leave_running {
            checkpoint.arg("--leave-running");
        }
        checkpoint
            .arg("--image-path")
            .arg(images)
            .arg("--work-path")
            .arg(work)
            .arg(id);
        self.status(checkpoint, "checkpoint")
    }

    /// Restores container `id` from checkpoint `images` with `runc restore -d`, from its own
    /// bundle `bundle`: a fresh overlay root over `lower`, whose `config.json` `config` writes
    /// (given the bundle and its root). Returns how long `runc restore` took (it alone is
    /// timed); CRIU's `stats-restore` is in `BUNDLE/criu-work`.
    pub fn restore_clone(
        &mut self,
        bundle: &Path,
        lower: &str,
        images: &Path,
        id: &str,
        config: impl FnOnce(&Path, &Path) -> anyhow::Result<()>,
    ) -> anyhow::Result<Duration> {
        self.overlay(bundle, lower)?;
        config(bundle, &bundle.join("rootfs"))?;
        let mut restore = self.command();
        restore
            .args(["restore", "-d", "--bundle"])
            .arg(bundle)
            .arg("--image-path")
            .arg(images)
            .arg("--work-path")
            .arg(bundle.join(CLONE_WORK))
            .arg(id);
        self.track(id);
        let start = Instant::now();
        self.status(restore, "restore")?;
        Ok(start.elapsed())
    }

    /// Deletes clone `id` and removes its bundle (its root unmounted first).
    pub fn remove_clone(&mut self, id: &str, bundle: &Path) -> anyhow::Result<()> {
        self.delete(id);
        self.unmount(&bundle.join("rootfs"))?;
        std::fs::remove_dir_all(bundle).with_context(|| format!("remove {}", bundle.display()))
    }

    /// The host pid of container `id`'s process (`runc state`).
    pub fn pid(&self, id: &str) -> anyhow::Result<i32> {
        let mut cmd = self.command();
        cmd.args(["state", id]).stdout(Stdio::piped());
        let out = cmd.output().with_context(|| format!("runc state {id}"))?;
        let state: serde_json::Value = serde_json::from_slice(&out.stdout)
            .with_context(|| format!("runc state {id} is not JSON ({})", out.status))?;
        state["pid"]
            .as_i64()
            .and_then(|p| i32::try_from(p).ok())
            .filter(|p| *p > 0)
            .with_context(|| format!("runc state {id} has no pid: {state}"))
    }

    /// Mounts `BUNDLE/rootfs`: an overlay of `lower` (colon-separated) with a fresh
    /// writable layer in `BUNDLE/upper`.
    pub fn overlay(&mut self, bundle: &Path, lower: &str) -> anyhow::Result<()> {
        let (upper, work, root) = (
            bundle.join("upper"),
            bundle.join("work"),
            bundle.join("rootfs"),
        );
        for d in [&upper, &work, &root] {
            std::fs::create_dir_all(d).with_context(|| format!("create {}", d.display()))?;
        }
        let options = format!(
            "lowerdir={lower},upperdir={},workdir={}",
            upper.display(),
            work.display()
        );
        self.mount("overlay", &root, &options)
    }

    /// Mounts a tmpfs at `at` (created if needed).
    pub fn tmpfs(&mut self, at: &Path) -> anyhow::Result<()> {
        std::fs::create_dir_all(at).with_context(|| format!("create {}", at.display()))?;
        self.mount("tmpfs", at, "mode=0700")
    }

    fn mount(&mut self, fstype: &str, at: &Path, options: &str) -> anyhow::Result<()> {
        nix::mount::mount(
            Some(fstype),
            at,
            Some(fstype),
            MsFlags::empty(),
            Some(options),
        )
        .with_context(|| format!("mount {fstype} at {}", at.display()))?;
        self.mounts.push(at.to_path_buf());
        Ok(())
    }

    pub fn unmount(&mut self, at: &Path) -> anyhow::Result<()> {
        nix::mount::umount2(at, MntFlags::MNT_DETACH)
            .with_context(|| format!("unmount {}", at.display()))?;
        self.mounts.retain(|m| m != at);
        Ok(())
    }
}

impl Drop for RuncRun {
    fn drop(&mut self) {
        for id in std::mem::take(&mut self.containers) {
            let _ = self.command().args(["delete", "-f", &id]).status();
        }
        for at in std::mem::take(&mut self.mounts).into_iter().rev() {
            let _ = nix::mount::umount2(&at, MntFlags::MNT_DETACH);
        }
    }
}

/// Containers runc still lists in the state directory of a run whose runc lived in `dir`.
pub fn leftover_containers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir.join("state"))
        .map(|entries| {
            entries
                .flatten()
                .map(|e| format!("runc container {}", e.file_name().to_string_lossy()))
                .collect()
        })
        .unwrap_or_default()
}

/// Writes `BUNDLE/config.json`: `runc spec`'s defaults with `rootfs` as a read-only root,
/// `args` as the container process, `binds` (destination, source) bind-mounted read-only, a
/// tmpfs `/tmp`, and the host's network namespace (so the benchmark reaches the container
/// without entering a namespace).
pub fn write_bundle(
    bundle: &Path,
    rootfs: &Path,
    args: &[String],
    binds: &[(&str, &Path)],
) -> anyhow::Result<()> {
    let status = Command::new("runc")
        .arg("spec")
        .current_dir(bundle)
        .status()
        .context("runc spec (is runc installed?)")?;
    if !status.success() {
        bail!("runc spec failed");
    }
    let config_path = bundle.join("config.json");
    let mut config: serde_json::Value = serde_json::from_slice(&std::fs::read(&config_path)?)?;
    config["root"] = serde_json::json!({ "path": rootfs, "readonly": true });
    config["process"]["terminal"] = false.into();
    config["process"]["args"] = serde_json::json!(args);
    let mounts = config["mounts"]
        .as_array_mut()
        .context("runc spec has mounts")?;
    for (destination, source) in binds {
        mounts.push(serde_json::json!({
            "destination": destination, "type": "bind", "source": source, "options": ["bind", "ro"]
        }));
    }
    mounts.push(serde_json::json!({
        "destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev"]
    }));
    if let Some(ns) = config["linux"]["namespaces"].as_array_mut() {
        ns.retain(|n| n["type"] != "network");
    }
    std::fs::write(&config_path, serde_json::to_vec_pretty(&config)?)?;
    Ok(())
}

/// Whether `runc` can be run (`runc --version`); the reason when not.
pub fn available() -> Result<(), String> {
    match Command::new("runc")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    {
        Ok(status) if status.success() => Ok(()),
        Ok(status) => Err(format!("runc --version failed ({status})")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err("runc is not on PATH".to_string())
        }
        Err(e) => Err(format!("runc cannot be run: {e}")),
    }
}
