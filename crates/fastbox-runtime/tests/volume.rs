//! `fastbox_runtime::volume`: a host directory mounted into a process's own mount namespace
//! (pivoted into a root of its own, as a sandbox is), at a path resolved inside that root.
//! A symlink on the path pointing at `/` stays inside the root; the mount is nosuid, nodev,
//! and read-only when asked. Privileged: real mount namespaces (skipped otherwise).

use std::ffi::CString;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use fastbox_runtime::confine::Dir;
use fastbox_runtime::volume::{DetachedMount, attach};

/// A child in a new mount namespace whose root is `root` (pivoted), waiting to be killed.
struct Pivoted {
    pid: i32,
}

impl Pivoted {
    fn start(root: &Path) -> Pivoted {
        let root = CString::new(root.as_os_str().as_encoded_bytes()).unwrap();
        let (dot, slash) = (c".", c"/");
        let mut fds = [0; 2];
        // SAFETY: pipe2(2) into an array of two descriptors.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        let (read_end, write_end) = (fds[0], fds[1]);
        // SAFETY: the child only makes async-signal-safe system calls on strings made before
        // the fork, says it pivoted through the pipe, then waits in pause(2) until killed;
        // it never returns into Rust.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            // SAFETY: in the forked child: system calls on strings and descriptors made
            // before the fork (see above).
            unsafe {
                let ok = libc::unshare(libc::CLONE_NEWNS) == 0
                    && libc::mount(
                        std::ptr::null(),
                        slash.as_ptr(),
                        std::ptr::null(),
                        libc::MS_REC | libc::MS_PRIVATE,
                        std::ptr::null(),
                    ) == 0
                    && libc::mount(
                        root.as_ptr(),
                        root.as_ptr(),
                        std::ptr::null(),
                        libc::MS_BIND,
                        std::ptr::null(),
                    ) == 0
                    && libc::chdir(root.as_ptr()) == 0
                    && libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) == 0
                    && libc::umount2(dot.as_ptr(), libc::MNT_DETACH) == 0;
                if !ok {
                    libc::_exit(1);
                }
                libc::write(write_end, b"p".as_ptr().cast(), 1);
                loop {
                    libc::pause();
                }
            }
        }
        // Killed when dropped, whatever happens below.
        let child = Pivoted { pid };
        let mut byte = 0u8;
        // SAFETY: close(2) of our copy of the write end, then read(2) into one byte we own;
        // the child's copy closes when it exits.
        let got = unsafe {
            libc::close(write_end);
            let got = libc::read(read_end, (&mut byte as *mut u8).cast(), 1);
            libc::close(read_end);
            got
        };
        assert_eq!(got, 1, "the child could not pivot into its root");
        child
    }

    fn mountinfo(&self) -> String {
        std::fs::read_to_string(format!("/proc/{}/mountinfo", self.pid)).unwrap()
    }
}

impl Drop for Pivoted {
    fn drop(&mut self) {
        // SAFETY: kill(2) and waitpid(2) of our own child.
        unsafe {
            libc::kill(self.pid, libc::SIGKILL);
            libc::waitpid(self.pid, std::ptr::null_mut(), 0);
        }
    }
}

/// The mount options of the mount at `point` in `mountinfo` (`rw,nosuid,...`).
fn options_at<'a>(mountinfo: &'a str, point: &str) -> Option<&'a str> {
    mountinfo.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(' ').collect();
        (fields.get(4) == Some(&point)).then(|| fields[5])
    })
}

/// A work directory with `root/` (holding the directory `in_root`) and `source/`; `None`
/// (and the reason printed) when not root.
fn work_dirs(in_root: &str) -> Option<(tempfile::TempDir, PathBuf, PathBuf)> {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root (mount namespaces)");
        return None;
    }
    let work = tempfile::tempdir().unwrap();
    let (root, source) = (work.path().join("root"), work.path().join("source"));
    std::fs::create_dir_all(root.join(in_root)).unwrap();
    std::fs::create_dir_all(&source).unwrap();
    Some((work, root, source))
}

#[test]
fn a_volume_mounts_inside_the_root_through_a_symlink_and_read_only() {
    let Some((_work, root, source)) = work_dirs("data") else {
        return;
    };
    std::fs::write(source.join("marker"), b"from the host").unwrap();
    // The tenant's root: `escape` points at `/`, which must mean its own root.
    std::os::unix::fs::symlink("/", root.join("escape")).unwrap();
    let host_target = Path::new("/fastbox-volume-test-escaped");
    assert!(
        !host_target.exists(),
        "{} exists already",
        host_target.display()
    );

    let child = Pivoted::start(&root);
    let source_dir = Dir::open_root(&source).unwrap();
    let rw = DetachedMount::of_dir(
        source_dir.as_fd(),
        "/escape/fastbox-volume-test-escaped",
        false,
    )
    .unwrap();
    let ro = DetachedMount::of_dir(source_dir.as_fd(), "/data/ro", true).unwrap();
    attach(child.pid, vec![rw, ro]).expect("attach");

    assert!(
        !host_target.exists(),
        "a symlink inside the root led the mount out to the host"
    );
    assert!(root.join("fastbox-volume-test-escaped").is_dir());
    let info = child.mountinfo();
    let rw_opts = options_at(&info, "/fastbox-volume-test-escaped")
        .unwrap_or_else(|| panic!("no mount at the path inside the root:\n{info}"));
    let ro_opts =
        options_at(&info, "/data/ro").unwrap_or_else(|| panic!("no read-only mount:\n{info}"));
    for (opts, read_only) in [(rw_opts, false), (ro_opts, true)] {
        let opts: Vec<&str> = opts.split(',').collect();
        assert!(
            opts.contains(&"nosuid") && opts.contains(&"nodev"),
            "{opts:?}"
        );
        assert_eq!(opts.contains(&"ro"), read_only, "{opts:?}");
    }
    // The child sees the host's file through the mount.
    let seen = std::fs::read_to_string(format!(
        "/proc/{}/root/fastbox-volume-test-escaped/marker",
        child.pid
    ))
    .unwrap();
    assert_eq!(seen, "from the host");
    // Nothing of it shows in the host's namespace.
    let host_info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !host_info.contains("fastbox-volume-test-escaped"),
        "{host_info}"
    );
}

#[test]
fn a_mount_path_across_another_mount_is_refused() {
    let Some((_work, root, source)) = work_dirs("first") else {
        return;
    };
    let child = Pivoted::start(&root);
    let source_dir = Dir::open_root(&source).unwrap();
    let first = DetachedMount::of_dir(source_dir.as_fd(), "/first", false).unwrap();
    let inside = DetachedMount::of_dir(source_dir.as_fd(), "/first/second", false).unwrap();
    let err = attach(child.pid, vec![first, inside]).expect_err("a path across a mount");
    assert!(err.to_string().contains("/first/second"), "{err}");
    assert!(
        !source.join("second").exists(),
        "the refused path was made in the volume"
    );
}
