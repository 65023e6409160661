//! The artifact store contract (`fastbox_artifact::store` module docs), run against both
//! S3 test servers: s3s-fs and moto. Each function below is one test per server.

mod common;

use std::collections::BTreeSet;
use std::sync::{Arc, Barrier};
use std::time::{Duration, SystemTime};

use fastbox_artifact::{
    ArtifactStore, BLOCK_SIZE, Digest, IndexCreate, IndexKey, IndexOutcome, NoProgress, ObjectKind,
    StoreError, Stored, materialize, publish_index,
};
use fastbox_testkit::s3::S3ServerKind;

use common::{block, bytes, env};

for_each_server!(
    blocks_round_trip,
    puts_are_verified,
    manifests_round_trip,
    corruption_is_detected_never_returned,
    a_damaged_object_is_replaced_by_a_put,
    racing_index_creates_have_one_winner,
    index_entries_round_trip,
    listings_return_every_object_and_skip_strays,
    listings_page_past_a_thousand_objects,
    publish_and_materialize_round_trip,
    stream_block_passes_bytes_on_and_verifies_them,
    ranged_reads_return_the_range,
    conditional_writes_are_detected_at_open,
    a_reput_refreshes_old_objects_only,
    racing_puts_report_added_once,
    works_from_spawn_blocking_inside_a_runtime,
);

fn blocks_round_trip(kind: S3ServerKind) {
    let Some(env) = env(kind) else { return };
    let store = env.store();
    let (digest, bytes) = block("round trip", BLOCK_SIZE);

    assert!(!store.has_block(&digest).unwrap());
    assert!(matches!(
        store.get_block(&digest),
        Err(StoreError::NotFound {
            kind: ObjectKind::Block,
            ..
        })
    ));
    assert_eq!(store.put_block(&digest, &bytes).unwrap(), Stored::Added);
    assert_eq!(
        store.put_block(&digest, &bytes).unwrap(),
        Stored::AlreadyPresent
    );
    assert!(store.has_block(&digest).unwrap());
    assert_eq!(store.get_block(&digest).unwrap(), bytes);

    let (empty, none) = block("empty", 0);
    assert_eq!(store.put_block(&empty, &none).unwrap(), Stored::Added);
    assert_eq!(store.get_block(&empty).unwrap(), none);

    store.delete_block(&digest).unwrap();
    assert!(!store.has_block(&digest).unwrap());
    store.delete_block(&digest).unwrap(); // absent: still fine
}

fn puts_are_verified(kind: S3ServerKind) {
    let Some(env) = env(kind) else { return };
    let store = env.store();
    let (digest, _) = block("a", 10);
    assert!(matches!(
        store.put_block(&digest, b"not the bytes"),
        Err(StoreError::DigestMismatch { .. })
    ));
    let too_big = bytes("big", BLOCK_SIZE + 1);
    assert!(matches!(
        store.put_block(&Digest::of(&too_big), &too_big),
        Err(StoreError::BlockTooLarge { .. })
    ));
    assert!(!store.has_block(&digest).unwrap());
}

fn manifests_round_trip(kind: S3ServerKind) {
    let Some(env) = env(kind) else { return };
    let store = env.store();
    let manifest = br#"{"format_version":1}"#;
    let (digest, stored) = store.put_manifest(manifest).unwrap();
    assert_eq!(digest, Digest::of(manifest));
    assert_eq!(stored, Stored::Added);
    assert_eq!(
        store.put_manifest(manifest).unwrap(),
        (digest, Stored::AlreadyPresent)
    );
    assert!(store.has_manifest(&digest).unwrap());
    assert_eq!(store.get_manifest(&digest).unwrap(), manifest);
    store.delete_manifest(&digest).unwrap();
    assert!(!store.has_manifest(&digest).unwrap());
    assert!(matches!(
        store.get_manifest(&digest),
        Err(StoreError::NotFound {
            kind: ObjectKind::Manifest,
            ..
        })
    ));
    store.delete_manifest(&digest).unwrap();
}

fn corruption_is_detected_never_returned(kind: S3ServerKind) {
    let Some(env) = env(kind) else { return };
    let store = env.store();
    let objects = env.objects();
    let (digest, bytes) = block("victim", 1000);
    store.put_block(&digest, &bytes).unwrap();
    let mut flipped = bytes.clone();
    flipped[500] ^= 1;
    objects.put(&store.layout().block(&digest), &flipped);

    match store.get_block(&digest) {
        Err(StoreError::Corrupt { kind, actual, .. }) => {
            assert_eq!(kind, ObjectKind::Block);
            assert_eq!(actual, Digest::of(&flipped));
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    let mut streamed = Vec::new();
    assert!(matches!(
        store.stream_block(&digest, &mut |chunk| {
            streamed.extend_from_slice(chunk);
            Ok(())
        }),
        Err(StoreError::Corrupt { .. })
    ));

    let manifest = br#"{"manifest":true}"#;
    let (manifest_digest, _) = store.put_manifest(manifest).unwrap();
    objects.put(
        &store.layout().manifest(&manifest_digest),
        br#"{"manifest":false}"#,
    );
    assert!(matches!(
        store.get_manifest(&manifest_digest),
        Err(StoreError::Corrupt {
            kind: ObjectKind::Manifest,
            ..
        })
    ));

    let key = IndexKey::try_new("broken").unwrap();
    objects.put(&store.layout().index(&key), b"not a digest\n");
    assert!(matches!(
        store.index_get(&key),
        Err(StoreError::CorruptIndex { .. })
    ));
}

fn a_damaged_object_is_replaced_by_a_put(kind: S3ServerKind) {
    let Some(env) = env(kind) else { return };
    let store = env.store();
    let (digest, bytes) = block("truncated", 2000);
    store.put_block(&digest, &bytes).unwrap();
    env.objects()
        .put(&store.layout().block(&digest), &bytes[..1000]);
    // The wrong size gives it away: replaced, and never reported as this put's addition.
    assert_eq!(
        store.put_block(&digest, &bytes).unwrap(),
        Stored::AlreadyPresent
    );
    assert_eq!(store.get_block(&digest).unwrap(), bytes);
}

fn racing_index_creates_have_one_winner(kind: S3ServerKind) {
    let Some(env) = env(kind) else { return };
    let store = Arc::new(env.store());
    const WRITERS: usize = 8;
    for round in 0..3 {
        let key = IndexKey::try_new(format!("race:{round}")).unwrap();
        let barrier = Arc::new(Barrier::new(WRITERS));
        let handles: Vec<_> = (0..WRITERS)
            .map(|i| {
                let (store, key, barrier) = (store.clone(), key.clone(), barrier.clone());
                std::thread::spawn(move || {
                    let digest = Digest::of(format!("manifest {round}/{i}").as_bytes());
                    barrier.wait();
                    (digest, store.index_create_if_absent(&key, &digest).unwrap())
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let entry = store.index_get(&key).unwrap().expect("an entry");
        let created: Vec<Digest> = results
            .iter()
            .filter(|(_, outcome)| *outcome == IndexCreate::Created)
            .map(|(digest, _)| *digest)
            .collect();
        // Whatever the server: the entry's writer was told Created, and every other answer
        // names one of the writers' digests.
        assert!(created.contains(&entry), "round {round}: {results:?}");
        for (_, outcome) in &results {
            if let IndexCreate::Exists(shown) = outcome {
                assert!(results.iter().any(|(d, _)| d == shown), "{results:?}");
            }
        }
        if common::atomic_conditional_put(kind) {
            assert_eq!(created, vec![entry], "round {round}: {results:?}");
            for (digest, outcome) in &results {
                if *digest != entry {
                    assert_eq!(*outcome, IndexCreate::Exists(entry), "{results:?}");
                }
            }
        } else {
            eprintln!(
                "note: {} does not check If-None-Match atomically; round {round}: {} of {WRITERS} told Created",
                kind.name(),
                created.len()
            );
        }
    }
}

fn index_entries_round_trip(kind: S3ServerKind) {
    let Some(env) = env(kind) else { return };
    let store = env.store();
    let key = IndexKey::try_new("docker.io/library/python:3.12").unwrap();
    let (a, b) = (Digest::of(b"a"), Digest::of(b"b"));
    assert_eq!(store.index_get(&key).unwrap(), None);
    assert_eq!(
        store.index_create_if_absent(&key, &a).unwrap(),
        IndexCreate::Created
    );
    assert_eq!(
        store.index_create_if_absent(&key, &b).unwrap(),
        IndexCreate::Exists(a)
    );
    assert_eq!(
        store.index_create_if_absent(&key, &a).unwrap(),
        IndexCreate::Exists(a)
    );
    assert_eq!(store.index_get(&key).unwrap(), Some(a));
    store.index_delete(&key).unwrap();
    assert_eq!(store.index_get(&key).unwrap(), None);
    store.index_delete(&key).unwrap();
    assert_eq!(
        store.index_create_if_absent(&key, &b).unwrap(),
        IndexCreate::Created
    );
}

fn listings_return_every_object_and_skip_strays(kind: S3ServerKind) {
    let Some(env) = env(kind) else { return };
    let store = env.store();
    let before = SystemTime::now() - Duration::from_secs(5);
    let mut blocks = BTreeSet::new();
    for i in 0..5 {
        let (digest, bytes) = block(&format!("listed {i}"), 100 + i);
        store.put_block(&digest, &bytes).unwrap();
        blocks.insert((digest, bytes.len() as u64));
    }
    let mut manifests = BTreeSet::new();
    for i in 0..3 {
        let text = format!("{{\"manifest\":{i}}}");
        let (digest, _) = store.put_manifest(text.as_bytes()).unwrap();
        manifests.insert((digest, text.len() as u64));
    }
    let mut index = BTreeSet::new();
    for (i, name) in ["python:3.12", "template/ab12", ".hidden", "ünïcode"]
        .iter()
        .enumerate()
    {
        let key = IndexKey::try_new(*name).unwrap();
        let digest = Digest::of(format!("m{i}").as_bytes());
        store.index_create_if_absent(&key, &digest).unwrap();
        index.insert((key, digest));
    }
    // Objects under the prefix that are not the store's, and another store's objects.
    let objects = env.objects();
    let root = env.config.prefix.clone();
    objects.put(&format!("{root}/blocks/zz/not-a-block"), b"x");
    objects.put(&format!("{root}/blocks/{}", Digest::of(b"x")), b"x");
    objects.put(&format!("{root}/manifests/readme.txt"), b"x");
    objects.put(&format!("{root}/index/%61"), b"x");
    objects.put(
        &format!("{root}-other/blocks/ab/{}", Digest::of(b"y")),
        b"y",
    );

    let listed: BTreeSet<_> = store
        .list_blocks()
        .unwrap()
        .into_iter()
        .map(|object| {
            assert!(object.modified > before, "{object:?}");
            (object.digest, object.size)
        })
        .collect();
    assert_eq!(listed, blocks);
    let listed: BTreeSet<_> = store
        .list_manifests()
        .unwrap()
        .into_iter()
        .map(|object| (object.digest, object.size))
        .collect();
    assert_eq!(listed, manifests);
    let listed: BTreeSet<_> = store.list_index().unwrap().into_iter().collect();
    assert_eq!(listed, index);
}

fn listings_page_past_a_thousand_objects(kind: S3ServerKind) {
    let Some(env) = env(kind) else { return };
    let store = Arc::new(env.store());
    const COUNT: usize = 1_050;
    const THREADS: usize = 8;
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let store = store.clone();
            std::thread::spawn(move || {
                let mut digests = Vec::new();
                for i in (t..COUNT).step_by(THREADS) {
                    let (digest, bytes) = block(&format!("many {i}"), 16);
                    store.put_block(&digest, &bytes).unwrap();
                    digests.push(digest);
                }
                digests
            })
        })
        .collect();
    let expected: BTreeSet<Digest> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    let listed: BTreeSet<Digest> = store
        .list_blocks()
        .unwrap()
        .into_iter()
        .map(|object| object.digest)
        .collect();
    assert_eq!(listed.len(), COUNT);
    assert_eq!(listed, expected);
}

fn publish_and_materialize_round_trip(kind: S3ServerKind) {
    let Some(env) = env(kind) else { return };
    let store = env.store();
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    common::tree(&src, "tree");
    let key = IndexKey::try_new("template/round-trip").unwrap();

    let published = publish_index(&store, &key, &src, common::meta(), &NoProgress).unwrap();
    assert_eq!(published.outcome, IndexOutcome::Created);
    assert_eq!(published.stats.new_blocks, 4, "{:?}", published.stats);
    assert_eq!(store.index_get(&key).unwrap(), Some(published.manifest));

    let again = publish_index(&store, &key, &src, common::meta(), &NoProgress).unwrap();
    assert_eq!(again.outcome, IndexOutcome::AlreadyCurrent);
    assert_eq!(again.stats.new_blocks, 0);

    let dest = dir.path().join("dest");
    let stats = materialize(&store, &published.manifest, &dest).unwrap();
    assert_eq!(stats.blocks_fetched, 4);
    assert_eq!(common::contents(&dest), common::contents(&src));
}

fn stream_block_passes_bytes_on_and_verifies_them(kind: S3ServerKind) {
    let Some(env) = env(kind) else { return };
    let store = env.store();
    let (digest, bytes) = block("streamed", BLOCK_SIZE);
    store.put_block(&digest, &bytes).unwrap();

    let mut received = Vec::new();
    let mut chunks = 0;
    let len = store
        .stream_block(&digest, &mut |chunk| {
            received.extend_from_slice(chunk);
            chunks += 1;
            Ok(())
        })
        .unwrap();
    assert_eq!(len, BLOCK_SIZE as u64);
    assert_eq!(received, bytes);
    assert!(chunks >= 1);

    // A sink that fails stops the stream with an I/O error.
    let failed = store.stream_block(&digest, &mut |_| Err(std::io::Error::other("full")));
    assert!(
        matches!(failed, Err(StoreError::Io { op: "pass on", .. })),
        "{failed:?}"
    );

    let (absent, _) = block("absent", 10);
    assert!(matches!(
        store.stream_block(&absent, &mut |_| Ok(())),
        Err(StoreError::NotFound { .. })
    ));
}

fn ranged_reads_return_the_range(kind: S3ServerKind) {
    let Some(env) = env(kind) else { return };
    let store = env.store();
    let (digest, bytes) = block("ranged", 100_000);
    store.put_block(&digest, &bytes).unwrap();
    assert_eq!(store.get_block_range(&digest, 0..10).unwrap(), bytes[0..10]);
    assert_eq!(
        store.get_block_range(&digest, 4096..8192).unwrap(),
        bytes[4096..8192]
    );
    assert_eq!(
        store.get_block_range(&digest, 99_990..100_000).unwrap(),
        bytes[99_990..]
    );
    let (absent, _) = block("absent", 10);
    assert!(matches!(
        store.get_block_range(&absent, 0..1),
        Err(StoreError::NotFound { .. })
    ));
    assert!(store.get_block_range(&digest, 200_000..200_010).is_err());
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = store.get_block_range(&digest, 10..5);
    assert!(matches!(reversed, Err(StoreError::Io { .. })));
}

fn conditional_writes_are_detected_at_open(kind: S3ServerKind) {
    let Some(env) = env(kind) else { return };
    // Both servers honour If-None-Match: the probe must say so, and leave nothing behind.
    let store = env.store();
    assert!(store.uses_conditional_writes());
    let forced = env.store_with(fastbox_s3::ConditionalWrites::Off);
    assert!(!forced.uses_conditional_writes());
    assert!(store.list_blocks().unwrap().is_empty());
}

fn a_reput_refreshes_old_objects_only(kind: S3ServerKind) {
    let Some(env) = env(kind) else { return };
    let mut config = env.config.clone();
    config.refresh_after = Duration::from_secs(3600);
    let lazy = fastbox_s3::S3Store::open(config.clone()).unwrap();
    config.refresh_after = Duration::ZERO;
    let eager = fastbox_s3::S3Store::open(config).unwrap();

    let (digest, bytes) = block("refreshed", 1000);
    lazy.put_block(&digest, &bytes).unwrap();
    let modified = |store: &fastbox_s3::S3Store| {
        store
            .list_blocks()
            .unwrap()
            .into_iter()
            .find(|object| object.digest == digest)
            .unwrap()
            .modified
    };
    let first = modified(&lazy);
    // S3 times have whole seconds.
    std::thread::sleep(Duration::from_millis(2100));
    assert_eq!(
        lazy.put_block(&digest, &bytes).unwrap(),
        Stored::AlreadyPresent
    );
    assert_eq!(modified(&lazy), first, "a young object is left alone");
    assert_eq!(
        eager.put_block(&digest, &bytes).unwrap(),
        Stored::AlreadyPresent
    );
    let refreshed = modified(&eager);
    assert!(refreshed > first, "{refreshed:?} after {first:?}");
    assert_eq!(
        eager.get_block(&digest).unwrap(),
        bytes,
        "the copy keeps the bytes"
    );
}

fn racing_puts_report_added_once(kind: S3ServerKind) {
    let Some(env) = env(kind) else { return };
    let store = Arc::new(env.store());
    const WRITERS: usize = 6;
    for round in 0..3 {
        let (digest, bytes) = block(&format!("contended {round}"), 64 * 1024);
        let bytes = Arc::new(bytes);
        let barrier = Arc::new(Barrier::new(WRITERS));
        let handles: Vec<_> = (0..WRITERS)
            .map(|_| {
                let (store, bytes, barrier) = (store.clone(), bytes.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    store.put_block(&digest, &bytes).unwrap()
                })
            })
            .collect();
        let added = handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .filter(|stored| *stored == Stored::Added)
            .count();
        assert_eq!(store.get_block(&digest).unwrap(), *bytes);
        // Several writers may find the fresh block absent; a conditional PUT lets one in.
        if common::atomic_conditional_put(kind) {
            assert_eq!(added, 1, "round {round}");
        } else {
            assert!(added >= 1, "round {round}");
            eprintln!(
                "note: {} told {added} of {WRITERS} writers Added",
                kind.name()
            );
        }
    }
}

fn works_from_spawn_blocking_inside_a_runtime(kind: S3ServerKind) {
    let Some(env) = env(kind) else { return };
    let store = Arc::new(env.store());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (digest, bytes) = block("from async", 5000);
    let inner = store.clone();
    let read = runtime
        .block_on(async move {
            tokio::task::spawn_blocking(move || {
                inner.put_block(&digest, &bytes).unwrap();
                inner.get_block(&digest).unwrap()
            })
            .await
        })
        .unwrap();
    assert_eq!(read.len(), 5000);
    // Dropping the last handle to the store inside the runtime must not panic.
    runtime.block_on(async move { drop(store) });
}
