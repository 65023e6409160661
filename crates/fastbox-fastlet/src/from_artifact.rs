//! Templates this node did not build: a golden checkpoint materialized from an artifact store
//! (the local directory, an S3 origin, or DART's peer delivery in front of one), made ready
//! for restores (`docs/artifacts.md`, DESIGN §3).
//!
//! [`Fastlet::template_from_artifact`] materializes the manifest into
//! `DATA_DIR/templates/artifact-<manifest digest>/` (complete or absent: see
//! [`materialize_template`]), checks the golden token it was handed against the manifest's
//! label, and makes the packed rootfs the overlay's lower layer:
//!
//! - `rootfs.erofs` is mounted read-only (`mount -t erofs -o loop,ro`) at `rootfs/`, once per
//!   template per node, shared by every restore; the loop device goes with the unmount
//!   ([`unmount_rootfs`], called when the template is removed and by `fastbox purge`);
//! - `rootfs.tar` is unpacked into `rootfs/` instead.
//!
//! The node then keeps the template as it keeps one it built (`template.json`, holding the
//! token, is written last), so a restart finds it again; a rootfs mount a reboot removed is
//! mounted again when the template is next used.

use std::path::Path;
use std::process::Command;

use fastbox_artifact::{ArtifactStore, Digest, PackFormat};
use fastbox_node_api::wire::CheckpointFetch;

use crate::agent::{Fastlet, FastletError};
use crate::artifact::{
    MaterializedTemplate, materialize_checkpoint, materialize_template, unpack_canonical_tar,
};
use crate::remote_pages::RemotePages;
use crate::template::{self, Template};

/// The directory the lower layer of a materialized template is mounted or unpacked at.
const ROOTFS_DIR: &str = "rootfs";
/// The packed rootfs images a materialized template may hold, by format.
const ROOTFS_IMAGES: [(&str, PackFormat); 2] = [
    ("rootfs.erofs", PackFormat::Erofs),
    ("rootfs.tar", PackFormat::Tar),
];

impl Fastlet {
    /// The template published as `manifest` in `store`, materialized on this node if it is
    /// not yet, ready for [`Fastlet::restore_from`]. `golden_token` is the token execd was
    /// started with when the template was built (the server keeps it; the artifact holds
    /// only its SHA-256): a token the manifest does not confirm is refused before anything
    /// runs.
    pub fn template_from_artifact(
        &self,
        store: &dyn ArtifactStore,
        manifest: &Digest,
        golden_token: &str,
    ) -> Result<Template, FastletError> {
        let key = artifact_key(manifest);
        let dir = template::template_dir(&self.config().data_dir, &key);
        self.materialized(
            store,
            manifest,
            golden_token,
            &key,
            &dir,
            Restorable::Template,
        )
    }

    /// The checkpoint of a snapshot or of a paused sandbox published as `manifest` (by
    /// another node), materialized on this node as snapshot `key` if it is not here yet: then
    /// clones of it ([`Fastlet::restore_from`]) and resumes of it ([`Fastlet::resume`]) run
    /// here as on the node that took it. `execd_token` is the token of execd inside it (the
    /// server keeps it; the manifest confirms it). With [`CheckpointFetch::MemoryOnFault`]
    /// its pages images stay in the store ([`crate::remote_pages`]): the resume that follows
    /// fetches them while the sandbox runs.
    pub fn snapshot_from_artifact(
        &self,
        store: &dyn ArtifactStore,
        manifest: &Digest,
        key: &str,
        execd_token: &str,
        fetch: CheckpointFetch,
    ) -> Result<Template, FastletError> {
        let dir = crate::snapshot::snapshot_dir(&self.config().data_dir, key);
        self.materialized(
            store,
            manifest,
            execd_token,
            key,
            &dir,
            Restorable::Checkpoint(fetch),
        )
    }

    fn materialized(
        &self,
        store: &dyn ArtifactStore,
        manifest: &Digest,
        golden_token: &str,
        key: &str,
        dir: &Path,
        what: Restorable,
    ) -> Result<Template, FastletError> {
        let fail = |message: String| FastletError::Template {
            image: format!("artifact {manifest}"),
            message,
        };
        let lock = self.builds.for_image(key);
        let _materializing = lock.lock().expect("build lock");
        if let Some(t) = self.current_template(dir) {
            if !self.whole_enough(&t, what) {
                // A resume restored from it (or may still): never removed from under it.
                return Err(fail(format!(
                    "checkpoint {key} is here without its memory, for a resume: it is not fetched again whole"
                )));
            }
            ensure_rootfs(dir).map_err(fail)?;
            return Ok(t);
        }
        unmount_rootfs(dir);
        let _ = std::fs::remove_dir_all(dir);
        if let Some(parent) = dir.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| fail(format!("{}: {e}", parent.display())))?;
        }
        let m = match what {
            Restorable::Template => materialize_template(store, manifest, dir),
            Restorable::Checkpoint(fetch) => materialize_checkpoint(
                store,
                manifest,
                dir,
                fetch == CheckpointFetch::MemoryOnFault,
            ),
        }
        .map_err(|e| fail(e.to_string()))?;
        let adopted = self.adopt_materialized(&m, key, golden_token);
        if adopted.is_err() {
            unmount_rootfs(dir);
            let _ = std::fs::remove_dir_all(dir);
        }
        let t = adopted.map_err(fail)?;
        tracing::info!(manifest = %manifest, blocks = m.stats.blocks_fetched, bytes = m.stats.bytes, remote_bytes = m.remote_pages.bytes(), seconds = m.seconds, "template materialized from an artifact");
        Ok(t)
    }

    /// Whether `t`, here already, serves `what`: a checkpoint whose memory is still in the
    /// store serves a resume, but clones need it whole. A resume still copying it in is
    /// waited for.
    fn whole_enough(&self, t: &Template, what: Restorable) -> bool {
        if what != Restorable::Checkpoint(CheckpointFetch::Whole)
            || RemotePages::read(&t.checkpoint).is_none()
        {
            return true;
        }
        self.transfers.wait_for_source(&t.key);
        RemotePages::read(&t.checkpoint).is_none()
    }

    fn adopt_materialized(
        &self,
        m: &MaterializedTemplate,
        key: &str,
        golden_token: &str,
    ) -> Result<Template, String> {
        if !m.accepts_golden_token(golden_token) {
            return Err(
                "the golden token given is not the one this template was built with".into(),
            );
        }
        let t = Template {
            key: key.to_string(),
            image_digest: m.info.image_digest.clone(),
            image_reference: m.info.image_reference.clone(),
            rootfs: m.dir.join(ROOTFS_DIR),
            checkpoint: m.checkpoint.clone(),
            golden_token: golden_token.to_string(),
            build_ms: m.info.build_ms,
        };
        if !self.holds_current_execd(&t) {
            return Err(format!(
                "it holds execd {}, this node runs another one",
                m.execd_digest
            ));
        }
        ensure_rootfs(&m.dir)?;
        template::commit(&m.dir, &t).map_err(|e| format!("commit: {e}"))?;
        Ok(t)
    }
}

/// What an artifact is materialized as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Restorable {
    /// A template (golden checkpoint) of the templates directory.
    Template,
    /// A node snapshot (a snapshot's or a pause's checkpoint) of the snapshots directory,
    /// whole or without its memory.
    Checkpoint(CheckpointFetch),
}

/// The template key of a materialized manifest (also its directory name).
pub fn artifact_key(manifest: &Digest) -> String {
    format!("artifact-{}", manifest.to_hex())
}

/// Makes `dir/rootfs` the unpacked lower layer: mounts `rootfs.erofs` there unless it is
/// mounted already, or unpacks `rootfs.tar` once.
fn ensure_rootfs(dir: &Path) -> Result<(), String> {
    let target = dir.join(ROOTFS_DIR);
    let Some((image, format)) = ROOTFS_IMAGES
        .iter()
        .map(|(name, format)| (dir.join(name), *format))
        .find(|(path, _)| path.is_file())
    else {
        return Err(format!("{}: no packed rootfs image", dir.display()));
    };
    match format {
        PackFormat::Erofs => {
            if is_mount_point(&target) {
                return Ok(());
            }
            std::fs::create_dir_all(&target).map_err(|e| format!("{}: {e}", target.display()))?;
            let out = Command::new("mount")
                .args(["-t", "erofs", "-o", "loop,ro"])
                .arg(&image)
                .arg(&target)
                .output()
                .map_err(|e| format!("mount: {e}"))?;
            if !out.status.success() {
                return Err(format!(
                    "mount {} at {}: {}",
                    image.display(),
                    target.display(),
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
            Ok(())
        }
        PackFormat::Tar => {
            if target.is_dir() {
                return Ok(());
            }
            let partial = dir.join(".rootfs.unpacking");
            let _ = std::fs::remove_dir_all(&partial);
            unpack_canonical_tar(&image, &partial).map_err(|e| e.to_string())?;
            std::fs::rename(&partial, &target).map_err(|e| format!("{}: {e}", target.display()))
        }
    }
}

/// Unmounts the erofs lower layer of the materialized template in `dir`, if mounted (lazily:
/// restores in flight keep their overlay).
pub fn unmount_rootfs(dir: &Path) {
    let target = dir.join(ROOTFS_DIR);
    if is_mount_point(&target)
        && let Err(e) = nix::mount::umount2(&target, nix::mount::MntFlags::MNT_DETACH)
    {
        tracing::warn!(path = %target.display(), error = %e, "could not unmount a template rootfs");
    }
}

/// Unmounts the lower layers of every materialized template and snapshot under `data_dir`.
pub fn unmount_all(data_dir: &Path) {
    for kind in ["templates", "snapshots"] {
        let Ok(entries) = std::fs::read_dir(data_dir.join(kind)) else {
            continue;
        };
        for entry in entries.flatten() {
            unmount_rootfs(&entry.path());
        }
    }
}

/// Whether `path` (a path of fastbox's own) is a mount point.
pub(crate) fn is_mount_point(path: &Path) -> bool {
    path.canonicalize()
        .is_ok_and(|canonical| fastbox_runtime::rootfs::is_mount_point(&canonical))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_root_is_a_mount_point_and_a_fresh_dir_is_not() {
        assert!(is_mount_point(Path::new("/")));
        let dir = tempfile::tempdir().unwrap();
        assert!(!is_mount_point(dir.path()));
    }
}
