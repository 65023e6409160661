//! Helpers shared by the integration tests: temporary directories with the run prefix,
//! deterministic content, tree building and comparison, and a store that fails on demand.

#![allow(dead_code)]

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use fastbox_artifact::{
    ArtifactKind, ArtifactStore, Digest, HostFacts, LocalStore, ManifestMeta, StoreError, Stored,
};

/// This suite's tag in `fastbox_testkit::run_prefix` (see its docs for the letters in use).
pub const TAG: &str = "g";

/// A temporary directory named with the run prefix (`FASTBOX_TEST_PREFIX` + tag).
pub fn temp_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("{}-", fastbox_testkit::run_prefix(TAG)))
        .tempdir()
        .expect("create a temporary directory")
}

/// `len` pseudo-random bytes determined by `seed`.
pub fn bytes(seed: &str, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    blake3::Hasher::new()
        .update(seed.as_bytes())
        .finalize_xof()
        .fill(&mut out);
    out
}

/// Fixed metadata, so identical trees give identical manifests.
pub fn meta() -> ManifestMeta {
    let mut meta = ManifestMeta::new(
        ArtifactKind::Template,
        Digest::of(b"execd"),
        HostFacts {
            kernel: "6.1.0-test".into(),
            criu_version: Some("4.2.1".into()),
            arch: "x86_64".into(),
            cpu_features: vec!["sse2".into()],
        },
    );
    meta.created_at = chrono::DateTime::from_timestamp(1_700_000_000, 0).unwrap();
    meta
}

/// Write a file and set its mode exactly (the umask does not apply).
pub fn file(root: &Path, path: &str, content: &[u8], mode: u32) {
    let path = root.join(path);
    fs::write(&path, content).unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
}

/// Create a directory and set its mode exactly.
pub fn dir(root: &Path, path: &str, mode: u32) {
    let path = root.join(path);
    fs::create_dir(&path).unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
}

/// Create a symlink.
pub fn symlink(root: &Path, path: &str, target: &str) {
    std::os::unix::fs::symlink(target, root.join(path)).unwrap();
}

/// What a tree holds, for comparison: path, kind, mode, content or target.
#[derive(Debug, PartialEq, Eq)]
pub struct Node {
    pub path: String,
    pub kind: &'static str,
    pub mode: u32,
    pub content: Vec<u8>,
}

/// Every entry below `root`, sorted by path.
pub fn snapshot(root: &Path) -> Vec<Node> {
    let mut nodes = Vec::new();
    collect(root, root, &mut nodes);
    nodes.sort_by(|a, b| a.path.cmp(&b.path));
    nodes
}

fn collect(root: &Path, dir: &Path, out: &mut Vec<Node>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let md = fs::symlink_metadata(&path).unwrap();
        let relative = path
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let (kind, content) = if md.is_symlink() {
            let target = fs::read_link(&path).unwrap();
            ("symlink", target.into_os_string().into_encoded_bytes())
        } else if md.is_dir() {
            ("dir", Vec::new())
        } else {
            ("file", fs::read(&path).unwrap())
        };
        let mode = if md.is_symlink() {
            0
        } else {
            md.mode() & 0o7777
        };
        out.push(Node {
            path: relative,
            kind,
            mode,
            content,
        });
        if md.is_dir() {
            collect(root, &path, out);
        }
    }
}

/// A local store whose `put_block` fails after `blocks_ok` successful calls, and whose
/// `put_manifest` fails when `fail_manifest` is set: a publish interrupted midway.
pub struct FaultyStore {
    pub inner: LocalStore,
    pub blocks_ok: usize,
    pub fail_manifest: bool,
    puts: AtomicUsize,
}

impl FaultyStore {
    pub fn new(inner: LocalStore, blocks_ok: usize, fail_manifest: bool) -> Self {
        FaultyStore {
            inner,
            blocks_ok,
            fail_manifest,
            puts: AtomicUsize::new(0),
        }
    }

    fn injected(what: &str) -> StoreError {
        StoreError::Io {
            op: "put",
            location: what.to_string(),
            source: std::io::Error::other("injected failure"),
        }
    }
}

impl ArtifactStore for FaultyStore {
    fn put_block(&self, digest: &Digest, bytes: &[u8]) -> Result<Stored, StoreError> {
        if self.puts.fetch_add(1, Ordering::SeqCst) >= self.blocks_ok {
            return Err(Self::injected("block"));
        }
        self.inner.put_block(digest, bytes)
    }
    fn put_manifest(&self, bytes: &[u8]) -> Result<(Digest, Stored), StoreError> {
        if self.fail_manifest {
            return Err(Self::injected("manifest"));
        }
        self.inner.put_manifest(bytes)
    }
    fastbox_artifact::forward_store!(
        inner;
        get_block,
        has_block,
        delete_block,
        list_blocks,
        get_manifest,
        has_manifest,
        delete_manifest,
        list_manifests,
        index,
    );
}

/// The digests of every stored block, sorted.
pub fn stored_blocks(store: &dyn ArtifactStore) -> Vec<Digest> {
    let mut blocks: Vec<_> = store
        .list_blocks()
        .unwrap()
        .into_iter()
        .map(|o| o.digest)
        .collect();
    blocks.sort();
    blocks
}

/// Names in `dir` that start with `.` (staging leftovers).
pub fn hidden_entries(dir: &Path) -> Vec<PathBuf> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with('.'))
        .collect()
}
