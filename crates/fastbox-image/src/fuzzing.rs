//! Entry points for the fuzz targets in `fuzz/` (see `docs/fuzzing.md`): the crate's parsers
//! of untrusted bytes, reached the way the image sources reach them. Not an API: hidden from
//! the docs and free to change with the fuzz targets.

use std::io::{self, Read};
use std::path::Path;

use crate::error::ImageError;
use crate::oci::{self, BlobSource, Index, ManifestKind};
use crate::progress::{NoProgress, Progress};
use crate::resolved::ImageRuntimeConfig;
use crate::unpack::{self, LayerStats};

/// The config blob [`read_oci_document`] serves for any digest: `{}`, whose digest
/// ([`FUZZ_CONFIG_DIGEST`]) a manifest must name for its config to be read.
pub const FUZZ_CONFIG: &[u8] = b"{}";

/// `sha256:` of [`FUZZ_CONFIG`].
pub const FUZZ_CONFIG_DIGEST: &str =
    "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a";

/// Applies one layer blob (tar, gzip or zstd, sniffed as for any layer) on top of `root`, as
/// an image pull does, without expected digests.
pub fn apply_layer(root: &Path, blob: &[u8], as_root: bool) -> Result<LayerStats, ImageError> {
    unpack::apply_layer_blob(root, blob, "fuzz", None, None, as_root)
}

/// Reads `document` as a registry's manifest answer is read: classified (by its `mediaType`,
/// else `content_type`, else its shape), then an index's manifest for `platform` is chosen, or
/// an image manifest is checked and its config ([`FUZZ_CONFIG`]) read. Returns the labels the
/// pull would print for the chosen manifest or the layers.
pub fn read_oci_document(
    document: &[u8],
    content_type: Option<&str>,
    platform: &str,
) -> Result<Vec<String>, ImageError> {
    match oci::classify_manifest(document, content_type, "fuzz input")? {
        ManifestKind::Index => {
            let index: Index = serde_json::from_slice(document)
                .map_err(|e| ImageError::invalid_image("index of fuzz input", e))?;
            let chosen = oci::select_platform(&index, platform, "fuzz input")?;
            Ok(vec![oci::short(&chosen.digest)])
        }
        ManifestKind::Image => {
            let prepared = oci::prepare_manifest(
                document,
                FUZZ_CONFIG_DIGEST,
                &FixedConfig,
                "fuzz input",
                &NoProgress,
            )?;
            Ok(prepared.layers.iter().map(|l| oci::short(&l.key)).collect())
        }
    }
}

/// Reads `config` as an image config blob: how to run the image, and its platform.
pub fn read_oci_config(config: &[u8]) -> Result<(ImageRuntimeConfig, Option<String>), ImageError> {
    let config: oci::ConfigBlob = serde_json::from_slice(config)
        .map_err(|e| ImageError::invalid_image("config of fuzz input", e))?;
    Ok((config.runtime(), config.platform()))
}

/// Serves [`FUZZ_CONFIG`] for every key.
struct FixedConfig;

impl BlobSource for FixedConfig {
    fn open(
        &self,
        _key: &str,
        _size: Option<u64>,
        _progress: &dyn Progress,
    ) -> Result<Box<dyn Read + '_>, ImageError> {
        Ok(Box::new(io::Cursor::new(FUZZ_CONFIG)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fixed_config_digest_is_its_sha256() {
        assert_eq!(
            crate::digest::sha256_digest(FUZZ_CONFIG),
            FUZZ_CONFIG_DIGEST
        );
    }
}
