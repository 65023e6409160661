//! `POST /files/upload`: multipart pairs of a `metadata` part (JSON: path, owner, group, mode)
//! followed by its `file` part, matched in order. Content is streamed to disk, never held in
//! memory; parents are created with the requested ownership.

use std::collections::VecDeque;
use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

use axum::extract::Multipart;
use serde::Deserialize;
use tokio::io::AsyncWriteExt;

use super::FilesError;
use super::fsid::{self, FsIdentity};
use super::ops::{Permission, create_dirs, io_error, set_permissions};
use crate::identity::Accounts;

#[derive(Debug, Deserialize)]
struct FileMetadata {
    path: String,
    #[serde(flatten)]
    perm: Permission,
}

pub async fn upload(
    mut form: Multipart,
    who: Option<FsIdentity>,
    home: String,
) -> Result<(), FilesError> {
    let mut pending: VecDeque<FileMetadata> = VecDeque::new();
    let mut written = 0usize;
    while let Some(mut field) = form
        .next_field()
        .await
        .map_err(|e| FilesError::Upload(e.to_string()))?
    {
        match field.name() {
            Some("metadata") => {
                let bytes = field
                    .bytes()
                    .await
                    .map_err(|e| FilesError::Upload(e.to_string()))?;
                let meta: FileMetadata = serde_json::from_slice(&bytes)
                    .map_err(|e| FilesError::Metadata(e.to_string()))?;
                if meta.path.is_empty() {
                    return Err(FilesError::Metadata("path is required".into()));
                }
                meta.perm.mode_bits()?;
                pending.push_back(meta);
            }
            Some("file") => {
                let meta = pending.pop_front().ok_or_else(|| {
                    FilesError::Metadata("file part without a preceding metadata part".into())
                })?;
                let path = fsid::resolve(&meta.path, &home);
                let perm = meta.perm.clone();
                let open_path = path.clone();
                let file = fsid::run(who, move || open_for_upload(&open_path, &perm)).await?;
                let mut file = tokio::fs::File::from_std(file);
                while let Some(chunk) = field
                    .chunk()
                    .await
                    .map_err(|e| FilesError::Upload(e.to_string()))?
                {
                    file.write_all(&chunk).await.map_err(io_error(&path))?;
                }
                file.flush().await.map_err(io_error(&path))?;
                drop(file);
                let perm = meta.perm;
                fsid::run(who, move || {
                    set_permissions(&path, &perm, &Accounts::system())
                })
                .await?;
                written += 1;
            }
            _ => {}
        }
    }
    if !pending.is_empty() {
        return Err(FilesError::Metadata(
            "metadata part without a file part".into(),
        ));
    }
    if written == 0 {
        return Err(FilesError::Upload("no file parts in request".into()));
    }
    Ok(())
}

/// Creates missing parents (owned as requested) and opens the file truncated.
fn open_for_upload(path: &PathBuf, perm: &Permission) -> Result<std::fs::File, FilesError> {
    let accounts = Accounts::system();
    if let Some(parent) = path.parent() {
        let created = create_dirs(parent)?;
        let (uid, gid) = perm.owner_ids(&accounts)?;
        if uid.is_some() || gid.is_some() {
            for dir in &created {
                std::os::unix::fs::chown(dir, uid, gid).map_err(io_error(dir))?;
            }
        }
    }
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(perm.mode_bits()?.unwrap_or(0o644))
        .open(path)
        .map_err(io_error(path))
}
