//! The runc baseline: the template workload (the image rootfs, execd as the container
//! process, as `bench cold-start`'s runc baseline runs it) started once with `runc run -d`,
//! checkpointed with `runc checkpoint`, then restored N times as clones, each from its own
//! bundle whose root is a fresh overlay over the template's root. Only `runc restore` is
//! timed (until it returns; `/ping` is checked after); everything is removed again, on
//! failure too.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use fastbox_runtime::criu_stats::{self, DumpStats, RestoreStats};
use nix::mount::{MntFlags, MsFlags};

use super::Run;
use fastbox_cli::bench::{free_port, runc_bundle};
use fastbox_cli::execd_client::ExecdClient;

/// How long a container's execd may take to answer `/ping`.
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// One timed clone.
#[derive(Debug)]
pub struct Sample {
    /// `runc restore -d` until it returned.
    pub restore: Duration,
    /// Until the clone's execd answered `/ping` (polled right after the restore returned).
    pub to_ping: Duration,
    /// CRIU's `stats-restore` of the clone's work path.
    pub criu: Option<RestoreStats>,
}

/// What the runc side measured.
#[derive(Debug)]
pub struct Series {
    /// `runc checkpoint` of the template container (untimed set-up).
    pub checkpoint: Duration,
    /// CRIU's `stats-dump` of that checkpoint.
    pub dump: Option<DumpStats>,
    pub samples: Vec<Sample>,
}

/// The runc side's containers and mounts; whatever is still there when it is dropped is
/// removed (containers first, then mounts).
struct Baseline<'a> {
    run: &'a Run,
    rootfs: &'a Path,
    dir: PathBuf,
    port: u16,
    containers: Vec<String>,
    mounts: Vec<PathBuf>,
    /// Connections are not kept alive: CRIU refuses to dump an established TCP connection.
    http: reqwest::blocking::Client,
}

/// Runs the runc side for the image whose unpacked root is `rootfs`.
pub fn series(run: &Run, rootfs: &Path) -> anyhow::Result<Series> {
    let dir = run.dir.join("runc");
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let mut baseline = Baseline {
        run,
        rootfs,
        dir,
        port: free_port()?,
        containers: Vec::new(),
        mounts: Vec::new(),
        http: reqwest::blocking::Client::builder()
            .pool_max_idle_per_host(0)
            .connect_timeout(Duration::from_secs(2))
            .build()?,
    };
    let (checkpoint, dump) = baseline.checkpoint_template()?;
    let samples = (0..run.n)
        .map(|i| baseline.clone_once(i))
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(Series {
        checkpoint,
        dump,
        samples,
    })
}

impl Baseline<'_> {
    fn images(&self) -> PathBuf {
        self.dir.join("checkpoint")
    }

    fn template_upper(&self) -> PathBuf {
        self.dir.join("template").join("upper")
    }

    /// Starts the template container, waits for its execd and checkpoints it.
    fn checkpoint_template(&mut self) -> anyhow::Result<(Duration, Option<DumpStats>)> {
        let bundle = self.dir.join("template");
        let lower = self.rootfs.display().to_string();
        self.overlay(&bundle, &lower)?;
        runc_bundle(&bundle, &bundle.join("rootfs"), &self.run.execd, self.port)?;
        let id = format!("{}-tpl", self.run.prefix);
        let mut run = self.runc();
        run.args(["run", "-d", "--bundle"]).arg(&bundle).arg(&id);
        self.containers.push(id.clone());
        self.status(run, "run")?;
        self.execd()
            .wait_ready(READY_TIMEOUT)
            .context("the template container's execd")?;
        let work = self.dir.join("checkpoint-work");
        let start = Instant::now();
        // The client's last connection may still be closing on execd's side: try again.
        let mut attempt = 0;
        loop {
            let mut checkpoint = self.runc();
            checkpoint
                .arg("checkpoint")
                .arg("--image-path")
                .arg(self.images())
                .arg("--work-path")
                .arg(&work)
                .arg(&id);
            match self.status(checkpoint, "checkpoint") {
                Ok(()) => break,
                Err(e) if attempt >= 2 => return Err(e),
                Err(_) => attempt += 1,
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let elapsed = start.elapsed();
        self.delete(&id);
        // The template's writable layer becomes a lower layer of every clone.
        self.unmount(&bundle.join("rootfs"))?;
        Ok((elapsed, criu_stats::read_dump_stats(&work).ok()))
    }

    /// Restores clone `i` from its own bundle, checks its execd, removes it.
    fn clone_once(&mut self, i: usize) -> anyhow::Result<Sample> {
        let bundle = self.dir.join(format!("clone-{i}"));
        let lower = format!(
            "{}:{}",
            self.template_upper().display(),
            self.rootfs.display()
        );
        self.overlay(&bundle, &lower)?;
        runc_bundle(&bundle, &bundle.join("rootfs"), &self.run.execd, self.port)?;
        let id = format!("{}-c{i}", self.run.prefix);
        let work = bundle.join("criu-work");
        let mut restore = self.runc();
        restore
            .args(["restore", "-d", "--bundle"])
            .arg(&bundle)
            .arg("--image-path")
            .arg(self.images())
            .arg("--work-path")
            .arg(&work)
            .arg(&id);
        self.containers.push(id.clone());
        let start = Instant::now();
        self.status(restore, "restore")?;
        let restored = start.elapsed();
        self.execd()
            .wait_ready(READY_TIMEOUT)
            .with_context(|| format!("clone {id}'s execd"))?;
        let to_ping = start.elapsed();
        let criu = criu_stats::read_restore_stats(&work)
            .inspect_err(|e| eprintln!("runc: {e}"))
            .ok();
        self.delete(&id);
        self.unmount(&bundle.join("rootfs"))?;
        std::fs::remove_dir_all(&bundle).with_context(|| format!("remove {}", bundle.display()))?;
        Ok(Sample {
            restore: restored,
            to_ping,
            criu,
        })
    }

    /// `runc` with this run's state directory, log file and CRIU.
    fn runc(&self) -> Command {
        let mut cmd = Command::new("runc");
        cmd.arg("--root")
            .arg(self.dir.join("state"))
            .arg("--log")
            .arg(self.dir.join("runc.log"))
            .arg("--criu")
            .arg(&self.run.criu.path)
            // The container inherits these: nothing may point at a file that changes later.
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        cmd
    }

    /// Runs `cmd`; on failure, the end of runc's log.
    fn status(&self, mut cmd: Command, what: &str) -> anyhow::Result<()> {
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

    fn execd(&self) -> ExecdClient {
        ExecdClient::with_client(
            format!("http://127.0.0.1:{}", self.port),
            None,
            self.http.clone(),
        )
    }

    fn delete(&mut self, id: &str) {
        let _ = self.runc().args(["delete", "-f", id]).status();
        self.containers.retain(|c| c != id);
    }

    /// Mounts `BUNDLE/rootfs`: an overlay of `lower` (colon-separated) with a fresh
    /// writable layer in `BUNDLE/upper`.
    fn overlay(&mut self, bundle: &Path, lower: &str) -> anyhow::Result<()> {
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
        nix::mount::mount(
            Some("overlay"),
            &root,
            Some("overlay"),
            MsFlags::empty(),
            Some(options.as_str()),
        )
        .with_context(|| format!("mount overlay at {}", root.display()))?;
        self.mounts.push(root);
        Ok(())
    }

    fn unmount(&mut self, root: &Path) -> anyhow::Result<()> {
        nix::mount::umount2(root, MntFlags::MNT_DETACH)
            .with_context(|| format!("unmount {}", root.display()))?;
        self.mounts.retain(|m| m != root);
        Ok(())
    }
}

impl Drop for Baseline<'_> {
    fn drop(&mut self) {
        for id in std::mem::take(&mut self.containers) {
            let _ = self.runc().args(["delete", "-f", &id]).status();
        }
        for root in std::mem::take(&mut self.mounts) {
            let _ = nix::mount::umount2(&root, MntFlags::MNT_DETACH);
        }
    }
}

/// Containers runc still lists in this run's state directory.
pub fn leftover_containers(run: &Run) -> Vec<String> {
    let state = run.dir.join("runc").join("state");
    std::fs::read_dir(state)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| format!("runc container {}", e.file_name().to_string_lossy()))
                .collect()
        })
        .unwrap_or_default()
}
