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
use fastbox_runtime::execd_binary::ExecdBinary;
use fastbox_runtime::net::Ipv4Pool;
use fastbox_runtime::sandbox::{self, SandboxHandle};
use serde::{Deserialize, Serialize};

use crate::host::{HostError, LocalHost, StartOptions};
use crate::slots::SlotTable;

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

/// The directory of sandbox `id` under an instance's data directory.
pub fn sandbox_dir(data_dir: &Path, id: &str) -> PathBuf {
    data_dir.join("sandboxes").join(id)
}
