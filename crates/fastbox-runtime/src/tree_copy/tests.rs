use super::testing::between_steps;
use super::*;
use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt, symlink};
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

/// Every entry under `root`: path, type, mode, owner, times, size, blocks, link count,
/// device, attributes, link target and contents.
fn listing(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        let m = fs::symlink_metadata(&p).unwrap();
        let rel = p.strip_prefix(root).unwrap().display().to_string();
        let xattrs = xattrs_of(&p);
        let content = if m.is_file() {
            format!("{:x}", digest(&fs::read(&p).unwrap()))
        } else if m.file_type().is_symlink() {
            fs::read_link(&p).unwrap().display().to_string()
        } else {
            String::new()
        };
        let dir_nlink = if m.is_dir() { 0 } else { m.nlink() };
        out.push(format!(
            "{rel} mode={:o} uid={} gid={} mtime={}.{} size={} blocks={} nlink={dir_nlink} rdev={} xattrs=[{xattrs}] {content}",
            m.mode(),
            m.uid(),
            m.gid(),
            m.mtime(),
            m.mtime_nsec(),
            if m.is_dir() { 0 } else { m.size() },
            if m.is_file() { m.blocks() } else { 0 },
            m.rdev(),
        ));
        if m.is_dir() {
            for e in fs::read_dir(&p).unwrap() {
                stack.push(e.unwrap().path());
            }
        }
    }
    out.sort();
    out
}

/// The extended attributes of `path` (of a symbolic link itself, not its target).
fn xattrs(path: &Path) -> Vec<(CString, Vec<u8>)> {
    let cpath = CString::new(path.as_os_str().as_bytes()).unwrap();
    let names = xattr_buffer(|buf, len| {
        // SAFETY: `buf` has room for `len` bytes; `cpath` is NUL-terminated.
        unsafe { libc::llistxattr(cpath.as_ptr(), buf, len) }
    })
    .unwrap();
    xattr_names(&names)
        .map(|name| {
            let value = xattr_buffer(|buf, len| {
                // SAFETY: as above; `name` is NUL-terminated.
                unsafe { libc::lgetxattr(cpath.as_ptr(), name.as_ptr(), buf.cast(), len) }
            })
            .unwrap();
            (name.to_owned(), value)
        })
        .collect()
}

/// Sets attribute `name` of `path` (of a symbolic link itself) to `value`.
fn set_xattr(path: &Path, name: &str, value: &[u8]) {
    let cpath = CString::new(path.as_os_str().as_bytes()).unwrap();
    let name = CString::new(name).unwrap();
    // SAFETY: `value` holds `value.len()` bytes; both strings are NUL-terminated.
    let r = unsafe {
        libc::lsetxattr(
            cpath.as_ptr(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    assert_eq!(r, 0, "{}", io::Error::last_os_error());
}

/// `name=value` of every extended attribute of `p` (not following a symbolic link).
fn xattrs_of(p: &Path) -> String {
    let mut out: Vec<String> = xattrs(p)
        .into_iter()
        .map(|(name, value)| {
            format!(
                "{}={}",
                name.to_string_lossy(),
                String::from_utf8_lossy(&value)
            )
        })
        .collect();
    out.sort();
    out.join(",")
}

fn digest(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x100000001b3)
    })
}

fn sh(script: &str) {
    let status = Command::new("/bin/sh")
        .args(["-ec", script])
        .status()
        .unwrap();
    assert!(status.success(), "{script}");
}

#[test]
fn the_copy_matches_cp_a() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root (device nodes, owners, trusted attributes)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    fs::create_dir(&src).unwrap();
    sh(&format!(
        "cd {}
         mkdir -p etc/opaque/sub var/empty .fastbox/dev/pts .fastbox/dev/shm deep/a/b/c
         echo hostname > etc/hostname
         printf 'secret' > etc/opaque/sub/file
         mknod etc/whiteout c 0 0
         mknod .fastbox/dev/null c 1 3 && chmod 666 .fastbox/dev/null
         mknod var/fifo p
         ln -s pts/ptmx .fastbox/dev/ptmx
         ln -s /nonexistent/target dangling
         echo linked > var/a && ln var/a var/b && ln var/a deep/a/b/c/a && ln var/a top
         mknod var/node-a c 1 5 && ln var/node-a deep/a/node-b
         cp /bin/true suid && chown 1000:2000 suid && chmod 4755 suid
         mknod setgid-node c 1 7 && chown 5:6 setgid-node && chmod 2640 setgid-node
         chmod 1777 .fastbox/dev/shm
         chmod 0500 deep/a/b
         chown -h 123:456 dangling
         dd if=/dev/urandom of=sparse bs=4096 count=1 seek=256 2>/dev/null
         truncate -s 4M sparse
         dd if=/dev/urandom of=big bs=1M count=1 2>/dev/null
         truncate -s 8M holes-at-both-ends && dd if=/dev/urandom of=holes-at-both-ends bs=4096 count=3 seek=600 conv=notrunc 2>/dev/null
         : > empty",
        src.display()
    ));
    set_xattr(&src.join("etc/opaque"), "trusted.overlay.opaque", b"y");
    set_xattr(&src.join("etc/hostname"), "user.note", b"hello");
    set_xattr(&src.join("dangling"), "trusted.on-the-link", b"1");
    set_xattr(&src.join(".fastbox/dev/null"), "trusted.on-the-node", b"2");
    set_xattr(&src.join("etc/whiteout"), "trusted.overlay.origin", b"3");
    sh(&format!(
        "touch -h -d '2001-02-03 04:05:06.789' {0}/dangling {0}/etc/hostname {0}/etc/opaque {0}/.fastbox/dev/null {0}/etc/whiteout {0}/deep/a/b",
        src.display()
    ));
    let ours = dir.path().join("ours");
    let theirs = dir.path().join("theirs");
    fs::create_dir(&ours).unwrap();
    fs::create_dir(&theirs).unwrap();
    copy_contents(&src, &ours).unwrap();
    sh(&format!("cp -a {}/. {}", src.display(), theirs.display()));
    let (a, b) = (listing(&ours), listing(&theirs));
    assert_eq!(a, b, "ours:\n{}\ncp -a:\n{}", a.join("\n"), b.join("\n"));
    for wanted in [
        "trusted.overlay.opaque",
        "trusted.on-the-link",
        "trusted.on-the-node",
    ] {
        assert!(a.iter().any(|l| l.contains(wanted)), "{wanted}: {a:#?}");
    }
    let sparse = fs::metadata(ours.join("sparse")).unwrap();
    assert!(
        sparse.blocks() * 512 < 64 * 1024,
        "holes kept: {} blocks",
        sparse.blocks()
    );
    assert_eq!(
        fs::metadata(ours.join("var/a")).unwrap().ino(),
        fs::metadata(ours.join("deep/a/b/c/a")).unwrap().ino()
    );
}

/// A tree and a probe directory beside it (outside the tree) that a copy must neither read
/// nor write, with the probe's listing taken.
struct Scene {
    dir: tempfile::TempDir,
    src: PathBuf,
    dst: PathBuf,
    probe: PathBuf,
    before: Vec<String>,
}

const PROBE_SECRET: &str = "the host's own secret";

impl Scene {
    fn new() -> Scene {
        let dir = tempfile::tempdir().unwrap();
        let (src, dst, probe) = (
            dir.path().join("src"),
            dir.path().join("dst"),
            dir.path().join("probe"),
        );
        fs::create_dir_all(src.join("sub/inner")).unwrap();
        fs::write(src.join("sub/file"), "the tenant's file").unwrap();
        fs::write(src.join("sub/inner/deeper"), "deeper").unwrap();
        fs::write(src.join("top"), "top").unwrap();
        fs::create_dir_all(&dst).unwrap();
        fs::create_dir_all(probe.join("dir")).unwrap();
        fs::write(probe.join("secret"), PROBE_SECRET).unwrap();
        fs::write(probe.join("dir/file"), PROBE_SECRET).unwrap();
        let before = listing(&probe);
        Scene {
            dir,
            src,
            dst,
            probe,
            before,
        }
    }

    fn assert_probe_untouched(&self) {
        assert_eq!(
            listing(&self.probe),
            self.before,
            "the probe directory changed"
        );
    }

    /// Nothing of the probe was read into the target.
    fn assert_nothing_read(&self) {
        for line in listing(&self.dst) {
            assert!(
                !line.ends_with(&format!("{:x}", digest(PROBE_SECRET.as_bytes()))),
                "the probe's contents were copied: {line}"
            );
        }
    }

    /// `name` (a directory of `root`) is moved aside and replaced by a symbolic link to the
    /// probe.
    fn swap_for_probe(root: &Path, name: &str, probe: &Path) {
        let at = root.join(name);
        fs::rename(&at, root.join(format!("{name}.moved"))).unwrap();
        symlink(probe, &at).unwrap();
    }
}

/// A source directory swapped for a symlink to the probe after it was looked at and before it
/// is opened: the open refuses the link.
#[test]
fn a_source_directory_swapped_for_a_symlink_is_not_followed() {
    let s = Scene::new();
    let (src, probe) = (s.src.clone(), s.probe.clone());
    let result = between_steps(
        move |step, at| {
            if step == Step::Looked && at == Path::new("sub") {
                Scene::swap_for_probe(&src, "sub", &probe);
            }
        },
        || copy_contents(&s.src, &s.dst),
    );
    let e = result.expect_err("the copy went through the link");
    assert!(e.to_string().contains("sub"), "{e}");
    s.assert_probe_untouched();
    s.assert_nothing_read();
}

/// A source directory swapped after it was opened: the copy goes on in the directory it
/// holds, never in the probe.
#[test]
fn a_source_directory_swapped_after_it_was_opened_is_copied_from_what_was_opened() {
    let s = Scene::new();
    let (src, probe) = (s.src.clone(), s.probe.clone());
    between_steps(
        move |step, at| {
            if step == Step::Looked && at == Path::new("sub/file") {
                Scene::swap_for_probe(&src, "sub", &probe);
            }
        },
        || copy_contents(&s.src, &s.dst),
    )
    .unwrap();
    assert_eq!(
        fs::read_to_string(s.dst.join("sub/file")).unwrap(),
        "the tenant's file"
    );
    assert_eq!(
        fs::read_to_string(s.dst.join("sub/inner/deeper")).unwrap(),
        "deeper"
    );
    s.assert_probe_untouched();
    s.assert_nothing_read();
}

/// A file swapped for a symlink to a probe file between the look and the open is refused.
#[test]
fn a_source_file_swapped_for_a_symlink_is_not_read() {
    let s = Scene::new();
    let (src, probe) = (s.src.clone(), s.probe.clone());
    let result = between_steps(
        move |step, at| {
            if step == Step::Looked && at == Path::new("sub/file") {
                fs::remove_file(src.join("sub/file")).unwrap();
                symlink(probe.join("secret"), src.join("sub/file")).unwrap();
            }
        },
        || copy_contents(&s.src, &s.dst),
    );
    result.expect_err("the copy read through the link");
    s.assert_probe_untouched();
    s.assert_nothing_read();
}

/// A target directory swapped for a symlink to the probe after the copy made it: the copy
/// refuses to open it, and writes nothing into the probe.
#[test]
fn a_target_directory_swapped_for_a_symlink_is_not_written_through() {
    let s = Scene::new();
    let (dst, probe) = (s.dst.clone(), s.probe.clone());
    let result = between_steps(
        move |step, at| {
            if step == Step::Made && at == Path::new("sub") {
                fs::remove_dir(dst.join("sub")).unwrap();
                symlink(&probe, dst.join("sub")).unwrap();
            }
        },
        || copy_contents(&s.src, &s.dst),
    );
    result.expect_err("the copy wrote through the link");
    s.assert_probe_untouched();
}

/// A target directory swapped after it was opened: the entries go into the directory the
/// copy holds.
#[test]
fn a_target_directory_swapped_after_it_was_opened_gets_nothing_through_the_link() {
    let s = Scene::new();
    let (dst, probe) = (s.dst.clone(), s.probe.clone());
    between_steps(
        move |step, at| {
            if step == Step::Looked && at == Path::new("sub/file") {
                Scene::swap_for_probe(&dst, "sub", &probe);
            }
        },
        || copy_contents(&s.src, &s.dst),
    )
    .unwrap();
    assert_eq!(
        fs::read_to_string(s.dst.join("sub.moved/file")).unwrap(),
        "the tenant's file"
    );
    s.assert_probe_untouched();
}

/// Symbolic links of the source (absolute, relative, to a directory and to a file outside
/// the tree) are copied as links with the same targets, never followed.
#[test]
fn symlinks_are_copied_as_symlinks() {
    let s = Scene::new();
    symlink(&s.probe, s.src.join("absolute")).unwrap();
    symlink("../probe", s.src.join("relative")).unwrap();
    symlink(s.probe.join("secret"), s.src.join("sub/to-a-file")).unwrap();
    symlink("/", s.src.join("root")).unwrap();
    copy_contents(&s.src, &s.dst).unwrap();
    for (name, target) in [
        ("absolute", s.probe.clone()),
        ("relative", PathBuf::from("../probe")),
        ("sub/to-a-file", s.probe.join("secret")),
        ("root", PathBuf::from("/")),
    ] {
        let at = s.dst.join(name);
        assert!(
            fs::symlink_metadata(&at).unwrap().file_type().is_symlink(),
            "{name} is not a link"
        );
        assert_eq!(fs::read_link(&at).unwrap(), target, "{name}");
    }
    s.assert_probe_untouched();
    s.assert_nothing_read();
    let _ = &s.dir;
}

/// Runs a copy on a thread of its own (the hook installed there) and waits at most 20 s.
fn copy_within_deadline(
    s: &Scene,
    hook: impl FnMut(Step, &Path) + Send + 'static,
) -> io::Result<()> {
    let (src, dst) = (s.src.clone(), s.dst.clone());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let result = between_steps(hook, || copy_contents(&src, &dst));
        let _ = tx.send(result);
    });
    rx.recv_timeout(Duration::from_secs(20))
        .expect("the copy blocked")
}

/// A FIFO in the source is made anew in the target, never opened: the copy does not block.
#[test]
fn a_fifo_does_not_block_the_copy() {
    let s = Scene::new();
    nix::unistd::mkfifo(
        &s.src.join("sub/pipe"),
        nix::sys::stat::Mode::from_bits_truncate(0o640),
    )
    .unwrap();
    copy_within_deadline(&s, |_, _| {}).unwrap();
    let meta = fs::symlink_metadata(s.dst.join("sub/pipe")).unwrap();
    assert!(meta.file_type().is_fifo());
    assert_eq!(meta.mode() & 0o7777, 0o640);
}

/// A FIFO swapped in for a regular file between the look and the open: the open does not
/// block, and the copy refuses the changed entry.
#[test]
fn a_fifo_swapped_in_for_a_file_does_not_block_the_copy() {
    let s = Scene::new();
    let src = s.src.clone();
    let result = copy_within_deadline(&s, move |step, at| {
        if step == Step::Looked && at == Path::new("top") {
            fs::remove_file(src.join("top")).unwrap();
            nix::unistd::mkfifo(
                &src.join("top"),
                nix::sys::stat::Mode::from_bits_truncate(0o600),
            )
            .unwrap();
        }
    });
    let e = result.expect_err("a FIFO was copied as a file");
    assert!(e.to_string().contains("replaced"), "{e}");
}

/// A tree deeper than [`MAX_DEPTH`] is refused, not walked until the descriptors run out.
#[test]
fn a_tree_deeper_than_the_limit_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
    fs::create_dir_all(&dst).unwrap();
    fs::create_dir(&src).unwrap();
    // Made through a descriptor per level: the path would outgrow PATH_MAX.
    let mut fd = open_root(&src).unwrap();
    for _ in 0..MAX_DEPTH + 1 {
        // SAFETY: mkdirat(2) on our descriptor with a NUL-terminated name.
        cvt(unsafe { libc::mkdirat(fd.as_raw_fd(), c"d".as_ptr(), 0o755) }).unwrap();
        fd = openat(fd.as_raw_fd(), c"d", libc::O_RDONLY | libc::O_DIRECTORY).unwrap();
    }
    drop(fd);
    let e = copy_contents(&src, &dst).expect_err("copied a tree deeper than the limit");
    assert!(e.to_string().contains("deeper than"), "{e}");
    // std's remove_dir_all walks by descriptor too: the temporary directory goes.
}
