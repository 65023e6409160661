//! `/files/replace`: replace every occurrence of a string in files, keeping their mode.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::FilesError;
use super::ops::io_error;

#[derive(Debug, Clone, Deserialize)]
pub struct ReplaceItem {
    pub old: String,
    #[serde(default)]
    pub new: String,
}

#[derive(Debug, Serialize)]
pub struct ReplaceResult {
    #[serde(rename = "replacedCount")]
    pub replaced_count: usize,
}

pub type ReplaceResults = BTreeMap<String, ReplaceResult>;

/// Replaces `item.old` by `item.new` in the file; returns how many occurrences there were.
/// The file is rewritten in place so its inode, owner and mode stay.
pub fn replace_in_file(path: &Path, item: &ReplaceItem) -> Result<usize, FilesError> {
    if item.old.is_empty() {
        return Err(FilesError::Invalid("old content must not be empty".into()));
    }
    let content = std::fs::read(path).map_err(io_error(path))?;
    let text = String::from_utf8_lossy(&content);
    let count = text.matches(&item.old).count();
    if count > 0 {
        std::fs::write(path, text.replace(&item.old, &item.new)).map_err(io_error(path))?;
    }
    Ok(count)
}
