//! `fastbox bench snapshot`: live snapshots, pause and resume, creates from a snapshot and
//! forks of a sandbox whose workload holds M MiB, through the lifecycle API of a running
//! server, next to `runc checkpoint --leave-running` and `runc restore` of the same workload
//! on this machine, in one run. See `docs/bench.md`.
//!
//! - `workload`: the process that holds the memory; `message`: the server's cost messages;
//! - `fastbox`: the timed API operations, and the deletion of what they made;
//! - `runc`: the baseline; `report`: percentiles per metric, JSON and text.

mod fastbox;
mod message;
mod report;
mod runc;
mod workload;

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, ensure};
use serde_json::json;

pub use workload::Workload;

use crate::bench_create::client::BenchClient;
use crate::bench_create::request::{Pool, Source, create_body};
use crate::bench_runc;
use crate::client::api::ApiClient;
use crate::client::connection::ServerArgs;
use crate::paths::HostArgs;
use fastbox::Fastbox;
use report::{Baseline, FastboxSeries, Report};

/// Seconds until the source sandbox expires: the whole run, with room; a run that dies
/// half-way leaves nothing running for long.
const SOURCE_TIMEOUT_S: u64 = 1800;
/// The memory limit every benchmark sandbox gets at least (the SDK's default, 2Gi).
const MIN_MEMORY_LIMIT_MIB: u64 = 2048;
/// Room above the workload's data for the interpreter and execd.
const MEMORY_HEADROOM_MIB: u64 = 512;

#[derive(clap::Args, Debug)]
pub struct SnapshotBenchArgs {
    /// `--url` (or `--server`) and `--api-key`, as for the client commands.
    #[command(flatten)]
    pub connection: ServerArgs,
    /// The runc baseline's CRIU, image cache and directory (`DATA_DIR/bench-snapshot-P`).
    #[command(flatten)]
    pub host: HostArgs,
    /// Image of the sandbox (and the runc baseline's root).
    #[arg(long, default_value = "python:3.12", value_name = "REF")]
    pub image: String,
    /// What holds the memory: python3, or sh for images without python3 (busybox).
    #[arg(long, value_enum, default_value_t = Workload::Python)]
    pub workload: Workload,
    /// Resident memory the workload holds, in MiB.
    #[arg(long, default_value_t = 256, value_name = "M")]
    pub memory_mib: u64,
    /// Timed snapshots, pauses (each with its resume) and creates from a snapshot.
    #[arg(long, default_value_t = 5)]
    pub n: usize,
    /// Sandboxes each fork makes.
    #[arg(long, default_value_t = 10)]
    pub fork_count: u32,
    /// Timed forks (0: none).
    #[arg(long, default_value_t = 1)]
    pub fork_rounds: usize,
    /// Seconds any one operation may take before the run fails.
    #[arg(long, default_value_t = 120.0, value_name = "S")]
    pub ready_timeout: f64,
    /// Skip the runc baseline.
    #[arg(long)]
    pub no_runc: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// How the run was configured, as the report repeats it.
#[derive(Debug, serde::Serialize)]
pub struct Settings {
    pub image: String,
    pub workload: Workload,
    pub memory_mib: u64,
    pub n: usize,
    pub fork_count: u32,
    pub fork_rounds: usize,
}

pub fn snapshot(args: SnapshotBenchArgs) -> anyhow::Result<i32> {
    ensure!(args.n > 0, "--n must be at least 1");
    ensure!(args.memory_mib > 0, "--memory-mib must be at least 1");
    ensure!(args.fork_count > 0, "--fork-count must be at least 1");
    let timeout = Duration::try_from_secs_f64(args.ready_timeout)
        .ok()
        .filter(|t| !t.is_zero())
        .context("--ready-timeout must be a number of seconds > 0")?;
    let (server, api_key) = args.connection.resolve()?;
    let bench = BenchClient::try_new(&server, api_key.clone(), timeout)?;
    let api = ApiClient::try_new(server, api_key)?;
    let fastbox = {
        // Dropped at the end of this block: what it made is deleted, on failure too.
        let mut fastbox = Fastbox::new(bench, api, timeout);
        measure(&mut fastbox, &args)?
    };
    let (baseline, leftovers) = baseline(&args, timeout);
    let failed = matches!(baseline, Baseline::Failed(_)) || !leftovers.is_empty();
    let settings = Settings {
        image: args.image.clone(),
        workload: args.workload,
        memory_mib: args.memory_mib,
        n: args.n,
        fork_count: args.fork_count,
        fork_rounds: args.fork_rounds,
    };
    let report = Report::new(settings, &fastbox, baseline, leftovers);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.human());
    }
    Ok(if failed { 1 } else { 0 })
}

/// The memory limit of the source sandbox: the SDK's default, or more for a large workload.
fn memory_limit_mib(workload_mib: u64) -> u64 {
    (workload_mib + MEMORY_HEADROOM_MIB).max(MIN_MEMORY_LIMIT_MIB)
}

/// The fastbox side, step by step.
fn measure(fb: &mut Fastbox, args: &SnapshotBenchArgs) -> anyhow::Result<FastboxSeries> {
    let n = args.n;
    let mut body = create_body(&Source::Image(args.image.clone()), Pool::On, None);
    body["timeout"] = json!(SOURCE_TIMEOUT_S);
    body["resourceLimits"]["memory"] = json!(format!("{}Mi", memory_limit_mib(args.memory_mib)));
    eprintln!("bench snapshot: creating a sandbox of {}", args.image);
    let id = fb.create_source(&body)?;
    let rss_mib = fb.start_workload(&id, args.workload, args.memory_mib)?;
    eprintln!(
        "bench snapshot: {id}'s {} workload holds {rss_mib:.1} MiB",
        args.workload
    );
    let mut s = FastboxSeries {
        rss_mib,
        ..FastboxSeries::default()
    };

    eprintln!("bench snapshot: {n} live snapshots");
    for i in 0..n {
        let taken = fb.snapshot(&id)?;
        if i + 1 < n {
            fb.delete_snapshot(&taken.id)?;
        }
        s.snapshots.push(taken);
    }
    let last = s.snapshots.last().expect("n > 0").id.clone();

    eprintln!("bench snapshot: {n} pauses and resumes");
    for _ in 0..n {
        s.pauses.push(fb.pause(&id)?);
        s.resumes.push(fb.resume(&id)?);
    }

    eprintln!("bench snapshot: {n} creates from the last snapshot");
    for _ in 0..n {
        s.creates.push(fb.create_from(&last)?);
    }

    eprintln!(
        "bench snapshot: {} forks of {}",
        args.fork_rounds, args.fork_count
    );
    for _ in 0..args.fork_rounds {
        s.forks.push(fb.fork(&id, args.fork_count)?);
    }
    fb.delete_snapshot(&last)?;
    fb.delete_sandbox(&id)?;
    Ok(s)
}

/// The runc baseline, or why it did not run; and what it left on the host.
fn baseline(args: &SnapshotBenchArgs, timeout: Duration) -> (Baseline, Vec<String>) {
    if args.no_runc {
        return (Baseline::Skipped("--no-runc".into()), Vec::new());
    }
    if !nix::unistd::geteuid().is_root() {
        return (
            Baseline::Skipped("needs root (runc, mounts)".into()),
            Vec::new(),
        );
    }
    if let Err(reason) = bench_runc::available() {
        return (Baseline::Skipped(reason), Vec::new());
    }
    let criu = match args.host.criu() {
        Ok(criu) => criu,
        Err(e) => return (Baseline::Skipped(format!("{e:#}")), Vec::new()),
    };
    let image = match args.host.resolve_image(&args.image) {
        Ok(image) => image,
        Err(e) => return (Baseline::Failed(format!("{e:#}")), Vec::new()),
    };
    let prefix = format!("fbs{:04x}", rand::random::<u16>());
    let dir = args.host.data_dir.join(format!("bench-snapshot-{prefix}"));
    eprintln!(
        "bench snapshot: runc baseline in {} ({} checkpoints to tmpfs and to disk, {} restores)",
        dir.display(),
        args.n,
        args.n
    );
    let result = std::fs::create_dir_all(&dir)
        .with_context(|| format!("create {}", dir.display()))
        .and_then(|()| {
            runc::series(&runc::Plan {
                dir: &dir,
                rootfs: &image.rootfs,
                criu: &criu.path,
                prefix: &prefix,
                argv: args.workload.argv(args.memory_mib),
                mib: args.memory_mib,
                n: args.n,
                ready_timeout: timeout,
            })
        });
    let mut leftovers = bench_runc::leftover_containers(&dir);
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    leftovers.extend(mounts_under(&mountinfo, &dir));
    if leftovers.is_empty()
        && let Err(e) = std::fs::remove_dir_all(&dir)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        leftovers.push(format!("directory {} ({e})", dir.display()));
    }
    let baseline = match result {
        Ok(series) => Baseline::Ran(series),
        Err(e) => Baseline::Failed(format!("{e:#}")),
    };
    (baseline, leftovers)
}

/// The mount points of a `/proc/self/mountinfo` text at or below `dir`.
fn mounts_under(mountinfo: &str, dir: &Path) -> Vec<String> {
    mountinfo
        .lines()
        .filter_map(|line| line.split_whitespace().nth(4))
        .filter(|point| Path::new(point).starts_with(dir))
        .map(|point| format!("mount {point}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memory_limit_grows_with_the_workload() {
        assert_eq!(memory_limit_mib(16), 2048);
        assert_eq!(memory_limit_mib(256), 2048);
        assert_eq!(memory_limit_mib(4096), 4608);
    }

    #[test]
    fn mounts_below_the_run_directory_are_found() {
        let mountinfo = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
90 22 0:50 / /var/lib/fastbox/bench-snapshot-fbs1/tmpfs rw - tmpfs tmpfs rw
91 22 0:51 / /var/lib/fastbox/bench-snapshot-fbs10/rootfs rw - overlay overlay rw
";
        let dir = Path::new("/var/lib/fastbox/bench-snapshot-fbs1");
        assert_eq!(
            mounts_under(mountinfo, dir),
            ["mount /var/lib/fastbox/bench-snapshot-fbs1/tmpfs"]
        );
    }
}
