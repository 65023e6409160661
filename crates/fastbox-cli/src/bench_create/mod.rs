//! `fastbox bench create`: create -> execd `/ping` 200 through the lifecycle API, the way a
//! client sees it, with nearest-rank percentiles. See `docs/bench.md`.
//!
//! - `request`: the create body (image or template, `--pool off`);
//! - `client`: one worker's timed create, readiness polling and untimed delete;
//! - `run`: warm-ups, workers back to back or in batches, progress;
//! - `stats`: percentiles and failure counts; `report`: JSON and text.

pub(crate) mod client;
mod report;
pub(crate) mod request;
pub(crate) mod run;
pub(crate) mod stats;

use std::time::Duration;

use anyhow::ensure;

pub use request::Pool;

use crate::client::connection::ServerArgs;
use client::BenchClient;
use report::{Report, Settings};
use request::Source;
use run::{Pace, Plan};

#[derive(clap::Args, Debug)]
pub struct CreateBenchArgs {
    /// `--url` (or `--server`) and `--api-key`, as for the client commands.
    #[command(flatten)]
    pub connection: ServerArgs,
    /// Timed creates.
    #[arg(long, default_value_t = 100)]
    pub n: usize,
    /// Creates in flight at once (one worker thread each).
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    /// Image of every sandbox.
    #[arg(long, default_value = "python:3.12", value_name = "REF")]
    pub image: String,
    /// Create from this template (`templateId`) instead of an image.
    #[arg(long, value_name = "ID", conflicts_with = "image")]
    pub template: Option<String>,
    /// `off`: ask the server not to use a pre-restored sandbox (extension fastbox.io/pool).
    #[arg(long, value_enum, default_value_t = Pool::On)]
    pub pool: Pool,
    /// Run in batches of CONCURRENCY creates with this many seconds between them, instead
    /// of back to back; a batch's sandboxes are deleted once all its creates are ready.
    #[arg(long, value_name = "S")]
    pub batch_pause: Option<f64>,
    /// Send this `networkPolicy` (JSON) with every create, e.g.
    /// '{"defaultAction":"deny","egress":[{"action":"allow","target":"files.example.org"}]}'.
    #[arg(long, value_name = "JSON", value_parser = parse_policy)]
    pub network_policy: Option<serde_json::Value>,
    /// Untimed creates before the timed ones.
    #[arg(long, default_value_t = 0, value_name = "W")]
    pub warmup: usize,
    /// Seconds a sandbox may take to be ready before its create counts as failed.
    #[arg(long, default_value_t = 60.0, value_name = "S")]
    pub ready_timeout: f64,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

fn parse_policy(text: &str) -> Result<serde_json::Value, String> {
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(v) if v.is_object() => Ok(v),
        Ok(_) => Err("a JSON object, as networkPolicy of a create".into()),
        Err(e) => Err(format!("not JSON: {e}")),
    }
}

impl CreateBenchArgs {
    fn source(&self) -> Source {
        match &self.template {
            Some(id) => Source::Template(id.clone()),
            None => Source::Image(self.image.clone()),
        }
    }
}

pub fn create(args: CreateBenchArgs) -> anyhow::Result<i32> {
    ensure!(args.n > 0, "--n must be at least 1");
    ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    let ready_timeout = seconds("--ready-timeout", args.ready_timeout)?;
    let batch_pause = args
        .batch_pause
        .map(|s| seconds("--batch-pause", s))
        .transpose()?;
    let (server, api_key) = args.connection.resolve()?;
    let source = args.source();
    let plan = Plan {
        n: args.n,
        pace: batch_pause.map_or(Pace::BackToBack, |pause| Pace::Batches { pause }),
        body: request::create_body(&source, args.pool, args.network_policy.as_ref()),
        ready_timeout,
    };
    let workers = args.concurrency.min(args.n);
    let clients = (0..workers)
        .map(|_| BenchClient::try_new(&server, api_key.clone(), ready_timeout))
        .collect::<Result<Vec<_>, _>>()?;

    let warmup_failures = run::warm_up(&clients[0], &plan, args.warmup);
    let (tally, wall) = run::measure(&clients, &plan);
    let settings = Settings {
        concurrency: args.concurrency,
        source: &source,
        pool: args.pool,
        batch_pause,
        warmup: args.warmup,
        ready_timeout,
    };
    let report = Report::new(&settings, warmup_failures, tally, wall);
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", report.human());
    }
    Ok(0)
}

fn seconds(flag: &str, value: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(value)
        .map_err(|_| anyhow::anyhow!("{flag} must be a number of seconds >= 0, not {value}"))
}
