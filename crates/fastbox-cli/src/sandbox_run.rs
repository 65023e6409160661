//! `fastbox sandbox run IMAGE [-- CMD...]`: the runtime without a server. Resolves the image,
//! starts a sandbox with execd, runs the command through execd (streaming its output), and
//! removes the sandbox afterwards.

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use fastbox_api::quantity;
use fastbox_runtime::cgroup::CgroupLimits;
use fastbox_runtime::execd_binary::ExecdBinary;

use crate::local_sandbox::{LocalHost, StartOptions};
use crate::paths::HostArgs;

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub host: HostArgs,
    /// CPU limit, e.g. `500m` or `2`.
    #[arg(long)]
    pub cpu: Option<String>,
    /// Memory limit, e.g. `512Mi`.
    #[arg(long)]
    pub memory: Option<String>,
    /// Size of the writable layer, e.g. `1Gi` (default 10Gi, sparse).
    #[arg(long)]
    pub disk: Option<String>,
    /// Maximum number of processes.
    #[arg(long, default_value_t = fastbox_runtime::spec::DEFAULT_PIDS)]
    pub pids: u64,
    /// Environment variables, `KEY=VALUE`.
    #[arg(long = "env", short = 'e')]
    pub env: Vec<String>,
    /// Keep the sandbox after the command (or without one) until Ctrl-C.
    #[arg(long)]
    pub keep: bool,
    /// Slot addresses, `BASE/LEN`; must not overlap another instance's or a host network.
    #[arg(long, default_value = "10.88.0.0/16")]
    pub pool: String,
    /// The image reference.
    pub image: String,
    /// The command to run inside, after `--`.
    #[arg(last = true)]
    pub command: Vec<String>,
}

impl RunArgs {
    fn pool(&self) -> anyhow::Result<fastbox_runtime::net::Ipv4Pool> {
        let (base, len) = self
            .pool
            .split_once('/')
            .context("--pool: expected BASE/LEN")?;
        Ok(fastbox_runtime::net::Ipv4Pool::try_new(
            base.parse()?,
            len.parse()?,
        )?)
    }
}

pub fn run(args: RunArgs) -> anyhow::Result<i32> {
    crate::paths::require_root()?;
    args.host.criu()?;
    let limits = CgroupLimits {
        cpu_millis: args
            .cpu
            .as_deref()
            .map(quantity::parse_cpu_millis)
            .transpose()?,
        memory_bytes: args
            .memory
            .as_deref()
            .map(quantity::parse_bytes)
            .transpose()?,
        pids: Some(args.pids),
    };
    let disk_bytes = args
        .disk
        .as_deref()
        .map(quantity::parse_bytes)
        .transpose()?;
    for kv in &args.env {
        anyhow::ensure!(kv.contains('='), "--env {kv:?}: expected KEY=VALUE");
    }

    let image = args.host.resolve_image(&args.image)?;
    if let Some(served_by) = &image.served_by {
        eprintln!(
            "fastbox: {} served by the offline recipe {served_by}",
            args.image
        );
    }

    let execd = ExecdBinary::import(&args.host.execd()?, &args.host.data_dir)?;
    let prefix = format!("fbr{:04x}", rand::random::<u16>());
    let helper = std::env::current_exe()?;
    let host = LocalHost::try_new(
        &prefix,
        &args.host.data_dir.join(&prefix),
        &helper,
        args.pool()?,
    )?;
    let opts = StartOptions {
        id: format!("{prefix}-sb"),
        limits,
        disk_bytes,
        env: args.env.clone(),
        entrypoint: vec![],
        execd_token: None,
        deny_egress: false,
        probe_without_token: false,
        policy: None,
        keep_tcp: false,
        lazy_memory: false,
        remote_memory: None,
        external_mounts: Vec::new(),
        isolation: false,
    };
    let started = Instant::now();
    let result = host
        .start(&image.rootfs, &execd, 0, &opts)
        .map_err(anyhow::Error::from)
        .and_then(|sandbox| {
            eprintln!(
                "fastbox: sandbox {} ready in {:?} (execd at {}:{})",
                sandbox.handle.id,
                started.elapsed(),
                sandbox.slot.address,
                fastbox_runtime::spec::EXECD_PORT
            );
            let code = run_inside(&sandbox, &args.command, args.keep);
            let destroyed = host.destroy(&sandbox);
            let code = code?;
            destroyed?;
            Ok(code)
        });
    let torn_down = host.teardown();
    let _ = std::fs::remove_dir_all(args.host.data_dir.join(&prefix));
    let code = result?;
    torn_down?;
    Ok(code)
}

fn run_inside(
    sandbox: &crate::local_sandbox::LocalSandbox,
    command: &[String],
    keep: bool,
) -> anyhow::Result<i32> {
    let mut code = 0;
    if !command.is_empty() {
        code = sandbox.execd.run(command, |event| {
            let text = event.text.as_deref().unwrap_or_default();
            let text = if text == "\n" { "" } else { text };
            match event.kind.as_str() {
                "stdout" => println!("{text}"),
                "stderr" => eprintln!("{text}"),
                _ => {}
            }
            let _ = std::io::stdout().flush();
        })?;
    }
    if keep || command.is_empty() {
        eprintln!("fastbox: sandbox running; press Ctrl-C to remove it");
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))
            .context("install Ctrl-C handler")?;
        while !stop.load(Ordering::SeqCst) && sandbox.handle.is_running() {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    Ok(code)
}
