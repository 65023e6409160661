//! Where fastbox finds what it runs with on this host: CRIU, the execd binary, its state.
//! Every path can be given by flag or environment; the defaults follow the repository layout
//! that `scripts/setup.sh` creates, then the system.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use fastbox_runtime::criu::Criu;

#[derive(clap::Args, Debug, Clone)]
pub struct HostArgs {
    /// The CRIU binary (>= 4.2). Default: `.deps/criu/bin/criu` of the repository, then `criu`.
    #[arg(long, env = "FASTBOX_CRIU")]
    pub criu: Option<PathBuf>,
    /// The static execd binary. Default: `fastbox-execd` beside this executable or in the
    /// repository's static build directory.
    #[arg(long, env = "FASTBOX_EXECD_BIN")]
    pub execd: Option<PathBuf>,
    /// State directory (sandboxes, execd store).
    #[arg(long, env = "FASTBOX_DATA_DIR", default_value = "/var/lib/fastbox")]
    pub data_dir: PathBuf,
    /// Host-wide image cache shared by every fastbox instance.
    #[arg(
        long,
        env = "FASTBOX_CACHE_DIR",
        default_value = "/var/lib/fastbox/cache"
    )]
    pub cache_dir: PathBuf,
}

/// The repository root when this executable runs from its `target/` directory.
fn repo_root() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    exe.ancestors()
        .find(|p| p.join("target").is_dir() && p.join("Cargo.toml").is_file())
        .map(Path::to_path_buf)
}

impl HostArgs {
    pub fn criu(&self) -> anyhow::Result<Criu> {
        let candidates: Vec<PathBuf> = match &self.criu {
            Some(p) => vec![p.clone()],
            None => repo_root()
                .map(|r| r.join(".deps/criu/bin/criu"))
                .into_iter()
                .chain([
                    PathBuf::from("/usr/local/sbin/criu"),
                    PathBuf::from("/usr/sbin/criu"),
                ])
                .filter(|p| p.exists())
                .collect(),
        };
        let Some(first) = candidates.first() else {
            bail!(
                "CRIU is not installed: run scripts/setup.sh (it installs CRIU >= 4.2 into .deps/criu)"
            );
        };
        Ok(Criu::at(first)?)
    }

    pub fn execd(&self) -> anyhow::Result<PathBuf> {
        if let Some(p) = &self.execd {
            return Ok(p.clone());
        }
        let exe = std::env::current_exe()?;
        let beside = exe.with_file_name("fastbox-execd-static");
        let mut candidates = vec![beside];
        if let Some(root) = repo_root() {
            candidates.push(root.join("target/x86_64-unknown-linux-gnu/release/fastbox-execd"));
        }
        candidates.into_iter().find(|p| p.exists()).context(
            "no static fastbox-execd found: scripts/fastbox builds it (or pass --execd / FASTBOX_EXECD_BIN)",
        )
    }
}

/// The prefix of a one-off run's host-wide names (a benchmark, a scenario): `given`, or
/// `stem` and 4 random hex digits; 1 to `max` of `[a-z0-9]`.
pub fn run_prefix(given: Option<&str>, stem: &str, max: usize) -> anyhow::Result<String> {
    let prefix = given
        .map(str::to_string)
        .unwrap_or_else(|| format!("{stem}{:04x}", rand::random::<u16>()));
    if prefix.is_empty()
        || prefix.len() > max
        || !prefix
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    {
        bail!("--prefix must be 1 to {max} of [a-z0-9], not {prefix:?}");
    }
    Ok(prefix)
}

/// What a one-off run's fastlet differs in: everything else is this host's (CRIU, execd, the
/// image cache) or off (warm pools, DNS upstreams).
pub struct RunFastlet<'a> {
    pub prefix: &'a str,
    pub data_dir: PathBuf,
    pub pool: fastbox_runtime::net::Ipv4Pool,
    pub spare_slots: usize,
    pub artifact_store: std::sync::Arc<dyn fastbox_artifact::ArtifactStore>,
}

impl HostArgs {
    /// `reference` resolved through this host's image cache (pulled or built when missing,
    /// with progress on stderr).
    pub fn resolve_image(&self, reference: &str) -> anyhow::Result<fastbox_image::ResolvedImage> {
        let cache = fastbox_image::ImageCache::try_new(self.image_config())?;
        cache
            .resolve(reference, None, &fastbox_image::StderrProgress::new())
            .with_context(|| format!("resolve image {reference}"))
    }

    /// The image settings of a one-off run (`fastbox sandbox run`, benchmarks): the operator
    /// runs it on their own host, so a registry may be anywhere, private ranges included (the
    /// lifecycle server refuses those unless `--registry-allow-private` names them).
    fn image_config(&self) -> fastbox_image::ImageConfig {
        fastbox_image::ImageConfig {
            cache_dir: self.cache_dir.clone(),
            registry_allow_private: ["0.0.0.0/0", "::/0"]
                .iter()
                .map(|net| net.parse().expect("a valid network"))
                .collect(),
            ..fastbox_image::ImageConfig::default()
        }
    }

    /// The configuration of a one-off run's fastlet.
    pub fn fastlet_config(
        &self,
        run: RunFastlet<'_>,
    ) -> anyhow::Result<fastbox_fastlet::FastletConfig> {
        Ok(fastbox_fastlet::FastletConfig {
            prefix: run.prefix.to_string(),
            data_dir: run.data_dir,
            helper: std::env::current_exe().context("locate the fastbox executable")?,
            pool: run.pool,
            images: self.image_config(),
            execd_bin: self.execd()?,
            criu: self.criu()?,
            pool_min: 0,
            pool_max: 0,
            spare_slots: run.spare_slots,
            dns_upstreams: None,
            sandbox_reach: Vec::new(),
            artifact_store: run.artifact_store,
            lazy_restore_min_bytes: None,
            host_volume_roots: Vec::new(),
            credential_proxy: None,
        })
    }
}

/// Fail with a clear message unless running as root.
pub fn require_root() -> anyhow::Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!("fastbox must run as root (namespaces, mounts, cgroups, CRIU)");
    }
    Ok(())
}

/// `fastbox check`: report what this host offers, fail on what is missing.
pub fn check(args: &HostArgs) -> anyhow::Result<i32> {
    require_root()?;
    let criu = args.criu()?;
    println!("criu: {} ({})", criu.version, criu.path.display());
    let execd = args.execd()?;
    println!("execd: {}", execd.display());
    let cgroups = fastbox_runtime::cgroup::CgroupRoot::detect()?;
    println!("cgroups: {cgroups:?}");
    Ok(0)
}
