//! Walking a directory tree in a deterministic order, shared by publishing and tar packing.
//!
//! Entries come in tree order (see `entry::tree_order`): each directory's children sorted by
//! name bytes, a directory before its contents, so the same tree always gives the same list
//! whatever order the filesystem returns names in. Symlinks are never followed.

use std::fs::{self, Metadata};
use std::path::{Path, PathBuf};

/// Why a tree could not be walked.
#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    /// The root is not a directory.
    #[error("{0} is not a directory")]
    RootNotDir(PathBuf),
    /// Listing or inspecting a path failed.
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// One entry below the root.
#[derive(Debug)]
pub struct TreeEntry {
    /// Path relative to the root.
    pub relative: PathBuf,
    /// Absolute path (the root joined with `relative`).
    pub path: PathBuf,
    /// `lstat` of the entry.
    pub metadata: Metadata,
}

/// Every entry below `root` (the root itself excluded), in tree order.
pub fn walk(root: &Path) -> Result<Vec<TreeEntry>, TreeError> {
    let metadata = fs::metadata(root).map_err(|source| TreeError::Io {
        op: "stat",
        path: root.to_path_buf(),
        source,
    })?;
    if !metadata.is_dir() {
        return Err(TreeError::RootNotDir(root.to_path_buf()));
    }
    let mut entries = Vec::new();
    walk_dir(root, Path::new(""), &mut entries)?;
    Ok(entries)
}

fn walk_dir(dir: &Path, relative: &Path, out: &mut Vec<TreeEntry>) -> Result<(), TreeError> {
    let io = |op, path: &Path| {
        let path = path.to_path_buf();
        move |source| TreeError::Io { op, path, source }
    };
    let mut names = Vec::new();
    for entry in fs::read_dir(dir).map_err(io("list", dir))? {
        names.push(entry.map_err(io("list", dir))?.file_name());
    }
    names.sort_by(|a, b| a.as_encoded_bytes().cmp(b.as_encoded_bytes()));
    for name in names {
        let path = dir.join(&name);
        let metadata = fs::symlink_metadata(&path).map_err(io("stat", &path))?;
        let relative = relative.join(&name);
        let is_dir = metadata.is_dir();
        out.push(TreeEntry {
            relative: relative.clone(),
            path: path.clone(),
            metadata,
        });
        if is_dir {
            walk_dir(&path, &relative, out)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_directories_before_contents_in_name_order() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        for d in ["b", "a", "a/z", "a-c"] {
            fs::create_dir(root.join(d)).unwrap();
        }
        fs::write(root.join("a/y"), "").unwrap();
        std::os::unix::fs::symlink("/nonexistent", root.join("a/x")).unwrap();
        let names: Vec<_> = walk(root)
            .unwrap()
            .into_iter()
            .map(|e| e.relative.to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["a", "a/x", "a/y", "a/z", "a-c", "b"]);
    }

    #[test]
    fn the_root_must_be_a_directory() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        fs::write(&file, "").unwrap();
        assert!(matches!(walk(&file), Err(TreeError::RootNotDir(_))));
    }
}
