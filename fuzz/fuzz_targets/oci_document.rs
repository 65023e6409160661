//! OCI and Docker image documents (`fastbox-image`'s `oci` module) on arbitrary bytes: read
//! as a manifest answer is read (classified; an index's manifest chosen for a platform, or an
//! image manifest checked and its config read) and as a config blob. Nothing may panic.
#![no_main]

use fastbox_image::fuzzing::{read_oci_config, read_oci_document};
use fastbox_image::media;
use libfuzzer_sys::fuzz_target;

/// Content types a registry may answer with (the document's own `mediaType` wins).
const CONTENT_TYPES: &[Option<&str>] = &[
    None,
    Some("application/vnd.oci.image.index.v1+json; charset=utf-8"),
    Some(media::DOCKER_MANIFEST),
];
const PLATFORMS: &[&str] = &["linux/amd64", "linux/arm64/v8"];

fuzz_target!(|data: &[u8]| {
    for (i, content_type) in CONTENT_TYPES.iter().enumerate() {
        if let Ok(labels) = read_oci_document(data, *content_type, PLATFORMS[i % 2]) {
            for label in labels {
                assert!(
                    label.len() <= data.len(),
                    "a label longer than the document"
                );
            }
        }
    }
    let _ = read_oci_config(data);
});
