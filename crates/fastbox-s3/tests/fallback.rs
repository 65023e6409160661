//! The fallback for servers that ignore `If-None-Match`, forced (`conditional_writes: off`)
//! against real servers: the index create reads back what it wrote.

mod common;

use std::sync::{Arc, Barrier};

use fastbox_artifact::{
    ArtifactStore, Digest, IndexCreate, IndexKey, IndexOutcome, NoProgress, Stored, materialize,
    publish_index, read_manifest,
};
use fastbox_s3::ConditionalWrites;
use fastbox_testkit::s3::S3ServerKind;

for_each_server!(
    fallback_puts_and_index_work_sequentially,
    fallback_index_races_never_have_two_losers,
    fallback_publish_races_leave_a_complete_winner,
);

fn fallback_puts_and_index_work_sequentially(kind: S3ServerKind) {
    let Some(env) = common::env(kind) else { return };
    let store = env.store_with(ConditionalWrites::Off);
    assert!(!store.uses_conditional_writes());
    let (digest, bytes) = common::block("fallback", 4096);
    assert_eq!(store.put_block(&digest, &bytes).unwrap(), Stored::Added);
    assert_eq!(
        store.put_block(&digest, &bytes).unwrap(),
        Stored::AlreadyPresent
    );
    let key = IndexKey::try_new("fallback").unwrap();
    let (a, b) = (Digest::of(b"a"), Digest::of(b"b"));
    assert_eq!(
        store.index_create_if_absent(&key, &a).unwrap(),
        IndexCreate::Created
    );
    assert_eq!(
        store.index_create_if_absent(&key, &b).unwrap(),
        IndexCreate::Exists(a)
    );
    assert_eq!(store.index_get(&key).unwrap(), Some(a));
}

/// Two creators at once, many times: never both told `Exists` (so never both remove what
/// they published), a creator told `Exists(x)` was shown the final entry, and the final entry
/// is one of theirs.
fn fallback_index_races_never_have_two_losers(kind: S3ServerKind) {
    let Some(env) = common::env(kind) else { return };
    let store = Arc::new(env.store_with(ConditionalWrites::Off));
    for round in 0..20 {
        let key = IndexKey::try_new(format!("pair-{round}")).unwrap();
        let barrier = Arc::new(Barrier::new(2));
        let handles: Vec<_> = (0..2)
            .map(|i| {
                let (store, key, barrier) = (store.clone(), key.clone(), barrier.clone());
                std::thread::spawn(move || {
                    let digest = Digest::of(format!("{round}/{i}").as_bytes());
                    barrier.wait();
                    (digest, store.index_create_if_absent(&key, &digest).unwrap())
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let last = store.index_get(&key).unwrap().unwrap();
        assert!(
            results.iter().any(|(digest, _)| *digest == last),
            "{results:?}"
        );
        let losers: Vec<_> = results
            .iter()
            .filter_map(|(_, outcome)| match outcome {
                IndexCreate::Exists(shown) => Some(*shown),
                IndexCreate::Created => None,
            })
            .collect();
        assert!(losers.len() <= 1, "round {round}: {results:?}");
        for shown in losers {
            assert_eq!(shown, last, "round {round}: {results:?}");
        }
    }
}

/// Two publishes of different trees under one key at once, with the fallback: whatever the
/// interleaving, the key ends up naming a complete artifact that materializes.
fn fallback_publish_races_leave_a_complete_winner(kind: S3ServerKind) {
    let Some(env) = common::env(kind) else { return };
    let store = Arc::new(env.store_with(ConditionalWrites::Off));
    let dir = tempfile::tempdir().unwrap();
    let key = IndexKey::try_new("contested").unwrap();
    let barrier = Arc::new(Barrier::new(2));
    let handles: Vec<_> = ["left", "right"]
        .into_iter()
        .map(|seed| {
            let src = dir.path().join(seed);
            common::tree(&src, seed);
            let (store, key, barrier) = (store.clone(), key.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                publish_index(&*store, &key, &src, common::meta(), &NoProgress).unwrap()
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let named = store.index_get(&key).unwrap().unwrap();
    let manifest = read_manifest(&*store, &named).unwrap();
    for block in manifest.blocks() {
        assert!(
            store.has_block(&block).unwrap(),
            "block {block} of the winner is gone"
        );
    }
    let dest = dir.path().join("dest");
    materialize(&*store, &named, &dest).unwrap();
    let source = if common::contents(&dest) == common::contents(&dir.path().join("left")) {
        "left"
    } else {
        "right"
    };
    assert_eq!(
        common::contents(&dest),
        common::contents(&dir.path().join(source))
    );
    for result in &results {
        if let IndexOutcome::Lost { ours, .. } = result.outcome {
            assert_eq!(result.manifest, named, "a loser was shown the final entry");
            assert!(
                !store.has_manifest(&ours).unwrap(),
                "the loser removed its manifest"
            );
        }
    }
}
