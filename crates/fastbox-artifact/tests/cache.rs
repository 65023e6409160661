//! The node block cache and the caching store: budget, scan resistance, pins, restarts,
//! corruption, concurrency, and materializing through the cache over a real local store.

mod common;

use std::fs;
use std::path::Path;
use std::sync::Arc;

use fastbox_artifact::{
    ArtifactKind, ArtifactStore, BLOCK_SIZE, BlockCache, CacheError, CachedStore, Digest, IndexKey,
    LocalStore, NoProgress, materialize, publish, publish_index, read_manifest,
};

use common::{bytes, dir, file, meta, snapshot, temp_dir};

/// The size of most test blocks: the cache does not care how large a block is.
const SMALL: usize = 64 * 1024;

fn block(seed: &str) -> (Digest, Vec<u8>) {
    let data = bytes(seed, SMALL);
    (Digest::of(&data), data)
}

fn blocks(prefix: &str, n: usize) -> Vec<(Digest, Vec<u8>)> {
    (0..n).map(|i| block(&format!("{prefix}{i}"))).collect()
}

/// Every file under the cache's `blocks/`, with its size.
fn files_on_disk(cache_dir: &Path) -> Vec<(String, u64)> {
    let mut files = Vec::new();
    for fanout in fs::read_dir(cache_dir.join("blocks")).unwrap() {
        for entry in fs::read_dir(fanout.unwrap().path()).unwrap() {
            let entry = entry.unwrap();
            files.push((
                entry.file_name().into_string().unwrap(),
                entry.metadata().unwrap().len(),
            ));
        }
    }
    files
}

/// Flip one byte of a file in place.
fn flip_byte(path: &Path, at: usize) {
    let mut content = fs::read(path).unwrap();
    content[at] ^= 0xff;
    fs::write(path, content).unwrap();
}

#[test]
fn the_budget_is_respected_and_the_disk_matches_the_stats() {
    let dir = temp_dir();
    let cache = BlockCache::open(dir.path(), 10 * SMALL as u64).unwrap();
    for (digest, data) in blocks("b", 50) {
        cache.insert(&digest, &data).unwrap();
        assert!(cache.stats().bytes <= 10 * SMALL as u64);
    }
    let stats = cache.stats();
    assert_eq!((stats.inserts, stats.evictions, stats.blocks), (50, 40, 10));
    assert!(!stats.over_budget);
    let on_disk = files_on_disk(dir.path());
    assert_eq!(on_disk.len(), 10);
    assert_eq!(on_disk.iter().map(|(_, len)| len).sum::<u64>(), stats.bytes);
    // The ten most recent inserts are what is left.
    for (digest, data) in &blocks("b", 50)[40..] {
        assert_eq!(cache.get(digest).unwrap().as_deref(), Some(&data[..]));
    }
}

#[test]
fn a_one_shot_scan_does_not_evict_a_block_read_twice() {
    let dir = temp_dir();
    let cache = BlockCache::open(dir.path(), 16 * SMALL as u64).unwrap();
    let (hot, hot_data) = block("hot");
    let (cold, cold_data) = block("cold");
    cache.insert(&hot, &hot_data).unwrap();
    assert!(cache.get(&hot).unwrap().is_some());
    cache.insert(&cold, &cold_data).unwrap();
    // A read of an artifact twelve times the cache, each block once.
    for (digest, data) in blocks("scan", 200) {
        cache.insert(&digest, &data).unwrap();
    }
    assert_eq!(cache.get(&hot).unwrap(), Some(hot_data));
    assert!(
        !cache.contains(&cold),
        "a block read once is evicted by the scan"
    );
    let stats = cache.stats();
    assert_eq!(stats.protected_bytes, SMALL as u64);
    assert_eq!(stats.bytes, 16 * SMALL as u64);
}

#[test]
fn a_hot_artifact_survives_a_large_one_shot_materialize() {
    let (origin_dir, cache_dir, src, out) = (temp_dir(), temp_dir(), temp_dir(), temp_dir());
    let origin = Arc::new(LocalStore::open(origin_dir.path()).unwrap());
    let tree = |name: &str, files: usize| {
        let root = src.path().join(name);
        fs::create_dir(&root).unwrap();
        for i in 0..files {
            file(
                &root,
                &format!("f{i}"),
                &bytes(&format!("{name}{i}"), SMALL),
                0o644,
            );
        }
        publish(&*origin, &root, meta(), &NoProgress)
            .unwrap()
            .manifest
    };
    let hot = tree("hot", 3);
    let big = tree("big", 40);
    // Room for 16 blocks and the manifests.
    let cache = Arc::new(BlockCache::open(cache_dir.path(), 16 * SMALL as u64 + 65536).unwrap());
    let store = CachedStore::new(cache, origin);
    let mut run = 0;
    let mut materialize_once = |digest: &Digest| {
        run += 1;
        materialize(&store, digest, &out.path().join(format!("run{run}"))).unwrap();
    };
    materialize_once(&hot);
    materialize_once(&hot);
    materialize_once(&big);
    let before = store.stats();
    materialize_once(&hot);
    let after = store.stats();
    assert_eq!(after.block_fetches, before.block_fetches);
    assert_eq!(after.manifest_fetches, before.manifest_fetches);
    assert_eq!(after.block_hits, before.block_hits + 3);
    assert!(
        store.cache().stats().evictions > 0,
        "the big artifact did not fit"
    );
}

#[test]
fn pinned_blocks_survive_pressure_until_unpinned() {
    let dir = temp_dir();
    let cache = BlockCache::open(dir.path(), 4 * SMALL as u64).unwrap();
    let pinned = blocks("pinned", 2);
    // Pinned before they are fetched, as a restore does.
    cache.pin("sandbox-1", pinned.iter().map(|(d, _)| *d));
    for (digest, data) in &pinned {
        cache.insert(digest, data).unwrap();
    }
    for (digest, data) in blocks("pressure", 50) {
        cache.insert(&digest, &data).unwrap();
    }
    assert!(pinned.iter().all(|(d, _)| cache.contains(d)));
    assert_eq!(cache.stats().pinned_bytes, 2 * SMALL as u64);
    assert_eq!(cache.stats().bytes, 4 * SMALL as u64);
    cache.unpin("sandbox-1");
    assert_eq!(cache.stats().pinned_bytes, 0);
    for (digest, data) in blocks("more", 4) {
        cache.insert(&digest, &data).unwrap();
    }
    assert!(pinned.iter().all(|(d, _)| !cache.contains(d)));
}

#[test]
fn pins_beyond_the_budget_take_the_cache_over_it_without_failing() {
    let dir = temp_dir();
    let cache = BlockCache::open(dir.path(), 4 * SMALL as u64).unwrap();
    let pinned = blocks("pinned", 6);
    cache.pin("big-template", pinned.iter().map(|(d, _)| *d));
    for (digest, data) in &pinned {
        cache.insert(digest, data).unwrap();
    }
    let stats = cache.stats();
    assert!(stats.over_budget);
    assert_eq!(stats.bytes, 6 * SMALL as u64);
    assert_eq!(stats.pinned_bytes, 6 * SMALL as u64);
    assert_eq!(stats.evictions, 0);
    cache.unpin("big-template");
    let stats = cache.stats();
    assert!(!stats.over_budget);
    assert_eq!(stats.bytes, 4 * SMALL as u64);
}

#[test]
fn a_restart_keeps_blocks_and_their_segments() {
    let dir = temp_dir();
    let kept = blocks("kept", 5);
    {
        let cache = BlockCache::open(dir.path(), 8 * SMALL as u64).unwrap();
        for (digest, data) in &kept {
            cache.insert(digest, data).unwrap();
        }
        // Blocks 0 and 1 are read again: protected.
        assert!(cache.get(&kept[0].0).unwrap().is_some());
        assert!(cache.get(&kept[1].0).unwrap().is_some());
    } // dropped: the state is saved
    // A block file the state does not know (copied in by hand).
    let (stray, stray_data) = block("stray");
    let hex = stray.to_hex();
    let stray_path = dir.path().join("blocks").join(&hex[..2]).join(&hex);
    fs::create_dir_all(stray_path.parent().unwrap()).unwrap();
    fs::write(&stray_path, &stray_data).unwrap();

    let cache = BlockCache::open(dir.path(), 8 * SMALL as u64).unwrap();
    let stats = cache.stats();
    assert_eq!(stats.blocks, 6);
    assert_eq!(stats.protected_bytes, 2 * SMALL as u64);
    assert!(kept.iter().all(|(d, _)| cache.contains(d)));
    assert!(cache.contains(&stray));
    // Over budget by one after three inserts: the unknown block is the coldest.
    for (digest, data) in blocks("new", 3) {
        cache.insert(&digest, &data).unwrap();
    }
    assert!(!cache.contains(&stray));
    assert!(cache.contains(&kept[2].0));
    // Pressure takes probation; the protected blocks stay.
    for (digest, data) in blocks("pressure", 20) {
        cache.insert(&digest, &data).unwrap();
    }
    assert_eq!(cache.get(&kept[0].0).unwrap(), Some(kept[0].1.clone()));
    assert_eq!(cache.get(&kept[1].0).unwrap(), Some(kept[1].1.clone()));
    assert!(kept[2..].iter().all(|(d, _)| !cache.contains(d)));
}

#[test]
fn a_missing_or_corrupt_state_file_costs_only_the_order() {
    let dir = temp_dir();
    let kept = blocks("kept", 3);
    {
        let cache = BlockCache::open(dir.path(), 8 * SMALL as u64).unwrap();
        for (digest, data) in &kept {
            cache.insert(digest, data).unwrap();
        }
        assert!(cache.get(&kept[0].0).unwrap().is_some());
        cache.flush().unwrap();
    }
    let state = dir.path().join("state.json");
    assert!(state.exists());
    fs::write(&state, b"{\"version\": 1, \"probation\": [tru").unwrap();
    {
        let cache = BlockCache::open(dir.path(), 8 * SMALL as u64).unwrap();
        let stats = cache.stats();
        assert_eq!((stats.blocks, stats.protected_bytes), (3, 0));
    }
    fs::remove_file(&state).unwrap();
    let cache = BlockCache::open(dir.path(), 8 * SMALL as u64).unwrap();
    assert_eq!(cache.stats().blocks, 3);
    assert_eq!(cache.get(&kept[2].0).unwrap(), Some(kept[2].1.clone()));
}

#[test]
fn a_smaller_budget_at_open_evicts_at_once() {
    let dir = temp_dir();
    {
        let cache = BlockCache::open(dir.path(), 8 * SMALL as u64).unwrap();
        for (digest, data) in blocks("b", 8) {
            cache.insert(&digest, &data).unwrap();
        }
    }
    let cache = BlockCache::open(dir.path(), 3 * SMALL as u64).unwrap();
    assert_eq!(cache.stats().blocks, 3);
    assert_eq!(files_on_disk(dir.path()).len(), 3);
}

#[test]
fn a_corrupt_or_torn_cached_block_is_a_counted_miss_and_is_removed() {
    let dir = temp_dir();
    let cache = BlockCache::open(dir.path(), 8 * SMALL as u64).unwrap();
    let (flipped, flipped_data) = block("flipped");
    let (torn, torn_data) = block("torn");
    cache.insert(&flipped, &flipped_data).unwrap();
    cache.insert(&torn, &torn_data).unwrap();
    flip_byte(&cache.block_path(&flipped), 1234);
    fs::write(cache.block_path(&torn), &torn_data[..100]).unwrap();
    assert_eq!(cache.get(&flipped).unwrap(), None);
    assert_eq!(cache.get(&torn).unwrap(), None);
    assert!(!cache.contains(&flipped) && !cache.contains(&torn));
    assert!(!cache.block_path(&flipped).exists());
    let stats = cache.stats();
    assert_eq!((stats.corrupt_dropped, stats.misses, stats.hits), (2, 2, 0));
    assert_eq!((stats.blocks, stats.bytes), (0, 0));
}

#[test]
fn a_corrupted_cached_block_is_refetched_through_the_caching_store() {
    let (origin_dir, cache_dir) = (temp_dir(), temp_dir());
    let origin = Arc::new(LocalStore::open(origin_dir.path()).unwrap());
    let (digest, data) = block("refetched");
    origin.put_block(&digest, &data).unwrap();
    let cache = Arc::new(BlockCache::open(cache_dir.path(), 8 * SMALL as u64).unwrap());
    let store = CachedStore::new(cache.clone(), origin);
    assert_eq!(store.get_block(&digest).unwrap(), data);
    flip_byte(&cache.block_path(&digest), 0);
    assert_eq!(store.get_block(&digest).unwrap(), data);
    assert_eq!(store.stats().block_fetches, 2);
    assert_eq!(cache.stats().corrupt_dropped, 1);
    // The cache holds the good bytes again, and serves them.
    assert_eq!(fs::read(cache.block_path(&digest)).unwrap(), data);
    assert_eq!(store.get_block(&digest).unwrap(), data);
    assert_eq!(store.stats().block_hits, 1);
    assert_eq!(store.stats().block_fetches, 2);
}

#[test]
fn insert_refuses_bytes_that_do_not_hash_to_the_digest() {
    let dir = temp_dir();
    let cache = BlockCache::open(dir.path(), 8 * SMALL as u64).unwrap();
    let (digest, _) = block("right");
    let (_, wrong) = block("wrong");
    assert!(matches!(
        cache.insert(&digest, &wrong),
        Err(CacheError::DigestMismatch { expected, .. }) if expected == digest
    ));
    assert!(!cache.contains(&digest));
    assert!(!cache.block_path(&digest).exists());
    assert_eq!(cache.stats().inserts, 0);
}

#[test]
fn a_second_open_of_the_same_directory_is_refused() {
    let dir = temp_dir();
    let first = BlockCache::open(dir.path(), SMALL as u64).unwrap();
    assert!(matches!(
        BlockCache::open(dir.path(), SMALL as u64),
        Err(CacheError::Busy(_))
    ));
    drop(first);
    BlockCache::open(dir.path(), SMALL as u64).unwrap();
}

#[test]
fn concurrent_inserts_and_gets_from_many_threads_stay_consistent() {
    const THREADS: usize = 8;
    const OPS: usize = 400;
    const WORKING_SET: usize = 60;
    const LEN: usize = 4096;
    let dir = temp_dir();
    let cache = Arc::new(BlockCache::open(dir.path(), 20 * LEN as u64).unwrap());
    let set: Arc<Vec<(Digest, Vec<u8>)>> = Arc::new(
        (0..WORKING_SET)
            .map(|i| {
                let data = bytes(&format!("c{i}"), LEN);
                (Digest::of(&data), data)
            })
            .collect(),
    );
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (cache, set) = (cache.clone(), set.clone());
            std::thread::spawn(move || {
                let pick = bytes(&format!("order{t}"), OPS);
                for (op, byte) in pick.iter().enumerate() {
                    // A skewed choice: low indexes are hot.
                    let i = (*byte as usize * *byte as usize) % WORKING_SET;
                    let (digest, data) = &set[i];
                    match cache.get(digest).unwrap() {
                        Some(got) => assert_eq!(&got, data, "thread {t} op {op}"),
                        None => cache.insert(digest, data).unwrap(),
                    }
                    if op % 50 == 0 {
                        cache.pin(&format!("t{t}"), [*digest]);
                    } else if op % 50 == 25 {
                        cache.unpin(&format!("t{t}"));
                    }
                }
                cache.unpin(&format!("t{t}"));
            })
        })
        .collect();
    for worker in workers {
        worker.join().unwrap();
    }
    let stats = cache.stats();
    assert_eq!(stats.hits + stats.misses, (THREADS * OPS) as u64);
    assert!(stats.bytes <= stats.budget);
    assert_eq!(stats.corrupt_dropped, 0);
    let on_disk = files_on_disk(dir.path());
    assert_eq!(on_disk.len() as u64, stats.blocks);
    for (name, _) in on_disk {
        let digest = Digest::from_hex(&name).unwrap();
        assert!(cache.contains(&digest));
        assert_eq!(
            Digest::of(&fs::read(cache.block_path(&digest)).unwrap()),
            digest
        );
    }
}

/// A source tree with a multi-block file, a repeated block, a sparse file and small files.
fn sample_tree(root: &Path) {
    dir(root, "checkpoint", 0o700);
    file(
        root,
        "checkpoint/pages-1.img",
        &bytes("pages", BLOCK_SIZE + 10),
        0o600,
    );
    let repeated = bytes("repeated", SMALL);
    file(root, "checkpoint/a.img", &repeated, 0o600);
    file(root, "checkpoint/b.img", &repeated, 0o600);
    let mut sparse = vec![0u8; 2 * BLOCK_SIZE];
    sparse.extend_from_slice(b"tail");
    file(root, "upper.img", &sparse, 0o644);
    file(root, "rootfs.tar", &bytes("rootfs", 3000), 0o644);
}

#[test]
fn a_second_materialize_is_served_entirely_from_the_cache() {
    let (origin_dir, cache_dir, src, out) = (temp_dir(), temp_dir(), temp_dir(), temp_dir());
    sample_tree(src.path());
    let origin = Arc::new(LocalStore::open(origin_dir.path()).unwrap());
    let key = IndexKey::try_new("python:3.12").unwrap();
    let published = publish_index(&*origin, &key, src.path(), meta(), &NoProgress).unwrap();
    let cache = Arc::new(BlockCache::open(cache_dir.path(), 64 << 20).unwrap());
    let store = CachedStore::new(cache, origin.clone());
    // Names come from upstream.
    let digest = store.index_get(&key).unwrap().unwrap();
    assert_eq!(digest, published.manifest);
    assert_eq!(store.list_index().unwrap(), origin.list_index().unwrap());

    let first = materialize(&store, &digest, &out.path().join("first")).unwrap();
    let after_first = store.stats();
    // pages (2 blocks), the repeated block, the tail of the sparse file, rootfs: fetched
    // once each; the repeated block is read once for both its uses, and the zero blocks are
    // not fetched.
    assert_eq!(after_first.block_fetches, 5);
    assert_eq!(after_first.block_hits, 0);
    assert_eq!(after_first.manifest_fetches, 1);
    assert_eq!(first.blocks_fetched, 5);
    assert_eq!(first.zero_blocks, 2);

    let second = materialize(&store, &digest, &out.path().join("second")).unwrap();
    let after_second = store.stats();
    assert_eq!(after_second.block_fetches, after_first.block_fetches);
    assert_eq!(after_second.manifest_fetches, after_first.manifest_fetches);
    assert_eq!(after_second.fetched_bytes, after_first.fetched_bytes);
    assert_eq!(
        after_second.block_hits,
        after_first.block_hits + second.blocks_fetched
    );
    assert_eq!(after_second.manifest_hits, 1);
    assert_eq!(snapshot(&out.path().join("first")), snapshot(src.path()));
    assert_eq!(snapshot(&out.path().join("second")), snapshot(src.path()));
    // has_* see the cache and upstream.
    let manifest = read_manifest(&store, &digest).unwrap();
    for block in manifest.blocks() {
        assert!(store.has_block(&block).unwrap());
    }
    assert!(store.has_manifest(&digest).unwrap());
}

#[test]
fn a_publish_through_the_cache_writes_through_and_warms_it() {
    let (origin_dir, cache_dir, src, out) = (temp_dir(), temp_dir(), temp_dir(), temp_dir());
    sample_tree(src.path());
    let origin = Arc::new(LocalStore::open(origin_dir.path()).unwrap());
    let cache = Arc::new(BlockCache::open(cache_dir.path(), 64 << 20).unwrap());
    let store = CachedStore::new(cache, origin.clone());
    let key = IndexKey::try_new("template/warm").unwrap();
    let published = publish_index(&store, &key, src.path(), meta(), &NoProgress).unwrap();
    // Upstream has everything: a node without this cache can materialize it.
    materialize(&*origin, &published.manifest, &out.path().join("origin")).unwrap();
    assert_eq!(origin.index_get(&key).unwrap(), Some(published.manifest));
    // This node materializes without a single upstream fetch.
    materialize(&store, &published.manifest, &out.path().join("node")).unwrap();
    let stats = store.stats();
    assert_eq!((stats.block_fetches, stats.manifest_fetches), (0, 0));
    assert_eq!(snapshot(&out.path().join("node")), snapshot(src.path()));
    // A delete through the caching store drops the cached copy too.
    let block = *read_manifest(&store, &published.manifest)
        .unwrap()
        .blocks()
        .first()
        .unwrap();
    store.delete_block(&block).unwrap();
    assert!(!store.cache().contains(&block));
    assert!(!store.has_block(&block).unwrap());
}

#[test]
fn stream_block_passes_bytes_on_and_caches_what_it_fetched() {
    let (origin_dir, cache_dir) = (temp_dir(), temp_dir());
    let origin = Arc::new(LocalStore::open(origin_dir.path()).unwrap());
    let data = bytes("streamed", BLOCK_SIZE);
    let digest = Digest::of(&data);
    origin.put_block(&digest, &data).unwrap();
    let cache = Arc::new(BlockCache::open(cache_dir.path(), 64 << 20).unwrap());
    let store = CachedStore::new(cache.clone(), origin);
    for round in 0..2 {
        let mut received = Vec::new();
        let len = store
            .stream_block(&digest, &mut |chunk| {
                received.extend_from_slice(chunk);
                Ok(())
            })
            .unwrap();
        assert_eq!(len, BLOCK_SIZE as u64, "round {round}");
        assert_eq!(received, data, "round {round}");
    }
    let stats = store.stats();
    assert_eq!((stats.block_fetches, stats.block_hits), (1, 1));
    assert!(cache.contains(&digest));
}

#[test]
fn pin_artifact_pins_a_snapshot_and_its_template_before_they_are_fetched() {
    let (origin_dir, cache_dir, src, out) = (temp_dir(), temp_dir(), temp_dir(), temp_dir());
    let origin = Arc::new(LocalStore::open(origin_dir.path()).unwrap());
    let template_src = src.path().join("template");
    fs::create_dir(&template_src).unwrap();
    for i in 0..3 {
        file(
            &template_src,
            &format!("t{i}"),
            &bytes(&format!("t{i}"), SMALL),
            0o644,
        );
    }
    let template = publish(&*origin, &template_src, meta(), &NoProgress).unwrap();
    let snapshot_src = src.path().join("snapshot");
    fs::create_dir(&snapshot_src).unwrap();
    for i in 0..2 {
        file(
            &snapshot_src,
            &format!("s{i}"),
            &bytes(&format!("s{i}"), SMALL),
            0o644,
        );
    }
    let mut snapshot_meta = meta();
    snapshot_meta.kind = ArtifactKind::Snapshot;
    snapshot_meta.lineage.parent = Some(template.manifest);
    let snap = publish(&*origin, &snapshot_src, snapshot_meta, &NoProgress).unwrap();

    // A cache smaller than the two artifacts together.
    let cache = Arc::new(BlockCache::open(cache_dir.path(), 4 * SMALL as u64).unwrap());
    let store = CachedStore::new(cache.clone(), origin);
    // Two manifests and five blocks.
    assert_eq!(store.pin_artifact("sandbox-7", &snap.manifest).unwrap(), 7);
    materialize(&store, &template.manifest, &out.path().join("template")).unwrap();
    materialize(&store, &snap.manifest, &out.path().join("snapshot")).unwrap();
    let stats = cache.stats();
    assert_eq!(stats.evictions, 0);
    assert!(stats.over_budget);
    assert_eq!(stats.pinned_bytes, stats.bytes);
    let fetches = store.stats().block_fetches;
    materialize(&store, &snap.manifest, &out.path().join("again")).unwrap();
    assert_eq!(store.stats().block_fetches, fetches);
    cache.unpin("sandbox-7");
    assert!(!cache.stats().over_budget);
}

#[test]
fn changes_are_saved_periodically_without_a_close() {
    let dir = temp_dir();
    let cache = BlockCache::open(dir.path(), 8 * SMALL as u64)
        .unwrap()
        .with_flush_interval(std::time::Duration::ZERO);
    let state = dir.path().join("state.json");
    let saved =
        || -> serde_json::Value { serde_json::from_slice(&fs::read(&state).unwrap()).unwrap() };
    let (hot, hot_data) = block("hot");
    let (gone, gone_data) = block("gone");
    cache.insert(&hot, &hot_data).unwrap();
    cache.insert(&gone, &gone_data).unwrap();
    assert!(cache.get(&hot).unwrap().is_some());
    assert_eq!(saved()["protected"], serde_json::json!([hot.to_hex()]));
    assert_eq!(saved()["probation"], serde_json::json!([gone.to_hex()]));
    // Every kind of change flushes, from the thread that made it.
    assert!(cache.remove(&gone).unwrap());
    assert_eq!(saved()["probation"], serde_json::json!([]));
    cache.pin("holder", [hot]);
    cache.unpin("holder");
    assert_eq!(saved()["protected"], serde_json::json!([hot.to_hex()]));
}
