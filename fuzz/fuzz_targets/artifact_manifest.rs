//! Artifact manifests (`fastbox_artifact::Manifest`) on arbitrary bytes: `from_slice` never
//! panics, and a manifest it accepts is valid, and its canonical bytes parse back to the same
//! manifest and the same bytes.
#![no_main]

use fastbox_artifact::Manifest;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(manifest) = Manifest::from_slice(data) else {
        return;
    };
    manifest
        .validate()
        .expect("from_slice returned a manifest that validate refuses");
    let bytes = manifest
        .to_bytes()
        .expect("an accepted manifest has canonical bytes");
    let again = Manifest::from_slice(&bytes).expect("canonical bytes parse");
    assert_eq!(again, manifest, "canonical bytes change the manifest");
    assert_eq!(
        again.to_bytes().expect("canonical bytes"),
        bytes,
        "canonical bytes are not a fixed point"
    );
    assert_eq!(
        manifest.digest().expect("digest"),
        fastbox_artifact::Digest::of(&bytes)
    );
    let blocks = manifest.blocks();
    let listed: usize = manifest
        .files
        .iter()
        .map(|f| match &f.kind {
            fastbox_artifact::EntryKind::File { blocks, .. } => blocks.len(),
            _ => 0,
        })
        .sum();
    assert!(blocks.len() <= listed);
    let _ = manifest.total_bytes();
});
