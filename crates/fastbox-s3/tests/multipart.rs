//! Objects over the multipart threshold (large manifests): uploaded in parts, create-if-absent
//! like single puts, and read back whole.

mod common;

use std::sync::{Arc, Barrier};

use fastbox_artifact::{
    ArtifactStore, BLOCK_SIZE, EntryKind, FileEntry, Manifest, Stored, zero_block_digest,
};
use fastbox_s3::{MIN_PART_SIZE, S3Store};
use fastbox_testkit::s3::S3ServerKind;

for_each_server!(
    a_large_manifest_round_trips_through_parts,
    racing_multipart_puts_add_once
);

/// A valid manifest of more than 12 MiB: one sparse file of 190 000 zero blocks (725 GiB).
fn large_manifest() -> Vec<u8> {
    let blocks = 190_000;
    let file = FileEntry {
        path: "disk.img".into(),
        mode: 0o600,
        kind: EntryKind::File {
            size: blocks as u64 * BLOCK_SIZE as u64,
            blocks: vec![zero_block_digest(); blocks],
        },
    };
    let bytes = Manifest::try_new(common::meta(), vec![file])
        .unwrap()
        .to_bytes()
        .unwrap();
    assert!(bytes.len() > 2 * MIN_PART_SIZE, "{} bytes", bytes.len());
    bytes
}

fn multipart_store(env: &common::Env) -> S3Store {
    let mut config = env.config.clone();
    config.multipart.threshold = MIN_PART_SIZE;
    config.multipart.part_size = MIN_PART_SIZE;
    S3Store::open(config).unwrap()
}

fn a_large_manifest_round_trips_through_parts(kind: S3ServerKind) {
    let Some(env) = common::env(kind) else { return };
    let store = multipart_store(&env);
    let bytes = large_manifest();
    let (digest, stored) = store.put_manifest(&bytes).unwrap();
    assert_eq!(stored, Stored::Added);
    // A multipart object's ETag ends with the number of parts.
    let parts = bytes.len().div_ceil(MIN_PART_SIZE);
    let etag = env
        .objects()
        .head(&store.layout().manifest(&digest))
        .e_tag
        .unwrap();
    assert!(
        etag.trim_matches('"').ends_with(&format!("-{parts}")),
        "{etag}"
    );

    let read = store.get_manifest(&digest).unwrap();
    assert_eq!(read.len(), bytes.len());
    assert!(read == bytes);
    Manifest::from_slice(&read).unwrap();
    assert_eq!(
        store.put_manifest(&bytes).unwrap(),
        (digest, Stored::AlreadyPresent)
    );
}

fn racing_multipart_puts_add_once(kind: S3ServerKind) {
    let Some(env) = common::env(kind) else { return };
    let store = Arc::new(multipart_store(&env));
    let bytes = Arc::new(large_manifest());
    let barrier = Arc::new(Barrier::new(3));
    let handles: Vec<_> = (0..3)
        .map(|_| {
            let (store, bytes, barrier) = (store.clone(), bytes.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                store.put_manifest(&bytes).unwrap().1
            })
        })
        .collect();
    let added = handles
        .into_iter()
        .map(|h| h.join().unwrap())
        .filter(|stored| *stored == Stored::Added)
        .count();
    // Neither test server checks the completion's If-None-Match atomically (see
    // `common::atomic_conditional_put`): at least one writer added it, and it is whole.
    assert!(added >= 1);
    eprintln!(
        "note: {} told {added} of 3 multipart writers Added",
        kind.name()
    );
    let digest = fastbox_artifact::Digest::of(&bytes);
    assert!(store.get_manifest(&digest).unwrap() == *bytes);
}
