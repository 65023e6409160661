//! The node agent: the only capacity authority of its node. It admits sandboxes into network
//! slots of its pool, starts them with the runtime, re-adopts them after a restart of the
//! process, and removes them without leaving anything behind. Its methods block (the runtime
//! is synchronous): async callers run them on a dedicated thread ([`crate::blocking`]).

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock};

use fastbox_image::{ImageCache, ImageConfig, ImageError, Progress, RegistryAuth, ResolvedImage};
use fastbox_runtime::cgroup::CgroupLimits;
use fastbox_runtime::criu::Criu;
use fastbox_runtime::execd_binary::ExecdBinary;
use fastbox_runtime::net::Ipv4Pool;
use fastbox_runtime::sandbox::{self, SandboxHandle};
use serde::{Deserialize, Serialize};

use crate::execd_client::ExecdClient;
use crate::host::{HostError, LocalHost, StartOptions};
use crate::slots::SlotTable;
use crate::template::{self, BuildClock, BuildLocks, Template};

/// What a fastlet needs to run.
#[derive(Debug, Clone)]
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
}

/// Where a started sandbox lives on this node; the server records it durably so a restarted
/// fastlet can find the sandbox again.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Placement {
    pub slot: u32,
    pub address: Ipv4Addr,
    pub handle: SandboxHandle,
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
}

/// How the node proxy reaches a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub address: Ipv4Addr,
    pub execd_token: String,
}

pub struct Fastlet {
    cfg: FastletConfig,
    host: LocalHost,
    images: ImageCache,
    execd: ExecdBinary,
    slots: Mutex<SlotTable>,
    routes: RwLock<HashMap<String, Route>>,
    builds: BuildLocks,
}

impl Fastlet {
    /// Sets up the node: cgroup root, DNS forwarder, the instance's nft table (existing slots
    /// are kept), the image cache and the content-addressed execd.
    pub fn start(cfg: FastletConfig) -> Result<Self, FastletError> {
        let images = ImageCache::try_new(cfg.images.clone())?;
        let execd =
            ExecdBinary::import(&cfg.execd_bin, &cfg.data_dir.join("execd")).map_err(|e| {
                FastletError::Execd {
                    path: cfg.execd_bin.clone(),
                    message: e.to_string(),
                }
            })?;
        let host = LocalHost::try_new(&cfg.prefix, &cfg.data_dir, &cfg.helper, cfg.pool)
            .map_err(|e| FastletError::Setup(Box::new(e)))?;
        let slots = Mutex::new(SlotTable::new(cfg.pool.capacity()));
        Ok(Self {
            cfg,
            host,
            images,
            execd,
            slots,
            routes: RwLock::new(HashMap::new()),
            builds: BuildLocks::default(),
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
    pub fn resolve_image(
        &self,
        reference: &str,
        auth: Option<&RegistryAuth>,
        progress: &dyn Progress,
    ) -> Result<ResolvedImage, FastletError> {
        Ok(self.images.resolve(reference, auth, progress)?)
    }

    /// Admission: takes a free slot index, or says the node is full.
    pub fn reserve_slot(&self) -> Result<u32, FastletError> {
        let mut slots = self.slots.lock().expect("slot table lock");
        slots.reserve().ok_or(FastletError::NoCapacity {
            capacity: slots.capacity(),
        })
    }

    /// Gives back a slot index that was reserved but never used.
    pub fn release_slot(&self, slot: u32) {
        self.slots.lock().expect("slot table lock").release(slot);
    }

    /// Slots in use and the pool's size.
    pub fn capacity(&self) -> (usize, u32) {
        let slots = self.slots.lock().expect("slot table lock");
        (slots.in_use(), slots.capacity())
    }

    /// Starts `req` in slot `slot` (reserved with [`Fastlet::reserve_slot`]) and waits for
    /// its execd. On failure nothing of the sandbox is left, and the slot stays reserved for
    /// the caller to [`Fastlet::remove`].
    pub fn place(&self, req: &PlaceRequest, slot: u32) -> Result<Placement, FastletError> {
        let opts = StartOptions {
            id: req.id.clone(),
            limits: req.limits,
            disk_bytes: req.disk_bytes,
            env: req.env.clone(),
            entrypoint: req.entrypoint.clone(),
            execd_token: Some(req.execd_token.clone()),
        };
        let started = self
            .host
            .start(&req.rootfs, &self.execd, slot, &opts)
            .map_err(|source| FastletError::Place {
                id: req.id.clone(),
                source: Box::new(source),
            })?;
        tracing::info!(sandbox = %req.id, slot, address = %started.slot.address, ready_ms = started.ready_after.as_millis() as u64, "sandbox started");
        self.add_route(&req.id, started.slot.address, &req.execd_token);
        Ok(Placement {
            slot,
            address: started.slot.address,
            handle: started.handle,
        })
    }

    /// The golden checkpoint of `image` on this node, built now if there is none: a cold
    /// start with execd only, readiness, then a CRIU dump.
    pub fn template(&self, image: &ResolvedImage) -> Result<Template, FastletError> {
        let dir = template::template_dir(&self.cfg.data_dir, &image.digest);
        if let Some(t) = template::load(&dir) {
            return Ok(t);
        }
        let lock = self.builds.for_image(&image.digest);
        let _building = lock.lock().expect("build lock");
        if let Some(t) = template::load(&dir) {
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
        let opts = StartOptions {
            id: id.clone(),
            env: image.config.env.clone(),
            execd_token: Some(golden_token.clone()),
            ..StartOptions::default()
        };
        let checkpoint = dir.join("checkpoint");
        let built = self
            .host
            .start(&image.rootfs, &self.execd, slot, &opts)
            .and_then(|sb| {
                let dumped = self.host.checkpoint(&self.cfg.criu, &sb, &checkpoint);
                if dumped.is_err() {
                    let _ = self.host.destroy(&sb);
                }
                dumped
            });
        self.release_slot(slot);
        if let Err(e) = built {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(fail(e.to_string()));
        }
        let t = Template {
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

    /// Restores `template` as sandbox `req.id` in slot `slot`, gives it its own identity
    /// (hostname, identity files) and claims its execd (token, environment, entrypoint).
    pub fn restore_from(
        &self,
        template: &Template,
        req: &PlaceRequest,
        slot: u32,
    ) -> Result<Placement, FastletError> {
        let clock = BuildClock::start();
        let opts = StartOptions {
            id: req.id.clone(),
            limits: req.limits,
            disk_bytes: req.disk_bytes,
            execd_token: Some(template.golden_token.clone()),
            ..StartOptions::default()
        };
        let place_err = |source: HostError| FastletError::Place {
            id: req.id.clone(),
            source: Box::new(source),
        };
        let sb = self
            .host
            .restore(
                &self.cfg.criu,
                &template.checkpoint,
                &template.rootfs,
                &self.cfg.data_dir.join("execd"),
                slot,
                &opts,
            )
            .map_err(place_err)?;
        let restored_ms = clock.ms();
        let configured = sandbox::set_identity(&sb.handle, &req.id, Some(&sb.slot.resolv_conf()))
            .map_err(|e| place_err(e.into()))
            .and_then(|()| {
                let mut envs: Vec<(String, String)> = req
                    .env
                    .iter()
                    .filter_map(|kv| kv.split_once('='))
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect();
                envs.extend(crate::host::announced_limits(&req.limits));
                ExecdClient::new(
                    format!(
                        "http://{}:{}",
                        sb.slot.address,
                        fastbox_runtime::spec::EXECD_PORT
                    ),
                    Some(template.golden_token.clone()),
                )
                .and_then(|c| c.claim(&req.execd_token, &envs, &req.entrypoint))
                .map_err(|source| FastletError::Claim {
                    id: req.id.clone(),
                    source,
                })
            });
        if let Err(e) = configured {
            let _ = self.host.destroy(&sb);
            return Err(e);
        }
        tracing::info!(sandbox = %req.id, slot, address = %sb.slot.address, restore_ms = restored_ms, total_ms = clock.ms(), "sandbox restored");
        self.add_route(&req.id, sb.slot.address, &req.execd_token);
        Ok(Placement {
            slot,
            address: sb.slot.address,
            handle: sb.handle,
        })
    }

    /// After a restart: takes back a sandbox recorded as placed here. True when its processes
    /// are alive (it is routable again); false when they are gone (the caller removes it).
    pub fn adopt(&self, id: &str, placement: &Placement, execd_token: &str) -> bool {
        self.slots
            .lock()
            .expect("slot table lock")
            .claim(placement.slot);
        if !placement.handle.is_running() {
            return false;
        }
        self.add_route(id, placement.address, execd_token);
        true
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
    pub fn remove(
        &self,
        id: &str,
        placement: Option<&Placement>,
        slot: Option<u32>,
    ) -> Result<(), FastletError> {
        self.routes.write().expect("routes lock").remove(id);
        let handle = placement
            .map(|p| p.handle.clone())
            .unwrap_or_else(|| self.unstarted_handle(id));
        let slot = placement.map(|p| p.slot).or(slot);
        let result = sandbox::destroy(&handle, &self.host.cgroups)
            .map_err(HostError::from)
            .and_then(|()| match slot {
                Some(index) => {
                    let net = self.host.network.slot(index)?;
                    self.host.network.destroy_slot(&net)?;
                    Ok(())
                }
                None => Ok(()),
            });
        match result {
            Ok(()) => {
                if let Some(index) = slot {
                    self.slots.lock().expect("slot table lock").release(index);
                }
                tracing::info!(sandbox = %id, "sandbox removed");
                Ok(())
            }
            Err(source) => Err(FastletError::Remove {
                id: id.to_string(),
                source: Box::new(source),
            }),
        }
    }

    fn unstarted_handle(&self, id: &str) -> SandboxHandle {
        SandboxHandle::unstarted(id, &self.cfg.prefix, sandbox_dir(&self.cfg.data_dir, id))
    }

    fn add_route(&self, id: &str, address: Ipv4Addr, token: &str) {
        self.routes.write().expect("routes lock").insert(
            id.to_string(),
            Route {
                address,
                execd_token: token.to_string(),
            },
        );
    }

    /// The route to a running sandbox of this node.
    pub fn route(&self, id: &str) -> Option<Route> {
        self.routes.read().expect("routes lock").get(id).cloned()
    }

    /// Stops the node's in-process services (the DNS forwarder). Sandboxes, slots and the
    /// nft table stay: they outlive the process.
    pub fn shutdown(self) {
        self.host.stop_services();
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
