//! `fastbox bench pool-memory`: what an idle pooled sandbox of a running instance costs in
//! memory, read from its processes' `smaps_rollup` (private pages are its own; PSS shares out
//! what it maps with other sandboxes of the same template: the image's files, the pages CRIU
//! restored).

use std::path::PathBuf;

use anyhow::Context;
use fastbox_fastlet::memory::{MemoryUse, sandbox_memory};
use fastbox_fastlet::pool::POOL_ID_PREFIX;
use fastbox_runtime::cgroup::CgroupRoot;

#[derive(clap::Args, Debug)]
pub struct PoolMemoryArgs {
    /// The instance's prefix.
    #[arg(long, env = "FASTBOX_PREFIX")]
    pub prefix: String,
    /// The instance's data directory [default: /var/lib/fastbox].
    #[arg(long, env = "FASTBOX_DATA_DIR", default_value = "/var/lib/fastbox")]
    pub data_dir: PathBuf,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, serde::Serialize)]
struct Report {
    pooled: usize,
    median_private_bytes: u64,
    median_pss_bytes: u64,
    median_rss_bytes: u64,
    sandboxes: Vec<(String, MemoryUse)>,
}

pub fn pool_memory(args: PoolMemoryArgs) -> anyhow::Result<i32> {
    crate::paths::require_root()?;
    let cgroups = CgroupRoot::detect().context("cgroups")?;
    let dir = args.data_dir.join("sandboxes");
    let mut sandboxes = Vec::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("{}", dir.display()))? {
        let id = entry?.file_name().to_string_lossy().into_owned();
        if id.starts_with(POOL_ID_PREFIX)
            && let Ok(used) = sandbox_memory(&cgroups, &args.prefix, &id)
            && used.processes > 0
        {
            sandboxes.push((id, used));
        }
    }
    anyhow::ensure!(
        !sandboxes.is_empty(),
        "no pooled sandbox of instance {} in {}",
        args.prefix,
        dir.display()
    );
    let median = |f: fn(&MemoryUse) -> u64| {
        let mut v: Vec<u64> = sandboxes.iter().map(|(_, m)| f(m)).collect();
        v.sort_unstable();
        v[(v.len() - 1) / 2]
    };
    let report = Report {
        pooled: sandboxes.len(),
        median_private_bytes: median(|m| m.private_bytes),
        median_pss_bytes: median(|m| m.pss_bytes),
        median_rss_bytes: median(|m| m.rss_bytes),
        sandboxes,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        println!(
            "{} idle pooled sandboxes of {}: median private {:.1} MiB, PSS {:.1} MiB, RSS {:.1} MiB",
            report.pooled,
            args.prefix,
            mib(report.median_private_bytes),
            mib(report.median_pss_bytes),
            mib(report.median_rss_bytes)
        );
        for (id, m) in &report.sandboxes {
            println!(
                "  {id}: {} processes, private {:.1} MiB, PSS {:.1} MiB, RSS {:.1} MiB",
                m.processes,
                mib(m.private_bytes),
                mib(m.pss_bytes),
                mib(m.rss_bytes)
            );
        }
    }
    Ok(0)
}
