//! Local image references on the API: the host's files are the operator's, not the caller's.
//!
//! `dir:`, `oci:`, `oci-archive:`, `docker-archive:` and paths name files on this host; a
//! reference from a request that is one of them is accepted only when its path, resolved as
//! it is now (symlinks, `..`), exists and lies under one of the directories the operator
//! allows (`--allow-local-images`, resolved at start-up). Registry references and recipes
//! (the offline aliases such as `python:3.12`) pass. The server's own images (its default
//! images) are not requests and are not checked; `fastbox sandbox run` does not come here.
//!
//! The reference is classified by [`ImageSource::parse`] with the node's image settings, the
//! very function the image cache resolves it with, so what is checked is what is opened.

use std::path::{Path, PathBuf};

use fastbox_image::{ImageConfig, ImageSource};

use crate::error::ApiError;

/// The host path `reference` names, if it is a local reference; relative paths (`./x`,
/// `../x`), which no caller can mean on this host, count as local too.
fn local_path(reference: &str, images: &ImageConfig) -> Option<PathBuf> {
    let trimmed = reference.trim();
    let relative = trimmed == "."
        || trimmed == ".."
        || trimmed.starts_with("./")
        || trimmed.starts_with("../");
    match ImageSource::parse(trimmed, images) {
        Ok(ImageSource::Dir(path))
        | Ok(ImageSource::OciLayout { path, .. })
        | Ok(ImageSource::OciArchive { path, .. })
        | Ok(ImageSource::DockerArchive { path, .. }) => Some(path),
        // A registry reference or a recipe (a bad one is the image check's 400). No `_`: a
        // new kind of source must be classified here.
        Ok(ImageSource::Recipe(_) | ImageSource::Registry(_)) | Err(_) => {
            relative.then(|| PathBuf::from(trimmed))
        }
    }
}

/// Why `path` is refused, or None when it is under one of `allowed` (canonical directories).
fn refusal(path: &Path, allowed: &[PathBuf]) -> Option<String> {
    if !path.is_absolute() {
        return Some("a relative path".into());
    }
    if allowed.is_empty() {
        return Some("no directory is allowed".into());
    }
    let canonical = match std::fs::canonicalize(path) {
        Ok(c) => c,
        Err(e) => return Some(format!("{}: {e}", path.display())),
    };
    if allowed.iter().any(|dir| canonical.starts_with(dir)) {
        None
    } else {
        Some(format!(
            "{} is outside the allowed directories",
            canonical.display()
        ))
    }
}

/// Refuses a caller's local image reference outside `allowed` (the operator's canonical
/// directories) with [`ApiError::LocalImageRefused`]; every other reference passes.
pub fn check(reference: &str, allowed: &[PathBuf], images: &ImageConfig) -> Result<(), ApiError> {
    let Some(path) = local_path(reference, images) else {
        return Ok(());
    };
    match refusal(&path, allowed) {
        None => Ok(()),
        Some(why) => {
            // The caller gets one message whatever the reason; the log says which.
            tracing::warn!(reference, reason = %why, "local image reference refused");
            Err(ApiError::LocalImageRefused {
                reference: reference.to_string(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Host {
        _tmp: tempfile::TempDir,
        /// The allowed directory (canonical), holding a rootfs `rootfs/`, an OCI layout
        /// `layout/`, `image.tar` and a symlink `escape` to `outside/`.
        allowed: PathBuf,
        /// A directory beside it, not allowed, with a marker file.
        outside: PathBuf,
    }

    fn host() -> Host {
        let tmp = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(tmp.path()).unwrap();
        let allowed = root.join("allowed");
        let outside = root.join("outside");
        for dir in [
            allowed.join("rootfs/bin"),
            allowed.join("layout/blobs"),
            outside.join("rootfs"),
            root.join("allowed2"),
        ] {
            std::fs::create_dir_all(dir).unwrap();
        }
        std::fs::write(outside.join("marker"), b"host file").unwrap();
        std::fs::write(allowed.join("image.tar"), b"").unwrap();
        std::fs::write(outside.join("image.tar"), b"").unwrap();
        std::os::unix::fs::symlink(&outside, allowed.join("escape")).unwrap();
        std::os::unix::fs::symlink(allowed.join("rootfs"), outside.join("inward")).unwrap();
        Host {
            _tmp: tmp,
            allowed,
            outside,
        }
    }

    fn accepted(reference: &str, allowed: &[PathBuf]) -> bool {
        match check(reference, allowed, &ImageConfig::default()) {
            Ok(()) => true,
            Err(e @ ApiError::LocalImageRefused { .. }) => {
                let message = e.to_string();
                assert!(message.contains("--allow-local-images"), "{message}");
                assert_eq!(e.status(), axum::http::StatusCode::BAD_REQUEST);
                assert_eq!(e.code(), "SANDBOX::INVALID_PARAMETER");
                false
            }
            Err(e) => panic!("{reference}: unexpected {e:?}"),
        }
    }

    #[test]
    fn every_local_kind_is_refused_when_nothing_is_allowed() {
        let h = host();
        let (a, o) = (h.allowed.display(), h.outside.display());
        for reference in [
            format!("dir:{a}/rootfs"),
            format!("{a}/rootfs"),
            format!("oci:{a}/layout"),
            format!("oci:{a}/layout:v1"),
            format!("oci-archive:{a}/image.tar"),
            format!("docker-archive:{a}/image.tar:app:1"),
            format!("dir:{o}"),
            "dir:/root".into(),
            "/".into(),
            " dir:/root ".into(),
        ] {
            assert!(!accepted(&reference, &[]), "{reference}");
        }
    }

    #[test]
    fn paths_under_an_allowed_directory_pass_and_others_do_not() {
        let h = host();
        let allowed = [h.allowed.clone()];
        let (a, o) = (h.allowed.display(), h.outside.display());
        for reference in [
            format!("dir:{a}/rootfs"),
            format!("dir:{a}"),
            format!("{a}/rootfs"),
            format!("dir:{a}/rootfs/../rootfs/bin"),
            format!("oci:{a}/layout"),
            format!("oci:{a}/layout:v1"),
            format!("oci-archive:{a}/image.tar"),
            format!("oci-archive:{a}/image.tar:v1"),
            format!("docker-archive:{a}/image.tar:app:1"),
            // A symlink outside that points in resolves to the allowed directory.
            format!("dir:{o}/inward"),
        ] {
            assert!(accepted(&reference, &allowed), "{reference}");
        }
        for reference in [
            format!("dir:{o}"),
            format!("dir:{o}/rootfs"),
            format!("{o}/rootfs"),
            format!("oci:{o}/rootfs"),
            format!("oci-archive:{o}/image.tar"),
            format!("docker-archive:{o}/image.tar"),
            // `..` out of the allowed directory.
            format!("dir:{a}/../outside"),
            format!("dir:{a}/.."),
            format!("{a}/../outside/marker"),
            // A symlink inside the allowed directory that points out of it.
            format!("dir:{a}/escape"),
            format!("dir:{a}/escape/rootfs"),
            format!("oci-archive:{a}/escape/image.tar"),
            // Paths that do not exist, inside or out.
            format!("dir:{a}/missing"),
            format!("oci:{a}/missing:v1"),
            "dir:/nonexistent/fastbox".into(),
            // A sibling whose name starts like the allowed one.
            format!("dir:{a}2"),
            // Relative paths.
            "dir:rootfs".into(),
            "./rootfs".into(),
            "../rootfs".into(),
            ".".into(),
            "dir:/root".into(),
        ] {
            assert!(!accepted(&reference, &allowed), "{reference}");
        }
    }

    #[test]
    fn registry_references_and_recipes_pass() {
        for reference in [
            "python:3.12",
            "fastbox/busybox",
            "recipe:busybox",
            "docker.io/library/alpine:3",
            "ghcr.io/owner/app@sha256:0000000000000000000000000000000000000000000000000000000000000000",
            "127.0.0.1:5000/team/app:v1",
            "docker://alpine",
        ] {
            assert!(accepted(reference, &[]), "{reference}");
        }
    }
}
