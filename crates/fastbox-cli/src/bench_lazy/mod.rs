//! `fastbox bench lazy`: restores of a checkpoint from artifact blocks, with the whole
//! checkpoint pulled first, next to lazy restores that start before its memory is local
//! (`fastbox_runtime::lazy`), measured in one run. See `docs/lazy.md`.
//!
//! A sandbox of the run's own instance (its prefix, address pool and directory
//! `DATA_DIR/bench-lazy-PREFIX`) runs the memory holder (`holder`: M MiB of pseudo-random
//! memory, a TCP port) on the image plus the holder (`rootfs`); it is checkpointed and the
//! checkpoint published as an artifact (kind `checkpoint`) into the origin store, and the
//! local checkpoint removed. Then, N times each way, alternating: a restore pulls from the
//! origin through a block source that adds `--block-delay-ms` per block (`source`), with
//! `--fetch-workers` threads (`pull`), and is timed until the holder answers, until its
//! checksum over all of its memory matches the one taken before the checkpoint, and until
//! every block is local (`restores`). `report` gives percentiles per mode.
//!
//! Everything the run makes carries its prefix and is removed at the end, on failure too
//! (purge of the instance, then a leftovers check that the report lists). With `--origin`
//! (an `s3://` URL), the run's index entry and manifest are deleted from it at the end; its
//! blocks are left to the store's garbage collection.

mod holder;
mod pull;
mod report;
mod restores;
mod rootfs;
mod source;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use fastbox_artifact::{
    ArtifactKind, ArtifactStore, EntryKind, IndexKey, NoProgress, read_manifest,
};
use fastbox_fastlet::artifact::{PublishOptions, publish_template};
use fastbox_fastlet::host::{LocalHost, StartOptions};
use fastbox_fastlet::node_store::StoreLocation;
use fastbox_fastlet::template::Template;
use fastbox_image::ResolvedImage;
use fastbox_runtime::criu::Criu;
use fastbox_runtime::execd_binary::ExecdBinary;
use fastbox_runtime::net::Ipv4Pool;

pub use holder::{HolderArgs, holder_main};

use crate::paths::{HostArgs, require_root};
use report::{CheckpointFacts, Report, Settings};
use restores::{Mode, Plan, Sample, is_pages_image, restore_once};
use rootfs::HolderRootfs;
use source::StoreBlocks;

/// The longest the holder may take to fill its memory and answer.
const HOLDER_START_TIMEOUT: Duration = Duration::from_secs(600);
/// The longest its checksum may take.
const CHECKSUM_TIMEOUT: Duration = Duration::from_secs(120);
/// The most characters of a prefix (`fastbox bench lazy`'s host-wide names add to it).
const MAX_PREFIX_LEN: usize = 7;

#[derive(clap::Args, Debug)]
pub struct LazyBenchArgs {
    /// CRIU, execd, the run's directory (`DATA_DIR/bench-lazy-PREFIX`), the image cache.
    #[command(flatten)]
    pub host: HostArgs,
    /// Image of the sandbox (the memory holder brings its own libraries).
    #[arg(long, default_value = "fastbox/busybox", value_name = "REF")]
    pub image: String,
    /// Pseudo-random memory the holder keeps, in MiB.
    #[arg(long, default_value_t = 512, value_name = "M")]
    pub memory_mib: u64,
    /// Timed restores of each kind.
    #[arg(long, default_value_t = 5)]
    pub n: usize,
    /// Simulated latency of every block fetched from the origin, in milliseconds.
    #[arg(long, default_value_t = 25, value_name = "D")]
    pub block_delay_ms: u64,
    /// Threads fetching blocks, in both modes.
    #[arg(long, default_value_t = 4, value_name = "W")]
    pub fetch_workers: usize,
    /// The origin store (`s3://bucket/prefix?endpoint=URL`, credentials from the
    /// environment, or an absolute directory) [default: a local store in the run's
    /// directory].
    #[arg(long, value_name = "URL")]
    pub origin: Option<String>,
    /// Prefix of the run's host-wide names, at most 7 of [a-z0-9] [default: fbl + 4 random
    /// hex digits].
    #[arg(long)]
    pub prefix: Option<String>,
    /// Address pool of the run's sandboxes, BASE/LEN.
    #[arg(long, default_value = "10.90.0.0/24", value_name = "BASE/LEN")]
    pub pool: Ipv4Pool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// What one run works with.
struct Run<'a> {
    args: &'a LazyBenchArgs,
    prefix: String,
    /// `DATA_DIR/bench-lazy-PREFIX`, removed at the end.
    dir: PathBuf,
    image: ResolvedImage,
    criu: Criu,
    execd: PathBuf,
    exe: PathBuf,
    origin: StoreLocation,
}

pub fn lazy(args: LazyBenchArgs) -> anyhow::Result<i32> {
    require_root()?;
    ensure!(args.n > 0, "--n must be at least 1");
    ensure!(args.memory_mib > 0, "--memory-mib must be at least 1");
    ensure!(args.fetch_workers > 0, "--fetch-workers must be at least 1");
    let prefix = crate::paths::run_prefix(args.prefix.as_deref(), "fbl", MAX_PREFIX_LEN)?;
    let dir = args.host.data_dir.join(format!("bench-lazy-{prefix}"));
    ensure!(!dir.exists(), "{} already exists", dir.display());
    let origin = match &args.origin {
        Some(url) => StoreLocation::parse(url)?,
        None => StoreLocation::Local(dir.join("store")),
    };
    let image = args.host.resolve_image(&args.image)?;
    let run = Run {
        args: &args,
        prefix,
        image,
        criu: args.host.criu()?,
        execd: args.host.execd()?,
        exe: std::env::current_exe().context("locate the fastbox executable")?,
        origin,
        dir,
    };
    std::fs::create_dir_all(&run.dir).with_context(|| format!("create {}", run.dir.display()))?;
    let measured = measure(&run);
    let purged = fastbox_fastlet::host::purge(&run.prefix, &run.dir.join("data"));
    let removed = std::fs::remove_dir_all(&run.dir);
    let leftovers = fastbox_fastlet::host::leftovers(&run.prefix);
    let (checkpoint, samples) = measured?;
    purged.context("purge the run's instance")?;
    removed.with_context(|| format!("remove {}", run.dir.display()))?;
    let settings = Settings {
        image: args.image.clone(),
        memory_mib: args.memory_mib,
        n: args.n,
        block_delay_ms: args.block_delay_ms,
        fetch_workers: args.fetch_workers,
        origin: run.origin.to_string(),
    };
    let report = Report::new(settings, checkpoint, samples, leftovers);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.human());
    }
    Ok(if report.passed() { 0 } else { 1 })
}

/// The run's instance: set up, measured, torn down.
fn measure(run: &Run<'_>) -> anyhow::Result<(CheckpointFacts, Vec<Sample>)> {
    let rootfs = HolderRootfs::build(&run.image.rootfs, &run.dir.join("rootfs"), &run.exe)?;
    let data = run.dir.join("data");
    let execd = ExecdBinary::import(&run.execd, &data)?;
    let host = LocalHost::try_new(&run.prefix, &data, &run.exe, run.args.pool)?;
    let measured = with_host(run, &host, &rootfs, &execd);
    let torn_down = host.teardown();
    let measured = measured?;
    torn_down.context("tear the run's instance down")?;
    Ok(measured)
}

fn with_host(
    run: &Run<'_>,
    host: &LocalHost,
    rootfs: &HolderRootfs,
    execd: &ExecdBinary,
) -> anyhow::Result<(CheckpointFacts, Vec<Sample>)> {
    let store = run
        .origin
        .open(&|name| std::env::var(name).ok())
        .context("open the origin")?;
    let checkpoint = run.dir.join("checkpoint");
    eprintln!(
        "bench lazy: a sandbox of {} holding {} MiB, checkpointed",
        run.args.image, run.args.memory_mib
    );
    let (mut facts, reference) = checkpoint_holder(run, host, rootfs, execd, &checkpoint)?;
    let key = IndexKey::try_new(format!("bench-lazy/{}", run.prefix))?;
    let clock = Instant::now();
    let template = Template {
        key: String::new(),
        image_digest: run.image.digest.clone(),
        image_reference: run.image.canonical_reference.clone(),
        rootfs: rootfs.dir.clone(),
        checkpoint: checkpoint.clone(),
        golden_token: format!("{:032x}", rand::random::<u128>()),
        build_ms: 0,
    };
    let mut options = PublishOptions::new(key.as_str(), &run.dir);
    options.kind = ArtifactKind::Checkpoint;
    let published = publish_template(store.as_ref(), &template, &options, &NoProgress)?;
    facts.publish_ms = clock.elapsed().as_micros() as f64 / 1000.0;
    // Restores find nothing of the checkpoint on the node: only the origin has it.
    std::fs::remove_dir_all(&checkpoint)
        .with_context(|| format!("remove {}", checkpoint.display()))?;
    let timed = read_manifest(store.as_ref(), &published.manifest)
        .map_err(anyhow::Error::from)
        .and_then(|manifest| {
            count_files(&manifest, &mut facts);
            let source = Arc::new(StoreBlocks::delayed(
                store.clone(),
                Duration::from_millis(run.args.block_delay_ms),
            ));
            let plan = Plan {
                host,
                criu: &run.criu,
                manifest: &manifest,
                source: &source,
                rootfs: &rootfs.dir,
                execd_store: &run.dir.join("data"),
                dir: &run.dir,
                fetch_workers: run.args.fetch_workers,
                reference,
            };
            restore_all(&plan, run.args.n)
        });
    let unpublished = unpublish(store.as_ref(), &key, &published.manifest);
    let samples = timed?;
    unpublished.context("remove the run's artifact from the origin")?;
    Ok((facts, samples))
}

/// `n` restores each way, alternating (so drift on the machine affects both alike).
fn restore_all(plan: &Plan<'_>, n: usize) -> anyhow::Result<Vec<Sample>> {
    let mut samples = Vec::with_capacity(2 * n);
    for i in 0..n {
        for mode in [Mode::Full, Mode::Lazy] {
            let sample = restore_once(plan, mode, i)?;
            eprintln!(
                "bench lazy: {mode:?} restore {i}: answers after {:.1} ms, checksum {} after \
                 {:.1} ms, every block local after {:.1} ms",
                sample.answer.as_micros() as f64 / 1000.0,
                if sample.checksum_ok {
                    "matches"
                } else {
                    "DIFFERS"
                },
                sample.checksum.as_micros() as f64 / 1000.0,
                sample.all_local.as_micros() as f64 / 1000.0,
            );
            samples.push(sample);
        }
    }
    Ok(samples)
}

/// The checkpoint's size from its manifest: files, blocks, pages images.
fn count_files(manifest: &fastbox_artifact::Manifest, facts: &mut CheckpointFacts) {
    for entry in &manifest.files {
        if let EntryKind::File { size, blocks } = &entry.kind {
            facts.bytes += size;
            facts.blocks += blocks.len() as u64;
            if is_pages_image(&entry.path) {
                facts.pages_bytes += size;
            }
        }
    }
}

/// Removes the run's index entry and manifest from the origin (a local origin in the run's
/// directory goes with it; the blocks of a remote one are left to its garbage collection:
/// blocks are shared by content, so only a collector can tell which are unreferenced).
fn unpublish(
    store: &dyn ArtifactStore,
    key: &IndexKey,
    manifest: &fastbox_artifact::Digest,
) -> anyhow::Result<()> {
    store.index_delete(key)?;
    store.delete_manifest(manifest)?;
    Ok(())
}

/// Starts the holder in a sandbox, takes its checksum, and checkpoints it into `out` (which
/// ends the sandbox); the facts so far and the checksum.
fn checkpoint_holder(
    run: &Run<'_>,
    host: &LocalHost,
    rootfs: &HolderRootfs,
    execd: &ExecdBinary,
    out: &Path,
) -> anyhow::Result<(CheckpointFacts, u64)> {
    let opts = StartOptions {
        id: format!("{}-src", run.prefix),
        deny_egress: true,
        ..Default::default()
    };
    let sandbox = host.start(&rootfs.dir, execd, 0, &opts)?;
    let addr = SocketAddr::from((sandbox.slot.address, holder::PORT));
    let started = (|| {
        let clock = Instant::now();
        let argv = ["/bin/sh", "-c", &rootfs.start_command(run.args.memory_mib)]
            .map(String::from)
            .to_vec();
        let code = sandbox.execd.run(&argv, |_| {})?;
        ensure!(code == 0, "starting the memory holder exited {code}");
        holder::wait_answer(addr, Instant::now() + HOLDER_START_TIMEOUT)?;
        let holder_start = clock.elapsed();
        let (now, at_start) = holder::checksums(addr, CHECKSUM_TIMEOUT)?;
        ensure!(
            now == at_start,
            "the holder's memory changed before the checkpoint"
        );
        Ok((holder_start, now))
    })();
    let (holder_start, reference) = match started {
        Ok(started) => started,
        Err(e) => {
            let _ = host.destroy(&sandbox);
            return Err(e);
        }
    };
    let clock = Instant::now();
    if let Err(e) = host.checkpoint(&run.criu, &sandbox, out) {
        let _ = host.destroy(&sandbox);
        return Err(e).context("checkpoint the holder's sandbox");
    }
    let facts = CheckpointFacts {
        holder_start_ms: holder_start.as_micros() as f64 / 1000.0,
        checkpoint_ms: clock.elapsed().as_micros() as f64 / 1000.0,
        ..CheckpointFacts::default()
    };
    Ok((facts, reference))
}
