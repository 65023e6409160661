//! Golden templates as artifacts: publish a node's template into an artifact store, and
//! materialize one from a store onto another node (`docs/artifacts.md`, DESIGN §3).
//!
//! A published template is one artifact of kind `template`:
//!
//! ```text
//! rootfs.erofs | rootfs.tar   the image rootfs packed by `pack_rootfs` (manifest `rootfs`)
//! template.json               `TemplateInfo`: image digest and reference, build time
//! checkpoint/
//!   checkpoint.json           as dumped (source id, execd digest, CRIU version)
//!   criu/*.img, stats-dump    the CRIU images (hard links into the staging tree; `*.log` left out)
//!   upper.tar                 the writable layer, as a canonical tar
//! ```
//!
//! **The writable layer travels as a tar**, not as a directory: an overlay upper layer holds
//! whiteouts (character devices 0/0), opaque-directory xattrs and files owned by the
//! image's users, and the artifact format keeps none of those for plain files (it refuses
//! device nodes and drops ownership). `pack_rootfs(.., Tar)` keeps them all and is
//! reproducible; [`materialize_template`] unpacks it back into `checkpoint/upper` with GNU
//! tar, so the result is an ordinary checkpoint directory that
//! `fastbox_runtime::checkpoint::restore` takes unchanged.
//!
//! **The manifest** records kind `template`, the execd digest and CRIU version read from
//! `checkpoint.json`, this host's facts ([`HostFacts::detect`]: publish on the node that
//! built the template), lineage (the image reference and digest), the caller's labels and
//! policy, and the rootfs file and format.
//!
//! **Re-publishing is deterministic.** `created_at` is the modification time of the
//! checkpoint's `checkpoint.json` (written when the dump finished, so it is the build time),
//! truncated to whole seconds, not the time of the publish. The rootfs image and the upper
//! tar are reproducible, the staging tree's own name is not part of the manifest, so
//! publishing an unchanged template again stores no block and yields the same manifest digest
//! (`IndexOutcome::AlreadyCurrent`). Copying a template directory keeps this only when the
//! copy keeps modification times (`cp -a`).
//!
//! **The golden token.** The clone's claim authenticates with the token execd was started
//! with, so a materialized template can only be claimed with the original token; another
//! node cannot mint its own. `template.json` in the artifact leaves it out, and the manifest
//! carries only its SHA-256 (label [`GOLDEN_TOKEN_LABEL`]), so a node that was handed a token
//! (by the server, from its state store) can check it before restoring
//! ([`MaterializedTemplate::accepts_golden_token`]). The node keeps the token in its own
//! local `template.json`, written when it commits the materialized template.
//! The checkpoint holds no copy of it either: execd keeps only a SHA-256 digest of its token
//! (the plain text is overwritten in its environment block and heap string), and a template's
//! start waits for execd without sending the token (`ExecdClient::wait_serving`), so no request
//! buffer holds it. Checked on the default template: the token is in none of its CRIU images
//! nor in the published blocks. The label lets a holder of a candidate confirm it, which is
//! as much as the digest in the pages would.
//!
//! **Trust.** A restore runs what the CRIU images say as root inside the sandbox, so the
//! manifest digest a node materializes is the trust decision; every block is verified
//! against it on read.
//!
//! **Using a materialized template** (not done here): `rootfs.erofs` becomes the overlay's
//! lower layer by mounting it read-only once per template per node (`mount -t erofs -o
//! loop,ro <dir>/rootfs.erofs <dir>/rootfs`, or a loop device from `LOOP_CTL_GET_FREE` and
//! the new mount API, names under the instance prefix), unmounted when the template is
//! removed; the lower is then that mount point (`Template::rootfs`), shared by every restore.
//! CRIU validates files the dumped processes held open by size (and build id), which the
//! image's bytes satisfy. A `rootfs.tar` is unpacked instead ([`unpack_canonical_tar`]) into
//! a directory that serves as the lower. The execd of the manifest's digest must be in the
//! node's execd store: execd is injected at restore, not part of the artifact.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use chrono::{DateTime, SubsecRound, Utc};
use fastbox_artifact::{
    ArtifactKind, ArtifactStore, Digest, DigestError, EntryKind, HostFacts, HostFactsError,
    IndexKey, IndexKeyError, IndexOutcome, ManifestMeta, MaterializeError, MaterializeStats,
    PackError, PackFormat, PublishError, PublishProgress, PublishStats, RootfsImage, SourceImage,
    materialize, materialize_except, pack_rootfs, publish_index, read_manifest,
};
use fastbox_runtime::checkpoint::{CheckpointMeta, images_dir};
use nix::fcntl::{RenameFlags, renameat2};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::remote_pages::{RemotePages, is_list_path, is_pages_image};
use crate::template::Template;

/// The manifest label holding the SHA-256 (hex) of the template's golden token.
pub const GOLDEN_TOKEN_LABEL: &str = "fastbox.io/golden-token-sha256";

const INFO_FILE: &str = "template.json";
const CHECKPOINT_DIR: &str = "checkpoint";
/// Where the CRIU images are in a published tree.
const CRIU_IMAGES_DIR: &str = "checkpoint/criu";
const CRIU_IMAGES_PREFIX: &str = "checkpoint/criu/";
const CHECKPOINT_META: &str = "checkpoint.json";
const UPPER_DIR: &str = "upper";
const UPPER_TAR: &str = "upper.tar";
/// CRIU logs describe one dump on one host; a restore does not read them.
const LOG_SUFFIX: &str = ".log";

/// Why a template could not be published or materialized.
#[derive(Debug, thiserror::Error)]
pub enum TemplateArtifactError {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("{path}: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path}: execd digest {value:?}: {source}")]
    ExecdDigest {
        path: PathBuf,
        value: String,
        source: DigestError,
    },
    #[error("{0}: only regular files belong in a checkpoint's image directory")]
    UnexpectedImageEntry(PathBuf),
    #[error("index key: {0}")]
    IndexKey(#[from] IndexKeyError),
    #[error("host facts: {0}")]
    HostFacts(#[from] HostFactsError),
    #[error("pack the {what}: {source}")]
    Pack {
        what: &'static str,
        source: PackError,
    },
    #[error("publish: {0}")]
    Publish(#[from] PublishError),
    #[error("materialize: {0}")]
    Materialize(#[from] MaterializeError),
    #[error("artifact {manifest} is not a template: {reason}")]
    NotATemplate { manifest: Digest, reason: String },
    #[error("template {manifest} cannot be restored on this host: {}", blockers.join("; "))]
    HostMismatch {
        manifest: Digest,
        blockers: Vec<String>,
    },
    #[error("{0} already exists")]
    DestinationExists(PathBuf),
    #[error("unpack {archive}: tar {status}: {stderr}")]
    Unpack {
        archive: PathBuf,
        status: String,
        stderr: String,
    },
}

type Result<T, E = TemplateArtifactError> = std::result::Result<T, E>;

/// The published `template.json`: what a template is, without anything node-local (paths)
/// or secret (the golden token).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateInfo {
    /// The image the template was built from (`sha256:...`).
    pub image_digest: String,
    /// The image's canonical reference.
    pub image_reference: String,
    /// How long the build took on the node that built it, milliseconds.
    pub build_ms: u64,
}

/// How to publish a template.
#[derive(Debug, Clone)]
pub struct PublishOptions<'a> {
    /// The index key the template is published under (an image reference, a template id).
    pub index_key: &'a str,
    /// Labels for the manifest ([`GOLDEN_TOKEN_LABEL`] is always set by the publish).
    pub labels: BTreeMap<String, String>,
    /// The server's policy, recorded opaquely.
    pub policy: Option<serde_json::Value>,
    /// Where the staging tree is made (the same filesystem as the template, so the CRIU
    /// images are hard-linked rather than copied); it is removed afterwards.
    pub work_dir: &'a Path,
    /// How the rootfs is packed.
    pub rootfs_format: PackFormat,
    /// `Template` carries its packed rootfs. A `Snapshot` or a `Checkpoint` (of a paused
    /// sandbox) carries only the checkpoint: its rootfs is its template's, named by
    /// `parent` when known.
    pub kind: ArtifactKind,
    /// The manifest the artifact derives from (a snapshot's template).
    pub parent: Option<Digest>,
}

impl<'a> PublishOptions<'a> {
    /// A template: no labels, no policy, the best rootfs format this host can write.
    pub fn new(index_key: &'a str, work_dir: &'a Path) -> Self {
        PublishOptions {
            index_key,
            labels: BTreeMap::new(),
            policy: None,
            work_dir,
            rootfs_format: PackFormat::best_available(),
            kind: ArtifactKind::Template,
            parent: None,
        }
    }
}

/// A published template.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PublishedTemplate {
    /// The manifest the index key points at (another publish's when this one lost the race).
    pub manifest: Digest,
    /// How the conditional index create ended.
    pub outcome: IndexOutcome,
    /// What the publish read and stored.
    pub stats: PublishStats,
    /// How the rootfs was packed.
    pub rootfs_format: PackFormat,
    /// The size of the packed rootfs image.
    pub packed_rootfs_bytes: u64,
    /// Time spent packing the rootfs.
    pub pack_seconds: f64,
    /// Time of the whole publish.
    pub seconds: f64,
}

/// A template materialized from a store, ready for a restore once its rootfs is mounted.
#[derive(Debug, Clone)]
pub struct MaterializedTemplate {
    /// The manifest it was materialized from.
    pub manifest: Digest,
    /// The directory holding everything below.
    pub dir: PathBuf,
    /// The checkpoint directory (`criu/`, `upper/`, `checkpoint.json`).
    pub checkpoint: PathBuf,
    /// The packed rootfs image file.
    pub rootfs_image: PathBuf,
    /// Its format.
    pub rootfs_format: PackFormat,
    /// The execd a restore must inject.
    pub execd_digest: Digest,
    /// The published `template.json`.
    pub info: TemplateInfo,
    /// The SHA-256 of the golden token, when the manifest records it.
    pub golden_token_sha256: Option<String>,
    /// What the materialization wrote.
    pub stats: MaterializeStats,
    /// The pages images it left in the store (none unless asked to).
    pub remote_pages: RemotePages,
    /// Time of the whole materialization.
    pub seconds: f64,
}

impl MaterializedTemplate {
    /// Whether `token` is the golden token baked into this template's checkpoint.
    pub fn accepts_golden_token(&self, token: &str) -> bool {
        self.golden_token_sha256.as_deref() == Some(golden_token_sha256(token).as_str())
    }
}

/// The SHA-256 of a golden token, hex, as the manifest label records it.
pub fn golden_token_sha256(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// Publish `template` into `store` under `opts.index_key` (see the module docs).
pub fn publish_template<S: ArtifactStore + ?Sized>(
    store: &S,
    template: &Template,
    opts: &PublishOptions<'_>,
    progress: &dyn PublishProgress,
) -> Result<PublishedTemplate> {
    let clock = Instant::now();
    let key = IndexKey::try_new(opts.index_key)?;
    let meta_path = template.checkpoint.join(CHECKPOINT_META);
    let checkpoint: CheckpointMeta = read_json(&meta_path)?;
    let execd_digest = Digest::from_hex(&checkpoint.execd_digest).map_err(|source| {
        TemplateArtifactError::ExecdDigest {
            path: meta_path.clone(),
            value: checkpoint.execd_digest.clone(),
            source,
        }
    })?;
    let created_at = modified_at(&meta_path)?;
    let host = HostFacts::detect(Some(checkpoint.criu_version))?;

    let staging = tempfile::Builder::new()
        .prefix(".template-publish-")
        .tempdir_in(opts.work_dir)
        .map_err(io_error("create a staging directory in", opts.work_dir))?;
    let stage = staging.path();
    let rootfs_name = rootfs_file_name(opts.rootfs_format);
    let packed = match opts.kind {
        ArtifactKind::Template => Some(
            pack_rootfs(
                &template.rootfs,
                &stage.join(rootfs_name),
                opts.rootfs_format,
            )
            .map_err(|source| TemplateArtifactError::Pack {
                what: "rootfs",
                source,
            })?,
        ),
        ArtifactKind::Snapshot | ArtifactKind::Checkpoint => None,
    };
    let pack_seconds = clock.elapsed().as_secs_f64();
    stage_checkpoint(&template.checkpoint, &stage.join(CHECKPOINT_DIR))?;
    let info = TemplateInfo {
        image_digest: template.image_digest.clone(),
        image_reference: template.image_reference.clone(),
        build_ms: template.build_ms,
    };
    write_info(&stage.join(INFO_FILE), &info)?;

    let mut meta = ManifestMeta::new(opts.kind, execd_digest, host);
    meta.created_at = created_at;
    meta.lineage.source = Some(SourceImage {
        reference: template.image_reference.clone(),
        digest: (!template.image_digest.is_empty()).then(|| template.image_digest.clone()),
    });
    meta.lineage.parent = opts.parent;
    meta.policy = opts.policy.clone();
    meta.labels = opts.labels.clone();
    meta.labels.insert(
        GOLDEN_TOKEN_LABEL.to_string(),
        golden_token_sha256(&template.golden_token),
    );
    meta.rootfs = packed.as_ref().map(|packed| RootfsImage {
        path: rootfs_name.to_string(),
        format: packed.format,
    });
    let done = publish_index(store, &key, stage, meta, progress)?;
    let published = PublishedTemplate {
        manifest: done.manifest,
        outcome: done.outcome,
        stats: done.stats,
        rootfs_format: packed.as_ref().map_or(opts.rootfs_format, |p| p.format),
        packed_rootfs_bytes: packed.as_ref().map_or(0, |p| p.bytes),
        pack_seconds,
        seconds: clock.elapsed().as_secs_f64(),
    };
    tracing::info!(
        key = %key,
        manifest = %published.manifest,
        outcome = ?published.outcome,
        blocks = published.stats.blocks,
        new_blocks = published.stats.new_blocks,
        bytes = published.stats.bytes,
        new_bytes = published.stats.new_bytes,
        pack_seconds,
        seconds = published.seconds,
        "template published"
    );
    Ok(published)
}

/// Materialize the template `manifest` from `store` at `dest` (which must not exist; its
/// parent must), after checking that this host can restore it. `dest` appears complete,
/// with the writable layer unpacked, or not at all.
pub fn materialize_template<S: ArtifactStore + ?Sized>(
    store: &S,
    manifest: &Digest,
    dest: &Path,
) -> Result<MaterializedTemplate> {
    materialize_restorable(store, manifest, dest, &[ArtifactKind::Template], false)
}

/// [`materialize_template`] for the checkpoint of a snapshot or of a paused sandbox (the
/// same layout: a packed rootfs, the writable layer, CRIU's images), published by another
/// node. With `leave_pages`, its pages images stay in the store: the checkpoint directory
/// lists them instead ([`RemotePages`]), for a lazy restore.
pub fn materialize_checkpoint<S: ArtifactStore + ?Sized>(
    store: &S,
    manifest: &Digest,
    dest: &Path,
    leave_pages: bool,
) -> Result<MaterializedTemplate> {
    materialize_restorable(
        store,
        manifest,
        dest,
        &[ArtifactKind::Snapshot, ArtifactKind::Checkpoint],
        leave_pages,
    )
}

fn materialize_restorable<S: ArtifactStore + ?Sized>(
    store: &S,
    manifest: &Digest,
    dest: &Path,
    kinds: &[ArtifactKind],
    leave_pages: bool,
) -> Result<MaterializedTemplate> {
    let clock = Instant::now();
    let m = read_manifest(store, manifest)?;
    let not_a_template = |reason: String| TemplateArtifactError::NotATemplate {
        manifest: *manifest,
        reason,
    };
    if !kinds.contains(&m.meta.kind) {
        return Err(not_a_template(format!("its kind is {:?}", m.meta.kind)));
    }
    // A checkpoint or snapshot published over its template's artifact (its parent) packs no
    // rootfs of its own: it restores over the parent's.
    let (rootfs, lower_from) = match (&m.meta.rootfs, m.meta.lineage.parent) {
        (Some(rootfs), _) => (rootfs.clone(), None),
        (None, Some(parent)) if m.meta.kind != ArtifactKind::Template => {
            let p = read_manifest(store, &parent)?;
            let rootfs = p.meta.rootfs.clone().ok_or_else(|| {
                not_a_template(format!("neither it nor its parent {parent} packs a rootfs"))
            })?;
            (rootfs, Some(parent))
        }
        (None, _) => return Err(not_a_template("it has no packed rootfs".into())),
    };
    let blockers = m.meta.host.restore_blockers(&HostFacts::detect(None)?);
    if !blockers.is_empty() {
        return Err(TemplateArtifactError::HostMismatch {
            manifest: *manifest,
            blockers,
        });
    }
    if let Some(list) = m.files.iter().find(|f| is_list_path(&f.path)) {
        // It is this node's own record of what is not local yet: never taken from a store.
        return Err(not_a_template(format!("it carries {}", list.path)));
    }
    // CRIU opens what the images directory holds by name, as root, and a lazy restore
    // creates the pages images there: a symlink there, or the directory (or the checkpoint
    // directory) being anything but a directory, would reach files of this host.
    if let Some(bad) = m.files.iter().find(|f| {
        let is_dir = matches!(f.kind, EntryKind::Dir);
        let is_link = matches!(f.kind, EntryKind::Symlink { .. });
        (f.path.starts_with(CRIU_IMAGES_PREFIX) && is_link)
            || ([CHECKPOINT_DIR, CRIU_IMAGES_DIR].contains(&f.path.as_str()) && !is_dir)
    }) {
        return Err(not_a_template(format!(
            "{} is a symlink or not a directory where CRIU images go",
            bad.path
        )));
    }
    if dest.symlink_metadata().is_ok() {
        return Err(TemplateArtifactError::DestinationExists(dest.to_path_buf()));
    }

    let parent = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let name = dest.file_name().unwrap_or_default().to_string_lossy();
    let staging = tempfile::Builder::new()
        .prefix(&format!(".{name}.template-"))
        .tempdir_in(parent)
        .map_err(io_error("create a staging directory in", parent))?;
    let tree = staging.path().join("tree");
    let leave_out = |path: &str| leave_pages && is_pages_image(path);
    let (mut stats, left_out) = materialize_except(store, manifest, &tree, &leave_out)?;
    if let Some(parent) = lower_from {
        // The parent's packed rootfs joins the tree (the rest of the parent is not needed).
        let parent_tree = staging.path().join("parent");
        let parent_stats = materialize(store, &parent, &parent_tree)?;
        stats.blocks_fetched += parent_stats.blocks_fetched;
        stats.bytes += parent_stats.bytes;
        let (from, to) = (parent_tree.join(&rootfs.path), tree.join(&rootfs.path));
        fs::rename(&from, &to).map_err(io_error("move the parent's rootfs into", &to))?;
    }
    let checkpoint = tree.join(CHECKPOINT_DIR);
    let upper_tar = checkpoint.join(UPPER_TAR);
    unpack_canonical_tar(&upper_tar, &checkpoint.join(UPPER_DIR))?;
    fs::remove_file(&upper_tar).map_err(io_error("remove", &upper_tar))?;
    let remote_pages = RemotePages::from_left_out(&left_out);
    if !left_out.is_empty() {
        remote_pages
            .write(&checkpoint)
            .map_err(io_error("write the remote pages list of", &checkpoint))?;
    }
    let info: TemplateInfo = read_json(&tree.join(INFO_FILE))?;
    renameat2(None, &tree, None, dest, RenameFlags::RENAME_NOREPLACE).map_err(|e| match e {
        nix::errno::Errno::EEXIST => TemplateArtifactError::DestinationExists(dest.to_path_buf()),
        e => io_error("rename into place", dest)(e.into()),
    })?;

    let materialized = MaterializedTemplate {
        manifest: *manifest,
        dir: dest.to_path_buf(),
        checkpoint: dest.join(CHECKPOINT_DIR),
        rootfs_image: dest.join(&rootfs.path),
        rootfs_format: rootfs.format,
        execd_digest: m.meta.execd_digest,
        info,
        golden_token_sha256: m.meta.labels.get(GOLDEN_TOKEN_LABEL).cloned(),
        stats,
        remote_pages,
        seconds: clock.elapsed().as_secs_f64(),
    };
    tracing::info!(
        manifest = %manifest,
        dir = %dest.display(),
        blocks_fetched = stats.blocks_fetched,
        bytes = stats.bytes,
        seconds = materialized.seconds,
        "template materialized"
    );
    Ok(materialized)
}

/// Unpack a canonical tar (`pack_rootfs(.., PackFormat::Tar)`) into `into` (created 0755 if
/// missing) with GNU tar: numeric ownership (as root), permission bits, xattrs of every
/// namespace, device nodes (as root). Modification times are the archive's (0).
pub fn unpack_canonical_tar(archive: &Path, into: &Path) -> Result<()> {
    create_dir(into)?;
    let output = Command::new("tar")
        .arg("--extract")
        .arg("--file")
        .arg(archive)
        .arg("--directory")
        .arg(into)
        .args([
            "--numeric-owner",
            "--same-permissions",
            "--xattrs",
            "--xattrs-include=*",
        ])
        .output()
        .map_err(io_error("run tar for", archive))?;
    if !output.status.success() {
        return Err(TemplateArtifactError::Unpack {
            archive: archive.to_path_buf(),
            status: output.status.to_string(),
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_string(),
        });
    }
    Ok(())
}

fn rootfs_file_name(format: PackFormat) -> &'static str {
    match format {
        PackFormat::Erofs => "rootfs.erofs",
        PackFormat::Tar => "rootfs.tar",
    }
}

/// `checkpoint.json` and the CRIU images as hard links (copies across filesystems), the
/// writable layer as a canonical tar.
fn stage_checkpoint(src: &Path, dst: &Path) -> Result<()> {
    create_dir(dst)?;
    link_or_copy(&src.join(CHECKPOINT_META), &dst.join(CHECKPOINT_META))?;
    let images = images_dir(src);
    let staged_images = images_dir(dst);
    create_dir(&staged_images)?;
    let entries = fs::read_dir(&images).map_err(io_error("list", &images))?;
    for entry in entries {
        let entry = entry.map_err(io_error("list", &images))?;
        let path = entry.path();
        let file_type = entry.file_type().map_err(io_error("stat", &path))?;
        if !file_type.is_file() {
            return Err(TemplateArtifactError::UnexpectedImageEntry(path));
        }
        if entry.file_name().to_string_lossy().ends_with(LOG_SUFFIX) {
            continue;
        }
        link_or_copy(&path, &staged_images.join(entry.file_name()))?;
    }
    pack_rootfs(&src.join(UPPER_DIR), &dst.join(UPPER_TAR), PackFormat::Tar).map_err(|source| {
        TemplateArtifactError::Pack {
            what: "writable layer",
            source,
        }
    })?;
    Ok(())
}

fn link_or_copy(src: &Path, dst: &Path) -> Result<()> {
    if fs::hard_link(src, dst).is_ok() {
        return Ok(());
    }
    fs::copy(src, dst).map_err(io_error("copy", src))?;
    Ok(())
}

/// A directory with mode 0755 whatever the umask (modes are part of the manifest).
fn create_dir(path: &Path) -> Result<()> {
    fs::create_dir_all(path).map_err(io_error("create", path))?;
    set_mode(path, 0o755)
}

fn write_info(path: &Path, info: &TemplateInfo) -> Result<()> {
    let bytes = serde_json::to_vec_pretty(info).map_err(|source| TemplateArtifactError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    fs::write(path, bytes).map_err(io_error("write", path))?;
    set_mode(path, 0o644)
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).map_err(io_error("chmod", path))
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let bytes = fs::read(path).map_err(io_error("read", path))?;
    serde_json::from_slice(&bytes).map_err(|source| TemplateArtifactError::Json {
        path: path.to_path_buf(),
        source,
    })
}

/// A file's modification time in whole seconds (filesystems differ below that).
fn modified_at(path: &Path) -> Result<DateTime<Utc>> {
    let modified = fs::metadata(path)
        .and_then(|m| m.modified())
        .map_err(io_error("stat", path))?;
    Ok(DateTime::<Utc>::from(modified).trunc_subsecs(0))
}

fn io_error<'a>(
    op: &'static str,
    path: &'a Path,
) -> impl FnOnce(io::Error) -> TemplateArtifactError + 'a {
    move |source| TemplateArtifactError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_token_digest_is_sha256_hex() {
        assert_eq!(
            golden_token_sha256("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn rootfs_file_is_named_by_format() {
        assert_eq!(rootfs_file_name(PackFormat::Erofs), "rootfs.erofs");
        assert_eq!(rootfs_file_name(PackFormat::Tar), "rootfs.tar");
    }
}
