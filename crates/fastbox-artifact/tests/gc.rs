//! Garbage collection over a real local store with real published artifacts.
//!
//! Objects are made old by setting their modification time back, never by sleeping.

mod common;

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fastbox_artifact::{
    ArtifactKind, ArtifactStore, Digest, GcOptions, GcReport, IndexKey, LocalStore, NoProgress,
    PublishProgress, collect_garbage, materialize, publish, publish_index, read_manifest,
};
use nix::sys::stat::{UtimensatFlags, utimensat};
use nix::sys::time::TimeSpec;

use common::{bytes, file, meta, snapshot, stored_blocks, temp_dir};

const GRACE: Duration = Duration::from_secs(3600);
const OLD: Duration = Duration::from_secs(2 * 24 * 3600);

/// Set `path`'s modification time `by` into the past.
fn age(path: &Path, by: Duration) {
    let when = SystemTime::now().checked_sub(by).unwrap();
    let since_epoch = when.duration_since(UNIX_EPOCH).unwrap();
    let mtime = TimeSpec::from_duration(since_epoch);
    utimensat(
        None,
        path,
        &TimeSpec::UTIME_OMIT,
        &mtime,
        UtimensatFlags::NoFollowSymlink,
    )
    .unwrap();
}

/// Make every block and manifest of the store old.
fn age_everything(store: &LocalStore) {
    for block in store.list_blocks().unwrap() {
        age(&store.block_path(&block.digest), OLD);
    }
    for manifest in store.list_manifests().unwrap() {
        age(&store.manifest_path(&manifest.digest), OLD);
    }
}

/// A source tree under `parent` with one file per `(name, content seed)`, each `len` bytes.
fn tree(parent: &Path, name: &str, files: &[(&str, &str)], len: usize) -> PathBuf {
    let root = parent.join(name);
    fs::create_dir(&root).unwrap();
    for (path, seed) in files {
        file(&root, path, &bytes(seed, len), 0o644);
    }
    root
}

fn block_of(seed: &str, len: usize) -> Digest {
    Digest::of(&bytes(seed, len))
}

fn options() -> GcOptions {
    GcOptions {
        grace: GRACE,
        ..GcOptions::default()
    }
}

fn collect(store: &LocalStore, options: &GcOptions) -> GcReport {
    collect_garbage(store, options).unwrap()
}

fn key(name: &str) -> IndexKey {
    IndexKey::try_new(name).unwrap()
}

/// Materialize `manifest` somewhere new and compare it with `src`.
fn assert_materializes(store: &LocalStore, manifest: &Digest, src: &Path) {
    let out = temp_dir();
    let dest = out.path().join("tree");
    materialize(store, manifest, &dest).unwrap();
    assert_eq!(snapshot(&dest), snapshot(src));
}

#[test]
fn unreferenced_blocks_go_and_referenced_pinned_and_young_ones_stay() {
    let (store_dir, src) = (temp_dir(), temp_dir());
    let store = LocalStore::open(store_dir.path()).unwrap();
    const LEN: usize = 1000;
    let app_src = tree(src.path(), "app", &[("a", "shared"), ("b", "app-b")], LEN);
    let app = publish_index(&store, &key("app"), &app_src, meta(), &NoProgress).unwrap();
    let pinned_src = tree(src.path(), "pinned", &[("p", "pinned-p")], LEN);
    let pinned = publish(&store, &pinned_src, meta(), &NoProgress).unwrap();
    let garbage_src = tree(
        src.path(),
        "garbage",
        &[("s", "shared"), ("u1", "garbage-1"), ("u2", "garbage-2")],
        LEN,
    );
    let garbage = publish(&store, &garbage_src, meta(), &NoProgress).unwrap();
    age_everything(&store);
    // Written within the grace period: an unindexed artifact, and a lone block (a publish
    // that has not written its manifest yet).
    let young_src = tree(src.path(), "young", &[("y", "young-y")], LEN);
    let young = publish(&store, &young_src, meta(), &NoProgress).unwrap();
    let in_flight = bytes("in-flight", LEN);
    store
        .put_block(&Digest::of(&in_flight), &in_flight)
        .unwrap();

    let mut opts = options();
    opts.pinned.insert(pinned.manifest);
    let report = collect(&store, &opts);

    assert!(!store.has_manifest(&garbage.manifest).unwrap());
    assert!(!store.has_block(&block_of("garbage-1", LEN)).unwrap());
    assert!(!store.has_block(&block_of("garbage-2", LEN)).unwrap());
    assert!(store.has_block(&block_of("shared", LEN)).unwrap());
    assert!(store.has_block(&Digest::of(&in_flight)).unwrap());
    assert_eq!((report.roots.index, report.roots.pinned), (1, 1));
    assert_eq!(report.roots.young, 1);
    assert_eq!(report.manifests.deleted.count, 1);
    assert_eq!(report.blocks.deleted.count, 2);
    assert_eq!(report.blocks.deleted.bytes, 2 * LEN as u64);
    assert_eq!(report.manifests.marked.count, 2);
    assert_eq!(report.blocks.marked.count, 3);
    assert_eq!(report.manifests.spared.count, 1);
    assert_eq!(report.blocks.spared.count, 2);
    assert!(report.missing_blocks.is_empty() && report.missing_manifests.is_empty());
    assert!(report.broken_manifests.is_empty() && !report.sweep_skipped);

    assert_materializes(&store, &app.manifest, &app_src);
    assert_materializes(&store, &pinned.manifest, &pinned_src);
    assert_materializes(&store, &young.manifest, &young_src);
    // Nothing left to collect.
    let again = collect(&store, &opts);
    assert_eq!(
        again.blocks.deleted.count + again.manifests.deleted.count,
        0
    );
}

#[test]
fn a_dry_run_reports_what_a_collection_deletes_and_deletes_nothing() {
    let (store_dir, src) = (temp_dir(), temp_dir());
    let store = LocalStore::open(store_dir.path()).unwrap();
    let kept_src = tree(src.path(), "kept", &[("k", "kept")], 2000);
    publish_index(&store, &key("kept"), &kept_src, meta(), &NoProgress).unwrap();
    let garbage_src = tree(src.path(), "garbage", &[("g1", "g1"), ("g2", "g2")], 2000);
    publish(&store, &garbage_src, meta(), &NoProgress).unwrap();
    age_everything(&store);
    let blocks_before = stored_blocks(&store);
    let manifests_before = store.list_manifests().unwrap().len();

    let mut dry = options();
    dry.dry_run = true;
    let planned = collect(&store, &dry);
    assert!(planned.dry_run);
    assert_eq!(planned.blocks.deleted.count, 2);
    assert_eq!(planned.blocks.deleted.bytes, 4000);
    assert_eq!(planned.manifests.deleted.count, 1);
    assert_eq!(stored_blocks(&store), blocks_before);
    assert_eq!(store.list_manifests().unwrap().len(), manifests_before);

    let done = collect(&store, &options());
    assert_eq!(done.blocks, planned.blocks);
    assert_eq!(done.manifests, planned.manifests);
    assert_eq!(stored_blocks(&store).len(), blocks_before.len() - 2);
}

#[test]
fn a_parent_named_by_a_snapshot_stays_transitively() {
    let (store_dir, src) = (temp_dir(), temp_dir());
    let store = LocalStore::open(store_dir.path()).unwrap();
    let template_src = tree(src.path(), "template", &[("rootfs", "rootfs")], 3000);
    let template = publish(&store, &template_src, meta(), &NoProgress).unwrap();
    let mut snapshot_meta = meta();
    snapshot_meta.kind = ArtifactKind::Snapshot;
    snapshot_meta.lineage.parent = Some(template.manifest);
    let snapshot_src = tree(src.path(), "snapshot", &[("upper", "snap-upper")], 3000);
    let snap = publish(&store, &snapshot_src, snapshot_meta, &NoProgress).unwrap();
    let mut checkpoint_meta = meta();
    checkpoint_meta.kind = ArtifactKind::Checkpoint;
    checkpoint_meta.lineage.parent = Some(snap.manifest);
    let checkpoint_src = tree(src.path(), "checkpoint", &[("pages", "ckpt-pages")], 3000);
    let checkpoint = publish(&store, &checkpoint_src, checkpoint_meta, &NoProgress).unwrap();
    age_everything(&store);

    // Only the snapshot is indexed: its template stays, the unpinned checkpoint goes.
    store
        .index_create_if_absent(&key("snap"), &snap.manifest)
        .unwrap();
    let report = collect(&store, &options());
    assert_eq!(report.manifests.marked.count, 2);
    assert_eq!(report.manifests.deleted.count, 1);
    assert!(!store.has_manifest(&checkpoint.manifest).unwrap());
    assert_materializes(&store, &template.manifest, &template_src);
    assert_materializes(&store, &snap.manifest, &snapshot_src);

    // A pinned checkpoint keeps its snapshot and, through it, the template.
    let checkpoint = publish(
        &store,
        &checkpoint_src,
        {
            let mut m = meta();
            m.kind = ArtifactKind::Checkpoint;
            m.lineage.parent = Some(snap.manifest);
            m
        },
        &NoProgress,
    )
    .unwrap();
    age_everything(&store);
    store.index_delete(&key("snap")).unwrap();
    let mut pinned = options();
    pinned.pinned.insert(checkpoint.manifest);
    let report = collect(&store, &pinned);
    assert_eq!(report.manifests.marked.count, 3);
    assert_eq!(report.blocks.deleted.count, 0);
    assert_materializes(&store, &template.manifest, &template_src);

    // Unpinned, the whole chain goes.
    let report = collect(&store, &options());
    assert_eq!(report.manifests.deleted.count, 3);
    assert_eq!(report.blocks.deleted.count, 3);
    assert!(store.list_blocks().unwrap().is_empty());
    assert!(store.list_manifests().unwrap().is_empty());
}

#[test]
fn missing_objects_are_reported_and_broken_entries_dropped_on_request() {
    let (store_dir, src) = (temp_dir(), temp_dir());
    let store = LocalStore::open(store_dir.path()).unwrap();
    // "a" loses a block (the race between publishes of different keys).
    let a_src = tree(src.path(), "a", &[("x", "a-x"), ("y", "a-y")], 500);
    let a = publish_index(&store, &key("a"), &a_src, meta(), &NoProgress).unwrap();
    let lost = block_of("a-x", 500);
    store.delete_block(&lost).unwrap();
    // "b" names a manifest that is gone.
    let b_src = tree(src.path(), "b", &[("z", "b-z")], 500);
    let b = publish_index(&store, &key("b"), &b_src, meta(), &NoProgress).unwrap();
    store.delete_manifest(&b.manifest).unwrap();
    // "c" is a snapshot of "a": broken through its parent.
    let mut c_meta = meta();
    c_meta.kind = ArtifactKind::Snapshot;
    c_meta.lineage.parent = Some(a.manifest);
    let c_src = tree(src.path(), "c", &[("w", "c-w")], 500);
    let c = publish_index(&store, &key("c"), &c_src, c_meta, &NoProgress).unwrap();
    // "d" is fine.
    let d_src = tree(src.path(), "d", &[("v", "d-v")], 500);
    let d = publish_index(&store, &key("d"), &d_src, meta(), &NoProgress).unwrap();
    age_everything(&store);

    let report = collect(&store, &options());
    assert_eq!(report.missing_blocks, BTreeSet::from([lost]));
    assert_eq!(report.missing_manifests, BTreeSet::from([b.manifest]));
    assert_eq!(
        report.broken_manifests,
        BTreeSet::from([a.manifest, c.manifest])
    );
    assert!(report.dropped_index_entries.is_empty());
    assert_eq!(store.list_index().unwrap().len(), 4);

    let mut dry = options();
    dry.drop_broken = true;
    dry.dry_run = true;
    let planned = collect(&store, &dry);
    assert_eq!(planned.dropped_index_entries.len(), 3);
    assert_eq!(store.list_index().unwrap().len(), 4);

    let mut drop = options();
    drop.drop_broken = true;
    let dropped = collect(&store, &drop);
    let dropped_keys: BTreeSet<String> = dropped
        .dropped_index_entries
        .iter()
        .map(|(k, _)| k.to_string())
        .collect();
    assert_eq!(
        dropped_keys,
        BTreeSet::from(["a".into(), "b".into(), "c".into()])
    );
    assert_eq!(store.list_index().unwrap(), vec![(key("d"), d.manifest)]);
    // The next collection removes what only the dropped artifacts referenced.
    let report = collect(&store, &options());
    assert_eq!(report.manifests.deleted.count, 2);
    assert_eq!(report.blocks.deleted.count, 2);
    assert_eq!(stored_blocks(&store), vec![block_of("d-v", 500)]);
    assert!(report.missing_blocks.is_empty() && report.broken_manifests.is_empty());
    assert_materializes(&store, &d.manifest, &d_src);
}

#[test]
fn a_reachable_manifest_of_an_unknown_format_skips_the_sweep() {
    let (store_dir, src) = (temp_dir(), temp_dir());
    let store = LocalStore::open(store_dir.path()).unwrap();
    let garbage_src = tree(src.path(), "garbage", &[("g", "g")], 700);
    publish(&store, &garbage_src, meta(), &NoProgress).unwrap();
    let (future, _) = store
        .put_manifest(br#"{"format_version":2,"chunks":["whatever"]}"#)
        .unwrap();
    store
        .index_create_if_absent(&key("future"), &future)
        .unwrap();
    age_everything(&store);

    let report = collect(&store, &options());
    assert!(report.sweep_skipped);
    assert!(report.unreadable_manifests.contains_key(&future));
    assert_eq!(
        report.blocks.deleted.count + report.manifests.deleted.count,
        0
    );
    assert_eq!(report.blocks.held_back.count, 1);
    assert_eq!(report.manifests.held_back.count, 1);
    assert_eq!(store.list_blocks().unwrap().len(), 1);
}

/// Runs a collection after the `after`-th block of a publish, from inside the publish.
struct CollectMidway<'a> {
    store: &'a LocalStore,
    after: usize,
    blocks: AtomicUsize,
    report: Mutex<Option<GcReport>>,
}

impl PublishProgress for CollectMidway<'_> {
    fn block(&self, _len: usize, _added: bool) {
        if self.blocks.fetch_add(1, Ordering::SeqCst) + 1 == self.after {
            let report = collect(self.store, &options());
            *self.report.lock().unwrap() = Some(report);
        }
    }
}

#[test]
fn a_collection_in_the_middle_of_a_publish_spares_what_it_wrote_and_reused() {
    let (store_dir, src) = (temp_dir(), temp_dir());
    let store = LocalStore::open(store_dir.path()).unwrap();
    // Old, unreferenced blocks that the next publish deduplicates against.
    let old_src = tree(
        src.path(),
        "old",
        &[("a", "reused-a"), ("b", "reused-b")],
        900,
    );
    publish(&store, &old_src, meta(), &NoProgress).unwrap();
    let doomed = tree(src.path(), "doomed", &[("d", "doomed")], 900);
    publish(&store, &doomed, meta(), &NoProgress).unwrap();
    age_everything(&store);

    let new_src = tree(
        src.path(),
        "new",
        &[
            ("a", "reused-a"),
            ("b", "reused-b"),
            ("c", "new-c"),
            ("e", "new-e"),
        ],
        900,
    );
    // The collection runs after the two reused blocks and one new one were handled.
    let midway = CollectMidway {
        store: &store,
        after: 3,
        blocks: AtomicUsize::new(0),
        report: Mutex::new(None),
    };
    let published = publish_index(&store, &key("new"), &new_src, meta(), &midway).unwrap();
    let report = midway
        .report
        .lock()
        .unwrap()
        .take()
        .expect("collected midway");
    assert_eq!(report.blocks.spared.count, 3);
    // Only the unrelated old artifact went.
    assert_eq!(report.blocks.deleted.count, 1);
    assert!(!store.has_block(&block_of("doomed", 900)).unwrap());
    assert_materializes(&store, &published.manifest, &new_src);
    let after = collect(&store, &options());
    assert!(after.missing_blocks.is_empty() && after.broken_manifests.is_empty());
}

#[test]
fn publishes_racing_collections_are_not_damaged() {
    const PUBLISHERS: usize = 2;
    const PER_PUBLISHER: usize = 8;
    let (store_dir, src) = (temp_dir(), temp_dir());
    let store = Arc::new(LocalStore::open(store_dir.path()).unwrap());
    // An indexed base whose block every publish shares, and old garbage to collect.
    let base_src = tree(src.path(), "base", &[("shared", "shared")], 4096);
    publish_index(&*store, &key("base"), &base_src, meta(), &NoProgress).unwrap();
    for i in 0..20 {
        let garbage = tree(
            src.path(),
            &format!("garbage{i}"),
            &[("g", &format!("g{i}"))],
            4096,
        );
        publish(&*store, &garbage, meta(), &NoProgress).unwrap();
    }
    age_everything(&store);
    // Sources are written before the race, so the race is only publish against collection.
    let sources: Vec<Vec<PathBuf>> = (0..PUBLISHERS)
        .map(|p| {
            (0..PER_PUBLISHER)
                .map(|i| {
                    let name = format!("p{p}-{i}");
                    tree(
                        src.path(),
                        &name,
                        &[
                            ("shared", "shared"),
                            ("own", &name),
                            ("more", &format!("{name}+")),
                        ],
                        4096,
                    )
                })
                .collect()
        })
        .collect();

    let done = Arc::new(AtomicUsize::new(0));
    let collector = {
        let (store, done) = (store.clone(), done.clone());
        std::thread::spawn(move || {
            let mut deleted = 0;
            let mut runs = 0;
            while done.load(Ordering::SeqCst) < PUBLISHERS || runs == 0 {
                let report = collect_garbage(&*store, &options()).unwrap();
                assert!(report.missing_blocks.is_empty(), "{report:?}");
                deleted += report.blocks.deleted.count;
                runs += 1;
            }
            (deleted, runs)
        })
    };
    let publishers: Vec<_> = sources
        .into_iter()
        .enumerate()
        .map(|(p, trees)| {
            let (store, done) = (store.clone(), done.clone());
            std::thread::spawn(move || {
                let mut published = Vec::new();
                for (i, tree) in trees.into_iter().enumerate() {
                    let key = key(&format!("p{p}-{i}"));
                    let result = publish_index(&*store, &key, &tree, meta(), &NoProgress).unwrap();
                    published.push((result.manifest, tree));
                }
                done.fetch_add(1, Ordering::SeqCst);
                published
            })
        })
        .collect();
    let published: Vec<(Digest, PathBuf)> = publishers
        .into_iter()
        .flat_map(|p| p.join().unwrap())
        .collect();
    let (deleted, runs) = collector.join().unwrap();
    assert!(runs >= 1);

    // Every publish is intact, and nothing but the old garbage went.
    for (manifest, tree) in &published {
        assert_materializes(&store, manifest, tree);
        assert!(read_manifest(&*store, manifest).is_ok());
    }
    let last = collect(&store, &options());
    assert!(last.missing_blocks.is_empty() && last.broken_manifests.is_empty());
    assert_eq!(deleted + last.blocks.deleted.count, 20);
    assert_eq!(
        store.list_index().unwrap().len(),
        1 + PUBLISHERS * PER_PUBLISHER
    );
}
