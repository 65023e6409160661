//! `FileInfo`, the metadata object every files route returns.

use std::fs::Metadata;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use serde::Serialize;

use super::mode::format_mode;
use crate::clock::rfc3339_from_parts;
use crate::identity::Accounts;

#[derive(Debug, Clone, Serialize)]
pub struct FileInfo {
    pub path: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub size: u64,
    pub modified_at: String,
    pub created_at: String,
    pub owner: String,
    pub group: String,
    pub mode: u32,
}

/// Builds the info for `path` from its (not followed) metadata.
pub fn file_info(path: &Path, meta: &Metadata, accounts: &Accounts) -> FileInfo {
    let ft = meta.file_type();
    let kind = if ft.is_symlink() {
        "symlink"
    } else if ft.is_dir() {
        "directory"
    } else if ft.is_file() {
        "file"
    } else {
        "other"
    };
    FileInfo {
        path: path.to_string_lossy().into_owned(),
        kind,
        size: meta.len(),
        modified_at: rfc3339_from_parts(meta.mtime(), (meta.mtime_nsec() / 1_000_000) as u32),
        // Linux has no portable birth time through stat(2); the status-change time is what
        // the reference execd reports too.
        created_at: rfc3339_from_parts(meta.ctime(), (meta.ctime_nsec() / 1_000_000) as u32),
        owner: accounts.user_name(meta.uid()),
        group: accounts.group_name(meta.gid()),
        mode: format_mode(meta.mode()),
    }
}
