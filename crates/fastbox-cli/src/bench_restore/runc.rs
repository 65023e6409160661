//! The runc baseline: the template workload (the image rootfs, execd as the container
//! process, as `bench cold-start`'s runc baseline runs it) started once with `runc run -d`,
//! checkpointed with `runc checkpoint`, then restored N times as clones, each from its own
//! bundle whose root is a fresh overlay over the template's root. Only `runc restore` is
//! timed (until it returns; `/ping` is checked after); everything is removed again, on
//! failure too.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use fastbox_runtime::criu_stats::{self, DumpStats, RestoreStats};

use super::Run;
use fastbox_cli::bench::{free_port, runc_bundle};
use fastbox_cli::bench_runc::{self, RuncRun};
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

/// The runc side; its containers and mounts (in `runc`) are removed when it is dropped.
struct Baseline<'a> {
    run: &'a Run,
    rootfs: &'a Path,
    dir: PathBuf,
    port: u16,
    runc: RuncRun,
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
        runc: RuncRun::new(&dir, &run.criu.path),
        dir,
        port: free_port()?,
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
        self.runc.overlay(&bundle, &lower)?;
        runc_bundle(&bundle, &bundle.join("rootfs"), &self.run.execd, self.port)?;
        let id = format!("{}-tpl", self.run.prefix);
        self.runc.run_detached(&bundle, &id)?;
        self.execd()
            .wait_ready(READY_TIMEOUT)
            .context("the template container's execd")?;
        let work = self.dir.join("checkpoint-work");
        let start = Instant::now();
        // The client's last connection may still be closing on execd's side: try again.
        let mut attempt = 0;
        loop {
            match self.runc.checkpoint(&id, &self.images(), &work, false) {
                Ok(()) => break,
                Err(e) if attempt >= 2 => return Err(e),
                Err(_) => attempt += 1,
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let elapsed = start.elapsed();
        self.runc.delete(&id);
        // The template's writable layer becomes a lower layer of every clone.
        self.runc.unmount(&bundle.join("rootfs"))?;
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
        let id = format!("{}-c{i}", self.run.prefix);
        let (execd, port, images) = (&self.run.execd, self.port, self.images());
        let restored = self
            .runc
            .restore_clone(&bundle, &lower, &images, &id, |bundle, root| {
                runc_bundle(bundle, root, execd, port)
            })?;
        let after = Instant::now();
        self.execd()
            .wait_ready(READY_TIMEOUT)
            .with_context(|| format!("clone {id}'s execd"))?;
        let to_ping = restored + after.elapsed();
        let criu = criu_stats::read_restore_stats(&bundle.join(bench_runc::CLONE_WORK))
            .inspect_err(|e| eprintln!("runc: {e}"))
            .ok();
        self.runc.remove_clone(&id, &bundle)?;
        Ok(Sample {
            restore: restored,
            to_ping,
            criu,
        })
    }

    fn execd(&self) -> ExecdClient {
        ExecdClient::with_client(
            format!("http://127.0.0.1:{}", self.port),
            None,
            self.http.clone(),
        )
    }
}

/// Containers runc still lists in this run's state directory.
pub fn leftover_containers(run: &Run) -> Vec<String> {
    bench_runc::leftover_containers(&run.dir.join("runc"))
}
