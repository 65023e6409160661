//! `/files/search`: a recursive walk with a glob.
//!
//! As in the reference execd, the pattern is matched against each entry's name, so `*.py`
//! finds Python files at any depth. A pattern containing `/` is matched against the path
//! relative to the search root instead, where `*` stays within one component and `**` spans
//! any number. Directories are walked but not returned; symlinks are returned, never followed.
//!
//! The pattern is compiled once by `globset` into a finite automaton, so matching takes time
//! linear in the name, whatever the pattern (a backtracking matcher takes exponential time on
//! `a*a*a*a*a*a*a*a*b` against a long run of `a`s: a denial of service by one request).
//! Syntax: `*` and `?` (never across `/`), `**` as a whole component (`**/`, `/**/`, `/**`;
//! elsewhere it is `*`), classes `[abc]`, `[a-z]`, `[!x]` or `[^x]` (and POSIX classes such
//! as `[[:digit:]]`), `\` escapes. Braces are literal characters, and so is a `[` that no `]`
//! closes; a class whose range runs backwards (`[z-a]`) is an invalid pattern (400).

use std::path::Path;

use globset::{GlobBuilder, GlobMatcher};

use super::FilesError;
use super::info::{FileInfo, file_info};
use super::ops::io_error;
use crate::identity::Accounts;

/// A compiled search pattern.
pub struct Pattern {
    matcher: GlobMatcher,
    /// Matched against the path relative to the root (the pattern has a `/`), else against
    /// the name.
    by_path: bool,
}

impl Pattern {
    /// Compiles `pattern` (empty: `**`, everything).
    pub fn new(pattern: &str) -> Result<Self, FilesError> {
        let pattern = if pattern.is_empty() { "**" } else { pattern };
        let glob = GlobBuilder::new(&literal_braces(pattern))
            .literal_separator(true)
            .backslash_escape(true)
            .build()
            .map_err(|e| {
                FilesError::Invalid(format!("invalid pattern {pattern:?}: {}", e.kind()))
            })?;
        Ok(Self {
            matcher: glob.compile_matcher(),
            by_path: pattern.contains('/'),
        })
    }

    /// Whether `candidate` (a name, or a path relative to the root) matches.
    pub fn matches(&self, candidate: &Path) -> bool {
        self.matcher.is_match(candidate)
    }
}

/// `pattern` in globset's syntax with this endpoint's meaning: braces are escaped (globset
/// reads `{a,b}` as alternatives), a `[` without its `]` is escaped (globset refuses it), a
/// trailing `\` is escaped; escapes and classes are copied as they are.
fn literal_braces(pattern: &str) -> String {
    let chars: Vec<char> = pattern.chars().collect();
    let mut out = String::with_capacity(pattern.len() + 8);
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '\\' if i + 1 < chars.len() => {
                out.push('\\');
                out.push(chars[i + 1]);
                i += 2;
            }
            '\\' => {
                out.push_str("\\\\");
                i += 1;
            }
            '[' => match class_end(&chars[i..]) {
                Some(end) => {
                    out.extend(&chars[i..=i + end]);
                    i += end + 1;
                }
                None => {
                    out.push_str("\\[");
                    i += 1;
                }
            },
            c @ ('{' | '}') => {
                out.push('\\');
                out.push(c);
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    out
}

/// Index of the `]` closing the class that starts at `p[0] == '['` (after an optional `!` or
/// `^`, a `]` first is a member).
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

pub fn search(
    root: &Path,
    pattern: &str,
    accounts: &Accounts,
) -> Result<Vec<FileInfo>, FilesError> {
    let pattern = Pattern::new(pattern)?;
    let meta = std::fs::metadata(root).map_err(io_error(root))?;
    let mut out = Vec::new();
    if !meta.is_dir() {
        let name = root.file_name().map(Path::new).unwrap_or(Path::new(""));
        if pattern.matches(name) {
            out.push(file_info(
                root,
                &std::fs::symlink_metadata(root).map_err(io_error(root))?,
                accounts,
            ));
        }
        return Ok(out);
    }
    walk(root, root, &pattern, accounts, &mut out)?;
    Ok(out)
}

fn walk(
    root: &Path,
    dir: &Path,
    pattern: &Pattern,
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
        let name = entry.file_name();
        let target = if pattern.by_path {
            path.strip_prefix(root).unwrap_or(&path)
        } else {
            Path::new(&name)
        };
        if pattern.matches(target) {
            out.push(file_info(&path, &meta, accounts));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn glob_match(pattern: &str, text: &str) -> bool {
        Pattern::new(pattern).unwrap().matches(Path::new(text))
    }

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
        assert!(glob_match("src/**", "src/a/b"));
        assert!(!glob_match("src/**", "src"));
        assert!(!glob_match("?", "/"));
    }

    #[test]
    fn braces_an_unclosed_bracket_and_a_trailing_backslash_are_literal() {
        assert!(glob_match("{a,b}.txt", "{a,b}.txt"));
        assert!(!glob_match("{a,b}.txt", "a.txt"));
        assert!(glob_match("x[y", "x[y"));
        assert!(glob_match("[", "["));
        assert!(glob_match("a\\", "a\\"));
        assert!(glob_match("[]]x", "]x"));
        assert!(glob_match("[!]]x", "ax"));
        assert!(glob_match("[{]", "{"));
        assert!(glob_match("\\{", "{"));
    }

    #[test]
    fn a_backwards_range_is_an_invalid_pattern() {
        assert!(matches!(Pattern::new("[z-a]"), Err(FilesError::Invalid(_))));
    }

    #[test]
    fn names_need_not_be_utf8() {
        use std::os::unix::ffi::OsStrExt;
        let name = std::ffi::OsStr::from_bytes(b"caf\xe9.txt");
        assert!(Pattern::new("*.txt").unwrap().matches(Path::new(name)));
    }

    #[test]
    fn a_pattern_that_makes_backtracking_exponential_matches_in_linear_time() {
        // A backtracking matcher tries every way of splitting the `a`s among the stars:
        // this would not finish.
        let pattern = "a*a*a*a*a*a*a*a*a*a*a*a*b";
        let long = "a".repeat(20_000);
        assert!(!glob_match(pattern, &long));
        assert!(glob_match(pattern, &format!("{long}b")));
        assert!(!glob_match("**/a*a*a*a*a*a*a*a*b", &format!("x/{long}")));
    }
}
