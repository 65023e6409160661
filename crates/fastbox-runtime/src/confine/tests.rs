//! Each test is an attack on a tree: a symlink, FIFO or swap placed where the host writes,
//! and a "host" directory outside the tree that must come out byte for byte unchanged.

use std::fs;
use std::os::unix::fs::{FileTypeExt, PermissionsExt, symlink};
use std::path::{Path, PathBuf};

use super::testing::between_steps;
use super::*;

/// A tree and a host directory beside it holding one file, with the host's digest taken.
struct Scene {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    host: PathBuf,
    before: String,
}

impl Scene {
    fn new() -> Scene {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let host = tmp.path().join("host");
        fs::create_dir_all(root.join("etc")).unwrap();
        fs::create_dir_all(&host).unwrap();
        fs::write(host.join("hosts"), "the host's own\n").unwrap();
        let before = digest(&host);
        Scene {
            _tmp: tmp,
            root,
            host,
            before,
        }
    }

    fn tree(&self) -> Dir {
        Dir::open_root(&self.root).unwrap()
    }

    fn assert_host_untouched(&self) {
        assert_eq!(
            digest(&self.host),
            self.before,
            "the host directory changed"
        );
    }
}

/// Names, kinds, modes and contents of every entry under `dir`, in order.
fn digest(dir: &Path) -> String {
    let mut entries: Vec<_> = walk(dir);
    entries.sort();
    entries.join("\n")
}

fn walk(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let meta = fs::symlink_metadata(entry.path()).unwrap();
        let kind = meta.file_type();
        let content = if kind.is_file() {
            format!("{:x?}", fs::read(entry.path()).unwrap())
        } else if kind.is_symlink() {
            fs::read_link(entry.path()).unwrap().display().to_string()
        } else {
            String::new()
        };
        out.push(format!(
            "{} {:o} {content}",
            entry.path().display(),
            meta.permissions().mode()
        ));
        if kind.is_dir() {
            out.extend(walk(&entry.path()));
        }
    }
    out
}

#[test]
fn a_symlinked_etc_resolves_inside_the_tree_not_on_the_host() {
    let s = Scene::new();
    fs::remove_dir(s.root.join("etc")).unwrap();
    symlink(&s.host, s.root.join("etc")).unwrap();
    // The host path does not exist inside the tree: nothing to write into.
    let err = s.tree().resolve_dir("etc").unwrap_err();
    assert!(matches!(err, ConfineError::Io { .. }), "{err}");
    // Once it does exist inside the tree, the write lands there.
    fs::create_dir_all(s.root.join(s.host.strip_prefix("/").unwrap())).unwrap();
    let etc = s.tree().resolve_dir("etc").unwrap();
    etc.write_file("hosts", b"sandbox\n", 0o644).unwrap();
    s.assert_host_untouched();
    let inside = s.root.join(s.host.strip_prefix("/").unwrap()).join("hosts");
    assert_eq!(fs::read_to_string(inside).unwrap(), "sandbox\n");
}

#[test]
fn dot_dot_symlinks_stop_at_the_tree_root() {
    let s = Scene::new();
    fs::remove_dir(s.root.join("etc")).unwrap();
    symlink("../../../../../..", s.root.join("etc")).unwrap();
    let etc = s.tree().resolve_dir("etc").unwrap();
    etc.write_file("marker", b"x", 0o644).unwrap();
    assert!(
        s.root.join("marker").exists(),
        "'..' from the root is the root"
    );
    s.assert_host_untouched();
}

#[test]
fn a_path_with_dot_dot_is_refused() {
    let s = Scene::new();
    let err = s.tree().resolve_dir("etc/../../host").unwrap_err();
    assert!(matches!(err, ConfineError::BadPath { .. }), "{err}");
    let etc = s.tree().resolve_dir("etc").unwrap();
    for name in ["..", ".", "", "a/b"] {
        let err = etc.write_file(name, b"x", 0o644).unwrap_err();
        assert!(matches!(err, ConfineError::BadPath { .. }), "{name}: {err}");
    }
}

#[test]
fn a_symlinked_file_is_replaced_not_followed() {
    let s = Scene::new();
    symlink(s.host.join("hosts"), s.root.join("etc/hosts")).unwrap();
    let etc = s.tree().resolve_dir("etc").unwrap();
    etc.write_file("hosts", b"sandbox\n", 0o644).unwrap();
    s.assert_host_untouched();
    let meta = fs::symlink_metadata(s.root.join("etc/hosts")).unwrap();
    assert!(meta.file_type().is_file());
    assert_eq!(meta.permissions().mode() & 0o7777, 0o644);
    assert_eq!(
        fs::read_to_string(s.root.join("etc/hosts")).unwrap(),
        "sandbox\n"
    );
}

#[test]
fn a_fifo_is_replaced_without_blocking() {
    let s = Scene::new();
    nix::unistd::mkfifo(
        &s.root.join("etc/resolv.conf"),
        nix::sys::stat::Mode::from_bits_truncate(0o644),
    )
    .unwrap();
    let etc = s.tree().resolve_dir("etc").unwrap();
    etc.write_file("resolv.conf", b"nameserver 10.0.0.1\n", 0o644)
        .unwrap();
    assert!(
        fs::symlink_metadata(s.root.join("etc/resolv.conf"))
            .unwrap()
            .is_file()
    );
}

#[test]
fn a_directory_where_a_file_goes_is_an_error_and_leaves_no_temporary() {
    let s = Scene::new();
    fs::create_dir(s.root.join("etc/hostname")).unwrap();
    let etc = s.tree().resolve_dir("etc").unwrap();
    etc.write_file("hostname", b"x\n", 0o644).unwrap_err();
    let names: Vec<_> = fs::read_dir(s.root.join("etc"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec!["hostname"], "a temporary file was left behind");
}

#[test]
fn etc_swapped_for_a_host_symlink_after_it_was_opened_takes_no_write_to_the_host() {
    let s = Scene::new();
    let (root, host) = (s.root.clone(), s.host.clone());
    let mut swapped = false;
    let etc = s.tree().resolve_dir("etc").unwrap();
    between_steps(
        move |_| {
            if !swapped {
                swapped = true;
                fs::rename(root.join("etc"), root.join("etc.old")).unwrap();
                symlink(&host, root.join("etc")).unwrap();
            }
        },
        || etc.write_file("hosts", b"sandbox\n", 0o644).unwrap(),
    );
    s.assert_host_untouched();
    assert_eq!(
        fs::read_to_string(s.root.join("etc.old/hosts")).unwrap(),
        "sandbox\n",
        "the write went to the directory that was opened"
    );
}

#[test]
fn a_swap_during_create_dir_all_stays_inside_the_tree() {
    let s = Scene::new();
    let (root, host) = (s.root.clone(), s.host.clone());
    let mut swapped = false;
    let tree = s.tree();
    let result = between_steps(
        move |at| {
            // After `a` is made and before it is opened: `a` becomes a symlink to the host.
            if !swapped && at == Path::new("a") {
                swapped = true;
                fs::remove_dir(root.join("a")).unwrap();
                symlink(&host, root.join("a")).unwrap();
            }
        },
        || tree.create_dir_all("a/b", 0o755),
    );
    // The host path is not inside the tree: the resolution fails, nothing is created.
    assert!(result.is_err());
    s.assert_host_untouched();
    assert!(!s.host.join("b").exists());
}

#[test]
fn own_directories_refuse_symlinks_on_the_way() {
    let s = Scene::new();
    symlink(&s.host, s.root.join(".fastbox")).unwrap();
    let err = s.tree().own_dir(".fastbox/dev", 0o755).unwrap_err();
    assert!(matches!(err, ConfineError::NotADirectory { .. }), "{err}");
    // A relative symlink inside the tree is refused too: fastbox's own paths are directories.
    fs::remove_file(s.root.join(".fastbox")).unwrap();
    symlink("etc", s.root.join(".fastbox")).unwrap();
    let err = s.tree().own_dir(".fastbox", 0o755).unwrap_err();
    assert!(matches!(err, ConfineError::NotADirectory { .. }), "{err}");
    s.assert_host_untouched();
    fs::remove_file(s.root.join(".fastbox")).unwrap();
    let dev = s.tree().own_dir(".fastbox/dev", 0o755).unwrap();
    assert_eq!(dev.shown(), Path::new("/.fastbox/dev"));
    assert!(s.root.join(".fastbox/dev").is_dir());
}

#[test]
fn symlinks_are_made_and_replace_what_was_there() {
    let s = Scene::new();
    fs::write(s.root.join("etc/fd"), "old").unwrap();
    let etc = s.tree().resolve_dir("etc").unwrap();
    etc.make_symlink("fd", "/proc/self/fd").unwrap();
    assert_eq!(
        fs::read_link(s.root.join("etc/fd")).unwrap(),
        Path::new("/proc/self/fd")
    );
}

#[test]
fn device_nodes_replace_symlinks_and_get_their_mode() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: mknod of a character device needs root");
        return;
    }
    let s = Scene::new();
    symlink(s.host.join("hosts"), s.root.join("etc/null")).unwrap();
    let etc = s.tree().resolve_dir("etc").unwrap();
    etc.make_char_device("null", 1, 3, 0o666).unwrap();
    let meta = fs::symlink_metadata(s.root.join("etc/null")).unwrap();
    assert!(meta.file_type().is_char_device());
    assert_eq!(meta.permissions().mode() & 0o777, 0o666);
    s.assert_host_untouched();
}

#[test]
fn a_regular_file_target_refuses_symlinks_and_fifos() {
    let s = Scene::new();
    let etc = s.tree().resolve_dir("etc").unwrap();
    symlink(s.host.join("hosts"), s.root.join("etc/execd")).unwrap();
    etc.regular_file("execd", 0o755).unwrap_err();
    nix::unistd::mkfifo(
        &s.root.join("etc/fifo"),
        nix::sys::stat::Mode::from_bits_truncate(0o644),
    )
    .unwrap();
    etc.regular_file("fifo", 0o755).unwrap_err();
    etc.regular_file("new", 0o755).unwrap();
    assert!(s.root.join("etc/new").is_file());
    s.assert_host_untouched();
}

#[test]
fn a_mount_inside_the_tree_is_not_crossed() {
    // The tree's root is on one file system; /proc is another.
    let tree = Dir::open_root(Path::new("/")).unwrap();
    let err = tree.resolve_dir("proc/self").unwrap_err();
    assert!(matches!(err, ConfineError::CrossesMount { .. }), "{err}");
}
