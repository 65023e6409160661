//! One sandbox on this machine without a server: a network slot, the runtime start, and
//! teardown that leaves nothing behind. Used by `fastbox sandbox run` and by the end-to-end
//! tests.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fastbox_runtime::cgroup::{CgroupLimits, CgroupRoot};
use fastbox_runtime::checkpoint::{CheckpointError, PreparedRestore, RestoreTarget};
use fastbox_runtime::criu::Criu;
use fastbox_runtime::execd_binary::ExecdBinary;
use fastbox_runtime::lazy::restore::LazyPages;
use fastbox_runtime::net::{
    DnsForwarder, DnsForwarderConfig, HostNetwork, Ipv4Net, Ipv4Pool, NetConfig, NetSlot,
    system_upstreams,
};
use fastbox_runtime::sandbox::{self, SandboxHandle};
use fastbox_runtime::spec::{EXECD_PORT, SandboxSpec};

use crate::execd_client::{ExecdClient, ExecdClientError};
use crate::phases::{LapClock, Phases};
use fastbox_egress::{EgressEnforcer, EgressPolicy, SlotRef};
use std::sync::Arc;

/// The limits execd reports in `/metrics` (the sandbox cannot read its cgroup on every host).
pub fn announced_limits(limits: &CgroupLimits) -> Vec<(String, String)> {
    let mut env = Vec::new();
    if let Some(bytes) = limits.memory_bytes {
        env.push(("EXECD_MEMORY_LIMIT".to_string(), bytes.to_string()));
    }
    if let Some(millis) = limits.cpu_millis {
        env.push((
            "EXECD_CPU_LIMIT".to_string(),
            (millis as f64 / 1000.0).to_string(),
        ));
    }
    env
}

/// The file execd's children append `KEY=value` lines to (`EXECD_ENVS`), in the writable layer.
pub const EXECD_ENVS_PATH: &str = "/.fastbox/envs";

#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error("cgroups: {0}")]
    Cgroup(#[from] fastbox_runtime::cgroup::CgroupError),
    #[error("network: {0}")]
    Net(#[from] fastbox_runtime::net::NetError),
    #[error(transparent)]
    Sandbox(#[from] fastbox_runtime::sandbox::SandboxError),
    #[error(transparent)]
    Checkpoint(#[from] fastbox_runtime::checkpoint::CheckpointError),
    #[error(transparent)]
    Execd(#[from] ExecdClientError),
    #[error("egress policy: {0}")]
    Egress(#[from] fastbox_egress::EgressError),
    #[error("writable layer: {0}")]
    Rootfs(#[from] fastbox_runtime::rootfs::RootfsError),
    #[error("the instance's private directory: {0}")]
    Staging(#[from] crate::staging::StagingError),
    #[error("spare slot {index}: {what} {path}: {source}")]
    Spare {
        index: u32,
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Id prefix of spare directories under `DATA_DIR/sandboxes` (`spare-<slot index>`): they are
/// removed like sandboxes by purges and at start.
pub const SPARE_ID_PREFIX: &str = "spare-";

/// A network slot and a writable layer made ahead of demand: the slot's namespace, veth and
/// routes (without a default route: no way out until a claim opens it), and a mounted empty
/// writable layer of the default disk size in `DATA_DIR/sandboxes/spare-<index>`. A restore
/// into a spare only renames that directory and mounts the overlay.
#[derive(Debug)]
pub struct Spare {
    pub index: u32,
    pub slot: NetSlot,
    pub dir: PathBuf,
    /// A cgroup (`spare-<index>`) with a CRIU launcher waiting in it, when it could be made.
    pub prepared: Option<PreparedRestore>,
}

/// What a slot comes with besides itself.
#[derive(Debug, Default)]
pub struct SlotExtras {
    /// The sandbox directory already holds a mounted writable layer (a spare's).
    pub layer_ready: bool,
    /// A spare's cgroup and CRIU launcher.
    pub prepared: Option<PreparedRestore>,
}

/// Where a start gets its slot: made now, or a spare made earlier.
#[derive(Debug)]
pub enum SlotSource {
    Fresh(u32),
    Spare(Box<Spare>),
}

impl SlotSource {
    pub fn index(&self) -> u32 {
        match self {
            Self::Fresh(index) => *index,
            Self::Spare(spare) => spare.index,
        }
    }
}

/// Everything one fastbox instance owns on the host, named with its prefix.
pub struct LocalHost {
    pub prefix: String,
    pub data_dir: PathBuf,
    pub helper: PathBuf,
    pub cgroups: CgroupRoot,
    pub network: HostNetwork,
    /// Per-slot egress policy (nftables) and the DNS forwarder's name policy.
    pub egress: Arc<EgressEnforcer>,
    dns: DnsForwarder,
}

/// What a sandbox start asks for, beyond the image.
#[derive(Debug, Clone, Default)]
pub struct StartOptions {
    pub id: String,
    pub limits: CgroupLimits,
    pub disk_bytes: Option<u64>,
    pub env: Vec<String>,
    pub entrypoint: Vec<String>,
    pub execd_token: Option<String>,
    /// Start without a way out of the slot and without an egress policy (its DNS is refused):
    /// pooled sandboxes and restores, until claimed or configured.
    pub deny_egress: bool,
    /// The egress policy of a start with a way out (`None`: allow all), in force before the
    /// sandbox runs.
    pub policy: Option<EgressPolicy>,
    /// A restore keeps the checkpoint's established TCP connections (a resume at the same
    /// address) instead of closing them (clones).
    pub keep_tcp: bool,
    /// Wait for execd without sending it the token (template starts: see
    /// [`ExecdClient::wait_serving`]).
    pub probe_without_token: bool,
    /// A restore returns before the checkpoint's memory is in place; the memory is copied in
    /// from the checkpoint's pages images while the sandbox runs ([`crate::transfers`]).
    pub lazy_memory: bool,
    /// A restore of a checkpoint whose pages images are not here ([`crate::remote_pages`]):
    /// lazy, its memory fetched from these while the sandbox runs.
    pub remote_memory: Option<LazyPages>,
    /// A restore's volumes: `(CRIU's key, staging point)` ([`crate::volumes::Staged`]).
    pub external_mounts: Vec<(String, PathBuf)>,
    /// A cold start that offers isolated sessions (template builds of the isolation variant).
    pub isolation: bool,
}

/// How long a lazy restore's `criu restore` may run.
pub(crate) const LAZY_RESTORE_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a lazy restore's memory may take to be copied in before the sandbox is killed.
pub(crate) const LAZY_TRANSFER_TIMEOUT: Duration = Duration::from_secs(600);

/// A started sandbox and its slot.
pub struct LocalSandbox {
    pub handle: SandboxHandle,
    pub slot: NetSlot,
    pub execd: ExecdClient,
    /// How the start went: `slot`, then the start's own phases, then `ready` (execd).
    pub phases: Phases,
    /// The memory still being copied in (a restore with [`StartOptions::lazy_memory`] or
    /// [`StartOptions::remote_memory`]).
    pub transfer: Option<fastbox_runtime::lazy::restore::LazyTransfer>,
}

impl LocalHost {
    /// Set up the instance: cgroup root, DNS forwarder and the nft table of `prefix`, with
    /// slot addresses from `pool`.
    pub fn try_new(
        prefix: &str,
        data_dir: &Path,
        helper: &Path,
        pool: Ipv4Pool,
    ) -> Result<Self, HostError> {
        Self::with_upstreams(prefix, data_dir, helper, pool, system_upstreams()?)
    }

    /// [`LocalHost::try_new`] whose DNS forwarder asks `upstreams` (instead of the host's
    /// resolvers).
    pub fn with_upstreams(
        prefix: &str,
        data_dir: &Path,
        helper: &Path,
        pool: Ipv4Pool,
        upstreams: Vec<std::net::SocketAddr>,
    ) -> Result<Self, HostError> {
        Self::with_network(prefix, data_dir, helper, pool, upstreams, Vec::new(), None)
    }

    /// [`LocalHost::with_upstreams`] whose sandboxes may reach `sandbox_reach` inside the
    /// private ranges that are otherwise denied to every sandbox (`--sandbox-reach`:
    /// `fastbox_runtime::net::ranges`), and whose table redirects the HTTPS of
    /// `credentialProxy` slots to `credential_proxy_port` (the node's
    /// [`crate::credential_proxy::CredentialProxy`]; `None`: no redirect).
    pub fn with_network(
        prefix: &str,
        data_dir: &Path,
        helper: &Path,
        pool: Ipv4Pool,
        upstreams: Vec<std::net::SocketAddr>,
        sandbox_reach: Vec<Ipv4Net>,
        credential_proxy_port: Option<u16>,
    ) -> Result<Self, HostError> {
        let cgroups = CgroupRoot::detect()?;
        let egress = Arc::new(EgressEnforcer::try_new(prefix)?.with_reach(sandbox_reach.clone()));
        let dns =
            DnsForwarder::start(DnsForwarderConfig::new(upstreams).with_hook(egress.clone()))?;
        let cfg = NetConfig {
            prefix: prefix.to_string(),
            pool,
            dns_port: dns.port(),
            sandbox_reach,
            slot_limits: Default::default(),
            credential_proxy_port,
        };
        let network = HostNetwork::try_new(cfg)?;
        Ok(Self {
            prefix: prefix.to_string(),
            data_dir: data_dir.to_path_buf(),
            helper: helper.to_path_buf(),
            cgroups,
            network,
            egress,
            dns,
        })
    }

    /// Start a sandbox of `rootfs` with `execd` in network slot `slot_index` and wait for
    /// execd's `/ping`.
    pub fn start(
        &self,
        rootfs: &Path,
        execd: &ExecdBinary,
        slot_index: u32,
        opts: &StartOptions,
    ) -> Result<LocalSandbox, HostError> {
        self.in_slot(SlotSource::Fresh(slot_index), opts, |slot, _| {
            let clock = Instant::now();
            let handle = self.start_in(slot, rootfs, execd, opts)?;
            let mut phases = Phases::default();
            phases.push("start", clock.elapsed());
            Ok((handle, phases))
        })
    }

    fn start_in(
        &self,
        slot: &NetSlot,
        rootfs: &Path,
        execd: &ExecdBinary,
        opts: &StartOptions,
    ) -> Result<SandboxHandle, HostError> {
        let mut env = vec![
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_string(),
            // Where `commands.set_env` of the SDK persists variables for later commands.
            format!("EXECD_ENVS={EXECD_ENVS_PATH}"),
        ];
        env.extend(
            announced_limits(&opts.limits)
                .into_iter()
                .map(|(k, v)| format!("{k}={v}")),
        );
        env.extend(opts.env.iter().cloned());
        if let Some(token) = &opts.execd_token {
            env.push(format!("EXECD_ACCESS_TOKEN={token}"));
        }
        let spec = SandboxSpec {
            id: opts.id.clone(),
            prefix: self.prefix.clone(),
            lower: rootfs.to_path_buf(),
            dir: crate::agent::sandbox_dir(&self.data_dir, &opts.id),
            hostname: opts.id.clone(),
            netns: slot.netns_path.clone(),
            resolv_conf: Some(slot.resolv_conf()),
            execd: execd.clone(),
            execd_args: vec![],
            isolation: opts.isolation,
            entrypoint: opts.entrypoint.clone(),
            env,
            limits: opts.limits,
            disk_bytes: opts
                .disk_bytes
                .unwrap_or(fastbox_runtime::spec::DEFAULT_DISK_BYTES),
        };
        Ok(sandbox::start(&spec, &self.helper, &self.cgroups)?)
    }

    /// Checkpoint `sandbox` into `out` with CRIU (the sandbox stops) and free its slot.
    pub fn checkpoint(
        &self,
        criu: &Criu,
        sandbox: &LocalSandbox,
        out: &Path,
    ) -> Result<(), HostError> {
        fastbox_runtime::checkpoint::checkpoint(criu, &sandbox.handle, out)?;
        self.destroy(sandbox)
    }

    /// Restore the checkpoint in `checkpoint` (taken over `rootfs`) as sandbox `id` in the
    /// network slot of `source`, and wait for its execd.
    pub fn restore(
        &self,
        criu: &Criu,
        checkpoint: &Path,
        rootfs: &Path,
        execd_store: &Path,
        source: SlotSource,
        opts: &StartOptions,
    ) -> Result<LocalSandbox, HostError> {
        let mut transfer = None;
        let mut sandbox = self.in_slot(source, opts, |slot, extras| {
            let dir = crate::agent::sandbox_dir(&self.data_dir, &opts.id);
            let target = RestoreTarget {
                id: &opts.id,
                prefix: &self.prefix,
                lower: rootfs,
                dir: &dir,
                netns: &slot.netns_path,
                limits: &opts.limits,
                disk_bytes: opts
                    .disk_bytes
                    .unwrap_or(fastbox_runtime::spec::DEFAULT_DISK_BYTES),
                execd_store,
                tcp_close: !opts.keep_tcp,
                layer_ready: extras.layer_ready,
                external_mounts: &opts.external_mounts,
            };
            let mut phases = Phases::default();
            let (handle, took) = if opts.lazy_memory || opts.remote_memory.is_some() {
                let images = fastbox_runtime::checkpoint::images_dir(checkpoint);
                let pages = match &opts.remote_memory {
                    Some(remote) => remote.clone(),
                    None => {
                        LazyPages::local(&images, LAZY_RESTORE_TIMEOUT, Some(LAZY_TRANSFER_TIMEOUT))
                            .map_err(|source| CheckpointError::Io {
                                id: opts.id.clone(),
                                what: "list the pages images of",
                                path: images.clone(),
                                source,
                            })?
                    }
                };
                let lazy = fastbox_runtime::checkpoint::restore_lazy(
                    criu,
                    &self.cgroups,
                    checkpoint,
                    &target,
                    extras.prepared,
                    &pages,
                )?;
                phases.note("lazy.prepare", lazy.prepare);
                transfer = Some(lazy.transfer);
                (lazy.handle, lazy.timings)
            } else {
                fastbox_runtime::checkpoint::restore(
                    criu,
                    &self.cgroups,
                    checkpoint,
                    &target,
                    extras.prepared,
                )?
            };
            phases.push("rootfs", took.rootfs);
            phases.push("cgroup", took.cgroup);
            phases.push("criu", took.criu);
            if let Some(stats) = &took.criu_stats {
                // Parts of `criu` (not added to the total): CRIU's own stats-restore.
                phases.note("criu.forking", Duration::from_micros(stats.forking_time_us));
                phases.note("criu.restore", Duration::from_micros(stats.restore_time_us));
            }
            Ok((handle, phases))
        })?;
        sandbox.transfer = transfer;
        Ok(sandbox)
    }

    /// Make a spare: network slot `index` without a way out, an empty writable layer of
    /// the default disk size, and (best effort) a cgroup with a CRIU launcher waiting in it.
    /// Nothing is left behind when it fails.
    pub fn make_spare(&self, index: u32, criu: &Criu) -> Result<Spare, HostError> {
        let slot = self.network.create_slot(index)?;
        let dir = crate::agent::sandbox_dir(&self.data_dir, &format!("{SPARE_ID_PREFIX}{index}"));
        let made = self
            .network
            .deny_egress(&slot)
            .map_err(HostError::from)
            .and_then(|()| {
                fastbox_runtime::rootfs::Rootfs::create_layer(
                    &dir,
                    fastbox_runtime::spec::DEFAULT_DISK_BYTES,
                )
                .map_err(HostError::from)
            });
        let mut spare = Spare {
            index,
            slot,
            dir,
            prepared: None,
        };
        match made {
            Ok(_) => {
                spare.prepared = self.prepare_restore(&spare, criu);
                Ok(spare)
            }
            Err(e) => {
                let _ = self.destroy_spare(&mut spare);
                Err(e)
            }
        }
    }

    /// The cgroup `spare-<index>` and a CRIU launcher in it (see [`Criu::launcher`]); `None`
    /// when either cannot be made (restores into the spare then make their own).
    fn prepare_restore(&self, spare: &Spare, criu: &Criu) -> Option<PreparedRestore> {
        let name = format!("{SPARE_ID_PREFIX}{}", spare.index);
        let cgroup = fastbox_runtime::cgroup::Cgroup::create(
            &self.cgroups,
            &self.prefix,
            &name,
            &CgroupLimits::default(),
        )
        .inspect_err(|e| tracing::debug!(spare = %name, error = %e, "no prepared cgroup"))
        .ok()?;
        match criu.launcher(&self.helper, &spare.slot.netns_path, &cgroup.procs_files()) {
            Ok(launcher) => Some(PreparedRestore { cgroup, launcher }),
            Err(e) => {
                tracing::debug!(spare = %name, error = %e, "no CRIU launcher");
                let _ = cgroup.remove();
                None
            }
        }
    }

    /// Remove a spare that was not used: its launcher and cgroup, layer, directory and
    /// network slot.
    pub fn destroy_spare(&self, spare: &mut Spare) -> Result<(), HostError> {
        if let Some(PreparedRestore { cgroup, launcher }) = spare.prepared.take() {
            drop(launcher);
            cgroup.kill_all().and_then(|()| cgroup.remove())?;
        }
        fastbox_runtime::rootfs::Rootfs::at(&spare.dir).destroy()?;
        match std::fs::remove_dir_all(&spare.dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(HostError::Spare {
                    index: spare.index,
                    what: "remove",
                    path: spare.dir.clone(),
                    source: e,
                });
            }
            _ => {}
        }
        self.release_network(&spare.slot)
    }

    /// Get the network slot of `source` (making it, or taking over a spare and moving its
    /// layer to the sandbox's directory), run `place` to put a sandbox into it (told whether
    /// the writable layer is already there), and wait for its execd. The slot is removed
    /// again when this fails.
    fn in_slot(
        &self,
        source: SlotSource,
        opts: &StartOptions,
        place: impl FnOnce(&NetSlot, SlotExtras) -> Result<(SandboxHandle, Phases), HostError>,
    ) -> Result<LocalSandbox, HostError> {
        let mut clock = LapClock::start();
        let (slot, extras) = match source {
            SlotSource::Fresh(index) => {
                let slot = self.network.create_slot(index)?;
                let closed = if opts.deny_egress {
                    self.network.deny_egress(&slot).map_err(HostError::from)
                } else {
                    let policy = opts.policy.clone().unwrap_or_default();
                    self.egress
                        .apply_to_new(&SlotRef::from(&slot), &policy)
                        .map_err(HostError::from)
                };
                if let Err(e) = closed {
                    let _ = self.release_network(&slot);
                    return Err(e);
                }
                (slot, SlotExtras::default())
            }
            SlotSource::Spare(mut spare) => {
                let to = crate::agent::sandbox_dir(&self.data_dir, &opts.id);
                if let Err(source) = std::fs::rename(&spare.dir, &to) {
                    let _ = self.destroy_spare(&mut spare);
                    return Err(HostError::Spare {
                        index: spare.index,
                        what: "move to",
                        path: to,
                        source,
                    });
                }
                let extras = SlotExtras {
                    layer_ready: true,
                    prepared: spare.prepared.take(),
                };
                (spare.slot, extras)
            }
        };
        clock.lap("slot");
        match place(&slot, extras) {
            Ok((handle, placed)) => {
                clock.laps(&placed);
                self.ready(handle, slot, opts, clock)
            }
            Err(e) => {
                let _ = self.release_network(&slot);
                Err(e)
            }
        }
    }

    /// Forget the slot's egress policy (a later occupant of the slot starts without one),
    /// remove the slot, then forget its tracked connections: they outlive the veth, and an
    /// established one passes the instance table without meeting any policy, so the next
    /// sandbox given the address would inherit it. For a slot whose index returns to the
    /// pool; a paused sandbox, which keeps its index, uses
    /// [`LocalHost::release_network_keeping_flows`].
    pub fn release_network(&self, slot: &NetSlot) -> Result<(), HostError> {
        self.release_network_keeping_flows(slot)?;
        self.egress.forget_connections(&SlotRef::from(slot))?;
        Ok(())
    }

    /// [`LocalHost::release_network`] that keeps the address's tracked connections: for a
    /// paused sandbox, which keeps its slot index (nobody else gets the address) and is
    /// resumed with its TCP connections. Its removal releases the slot with
    /// [`LocalHost::release_network`], which forgets them.
    pub fn release_network_keeping_flows(&self, slot: &NetSlot) -> Result<(), HostError> {
        self.egress.remove(&SlotRef::from(slot))?;
        self.network.destroy_slot_lazily(slot)?;
        Ok(())
    }

    /// Wrap a started sandbox, wait for its execd, and tear it down if it never answers.
    fn ready(
        &self,
        handle: SandboxHandle,
        slot: NetSlot,
        opts: &StartOptions,
        mut clock: LapClock,
    ) -> Result<LocalSandbox, HostError> {
        let execd = ExecdClient::new(
            format!("http://{}:{EXECD_PORT}", slot.address),
            opts.execd_token.clone(),
        )?;
        let sandbox = LocalSandbox {
            handle,
            slot,
            execd,
            phases: Phases::default(),
            transfer: None,
        };
        let ready = if opts.probe_without_token {
            sandbox.execd.wait_serving(Duration::from_secs(20))
        } else {
            sandbox.execd.wait_ready(Duration::from_secs(20))
        };
        match ready {
            Ok(_) => {
                clock.lap("ready");
                Ok(LocalSandbox {
                    phases: clock.finish(),
                    ..sandbox
                })
            }
            Err(e) => {
                let _ = self.destroy(&sandbox);
                Err(e.into())
            }
        }
    }

    /// Kill and remove a sandbox and its slot.
    pub fn destroy(&self, sandbox: &LocalSandbox) -> Result<(), HostError> {
        sandbox::destroy(&sandbox.handle, &self.cgroups)?;
        self.release_network(&sandbox.slot)?;
        Ok(())
    }

    /// Stop the in-process services (the DNS forwarder); host-wide state stays for the next
    /// start of the instance.
    pub fn stop_services(self) {
        self.dns.stop();
    }

    /// Remove the instance's host-wide state (nft table, DNS forwarder), and the tracked
    /// connections of its pool (as each slot's release does).
    pub fn teardown(self) -> Result<(), HostError> {
        self.dns.stop();
        let pool = self.network.config().pool;
        self.network.teardown()?;
        let pool = Ipv4Net::try_new(pool.base(), pool.prefix_len())
            .map_err(fastbox_runtime::net::NetError::from)?;
        self.egress.forget_network_connections(pool)?;
        fastbox_runtime::cgroup::remove_prefix(&self.cgroups, &self.prefix)?;
        Ok(())
    }
}

/// Remove everything an instance left on the host: the sandboxes under `data_dir` (processes,
/// mounts, files), its network slots and nft table, its cgroups, its private tmpfs
/// (`DATA_DIR/run`: [`crate::staging`]). For a stopped instance;
/// sandboxes of a running one lose their network.
pub fn purge(prefix: &str, data_dir: &Path) -> Result<(), HostError> {
    let cgroups = CgroupRoot::detect()?;
    let sandboxes = data_dir.join("sandboxes");
    if let Ok(entries) = std::fs::read_dir(&sandboxes) {
        for entry in entries.flatten() {
            let id = entry.file_name().to_string_lossy().into_owned();
            let handle = SandboxHandle::unstarted(&id, prefix, entry.path());
            sandbox::destroy(&handle, &cgroups)?;
        }
    }
    crate::from_artifact::unmount_all(data_dir);
    crate::named_volumes::NamedVolumes::new(data_dir).unmount_all();
    crate::volumes::purge_staged(data_dir);
    HostNetwork::purge(prefix)?;
    // Cgroups no sandbox directory names (a spare a crash interrupted) go too.
    remove_cgroups(&cgroups, prefix, |_| true);
    fastbox_runtime::cgroup::remove_prefix(&cgroups, prefix)?;
    crate::staging::purge(prefix, data_dir);
    Ok(())
}

/// Kills the processes of and removes every cgroup of instance `prefix` whose name `which`
/// accepts; returns how many went.
pub(crate) fn remove_cgroups(
    cgroups: &CgroupRoot,
    prefix: &str,
    which: impl Fn(&str) -> bool,
) -> usize {
    crate::fence::group_names(cgroups, prefix)
        .iter()
        .filter(|name| which(name))
        .filter(|name| {
            fastbox_runtime::cgroup::Cgroup::open(cgroups, prefix, name)
                .is_some_and(|cg| cg.kill_all().and_then(|()| cg.remove()).is_ok())
        })
        .count()
}

/// Host-wide state still carrying `prefix`: network namespaces, links, nft tables, cgroups,
/// mounts. Empty after a clean teardown.
pub fn leftovers(prefix: &str) -> Vec<String> {
    let mut found = Vec::new();
    match HostNetwork::leaked(prefix) {
        Ok(net) => {
            found.extend(net.netns.into_iter().map(|n| format!("netns {n}")));
            found.extend(net.links.into_iter().map(|n| format!("link {n}")));
            found.extend(net.nft_tables.into_iter().map(|n| format!("nft table {n}")));
        }
        Err(e) => found.push(format!("could not list network state: {e}")),
    }
    if let Ok(root) = CgroupRoot::detect() {
        found.extend(
            fastbox_runtime::cgroup::leaked(&root, prefix)
                .into_iter()
                .map(|p| format!("cgroup {}", p.display())),
        );
    }
    found.extend(
        fastbox_runtime::rootfs::mounts_containing(prefix)
            .into_iter()
            .map(|m| format!("mount {m}")),
    );
    // The instance's private tmpfs, by its source (its data directory may not show the
    // prefix).
    found.extend(
        crate::staging::leftover_mounts(prefix)
            .into_iter()
            .map(|m| format!("mount {m}")),
    );
    found
}
