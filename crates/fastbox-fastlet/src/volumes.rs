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

use std::path::{Component, Path, PathBuf};

use fastbox_node_api::wire::{VolumeMount, VolumeSource};
use fastbox_runtime::confine::{ConfineError, Dir};
use fastbox_runtime::volume::{DetachedMount, VolumeError};

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
}

/// The detached mounts of `volumes`, in order, host paths confined to `allowed`.
pub fn detached_mounts(
    allowed: &[PathBuf],
    volumes: &[VolumeMount],
) -> Result<Vec<DetachedMount>, VolumesError> {
    volumes
        .iter()
        .map(|volume| {
            let dir = source_dir(allowed, volume)?;
            Ok(DetachedMount::of_dir(
                std::os::fd::AsFd::as_fd(&dir),
                &volume.mount_path,
                volume.read_only,
            )?)
        })
        .collect()
}

/// The directory volume `volume` binds, held open.
fn source_dir(allowed: &[PathBuf], volume: &VolumeMount) -> Result<Dir, VolumesError> {
    let VolumeSource::Host { path } = &volume.source;
    let source = |path: &str| {
        let name = volume.name.clone();
        let path = path.to_string();
        move |source| VolumesError::Source { name, path, source }
    };
    let (root, rel) =
        allowed_root(allowed, Path::new(path)).ok_or_else(|| VolumesError::NotAllowed {
            name: volume.name.clone(),
            path: path.clone(),
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
    let dir = root.resolve_dir(rel_or_dot(&rel)).map_err(source(path))?;
    match &volume.sub_path {
        Some(sub) => dir
            .create_dir_all(sub, 0o755)
            .map_err(source(&format!("{path} (subPath {sub})"))),
        None => Ok(dir),
    }
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
