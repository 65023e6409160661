//! The private directory on a real file system: what a local user could plant there is
//! refused and never followed, and a clean start makes it 0700 on its own tmpfs.

use super::*;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};

/// A data directory and a probe directory beside it (outside), whose listing is taken; an
/// instance prefix of its own per test (tag `7`).
struct Scene {
    _tmp: tempfile::TempDir,
    data: PathBuf,
    probe: PathBuf,
    before: Vec<String>,
    prefix: String,
}

impl Scene {
    fn new(test: &str) -> Scene {
        let tmp = tempfile::tempdir().unwrap();
        let data = tmp.path().join("data");
        let probe = tmp.path().join("probe");
        fs::create_dir(&data).unwrap();
        fs::set_permissions(&data, fs::Permissions::from_mode(0o700)).unwrap();
        fs::create_dir_all(probe.join("sub")).unwrap();
        fs::write(probe.join("image.img"), "the probe's own bytes").unwrap();
        fs::write(probe.join("sub/file"), "more").unwrap();
        let before = listing(&probe);
        Scene {
            _tmp: tmp,
            data,
            probe,
            before,
            prefix: format!("{}{test}", fastbox_testkit::run_prefix("7")),
        }
    }

    fn run(&self) -> PathBuf {
        self.data.join(RUN_DIR)
    }

    fn assert_probe_untouched(&self) {
        assert_eq!(
            listing(&self.probe),
            self.before,
            "the probe directory changed"
        );
    }

    /// Mount points of this scene's tmpfs, by source.
    fn our_mounts(&self) -> Vec<String> {
        let source = mount_source(&self.prefix);
        mounts()
            .into_iter()
            .filter(|(_, _, s)| *s == source)
            .map(|(point, _, _)| point)
            .collect()
    }

    fn assert_no_mount(&self) {
        assert_eq!(self.our_mounts(), Vec::<String>::new(), "a mount was left");
        let probe = self.probe.display().to_string();
        assert!(
            !mounts()
                .iter()
                .any(|(point, _, _)| point.starts_with(&probe)),
            "something was mounted on the probe"
        );
    }
}

impl Drop for Scene {
    fn drop(&mut self) {
        purge(&self.prefix, &self.data);
    }
}

/// Names, types, modes, owners and contents of everything under `dir`.
fn listing(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(p) = stack.pop() {
        let m = fs::symlink_metadata(&p).unwrap();
        let content = if m.is_file() {
            fs::read_to_string(&p).unwrap()
        } else {
            String::new()
        };
        out.push(format!(
            "{} {:o} {}:{} {content}",
            p.display(),
            m.mode(),
            m.uid(),
            m.gid()
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

macro_rules! skip_unless_root {
    () => {
        fastbox_testkit::skip_unless!(fastbox_testkit::privileged_unavailable());
    };
}

#[test]
fn a_symlink_planted_at_the_private_directory_is_refused() {
    skip_unless_root!();
    let s = Scene::new("a");
    symlink(&s.probe, s.run()).unwrap();
    let e = Staging::open(&s.data, &s.prefix).expect_err("opened through a symlink");
    assert!(matches!(e, StagingError::NotADirectory { .. }), "{e}");
    assert!(e.to_string().contains("symbolic link"), "{e}");
    assert!(
        e.to_string().contains(&s.run().display().to_string()),
        "{e}"
    );
    s.assert_no_mount();
    s.assert_probe_untouched();
}

/// A tmpfs a crashed run left (reused), holding a symlink at the staging path.
#[test]
fn a_symlink_planted_at_the_staging_path_is_refused() {
    skip_unless_root!();
    let s = Scene::new("b");
    fs::create_dir(s.run()).unwrap();
    mount(
        Some(mount_source(&s.prefix).as_str()),
        &s.run(),
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=0700"),
    )
    .unwrap();
    symlink(&s.probe, s.run().join(STAGING_DIR)).unwrap();
    let e = Staging::open(&s.data, &s.prefix).expect_err("opened through a symlink");
    assert!(matches!(e, StagingError::NotADirectory { .. }), "{e}");
    assert!(
        e.to_string().contains(&root(&s.data).display().to_string()),
        "{e}"
    );
    s.assert_probe_untouched();
    // The purge removes the tmpfs and the symlink, never what it points at.
    purge(&s.prefix, &s.data);
    s.assert_no_mount();
    assert!(fs::symlink_metadata(s.run()).is_err());
    s.assert_probe_untouched();
}

#[test]
fn a_private_directory_writable_by_others_is_refused() {
    skip_unless_root!();
    let s = Scene::new("c");
    fs::create_dir(s.run()).unwrap();
    fs::set_permissions(s.run(), fs::Permissions::from_mode(0o777)).unwrap();
    let e = Staging::open(&s.data, &s.prefix).expect_err("opened a directory others write");
    assert!(matches!(e, StagingError::Mode { mode: 0o777, .. }), "{e}");
    s.assert_no_mount();
    assert_eq!(
        fs::symlink_metadata(s.run()).unwrap().mode() & 0o7777,
        0o777,
        "the directory was repaired instead of refused"
    );
}

#[test]
fn a_private_directory_of_another_user_is_refused() {
    skip_unless_root!();
    let s = Scene::new("d");
    fs::create_dir(s.run()).unwrap();
    fs::set_permissions(s.run(), fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::chown(s.run(), Some(65534), Some(65534)).unwrap();
    let e = Staging::open(&s.data, &s.prefix).expect_err("opened another user's directory");
    assert!(matches!(e, StagingError::Owner { uid: 65534, .. }), "{e}");
    s.assert_no_mount();
}

#[test]
fn a_data_directory_writable_by_others_is_refused() {
    skip_unless_root!();
    let s = Scene::new("e");
    fs::set_permissions(&s.data, fs::Permissions::from_mode(0o777)).unwrap();
    let e = Staging::open(&s.data, &s.prefix).expect_err("used a data directory others write");
    assert!(matches!(e, StagingError::Mode { .. }), "{e}");
    s.assert_no_mount();
}

#[test]
fn the_private_directory_is_made_0700_on_a_tmpfs_of_its_own() {
    skip_unless_root!();
    let s = Scene::new("f");
    let staging = Staging::open(&s.data, &s.prefix).unwrap();
    assert!(staging.is_mounted());
    for dir in [s.run(), root(&s.data), s.run().join(CRIU_RUN_DIR)] {
        let m = fs::symlink_metadata(&dir).unwrap();
        assert!(m.is_dir(), "{}", dir.display());
        assert_eq!(m.mode() & 0o7777, 0o700, "{}", dir.display());
        assert_eq!(m.uid(), 0, "{}", dir.display());
        let fs_type = nix::sys::statfs::statfs(&dir).unwrap().filesystem_type();
        assert_eq!(fs_type, nix::sys::statfs::TMPFS_MAGIC, "{}", dir.display());
    }
    assert_eq!(staging.dir("snap"), root(&s.data).join("snap"));
    assert_eq!(s.our_mounts(), vec![s.run().display().to_string()]);
    // Listed as a leftover although its path does not carry the prefix.
    assert!(!s.run().display().to_string().contains(&s.prefix));
    assert_eq!(
        leftover_mounts(&s.prefix),
        vec![s.run().display().to_string()]
    );
    // A second start (a crash left the mount) reuses it.
    fs::create_dir(staging.dir("left-by-a-crash")).unwrap();
    let again = Staging::open(&s.data, &s.prefix).unwrap();
    assert_eq!(s.our_mounts().len(), 1);
    assert_eq!(again.purge_entries(), 1);
    again.unmount();
    s.assert_no_mount();
    assert!(leftover_mounts(&s.prefix).is_empty());
    assert!(
        fs::symlink_metadata(s.run()).is_err(),
        "the directory stays"
    );
}

#[test]
fn purge_removes_the_tmpfs_of_a_stopped_instance() {
    skip_unless_root!();
    let s = Scene::new("g");
    let staging = Staging::open(&s.data, &s.prefix).unwrap();
    fs::write(staging.dir("staged-image"), "bytes").unwrap();
    drop(staging);
    assert_eq!(s.our_mounts().len(), 1);
    purge(&s.prefix, &s.data);
    s.assert_no_mount();
    assert!(fs::symlink_metadata(s.run()).is_err());
}

#[test]
fn mountinfo_fields_are_unescaped() {
    assert_eq!(unescape(r"/a\040b\011c\134d"), "/a b\tc\\d");
    assert_eq!(unescape(r"/trailing\04"), r"/trailing\04");
    assert_eq!(unescape("plain"), "plain");
}
