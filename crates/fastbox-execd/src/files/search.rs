//! `/files/search`: a recursive walk with a glob, and the glob matcher itself.
//!
//! As in the reference execd, the pattern is matched against each entry's name, so `*.py`
//! finds Python files at any depth. A pattern containing `/` is matched against the path
//! relative to the search root instead, where `*` stays within one component and `**` spans
//! any number. Directories are walked but not returned; symlinks are returned, never followed.

use std::path::Path;

use super::FilesError;
use super::info::{FileInfo, file_info};
use super::ops::io_error;
use crate::identity::Accounts;

pub fn search(
    root: &Path,
    pattern: &str,
    accounts: &Accounts,
) -> Result<Vec<FileInfo>, FilesError> {
    let pattern = if pattern.is_empty() { "**" } else { pattern };
    let meta = std::fs::metadata(root).map_err(io_error(root))?;
    let mut out = Vec::new();
    if !meta.is_dir() {
        let name = root
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if glob_match(pattern, &name) {
            out.push(file_info(
                root,
                &std::fs::symlink_metadata(root).map_err(io_error(root))?,
                accounts,
            ));
        }
        return Ok(out);
    }
    walk(root, root, pattern, accounts, &mut out)?;
    Ok(out)
}

fn walk(
    root: &Path,
    dir: &Path,
    pattern: &str,
    accounts: &Accounts,
    out: &mut Vec<FileInfo>,
) -> Result<(), FilesError> {
    let mut entries: Vec<_> = match std::fs::read_dir(dir) {
        Ok(rd) => rd.filter_map(Result::ok).collect(),
        // Entries that vanish or cannot be read mid-walk are skipped, not fatal.
        Err(_) if dir != root => return Ok(()),
        Err(e) => return Err(super::FilesError::from_io(dir, e)),
    };
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if meta.is_dir() {
            walk(root, &path, pattern, accounts, out)?;
            continue;
        }
        let target = if pattern.contains('/') {
            path.strip_prefix(root)
                .unwrap_or(&path)
                .to_string_lossy()
                .into_owned()
        } else {
            entry.file_name().to_string_lossy().into_owned()
        };
        if glob_match(pattern, &target) {
            out.push(file_info(&path, &meta, accounts));
        }
    }
    Ok(())
}

/// Shell-style glob: `*` (not across `/`), `**` (across `/`), `?`, `[abc]`, `[a-z]`, `[!x]`,
/// and `\` escapes.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    matches(&p, &t)
}

fn matches(p: &[char], t: &[char]) -> bool {
    match p.first() {
        None => t.is_empty(),
        Some('*') => {
            let double = p.get(1) == Some(&'*');
            let rest = if double { &p[2..] } else { &p[1..] };
            // `**/` also matches zero directories.
            if double && rest.first() == Some(&'/') && matches(&rest[1..], t) {
                return true;
            }
            for i in 0..=t.len() {
                if matches(rest, &t[i..]) {
                    return true;
                }
                if i < t.len() && t[i] == '/' && !double {
                    return false;
                }
            }
            false
        }
        Some('?') => !t.is_empty() && t[0] != '/' && matches(&p[1..], &t[1..]),
        Some('[') => match (t.first(), class_end(p)) {
            (Some(&c), Some(end)) => {
                class_matches(&p[1..end], c) && matches(&p[end + 1..], &t[1..])
            }
            (Some(&c), None) => c == '[' && matches(&p[1..], &t[1..]),
            (None, _) => false,
        },
        Some('\\') if p.len() > 1 => t.first() == Some(&p[1]) && matches(&p[2..], &t[1..]),
        Some(&c) => t.first() == Some(&c) && matches(&p[1..], &t[1..]),
    }
}

/// Index of the `]` closing the class that starts at `p[0] == '['`.
fn class_end(p: &[char]) -> Option<usize> {
    let mut i = 1;
    if matches!(p.get(i), Some('!') | Some('^')) {
        i += 1;
    }
    if p.get(i) == Some(&']') {
        i += 1;
    }
    (i..p.len()).find(|&j| p[j] == ']')
}

fn class_matches(class: &[char], c: char) -> bool {
    let (negate, body) = match class.first() {
        Some('!') | Some('^') => (true, &class[1..]),
        _ => (false, class),
    };
    let mut found = false;
    let mut i = 0;
    while i < body.len() {
        if i + 2 < body.len() && body[i + 1] == '-' {
            found |= body[i] <= c && c <= body[i + 2];
            i += 3;
        } else {
            found |= body[i] == c;
            i += 1;
        }
    }
    found != negate
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob_basics() {
        assert!(glob_match("*.py", "a.py"));
        assert!(!glob_match("*.py", "a.pyc"));
        assert!(glob_match("**", "anything"));
        assert!(glob_match("?.txt", "a.txt"));
        assert!(!glob_match("?.txt", "ab.txt"));
        assert!(glob_match("[ab]*", "banana"));
        assert!(!glob_match("[!ab]*", "banana"));
        assert!(glob_match("[a-c]x", "bx"));
        assert!(glob_match("\\*", "*"));
        assert!(!glob_match("\\*", "a"));
    }

    #[test]
    fn glob_paths() {
        assert!(glob_match("src/*.rs", "src/main.rs"));
        assert!(!glob_match("src/*.rs", "src/a/main.rs"));
        assert!(glob_match("src/**/*.rs", "src/a/b/main.rs"));
        assert!(glob_match("src/**/*.rs", "src/main.rs"));
        assert!(glob_match("**/*.rs", "main.rs"));
    }
}
