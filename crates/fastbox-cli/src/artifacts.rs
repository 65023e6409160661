//! `fastbox artifacts gc`: one garbage collection of an artifact store, by hand.
//!
//! The store is `--artifact-store` (an absolute directory or `s3://bucket/prefix?endpoint=`,
//! credentials from `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY`), else the local store of
//! `--data-dir` (`DATA_DIR/artifacts`). The collection marks from the store's index: every
//! template, snapshot and pause checkpoint a server relies on has an index entry, so a
//! running server's artifacts are safe. What this command cannot see are a server's pins
//! (manifests it still remembers for keys whose index entry went missing, `docs/server.md`);
//! the server's own periodic collection uses them. Objects written within `--grace` are
//! never deleted, so publishes in flight keep their blocks; a grace shorter than the longest
//! publish is unsafe while servers publish.
//!
//! Prints the report (`fastbox_server::artifact_gc::report`): text, or JSON with `--json`.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use fastbox_artifact::{GcOptions, collect_garbage};
use fastbox_fastlet::node_store::StoreLocation;
use fastbox_server::artifact_gc::report;
use fastbox_server::config::{DEFAULT_DATA_DIR, format_duration, parse_duration};

/// `fastbox artifacts gc` flags.
#[derive(clap::Args, Debug)]
pub struct GcArgs {
    /// The store: an absolute directory or `s3://BUCKET[/PREFIX]?endpoint=URL`; wins over
    /// --data-dir.
    #[arg(long, env = "FASTBOX_ARTIFACT_STORE")]
    pub artifact_store: Option<String>,
    /// Collect the local store of this data directory (DATA_DIR/artifacts)
    /// [default: /var/lib/fastbox].
    #[arg(long, env = "FASTBOX_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Objects written or re-put more recently than this are kept: `24h`, `30m`, `90s`.
    #[arg(long, default_value = "24h", value_parser = parse_duration)]
    pub grace: Duration,
    /// Report what would be deleted; delete nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Also remove index entries whose manifest is missing, corrupt or lists a missing block,
    /// so the next build publishes them again.
    #[arg(long)]
    pub drop_broken: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

impl GcArgs {
    fn location(&self) -> anyhow::Result<StoreLocation> {
        match &self.artifact_store {
            Some(text) => StoreLocation::parse(text).context("--artifact-store"),
            None => Ok(StoreLocation::local_default(
                self.data_dir
                    .as_deref()
                    .unwrap_or(std::path::Path::new(DEFAULT_DATA_DIR)),
            )),
        }
    }
}

/// Collects the store's garbage once and prints the report.
pub fn gc(args: GcArgs) -> anyhow::Result<i32> {
    let location = args.location()?;
    // The store's errors say what failed, their causes included.
    let store = location
        .open(&|name| std::env::var(name).ok())
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let options = GcOptions {
        grace: args.grace,
        pinned: Default::default(),
        dry_run: args.dry_run,
        drop_broken: args.drop_broken,
    };
    let gc_report = collect_garbage(store.as_ref(), &options)
        .map_err(|e| anyhow::anyhow!("artifact store {location}: {e}"))?;
    let text = if args.json {
        let mut json = report::to_json(&gc_report);
        json["store"] = location.to_string().into();
        json["grace_seconds"] = args.grace.as_secs().into();
        format!("{}\n", serde_json::to_string_pretty(&json)?)
    } else {
        format!(
            "artifact store {location} (grace {}):\n{}",
            format_duration(args.grace),
            report::to_text(&gc_report)
        )
    };
    std::io::stdout()
        .lock()
        .write_all(text.as_bytes())
        .context("write the report")?;
    Ok(0)
}
