//! Rebuilding an artifact's tree from a block source with parallel fetches, leaving chosen
//! files out: the full pull (every file) and the lazy restore's pull (all but the pages
//! images) of the benchmark.
//!
//! `fastbox_artifact::materialize` fetches one block at a time; both modes here fetch with
//! the same `--fetch-workers` threads instead, through the runtime's [`LazyFile`] (a file
//! created at its size and filled block by block), so the modes differ only in what they
//! fetch before the restore. Directories and symlinks are made as the manifest lists them
//! (tree order: a parent before its contents); files get their permission bits once written.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use fastbox_artifact::{BLOCK_SIZE, EntryKind, Manifest};
use fastbox_runtime::lazy::blocks::{BlockSource, LazyFile, prefetch_files};
use fastbox_runtime::lazy::restore::RemoteFile;

/// Rebuilds `manifest`'s tree at `dest` (created; it must not exist) from `source` with
/// `workers` fetching threads, except the files whose path `leave_out` accepts: those are
/// returned, by path, for a lazy restore.
pub fn pull(
    manifest: &Manifest,
    dest: &Path,
    source: &Arc<dyn BlockSource>,
    workers: usize,
    leave_out: impl Fn(&str) -> bool,
) -> anyhow::Result<BTreeMap<String, RemoteFile>> {
    fs::create_dir(dest).with_context(|| format!("create {}", dest.display()))?;
    let mut left_out = BTreeMap::new();
    let mut files = Vec::new();
    let mut modes = Vec::new();
    for entry in &manifest.files {
        let path = dest.join(&entry.path);
        match &entry.kind {
            EntryKind::Dir => {
                fs::create_dir(&path).with_context(|| format!("create {}", path.display()))?;
                modes.push((path, entry.mode));
            }
            EntryKind::Symlink { target } => std::os::unix::fs::symlink(target, &path)
                .with_context(|| format!("create {}", path.display()))?,
            EntryKind::File { size, blocks } => {
                let blocks = blocks.iter().map(|d| d.to_hex()).collect();
                if leave_out(&entry.path) {
                    left_out.insert(
                        entry.path.clone(),
                        RemoteFile {
                            size: *size,
                            blocks,
                        },
                    );
                    continue;
                }
                let file =
                    LazyFile::create(&path, *size, BLOCK_SIZE as u64, blocks, Arc::clone(source))?;
                files.push(Arc::new(file));
                modes.push((path, entry.mode));
            }
        }
    }
    prefetch_files(&files, workers)
        .wait()
        .context("fetch the artifact's blocks")?;
    // Deepest first: a directory gets its mode after everything in it was written.
    for (path, mode) in modes.iter().rev() {
        fs::set_permissions(path, fs::Permissions::from_mode(*mode))
            .with_context(|| format!("chmod {}", path.display()))?;
    }
    Ok(left_out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench_lazy::source::StoreBlocks;
    use fastbox_artifact::{
        ArtifactKind, ArtifactStore, HostFacts, LocalStore, ManifestMeta, NoProgress, publish,
        read_manifest,
    };

    #[test]
    fn a_pull_rebuilds_the_tree_but_what_it_leaves_out() {
        let dir = tempfile::tempdir().unwrap();
        let tree = dir.path().join("tree");
        fs::create_dir_all(tree.join("checkpoint/criu")).unwrap();
        let big: Vec<u8> = (0..BLOCK_SIZE + 1000).map(|i| (i % 251) as u8).collect();
        fs::write(tree.join("checkpoint/criu/pages-1.img"), &big).unwrap();
        fs::write(tree.join("checkpoint/criu/pagemap-1.img"), b"map").unwrap();
        fs::write(tree.join("checkpoint/empty"), b"").unwrap();
        fs::set_permissions(
            tree.join("checkpoint/criu/pagemap-1.img"),
            fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        std::os::unix::fs::symlink("criu", tree.join("checkpoint/current")).unwrap();
        let store: Arc<dyn ArtifactStore> =
            Arc::new(LocalStore::open(dir.path().join("store")).unwrap());
        let meta = ManifestMeta::new(
            ArtifactKind::Checkpoint,
            fastbox_artifact::Digest::of(b"execd"),
            HostFacts::detect(None).unwrap(),
        );
        let published = publish(store.as_ref(), &tree, meta, &NoProgress).unwrap();
        let manifest = read_manifest(store.as_ref(), &published.manifest).unwrap();
        let counted = Arc::new(StoreBlocks::new(store));
        let source: Arc<dyn BlockSource> = counted.clone();

        let full = dir.path().join("full");
        assert!(
            pull(&manifest, &full, &source, 3, |_| false)
                .unwrap()
                .is_empty()
        );
        assert_eq!(
            fs::read(full.join("checkpoint/criu/pages-1.img")).unwrap(),
            big
        );
        let mode = fs::metadata(full.join("checkpoint/criu/pagemap-1.img"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(
            fs::read_link(full.join("checkpoint/current")).unwrap(),
            Path::new("criu")
        );
        assert_eq!(fs::read(full.join("checkpoint/empty")).unwrap(), b"");
        assert_eq!(counted.fetched().blocks, 3);

        let lazy = dir.path().join("lazy");
        let left = pull(&manifest, &lazy, &source, 3, |p| p.ends_with("pages-1.img")).unwrap();
        assert_eq!(counted.fetched().blocks, 4, "only the pagemap's block");
        assert!(!lazy.join("checkpoint/criu/pages-1.img").exists());
        let remote = &left["checkpoint/criu/pages-1.img"];
        assert_eq!(remote.size, big.len() as u64);
        assert_eq!(remote.blocks.len(), 2);
        assert_eq!(
            fs::read(lazy.join("checkpoint/criu/pagemap-1.img")).unwrap(),
            b"map"
        );
    }
}
