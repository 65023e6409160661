//! `fastbox bench cold-start`: start -> execd `/ping` 200 for cold starts from an image,
//! side by side with `runc run` of the same rootfs running the same execd, measured in one run.

use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::bail;
use fastbox_runtime::execd_binary::ExecdBinary;
use fastbox_runtime::spec::EXECD_SANDBOX_PATH;

use crate::execd_client::ExecdClient;
use crate::local_sandbox::{LocalHost, StartOptions};
use crate::paths::HostArgs;

#[derive(clap::Args, Debug)]
pub struct ColdStartArgs {
    #[command(flatten)]
    pub host: HostArgs,
    /// Image to start.
    #[arg(long, default_value = "python:3.12")]
    pub image: String,
    /// Number of starts of each kind.
    #[arg(long, default_value_t = 20)]
    pub n: usize,
    /// Skip the runc baseline.
    #[arg(long)]
    pub no_runc: bool,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Latency percentiles of one series, in milliseconds. Nearest rank: pN is the value at rank
/// `ceil(N/100 * n)` (1-based) of the sorted samples (see `docs/bench.md`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Percentiles {
    pub n: usize,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
}

impl Percentiles {
    /// The percentiles of `samples`, which must not be empty.
    pub fn of(samples: &[Duration]) -> Self {
        let mut ms: Vec<f64> = samples
            .iter()
            .map(|d| d.as_micros() as f64 / 1000.0)
            .collect();
        ms.sort_by(f64::total_cmp);
        // Integer arithmetic: `0.99 * 100.0` must not become rank 100 through rounding.
        let at = |percent: usize| ms[(percent * ms.len()).div_ceil(100).clamp(1, ms.len()) - 1];
        Self {
            n: ms.len(),
            p50_ms: at(50),
            p90_ms: at(90),
            p99_ms: at(99),
            min_ms: ms[0],
            max_ms: ms[ms.len() - 1],
        }
    }

    /// The percentiles of `samples`, or None when there are none.
    pub fn of_some(samples: &[Duration]) -> Option<Self> {
        (!samples.is_empty()).then(|| Self::of(samples))
    }

    /// `n=20  p50 12.3 ms  p90 ...` for a terminal.
    pub fn line(&self) -> String {
        format!(
            "n={:<4} p50 {:>8.1} ms  p90 {:>8.1} ms  p99 {:>8.1} ms  (min {:.1}, max {:.1})",
            self.n, self.p50_ms, self.p90_ms, self.p99_ms, self.min_ms, self.max_ms
        )
    }
}

pub fn cold_start(args: ColdStartArgs) -> anyhow::Result<i32> {
    crate::paths::require_root()?;
    anyhow::ensure!(args.n > 0, "--n must be at least 1");
    let image = args.host.resolve_image(&args.image)?;
    let execd_path = args.host.execd()?;
    let execd = ExecdBinary::import(&execd_path, &args.host.data_dir)?;
    let prefix = format!("fbb{:04x}", rand::random::<u16>());
    let data_dir = args.host.data_dir.join(&prefix);
    let pool = fastbox_runtime::net::Ipv4Pool::try_new(std::net::Ipv4Addr::new(10, 89, 0, 0), 16)?;
    let host = LocalHost::try_new(&prefix, &data_dir, &std::env::current_exe()?, pool)?;

    let mut fastbox = Vec::with_capacity(args.n);
    let measured = (0..args.n).try_for_each(|i| {
        let opts = StartOptions {
            id: format!("{prefix}-{i}"),
            ..Default::default()
        };
        let start = Instant::now();
        let sandbox = host.start(&image.rootfs, &execd, i as u32, &opts)?;
        fastbox.push(start.elapsed());
        host.destroy(&sandbox)
    });
    let torn_down = host.teardown();
    let _ = std::fs::remove_dir_all(&data_dir);
    measured?;
    torn_down?;

    let runc = if args.no_runc {
        None
    } else {
        Some(runc_series(&image.rootfs, &execd.path, args.n)?)
    };
    let report = serde_json::json!({
        "image": args.image,
        "served_by": image.served_by,
        "fastbox_cold_start_to_ping": Percentiles::of(&fastbox),
        "runc_run_to_ping": runc.as_deref().map(Percentiles::of),
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        let line = |name: &str, p: &Percentiles| println!("{name:<28} {}", p.line());
        println!("cold start -> execd /ping 200, image {}", args.image);
        line("fastbox sandbox start", &Percentiles::of(&fastbox));
        if let Some(runc) = &runc {
            line("runc run (same rootfs)", &Percentiles::of(runc));
        }
    }
    Ok(0)
}

/// `runc run -d` of `rootfs` with execd (see [`runc_bundle`]) as the container process, timed
/// until `/ping` answers; `n` times.
fn runc_series(rootfs: &Path, execd: &Path, n: usize) -> anyhow::Result<Vec<Duration>> {
    let bundle = tempfile::tempdir()?;
    let port = free_port()?;
    runc_bundle(bundle.path(), rootfs, execd, port)?;
    let client = ExecdClient::new(format!("http://127.0.0.1:{port}"), None)?;
    let mut samples = Vec::with_capacity(n);
    for i in 0..n {
        let id = format!("fastbox-bench-runc-{}-{i}", std::process::id());
        let start = Instant::now();
        let status = Command::new("runc")
            .args(["run", "-d", "--bundle"])
            .arg(bundle.path())
            .arg(&id)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()?;
        let ready = status
            .success()
            .then(|| client.wait_ready(Duration::from_secs(20)));
        samples.push(start.elapsed());
        let _ = Command::new("runc").args(["delete", "-f", &id]).status();
        match ready {
            Some(Ok(_)) => {}
            Some(Err(e)) => return Err(anyhow::Error::from(e).context("runc container's execd")),
            None => bail!("runc run failed ({status})"),
        }
    }
    Ok(samples)
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Writes `BUNDLE/config.json` for the runc baselines of execd (see
/// [`crate::bench_runc::write_bundle`]): execd bind-mounted read-only at its sandbox path and
/// run as the container process on `127.0.0.1:port`.
pub fn runc_bundle(bundle: &Path, rootfs: &Path, execd: &Path, port: u16) -> anyhow::Result<()> {
    let args = [
        EXECD_SANDBOX_PATH.to_string(),
        "--port".into(),
        port.to_string(),
    ];
    crate::bench_runc::write_bundle(bundle, rootfs, &args, &[(EXECD_SANDBOX_PATH, execd)])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(values: &[u64]) -> Vec<Duration> {
        values.iter().map(|v| Duration::from_millis(*v)).collect()
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let twenty: Vec<u64> = (1..=20).collect();
        let p = Percentiles::of(&ms(&twenty));
        assert_eq!((p.p50_ms, p.p90_ms, p.p99_ms), (10.0, 18.0, 20.0));
        assert_eq!((p.min_ms, p.max_ms, p.n), (1.0, 20.0, 20));
        let p = Percentiles::of(&ms(&[30, 10, 20]));
        assert_eq!((p.p50_ms, p.p90_ms, p.p99_ms), (20.0, 30.0, 30.0));
        let p = Percentiles::of(&[Duration::from_micros(1500)]);
        assert_eq!((p.p50_ms, p.min_ms, p.max_ms), (1.5, 1.5, 1.5));
        assert_eq!(Percentiles::of_some(&[]), None);
    }
}
