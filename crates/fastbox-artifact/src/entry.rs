//! The entries of an artifact's tree: files, directories and symlinks under relative paths.
//!
//! Paths are `/`-separated, relative, without empty, `.` or `..` components, so a manifest
//! can never name anything outside the directory it is materialized into. Entries are listed
//! in tree order (components compared one by one, bytewise), which puts every directory
//! before its contents; every parent of an entry must itself be a directory entry, so
//! materializing never follows a symlink the artifact created.

use std::cmp::Ordering;

use serde::{Deserialize, Serialize};

use crate::block::block_count;
use crate::digest::Digest;

/// The permission bits an entry may carry (rwx for all, setuid, setgid, sticky).
pub const MODE_MASK: u32 = 0o7777;

/// Why an entry, or the order of entries, is invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EntryError {
    /// The path is not a clean relative path.
    #[error("path {path:?} {reason}")]
    BadPath { path: String, reason: &'static str },
    /// Mode bits beyond [`MODE_MASK`].
    #[error("{path}: mode {mode:o} has bits beyond {MODE_MASK:o}")]
    Mode { path: String, mode: u32 },
    /// The number of blocks does not match the size.
    #[error("{path}: {size} bytes need {expected} blocks, the entry lists {listed}")]
    BlockCount {
        path: String,
        size: u64,
        expected: u64,
        listed: usize,
    },
    /// An empty or NUL-containing symlink target.
    #[error("{path}: symlink target {target:?} is empty or contains NUL")]
    BadTarget { path: String, target: String },
    /// Entries out of tree order, or listed twice.
    #[error("{path} is listed after {previous} (entries must be in tree order, each once)")]
    Order { path: String, previous: String },
    /// The parent directory of an entry is not a directory entry.
    #[error("{path}: parent {parent} is not a directory entry listed before it")]
    MissingParent { path: String, parent: String },
}

/// One entry of an artifact's tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Relative, `/`-separated path.
    pub path: String,
    /// Permission bits (`mode & 0o7777`); symlinks record `0o777`.
    pub mode: u32,
    /// File, directory or symlink.
    #[serde(flatten)]
    pub kind: EntryKind,
}

/// What an entry is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum EntryKind {
    /// A regular file and the digests of its blocks, in order.
    File { size: u64, blocks: Vec<Digest> },
    /// A directory.
    Dir,
    /// A symbolic link, its target kept verbatim (it may be absolute: it is resolved inside
    /// the sandbox's root, never while materializing).
    Symlink { target: String },
}

impl FileEntry {
    /// Check the entry on its own: path, mode, block count, symlink target.
    pub fn validate(&self) -> Result<(), EntryError> {
        check_path(&self.path)?;
        if self.mode & !MODE_MASK != 0 {
            return Err(EntryError::Mode {
                path: self.path.clone(),
                mode: self.mode,
            });
        }
        match &self.kind {
            EntryKind::File { size, blocks } => {
                let expected = block_count(*size);
                if blocks.len() as u64 != expected {
                    return Err(EntryError::BlockCount {
                        path: self.path.clone(),
                        size: *size,
                        expected,
                        listed: blocks.len(),
                    });
                }
            }
            EntryKind::Symlink { target } if target.is_empty() || target.contains('\0') => {
                return Err(EntryError::BadTarget {
                    path: self.path.clone(),
                    target: target.clone(),
                });
            }
            EntryKind::Dir | EntryKind::Symlink { .. } => {}
        }
        Ok(())
    }

    /// The parent directory's path, None for top-level entries.
    pub fn parent(&self) -> Option<&str> {
        self.path.rsplit_once('/').map(|(parent, _)| parent)
    }
}

/// Compare two paths in tree order: component by component, bytewise.
pub fn tree_order(a: &str, b: &str) -> Ordering {
    a.split('/').cmp(b.split('/'))
}

/// Check a whole list: each entry valid, strictly in tree order, each parent a directory.
pub fn validate_entries(entries: &[FileEntry]) -> Result<(), EntryError> {
    let mut dirs = std::collections::HashSet::new();
    let mut previous: Option<&FileEntry> = None;
    for entry in entries {
        entry.validate()?;
        if let Some(prev) = previous
            && tree_order(&prev.path, &entry.path) != Ordering::Less
        {
            return Err(EntryError::Order {
                path: entry.path.clone(),
                previous: prev.path.clone(),
            });
        }
        if let Some(parent) = entry.parent()
            && !dirs.contains(parent)
        {
            return Err(EntryError::MissingParent {
                path: entry.path.clone(),
                parent: parent.to_string(),
            });
        }
        if entry.kind == EntryKind::Dir {
            dirs.insert(entry.path.as_str());
        }
        previous = Some(entry);
    }
    Ok(())
}

fn check_path(path: &str) -> Result<(), EntryError> {
    let bad = |reason| {
        Err(EntryError::BadPath {
            path: path.to_string(),
            reason,
        })
    };
    if path.is_empty() {
        return bad("is empty");
    }
    if path.starts_with('/') {
        return bad("is absolute");
    }
    if path.contains('\0') {
        return bad("contains NUL");
    }
    for component in path.split('/') {
        match component {
            "" => return bad("has an empty component"),
            "." | ".." => return bad("has a . or .. component"),
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(path: &str) -> FileEntry {
        FileEntry {
            path: path.into(),
            mode: 0o755,
            kind: EntryKind::Dir,
        }
    }

    fn file(path: &str, size: u64, blocks: usize) -> FileEntry {
        FileEntry {
            path: path.into(),
            mode: 0o644,
            kind: EntryKind::File {
                size,
                blocks: vec![Digest::of(b"b"); blocks],
            },
        }
    }

    #[test]
    fn rejects_paths_that_could_leave_the_tree() {
        for path in ["", "/etc", "a/../b", "..", "./a", "a//b", "a/", "a\0b"] {
            assert!(
                matches!(file(path, 0, 0).validate(), Err(EntryError::BadPath { .. })),
                "{path:?}"
            );
        }
        assert!(file("a/b.c/d", 0, 0).validate().is_ok());
    }

    #[test]
    fn block_count_must_match_size() {
        assert!(file("f", 1, 1).validate().is_ok());
        assert!(matches!(
            file("f", 1, 0).validate(),
            Err(EntryError::BlockCount { .. })
        ));
        assert!(matches!(
            file("f", 0, 1).validate(),
            Err(EntryError::BlockCount { .. })
        ));
    }

    #[test]
    fn tree_order_puts_a_directory_before_its_contents() {
        // Bytewise string order would put "a-c" (0x2d) before "a/b" (0x2f).
        assert_eq!(tree_order("a", "a/b"), Ordering::Less);
        assert_eq!(tree_order("a/b", "a-c"), Ordering::Less);
        let entries = vec![dir("a"), file("a/b", 0, 0), file("a-c", 0, 0)];
        assert_eq!(validate_entries(&entries), Ok(()));
    }

    #[test]
    fn rejects_duplicates_disorder_and_non_directory_parents() {
        let dup = vec![file("a", 0, 0), file("a", 0, 0)];
        assert!(matches!(
            validate_entries(&dup),
            Err(EntryError::Order { .. })
        ));
        let disorder = vec![file("b", 0, 0), file("a", 0, 0)];
        assert!(matches!(
            validate_entries(&disorder),
            Err(EntryError::Order { .. })
        ));
        let orphan = vec![file("a/b", 0, 0)];
        assert!(matches!(
            validate_entries(&orphan),
            Err(EntryError::MissingParent { .. })
        ));
        let through_symlink = vec![
            FileEntry {
                path: "a".into(),
                mode: 0o777,
                kind: EntryKind::Symlink {
                    target: "/etc".into(),
                },
            },
            file("a/passwd", 0, 0),
        ];
        assert!(matches!(
            validate_entries(&through_symlink),
            Err(EntryError::MissingParent { .. })
        ));
    }

    #[test]
    fn serializes_kind_inline() {
        let json = serde_json::to_value(file("f", 1, 1)).unwrap();
        assert_eq!(json["kind"], "file");
        assert_eq!(json["size"], 1);
        let json = serde_json::to_value(dir("d")).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"path": "d", "mode": 0o755, "kind": "dir"})
        );
    }
}
