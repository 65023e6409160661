//! The runc baseline: the same workload as the process of a runc container on the image
//! rootfs (an overlay root, the host's network namespace, a tmpfs `/tmp`: `bench_runc`),
//! checkpointed N times with `runc checkpoint --leave-running` into a tmpfs and N times into
//! a directory on disk, CRIU's `frozen_time` read from each `stats-dump`; then the last disk
//! checkpoint restored N times with `runc restore -d`, each clone from its own bundle whose
//! root is a fresh overlay. Containers and mounts are removed at the end, on failure too.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use fastbox_runtime::criu_stats::{self, DumpStats, RestoreStats};

use crate::bench_runc::{self, CLONE_WORK, RuncRun};

use super::message::vm_rss_kib;
use super::workload::wait_for_rss;

/// Between two reads of the container process's memory while it allocates.
const RSS_POLL: Duration = Duration::from_millis(100);

/// What to run.
pub struct Plan<'a> {
    /// The run's directory (runc state and log, bundles, the disk checkpoints).
    pub dir: &'a Path,
    pub rootfs: &'a Path,
    pub criu: &'a Path,
    /// Prefix of the run's container names.
    pub prefix: &'a str,
    /// The workload's process.
    pub argv: Vec<String>,
    pub mib: u64,
    pub n: usize,
    /// Longest wait for the workload's allocation.
    pub ready_timeout: Duration,
}

/// One `runc checkpoint --leave-running`.
#[derive(Debug, Clone, Copy)]
pub struct Checkpoint {
    /// Until `runc checkpoint` returned.
    pub wall: Duration,
    /// CRIU's `stats-dump` of it.
    pub stats: Option<DumpStats>,
}

/// One `runc restore -d`.
#[derive(Debug, Clone, Copy)]
pub struct Restore {
    /// Until `runc restore` returned.
    pub wall: Duration,
    /// CRIU's `stats-restore` of it.
    pub stats: Option<RestoreStats>,
}

/// What the baseline measured.
#[derive(Debug, Default)]
pub struct Series {
    /// The container process's RSS when its allocation was done.
    pub rss_mib: f64,
    pub tmpfs: Vec<Checkpoint>,
    pub disk: Vec<Checkpoint>,
    pub restores: Vec<Restore>,
}

/// Runs the baseline; whatever it made is removed before it returns.
pub fn series(plan: &Plan) -> anyhow::Result<Series> {
    let mut runc = RuncRun::new(plan.dir, plan.criu);
    measure(&mut runc, plan)
}

fn measure(runc: &mut RuncRun, plan: &Plan) -> anyhow::Result<Series> {
    let template = plan.dir.join("template");
    runc.overlay(&template, &plan.rootfs.display().to_string())?;
    bench_runc::write_bundle(&template, &template.join("rootfs"), &plan.argv, &[])?;
    let id = format!("{}-tpl", plan.prefix);
    runc.run_detached(&template, &id)?;
    let pid = runc.pid(&id)?;
    let rss_mib = wait_for_rss(plan.mib, plan.ready_timeout, RSS_POLL, || {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        vm_rss_kib(&status)
    })?;
    let tmpfs = plan.dir.join("tmpfs");
    runc.tmpfs(&tmpfs)?;
    let disk = plan.dir.join("disk");
    let mut series = Series {
        rss_mib,
        ..Series::default()
    };
    for i in 0..plan.n {
        let in_memory = tmpfs.join(i.to_string());
        series.tmpfs.push(checkpoint(runc, &id, &in_memory)?);
        remove(&in_memory)?;
        let on_disk = disk.join(i.to_string());
        series.disk.push(checkpoint(runc, &id, &on_disk)?);
        if i + 1 < plan.n {
            remove(&on_disk)?;
        }
    }
    runc.delete(&id);
    runc.unmount(&tmpfs)?;
    // The template's writable layer becomes a lower layer of every clone.
    runc.unmount(&template.join("rootfs"))?;
    let images = disk.join((plan.n - 1).to_string()).join("images");
    let lower = format!(
        "{}:{}",
        template.join("upper").display(),
        plan.rootfs.display()
    );
    for i in 0..plan.n {
        let bundle = plan.dir.join(format!("clone-{i}"));
        let clone = format!("{}-r{i}", plan.prefix);
        let wall = runc.restore_clone(&bundle, &lower, &images, &clone, |bundle, root| {
            bench_runc::write_bundle(bundle, root, &plan.argv, &[])
        })?;
        let stats = criu_stats::read_restore_stats(&bundle.join(CLONE_WORK))
            .inspect_err(|e| eprintln!("runc: {e}"))
            .ok();
        runc.remove_clone(&clone, &bundle)?;
        series.restores.push(Restore { wall, stats });
    }
    Ok(series)
}

/// `runc checkpoint --leave-running` of `id` into `DIR/images` (CRIU's work directory:
/// `DIR/work`), timed until it returns.
fn checkpoint(runc: &RuncRun, id: &str, dir: &Path) -> anyhow::Result<Checkpoint> {
    let (images, work): (PathBuf, PathBuf) = (dir.join("images"), dir.join("work"));
    for d in [&images, &work] {
        std::fs::create_dir_all(d).with_context(|| format!("create {}", d.display()))?;
    }
    let start = Instant::now();
    runc.checkpoint(id, &images, &work, true)?;
    let wall = start.elapsed();
    let stats = criu_stats::read_dump_stats(&work)
        .inspect_err(|e| eprintln!("runc: {e}"))
        .ok();
    Ok(Checkpoint { wall, stats })
}

fn remove(dir: &Path) -> anyhow::Result<()> {
    std::fs::remove_dir_all(dir).with_context(|| format!("remove {}", dir.display()))
}
