//! Publishing trees, materializing them back, and racing publishes of one key.

mod common;

use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::sync::{Arc, Barrier};

use fastbox_artifact::{
    ArtifactStore, BLOCK_SIZE, Digest, EntryKind, IndexKey, IndexOutcome, LocalStore,
    MaterializeError, NoProgress, PublishError, StoreError, materialize, materialize_except,
    publish, publish_index, read_manifest,
};

use common::{
    FaultyStore, bytes, dir, file, hidden_entries, meta, snapshot, stored_blocks, symlink, temp_dir,
};

/// The blocks of `path` in the manifest, with their stored lengths.
fn block_lens(store: &LocalStore, manifest: &Digest, path: &str) -> Vec<usize> {
    let manifest = read_manifest(store, manifest).unwrap();
    let entry = manifest.files.iter().find(|f| f.path == path).unwrap();
    let EntryKind::File { blocks, .. } = &entry.kind else {
        panic!("{path} is not a file");
    };
    blocks
        .iter()
        .map(|d| store.get_block(d).unwrap().len())
        .collect()
}

#[test]
fn files_are_cut_at_exact_block_boundaries() {
    let (src, dir_store, out) = (temp_dir(), temp_dir(), temp_dir());
    let store = LocalStore::open(dir_store.path()).unwrap();
    for (name, len) in [
        ("zero", 0),
        ("one", 1),
        ("exact", BLOCK_SIZE),
        ("over", BLOCK_SIZE + 1),
    ] {
        file(src.path(), name, &bytes(name, len), 0o644);
    }
    let published = publish(&store, src.path(), meta(), &NoProgress).unwrap();
    let digest = published.manifest;
    assert_eq!(block_lens(&store, &digest, "zero"), Vec::<usize>::new());
    assert_eq!(block_lens(&store, &digest, "one"), vec![1]);
    assert_eq!(block_lens(&store, &digest, "exact"), vec![BLOCK_SIZE]);
    assert_eq!(block_lens(&store, &digest, "over"), vec![BLOCK_SIZE, 1]);
    assert_eq!(published.stats.files, 4);
    assert_eq!(published.stats.blocks, 4);
    assert_eq!(published.stats.bytes, 2 * BLOCK_SIZE as u64 + 2);
    let dest = out.path().join("tree");
    materialize(&store, &digest, &dest).unwrap();
    assert_eq!(snapshot(&dest), snapshot(src.path()));
}

#[test]
fn identical_blocks_are_stored_once() {
    let (src, dir_store) = (temp_dir(), temp_dir());
    let store = LocalStore::open(dir_store.path()).unwrap();
    let block = bytes("repeated", BLOCK_SIZE);
    file(src.path(), "a", &block, 0o644);
    file(src.path(), "b", &block, 0o644);
    file(
        src.path(),
        "twice",
        &[block.clone(), block.clone()].concat(),
        0o644,
    );
    file(src.path(), "other", b"other", 0o644);
    let first = publish(&store, src.path(), meta(), &NoProgress).unwrap();
    assert_eq!(first.stats.blocks, 5);
    assert_eq!(first.stats.new_blocks, 2);
    assert_eq!(stored_blocks(&store).len(), 2);

    // The same tree again adds nothing and yields the same manifest.
    let again = publish(&store, src.path(), meta(), &NoProgress).unwrap();
    assert_eq!(again.manifest, first.manifest);
    assert_eq!(again.stats.new_blocks, 0);
    assert_eq!(again.stats.new_bytes, 0);
    assert_eq!(store.list_manifests().unwrap().len(), 1);
}

/// A tree with every kind of entry the format keeps.
fn rich_tree(root: &Path) {
    dir(root, "bin", 0o755);
    file(root, "bin/tool", b"#!/bin/sh\necho hi\n", 0o4755);
    dir(root, "data", 0o700);
    file(root, "data/big", &bytes("big", BLOCK_SIZE + 123), 0o644);
    file(root, "data/empty", b"", 0o600);
    dir(root, "data/ro", 0o755);
    file(root, "data/ro/inside", b"read-only dir content", 0o444);
    dir(root, "emptydir", 0o1777);
    symlink(root, "link-rel", "bin/tool");
    symlink(root, "link-abs", "/etc/passwd");
    symlink(root, "link-dangling", "does/not/exist");
    file(root, "z-last", b"last", 0o640);
    // The read-only directory's mode is set after its content was written.
    fs::set_permissions(root.join("data/ro"), fs::Permissions::from_mode(0o555)).unwrap();
}

#[test]
fn materialize_rebuilds_files_dirs_symlinks_modes_and_empty_files() {
    let (src, dir_store, out) = (temp_dir(), temp_dir(), temp_dir());
    let store = LocalStore::open(dir_store.path()).unwrap();
    rich_tree(src.path());
    let published = publish(&store, src.path(), meta(), &NoProgress).unwrap();
    assert_eq!(published.stats.dirs, 4);
    assert_eq!(published.stats.symlinks, 3);
    let dest = out.path().join("restored");
    let stats = materialize(&store, &published.manifest, &dest).unwrap();
    assert_eq!(stats.entries, 12);
    assert_eq!(snapshot(&dest), snapshot(src.path()));
    assert_eq!(
        fs::metadata(&dest).unwrap().mode() & 0o7777,
        0o755,
        "the destination itself is 0755"
    );
    assert!(hidden_entries(out.path()).is_empty(), "staging left behind");

    // The destination must not exist.
    assert!(matches!(
        materialize(&store, &published.manifest, &dest),
        Err(MaterializeError::DestinationExists(_))
    ));
}

#[test]
fn materialize_except_leaves_chosen_files_out_and_lists_their_blocks() {
    let (src, dir_store, out) = (temp_dir(), temp_dir(), temp_dir());
    let store = LocalStore::open(dir_store.path()).unwrap();
    rich_tree(src.path());
    let published = publish(&store, src.path(), meta(), &NoProgress).unwrap();
    let dest = out.path().join("restored");
    let (stats, left) = materialize_except(&store, &published.manifest, &dest, &|p| {
        p.starts_with("data/b")
    })
    .unwrap();
    assert_eq!(stats.entries, 11, "every entry but the one left out");
    assert!(!dest.join("data/big").exists());
    assert_eq!(fs::read(dest.join("z-last")).unwrap(), b"last");
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].path, "data/big");
    assert_eq!(left[0].size, (BLOCK_SIZE + 123) as u64);
    let lens: Vec<usize> = left[0]
        .blocks
        .iter()
        .map(|d| store.get_block(d).unwrap().len())
        .collect();
    assert_eq!(lens, block_lens(&store, &published.manifest, "data/big"));
}

#[test]
fn many_files_of_many_blocks_come_back_byte_for_byte() {
    // More blocks than fetching threads, in files of every shape, written concurrently.
    let (src, dir_store, out) = (temp_dir(), temp_dir(), temp_dir());
    let store = LocalStore::open(dir_store.path()).unwrap();
    dir(src.path(), "d", 0o755);
    for i in 0..12 {
        let len = (i % 4) * BLOCK_SIZE + i * 977;
        file(
            src.path(),
            &format!("d/f{i:02}"),
            &bytes(&format!("f{i}"), len),
            0o640,
        );
    }
    let published = publish(&store, src.path(), meta(), &NoProgress).unwrap();
    let dest = out.path().join("many");
    let stats = materialize(&store, &published.manifest, &dest).unwrap();
    assert_eq!(snapshot(&dest), snapshot(src.path()));
    assert_eq!(stats.blocks_fetched, published.stats.blocks);
}

#[test]
fn sparse_files_stay_sparse_and_zero_blocks_are_not_fetched() {
    let (src, dir_store, out) = (temp_dir(), temp_dir(), temp_dir());
    let store = LocalStore::open(dir_store.path()).unwrap();
    let content = [
        bytes("head", BLOCK_SIZE),
        vec![0u8; 3 * BLOCK_SIZE],
        bytes("tail", 10),
    ]
    .concat();
    file(src.path(), "layer.img", &content, 0o644);
    file(src.path(), "zeros", &vec![0u8; 2 * BLOCK_SIZE], 0o644);
    let published = publish(&store, src.path(), meta(), &NoProgress).unwrap();
    assert_eq!(published.stats.new_blocks, 3, "head, one zero block, tail");
    let dest = out.path().join("sparse");
    let stats = materialize(&store, &published.manifest, &dest).unwrap();
    assert_eq!(stats.zero_blocks, 5);
    assert_eq!(stats.blocks_fetched, 2);
    assert_eq!(fs::read(dest.join("layer.img")).unwrap(), content);
    let zeros = fs::metadata(dest.join("zeros")).unwrap();
    assert_eq!(zeros.len(), 2 * BLOCK_SIZE as u64);
    assert!(
        zeros.blocks() * 512 < BLOCK_SIZE as u64,
        "trailing zero blocks are holes ({} bytes allocated)",
        zeros.blocks() * 512
    );
}

#[test]
fn materialize_fails_on_a_corrupt_block_and_leaves_nothing() {
    let (src, dir_store, out) = (temp_dir(), temp_dir(), temp_dir());
    let store = LocalStore::open(dir_store.path()).unwrap();
    file(src.path(), "f", &bytes("f", 10_000), 0o644);
    let published = publish(&store, src.path(), meta(), &NoProgress).unwrap();
    let block = stored_blocks(&store)[0];
    let path = store.block_path(&block);
    fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
    let mut content = fs::read(&path).unwrap();
    content[0] ^= 1;
    fs::write(&path, content).unwrap();
    let dest = out.path().join("t");
    assert!(matches!(
        materialize(&store, &published.manifest, &dest),
        Err(MaterializeError::Store(StoreError::Corrupt { .. }))
    ));
    assert!(!dest.exists());
    assert!(hidden_entries(out.path()).is_empty(), "staging left behind");
}

#[test]
fn unsupported_files_are_refused_by_name() {
    let (src, dir_store) = (temp_dir(), temp_dir());
    let store = LocalStore::open(dir_store.path()).unwrap();
    nix::unistd::mkfifo(&src.path().join("pipe"), nix::sys::stat::Mode::S_IRWXU).unwrap();
    match publish(&store, src.path(), meta(), &NoProgress) {
        Err(PublishError::Unsupported { path, kind }) => {
            assert_eq!((path.as_str(), kind), ("pipe", "fifo"));
        }
        other => panic!("expected unsupported, got {other:?}"),
    }
}

#[test]
fn a_publish_that_fails_midway_leaves_no_manifest_no_index_entry_and_no_blocks() {
    let (src, dir_store) = (temp_dir(), temp_dir());
    file(src.path(), "a", &bytes("a", 3 * BLOCK_SIZE), 0o644);
    file(src.path(), "b", &bytes("b", 2 * BLOCK_SIZE), 0o644);
    let store = FaultyStore::new(LocalStore::open(dir_store.path()).unwrap(), 3, false);
    let key = IndexKey::try_new("template/interrupted").unwrap();
    let result = publish_index(&store, &key, src.path(), meta(), &NoProgress);
    assert!(
        matches!(result, Err(PublishError::StoreBlock { .. })),
        "{result:?}"
    );
    assert!(store.list_manifests().unwrap().is_empty());
    assert_eq!(store.index_get(&key).unwrap(), None);
    assert!(
        stored_blocks(&store).is_empty(),
        "the blocks it added are removed"
    );
}

#[test]
fn a_failed_manifest_write_leaves_no_manifest_and_no_index_entry() {
    let (src, dir_store) = (temp_dir(), temp_dir());
    file(src.path(), "a", &bytes("a", 2 * BLOCK_SIZE), 0o644);
    let store = FaultyStore::new(
        LocalStore::open(dir_store.path()).unwrap(),
        usize::MAX,
        true,
    );
    let key = IndexKey::try_new("template/uncommitted").unwrap();
    let result = publish_index(&store, &key, src.path(), meta(), &NoProgress);
    assert!(
        matches!(result, Err(PublishError::StoreManifest(_))),
        "{result:?}"
    );
    assert!(store.list_manifests().unwrap().is_empty());
    assert_eq!(store.index_get(&key).unwrap(), None);
    // The blocks stay for garbage collection: a remote manifest write may have landed.
    assert_eq!(stored_blocks(&store).len(), 2);
}

/// Two trees sharing one file (two blocks), each with a file of its own (two blocks).
fn racing_trees() -> (tempfile::TempDir, tempfile::TempDir) {
    let (a, b) = (temp_dir(), temp_dir());
    let shared = bytes("shared", 2 * BLOCK_SIZE);
    file(a.path(), "shared", &shared, 0o644);
    file(b.path(), "shared", &shared, 0o644);
    file(a.path(), "own", &bytes("only in a", BLOCK_SIZE + 5), 0o644);
    file(b.path(), "own", &bytes("only in b", BLOCK_SIZE + 7), 0o644);
    (a, b)
}

#[test]
fn concurrent_publishes_of_one_key_converge_and_the_loser_cleans_up() {
    for round in 0..4 {
        let (a, b) = racing_trees();
        let dir_store = temp_dir();
        let key = IndexKey::try_new("python:3.12").unwrap();
        let barrier = Arc::new(Barrier::new(2));
        let handles: Vec<_> = [a.path().to_path_buf(), b.path().to_path_buf()]
            .into_iter()
            .map(|src| {
                let store = LocalStore::open(dir_store.path()).unwrap();
                let (key, barrier) = (key.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    publish_index(&store, &key, &src, meta(), &NoProgress).unwrap()
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let store = LocalStore::open(dir_store.path()).unwrap();
        let indexed = store.index_get(&key).unwrap().unwrap();

        let created = results
            .iter()
            .filter(|r| r.outcome == IndexOutcome::Created)
            .count();
        assert_eq!(created, 1, "round {round}: {results:?}");
        let loser = results
            .iter()
            .find_map(|r| match r.outcome {
                IndexOutcome::Lost {
                    ours,
                    removed_blocks,
                } => Some((ours, removed_blocks)),
                _ => None,
            })
            .unwrap_or_else(|| panic!("round {round}: no loser in {results:?}"));
        for result in &results {
            assert_eq!(result.manifest, indexed, "both report the indexed manifest");
        }

        // The loser's manifest is gone, and so is every block only it referenced: the store
        // holds exactly the winner's artifact.
        let winner = read_manifest(&store, &indexed).unwrap();
        let winner_blocks: Vec<_> = winner.blocks().into_iter().collect();
        assert!(!store.has_manifest(&loser.0).unwrap());
        assert_eq!(store.list_manifests().unwrap().len(), 1);
        assert_eq!(stored_blocks(&store), winner_blocks, "round {round}");
        assert_eq!(
            loser.1, 2,
            "round {round}: the loser's own file had two blocks"
        );
        let out = temp_dir();
        materialize(&store, &indexed, &out.path().join("t")).unwrap();
    }
}

#[test]
fn identical_concurrent_publishes_converge_without_removing_anything() {
    let src = temp_dir();
    file(src.path(), "f", &bytes("same", BLOCK_SIZE * 2 + 1), 0o644);
    let dir_store = temp_dir();
    let key = IndexKey::try_new("template/same").unwrap();
    let barrier = Arc::new(Barrier::new(2));
    let handles: Vec<_> = (0..2)
        .map(|_| {
            let store = LocalStore::open(dir_store.path()).unwrap();
            let (key, barrier, src) = (key.clone(), barrier.clone(), src.path().to_path_buf());
            std::thread::spawn(move || {
                barrier.wait();
                publish_index(&store, &key, &src, meta(), &NoProgress).unwrap()
            })
        })
        .collect();
    let outcomes: BTreeSet<_> = handles
        .into_iter()
        .map(|h| format!("{:?}", h.join().unwrap().outcome))
        .collect();
    assert_eq!(
        outcomes,
        BTreeSet::from(["AlreadyCurrent".to_string(), "Created".to_string()])
    );
    let store = LocalStore::open(dir_store.path()).unwrap();
    assert_eq!(stored_blocks(&store).len(), 3);
    let out = temp_dir();
    let indexed = store.index_get(&key).unwrap().unwrap();
    materialize(&store, &indexed, &out.path().join("t")).unwrap();
}

#[test]
fn a_key_that_points_elsewhere_keeps_its_entry() {
    let (a, b) = racing_trees();
    let dir_store = temp_dir();
    let store = LocalStore::open(dir_store.path()).unwrap();
    let key = IndexKey::try_new("template/first").unwrap();
    let first = publish_index(&store, &key, a.path(), meta(), &NoProgress).unwrap();
    assert_eq!(first.outcome, IndexOutcome::Created);
    let second = publish_index(&store, &key, b.path(), meta(), &NoProgress).unwrap();
    assert_eq!(second.manifest, first.manifest);
    assert!(matches!(
        second.outcome,
        IndexOutcome::Lost {
            removed_blocks: 2,
            ..
        }
    ));
    assert_eq!(second.stats.new_blocks, 2, "only b's own file was new");
    assert_eq!(store.index_get(&key).unwrap(), Some(first.manifest));
}
