//! Files the servers of one etcd state use alike: the control API's TLS identity (nodes pin
//! its certificate, whichever server they call) and the join token. The first server to
//! start shares its own (sealed in the store like every record); the others write the
//! shared ones into their data directory before using them.

use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use fastbox_server::store::{SharedFiles, Store};

use super::run::UpError;

/// One file of a share: its path here and its mode.
pub(crate) struct SharedFile {
    pub path: PathBuf,
    pub mode: u32,
}

/// Makes `files` (under `name`) the shared ones: written from the store when another
/// server shared them, else `make` makes them here (when missing) and they are shared.
/// Alone (a store no other server shares), only `make` runs.
pub(crate) fn share(
    store: &Store,
    shared: bool,
    name: &str,
    files: &[SharedFile],
    make: impl FnOnce() -> Result<(), UpError>,
) -> Result<(), UpError> {
    if !shared {
        return make();
    }
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| UpError::DataDir { path, source }
    };
    if let Some(theirs) = store.shared_files(name)? {
        return write_all(files, &theirs);
    }
    make()?;
    let mut ours = SharedFiles::new();
    for file in files {
        let text = std::fs::read_to_string(&file.path).map_err(io(&file.path))?;
        ours.insert(file_name(&file.path), text);
    }
    match store.share_files(name, &ours) {
        Ok(()) => Ok(()),
        // Another server shared its own first: those are the cluster's.
        Err(e) if e.is_conflict() => match store.shared_files(name)? {
            Some(theirs) => write_all(files, &theirs),
            None => Err(e.into()),
        },
        Err(e) => Err(e.into()),
    }
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Writes each of `files` from `shared` (replacing what is there).
fn write_all(files: &[SharedFile], shared: &SharedFiles) -> Result<(), UpError> {
    for file in files {
        let io = |source| UpError::DataDir {
            path: file.path.clone(),
            source,
        };
        let Some(text) = shared.get(&file_name(&file.path)) else {
            return Err(UpError::DataDir {
                path: file.path.clone(),
                source: std::io::Error::other("not among the files the other servers share"),
            });
        };
        if let Some(dir) = file.path.parent() {
            std::os::unix::fs::DirBuilderExt::mode(
                std::fs::DirBuilder::new().recursive(true),
                0o700,
            )
            .create(dir)
            .map_err(io)?;
        }
        let partial = file.path.with_extension("shared");
        let _ = std::fs::remove_file(&partial);
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(file.mode)
            .open(&partial)
            .map_err(io)?;
        std::io::Write::write_all(&mut out, text.as_bytes()).map_err(io)?;
        out.sync_all().map_err(io)?;
        std::fs::rename(&partial, &file.path).map_err(io)?;
    }
    Ok(())
}
