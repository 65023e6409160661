//! OCI / Docker image metadata: manifests, indexes, configs, platform selection, and the
//! pipeline shared by every image source (layout, archives, registry): manifest -> verified
//! config -> layers applied in order.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use serde::Deserialize;

use crate::digest::verify_bytes;
use crate::error::ImageError;
use crate::progress::{Progress, mib};
use crate::resolved::ImageRuntimeConfig;

/// Media types this crate knows.
pub mod media {
    pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
    pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
    pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
    pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
    pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
    pub const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
    pub const DOCKER_SCHEMA1: &str = "application/vnd.docker.distribution.manifest.v1+json";
    pub const DOCKER_SCHEMA1_SIGNED: &str =
        "application/vnd.docker.distribution.manifest.v1+prettyjws";
    /// Layer types unpacked here (compression is sniffed from the bytes in any case).
    pub const LAYERS: &[&str] = &[
        "application/vnd.oci.image.layer.v1.tar",
        "application/vnd.oci.image.layer.v1.tar+gzip",
        "application/vnd.oci.image.layer.v1.tar+zstd",
        "application/vnd.oci.image.layer.nondistributable.v1.tar",
        "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
        "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
        "application/vnd.docker.image.rootfs.diff.tar.gzip",
        "application/vnd.docker.image.rootfs.diff.tar",
    ];
    /// What the registry client accepts for manifests.
    pub const MANIFEST_ACCEPT: &[&str] = &[OCI_INDEX, OCI_MANIFEST, DOCKER_LIST, DOCKER_MANIFEST];
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Descriptor {
    #[serde(default)]
    pub media_type: String,
    pub digest: String,
    #[serde(default)]
    pub size: u64,
    #[serde(default)]
    pub platform: Option<Platform>,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    #[serde(default)]
    pub urls: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub(crate) struct Platform {
    #[serde(default)]
    pub architecture: String,
    #[serde(default)]
    pub os: String,
    #[serde(default)]
    pub variant: Option<String>,
}

impl Platform {
    fn label(&self) -> String {
        match &self.variant {
            Some(v) => format!("{}/{}/{v}", self.os, self.architecture),
            None => format!("{}/{}", self.os, self.architecture),
        }
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct Index {
    #[serde(default)]
    pub manifests: Vec<Descriptor>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Manifest {
    pub config: Descriptor,
    #[serde(default)]
    pub layers: Vec<Descriptor>,
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct ConfigBlob {
    #[serde(default)]
    pub os: String,
    #[serde(default)]
    pub architecture: String,
    #[serde(default)]
    pub config: Option<ContainerConfig>,
    #[serde(default)]
    pub rootfs: Option<RootFs>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub(crate) struct ContainerConfig {
    #[serde(default)]
    pub entrypoint: Option<Vec<String>>,
    #[serde(default)]
    pub cmd: Option<Vec<String>>,
    #[serde(default)]
    pub env: Option<Vec<String>>,
    #[serde(default)]
    pub working_dir: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct RootFs {
    #[serde(default)]
    pub diff_ids: Vec<String>,
}

impl ConfigBlob {
    pub(crate) fn platform(&self) -> Option<String> {
        (!self.os.is_empty() && !self.architecture.is_empty())
            .then(|| format!("{}/{}", self.os, self.architecture))
    }

    pub(crate) fn runtime(&self) -> ImageRuntimeConfig {
        let c = self.config.as_ref();
        ImageRuntimeConfig {
            entrypoint: c.and_then(|c| c.entrypoint.clone()).unwrap_or_default(),
            cmd: c.and_then(|c| c.cmd.clone()).unwrap_or_default(),
            env: c.and_then(|c| c.env.clone()).unwrap_or_default(),
            working_dir: c
                .and_then(|c| c.working_dir.clone())
                .filter(|w| !w.is_empty()),
            user: c.and_then(|c| c.user.clone()).filter(|u| !u.is_empty()),
        }
    }
}

/// What a manifest document is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ManifestKind {
    Index,
    Image,
}

/// Classifies a manifest by its `mediaType`, else the HTTP content type, else its shape.
pub(crate) fn classify_manifest(
    bytes: &[u8],
    content_type: Option<&str>,
    what: &str,
) -> Result<ManifestKind, ImageError> {
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Probe {
        #[serde(default)]
        media_type: Option<String>,
        #[serde(default)]
        manifests: Option<serde_json::Value>,
        #[serde(default)]
        layers: Option<serde_json::Value>,
        #[serde(default)]
        fs_layers: Option<serde_json::Value>,
        #[serde(default)]
        schema_version: Option<u32>,
    }
    let probe: Probe = serde_json::from_slice(bytes)
        .map_err(|e| ImageError::invalid_image(what, format!("manifest is not json: {e}")))?;
    let content_type = content_type
        .map(|c| c.split(';').next().unwrap_or("").trim())
        .filter(|c| !c.is_empty());
    let media_type = probe.media_type.as_deref().or(content_type).unwrap_or("");
    match media_type {
        media::OCI_INDEX | media::DOCKER_LIST => return Ok(ManifestKind::Index),
        media::OCI_MANIFEST | media::DOCKER_MANIFEST => return Ok(ManifestKind::Image),
        media::DOCKER_SCHEMA1 | media::DOCKER_SCHEMA1_SIGNED => {
            return Err(ImageError::UnsupportedMediaType {
                what: format!(
                    "{what} (docker schema 1 is deprecated; re-push the image with a current client)"
                ),
                media_type: media_type.to_owned(),
            });
        }
        _ => {}
    }
    if probe.fs_layers.is_some() || probe.schema_version == Some(1) {
        return Err(ImageError::UnsupportedMediaType {
            what: what.to_owned(),
            media_type: media::DOCKER_SCHEMA1.to_owned(),
        });
    }
    if probe.manifests.is_some() {
        return Ok(ManifestKind::Index);
    }
    if probe.layers.is_some() {
        return Ok(ManifestKind::Image);
    }
    Err(ImageError::UnsupportedMediaType {
        what: what.to_owned(),
        media_type: media_type.to_owned(),
    })
}

/// The manifest of `index` for `platform` (`os/arch[/variant]`). An index with one manifest
/// and no platform information (common in OCI layouts) yields that manifest.
pub(crate) fn select_platform<'a>(
    index: &'a Index,
    platform: &str,
    reference: &str,
) -> Result<&'a Descriptor, ImageError> {
    let mut parts = platform.split('/');
    let (os, arch, variant) = (
        parts.next().unwrap_or(""),
        parts.next().unwrap_or(""),
        parts.next(),
    );
    if let [only] = index.manifests.as_slice()
        && only.platform.is_none()
    {
        return Ok(only);
    }
    let found = index.manifests.iter().find(|d| {
        d.platform.as_ref().is_some_and(|p| {
            p.os == os
                && p.architecture == arch
                && match (variant, p.variant.as_deref()) {
                    (None, _) => true,
                    (Some(want), Some(have)) => want == have,
                    (Some(want), None) => arch == "arm64" && want == "v8",
                }
        })
    });
    found.ok_or_else(|| {
        let available: Vec<String> = index
            .manifests
            .iter()
            .map(|d| {
                d.platform
                    .as_ref()
                    .map_or_else(|| "unknown".to_owned(), Platform::label)
            })
            .collect();
        ImageError::NoMatchingPlatform {
            reference: reference.to_owned(),
            platform: platform.to_owned(),
            available: if available.is_empty() {
                "none".into()
            } else {
                available.join(", ")
            },
        }
    })
}

/// Where blobs come from. `key` is a digest for OCI sources and a file name for docker archives.
pub(crate) trait BlobSource {
    fn open(
        &self,
        key: &str,
        size: Option<u64>,
        progress: &dyn Progress,
    ) -> Result<Box<dyn Read + '_>, ImageError>;
}

/// Reads a small blob (config, manifest) whole, at most `limit` bytes, verifying its digest.
pub(crate) fn read_verified(
    source: &dyn BlobSource,
    digest: &str,
    what: &str,
    progress: &dyn Progress,
) -> Result<Vec<u8>, ImageError> {
    const LIMIT: u64 = 64 * 1024 * 1024;
    let mut bytes = Vec::new();
    source
        .open(digest, None, progress)?
        .take(LIMIT + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| ImageError::invalid_image(what, format!("cannot read {digest}: {e}")))?;
    if bytes.len() as u64 > LIMIT {
        return Err(ImageError::invalid_image(
            what,
            format!("{digest} is larger than {}", mib(LIMIT)),
        ));
    }
    verify_bytes(what, &bytes, digest)?;
    Ok(bytes)
}

/// One layer to apply.
#[derive(Debug, Clone)]
pub(crate) struct LayerSpec {
    pub key: String,
    pub digest: Option<String>,
    pub diff_id: Option<String>,
    pub size: Option<u64>,
}

/// An image ready to unpack: its content address and its layers.
#[derive(Debug, Clone)]
pub(crate) struct PreparedImage {
    /// sha256 of the config blob: the image ID, which names the rootfs content exactly
    /// (it lists the uncompressed digests of every layer).
    pub config_digest: String,
    pub manifest_digest: Option<String>,
    pub runtime: ImageRuntimeConfig,
    pub layers: Vec<LayerSpec>,
    /// `os/architecture` from the config, when it says.
    pub platform: Option<String>,
}

/// Reads the config a manifest points at and lists its layers.
pub(crate) fn prepare_manifest(
    manifest_bytes: &[u8],
    manifest_digest: &str,
    source: &dyn BlobSource,
    what: &str,
    progress: &dyn Progress,
) -> Result<PreparedImage, ImageError> {
    let manifest: Manifest = serde_json::from_slice(manifest_bytes)
        .map_err(|e| ImageError::invalid_image(format!("manifest of {what}"), e))?;
    let config_type = manifest.config.media_type.as_str();
    if !matches!(config_type, "" | media::OCI_CONFIG | media::DOCKER_CONFIG) {
        return Err(ImageError::UnsupportedMediaType {
            what: format!("config of {what} (an OCI artifact, not a container image)"),
            media_type: config_type.to_owned(),
        });
    }
    for layer in &manifest.layers {
        if !media::LAYERS.contains(&layer.media_type.as_str()) || !layer.urls.is_empty() {
            return Err(ImageError::UnsupportedMediaType {
                what: format!("layer {} of {what}", layer.digest),
                media_type: layer.media_type.clone(),
            });
        }
        crate::digest::digest_hex(&layer.digest)?;
    }
    let config_bytes = read_verified(
        source,
        &manifest.config.digest,
        &format!("config of {what}"),
        progress,
    )?;
    let config: ConfigBlob = serde_json::from_slice(&config_bytes)
        .map_err(|e| ImageError::invalid_image(format!("config of {what}"), e))?;
    let diff_ids = config
        .rootfs
        .as_ref()
        .map(|r| r.diff_ids.clone())
        .unwrap_or_default();
    if !diff_ids.is_empty() && diff_ids.len() != manifest.layers.len() {
        return Err(ImageError::invalid_image(
            what,
            format!(
                "manifest lists {} layers but the config {} diff_ids",
                manifest.layers.len(),
                diff_ids.len()
            ),
        ));
    }
    let layers = manifest
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| LayerSpec {
            key: l.digest.clone(),
            digest: Some(l.digest.clone()),
            diff_id: diff_ids.get(i).cloned(),
            size: Some(l.size),
        })
        .collect();
    Ok(PreparedImage {
        config_digest: manifest.config.digest.clone(),
        manifest_digest: Some(manifest_digest.to_owned()),
        runtime: config.runtime(),
        platform: config.platform(),
        layers,
    })
}

/// Applies the layers of `image` to `rootfs`, in order.
pub(crate) fn unpack_layers(
    image: &PreparedImage,
    source: &dyn BlobSource,
    rootfs: &Path,
    progress: &dyn Progress,
) -> Result<(), ImageError> {
    let as_root = nix::unistd::geteuid().is_root();
    let total = image.layers.len();
    for (i, layer) in image.layers.iter().enumerate() {
        let label = short(&layer.key);
        let blob = source.open(&layer.key, layer.size, progress)?;
        progress.message(&format!(
            "unpacking layer {}/{total} {label}{}",
            i + 1,
            layer
                .size
                .map(|s| format!(" ({})", mib(s)))
                .unwrap_or_default()
        ));
        let stats = crate::unpack::apply_layer_blob(
            rootfs,
            blob,
            &label,
            layer.digest.as_deref(),
            layer.diff_id.as_deref(),
            as_root,
        )?;
        tracing::debug!(layer = %label, entries = stats.entries, whiteouts = stats.whiteouts, skipped = stats.skipped, "layer applied");
    }
    Ok(())
}

/// `sha256:0123456789ab` for messages. `key` may be unchecked (a digest an index names, a
/// file name in an archive): it is cut at a character, never inside one.
pub(crate) fn short(key: &str) -> String {
    match key.strip_prefix("sha256:") {
        Some(hex) => format!("sha256:{}", hex.chars().take(12).collect::<String>()),
        None => key.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index(json: &str) -> Index {
        serde_json::from_str(json).unwrap()
    }

    const D: &str = "sha256:0000000000000000000000000000000000000000000000000000000000000000";

    #[test]
    fn platform_selection_picks_the_host_platform() {
        let idx = index(&format!(
            r#"{{"manifests":[
              {{"digest":"{D}1","platform":{{"os":"linux","architecture":"arm64","variant":"v8"}}}},
              {{"digest":"{D}2","platform":{{"os":"linux","architecture":"amd64"}}}},
              {{"digest":"{D}3","platform":{{"os":"unknown","architecture":"unknown"}}}}]}}"#
        ));
        assert!(
            select_platform(&idx, "linux/amd64", "x")
                .unwrap()
                .digest
                .ends_with('2')
        );
        assert!(
            select_platform(&idx, "linux/arm64/v8", "x")
                .unwrap()
                .digest
                .ends_with('1')
        );
        assert!(
            select_platform(&idx, "linux/arm64", "x")
                .unwrap()
                .digest
                .ends_with('1')
        );
        let err = select_platform(&idx, "linux/s390x", "x")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("linux/arm64/v8, linux/amd64, unknown/unknown"),
            "{err}"
        );
    }

    #[test]
    fn short_labels_cut_at_a_character() {
        // A registry's index may name any string as a digest; it is shown before it is checked.
        let hex = "0123456789abcdef";
        assert_eq!(short(&format!("sha256:{hex}")), "sha256:0123456789ab");
        assert_eq!(
            short("sha256:01234567890\u{e9}abc"),
            "sha256:01234567890\u{e9}"
        );
        assert_eq!(short("sha256:\u{1f600}"), "sha256:\u{1f600}");
        assert_eq!(short("blobs/layer.tar"), "blobs/layer.tar");
    }

    #[test]
    fn a_single_manifest_without_platform_is_taken() {
        let idx = index(&format!(r#"{{"manifests":[{{"digest":"{D}"}}]}}"#));
        assert_eq!(select_platform(&idx, "linux/amd64", "x").unwrap().digest, D);
    }

    #[test]
    fn manifests_are_classified_by_media_type_then_shape() {
        let c = |s: &str, ct| classify_manifest(s.as_bytes(), ct, "m");
        assert_eq!(
            c(
                &format!(r#"{{"mediaType":"{}"}}"#, media::DOCKER_LIST),
                None
            )
            .unwrap(),
            ManifestKind::Index
        );
        assert_eq!(
            c("{}", Some(media::OCI_MANIFEST)).unwrap(),
            ManifestKind::Image
        );
        assert_eq!(c(r#"{"manifests":[]}"#, None).unwrap(), ManifestKind::Index);
        assert_eq!(
            c(r#"{"config":{},"layers":[]}"#, None).unwrap(),
            ManifestKind::Image
        );
        let err = c(r#"{"schemaVersion":1,"fsLayers":[]}"#, None).unwrap_err();
        assert!(matches!(err, ImageError::UnsupportedMediaType { .. }));
        let err = c(r#"{"mediaType":"application/vnd.example+json"}"#, None).unwrap_err();
        assert!(
            err.to_string()
                .contains("unsupported media type \"application/vnd.example+json\""),
            "{err}"
        );
    }
}
