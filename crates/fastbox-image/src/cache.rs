//! The host-wide, content-addressed cache, and `ImageCache::resolve`.
//!
//! Layout under `cache_dir` (see `docs/images.md`):
//! ```text
//! images/sha256/<hex>/rootfs/       an unpacked image, named by its content address
//! images/sha256/<hex>/image.json    its metadata, written before the directory appears
//! blobs/sha256/<hex>                verified registry blobs (layers, configs)
//! refs/<sha256(canonical ref)>.json reference -> digest, for pinned and offline lookups
//! locks/<hex>.lock                  flock(2) taken while building <hex>
//! tmp/                              staging directories, same file system as images/
//! logs/                             recipe build logs
//! ```
//! Convergence: a builder takes the image's lock, re-checks, builds in `tmp/`, then renames
//! the finished directory into `images/` (rename(2) is atomic, so a rootfs is either absent
//! or complete). A second process resolving the same image waits on the lock and then finds
//! the finished directory. Staging left by a crashed builder is removed by the next holder
//! of the lock.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

use crate::config::ImageConfig;
use crate::digest::{digest_hex, sha256_digest};
use crate::error::ImageError;
use crate::local::{DirTree, TarTree, TreeBlobs};
use crate::oci::{BlobSource, PreparedImage};
use crate::progress::Progress;
use crate::recipe::{self, Recipe};
use crate::reference::{ImageSource, RegistryReference};
use crate::registry::{self, RegistryBlobs, RegistryClient};
use crate::resolved::{ImageRuntimeConfig, RegistryAuth, ResolvedImage};

const ENTRY_FORMAT: u32 = 1;

/// A unique-enough suffix for temporary names (pid, time, counter).
pub(crate) fn nonce() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    format!(
        "{}-{nanos:x}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `images/sha256/<hex>/image.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct EntryMeta {
    format: u32,
    digest: String,
    /// The reference that first produced this entry (others may map to it too).
    first_reference: String,
    served_by: Option<String>,
    manifest_digest: Option<String>,
    config: ImageRuntimeConfig,
    created_unix: u64,
    build_seconds: f64,
}

/// `refs/<sha256 of canonical reference>.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct RefEntry {
    reference: String,
    digest: String,
    manifest_digest: Option<String>,
    updated_unix: u64,
}

/// Resolves image references to rootfs directories in a host-wide cache.
///
/// `resolve` blocks (network, unpacking, debootstrap): call it from a plain thread or
/// `spawn_blocking`. Instances are cheap and may be shared between threads; any number of
/// processes may use the same `cache_dir` at once.
#[derive(Debug, Clone)]
pub struct ImageCache {
    cfg: ImageConfig,
    images: PathBuf,
    blobs: PathBuf,
    refs: PathBuf,
    locks: PathBuf,
    tmp: PathBuf,
    logs: PathBuf,
}

impl ImageCache {
    /// Validates `cfg` and creates the cache directories.
    pub fn try_new(cfg: ImageConfig) -> Result<Self, ImageError> {
        cfg.validate()?;
        let root = cfg.cache_dir.clone();
        let cache = ImageCache {
            images: root.join("images/sha256"),
            blobs: root.join("blobs/sha256"),
            refs: root.join("refs"),
            locks: root.join("locks"),
            tmp: root.join("tmp"),
            logs: root.join("logs"),
            cfg,
        };
        for dir in [
            &cache.images,
            &cache.blobs,
            &cache.refs,
            &cache.locks,
            &cache.tmp,
            &cache.logs,
        ] {
            fs::create_dir_all(dir)
                .map_err(ImageError::io("cannot create cache directory", dir))?;
        }
        let tag = root.join("CACHEDIR.TAG");
        if !tag.exists() {
            let _ = fs::write(
                &tag,
                "Signature: 8a477f597d28d172789f06886806bc55\n# fastbox image cache: rootfs directories and blobs, safe to delete while no sandbox uses them.\n",
            );
        }
        Ok(cache)
    }

    pub fn config(&self) -> &ImageConfig {
        &self.cfg
    }

    pub fn cache_dir(&self) -> &Path {
        &self.cfg.cache_dir
    }

    /// Resolves `reference` to an unpacked rootfs, downloading or building it at most once per
    /// host. See `docs/images.md` for the reference forms.
    pub fn resolve(
        &self,
        reference: &str,
        auth: Option<&RegistryAuth>,
        progress: &dyn Progress,
    ) -> Result<ResolvedImage, ImageError> {
        let started = Instant::now();
        let span = tracing::info_span!("image.resolve", reference = %reference);
        let _entered = span.enter();
        let source = ImageSource::parse(reference, &self.cfg)?;
        let result = match source {
            ImageSource::Dir(path) => self.resolve_dir(reference, &path),
            ImageSource::Recipe(r) => self.resolve_recipe(reference, r, progress),
            ImageSource::OciLayout { path, selector } => {
                let path = canonical_path(reference, &path)?;
                let canonical = with_selector("oci", &path, selector.as_deref());
                let tree = DirTree(path);
                self.resolve_oci_tree(reference, canonical, &tree, selector.as_deref(), progress)
            }
            ImageSource::OciArchive { path, selector } => {
                let path = canonical_path(reference, &path)?;
                let canonical = with_selector("oci-archive", &path, selector.as_deref());
                let tree = TarTree::open(&path, &self.tmp)?;
                self.resolve_oci_tree(reference, canonical, &tree, selector.as_deref(), progress)
            }
            ImageSource::DockerArchive { path, selector } => {
                let path = canonical_path(reference, &path)?;
                let tree = TarTree::open(&path, &self.tmp)?;
                let canonical = with_selector("docker-archive", &path, selector.as_deref());
                let prepared =
                    crate::local::prepare_docker_archive(&tree, selector.as_deref(), reference)?;
                self.resolve_prepared(reference, canonical, &prepared, &TreeBlobs(&tree), progress)
            }
            ImageSource::Registry(r) => self.resolve_registry(reference, &r, auth, progress),
        };
        match &result {
            Ok(img) => tracing::info!(
                digest = %img.digest,
                cached = img.cached,
                served_by = img.served_by.as_deref().unwrap_or(""),
                elapsed_ms = started.elapsed().as_millis() as u64,
                "image resolved"
            ),
            Err(e) => {
                tracing::warn!(error = %e, elapsed_ms = started.elapsed().as_millis() as u64, "image resolution failed")
            }
        }
        result
    }

    /// A rootfs directory is used in place: nothing is copied, and the digest names the
    /// directory (path, inode, mtime), not its content.
    fn resolve_dir(&self, reference: &str, path: &Path) -> Result<ResolvedImage, ImageError> {
        let path = canonical_path(reference, path)?;
        let meta =
            fs::metadata(&path).map_err(ImageError::io("cannot stat rootfs directory", &path))?;
        if !meta.is_dir() {
            return Err(ImageError::InvalidReference {
                reference: reference.to_owned(),
                reason: format!(
                    "{} is not a directory (use oci-archive: or docker-archive: for image files)",
                    path.display()
                ),
            });
        }
        use std::os::unix::fs::MetadataExt;
        let identity = format!(
            "fastbox-dir\0{}\0{}:{}\0{}.{}",
            path.display(),
            meta.dev(),
            meta.ino(),
            meta.mtime(),
            meta.mtime_nsec()
        );
        Ok(ResolvedImage {
            rootfs: path.clone(),
            digest: sha256_digest(identity.as_bytes()),
            reference: reference.to_owned(),
            canonical_reference: format!("dir:{}", path.display()),
            served_by: None,
            manifest_digest: None,
            config: ImageRuntimeConfig::default(),
            cached: true,
        })
    }

    fn resolve_recipe(
        &self,
        reference: &str,
        recipe: Recipe,
        progress: &dyn Progress,
    ) -> Result<ResolvedImage, ImageError> {
        let digest = recipe::digest(recipe, &self.cfg)?;
        let canonical = format!("recipe:{}", recipe.name());
        let (meta, rootfs, cached) = self.materialize(&digest, &canonical, progress, |rootfs| {
            let out = recipe::build(recipe, &self.cfg, rootfs, &self.logs, progress)?;
            Ok((Some(out.served_by), None, out.runtime))
        })?;
        Ok(self.resolved(reference, canonical, meta, rootfs, cached))
    }

    /// An OCI layout, as a directory or inside an archive.
    fn resolve_oci_tree(
        &self,
        reference: &str,
        canonical: String,
        tree: &dyn crate::local::FileTree,
        selector: Option<&str>,
        progress: &dyn Progress,
    ) -> Result<ResolvedImage, ImageError> {
        let prepared = crate::local::prepare_oci_layout(
            tree,
            selector,
            &self.cfg.platform,
            reference,
            progress,
        )?;
        self.resolve_prepared(reference, canonical, &prepared, &TreeBlobs(tree), progress)
    }

    fn resolve_prepared(
        &self,
        reference: &str,
        canonical: String,
        prepared: &PreparedImage,
        blobs: &dyn BlobSource,
        progress: &dyn Progress,
    ) -> Result<ResolvedImage, ImageError> {
        // Only the variant-less os/arch is compared: configs rarely record the variant.
        let wanted: String = self
            .cfg
            .platform
            .split('/')
            .take(2)
            .collect::<Vec<_>>()
            .join("/");
        if let Some(platform) = prepared.platform.as_deref().filter(|p| *p != wanted) {
            progress.message(&format!(
                "warning: {canonical} is built for {platform}, not {wanted}; its programs may not run here"
            ));
            tracing::warn!(image = %canonical, platform, wanted = %wanted, "image platform differs from the host's");
        }
        let (meta, rootfs, cached) =
            self.materialize(&prepared.config_digest, &canonical, progress, |rootfs| {
                crate::oci::unpack_layers(prepared, blobs, rootfs, progress)?;
                Ok((
                    None,
                    prepared.manifest_digest.clone(),
                    prepared.runtime.clone(),
                ))
            })?;
        let mut resolved = self.resolved(reference, canonical, meta, rootfs, cached);
        resolved.manifest_digest = prepared.manifest_digest.clone();
        Ok(resolved)
    }

    fn resolve_registry(
        &self,
        reference: &str,
        r: &RegistryReference,
        auth: Option<&RegistryAuth>,
        progress: &dyn Progress,
    ) -> Result<ResolvedImage, ImageError> {
        let canonical = r.canonical();
        // A digest names immutable content: a cached copy needs no network.
        if r.digest.is_some()
            && let Some(hit) = self.cached_ref(reference, &canonical)
        {
            progress.message(&format!("using cached {} for {canonical}", hit.digest));
            return Ok(hit);
        }
        let client = RegistryClient::try_new(&self.cfg, r, auth)?;
        let blobs = RegistryBlobs {
            client: &client,
            blob_dir: &self.blobs,
        };
        let prepared = match registry::prepare(&client, &blobs, &self.cfg.platform, progress) {
            Ok(p) => p,
            Err(e @ ImageError::Unreachable { .. }) => {
                return match self.cached_ref(reference, &canonical) {
                    Some(hit) => {
                        progress.message(&format!(
                            "registry unreachable ({e}); using the cached {} for {canonical}",
                            hit.digest
                        ));
                        Ok(hit)
                    }
                    None => Err(e),
                };
            }
            Err(e) => return Err(e),
        };
        let resolved =
            self.resolve_prepared(reference, canonical.clone(), &prepared, &blobs, progress)?;
        self.write_ref(
            &canonical,
            &resolved.digest,
            resolved.manifest_digest.clone(),
        );
        Ok(resolved)
    }

    fn resolved(
        &self,
        reference: &str,
        canonical: String,
        meta: EntryMeta,
        rootfs: PathBuf,
        cached: bool,
    ) -> ResolvedImage {
        ResolvedImage {
            rootfs,
            digest: meta.digest,
            reference: reference.to_owned(),
            canonical_reference: canonical,
            served_by: meta.served_by,
            manifest_digest: meta.manifest_digest,
            config: meta.config,
            cached,
        }
    }

    fn entry_dir(&self, digest: &str) -> Result<PathBuf, ImageError> {
        Ok(self.images.join(digest_hex(digest)?))
    }

    fn read_entry(&self, digest: &str) -> Result<Option<(EntryMeta, PathBuf)>, ImageError> {
        let dir = self.entry_dir(digest)?;
        let Ok(bytes) = fs::read(dir.join("image.json")) else {
            return Ok(None);
        };
        let meta: EntryMeta = serde_json::from_slice(&bytes)
            .map_err(|e| ImageError::invalid_image(format!("cache entry {}", dir.display()), e))?;
        Ok(Some((meta, dir.join("rootfs"))))
    }

    /// Returns the entry for `digest`, building it under the lock if no process has yet.
    /// `build` fills an empty rootfs directory and returns (served_by, manifest digest, config).
    fn materialize(
        &self,
        digest: &str,
        reference: &str,
        progress: &dyn Progress,
        build: impl FnOnce(
            &Path,
        )
            -> Result<(Option<String>, Option<String>, ImageRuntimeConfig), ImageError>,
    ) -> Result<(EntryMeta, PathBuf, bool), ImageError> {
        if let Some((meta, rootfs)) = self.read_entry(digest)? {
            progress.message(&format!("using cached {digest} for {reference}"));
            return Ok((meta, rootfs, true));
        }
        let hex = digest_hex(digest)?.to_owned();
        let _lock = self.lock(&hex, digest, progress)?;
        if let Some((meta, rootfs)) = self.read_entry(digest)? {
            progress.message(&format!("{digest} was built by another process"));
            return Ok((meta, rootfs, true));
        }
        self.remove_stale_staging(&hex);
        let staging = self.tmp.join(format!("{hex}.{}", nonce()));
        let rootfs = staging.join("rootfs");
        fs::create_dir_all(&rootfs)
            .map_err(ImageError::io("cannot create staging directory", &rootfs))?;
        let started = Instant::now();
        let result = (|| {
            let (served_by, manifest_digest, config) = build(&rootfs)?;
            let meta = EntryMeta {
                format: ENTRY_FORMAT,
                digest: digest.to_owned(),
                first_reference: reference.to_owned(),
                served_by,
                manifest_digest,
                config,
                created_unix: unix_now(),
                build_seconds: started.elapsed().as_secs_f64(),
            };
            let meta_path = staging.join("image.json");
            let mut f =
                File::create(&meta_path).map_err(ImageError::io("cannot write", &meta_path))?;
            f.write_all(&serde_json::to_vec_pretty(&meta).expect("serializable"))
                .and_then(|()| f.sync_all())
                .map_err(ImageError::io("cannot write", &meta_path))?;
            let dest = self.entry_dir(digest)?;
            fs::rename(&staging, &dest)
                .map_err(ImageError::io("cannot publish cache entry", &dest))?;
            Ok((meta, dest.join("rootfs")))
        })();
        match result {
            Ok((meta, rootfs)) => {
                tracing::info!(
                    digest,
                    build_seconds = meta.build_seconds,
                    "cache entry published"
                );
                Ok((meta, rootfs, false))
            }
            Err(e) => {
                remove_staging(&staging);
                Err(e)
            }
        }
    }

    /// flock(2) on `locks/<hex>.lock`, held until the returned guard drops. Lock files are
    /// never deleted (deleting them would let two builders hold "the" lock at once).
    fn lock(
        &self,
        hex: &str,
        digest: &str,
        progress: &dyn Progress,
    ) -> Result<Flock<File>, ImageError> {
        let path = self.locks.join(format!("{hex}.lock"));
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(ImageError::io("cannot open lock", &path))?;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => Ok(lock),
            Err((file, nix::errno::Errno::EWOULDBLOCK)) => {
                progress.message(&format!("waiting for another process building {digest}"));
                Flock::lock(file, FlockArg::LockExclusive)
                    .map_err(|(_, e)| ImageError::io("cannot lock", &path)(e.into()))
            }
            Err((_, e)) => Err(ImageError::io("cannot lock", &path)(e.into())),
        }
    }

    /// Staging of `hex` left by a builder that died (we hold the lock, so none is live).
    fn remove_stale_staging(&self, hex: &str) {
        let prefix = format!("{hex}.");
        for e in fs::read_dir(&self.tmp).into_iter().flatten().flatten() {
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                tracing::info!(path = %e.path().display(), "removing staging left by an interrupted build");
                remove_staging(&e.path());
            }
        }
    }

    fn ref_path(&self, canonical: &str) -> PathBuf {
        let hex = &sha256_digest(canonical.as_bytes())["sha256:".len()..];
        self.refs.join(format!("{hex}.json"))
    }

    fn cached_ref(&self, reference: &str, canonical: &str) -> Option<ResolvedImage> {
        let entry: RefEntry =
            serde_json::from_slice(&fs::read(self.ref_path(canonical)).ok()?).ok()?;
        let (meta, rootfs) = self.read_entry(&entry.digest).ok()??;
        let mut r = self.resolved(reference, canonical.to_owned(), meta, rootfs, true);
        r.manifest_digest = entry.manifest_digest;
        Some(r)
    }

    /// Best effort: the index only saves network round trips.
    fn write_ref(&self, canonical: &str, digest: &str, manifest_digest: Option<String>) {
        let entry = RefEntry {
            reference: canonical.to_owned(),
            digest: digest.to_owned(),
            manifest_digest,
            updated_unix: unix_now(),
        };
        let path = self.ref_path(canonical);
        let tmp = path.with_extension(format!("{}.tmp", nonce()));
        let ok = fs::write(
            &tmp,
            serde_json::to_vec_pretty(&entry).expect("serializable"),
        )
        .and_then(|()| fs::rename(&tmp, &path));
        if let Err(e) = ok {
            let _ = fs::remove_file(&tmp);
            tracing::warn!(path = %path.display(), error = %e, "cannot record reference");
        }
    }
}

fn canonical_path(reference: &str, path: &Path) -> Result<PathBuf, ImageError> {
    fs::canonicalize(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            ImageError::NotFound {
                reference: reference.to_owned(),
                detail: format!("{} does not exist", path.display()),
            }
        } else {
            ImageError::Io {
                what: "cannot resolve path",
                path: path.to_owned(),
                error: e,
            }
        }
    })
}

fn with_selector(scheme: &str, path: &Path, selector: Option<&str>) -> String {
    match selector {
        Some(s) => format!("{scheme}:{}:{s}", path.display()),
        None => format!("{scheme}:{}", path.display()),
    }
}

/// Removes a staging directory, first detaching anything a failed build left mounted in it
/// (debootstrap mounts proc, sys and dev): removing through a mount would reach the host.
fn remove_staging(path: &Path) {
    if let Ok(mountinfo) = fs::read_to_string("/proc/self/mountinfo") {
        let mut mounts: Vec<PathBuf> = mountinfo
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .map(|m| PathBuf::from(m.replace("\\040", " ")))
            .filter(|m| m.starts_with(path))
            .collect();
        mounts.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
        for m in &mounts {
            if let Err(e) = nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH) {
                tracing::warn!(mount = %m.display(), error = %e, "cannot unmount; leaving staging in place");
                return;
            }
        }
    }
    if let Err(e) = fs::remove_dir_all(path) {
        tracing::warn!(path = %path.display(), error = %e, "cannot remove staging directory");
    }
}
