//! `manifest.json`: what an artifact is, where it came from, and its files' blocks.
//!
//! A manifest is stored under the digest of its canonical JSON bytes (see `canonical`) and is
//! written last: it exists only once every block it lists exists, so its presence is the
//! commit point of a publish. Readers check `format_version` first and refuse versions they
//! do not know; fields added within a version are optional, so older readers ignore them.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::block::BLOCK_SIZE;
use crate::canonical;
use crate::digest::Digest;
use crate::entry::{EntryError, EntryKind, FileEntry, validate_entries};
use crate::host::HostFacts;
use crate::pack::PackFormat;

/// The manifest format this crate writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// Why a manifest cannot be built, written or read.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// Not JSON, or not the shape of a manifest.
    #[error("manifest json: {0}")]
    Json(#[from] serde_json::Error),
    /// Written by a format version this build does not read.
    #[error("manifest format version {0} is not supported (this build reads {FORMAT_VERSION})")]
    UnsupportedVersion(u32),
    /// Cut with another block size.
    #[error("manifest block size {0} is not supported (this build uses {BLOCK_SIZE})")]
    BlockSize(u64),
    /// An invalid entry or entry order.
    #[error("manifest entry: {0}")]
    Entry(#[from] EntryError),
    /// `rootfs` names no regular file of the artifact.
    #[error("manifest rootfs {0:?} is not a file of the artifact")]
    RootfsNotAFile(String),
}

/// What an artifact is used for. All three share the same shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ArtifactKind {
    /// A golden checkpoint that creates restore from.
    Template,
    /// A live snapshot of a sandbox, usable as a template.
    Snapshot,
    /// The checkpoint of a paused sandbox.
    Checkpoint,
}

/// The runtime an artifact restores into, tagged by `kind`. A microVM runtime will add its
/// own variant with its machine shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Runtime {
    /// Linux namespaces + overlay rootfs + CRIU (`{"kind": "linux-namespaces"}`).
    LinuxNamespaces,
}

/// The image an artifact was built from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceImage {
    /// The image reference as given (`python:3.12`, `oci-archive:/x.tar`).
    pub reference: String,
    /// The resolved image's digest (`sha256:...`), when the source has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
}

/// Where an artifact comes from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lineage {
    /// The image it was built from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<SourceImage>,
    /// The manifest digest of the artifact it derives from (a snapshot's template).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<Digest>,
}

/// Which file of the artifact is the packed rootfs, and how it is packed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RootfsImage {
    /// Path of a regular file entry.
    pub path: String,
    /// `erofs` (mounted read-only as the overlay's lower layer) or `tar` (unpacked first).
    pub format: PackFormat,
}

/// Everything a manifest records besides its files: the caller's part of a publish.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ManifestMeta {
    /// Template, snapshot or checkpoint.
    pub kind: ArtifactKind,
    /// The runtime the artifact restores into.
    pub runtime: Runtime,
    /// Digest of the execd binary inside the checkpoint; a restore must inject exactly it.
    pub execd_digest: Digest,
    /// The host the artifact was made on.
    pub host: HostFacts,
    /// Source image and parent artifact.
    #[serde(default)]
    pub lineage: Lineage,
    /// When the artifact was made.
    pub created_at: DateTime<Utc>,
    /// Recorded policy, opaque here: the server's egress policy, metadata, expiry settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<serde_json::Value>,
    /// Free-form labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The packed rootfs among the files, if the artifact has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rootfs: Option<RootfsImage>,
}

impl ManifestMeta {
    /// Metadata for a Linux-namespaces artifact made now, without lineage, policy, labels or
    /// rootfs (set those fields directly).
    pub fn new(kind: ArtifactKind, execd_digest: Digest, host: HostFacts) -> Self {
        ManifestMeta {
            kind,
            runtime: Runtime::LinuxNamespaces,
            execd_digest,
            host,
            lineage: Lineage::default(),
            created_at: Utc::now(),
            policy: None,
            labels: BTreeMap::new(),
            rootfs: None,
        }
    }
}

/// A whole manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT_VERSION`] when written by this build.
    pub format_version: u32,
    /// [`BLOCK_SIZE`]: recorded so the format says how it was cut.
    pub block_size: u64,
    /// The caller's metadata, flattened into the top level.
    #[serde(flatten)]
    pub meta: ManifestMeta,
    /// Every entry of the tree, in tree order.
    pub files: Vec<FileEntry>,
}

/// Only the version, read before the rest.
#[derive(Deserialize)]
struct VersionProbe {
    format_version: u32,
}

impl Manifest {
    /// A manifest of the current format over `files` (validated).
    pub fn try_new(meta: ManifestMeta, files: Vec<FileEntry>) -> Result<Self, ManifestError> {
        let manifest = Manifest {
            format_version: FORMAT_VERSION,
            block_size: BLOCK_SIZE as u64,
            meta,
            files,
        };
        manifest.validate()?;
        Ok(manifest)
    }

    /// Parse and validate stored bytes. The version is checked before anything else.
    pub fn from_slice(bytes: &[u8]) -> Result<Self, ManifestError> {
        let probe: VersionProbe = serde_json::from_slice(bytes)?;
        if probe.format_version != FORMAT_VERSION {
            return Err(ManifestError::UnsupportedVersion(probe.format_version));
        }
        let manifest: Manifest = serde_json::from_slice(bytes)?;
        manifest.validate()?;
        Ok(manifest)
    }

    /// The canonical JSON bytes: what is stored and what the digest covers.
    pub fn to_bytes(&self) -> Result<Vec<u8>, ManifestError> {
        Ok(canonical::to_vec(self)?)
    }

    /// The digest of [`Manifest::to_bytes`].
    pub fn digest(&self) -> Result<Digest, ManifestError> {
        Ok(Digest::of(&self.to_bytes()?))
    }

    /// Check version, block size, every entry, their order, and the rootfs reference.
    pub fn validate(&self) -> Result<(), ManifestError> {
        if self.format_version != FORMAT_VERSION {
            return Err(ManifestError::UnsupportedVersion(self.format_version));
        }
        if self.block_size != BLOCK_SIZE as u64 {
            return Err(ManifestError::BlockSize(self.block_size));
        }
        validate_entries(&self.files)?;
        if let Some(rootfs) = &self.meta.rootfs {
            let is_file = self
                .files
                .iter()
                .any(|f| f.path == rootfs.path && matches!(f.kind, EntryKind::File { .. }));
            if !is_file {
                return Err(ManifestError::RootfsNotAFile(rootfs.path.clone()));
            }
        }
        Ok(())
    }

    /// Every distinct block the manifest references.
    pub fn blocks(&self) -> BTreeSet<Digest> {
        self.files
            .iter()
            .filter_map(|f| match &f.kind {
                EntryKind::File { blocks, .. } => Some(blocks),
                _ => None,
            })
            .flatten()
            .copied()
            .collect()
    }

    /// The total size of the regular files.
    pub fn total_bytes(&self) -> u64 {
        self.files
            .iter()
            .map(|f| match f.kind {
                EntryKind::File { size, .. } => size,
                _ => 0,
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> ManifestMeta {
        let mut meta = ManifestMeta::new(
            ArtifactKind::Template,
            Digest::of(b"execd"),
            HostFacts {
                kernel: "6.1".into(),
                criu_version: Some("4.2".into()),
                arch: "x86_64".into(),
                cpu_features: vec!["avx".into()],
            },
        );
        meta.created_at = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        meta.lineage.source = Some(SourceImage {
            reference: "python:3.12".into(),
            digest: Some("sha256:abc".into()),
        });
        meta.policy = Some(serde_json::json!({"egress": {"default": "deny"}, "a": 1}));
        meta.labels.insert("team".into(), "x".into());
        meta
    }

    fn files() -> Vec<FileEntry> {
        vec![
            FileEntry {
                path: "rootfs.erofs".into(),
                mode: 0o644,
                kind: EntryKind::File {
                    size: 3,
                    blocks: vec![Digest::of(b"abc")],
                },
            },
            FileEntry {
                path: "upper".into(),
                mode: 0o755,
                kind: EntryKind::Dir,
            },
        ]
    }

    #[test]
    fn round_trips_through_canonical_bytes() {
        let mut meta = meta();
        meta.rootfs = Some(RootfsImage {
            path: "rootfs.erofs".into(),
            format: PackFormat::Erofs,
        });
        let manifest = Manifest::try_new(meta, files()).unwrap();
        let bytes = manifest.to_bytes().unwrap();
        let parsed = Manifest::from_slice(&bytes).unwrap();
        assert_eq!(parsed, manifest);
        assert_eq!(parsed.to_bytes().unwrap(), bytes);
        assert_eq!(manifest.digest().unwrap(), Digest::of(&bytes));
    }

    #[test]
    fn json_has_the_documented_top_level_fields() {
        let manifest = Manifest::try_new(meta(), files()).unwrap();
        let json: serde_json::Value =
            serde_json::from_slice(&manifest.to_bytes().unwrap()).unwrap();
        assert_eq!(json["format_version"], FORMAT_VERSION);
        assert_eq!(json["kind"], "template");
        assert_eq!(
            json["runtime"],
            serde_json::json!({"kind": "linux-namespaces"})
        );
        assert_eq!(json["host"]["criu_version"], "4.2");
        assert_eq!(json["lineage"]["source"]["reference"], "python:3.12");
        assert_eq!(json["created_at"], "2023-11-14T22:13:20Z");
        assert_eq!(json["files"][0]["kind"], "file");
        assert!(json.get("rootfs").is_none());
    }

    #[test]
    fn refuses_unknown_versions_before_parsing_the_rest() {
        let bytes = br#"{"format_version": 2, "whatever": true}"#;
        assert!(matches!(
            Manifest::from_slice(bytes),
            Err(ManifestError::UnsupportedVersion(2))
        ));
    }

    #[test]
    fn rootfs_must_name_a_file() {
        let mut meta = meta();
        meta.rootfs = Some(RootfsImage {
            path: "upper".into(),
            format: PackFormat::Tar,
        });
        assert!(matches!(
            Manifest::try_new(meta, files()),
            Err(ManifestError::RootfsNotAFile(_))
        ));
    }

    #[test]
    fn lists_distinct_blocks() {
        let mut files = files();
        files.push(files[0].clone());
        files[2].path = "z".into();
        let manifest = Manifest::try_new(meta(), files).unwrap();
        assert_eq!(manifest.blocks().len(), 1);
        assert_eq!(manifest.total_bytes(), 6);
    }
}
