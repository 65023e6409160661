//! `fastbox bench restore`: the node-side restore of an image's golden checkpoint next to
//! `runc restore` of clones of a checkpoint of the same workload, in one run, with CRIU's
//! own `stats-restore` of each side. See `docs/bench.md`.
//!
//! - `fastbox`: a fastlet of the run's own, `restore_from` timed N times;
//! - `runc`: the template container, its checkpoint, N clones from their own bundles;
//! - `report`: percentiles, CRIU's timings, JSON and text.

mod fastbox;
mod report;
mod runc;

use std::path::PathBuf;

use anyhow::{Context, ensure};
use fastbox_cli::paths::{HostArgs, require_root};
use fastbox_runtime::criu::Criu;
use fastbox_runtime::net::Ipv4Pool;

use report::Report;

#[derive(clap::Args, Debug)]
pub struct RestoreBenchArgs {
    #[command(flatten)]
    pub host: HostArgs,
    /// Image whose golden checkpoint is restored.
    #[arg(long, default_value = "python:3.12", value_name = "REF")]
    pub image: String,
    /// Timed restores on each side.
    #[arg(long, default_value_t = 20)]
    pub n: usize,
    /// Prefix of the run's host-wide names (at most 8 of [a-z0-9]) [default: fbr + 4
    /// random hex digits].
    #[arg(long)]
    pub prefix: Option<String>,
    /// Address pool of the run's fastlet, BASE/LEN.
    #[arg(long, default_value = "10.88.0.0/24", value_name = "BASE/LEN")]
    pub pool: Ipv4Pool,
    /// Spare slots (network slot + empty writable layer) the run's fastlet keeps made ahead,
    /// as `fastbox up --spare-slots` does; 0: every restore makes its own slot.
    #[arg(long, default_value_t = fastbox_server::config::DEFAULT_SPARE_SLOTS, value_name = "K")]
    pub spare_slots: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One run's settings, shared by both sides.
pub struct Run {
    pub prefix: String,
    /// The run's own directory (`DATA_DIR/bench-restore-PREFIX`), removed at the end.
    pub dir: PathBuf,
    pub pool: Ipv4Pool,
    pub execd: PathBuf,
    pub criu: Criu,
    pub image: String,
    pub n: usize,
    pub spare_slots: usize,
}

pub fn restore(args: RestoreBenchArgs) -> anyhow::Result<i32> {
    require_root()?;
    ensure!(args.n > 0, "--n must be at least 1");
    let prefix = fastbox_cli::paths::run_prefix(args.prefix.as_deref(), "fbr", 8)?;
    let image = args.host.resolve_image(&args.image)?;
    let run = Run {
        dir: args.host.data_dir.join(format!("bench-restore-{prefix}")),
        prefix,
        pool: args.pool,
        execd: args.host.execd()?,
        criu: args.host.criu()?,
        image: args.image.clone(),
        n: args.n,
        spare_slots: args.spare_slots,
    };
    std::fs::create_dir_all(&run.dir).with_context(|| format!("create {}", run.dir.display()))?;

    let fastlet_dir = run.dir.join("fastlet");
    let config = args.host.fastlet_config(fastbox_cli::paths::RunFastlet {
        prefix: &run.prefix,
        data_dir: fastlet_dir.clone(),
        pool: run.pool,
        spare_slots: run.spare_slots,
        artifact_store: fastbox_fastlet::node_store::open_local(&fastlet_dir)?,
    })?;
    let fastbox = fastbox::series(&run, config, &image);
    let purged = fastbox_fastlet::host::purge(&run.prefix, &run.dir.join("fastlet"));
    let runc = match &fastbox {
        Ok(_) => {
            eprintln!(
                "runc: checkpoint of the same workload, then {} clones",
                run.n
            );
            Some(runc::series(&run, &image.rootfs))
        }
        Err(_) => None,
    };
    let mut leftovers = runc::leftover_containers(&run);
    let removed = std::fs::remove_dir_all(&run.dir);
    leftovers.extend(fastbox_fastlet::host::leftovers(&run.prefix));
    let fastbox = fastbox.context("fastbox restores")?;
    let runc = runc.expect("runc ran").context("runc restores")?;
    purged.context("purge the run's fastlet")?;
    removed.with_context(|| format!("remove {}", run.dir.display()))?;

    let report = Report::new(
        &args.image,
        image.served_by,
        args.spare_slots,
        &fastbox,
        &runc,
        leftovers,
    );
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.human());
    }
    Ok(0)
}
