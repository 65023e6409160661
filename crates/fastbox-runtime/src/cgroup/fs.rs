//! File operations on a cgroup filesystem (or a directory shaped like one), with errors that
//! name the operation and the path.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use super::CgroupError;

pub(super) fn io_err(op: &'static str, path: &Path) -> impl FnOnce(io::Error) -> CgroupError {
    let path = path.to_path_buf();
    move |source| CgroupError::Io { op, path, source }
}

/// Writes `value` with one `write(2)`, as cgroup files require. On the kernel's filesystem
/// the file must exist; on a stand-in directory (`kernel == false`) it is created.
pub(super) fn write(path: &Path, value: &str, kernel: bool) -> Result<(), CgroupError> {
    let mut opts = fs::OpenOptions::new();
    opts.write(true);
    if !kernel {
        opts.create(true).truncate(true);
    }
    let mut file = opts.open(path).map_err(io_err("open", path))?;
    file.write_all(value.as_bytes())
        .map_err(io_err("write", path))
}

pub(super) fn read(path: &Path) -> Result<String, CgroupError> {
    fs::read_to_string(path).map_err(io_err("read", path))
}

/// `None` when the file does not exist.
pub(super) fn read_optional(path: &Path) -> Result<Option<String>, CgroupError> {
    match fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err("read", path)(e)),
    }
}

/// The value of `key` in a flat-keyed file (`key value` per line: `memory.events`,
/// `memory.oom_control`, `cpu.stat`, `cgroup.events`).
pub(super) fn keyed_value(content: &str, key: &str) -> Option<u64> {
    content.lines().find_map(|line| {
        let (k, v) = line.split_once(char::is_whitespace)?;
        (k == key).then(|| v.trim().parse().ok())?
    })
}

/// Creates `path`; `Ok(false)` if it already existed.
pub(super) fn mkdir(path: &Path) -> Result<bool, CgroupError> {
    match fs::create_dir(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(io_err("mkdir", path)(e)),
    }
}

/// Removes the cgroup directory `path` and any cgroups nested in it, deepest first.
/// `Ok(())` if it does not exist. Errors carry the raw `rmdir` error (EBUSY while tasks are
/// still exiting) so the caller can retry.
pub(super) fn rmdir_tree(path: &Path, kernel: bool) -> Result<(), CgroupError> {
    let entries = match fs::read_dir(path) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_err("list", path)(e)),
    };
    let mut files: Vec<PathBuf> = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io_err("list", path))?;
        let file_type = entry.file_type().map_err(io_err("stat", &entry.path()))?;
        if file_type.is_dir() {
            rmdir_tree(&entry.path(), kernel)?;
        } else {
            files.push(entry.path());
        }
    }
    if !kernel {
        // A stand-in directory holds real files; the kernel's cgroup files vanish with rmdir.
        for file in files {
            fs::remove_file(&file).map_err(io_err("remove", &file))?;
        }
    }
    match fs::remove_dir(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err("rmdir", path)(e)),
    }
}

/// Pids listed in a `cgroup.procs` file; an absent file lists none.
pub(super) fn read_pids(path: &Path) -> Result<Vec<i32>, CgroupError> {
    let Some(content) = read_optional(path)? else {
        return Ok(Vec::new());
    };
    content
        .split_whitespace()
        .map(|p| {
            p.parse().map_err(|_| CgroupError::Parse {
                path: path.to_path_buf(),
                content: p.to_string(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keyed_values() {
        let oom_control = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n";
        assert_eq!(keyed_value(oom_control, "oom_kill"), Some(3));
        assert_eq!(keyed_value(oom_control, "oom_kill_disable"), Some(0));
        let events = "low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n";
        assert_eq!(keyed_value(events, "oom_kill"), Some(1));
        assert_eq!(keyed_value(events, "oom"), Some(2));
        assert_eq!(keyed_value(events, "missing"), None);
        assert_eq!(keyed_value("populated 1\nfrozen 0\n", "frozen"), Some(0));
    }
}
