//! Golden templates published into a local artifact store and materialized again
//! (`fastbox_fastlet::artifact`): what the manifest lists, that the golden token is not
//! published, that re-publishing stores nothing, that the checkpoint comes back byte for byte,
//! and (as root, with erofs-utils) that the published erofs rootfs mounts as the image tree.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::UNIX_EPOCH;

use fastbox_artifact::{
    ArtifactKind, Digest, EntryKind, HostFacts, IndexOutcome, LocalStore, Manifest, ManifestMeta,
    NoProgress, PackFormat, RootfsImage, publish, read_manifest,
};
use fastbox_fastlet::artifact::{
    GOLDEN_TOKEN_LABEL, PublishOptions, TemplateArtifactError, golden_token_sha256,
    materialize_checkpoint, materialize_template, publish_template, unpack_canonical_tar,
};
use fastbox_fastlet::remote_pages::RemotePages;
use fastbox_fastlet::template::{self, Template};
use tempfile::TempDir;

const TOKEN: &str = "9d1c3f0e6a5b4c2d8e7f6a5b4c3d2e1f0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d";
const EXECD_DIGEST: &str = "37f47f8d37d8b9babf6fb8f23006bb33e04689a858bc0fe66e601dbd8b4176c7";
const IMAGE_DIGEST: &str =
    "sha256:4d248edd564abd4150fffb7bc60b4d25a74fe6f5338a0308dd223790172b83a3";
const IMAGE_REFERENCE: &str = "recipe:fake-image";
/// Bigger than one 4 MiB block, so a file spans two.
const PAGES_BYTES: usize = 5 * 1024 * 1024 + 123;

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// A temporary directory named with this suite's run prefix.
fn temp_root() -> TempDir {
    tempfile::Builder::new()
        .prefix(&fastbox_testkit::run_prefix("h"))
        .tempdir()
        .unwrap()
}

fn write(path: &Path, bytes: &[u8], mode: u32) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, bytes).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).unwrap();
}

/// Deterministic bytes that are not all zero.
fn noise(len: usize) -> Vec<u8> {
    let mut state: u32 = 0x1234_5678;
    (0..len)
        .map(|_| {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (state >> 24) as u8
        })
        .collect()
}

/// A template directory as `Fastlet::template` leaves it, with files standing in for the
/// CRIU images, over a small image rootfs. As root the writable layer also holds a whiteout
/// and a file owned by another user.
fn fake_template(root: &Path) -> Template {
    let rootfs = root.join("image/rootfs");
    write(&rootfs.join("bin/sh"), b"#!fake shell\n", 0o755);
    write(&rootfs.join("etc/os-release"), b"ID=fake\n", 0o644);
    write(&rootfs.join("usr/lib/libfake.so"), &noise(70_000), 0o644);
    symlink("usr/lib", rootfs.join("lib")).unwrap();
    fs::create_dir_all(rootfs.join("tmp")).unwrap();
    fs::set_permissions(rootfs.join("tmp"), fs::Permissions::from_mode(0o1777)).unwrap();

    let dir = root.join("data/templates/tpl");
    let checkpoint = dir.join("checkpoint");
    let criu = checkpoint.join("criu");
    write(&criu.join("core-1.img"), &noise(2_561), 0o644);
    write(&criu.join("inventory.img"), b"inventory", 0o644);
    write(&criu.join("pages-1.img"), &noise(PAGES_BYTES), 0o644);
    write(&criu.join("dump.log"), b"(00.000000) dump log\n", 0o600);
    let upper = checkpoint.join("upper");
    write(&upper.join("etc/hostname"), b"tpl-4d248edd564a\n", 0o644);
    write(&upper.join("etc/hosts"), b"127.0.0.1 localhost\n", 0o644);
    fs::create_dir_all(upper.join(".fastbox/execd")).unwrap();
    symlink("/etc/hostname", upper.join("etc/hostname.link")).unwrap();
    if is_root() {
        let whiteout = upper.join("etc/os-release");
        let made = Command::new("mknod")
            .arg(&whiteout)
            .args(["c", "0", "0"])
            .status()
            .unwrap();
        assert!(made.success(), "mknod whiteout");
        let owned = upper.join("home/user/notes");
        write(&owned, b"a user's file\n", 0o600);
        std::os::unix::fs::chown(&owned, Some(1000), Some(1000)).unwrap();
    }
    let meta = serde_json::json!({
        "source_id": "tpl-4d248edd564a-3c8983",
        "execd_digest": EXECD_DIGEST,
        "criu_version": "4.2.1",
    });
    write(
        &checkpoint.join("checkpoint.json"),
        &serde_json::to_vec_pretty(&meta).unwrap(),
        0o644,
    );
    let template = serde_json::json!({
        "key": IMAGE_DIGEST,
        "image_digest": IMAGE_DIGEST,
        "image_reference": IMAGE_REFERENCE,
        "rootfs": rootfs,
        "checkpoint": checkpoint,
        "golden_token": TOKEN,
        "build_ms": 336,
    });
    write(
        &dir.join("template.json"),
        &serde_json::to_vec_pretty(&template).unwrap(),
        0o644,
    );
    template::load(&dir).expect("the fake template loads")
}

/// What a tree holds, for comparisons: kind, permission bits, owner, and contents or target.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, String>) {
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let md = fs::symlink_metadata(&path).unwrap();
            let mode = md.mode() & 0o7777;
            let owner = format!("{}:{}", md.uid(), md.gid());
            let what = if md.is_dir() {
                walk(root, &path, out);
                format!("dir {mode:o} {owner}")
            } else if md.file_type().is_symlink() {
                format!("symlink -> {}", fs::read_link(&path).unwrap().display())
            } else if md.is_file() {
                let hash = Digest::of(&fs::read(&path).unwrap());
                format!("file {mode:o} {owner} {hash}")
            } else {
                format!(
                    "special {:o} {mode:o} {owner} rdev {}",
                    md.mode(),
                    md.rdev()
                )
            };
            out.insert(path.strip_prefix(root).unwrap().to_path_buf(), what);
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// Every file below `dir` whose bytes contain `needle`.
fn files_containing(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
    snapshot(dir)
        .keys()
        .map(|rel| dir.join(rel))
        .filter(|path| path.is_file() && !path.is_symlink())
        .filter(|path| {
            fs::read(path)
                .unwrap()
                .windows(needle.len())
                .any(|w| w == needle)
        })
        .collect()
}

fn file_paths(manifest: &Manifest) -> Vec<&str> {
    manifest
        .files
        .iter()
        .filter(|f| matches!(f.kind, EntryKind::File { .. }))
        .map(|f| f.path.as_str())
        .collect()
}

#[test]
fn a_published_template_omits_its_token_republishes_nothing_and_materializes_back() {
    let root = temp_root();
    let template = fake_template(root.path());
    let store = LocalStore::open(root.path().join("store")).unwrap();
    let work = root.path().join("work");
    fs::create_dir(&work).unwrap();
    let mut opts = PublishOptions::new(IMAGE_REFERENCE, &work);
    opts.labels
        .insert("fastbox.io/template".into(), "fake".into());
    opts.policy = Some(serde_json::json!({"egress": {"defaultAction": "deny"}}));

    let first = publish_template(&store, &template, &opts, &NoProgress).unwrap();
    println!(
        "fake template: published in {:.3} s (pack {:.3} s): {} files, {} blocks ({} new), {} bytes, rootfs {:?} {} bytes",
        first.seconds,
        first.pack_seconds,
        first.stats.files,
        first.stats.blocks,
        first.stats.new_blocks,
        first.stats.bytes,
        first.rootfs_format,
        first.packed_rootfs_bytes
    );
    assert_eq!(first.outcome, IndexOutcome::Created);
    assert_eq!(first.rootfs_format, PackFormat::best_available());

    let manifest = read_manifest(&store, &first.manifest).unwrap();
    let rootfs_file = match first.rootfs_format {
        PackFormat::Erofs => "rootfs.erofs",
        PackFormat::Tar => "rootfs.tar",
    };
    assert_eq!(
        file_paths(&manifest),
        vec![
            "checkpoint/checkpoint.json",
            "checkpoint/criu/core-1.img",
            "checkpoint/criu/inventory.img",
            "checkpoint/criu/pages-1.img",
            "checkpoint/upper.tar",
            rootfs_file,
            "template.json",
        ],
        "CRIU images, the writable layer and the rootfs, without dump.log"
    );
    let meta = &manifest.meta;
    assert_eq!(meta.kind, ArtifactKind::Template);
    assert_eq!(
        meta.rootfs,
        Some(RootfsImage {
            path: rootfs_file.into(),
            format: first.rootfs_format
        })
    );
    assert_eq!(meta.execd_digest.to_hex(), EXECD_DIGEST);
    assert_eq!(meta.host.criu_version.as_deref(), Some("4.2.1"));
    let source = meta.lineage.source.as_ref().unwrap();
    assert_eq!(source.reference, IMAGE_REFERENCE);
    assert_eq!(source.digest.as_deref(), Some(IMAGE_DIGEST));
    assert_eq!(meta.labels["fastbox.io/template"], "fake");
    assert_eq!(meta.labels[GOLDEN_TOKEN_LABEL], golden_token_sha256(TOKEN));
    assert_eq!(meta.policy, opts.policy);
    let dumped = fs::metadata(template.checkpoint.join("checkpoint.json"))
        .unwrap()
        .modified()
        .unwrap()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert_eq!(
        meta.created_at.timestamp() as u64,
        dumped,
        "created_at is the dump's time"
    );

    assert_eq!(
        files_containing(store.root(), TOKEN.as_bytes()),
        Vec::<PathBuf>::new(),
        "the golden token is in no file of the store"
    );
    assert_eq!(
        fs::read_dir(&work).unwrap().count(),
        0,
        "the staging tree is removed"
    );

    let second = publish_template(&store, &template, &opts, &NoProgress).unwrap();
    assert_eq!(
        second.manifest, first.manifest,
        "same template, same manifest"
    );
    assert_eq!(second.outcome, IndexOutcome::AlreadyCurrent);
    assert_eq!(second.stats.new_blocks, 0, "a re-publish stores no block");
    assert_eq!(second.stats.blocks, first.stats.blocks);

    let dest = root.path().join("node/templates/tpl");
    fs::create_dir_all(dest.parent().unwrap()).unwrap();
    let got = materialize_template(&store, &first.manifest, &dest).unwrap();
    println!(
        "fake template: materialized in {:.3} s: {} blocks fetched, {} bytes",
        got.seconds, got.stats.blocks_fetched, got.stats.bytes
    );
    assert_eq!(got.checkpoint, dest.join("checkpoint"));
    assert_eq!(got.rootfs_image, dest.join(rootfs_file));
    assert_eq!(got.rootfs_format, first.rootfs_format);
    assert_eq!(got.execd_digest.to_hex(), EXECD_DIGEST);
    assert_eq!(got.info.image_digest, IMAGE_DIGEST);
    assert_eq!(got.info.build_ms, 336);
    assert!(got.accepts_golden_token(TOKEN));
    assert!(!got.accepts_golden_token("not-the-token"));
    assert_eq!(
        fs::metadata(&got.rootfs_image).unwrap().len(),
        first.packed_rootfs_bytes
    );

    let mut expected = snapshot(&template.checkpoint);
    expected.remove(Path::new("criu/dump.log"));
    assert_eq!(
        snapshot(&got.checkpoint),
        expected,
        "checkpoint.json, the CRIU images and the writable layer (modes, owners, whiteouts) come back"
    );
    assert!(
        template::load(&dest).is_none(),
        "the published template.json is no node template (no token, no paths)"
    );

    let again = materialize_template(&store, &first.manifest, &dest).unwrap_err();
    assert!(
        matches!(again, TemplateArtifactError::DestinationExists(_)),
        "{again}"
    );
}

#[test]
fn a_tar_rootfs_unpacks_to_the_image_tree() {
    let root = temp_root();
    let template = fake_template(root.path());
    let store = LocalStore::open(root.path().join("store")).unwrap();
    let mut opts = PublishOptions::new(IMAGE_REFERENCE, root.path());
    opts.rootfs_format = PackFormat::Tar;
    let published = publish_template(&store, &template, &opts, &NoProgress).unwrap();
    assert_eq!(published.rootfs_format, PackFormat::Tar);

    let got = materialize_template(&store, &published.manifest, &root.path().join("m")).unwrap();
    assert_eq!(got.rootfs_image, root.path().join("m/rootfs.tar"));
    let unpacked = root.path().join("unpacked");
    unpack_canonical_tar(&got.rootfs_image, &unpacked).unwrap();
    assert_eq!(snapshot(&unpacked), snapshot(&template.rootfs));
}

/// Unmounts on drop, so a failed assertion leaves no mount behind.
struct Mounted(PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

fn erofs_unavailable() -> Option<String> {
    if let Some(reason) = fastbox_testkit::privileged_unavailable() {
        return Some(reason);
    }
    if PackFormat::best_available() != PackFormat::Erofs {
        return Some("mkfs.erofs is not installed (erofs-utils)".into());
    }
    let filesystems = fs::read_to_string("/proc/filesystems").unwrap_or_default();
    if !filesystems.lines().any(|l| l.trim_end().ends_with("erofs")) {
        return Some("the kernel lists no erofs in /proc/filesystems".into());
    }
    None
}

#[test]
fn an_erofs_rootfs_mounts_as_the_image_tree() {
    fastbox_testkit::skip_unless!(erofs_unavailable());
    let root = temp_root();
    let template = fake_template(root.path());
    let store = LocalStore::open(root.path().join("store")).unwrap();
    let mut opts = PublishOptions::new(IMAGE_REFERENCE, root.path());
    opts.rootfs_format = PackFormat::Erofs;
    let published = publish_template(&store, &template, &opts, &NoProgress).unwrap();
    let got = materialize_template(&store, &published.manifest, &root.path().join("m")).unwrap();
    assert_eq!(got.rootfs_format, PackFormat::Erofs);
    assert_eq!(got.rootfs_image, root.path().join("m/rootfs.erofs"));

    let mountpoint = root.path().join("lower");
    fs::create_dir(&mountpoint).unwrap();
    let status = Command::new("mount")
        .args(["-t", "erofs", "-o", "loop,ro"])
        .arg(&got.rootfs_image)
        .arg(&mountpoint)
        .status()
        .unwrap();
    assert!(status.success(), "mount the materialized erofs image");
    let mounted = Mounted(mountpoint);
    assert_eq!(snapshot(&mounted.0), snapshot(&template.rootfs));
}

#[test]
fn a_template_made_on_a_host_with_other_cpu_features_is_refused() {
    let root = temp_root();
    let store = LocalStore::open(root.path().join("store")).unwrap();
    let tree = root.path().join("tree");
    write(&tree.join("rootfs.tar"), b"not really a tar", 0o644);
    let mut host = HostFacts::detect(Some("4.2.1".into())).unwrap();
    host.cpu_features.push("fastbox-test-feature".into());
    let execd = EXECD_DIGEST.parse().unwrap();
    let mut meta = ManifestMeta::new(ArtifactKind::Template, execd, host);
    meta.rootfs = Some(RootfsImage {
        path: "rootfs.tar".into(),
        format: PackFormat::Tar,
    });
    let snapshot_meta = ManifestMeta {
        kind: ArtifactKind::Snapshot,
        ..meta.clone()
    };
    let foreign = publish(&store, &tree, meta, &NoProgress).unwrap();
    let dest = root.path().join("m");

    let err = materialize_template(&store, &foreign.manifest, &dest).unwrap_err();
    match &err {
        TemplateArtifactError::HostMismatch { blockers, .. } => {
            assert_eq!(
                blockers,
                &vec!["cpu features missing on the target: fastbox-test-feature".to_string()]
            );
        }
        other => panic!("expected a host mismatch, got {other}"),
    }
    assert!(err.to_string().contains("cannot be restored on this host"));
    assert!(!dest.exists(), "nothing is materialized");

    let snapshot = publish(&store, &tree, snapshot_meta, &NoProgress).unwrap();
    let err = materialize_template(&store, &snapshot.manifest, &dest).unwrap_err();
    assert!(
        matches!(err, TemplateArtifactError::NotATemplate { .. }),
        "{err}"
    );
}

/// A pause checkpoint's tree as a node publishes it (kind `checkpoint`): a tar rootfs, an
/// empty writable layer, CRIU images with a pages image of two blocks; and `extra` files.
fn published_checkpoint(root: &Path, store: &LocalStore, extra: &[&str]) -> Digest {
    let tree = root.join("tree");
    let empty = root.join("empty");
    fs::create_dir_all(&empty).unwrap();
    fs::create_dir_all(tree.join("checkpoint")).unwrap();
    for tar in ["rootfs.tar", "checkpoint/upper.tar"] {
        let made = Command::new("tar")
            .arg("-cf")
            .arg(tree.join(tar))
            .arg("-C")
            .arg(&empty)
            .arg(".")
            .status()
            .unwrap();
        assert!(made.success());
    }
    let info = serde_json::json!({
        "image_digest": IMAGE_DIGEST, "image_reference": IMAGE_REFERENCE, "build_ms": 1,
    });
    write(
        &tree.join("template.json"),
        info.to_string().as_bytes(),
        0o644,
    );
    write(
        &tree.join("checkpoint/criu/core-1.img"),
        &noise(2_561),
        0o644,
    );
    write(
        &tree.join("checkpoint/criu/pagemap-1.img"),
        b"pagemap",
        0o644,
    );
    write(
        &tree.join("checkpoint/criu/pages-1.img"),
        &noise(PAGES_BYTES),
        0o644,
    );
    for path in extra {
        write(&tree.join(path), b"{}", 0o644);
    }
    let execd = EXECD_DIGEST.parse().unwrap();
    let host = HostFacts::detect(None).unwrap();
    let mut meta = ManifestMeta::new(ArtifactKind::Checkpoint, execd, host);
    meta.rootfs = Some(RootfsImage {
        path: "rootfs.tar".into(),
        format: PackFormat::Tar,
    });
    publish(store, &tree, meta, &NoProgress).unwrap().manifest
}

#[test]
fn a_checkpoint_for_a_resume_leaves_its_pages_images_in_the_store() {
    let root = temp_root();
    let store = LocalStore::open(root.path().join("store")).unwrap();
    let manifest = published_checkpoint(root.path(), &store, &[]);

    let whole =
        materialize_checkpoint(&store, &manifest, &root.path().join("whole"), false).unwrap();
    assert_eq!(
        fs::read(whole.checkpoint.join("criu/pages-1.img"))
            .unwrap()
            .len(),
        PAGES_BYTES
    );
    assert_eq!(RemotePages::read(&whole.checkpoint), None);

    let lazy = materialize_checkpoint(&store, &manifest, &root.path().join("lazy"), true).unwrap();
    assert!(!lazy.checkpoint.join("criu/pages-1.img").exists());
    assert!(lazy.checkpoint.join("criu/pagemap-1.img").exists());
    let remote = RemotePages::read(&lazy.checkpoint).expect("the list of remote pages images");
    assert_eq!(remote, lazy.remote_pages);
    assert_eq!(remote.files.len(), 1);
    assert_eq!(remote.files["pages-1.img"].size, PAGES_BYTES as u64);
    assert_eq!(remote.files["pages-1.img"].blocks.len(), 2);
    assert!(lazy.stats.bytes < whole.stats.bytes - PAGES_BYTES as u64 + 1);
}

#[test]
fn a_published_checkpoint_carrying_a_remote_pages_list_is_refused() {
    // The list is the node's own record of what is not local; one from the store would name
    // the files a restore creates.
    let root = temp_root();
    let store = LocalStore::open(root.path().join("store")).unwrap();
    let manifest = published_checkpoint(root.path(), &store, &["checkpoint/remote-pages.json"]);
    let dest = root.path().join("m");
    let err = materialize_checkpoint(&store, &manifest, &dest, true).unwrap_err();
    assert!(
        matches!(err, TemplateArtifactError::NotATemplate { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("remote-pages.json"), "{err}");
    assert!(!dest.exists());
}

#[test]
fn a_published_checkpoint_with_a_symlink_among_its_criu_images_is_refused() {
    // CRIU would read the host file it names, as root.
    let root = temp_root();
    let store = LocalStore::open(root.path().join("store")).unwrap();
    let tree = root.path().join("tree");
    fs::create_dir_all(tree.join("checkpoint/criu")).unwrap();
    symlink("/etc/shadow", tree.join("checkpoint/criu/pages-2.img")).unwrap();
    let manifest = published_checkpoint(root.path(), &store, &[]);
    refused_with_and_without_pages(&store, &manifest, root.path());
}

#[test]
fn a_published_checkpoint_whose_criu_directory_is_a_symlink_is_refused() {
    // A lazy restore would create the pages images wherever it points.
    let root = temp_root();
    let store = LocalStore::open(root.path().join("store")).unwrap();
    let tree = root.path().join("tree");
    fs::create_dir_all(tree.join("checkpoint")).unwrap();
    symlink("/etc", tree.join("checkpoint/criu")).unwrap();
    let execd = EXECD_DIGEST.parse().unwrap();
    let mut meta = ManifestMeta::new(
        ArtifactKind::Checkpoint,
        execd,
        HostFacts::detect(None).unwrap(),
    );
    write(&tree.join("rootfs.tar"), b"not really a tar", 0o644);
    meta.rootfs = Some(RootfsImage {
        path: "rootfs.tar".into(),
        format: PackFormat::Tar,
    });
    let manifest = publish(&store, &tree, meta, &NoProgress).unwrap().manifest;
    refused_with_and_without_pages(&store, &manifest, root.path());
}

/// `manifest` is refused, pages left out or not, and nothing is materialized.
fn refused_with_and_without_pages(store: &LocalStore, manifest: &Digest, root: &Path) {
    for leave_pages in [false, true] {
        let dest = root.join(format!("m-{leave_pages}"));
        let err = materialize_checkpoint(store, manifest, &dest, leave_pages).unwrap_err();
        assert!(
            matches!(err, TemplateArtifactError::NotATemplate { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("symlink"), "{err}");
        assert!(!dest.exists());
    }
}

/// Publishes a template directory built by a real `fastbox up` (read-only: its checkpoint is
/// copied first), prints the figures, and reports where the golden token occurs in the store.
#[test]
#[ignore = "measurement: FASTBOX_TEMPLATE_DIR=<DATA_DIR/templates/<key>>, as root"]
fn measure_publishing_a_real_template() {
    let dir =
        PathBuf::from(std::env::var_os("FASTBOX_TEMPLATE_DIR").expect("FASTBOX_TEMPLATE_DIR"));
    let mut template = template::load(&dir).expect("a finished template");
    let root = temp_root();
    let copy = root.path().join("checkpoint");
    let copied = Command::new("cp")
        .arg("-a")
        .arg(&template.checkpoint)
        .arg(&copy)
        .status()
        .unwrap();
    assert!(copied.success());
    template.checkpoint = copy;
    let store = LocalStore::open(root.path().join("store")).unwrap();
    let opts = PublishOptions::new(&template.image_reference, root.path());

    let first = publish_template(&store, &template, &opts, &NoProgress).unwrap();
    println!(
        "{}: published in {:.3} s (pack {:.3} s, {:?} {} bytes): {} files, {} blocks ({} new), {} bytes ({} new)",
        template.image_reference,
        first.seconds,
        first.pack_seconds,
        first.rootfs_format,
        first.packed_rootfs_bytes,
        first.stats.files,
        first.stats.blocks,
        first.stats.new_blocks,
        first.stats.bytes,
        first.stats.new_bytes
    );
    let second = publish_template(&store, &template, &opts, &NoProgress).unwrap();
    println!(
        "re-published in {:.3} s: {:?}, {} new blocks",
        second.seconds, second.outcome, second.stats.new_blocks
    );
    assert_eq!(second.manifest, first.manifest);
    assert_eq!(second.stats.new_blocks, 0);

    let got = materialize_template(&store, &first.manifest, &root.path().join("m")).unwrap();
    println!(
        "materialized in {:.3} s: {} blocks fetched, {} zero blocks, {} bytes",
        got.seconds, got.stats.blocks_fetched, got.stats.zero_blocks, got.stats.bytes
    );
    let mut expected = snapshot(&template.checkpoint);
    expected.retain(|path, _| !path.to_string_lossy().ends_with(".log"));
    assert_eq!(snapshot(&got.checkpoint), expected);
    let holders = files_containing(store.root(), template.golden_token.as_bytes());
    println!(
        "store files holding the golden token in plain text: {}",
        holders.len()
    );
    for path in holders {
        println!("  {}", path.display());
    }
}
