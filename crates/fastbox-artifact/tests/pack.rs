//! Rootfs packing: reproducible erofs and tar images, and an erofs image the kernel mounts.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime};

use fastbox_artifact::{
    ArtifactKind, LocalStore, NoProgress, PackError, PackFormat, RootfsImage, materialize,
    pack_rootfs, publish,
};
use fastbox_testkit::skip_unless;

use common::{bytes, dir, file, meta, symlink, temp_dir};

/// Build the same rootfs at `root`, creating entries in forward or reverse order and with
/// different timestamps, so only the content is common.
fn rootfs(root: &Path, reverse: bool) {
    let mut dirs = vec![
        ("etc", 0o755),
        ("usr", 0o755),
        ("tmp", 0o1777),
        ("var", 0o755),
    ];
    let mut files: Vec<(&str, Vec<u8>, u32)> = vec![
        ("etc/hostname", b"sandbox\n".to_vec(), 0o644),
        ("etc/shadow", b"root:*:19000::::::\n".to_vec(), 0o640),
        ("usr/su", b"\x7fELF pretend".to_vec(), 0o4755),
        ("var/big", bytes("big", 300_000), 0o644),
        ("var/empty", Vec::new(), 0o644),
    ];
    let mut links = vec![("bin", "usr"), ("etc/localtime", "/usr/share/zoneinfo/UTC")];
    if reverse {
        dirs.reverse();
        files.reverse();
        links.reverse();
    }
    for (path, mode) in dirs {
        dir(root, path, mode);
    }
    for (path, content, mode) in files {
        file(root, path, &content, mode);
    }
    for (path, target) in links {
        symlink(root, path, target);
    }
    fs::hard_link(root.join("usr/su"), root.join("usr/su-link")).unwrap();
    let fifo_mode = nix::sys::stat::Mode::from_bits_truncate(0o600);
    nix::unistd::mkfifo(&root.join("var/fifo"), fifo_mode).unwrap();
    // Timestamps must not matter.
    let when = SystemTime::now() - Duration::from_secs(if reverse { 86_400 } else { 7 });
    for path in ["etc/hostname", "var/big", "usr"] {
        let f = fs::File::open(root.join(path)).unwrap();
        f.set_modified(when).unwrap();
    }
}

fn erofs_missing() -> Option<String> {
    match Command::new("mkfs.erofs").arg("--help").output() {
        Ok(_) => None,
        Err(_) => Some("mkfs.erofs is not installed (Debian: erofs-utils)".into()),
    }
}

/// Pack two independently built copies of one rootfs; return both images.
fn pack_twice(format: PackFormat) -> (Vec<u8>, Vec<u8>, tempfile::TempDir) {
    let (a, b, out) = (temp_dir(), temp_dir(), temp_dir());
    rootfs(a.path(), false);
    rootfs(b.path(), true);
    let (img_a, img_b) = (out.path().join("a.img"), out.path().join("b.img"));
    let packed = pack_rootfs(a.path(), &img_a, format).unwrap();
    assert_eq!(packed.format, format);
    assert_eq!(packed.bytes, fs::metadata(&img_a).unwrap().len());
    pack_rootfs(b.path(), &img_b, format).unwrap();
    (fs::read(img_a).unwrap(), fs::read(img_b).unwrap(), out)
}

#[test]
fn tar_packing_is_reproducible() {
    let (a, b, _out) = pack_twice(PackFormat::Tar);
    assert!(
        a == b,
        "the same tree packed twice gives different tar bytes"
    );
}

#[test]
fn canonical_tar_has_sorted_entries_zero_mtimes_and_no_owner_names() {
    let (a, _, _out) = pack_twice(PackFormat::Tar);
    let mut archive = tar::Archive::new(&a[..]);
    let mut paths = Vec::new();
    for entry in archive.entries().unwrap() {
        let entry = entry.unwrap();
        let header = entry.header();
        assert_eq!(header.mtime().unwrap(), 0);
        assert_eq!(header.username().unwrap(), Some(""));
        assert_eq!(header.groupname().unwrap(), Some(""));
        let path = entry.path().unwrap().to_string_lossy().into_owned();
        match path.as_str() {
            "usr/su" => assert_eq!(header.mode().unwrap(), 0o4755),
            "tmp" => assert_eq!(header.mode().unwrap(), 0o1777),
            "usr/su-link" => {
                assert_eq!(header.entry_type(), tar::EntryType::Link);
                assert_eq!(entry.link_name().unwrap().unwrap(), Path::new("usr/su"));
            }
            "var/fifo" => assert_eq!(header.entry_type(), tar::EntryType::Fifo),
            _ => {}
        }
        paths.push(path);
    }
    let mut sorted = paths.clone();
    sorted.sort_by(|x, y| fastbox_artifact::tree_order(x, y));
    assert_eq!(paths, sorted);
    assert_eq!(paths.len(), 13);
}

#[test]
fn erofs_packing_is_reproducible() {
    skip_unless!(erofs_missing());
    let (a, b, _out) = pack_twice(PackFormat::Erofs);
    assert!(
        a == b,
        "the same tree packed twice gives different erofs bytes"
    );
}

#[test]
fn output_inside_the_rootfs_is_refused() {
    let root = temp_dir();
    rootfs(root.path(), false);
    assert!(matches!(
        pack_rootfs(
            root.path(),
            &root.path().join("var/self.tar"),
            PackFormat::Tar
        ),
        Err(PackError::OutputInsideRootfs { .. })
    ));
}

/// Unmounts on drop, so a failed assertion does not leave the mount behind.
struct Mounted(PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let status = Command::new("umount").arg(&self.0).status();
        if !matches!(status, Ok(s) if s.success()) {
            eprintln!("umount {} failed: {status:?}", self.0.display());
        }
    }
}

fn erofs_mount_unavailable() -> Option<String> {
    if let Some(reason) = fastbox_testkit::privileged_unavailable() {
        return Some(format!("mounting erofs {reason}"));
    }
    if let Some(reason) = erofs_missing() {
        return Some(reason);
    }
    let filesystems = fs::read_to_string("/proc/filesystems").unwrap_or_default();
    if !filesystems.contains("erofs") {
        let _ = Command::new("modprobe").arg("erofs").status();
        let filesystems = fs::read_to_string("/proc/filesystems").unwrap_or_default();
        if !filesystems.contains("erofs") {
            return Some("the kernel has no erofs support".into());
        }
    }
    None
}

#[test]
fn an_erofs_image_mounts_read_only_and_shows_the_files() {
    skip_unless!(erofs_mount_unavailable());
    let (root, work) = (temp_dir(), temp_dir());
    rootfs(root.path(), false);
    let image = work.path().join("rootfs.erofs");
    pack_rootfs(root.path(), &image, PackFormat::Erofs).unwrap();
    let mountpoint = work.path().join("mnt");
    fs::create_dir(&mountpoint).unwrap();
    let status = Command::new("mount")
        .args(["-t", "erofs", "-o", "loop,ro"])
        .arg(&image)
        .arg(&mountpoint)
        .status()
        .unwrap();
    assert!(status.success(), "mount failed: {status}");
    let mounted = Mounted(mountpoint.clone());

    assert_eq!(
        fs::read(mountpoint.join("etc/hostname")).unwrap(),
        b"sandbox\n"
    );
    assert_eq!(
        fs::read(mountpoint.join("var/big")).unwrap(),
        bytes("big", 300_000)
    );
    assert_eq!(
        fs::read_link(mountpoint.join("bin")).unwrap(),
        Path::new("usr")
    );
    use std::os::unix::fs::MetadataExt;
    let su = fs::metadata(mountpoint.join("usr/su")).unwrap();
    assert_eq!(su.mode() & 0o7777, 0o4755);
    assert_eq!(su.nlink(), 2, "the hard link is kept");
    let write = fs::write(mountpoint.join("etc/new"), b"x").unwrap_err();
    assert_eq!(write.raw_os_error(), Some(nix::libc::EROFS));
    drop(mounted);
    assert!(!mountpoint.join("etc").exists(), "unmounted");
}

#[test]
fn a_packed_rootfs_travels_through_the_store_unchanged() {
    let format = PackFormat::best_available();
    let (root, artifact, store_dir, out) = (temp_dir(), temp_dir(), temp_dir(), temp_dir());
    rootfs(root.path(), false);
    let name = match format {
        PackFormat::Erofs => "rootfs.erofs",
        PackFormat::Tar => "rootfs.tar",
    };
    pack_rootfs(root.path(), &artifact.path().join(name), format).unwrap();
    dir(artifact.path(), "checkpoint", 0o700);
    file(
        artifact.path(),
        "checkpoint/pages-1.img",
        &bytes("pages", 5_000_000),
        0o600,
    );

    let store = LocalStore::open(store_dir.path()).unwrap();
    let mut meta = meta();
    meta.kind = ArtifactKind::Checkpoint;
    meta.rootfs = Some(RootfsImage {
        path: name.into(),
        format,
    });
    let published = publish(&store, artifact.path(), meta, &NoProgress).unwrap();
    let dest = out.path().join("restored");
    materialize(&store, &published.manifest, &dest).unwrap();
    assert_eq!(
        fs::read(dest.join(name)).unwrap(),
        fs::read(artifact.path().join(name)).unwrap()
    );
    let manifest = fastbox_artifact::read_manifest(&store, &published.manifest).unwrap();
    assert_eq!(manifest.meta.rootfs.unwrap().format, format);
}
