//! The node agent: the only capacity authority of its node. It admits sandboxes into network
//! slots of its pool, starts them with the runtime, re-adopts them after a restart of the
//! process, and removes them without leaving anything behind. Its methods block (the runtime
//! is synchronous): async callers run them on a dedicated thread ([`crate::blocking`]).

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};

use fastbox_image::{ImageCache, ImageConfig, ImageError, Progress, RegistryAuth, ResolvedImage};
use fastbox_runtime::cgroup::CgroupLimits;
use fastbox_runtime::criu::Criu;
use fastbox_runtime::execd_binary::ExecdBinary;
use fastbox_runtime::lazy::restore::LazyPages;
use fastbox_runtime::net::Ipv4Pool;
use fastbox_runtime::sandbox::{self, SandboxHandle};
use serde::{Deserialize, Serialize};

use crate::execd_client::ExecdClient;
use crate::host::{
    HostError, LAZY_RESTORE_TIMEOUT, LAZY_TRANSFER_TIMEOUT, LocalHost, LocalSandbox,
    SPARE_ID_PREFIX, SlotSource, StartOptions,
};
use crate::phases::{LapClock, Phases};
use crate::pool::{POOL_ID_PREFIX, POOL_SLOT_FILE, Pooled, WarmPools};
use crate::reaper::{ReapJob, Reaper};
use crate::remote_pages::{RemotePages, StoreBlocks};
use crate::slots::SlotTable;
use crate::spares::SparePool;
use crate::template::{self, BuildClock, BuildLocks, Template};
use crate::warmup::GoldenRecipe;
use fastbox_egress::{EgressPolicy, SlotRef};
// The per-sandbox credentials of a sandbox's endpoints (`X-EXECD-ACCESS-TOKEN`, and
// `OPENSANDBOX-EGRESS-AUTH` of port 18080) and what [`Fastlet::adopt`] made of a sandbox found
// after a restart: data of the node boundary.
pub use fastbox_node_api::wire::{Adoption, SandboxTokens};

/// What a fastlet needs to run.
#[derive(Clone)]
pub struct FastletConfig {
    /// Prefix of every host-wide name of this instance (at most 8 of `[a-z0-9]`).
    pub prefix: String,
    /// The instance's own directory: sandboxes, the execd store.
    pub data_dir: PathBuf,
    /// The `fastbox` binary, re-executed as the sandbox helper.
    pub helper: PathBuf,
    /// Sandbox addresses.
    pub pool: Ipv4Pool,
    /// The image cache (shared by every instance on the host).
    pub images: ImageConfig,
    /// The static execd binary injected into every sandbox.
    pub execd_bin: PathBuf,
    /// CRIU (>= 4.2): golden checkpoints and restores.
    pub criu: Criu,
    /// Unclaimed sandboxes kept restored per template when idle.
    pub pool_min: usize,
    /// Most unclaimed sandboxes kept per template, when creates ask for more (0: no warm
    /// pool; see [`crate::pool`]).
    pub pool_max: usize,
    /// Spare slots (network slot + empty writable layer) kept made ahead of demand (0: none;
    /// every restore then makes its slot).
    pub spare_slots: usize,
    /// Where the DNS forwarder sends the names a policy allows (`None`: the host's
    /// resolvers from `/etc/resolv.conf`).
    pub dns_upstreams: Option<Vec<std::net::SocketAddr>>,
    /// Networks inside the private ranges denied to every sandbox
    /// (`fastbox_runtime::net::PRIVATE_RANGES`) that sandboxes may reach after all, subject
    /// to their egress policy (`--sandbox-reach`; empty: none).
    pub sandbox_reach: Vec<fastbox_runtime::net::Ipv4Net>,
    /// The node's artifact store: templates, snapshots and pause checkpoints are published
    /// into it ([`crate::node_store`] opens one: a local directory, by default
    /// `DATA_DIR/artifacts` ([`crate::node_store::open_local`]), or an S3 origin behind the
    /// node block cache and DART).
    pub artifact_store: std::sync::Arc<dyn fastbox_artifact::ArtifactStore>,
    /// Clones of a snapshot and resumes whose checkpoint's pages images hold at least this
    /// many bytes start before their memory is in place ([`crate::transfers`]); `None`:
    /// every restore is whole.
    pub lazy_restore_min_bytes: Option<u64>,
    /// Directories whose subdirectories sandboxes may bind as host volumes
    /// (`--allow-host-volume`; empty: host volumes are refused). See [`crate::volumes`].
    pub host_volume_roots: Vec<PathBuf>,
    /// The Credential Vault's proxy ([`crate::credential_proxy`]; `None`: none, and
    /// `credentialProxy` sandboxes are refused).
    pub credential_proxy: Option<crate::credential_proxy::CredentialProxyConfig>,
}

/// The default of [`FastletConfig::lazy_restore_min_bytes`].
pub use fastbox_api::limits::DEFAULT_LAZY_RESTORE_MIN_BYTES;

impl std::fmt::Debug for FastletConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastletConfig")
            .field("prefix", &self.prefix)
            .field("data_dir", &self.data_dir)
            .field("helper", &self.helper)
            .field("pool", &self.pool)
            .field("images", &self.images)
            .field("execd_bin", &self.execd_bin)
            .field("criu", &self.criu)
            .field("pool_min", &self.pool_min)
            .field("pool_max", &self.pool_max)
            .field("spare_slots", &self.spare_slots)
            .field("dns_upstreams", &self.dns_upstreams)
            .field("sandbox_reach", &self.sandbox_reach)
            .field("artifact_store", &"<dyn ArtifactStore>")
            .field("lazy_restore_min_bytes", &self.lazy_restore_min_bytes)
            .finish()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FastletError {
    #[error("node set-up failed: {0}")]
    Setup(Box<HostError>),
    #[error("execd binary {path}: {message}")]
    Execd { path: PathBuf, message: String },
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error("no free sandbox slot: all {capacity} slots of the address pool are in use")]
    NoCapacity { capacity: u32 },
    #[error("sandbox {id} could not be started: {source}")]
    Place { id: String, source: Box<HostError> },
    #[error("template of {image}: {message}")]
    Template { image: String, message: String },
    #[error("sandbox {id} could not be claimed: {source}")]
    Claim {
        id: String,
        source: crate::execd_client::ExecdClientError,
    },
    #[error("sandbox {id} could not be removed: {source}")]
    Remove { id: String, source: Box<HostError> },
    #[error("snapshot {key}: {message}")]
    Snapshot { key: String, message: String },
    #[error("sandbox {0} does not run on this node")]
    NotHere(String),
    #[error("egress policy of sandbox {id}: {source}")]
    Egress {
        id: String,
        source: Box<fastbox_egress::EgressError>,
    },
    #[error(transparent)]
    CredentialProxy(#[from] crate::credential_proxy::CredentialProxyError),
    #[error(
        "sandbox {0}: credentialProxy needs the node's credential proxy, which this node does not run"
    )]
    NoCredentialProxy(String),
    #[error("sandbox {id}: {source}")]
    ObjectVolume {
        id: String,
        source: Box<crate::object_volumes::ObjectVolumeError>,
    },
    #[error("sandbox {id}: {source}")]
    Volumes {
        id: String,
        source: Box<crate::volumes::VolumesError>,
    },
}

/// Where a started sandbox lives on this node; the server records it durably so a restarted
/// fastlet can find the sandbox again.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Placement {
    pub slot: u32,
    pub address: Ipv4Addr,
    pub handle: SandboxHandle,
}

/// How a sandbox came to run, for logs, events and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartReport {
    /// `pool` (claimed from the warm pool) or `restore` (restored on demand).
    pub source: String,
    /// Phases and their durations, in order.
    pub phases: Phases,
}

impl StartReport {
    /// `restore: slot 9.8 ms, rootfs 21.0 ms, ...` style.
    pub fn summary(&self) -> String {
        format!("{}: {}", self.source, self.phases)
    }
}

/// How a restored sandbox is woken ([`Fastlet::restore_as`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartMode {
    /// A clone of a golden checkpoint: claimed (token, environment, entrypoint).
    Claim,
    /// A clone of a snapshot of a claimed sandbox: a new token; its processes run as they
    /// were, no entrypoint is started.
    Clone,
    /// A paused sandbox back at its own address, with its own token.
    Resume,
    /// A paused sandbox resumed on another node than the one it paused on: its own token, a
    /// new address (its identity files follow it), its TCP connections closed.
    Moved,
}

impl StartMode {
    /// The `source` of its [`StartReport`].
    pub fn source(self) -> &'static str {
        match self {
            Self::Claim => "restore",
            Self::Clone => "snapshot",
            Self::Resume => "resume",
            Self::Moved => "moved",
        }
    }
}

/// How long a removal took: until every process was gone, and until the files, mounts,
/// cgroup and slot were released too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoveReport {
    pub processes_gone_ms: u64,
    pub total_ms: u64,
}

/// A sandbox start, decided by the server.
#[derive(Debug, Clone)]
pub struct PlaceRequest {
    pub id: String,
    pub rootfs: PathBuf,
    pub entrypoint: Vec<String>,
    /// `KEY=VALUE`, image environment first, the request's after (later entries win).
    pub env: Vec<String>,
    pub limits: CgroupLimits,
    pub disk_bytes: Option<u64>,
    /// The per-sandbox execd access token (`X-EXECD-ACCESS-TOKEN`).
    pub execd_token: String,
    /// The per-sandbox token of its egress endpoint (`OPENSANDBOX-EGRESS-AUTH`, port 18080).
    pub egress_token: String,
    /// The egress policy, in force before the entrypoint starts.
    pub policy: EgressPolicy,
    /// Mounted before the entrypoint starts ([`crate::volumes`]).
    pub volumes: Vec<fastbox_node_api::wire::VolumeMount>,
    /// The keys of its object-storage volumes, by volume name.
    pub volume_keys: std::collections::BTreeMap<String, fastbox_node_api::wire::ObjectStorageKeys>,
    /// Created with `credentialProxy.enabled`: its HTTPS goes through the node's credential
    /// proxy, it trusts the proxy's CA, and it has a Credential Vault.
    pub credential_proxy: bool,
}

/// How the node proxy reaches a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub address: Ipv4Addr,
    /// The network slot (its egress policy is keyed by it).
    pub slot: u32,
    pub execd_token: String,
    pub egress_token: String,
    /// Created with `credentialProxy.enabled`: it has a Credential Vault.
    pub credential_proxy: bool,
}

pub struct Fastlet {
    cfg: FastletConfig,
    pub(crate) host: LocalHost,
    images: ImageCache,
    execd: ExecdBinary,
    slots: Mutex<SlotTable>,
    routes: RwLock<HashMap<String, Route>>,
    /// The Credential Vaults of this node's sandboxes (kept while one is paused here).
    vaults: crate::node_proxy::vault::Vaults,
    /// The proxy that injects their credentials (`None`: not configured).
    credential_proxy: Option<crate::credential_proxy::CredentialProxy>,
    /// Pooled sandboxes claimed, by the id they were claimed as, until that sandbox is
    /// removed or released ([`Fastlet::remove_unrecorded_claims`]).
    claimed: Mutex<HashMap<String, Vec<Placement>>>,
    named_volumes: crate::named_volumes::NamedVolumes,
    pub(crate) builds: BuildLocks,
    pools: WarmPools,
    spares: SparePool,
    reaper: Reaper,
    /// Foreground starts in flight, which teardowns hold off for.
    starts: crate::background::Starts,
    /// Where live snapshots stage their files while the sandbox is frozen.
    pub(crate) staging: crate::staging::Staging,
    /// Memory transfers of sandboxes started before their memory was in place.
    pub(crate) transfers: std::sync::Arc<crate::transfers::Transfers>,
    /// Connection pool of execd clients (claims).
    http: reqwest::blocking::Client,
    /// Recent resolutions by reference (see [`Fastlet::resolve_image`]).
    resolved: Mutex<HashMap<String, (std::time::Instant, ResolvedImage)>>,
}

/// Restores of warm-pool refills running at once. One: on two cores, a second refill thread
/// made 10-way bursts slower (p50 56 against 49 ms) without fewer misses.
pub const REFILL_THREADS: usize = 1;

/// Longest background work (a teardown, a spare while half of them are left) holds off for
/// starts in flight (a 10-way burst of claims takes about 100 ms on two cores). Refills do
/// not: a burst empties the pool, and under a sustained load a refill that waited would only
/// turn claims into restores.
pub const BACKGROUND_HOLD_OFF: std::time::Duration = std::time::Duration::from_millis(200);
/// Teardowns hold off only while at most this many are queued: under a sustained load the
/// queue does not grow without bound.
pub const REAP_HOLD_OFF_QUEUE: usize = 16;

/// Memory transfers of lazy restores that may run at once; a clone or resume made while this
/// many run is restored whole. A bound on the memory copied in the background at once, above
/// what a fork of 10 needs: on two cores a fork of 10 clones of a 256 MiB snapshot answered in
/// 0.99-1.11 s with all of them lazy, and in 1.22-1.41 s with only two of them (the others
/// restored whole, copying their memory before they answer).
pub const LAZY_TRANSFERS_MAX: usize = 16;

/// How long adopting a sandbox after a restart waits for a memory transfer the last run left.
pub const TRANSFER_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// How long removing an interrupted start waits for a CRIU restore that outlived a crash.
pub const RESTORE_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// How long a resolution is reused: a registry tag that moves is seen within this time.
pub const RESOLVED_TTL: std::time::Duration = std::time::Duration::from_secs(300);

impl Fastlet {
    /// Sets up the node: cgroup root, DNS forwarder, the instance's nft table (existing slots
    /// are kept), the image cache and the content-addressed execd.
    pub fn start(mut cfg: FastletConfig) -> Result<Self, FastletError> {
        let images = ImageCache::try_new(cfg.images.clone())?;
        let execd =
            ExecdBinary::import(&cfg.execd_bin, &cfg.data_dir.join("execd")).map_err(|e| {
                FastletError::Execd {
                    path: cfg.execd_bin.clone(),
                    message: e.to_string(),
                }
            })?;
        let credential_proxy = cfg
            .credential_proxy
            .as_ref()
            .map(|c| crate::credential_proxy::CredentialProxy::start(&cfg.data_dir, c))
            .transpose()?;
        let host = match &cfg.dns_upstreams {
            Some(upstreams) => Ok(upstreams.clone()),
            None => fastbox_runtime::net::system_upstreams().map_err(HostError::from),
        }
        .and_then(|upstreams| {
            LocalHost::with_network(
                &cfg.prefix,
                &cfg.data_dir,
                &cfg.helper,
                cfg.pool,
                upstreams,
                cfg.sandbox_reach.clone(),
                credential_proxy.as_ref().map(|p| p.port()),
            )
        })
        .map_err(|e| FastletError::Setup(Box::new(e)))?;
        let slots = Mutex::new(SlotTable::new(cfg.pool.capacity()));
        let (pool_min, pool_max) = (cfg.pool_min, cfg.pool_max);
        let spares = SparePool::new(cfg.spare_slots);
        // The instance's private tmpfs: live snapshots' staging area and CRIU's `/run`.
        let staging = crate::staging::Staging::open(&cfg.data_dir, &cfg.prefix)
            .map_err(|e| FastletError::Setup(Box::new(e.into())))?;
        cfg.criu = staging.criu(cfg.criu.clone()).map_err(|e| {
            staging.unmount();
            FastletError::Setup(Box::new(e.into()))
        })?;
        let named_volumes = crate::named_volumes::NamedVolumes::new(&cfg.data_dir);
        Ok(Self {
            cfg,
            host,
            images,
            execd,
            slots,
            routes: RwLock::new(HashMap::new()),
            vaults: Default::default(),
            credential_proxy,
            claimed: Mutex::new(HashMap::new()),
            named_volumes,
            builds: BuildLocks::default(),
            pools: WarmPools::new(pool_min, pool_max),
            spares,
            reaper: Reaper::default(),
            starts: Default::default(),
            staging,
            transfers: Default::default(),
            resolved: Mutex::new(HashMap::new()),
            http: ExecdClient::http_client().map_err(|e| FastletError::Execd {
                path: PathBuf::from("http client"),
                message: e.to_string(),
            })?,
        })
    }

    pub fn config(&self) -> &FastletConfig {
        &self.cfg
    }

    /// Checks the form of an image reference without fetching anything.
    pub fn check_image(&self, reference: &str) -> Result<(), FastletError> {
        fastbox_image::ImageSource::parse(reference, self.images.config())?;
        Ok(())
    }

    /// Resolves an image to an unpacked rootfs (downloads or builds it at most once per host).
    /// Answers from memory for [`RESOLVED_TTL`] after a resolution without credentials, so a
    /// create of a known image does not touch the cache or the registry.
    pub fn resolve_image(
        &self,
        reference: &str,
        auth: Option<&RegistryAuth>,
        progress: &dyn Progress,
    ) -> Result<ResolvedImage, FastletError> {
        if auth.is_none()
            && let Some((at, image)) = self.resolved.lock().expect("resolved lock").get(reference)
            && at.elapsed() < RESOLVED_TTL
        {
            return Ok(image.clone());
        }
        let image = self.images.resolve(reference, auth, progress)?;
        if auth.is_none() {
            self.resolved.lock().expect("resolved lock").insert(
                reference.to_string(),
                (std::time::Instant::now(), image.clone()),
            );
        }
        Ok(image)
    }

    /// Admission: takes a free slot index, or says the node is full.
    pub fn reserve_slot(&self) -> Result<u32, FastletError> {
        let mut slots = self.slots.lock().expect("slot table lock");
        slots.reserve().ok_or(FastletError::NoCapacity {
            capacity: slots.capacity(),
        })
    }

    /// Teardowns queued and not finished (their slots are released when they are).
    pub fn teardowns_pending(&self) -> usize {
        self.reaper.pending()
    }

    /// What holds slot `slot` now, as far as this node can tell: a running sandbox (its
    /// route), a paused one (its kept index), a pooled sandbox or a spare. `None` for an
    /// admitted slot nothing was started in (or a start still in progress).
    pub fn slot_holder(&self, slot: u32) -> Option<String> {
        let routed = self
            .routes
            .read()
            .expect("routes lock")
            .iter()
            .find(|(_, r)| r.slot == slot)
            .map(|(id, _)| id.clone());
        routed
            .or_else(|| self.kept_slots().holder(slot))
            .or_else(|| self.pools.in_slot(slot))
            .or_else(|| self.spares.holds(slot).then(|| format!("spare-{slot}")))
    }

    /// Gives back a slot index (reserved but never used, or torn down); a paused sandbox's
    /// hold on it ends too.
    pub fn release_slot(&self, slot: u32) {
        self.kept_slots().forget(slot);
        self.slots.lock().expect("slot table lock").release(slot);
    }

    /// The slot indexes paused sandboxes keep, on disk ([`crate::kept_slots::KeptSlots`]).
    pub fn kept_slots(&self) -> crate::kept_slots::KeptSlots {
        crate::kept_slots::KeptSlots::new(&self.cfg.data_dir)
    }

    /// Slots in use and the pool's size.
    pub fn capacity(&self) -> (usize, u32) {
        let slots = self.slots.lock().expect("slot table lock");
        (slots.in_use(), slots.capacity())
    }

    /// The golden checkpoint of `image` on this node, built now if there is none: a cold
    /// start with execd only, readiness, then a CRIU dump.
    pub fn template(&self, image: &ResolvedImage) -> Result<Template, FastletError> {
        self.template_for(&image.digest, image, &image_recipe(image))
    }

    /// The golden checkpoint named `key` of `image` built by `recipe` (a template of the
    /// templates API: its environment baked in, its warm-up command running and its readiness
    /// gate passed), built now if this node has none.
    pub fn template_for(
        &self,
        key: &str,
        image: &ResolvedImage,
        recipe: &GoldenRecipe,
    ) -> Result<Template, FastletError> {
        let dir = template::template_dir(&self.cfg.data_dir, key);
        if let Some(t) = self.current_template(&dir) {
            return Ok(t);
        }
        let lock = self.builds.for_image(key);
        let _building = lock.lock().expect("build lock");
        if let Some(t) = self.current_template(&dir) {
            return Ok(t);
        }
        let fail = |message: String| FastletError::Template {
            image: image.canonical_reference.clone(),
            message,
        };
        let clock = BuildClock::start();
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
        let golden_token = random_hex();
        let id = format!("{}-{}", template::short_name(image), &random_hex()[..6]);
        let slot = self.reserve_slot()?;
        let mut golden_env = image.config.env.clone();
        golden_env.extend(recipe.env.iter().cloned());
        let opts = StartOptions {
            id: id.clone(),
            env: golden_env,
            entrypoint: recipe.warm_up.clone(),
            execd_token: Some(golden_token.clone()),
            probe_without_token: true,
            isolation: recipe.isolation,
            ..StartOptions::default()
        };
        let checkpoint = dir.join("checkpoint");
        let built = self
            .host
            .start(&image.rootfs, &self.execd, slot, &opts)
            .map_err(|e| e.to_string())
            .and_then(|sb| {
                let dumped = self.warm_up(&sb, recipe).and_then(|()| {
                    self.host
                        .checkpoint(&self.cfg.criu, &sb, &checkpoint)
                        .map_err(|e| e.to_string())
                });
                if dumped.is_err() {
                    let _ = self.host.destroy(&sb);
                }
                dumped
            });
        self.release_slot(slot);
        if let Err(e) = built {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(fail(e));
        }
        let t = Template {
            key: key.to_string(),
            image_digest: image.digest.clone(),
            image_reference: image.canonical_reference.clone(),
            rootfs: image.rootfs.clone(),
            checkpoint,
            golden_token,
            build_ms: clock.ms(),
        };
        template::commit(&dir, &t).map_err(|e| fail(format!("commit: {e}")))?;
        tracing::info!(image = %t.image_reference, build_ms = t.build_ms, "template built");
        Ok(t)
    }

    /// Passes the readiness gate of `recipe` in the started template `sandbox`.
    fn warm_up(&self, sandbox: &LocalSandbox, recipe: &GoldenRecipe) -> Result<(), String> {
        let Some(readiness) = &recipe.readiness else {
            return Ok(());
        };
        let waited = crate::warmup::wait_ready(readiness, &sandbox.slot.netns_path, &sandbox.execd)
            .map_err(|e| format!("readiness: {e}"))?;
        tracing::info!(sandbox = %sandbox.handle.id, waited_ms = waited.as_millis() as u64, "template ready");
        Ok(())
    }

    /// The template in `dir` if it holds this node's execd; one built with another execd
    /// (fastbox was upgraded since) is built again, so new sandboxes get the current one.
    pub(crate) fn current_template(&self, dir: &Path) -> Option<Template> {
        let t = template::load(dir)?;
        if self.holds_current_execd(&t) {
            Some(t)
        } else {
            tracing::info!(image = %t.image_reference, "template holds another execd: building it again");
            None
        }
    }

    /// Whether the checkpoint of `t` was taken of the execd this node injects.
    pub(crate) fn holds_current_execd(&self, t: &Template) -> bool {
        fastbox_runtime::checkpoint::read_meta(&t.checkpoint)
            .is_ok_and(|meta| meta.execd_digest == self.execd.digest)
    }

    /// Restores `template` as sandbox `req.id` in slot `slot`, gives it its own identity
    /// (hostname, identity files) and claims its execd (token, environment, entrypoint).
    pub fn restore_from(
        &self,
        template: &Template,
        req: &PlaceRequest,
        slot: u32,
    ) -> Result<(Placement, StartReport), FastletError> {
        self.restore_as(template, req, slot, StartMode::Claim)
    }

    /// Restores `template` as sandbox `req.id` and wakes it as `mode` says. A resume stays in
    /// `slot` (its address); other starts may take a spare, and the caller releases `slot`
    /// when the placement names another.
    pub(crate) fn restore_as(
        &self,
        template: &Template,
        req: &PlaceRequest,
        slot: u32,
        mode: StartMode,
    ) -> Result<(Placement, StartReport), FastletError> {
        let _start = self.starts.begin();
        // `_reading` keeps other restores off the checkpoint until its transfer is tracked.
        let (remote_memory, _reading) = match self.remote_memory(template, &req.id, mode)? {
            Some((pages, claim)) => (Some(pages), Some(claim)),
            None => (None, None),
        };
        let whole_after = remote_memory.as_ref().map(|_| template.checkpoint.clone());
        // The same sandbox at the same address keeps its connections; clones close them.
        let keep_tcp = mode == StartMode::Resume;
        let opts = StartOptions {
            id: req.id.clone(),
            limits: req.limits,
            disk_bytes: req.disk_bytes,
            execd_token: Some(template.golden_token.clone()),
            // No way out until `configure` installed the request's policy. A resume that
            // keeps its connections needs its way out during the restore (CRIU connects
            // each one again, which needs a route to its peer): its policy goes in first.
            deny_egress: !keep_tcp,
            policy: keep_tcp.then(|| req.policy.clone()),
            keep_tcp,
            // Claims restore templates, which are small and restored whole.
            lazy_memory: mode != StartMode::Claim && self.restores_lazily(template),
            remote_memory,
            ..StartOptions::default()
        };
        let place_err = |source: HostError| FastletError::Place {
            id: req.id.clone(),
            source: Box::new(source),
        };
        let source = match (req.disk_bytes, mode) {
            (None, StartMode::Claim | StartMode::Clone) => {
                self.spares.take().map(|s| SlotSource::Spare(Box::new(s)))
            }
            _ => None,
        }
        .unwrap_or(SlotSource::Fresh(slot));
        let index = source.index();
        let volumes_err = |source| FastletError::Volumes {
            id: req.id.clone(),
            source: Box::new(source),
        };
        let staged = match mode {
            StartMode::Resume | StartMode::Moved | StartMode::Clone => {
                crate::volumes::Staged::mount(
                    &self.cfg.data_dir,
                    self.volume_sources(&req.id),
                    &req.volumes,
                )
                .map_err(volumes_err)?
            }
            StartMode::Claim => Default::default(),
        };
        let opts = StartOptions {
            external_mounts: staged.sources(),
            ..opts
        };
        let restored = self.restore_template(template, source, &opts);
        drop(staged);
        let mut sb = restored.map_err(|e| {
            if index != slot {
                self.release_slot(index);
            }
            place_err(e)
        })?;
        if let Some(transfer) = sb.transfer.take() {
            self.transfers.track(
                &req.id,
                &sb.handle.dir,
                &template.key,
                transfer,
                whole_after,
            );
        }
        let mut phases = sb.phases.clone();
        match self.configure(&sb.handle, &sb.slot, template, req, mode) {
            Ok(configured) => phases.extend(&configured),
            Err(e) => {
                let _ = self.host.destroy(&sb);
                if index != slot {
                    self.release_slot(index);
                }
                return Err(e);
            }
        }
        let report = StartReport {
            source: mode.source().into(),
            phases,
        };
        // (`slot`: the one it runs in, a spare's when one stood in for the admitted one.)
        tracing::info!(sandbox = %req.id, checkpoint = %template.key, slot = index, admitted = slot, address = %sb.slot.address, phases = %report.summary(), "sandbox restored");
        self.add_route(&req.id, index, sb.slot.address, req);
        Ok((
            Placement {
                slot: index,
                address: sb.slot.address,
                handle: sb.handle,
            },
            report,
        ))
    }

    /// The pages a restore of `template` as `id` fetches while it runs, when its memory is
    /// still in the artifact store ([`RemotePages`]), with the claim that keeps other
    /// restores off the checkpoint: only a resume restores such a checkpoint, one at a time,
    /// and whatever pages image a cut transfer left goes first. A resume that may not start
    /// before its memory is in place (lazy restores off, too small, or too many transfers
    /// running: [`Fastlet::lazy_allowed`]) fetches it whole here and restores it whole.
    fn remote_memory(
        &self,
        template: &Template,
        id: &str,
        mode: StartMode,
    ) -> Result<Option<(LazyPages, crate::transfers::ReadClaim)>, FastletError> {
        // Templates are materialized whole: a claim (every create) reads no list.
        if mode == StartMode::Claim {
            return Ok(None);
        }
        let Some(pages) = RemotePages::read(&template.checkpoint) else {
            return Ok(None);
        };
        let refuse = |message: &str| FastletError::Snapshot {
            key: template.key.clone(),
            message: format!("sandbox {id}: {message}"),
        };
        if !matches!(mode, StartMode::Resume | StartMode::Moved) {
            return Err(refuse(
                "its memory is not on this node yet: only a resume restores it",
            ));
        }
        if pages.files.is_empty() {
            // `RemotePages::read` found the list unreadable: which pages are missing is unknown.
            return Err(refuse("the list of its memory's blocks is unreadable"));
        }
        let claim = self
            .transfers
            .begin_read(&template.key)
            .ok_or_else(|| refuse("another restore is fetching its memory"))?;
        let images = fastbox_runtime::checkpoint::images_dir(&template.checkpoint);
        let source = Arc::new(StoreBlocks::new(self.artifact_store().clone()));
        if !self.lazy_allowed(pages.bytes()) {
            let clock = BuildClock::start();
            pages
                .fetch_whole(source.as_ref(), &images, &template.checkpoint)
                .map_err(|e| refuse(&format!("fetching its memory: {e}")))?;
            tracing::info!(sandbox = %id, checkpoint = %template.key, bytes = pages.bytes(), ms = clock.ms(), "memory fetched whole before the restore");
            return Ok(None);
        }
        pages.remove_partial(&images);
        let transfer_timeout = pages.transfer_timeout(LAZY_TRANSFER_TIMEOUT);
        Ok(Some((
            pages.lazy_pages(source, LAZY_RESTORE_TIMEOUT, Some(transfer_timeout)),
            claim,
        )))
    }

    /// Whether a restore whose pages images hold `bytes` may start before they are in
    /// place: lazy restores are on, it holds at least [`FastletConfig::lazy_restore_min_bytes`],
    /// and fewer than [`LAZY_TRANSFERS_MAX`] transfers run.
    fn lazy_allowed(&self, bytes: u64) -> bool {
        self.cfg
            .lazy_restore_min_bytes
            .is_some_and(|min| bytes > 0 && bytes >= min)
            && self.transfers.running() < LAZY_TRANSFERS_MAX
    }

    /// Whether a clone or a resume of checkpoint `template` starts before its memory is in
    /// place: its pages images hold at least [`FastletConfig::lazy_restore_min_bytes`], and fewer than
    /// [`LAZY_TRANSFERS_MAX`] transfers run.
    fn restores_lazily(&self, template: &Template) -> bool {
        let images = fastbox_runtime::checkpoint::images_dir(&template.checkpoint);
        let pages: u64 = std::fs::read_dir(images)
            .map(|entries| {
                entries
                    .flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with("pages-"))
                    .filter_map(|e| e.metadata().ok())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0);
        self.lazy_allowed(pages)
    }

    /// Restores the golden checkpoint of `template` into the slot of `source` and waits for
    /// execd.
    fn restore_template(
        &self,
        template: &Template,
        source: SlotSource,
        opts: &StartOptions,
    ) -> Result<crate::host::LocalSandbox, HostError> {
        self.host.restore(
            &self.cfg.criu,
            &template.checkpoint,
            &template.rootfs,
            &self.cfg.data_dir.join("execd"),
            source,
            opts,
        )
    }

    /// Makes a restored sandbox `req.id`: its hostname and identity files (not on a resume:
    /// they are its own), its egress policy, its network opened, and its execd woken as
    /// `mode` says (claimed with token, environment and entrypoint; given a new token; or
    /// left as it was). Returns the phases `identity`, `policy` and `claim` (execd woken and
    /// the network opened, in parallel).
    fn configure(
        &self,
        handle: &SandboxHandle,
        slot: &fastbox_runtime::net::NetSlot,
        template: &Template,
        req: &PlaceRequest,
        mode: StartMode,
    ) -> Result<Phases, FastletError> {
        let place_err = |source: HostError| FastletError::Place {
            id: req.id.clone(),
            source: Box::new(source),
        };
        let mut clock = LapClock::start();
        if mode != StartMode::Resume {
            sandbox::set_identity(handle, &req.id, Some(&slot.resolv_conf()))
                .map_err(|e| place_err(e.into()))?;
            clock.lap("identity");
        }
        // A restore's volumes (a resume, a clone) are CRIU's to mount again: external mounts
        // of its checkpoint.
        let egress_err = |source| FastletError::Egress {
            id: req.id.clone(),
            source: Box::new(source),
        };
        self.host
            .egress
            .apply_to_new(&SlotRef::from(slot), &req.policy)
            .map_err(egress_err)?;
        // Its HTTPS goes through the proxy before its network opens, with its vault (kept
        // here while it was paused on this node; new otherwise).
        let trust_ca_pem = if req.credential_proxy {
            let proxy = self
                .credential_proxy
                .as_ref()
                .ok_or_else(|| FastletError::NoCredentialProxy(req.id.clone()))?;
            self.host
                .egress
                .route_https_to_credential_proxy(&SlotRef::from(slot), true)
                .map_err(egress_err)?;
            proxy.admit(slot, self.vaults.cell(&req.id));
            Some(proxy.ca_pem())
        } else {
            None
        };
        clock.lap("policy");
        // Its buckets are unmounted again unless the whole configuration succeeds.
        let mut buckets = crate::object_volumes::UnmountOnDrop::new(&self.cfg.data_dir, &req.id);
        if !req.volumes.is_empty() && mode == StartMode::Claim {
            let mounted = self.mount_volumes(handle, slot, req);
            if let (Err(_), Some(proxy), Some(_)) = (&mounted, &self.credential_proxy, trust_ca_pem)
            {
                proxy.forget(slot.address);
            }
            mounted?;
            clock.lap("volumes");
        }
        let mut envs: Vec<(String, String)> = req
            .env
            .iter()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        envs.extend(crate::host::announced_limits(&req.limits));
        let execd = ExecdClient::with_client(
            format!(
                "http://{}:{}",
                slot.address,
                fastbox_runtime::spec::EXECD_PORT
            ),
            Some(template.golden_token.clone()),
            self.http.clone(),
        );
        // The network opens while execd is claimed (the entrypoint may start before it is
        // open, never after this returns).
        let (opened, claimed) = std::thread::scope(|scope| {
            let open = scope.spawn(|| {
                let c = BuildClock::start();
                self.host.network.allow_egress(slot).map(|()| c.ms())
            });
            let c = BuildClock::start();
            let claimed = match mode {
                StartMode::Claim => {
                    execd.claim(&req.execd_token, &envs, &req.entrypoint, trust_ca_pem)
                }
                StartMode::Clone => execd.rekey(&req.execd_token),
                StartMode::Resume | StartMode::Moved => Ok(()),
            }
            .map(|()| c.ms());
            (open.join().expect("egress thread"), claimed)
        });
        tracing::debug!(sandbox = %req.id, claim_ms = ?claimed.as_ref().ok(), egress_ms = ?opened.as_ref().ok(), "configured");
        let configured = claimed
            .map_err(|source| FastletError::Claim {
                id: req.id.clone(),
                source,
            })
            .and_then(|_| opened.map_err(|e| place_err(e.into())));
        if let (Err(_), Some(proxy), Some(_)) = (&configured, &self.credential_proxy, trust_ca_pem)
        {
            proxy.forget(slot.address);
        }
        configured?;
        buckets.keep();
        clock.lap("claim");
        Ok(clock.finish())
    }

    /// Mounts a claimed sandbox's volumes before its entrypoint starts. Its buckets first:
    /// their clients run in its network namespace, which is opened for them now (under the
    /// policy in force already).
    fn mount_volumes(
        &self,
        handle: &SandboxHandle,
        slot: &fastbox_runtime::net::NetSlot,
        req: &PlaceRequest,
    ) -> Result<(), FastletError> {
        let object_err = |source| FastletError::ObjectVolume {
            id: req.id.clone(),
            source: Box::new(source),
        };
        let buckets = req.volumes.iter().any(|v| {
            matches!(
                v.source,
                fastbox_node_api::wire::VolumeSource::ObjectStorage { .. }
            )
        });
        if buckets {
            self.host
                .network
                .allow_egress(slot)
                .map_err(|e| FastletError::Place {
                    id: req.id.clone(),
                    source: Box::new(e.into()),
                })?;
        }
        for volume in &req.volumes {
            crate::object_volumes::mount(
                &self.cfg.data_dir,
                &req.id,
                &slot.netns_path,
                volume,
                req.volume_keys.get(&volume.name),
            )
            .map_err(object_err)?;
        }
        crate::volumes::detached_mounts(self.volume_sources(&req.id), &req.volumes)
            .and_then(|mounts| Ok(fastbox_runtime::volume::attach(handle.init_pid, mounts)?))
            .map_err(|source| FastletError::Volumes {
                id: req.id.clone(),
                source: Box::new(source),
            })
    }

    /// Forgets the template named `key` on this node (its directory; pooled sandboxes of it
    /// are not refilled after a restart).
    pub fn remove_template(&self, key: &str) -> std::io::Result<()> {
        // Its isolation variant ([`fastbox_node_api::recipe::isolation_key`]) goes with it.
        for key in [
            key.to_string(),
            fastbox_node_api::recipe::isolation_key(key),
        ] {
            self.pools.unregister(&key);
            let dir = template::template_dir(&self.cfg.data_dir, &key);
            crate::from_artifact::unmount_rootfs(&dir);
            match std::fs::remove_dir_all(dir) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        Ok(())
    }

    /// Publishes `template` into this node's artifact store
    /// ([`FastletConfig::artifact_store`]): packed rootfs and checkpoint as content-addressed
    /// blocks, the manifest, and the index entry `index_key` (an image reference or a
    /// template id), created only if absent.
    pub fn publish_template(
        &self,
        template: &Template,
        index_key: &str,
    ) -> Result<crate::artifact::PublishedTemplate, FastletError> {
        self.publish(
            template,
            index_key,
            fastbox_artifact::ArtifactKind::Template,
        )
        .map_err(|message| FastletError::Template {
            image: template.image_reference.clone(),
            message,
        })
    }

    /// Publishes the checkpoint `template` (a golden template, a snapshot or a pause's
    /// checkpoint) into this node's artifact store under `index_key`. A snapshot or a
    /// checkpoint names the template of its image as its parent, when that is published.
    pub(crate) fn publish(
        &self,
        template: &Template,
        index_key: &str,
        kind: fastbox_artifact::ArtifactKind,
    ) -> Result<crate::artifact::PublishedTemplate, String> {
        let store = self.artifact_store();
        let work_dir = self.cfg.data_dir.join("artifacts-work");
        std::fs::create_dir_all(&work_dir).map_err(|e| format!("{}: {e}", work_dir.display()))?;
        let mut opts = crate::artifact::PublishOptions::new(index_key, &work_dir);
        opts.kind = kind;
        if kind != fastbox_artifact::ArtifactKind::Template {
            opts.parent = fastbox_artifact::IndexKey::try_new(&template.image_reference)
                .ok()
                .and_then(|key| store.index_get(&key).ok())
                .flatten();
        }
        let published = crate::artifact::publish_template(
            store.as_ref(),
            template,
            &opts,
            &fastbox_artifact::NoProgress,
        )
        .map_err(|e| format!("publish: {e}"))?;
        tracing::info!(key = %index_key, kind = ?kind, manifest = %published.manifest.to_hex(), blocks = published.stats.blocks, new_blocks = published.stats.new_blocks, seconds = published.seconds, "artifact published");
        Ok(published)
    }

    /// This node's artifact store ([`FastletConfig::artifact_store`], opened before the
    /// fastlet started).
    pub(crate) fn artifact_store(&self) -> &std::sync::Arc<dyn fastbox_artifact::ArtifactStore> {
        &self.cfg.artifact_store
    }

    /// Keeps a warm pool of `template` from now on (no-op without a pool size).
    pub fn register_template(&self, template: &Template) {
        self.pools.register(template);
    }

    /// Memory of every unclaimed pooled sandbox (what an idle one costs), by runtime id.
    pub fn pool_memory(&self) -> Vec<(String, crate::memory::MemoryUse)> {
        self.pools
            .ids()
            .into_iter()
            .filter_map(|id| {
                crate::memory::sandbox_memory(&self.host.cgroups, &self.cfg.prefix, &id)
                    .ok()
                    .map(|m| (id, m))
            })
            .collect()
    }

    /// Ready pooled sandboxes per template digest.
    pub fn pool_sizes(&self) -> HashMap<String, usize> {
        self.pools.sizes()
    }

    /// Takes an unclaimed sandbox of `template` from the warm pool and makes it `req`: O(1)
    /// admission, then the claim. None when the pool is empty (or `req` needs something a
    /// pooled sandbox cannot give, such as its own disk size): the caller restores instead.
    pub fn claim_pooled(
        &self,
        template: &Template,
        req: &PlaceRequest,
    ) -> Option<Result<(Placement, StartReport), FastletError>> {
        if req.disk_bytes.is_some() {
            return None;
        }
        let _start = self.starts.begin();
        let mut clock = LapClock::start();
        let pooled = self.pools.take(&template.key)?;
        clock.lap("acquire");
        let placement = pooled.placement;
        // Held by the claim until it is routed (a stale release of the slot is refused).
        let _held = self.pools.hold_slot(placement.slot, &req.id);
        let slot = match self.host.network.slot(placement.slot) {
            Ok(slot) => slot,
            Err(e) => return Some(Err(self.discard_pooled(&placement, req, e.into()))),
        };
        // The slot's network must still be this sandbox's. One released under it and made
        // again holds another sandbox, whose execd must never be sent the template's golden
        // token: the pooled sandbox goes (its processes and files, not the slot, which is
        // not its own any more), and the create restores instead.
        if !fastbox_runtime::net::netns::process_is_in(placement.handle.init_pid, &slot.netns_path)
        {
            tracing::error!(pooled = %placement.handle.id, slot = placement.slot, "a pooled sandbox is not in its slot's network namespace (the slot was released under it): discarded, the create restores instead");
            let _ = self.remove(&placement.handle.id, None, None);
            return None;
        }
        let limited = fastbox_runtime::cgroup::Cgroup::open(
            &self.host.cgroups,
            &self.cfg.prefix,
            &placement.handle.id,
        )
        .map(|cg| cg.set_limits(&req.limits));
        if let Some(Err(e)) = limited {
            return Some(Err(self.discard_pooled(&placement, req, e.into())));
        }
        clock.lap("limits");
        match self.configure(&placement.handle, &slot, template, req, StartMode::Claim) {
            Ok(configured) => clock.laps(&configured),
            // Its execd did not take the claim (not reached, no answer): the pooled sandbox
            // goes, whatever it took of the claim with it, and the create restores instead
            // (a restore waits for its own execd).
            Err(e @ FastletError::Claim { .. }) => {
                tracing::warn!(sandbox = %req.id, pooled = %placement.handle.id, error = %e, "a pooled sandbox did not take its claim: discarded, the create restores instead");
                let _ = self.remove(&placement.handle.id, Some(&placement), None);
                return None;
            }
            Err(e) => {
                let _ = self.remove(&placement.handle.id, Some(&placement), None);
                return Some(Err(e));
            }
        }
        let report = StartReport {
            source: "pool".into(),
            phases: clock.finish(),
        };
        tracing::info!(sandbox = %req.id, pooled = %placement.handle.id, slot = placement.slot, phases = %report.summary(), "sandbox claimed from the warm pool");
        self.add_route(&req.id, placement.slot, placement.address, req);
        self.claimed
            .lock()
            .expect("claimed lock")
            .entry(req.id.clone())
            .or_default()
            .push(placement.clone());
        Some(Ok((placement, report)))
    }

    fn discard_pooled(
        &self,
        placement: &Placement,
        req: &PlaceRequest,
        e: HostError,
    ) -> FastletError {
        let _ = self.remove(&placement.handle.id, Some(placement), None);
        FastletError::Place {
            id: req.id.clone(),
            source: Box::new(e),
        }
    }

    /// Restores one unclaimed sandbox of `template` into the warm pool.
    fn fill_one(&self, template: &Template) -> Result<(), FastletError> {
        let id = format!("{POOL_ID_PREFIX}{}", &random_hex()[..12]);
        let source = match self.spares.take() {
            Some(spare) => SlotSource::Spare(Box::new(spare)),
            None => SlotSource::Fresh(self.reserve_slot()?),
        };
        let slot = source.index();
        let _held = self.pools.hold_slot(slot, &id);
        let opts = StartOptions {
            id: id.clone(),
            execd_token: Some(template.golden_token.clone()),
            deny_egress: true,
            ..StartOptions::default()
        };
        let restored = self
            .restore_template(template, source, &opts)
            .map_err(|source| FastletError::Place {
                id: id.clone(),
                source: Box::new(source),
            });
        let sb = match restored {
            Ok(sb) => sb,
            Err(e) => {
                self.release_slot(slot);
                return Err(e);
            }
        };
        let recorded = std::fs::write(sb.handle.dir.join(POOL_SLOT_FILE), slot.to_string())
            .map_err(|e| {
                HostError::from(fastbox_runtime::sandbox::SandboxError::Io {
                    id: id.clone(),
                    what: "record the pool slot".into(),
                    source: e,
                })
            });

        if let Err(e) = recorded {
            let _ = self.host.destroy(&sb);
            self.release_slot(slot);
            return Err(FastletError::Place {
                id,
                source: Box::new(e),
            });
        }
        let late = self.pools.put(Pooled {
            placement: Placement {
                slot,
                address: sb.slot.address,
                handle: sb.handle,
            },
            template: template.key.clone(),
        });
        if let Some(late) = late {
            // The pools were drained while it was restored.
            self.remove(&late.placement.handle.id, Some(&late.placement), None)?;
        }
        Ok(())
    }

    /// Starts the threads that keep the warm pools full: [`REFILL_THREADS`] restores at a
    /// time.
    pub fn start_refill(self: &std::sync::Arc<Self>) {
        if self.pools.max() == 0 {
            return;
        }
        for i in 0..REFILL_THREADS {
            let this = std::sync::Arc::downgrade(self);
            std::thread::Builder::new()
                .name(format!("fastbox-pool-{i}"))
                .spawn(move || {
                    crate::background::enter();
                    loop {
                        let Some(fastlet) = this.upgrade() else { return };
                        let Some(template) = fastlet.pools.next_to_fill() else {
                            return;
                        };
                        let filled = fastlet.fill_one(&template);
                        fastlet.pools.filled(&template.key);
                        if let Err(e) = filled {
                            tracing::warn!(image = %template.image_reference, error = %e, "warm pool refill failed");
                            drop(fastlet);
                            std::thread::sleep(std::time::Duration::from_secs(1));
                        }
                    }
                })
                .expect("spawn a pool thread");
        }
    }

    /// After a restart, once every recorded sandbox and pooled leftover holds its slot:
    /// removes network slots of the instance that nothing holds (a start interrupted by a
    /// crash leaves one). Returns how many.
    pub fn purge_stale_slots(&self) -> usize {
        let names = match fastbox_runtime::net::HostNetwork::leaked(&self.cfg.prefix) {
            Ok(found) => found.netns.into_iter().chain(found.links),
            Err(e) => {
                tracing::warn!(error = %e, "could not list network slots");
                return 0;
            }
        };
        let stale: std::collections::BTreeSet<u32> = names
            .filter_map(|n| fastbox_runtime::net::names::slot_index(&self.cfg.prefix, &n))
            .filter(|i| !self.slots.lock().expect("slot table lock").is_used(*i))
            .collect();
        for &index in &stale {
            if let Ok(slot) = self.host.network.slot(index)
                && let Err(e) = self.host.release_network(&slot)
            {
                tracing::warn!(slot = index, error = %e, "could not remove a stale slot");
            }
        }
        stale.len()
    }

    /// After a restart: removes the spare slots and pooled sandboxes a previous run left,
    /// except pooled ones in `claimed` (they became sandboxes before the restart).
    pub fn purge_pool_leftovers(&self, claimed: &std::collections::HashSet<String>) -> usize {
        let Ok(entries) = std::fs::read_dir(self.cfg.data_dir.join("sandboxes")) else {
            return 0;
        };
        let mut removed = 0;
        for entry in entries.flatten() {
            let id = entry.file_name().to_string_lossy().into_owned();
            if let Some(slot) = ReapJob::slot_of(&id) {
                // A teardown queued before the restart.
                if let Some(index) = slot {
                    self.claim_slot(index);
                }
                let job = ReapJob {
                    dir: entry.path(),
                    slot,
                };
                match self.reap(&job) {
                    Ok(()) => removed += 1,
                    Err(e) => {
                        tracing::warn!(dir = %job.dir.display(), error = %e, "could not finish a teardown left by an earlier run")
                    }
                }
                continue;
            }
            let slot = if let Some(index) = id.strip_prefix(SPARE_ID_PREFIX) {
                index.parse::<u32>().ok()
            } else if id.starts_with(POOL_ID_PREFIX) && !claimed.contains(&id) {
                std::fs::read_to_string(entry.path().join(POOL_SLOT_FILE))
                    .ok()
                    .and_then(|s| s.trim().parse::<u32>().ok())
            } else {
                continue;
            };
            if let Some(slot) = slot {
                self.claim_slot(slot);
            }
            match self.remove(&id, None, slot) {
                Ok(_) => removed += 1,
                Err(e) => {
                    tracing::warn!(sandbox = %id, error = %e, "could not remove a pooled sandbox left by an earlier run")
                }
            }
        }
        removed + self.purge_spare_cgroups()
    }

    /// Cgroups of spares a crash interrupted before their directory existed (at start, when
    /// no spare is being made).
    fn purge_spare_cgroups(&self) -> usize {
        crate::host::remove_cgroups(&self.host.cgroups, &self.cfg.prefix, |name| {
            name.starts_with(SPARE_ID_PREFIX)
        })
    }

    /// After a restart: takes back a sandbox recorded as placed here. [`Adoption::Adopted`]
    /// when its processes are alive (it is routable again); otherwise the caller fails and
    /// removes it. The instance's nft table was re-installed at start, so the egress policy
    /// is applied again; a sandbox whose policy cannot be applied is not adopted (fail
    /// closed), nor is a sandbox whose memory a transfer of an earlier run was still copying
    /// in ([`crate::transfers`]; one this run watches is adopted, its transfer goes on).
    pub fn adopt(
        &self,
        id: &str,
        placement: &Placement,
        tokens: &SandboxTokens,
        policy: &EgressPolicy,
        credential_proxy: bool,
    ) -> Adoption {
        self.slots
            .lock()
            .expect("slot table lock")
            .claim(placement.slot);
        // A transfer this run watches goes on (a server that started asks about every
        // sandbox on the node): only one the last run left is checked.
        if !self.transfers.watches(id)
            && let Some(incomplete) = self.memory_incomplete(id, &placement.handle.dir)
        {
            tracing::warn!(sandbox = %id, why = incomplete, "its memory was still being copied in: not adopted");
            return Adoption::MemoryIncomplete;
        }
        if !placement.handle.is_running() {
            return Adoption::Gone;
        }
        let applied = self
            .host
            .network
            .slot(placement.slot)
            .map_err(HostError::from)
            .and_then(|slot| {
                self.host.egress.apply(&SlotRef::from(&slot), policy)?;
                Ok(slot)
            });
        let slot = match applied {
            Ok(slot) => slot,
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, "could not re-apply the egress policy");
                return Adoption::Gone;
            }
        };
        // Its HTTPS through the proxy again, with a new (empty) vault: values lived in the
        // last run's memory only.
        if credential_proxy {
            let routed = match &self.credential_proxy {
                Some(proxy) => self
                    .host
                    .egress
                    .route_https_to_credential_proxy(&SlotRef::from(&slot), true)
                    .map(|()| proxy.admit(&slot, self.vaults.cell(id)))
                    .map_err(|e| e.to_string()),
                None => Err("this node runs no credential proxy".into()),
            };
            if let Err(e) = routed {
                tracing::warn!(sandbox = %id, error = %e, "could not route its HTTPS through the credential proxy again: not adopted");
                return Adoption::Gone;
            }
        }
        self.insert_route(
            id,
            Route {
                address: placement.address,
                slot: placement.slot,
                execd_token: tokens.execd.clone(),
                egress_token: tokens.egress.clone(),
                credential_proxy,
            },
        );
        Adoption::Adopted
    }

    /// After a restart: why the memory of sandbox `id` (directory `dir`) is not all in place,
    /// if it is not. A memory transfer the last run left is waited for first (a daemon
    /// reading a local checkpoint finishes on its own); it failed when the daemon's guard
    /// froze the sandbox. A frozen sandbox without a mark was frozen between its restore and
    /// the mark.
    fn memory_incomplete(&self, id: &str, dir: &Path) -> Option<&'static str> {
        let mark = crate::transfers::Mark::read(dir);
        let daemon_done = match mark.as_ref().map(|m| m.daemon) {
            Some(Some(daemon)) => daemon.wait_gone(TRANSFER_WAIT),
            Some(None) => return Some("its transfer's daemon is not known"),
            None => true,
        };
        if !daemon_done {
            return Some("its transfer's daemon still runs");
        }
        let frozen =
            fastbox_runtime::cgroup::Cgroup::open(&self.host.cgroups, &self.cfg.prefix, id)
                .is_some_and(|c| c.is_frozen().unwrap_or(false));
        if frozen {
            return Some("its transfer failed and froze it");
        }
        // The daemon finished the transfer after the last run ended.
        crate::transfers::Mark::clear(dir);
        None
    }

    /// Marks a slot as taken without a running sandbox (a create that was interrupted), so
    /// it is not handed out before [`Fastlet::remove`] cleaned it.
    pub fn claim_slot(&self, slot: u32) {
        self.slots.lock().expect("slot table lock").claim(slot);
    }

    /// Whether the processes of `placement` are alive.
    pub fn is_alive(&self, placement: &Placement) -> bool {
        placement.handle.is_running()
    }

    /// Kills sandbox `id` and removes its files, mounts, cgroup and slot, then frees the
    /// slot. Idempotent, and works from any point of a create: `placement` is `None` when
    /// the start never finished, then whatever exists under the sandbox's name is removed.
    /// Once the processes are gone, the rest is queued to the reaper when it runs
    /// ([`Fastlet::start_reaper`]; `total_ms` is then the time until queued).
    pub fn remove(
        &self,
        id: &str,
        placement: Option<&Placement>,
        slot: Option<u32>,
    ) -> Result<RemoveReport, FastletError> {
        let clock = BuildClock::start();
        self.forget_route(id);
        self.forget_vault(id);
        self.remove_unrecorded_claims(id, placement)
            .map_err(|source| FastletError::Remove {
                id: id.to_string(),
                source: Box::new(source),
            })?;
        let handle = placement.map(|p| p.handle.clone()).unwrap_or_else(|| {
            // An interrupted start: a restore that outlived a crash would put processes
            // back after this.
            let handle = self.unstarted_handle(id);
            fastbox_runtime::checkpoint::wait_for_restore(&handle.dir, RESTORE_WAIT);
            handle
        });
        let slot = placement.map(|p| p.slot).or(slot);
        let remove_err = |source: HostError| FastletError::Remove {
            id: id.to_string(),
            source: Box::new(source),
        };
        sandbox::stop_processes(&handle, &self.host.cgroups).map_err(|e| remove_err(e.into()))?;
        let processes_gone_ms = clock.ms();
        crate::object_volumes::unmount_all(&self.cfg.data_dir, id);
        if placement.is_some() && !handle.dir.exists() {
            // Removed already: an earlier removal moved its directory to the reaper, whose
            // teardown releases (or released) the slot. A second removal (a server taking
            // over a removal whose node call its predecessor left running) releasing it
            // again would free it under its next holder.
            tracing::info!(sandbox = %id, slot = ?slot, "removed already: the slot is not released again");
            return Ok(RemoveReport {
                processes_gone_ms,
                total_ms: clock.ms(),
            });
        }
        let job = self.queue_teardown(&handle, slot).map_err(remove_err)?;
        if let Some(job) = job {
            self.reap(&job).map_err(remove_err)?;
        }
        for volume in self.named_volumes.user_ended(id) {
            tracing::info!(sandbox = %id, volume = %volume, "named volume deleted with its sandbox");
        }
        let report = RemoveReport {
            processes_gone_ms,
            total_ms: clock.ms(),
        };
        tracing::info!(sandbox = %id, processes_gone_ms, total_ms = report.total_ms, "sandbox removed");
        Ok(report)
    }

    /// Removes the pooled sandboxes claimed as `id` other than `placement` (all of them
    /// without one), slots included, and forgets the claims. A claim is a start into a slot
    /// that is not the one reserved for it: when its server died before it recorded the
    /// placement, the server that finishes its operation knows only the reserved slot, and
    /// the claimed sandbox would otherwise run on, as `id`, after `id` was deleted.
    pub(crate) fn remove_unrecorded_claims(
        &self,
        id: &str,
        placement: Option<&Placement>,
    ) -> Result<(), HostError> {
        let claims = self
            .claimed
            .lock()
            .expect("claimed lock")
            .remove(id)
            .unwrap_or_default();
        let unrecorded = claims
            .into_iter()
            .filter(|c| placement.is_none_or(|p| p.handle.id != c.handle.id))
            // Gone already (its directory moved to the reaper): its slot may be another's.
            .filter(|c| c.handle.dir.exists());
        for claim in unrecorded {
            tracing::warn!(sandbox = %id, pooled = %claim.handle.id, slot = claim.slot, "removing a sandbox claimed from the pool whose placement its server never recorded");
            sandbox::stop_processes(&claim.handle, &self.host.cgroups)?;
            if let Some(job) = self.queue_teardown(&claim.handle, Some(claim.slot))? {
                self.reap(&job)?;
            }
        }
        Ok(())
    }

    /// Moves the sandbox directory out of the way (`reap-<slot>-<id>`) and queues its
    /// teardown; returns the job when no reaper runs (the caller reaps it now).
    fn queue_teardown(
        &self,
        handle: &SandboxHandle,
        slot: Option<u32>,
    ) -> Result<Option<ReapJob>, HostError> {
        let dir = self
            .cfg
            .data_dir
            .join("sandboxes")
            .join(ReapJob::dir_name(slot, &handle.id));
        match std::fs::rename(&handle.dir, &dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(HostError::from(
                    fastbox_runtime::sandbox::SandboxError::Io {
                        id: handle.id.clone(),
                        what: format!("move {} to {}", handle.dir.display(), dir.display()),
                        source,
                    },
                ));
            }
        }
        let job = ReapJob { dir, slot };
        Ok((!self.reaper.queue(job.clone())).then_some(job))
    }

    /// Tears down what `job` names: the layers and files of the directory, the network
    /// slot, then frees the slot index. A slot whose teardown failed stays taken (and is
    /// logged), so it is never handed out half-removed.
    fn reap(&self, job: &ReapJob) -> Result<(), HostError> {
        let name = job
            .dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let handle = SandboxHandle::unstarted(&name, &self.cfg.prefix, job.dir.clone());
        sandbox::destroy(&handle, &self.host.cgroups)?;
        if let Some(index) = job.slot {
            let net = self.host.network.slot(index)?;
            self.host.release_network(&net)?;
            self.release_slot(index);
        }
        Ok(())
    }

    /// Starts the reaper thread: removals return once the processes are gone and the rest
    /// is queued. [`Fastlet::drain_pools`] waits for the queue.
    pub fn start_reaper(self: &std::sync::Arc<Self>) {
        let this = std::sync::Arc::downgrade(self);
        self.reaper.start(move |job| {
            let Some(fastlet) = this.upgrade() else { return };
            if fastlet.reaper.pending() <= REAP_HOLD_OFF_QUEUE {
                fastlet.starts.wait_quiet(BACKGROUND_HOLD_OFF);
            }
            let clock = BuildClock::start();
            match fastlet.reap(job) {
                Ok(()) => {
                    tracing::debug!(dir = %job.dir.display(), ms = clock.ms(), "teardown done")
                }
                Err(e) => {
                    tracing::warn!(dir = %job.dir.display(), error = %e, "teardown failed; the slot stays taken")
                }
            }
        });
    }

    /// Where the volumes of sandbox `id` come from on this node.
    fn volume_sources<'a>(&'a self, id: &'a str) -> crate::volumes::Sources<'a> {
        crate::volumes::Sources {
            allowed: &self.cfg.host_volume_roots,
            named: &self.named_volumes,
            user: id,
            data_dir: &self.cfg.data_dir,
        }
    }

    /// This node's named volumes.
    pub fn named_volumes(&self) -> &crate::named_volumes::NamedVolumes {
        &self.named_volumes
    }

    pub(crate) fn unstarted_handle(&self, id: &str) -> SandboxHandle {
        SandboxHandle::unstarted(id, &self.cfg.prefix, sandbox_dir(&self.cfg.data_dir, id))
    }

    fn add_route(&self, id: &str, slot: u32, address: Ipv4Addr, req: &PlaceRequest) {
        self.insert_route(
            id,
            Route {
                address,
                slot,
                execd_token: req.execd_token.clone(),
                egress_token: req.egress_token.clone(),
                credential_proxy: req.credential_proxy,
            },
        );
    }

    /// Stops routing to sandbox `id` (it is gone or paused; its vault stays, for a resume on
    /// this node: [`Fastlet::forget_vault`] drops it).
    pub(crate) fn forget_route(&self, id: &str) {
        let route = self.routes.write().expect("routes lock").remove(id);
        if let (Some(route), Some(proxy)) = (route, &self.credential_proxy) {
            proxy.forget(route.address);
        }
    }

    /// Drops sandbox `id`'s Credential Vault (its values go with it): it is removed.
    pub(crate) fn forget_vault(&self, id: &str) {
        self.vaults.forget(id);
    }

    /// Sandbox `id`'s Credential Vault (in this node's memory only).
    pub fn vault_cell(&self, id: &str) -> crate::node_proxy::vault::VaultCell {
        self.vaults.cell(id)
    }

    fn insert_route(&self, id: &str, route: Route) {
        self.routes
            .write()
            .expect("routes lock")
            .insert(id.to_string(), route);
    }

    /// The egress policy in force for sandbox `id` of this node.
    pub fn egress_policy(&self, id: &str) -> Option<EgressPolicy> {
        let route = self.route(id)?;
        self.host.egress.policy(route.address)
    }

    /// Changes the egress policy of running sandbox `id` live: the new rules are in force
    /// when this returns, and open connections the new policy denies are cut.
    pub fn set_egress_policy(&self, id: &str, policy: &EgressPolicy) -> Result<(), FastletError> {
        let route = self
            .route(id)
            .ok_or_else(|| FastletError::NotHere(id.to_string()))?;
        let slot = self
            .host
            .network
            .slot(route.slot)
            .map_err(|e| FastletError::Place {
                id: id.to_string(),
                source: Box::new(e.into()),
            })?;
        self.host
            .egress
            .apply(&SlotRef::from(&slot), policy)
            .map_err(|source| FastletError::Egress {
                id: id.to_string(),
                source: Box::new(source),
            })
    }

    /// How many sandboxes run on this node (placed or claimed; pooled ones not counted).
    pub fn running_count(&self) -> usize {
        self.routes.read().expect("routes lock").len()
    }

    /// The route to a running sandbox of this node.
    pub fn route(&self, id: &str) -> Option<Route> {
        self.routes.read().expect("routes lock").get(id).cloned()
    }

    /// Stops the node's in-process services (the DNS forwarder). Sandboxes, slots and the
    /// nft table stay: they outlive the process.
    pub fn shutdown(self) {
        self.drain_pools();
        self.reaper.stop();
        self.host.stop_services();
    }

    /// Stops refilling and removes every pooled (unclaimed) sandbox and every spare slot,
    /// and the staging area of live snapshots (at shutdown).
    pub fn drain_pools(&self) {
        self.staging.unmount();
        for pooled in self.pools.drain() {
            let _ = self.remove(&pooled.placement.handle.id, Some(&pooled.placement), None);
        }
        for mut spare in self.spares.drain() {
            if let Err(e) = self.host.destroy_spare(&mut spare) {
                tracing::warn!(slot = spare.index, error = %e, "could not remove a spare slot");
            }
            self.release_slot(spare.index);
        }
        self.reaper.flush();
    }

    /// Starts the thread that keeps [`FastletConfig::spare_slots`] spares made. It stops
    /// with [`Fastlet::drain_pools`] or when the fastlet is dropped.
    pub fn start_spares(self: &std::sync::Arc<Self>) {
        if self.spares.target() == 0 {
            return;
        }
        let this = std::sync::Arc::downgrade(self);
        std::thread::Builder::new()
            .name("fastbox-spares".into())
            .spawn(move || {
                crate::background::enter();
                loop {
                    let Some(fastlet) = this.upgrade() else {
                        return;
                    };
                    if !fastlet.spares.wait_for_room() {
                        return;
                    }
                    // While half the spares are still there, the burst goes first.
                    if fastlet.spares.ready() * 2 >= fastlet.spares.target() {
                        fastlet.starts.wait_quiet(BACKGROUND_HOLD_OFF);
                    }
                    let made = fastlet.reserve_slot().and_then(|index| {
                        fastlet
                            .host
                            .make_spare(index, &fastlet.cfg.criu)
                            .map_err(|e| {
                                fastlet.release_slot(index);
                                FastletError::Place {
                                    id: format!("{SPARE_ID_PREFIX}{index}"),
                                    source: Box::new(e),
                                }
                            })
                    });
                    let failed = made.as_ref().err().map(ToString::to_string);
                    if let Some(mut late) = fastlet.spares.made(made.ok()) {
                        let _ = fastlet.host.destroy_spare(&mut late);
                        fastlet.release_slot(late.index);
                        fastlet.spares.discarded();
                    }
                    if let Some(error) = failed {
                        tracing::warn!(%error, "could not make a spare slot");
                        drop(fastlet);
                        std::thread::sleep(std::time::Duration::from_secs(1));
                    }
                }
            })
            .expect("spawn the spares thread");
    }
}

/// 32 random bytes from getrandom(2), hex.
fn random_hex() -> String {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).expect("getrandom");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The directory of sandbox `id` under an instance's data directory.
pub fn sandbox_dir(data_dir: &Path, id: &str) -> PathBuf {
    data_dir.join("sandboxes").join(id)
}

/// How the image's own template is built: execd only, with what the image's recipe asks of
/// its golden checkpoint (the code interpreter's warm interpreters).
pub fn image_recipe(image: &ResolvedImage) -> GoldenRecipe {
    let env = fastbox_image::Recipe::of_reference(&image.canonical_reference)
        .map(|r| r.golden_env().iter().map(|e| e.to_string()).collect())
        .unwrap_or_default();
    GoldenRecipe {
        env,
        ..GoldenRecipe::default()
    }
}
