//! The local directory store: verified, idempotent, atomic objects and a conditional index.

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::sync::{Arc, Barrier};

use fastbox_artifact::{
    ArtifactStore, BLOCK_SIZE, Digest, IndexCreate, IndexKey, LocalStore, ObjectKind, StoreError,
    Stored,
};

use common::{bytes, temp_dir};

/// Flip one byte of a stored file (stored files are read-only).
fn flip_byte(path: &std::path::Path, at: usize) {
    fs::set_permissions(path, fs::Permissions::from_mode(0o644)).unwrap();
    let mut content = fs::read(path).unwrap();
    content[at] ^= 0xff;
    fs::write(path, content).unwrap();
}

#[test]
fn blocks_round_trip_and_a_second_put_is_already_present() {
    let dir = temp_dir();
    let store = LocalStore::open(dir.path()).unwrap();
    let data = bytes("block", 1000);
    let digest = Digest::of(&data);
    assert!(!store.has_block(&digest).unwrap());
    assert_eq!(store.put_block(&digest, &data).unwrap(), Stored::Added);
    assert_eq!(
        store.put_block(&digest, &data).unwrap(),
        Stored::AlreadyPresent
    );
    assert!(store.has_block(&digest).unwrap());
    assert_eq!(store.get_block(&digest).unwrap(), data);
    let path = store.block_path(&digest);
    let hex = digest.to_hex();
    assert!(path.ends_with(format!("blocks/{}/{hex}", &hex[..2])));
    assert_eq!(store.list_blocks().unwrap().len(), 1);
    assert_eq!(store.list_blocks().unwrap()[0].size, 1000);
    store.delete_block(&digest).unwrap();
    store.delete_block(&digest).unwrap();
    assert!(matches!(
        store.get_block(&digest),
        Err(StoreError::NotFound {
            kind: ObjectKind::Block,
            ..
        })
    ));
}

#[test]
fn put_block_refuses_bytes_that_do_not_match_the_digest() {
    let dir = temp_dir();
    let store = LocalStore::open(dir.path()).unwrap();
    let digest = Digest::of(b"right");
    assert!(matches!(
        store.put_block(&digest, b"wrong"),
        Err(StoreError::DigestMismatch { .. })
    ));
    assert!(!store.has_block(&digest).unwrap());
    let too_big = vec![0u8; BLOCK_SIZE + 1];
    assert!(matches!(
        store.put_block(&Digest::of(&too_big), &too_big),
        Err(StoreError::BlockTooLarge { .. })
    ));
}

#[test]
fn a_flipped_byte_in_a_stored_block_is_a_read_error() {
    let dir = temp_dir();
    let store = LocalStore::open(dir.path()).unwrap();
    let data = bytes("corrupt me", 4096);
    let digest = Digest::of(&data);
    store.put_block(&digest, &data).unwrap();
    flip_byte(&store.block_path(&digest), 100);
    match store.get_block(&digest) {
        Err(StoreError::Corrupt {
            kind,
            digest: d,
            actual,
        }) => {
            assert_eq!(kind, ObjectKind::Block);
            assert_eq!(d, digest);
            assert_ne!(actual, digest);
        }
        other => panic!("expected a corrupt block, got {other:?}"),
    }
}

#[test]
fn a_corrupt_manifest_is_a_read_error() {
    let dir = temp_dir();
    let store = LocalStore::open(dir.path()).unwrap();
    let (digest, stored) = store.put_manifest(br#"{"format_version":1}"#).unwrap();
    assert_eq!(stored, Stored::Added);
    assert_eq!(digest, Digest::of(br#"{"format_version":1}"#));
    assert_eq!(
        store.put_manifest(br#"{"format_version":1}"#).unwrap().1,
        Stored::AlreadyPresent
    );
    flip_byte(&store.manifest_path(&digest), 3);
    assert!(matches!(
        store.get_manifest(&digest),
        Err(StoreError::Corrupt {
            kind: ObjectKind::Manifest,
            ..
        })
    ));
}

#[test]
fn a_truncated_block_is_replaced_by_the_next_put_without_claiming_it() {
    let dir = temp_dir();
    let store = LocalStore::open(dir.path()).unwrap();
    let data = bytes("truncated", 5000);
    let digest = Digest::of(&data);
    store.put_block(&digest, &data).unwrap();
    let path = store.block_path(&digest);
    fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
    fs::write(&path, &data[..10]).unwrap();
    // Someone referenced the block before: the repair must not report it as this put's own.
    assert_eq!(
        store.put_block(&digest, &data).unwrap(),
        Stored::AlreadyPresent
    );
    assert_eq!(store.get_block(&digest).unwrap(), data);
}

#[test]
fn index_entries_are_created_only_if_absent() {
    let dir = temp_dir();
    let store = LocalStore::open(dir.path()).unwrap();
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
    assert_eq!(store.index_get(&key).unwrap(), Some(a));
    assert_eq!(store.list_index().unwrap(), vec![(key.clone(), a)]);
    assert!(
        dir.path()
            .join("index/docker.io%2Flibrary%2Fpython%3A3.12")
            .is_file()
    );
    store.index_delete(&key).unwrap();
    store.index_delete(&key).unwrap();
    assert_eq!(
        store.index_create_if_absent(&key, &b).unwrap(),
        IndexCreate::Created
    );
    assert_eq!(store.index_get(&key).unwrap(), Some(b));
}

#[test]
fn concurrent_index_creates_have_exactly_one_winner() {
    let dir = temp_dir();
    let key = IndexKey::try_new("template/racy").unwrap();
    let threads = 8;
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|i| {
            // Separate handles on one directory, as separate processes would have.
            let store = LocalStore::open(dir.path()).unwrap();
            let (key, barrier) = (key.clone(), barrier.clone());
            std::thread::spawn(move || {
                let digest = Digest::of(format!("candidate {i}").as_bytes());
                barrier.wait();
                (digest, store.index_create_if_absent(&key, &digest).unwrap())
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let winners: Vec<_> = results
        .iter()
        .filter(|(_, r)| *r == IndexCreate::Created)
        .map(|(d, _)| *d)
        .collect();
    assert_eq!(winners.len(), 1, "{results:?}");
    for (_, result) in &results {
        if let IndexCreate::Exists(existing) = result {
            assert_eq!(*existing, winners[0]);
        }
    }
    let store = LocalStore::open(dir.path()).unwrap();
    assert_eq!(store.index_get(&key).unwrap(), Some(winners[0]));
}

#[test]
fn concurrent_puts_of_one_block_report_added_once() {
    let dir = temp_dir();
    let data = Arc::new(bytes("shared", 100_000));
    let digest = Digest::of(&data);
    let threads = 8;
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let store = LocalStore::open(dir.path()).unwrap();
            let (data, barrier) = (data.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                store.put_block(&digest, &data).unwrap()
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(
        results.iter().filter(|r| **r == Stored::Added).count(),
        1,
        "{results:?}"
    );
    let store = LocalStore::open(dir.path()).unwrap();
    assert_eq!(store.get_block(&digest).unwrap(), *data);
    let staging = fs::read_dir(dir.path().join("tmp")).unwrap().count();
    assert_eq!(staging, 0, "staging files left behind");
}

#[test]
fn listings_skip_foreign_files() {
    let dir = temp_dir();
    let store = LocalStore::open(dir.path()).unwrap();
    let data = bytes("listed", 10);
    store.put_block(&Digest::of(&data), &data).unwrap();
    store.put_manifest(b"{}").unwrap();
    fs::write(dir.path().join("blocks/README"), "").unwrap();
    fs::create_dir(dir.path().join("blocks/zz")).unwrap();
    fs::write(dir.path().join("manifests/notes.txt"), "").unwrap();
    fs::write(dir.path().join("index/.hidden"), "").unwrap();
    assert_eq!(store.list_blocks().unwrap().len(), 1);
    assert_eq!(store.list_manifests().unwrap().len(), 1);
    assert!(store.list_index().unwrap().is_empty());
}
