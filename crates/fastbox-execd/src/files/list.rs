//! `/directories/list`: children up to a depth, in lexical order, descendants right after their
//! parent, symlinks reported but never traversed.

use std::path::Path;

use super::FilesError;
use super::info::{FileInfo, file_info};
use super::ops::io_error;
use crate::identity::Accounts;

pub fn list(root: &Path, depth: u32, accounts: &Accounts) -> Result<Vec<FileInfo>, FilesError> {
    let meta = std::fs::symlink_metadata(root).map_err(io_error(root))?;
    if meta.file_type().is_symlink() {
        return Err(FilesError::Invalid(format!(
            "path is a symbolic link, refusing to traverse: {}",
            root.display()
        )));
    }
    if !meta.is_dir() {
        return Err(FilesError::Invalid(format!(
            "path is not a directory: {}",
            root.display()
        )));
    }
    let mut out = Vec::new();
    if depth > 0 {
        walk(root, 1, depth, accounts, &mut out)?;
    }
    Ok(out)
}

fn walk(
    dir: &Path,
    level: u32,
    depth: u32,
    accounts: &Accounts,
    out: &mut Vec<FileInfo>,
) -> Result<(), FilesError> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .map_err(io_error(dir))?
        .filter_map(Result::ok)
        .collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        out.push(file_info(&path, &meta, accounts));
        if meta.is_dir() && level < depth {
            walk(&path, level + 1, depth, accounts, out)?;
        }
    }
    Ok(())
}
