//! The volumes of a start: each source directory opened confined to what this node may
//! bind, cloned as a detached mount ([`fastbox_runtime::volume`]), then mounted into the
//! sandbox before its entrypoint starts.
//!
//! A host volume's path must lie under one of the directories the operator allows
//! (`--allow-host-volume DIR`; none by default). The comparison is by whole components of a
//! path made only of plain names, and the path is then opened from the allowed directory
//! with `RESOLVE_IN_ROOT` ([`Dir::resolve_dir`]): a symlink inside the allowed directory (the
//! tenants' files may be there) resolves inside it, never to the rest of the host. A
//! `subPath` resolves the same way inside the volume's directory.
//!
//! A pause dumps each volume as one of CRIU's external mounts ([`dump_keys`]); a resume
//! mounts the volumes again on staging points of fastbox's own ([`Staged`],
//! `DATA_DIR/volume-mounts/`) that CRIU binds into the restored sandbox with the flags they
//! carry, then removes the staging mounts. Staging points are only ever unmounted and
//! removed one directory at a time, never deleted recursively (that would reach into the
//! volume).

use std::os::fd::AsFd;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Component, Path, PathBuf};

use fastbox_node_api::wire::{VolumeMount, VolumeSource};
use fastbox_runtime::confine::{ConfineError, Dir};
use fastbox_runtime::volume::{DetachedMount, VolumeError};

/// Where a resume's volumes are mounted for CRIU, under the data directory.
pub const STAGING_DIR: &str = "volume-mounts";

/// Why a volume could not be bound.
#[derive(Debug, thiserror::Error)]
pub enum VolumesError {
    #[error(
        "volume {name}: host path {path} is not under a directory this node allows (--allow-host-volume{allowed})"
    )]
    NotAllowed {
        name: String,
        path: String,
        allowed: String,
    },
    #[error("volume {name}: {path}: {source}")]
    Source {
        name: String,
        path: String,
        source: ConfineError,
    },
    #[error(transparent)]
    Mount(#[from] VolumeError),
    #[error(transparent)]
    Named(#[from] crate::named_volumes::NamedVolumeError),
}

/// Where a start's volumes come from on this node.
#[derive(Clone, Copy)]
pub struct Sources<'a> {
    /// `--allow-host-volume`.
    pub allowed: &'a [PathBuf],
    pub named: &'a crate::named_volumes::NamedVolumes,
    /// The sandbox the volumes are for.
    pub user: &'a str,
    /// The data directory (object-storage volumes are mounted under it first:
    /// [`crate::object_volumes`]).
    pub data_dir: &'a Path,
}

/// The detached mounts of `volumes`, in order, host paths confined to `allowed`.
pub fn detached_mounts(
    sources: Sources<'_>,
    volumes: &[VolumeMount],
) -> Result<Vec<DetachedMount>, VolumesError> {
    volumes
        .iter()
        .map(|volume| {
            let dir = source_dir(sources, volume)?;
            Ok(DetachedMount::of_dir(
                dir.as_fd(),
                &volume.mount_path,
                volume.read_only,
            )?)
        })
        .collect()
}

/// CRIU's key of volume `name`'s external mount.
pub fn key(name: &str) -> String {
    format!("fastbox-vol-{name}")
}

/// What a dump of a sandbox with `volumes` names as external mounts: `(mount path, key)`.
pub fn dump_keys(volumes: &[VolumeMount]) -> Vec<(String, String)> {
    volumes
        .iter()
        .map(|v| (v.mount_path.clone(), key(&v.name)))
        .collect()
}

/// A resume's volumes, each mounted on a staging point of its own for CRIU to bind; the
/// mounts go (and their points) when this is dropped.
#[derive(Debug, Default)]
pub struct Staged {
    dir: Option<PathBuf>,
    points: Vec<(String, PathBuf)>,
}

impl Staged {
    /// Mounts `volumes` (host paths confined to `allowed`) under a new directory named after
    /// sandbox `id` in `data_dir`'s [`STAGING_DIR`].
    pub fn mount(
        data_dir: &Path,
        sources: Sources<'_>,
        volumes: &[VolumeMount],
    ) -> Result<Self, VolumesError> {
        let mut staged = Staged::default();
        if volumes.is_empty() {
            return Ok(staged);
        }
        let mounts = detached_mounts(sources, volumes)?;
        let base = data_dir.join(STAGING_DIR);
        let dir = base.join(format!(
            "{}-{}",
            sources.user,
            std::process::id() ^ rand_suffix()
        ));
        let failed = |what: &'static str, path: &Path| {
            let path = path.to_path_buf();
            move |source| {
                VolumesError::Mount(VolumeError::Mount {
                    mount_path: path.display().to_string(),
                    what,
                    source,
                })
            }
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&base)
            .map_err(failed("create the staging directory", &base))?;
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(failed("create the staging directory", &dir))?;
        staged.dir = Some(dir.clone());
        let root = Dir::open_root(&dir).map_err(|source| VolumesError::Source {
            name: String::new(),
            path: dir.display().to_string(),
            source,
        })?;
        for (volume, mount) in volumes.iter().zip(mounts) {
            let point =
                root.own_dir(&volume.name, 0o700)
                    .map_err(|source| VolumesError::Source {
                        name: volume.name.clone(),
                        path: dir.join(&volume.name).display().to_string(),
                        source,
                    })?;
            mount.mount_on(point.as_fd())?;
            staged
                .points
                .push((key(&volume.name), dir.join(&volume.name)));
        }
        Ok(staged)
    }

    /// `(key, staging point)` of each volume, as CRIU's restore takes them.
    pub fn sources(&self) -> Vec<(String, PathBuf)> {
        self.points.clone()
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        for (_, point) in self.points.drain(..) {
            // Detached, so CRIU's copy of the namespace or an open file does not keep it.
            match nix::mount::umount2(&point, nix::mount::MntFlags::MNT_DETACH) {
                Ok(()) => {
                    let _ = std::fs::remove_dir(&point);
                }
                Err(e) => {
                    tracing::warn!(point = %point.display(), error = %e, "could not unmount a volume's staging point");
                }
            }
        }
        if let Some(dir) = self.dir.take() {
            // Only if empty: a point still mounted stays (and so does its volume's data).
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// Unmounts and removes the staging points a crash left in `data_dir` (at start). Returns
/// how many points were removed.
pub fn purge_staged(data_dir: &Path) -> usize {
    let Ok(dirs) = std::fs::read_dir(data_dir.join(STAGING_DIR)) else {
        return 0;
    };
    let mut removed = 0;
    for dir in dirs.flatten() {
        if let Ok(points) = std::fs::read_dir(dir.path()) {
            for point in points.flatten() {
                let _ = nix::mount::umount2(&point.path(), nix::mount::MntFlags::MNT_DETACH);
                if std::fs::remove_dir(point.path()).is_ok() {
                    removed += 1;
                }
            }
        }
        let _ = std::fs::remove_dir(dir.path());
    }
    removed
}

fn rand_suffix() -> u32 {
    let mut bytes = [0u8; 4];
    let _ = getrandom::fill(&mut bytes);
    u32::from_ne_bytes(bytes)
}

/// The directory volume `volume` binds, held open.
fn source_dir(sources: Sources<'_>, volume: &VolumeMount) -> Result<Dir, VolumesError> {
    let dir = match &volume.source {
        VolumeSource::Host { path } => host_dir(sources.allowed, volume, path)?,
        VolumeSource::Named {
            name,
            create,
            size_bytes,
            delete_on_termination,
        } => sources.named.open_for(
            name,
            sources.user,
            *create,
            *size_bytes,
            *delete_on_termination,
        )?,
        // The bucket, mounted already; its prefix (`sub_path`) is a directory in it.
        VolumeSource::ObjectStorage { .. } => {
            let point = crate::object_volumes::point(sources.data_dir, sources.user, &volume.name);
            Dir::open_root(&point).map_err(|source| VolumesError::Source {
                name: volume.name.clone(),
                path: point.display().to_string(),
                source,
            })?
        }
    };
    match &volume.sub_path {
        Some(sub) => dir
            .create_dir_all(sub, 0o755)
            .map_err(|source| VolumesError::Source {
                name: volume.name.clone(),
                path: format!("subPath {sub}"),
                source,
            }),
        None => Ok(dir),
    }
}

/// The host directory `path` of volume `volume`, opened from the allowed directory it is in.
fn host_dir(allowed: &[PathBuf], volume: &VolumeMount, path: &str) -> Result<Dir, VolumesError> {
    let source = |path: &str| {
        let name = volume.name.clone();
        let path = path.to_string();
        move |source| VolumesError::Source { name, path, source }
    };
    let (root, rel) =
        allowed_root(allowed, Path::new(path)).ok_or_else(|| VolumesError::NotAllowed {
            name: volume.name.clone(),
            path: path.to_string(),
            allowed: match allowed.is_empty() {
                true => " is not given: host volumes are off".into(),
                false => format!(
                    ": {}",
                    allowed
                        .iter()
                        .map(|d| d.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            },
        })?;
    let root = Dir::open_root(root).map_err(source(&root.display().to_string()))?;
    root.resolve_dir(rel_or_dot(&rel)).map_err(source(path))
}

/// The allowed directory `path` lies under, and `path` relative to it; `None` when `path`
/// is not absolute, has anything but plain names, or lies under none of them.
fn allowed_root<'a>(allowed: &'a [PathBuf], path: &Path) -> Option<(&'a Path, PathBuf)> {
    let plain = path.is_absolute()
        && path
            .components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
    if !plain {
        return None;
    }
    allowed.iter().find_map(|root| {
        path.strip_prefix(root)
            .ok()
            .map(|rel| (root.as_path(), rel.to_path_buf()))
    })
}

fn rel_or_dot(rel: &Path) -> &Path {
    match rel.as_os_str().is_empty() {
        true => Path::new("."),
        false => rel,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_path_must_be_plain_and_under_an_allowed_directory() {
        let allowed = vec![PathBuf::from("/srv/data"), PathBuf::from("/mnt/shared")];
        let under =
            |p: &str| allowed_root(&allowed, Path::new(p)).map(|(r, rel)| (r.to_path_buf(), rel));
        assert_eq!(
            under("/srv/data/team/a"),
            Some((PathBuf::from("/srv/data"), PathBuf::from("team/a")))
        );
        assert_eq!(
            under("/srv/data"),
            Some((PathBuf::from("/srv/data"), PathBuf::new()))
        );
        assert_eq!(
            under("/srv/database"),
            None,
            "a prefix of a name is not its directory"
        );
        assert_eq!(under("/srv/data/../../etc"), None);
        assert_eq!(under("srv/data/x"), None);
        assert_eq!(under("/etc"), None);
        assert_eq!(allowed_root(&[], Path::new("/srv/data")), None);
    }
}
