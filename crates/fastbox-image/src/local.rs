//! Images on the local file system: OCI image layouts (directories or tar archives) and
//! `docker save` archives.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::digest::{digest_hex, sha256_digest};
use crate::error::ImageError;
use crate::oci::{self, BlobSource, Index, LayerSpec, ManifestKind, PreparedImage};
use crate::progress::Progress;
use crate::reference::RegistryReference;

/// Files of an image, wherever they are kept.
pub(crate) trait FileTree {
    fn describe(&self) -> String;
    /// `None` when the file does not exist.
    fn open_file(&self, name: &str) -> io::Result<Option<Box<dyn Read + '_>>>;
}

/// A directory.
pub(crate) struct DirTree(pub PathBuf);

impl FileTree for DirTree {
    fn describe(&self) -> String {
        self.0.display().to_string()
    }

    fn open_file(&self, name: &str) -> io::Result<Option<Box<dyn Read + '_>>> {
        let components = crate::unpack::entry_components(Path::new(name))
            .map_err(|r| io::Error::new(io::ErrorKind::InvalidInput, r))?;
        let mut path = self.0.clone();
        path.extend(components);
        match File::open(&path) {
            Ok(f) => Ok(Some(Box::new(BufReader::new(f)))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// A tar file, indexed once so that members are read by seeking (no extraction). A gzipped
/// archive is first decompressed to `scratch` (removed on drop).
pub(crate) struct TarTree {
    path: PathBuf,
    shown: PathBuf,
    members: HashMap<String, (u64, u64)>,
    scratch: Option<PathBuf>,
}

impl TarTree {
    pub(crate) fn open(path: &Path, scratch_dir: &Path) -> Result<TarTree, ImageError> {
        let mut file = File::open(path).map_err(ImageError::io("cannot open archive", path))?;
        let mut magic = [0u8; 4];
        let n = file
            .read(&mut magic)
            .map_err(ImageError::io("cannot read archive", path))?;
        let (tar_path, scratch) =
            if crate::unpack::Compression::sniff(&magic[..n]) != crate::unpack::Compression::None {
                let tmp = scratch_dir.join(format!("archive-{}.tar", crate::cache::nonce()));
                let result = (|| -> io::Result<()> {
                    let src = BufReader::new(File::open(path)?);
                    let mut out = File::create(&tmp)?;
                    io::copy(&mut crate::unpack::decompress(src)?, &mut out)?;
                    Ok(())
                })();
                if let Err(e) = result {
                    let _ = std::fs::remove_file(&tmp);
                    return Err(ImageError::io("cannot decompress archive", path)(e));
                }
                (tmp.clone(), Some(tmp))
            } else {
                (path.to_owned(), None)
            };
        let mut tree = TarTree {
            path: tar_path,
            shown: path.to_owned(),
            members: HashMap::new(),
            scratch,
        };
        tree.index()
            .map_err(|e| ImageError::invalid_image(format!("archive {}", path.display()), e))?;
        Ok(tree)
    }

    fn index(&mut self) -> io::Result<()> {
        let mut archive = tar::Archive::new(File::open(&self.path)?);
        for entry in archive.entries_with_seek()? {
            let entry = entry?;
            if !matches!(
                entry.header().entry_type(),
                tar::EntryType::Regular | tar::EntryType::Continuous
            ) {
                continue;
            }
            let name = normalize_member(&entry.path()?.to_string_lossy());
            self.members
                .insert(name, (entry.raw_file_position(), entry.size()));
        }
        Ok(())
    }
}

impl Drop for TarTree {
    fn drop(&mut self) {
        if let Some(s) = &self.scratch {
            let _ = std::fs::remove_file(s);
        }
    }
}

fn normalize_member(name: &str) -> String {
    name.trim_start_matches("./")
        .trim_start_matches('/')
        .to_owned()
}

impl FileTree for TarTree {
    fn describe(&self) -> String {
        self.shown.display().to_string()
    }

    fn open_file(&self, name: &str) -> io::Result<Option<Box<dyn Read + '_>>> {
        let Some(&(offset, size)) = self.members.get(&normalize_member(name)) else {
            return Ok(None);
        };
        let mut f = File::open(&self.path)?;
        f.seek(SeekFrom::Start(offset))?;
        Ok(Some(Box::new(BufReader::new(f.take(size)))))
    }
}

/// Blobs of a file tree: digests live under `blobs/sha256/`, other keys are file names.
pub(crate) struct TreeBlobs<'a>(pub &'a dyn FileTree);

impl BlobSource for TreeBlobs<'_> {
    fn open(
        &self,
        key: &str,
        _size: Option<u64>,
        _progress: &dyn Progress,
    ) -> Result<Box<dyn Read + '_>, ImageError> {
        let name = if key.starts_with("sha256:") {
            format!("blobs/sha256/{}", digest_hex(key)?)
        } else {
            key.to_owned()
        };
        self.0
            .open_file(&name)
            .map_err(|e| {
                ImageError::invalid_image(
                    format!("image at {}", self.0.describe()),
                    format!("cannot read {name}: {e}"),
                )
            })?
            .ok_or_else(|| {
                ImageError::invalid_image(
                    format!("image at {}", self.0.describe()),
                    format!("{name} is missing"),
                )
            })
    }
}

fn read_json<T: for<'de> Deserialize<'de>>(
    tree: &dyn FileTree,
    name: &str,
    what: &str,
) -> Result<Option<T>, ImageError> {
    let invalid = |e: &dyn std::fmt::Display| {
        ImageError::invalid_image(
            format!("{what} at {}", tree.describe()),
            format!("{name}: {e}"),
        )
    };
    let Some(mut r) = tree.open_file(name).map_err(|e| invalid(&e))? else {
        return Ok(None);
    };
    let mut bytes = Vec::new();
    r.read_to_end(&mut bytes).map_err(|e| invalid(&e))?;
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| invalid(&e))
}

const REF_NAME: &str = "org.opencontainers.image.ref.name";
const CONTAINERD_NAME: &str = "io.containerd.image.name";

/// Reads an OCI layout: `selector` is a tag (`org.opencontainers.image.ref.name`), a full
/// name (`io.containerd.image.name`) or a manifest digest; without one, the layout must hold
/// a single image (or one index of platforms).
pub(crate) fn prepare_oci_layout(
    tree: &dyn FileTree,
    selector: Option<&str>,
    platform: &str,
    reference: &str,
    progress: &dyn Progress,
) -> Result<PreparedImage, ImageError> {
    let what = format!("OCI layout at {}", tree.describe());
    let layout: Option<serde_json::Value> = read_json(tree, "oci-layout", "OCI layout")?;
    if layout.is_none() {
        return Err(ImageError::invalid_image(
            &what,
            "no oci-layout file (is this an OCI image layout?)",
        ));
    }
    let index: Index = read_json(tree, "index.json", "OCI layout")?
        .ok_or_else(|| ImageError::invalid_image(&what, "no index.json"))?;
    let blobs = TreeBlobs(tree);
    let names = |idx: &Index| -> String {
        let n: Vec<String> = idx
            .manifests
            .iter()
            .map(|d| {
                d.annotations
                    .get(REF_NAME)
                    .or(d.annotations.get(CONTAINERD_NAME))
                    .cloned()
                    .unwrap_or_else(|| d.digest.clone())
            })
            .collect();
        if n.is_empty() {
            "none".into()
        } else {
            n.join(", ")
        }
    };
    let mut descriptor = match selector {
        Some(sel) => index
            .manifests
            .iter()
            .find(|d| {
                d.digest == sel
                    || d.annotations.get(REF_NAME).is_some_and(|n| n == sel)
                    || d.annotations.get(CONTAINERD_NAME).is_some_and(|n| {
                        n == sel
                            || RegistryReference::parse(sel)
                                .is_ok_and(|s| RegistryReference::parse(n).is_ok_and(|n| n == s))
                    })
            })
            .cloned()
            .ok_or_else(|| ImageError::NotFound {
                reference: reference.to_owned(),
                detail: format!(
                    "no manifest named {sel:?} in {what} (available: {})",
                    names(&index)
                ),
            })?,
        None if index.manifests.len() == 1 => index.manifests[0].clone(),
        None if !index.manifests.is_empty()
            && index.manifests.iter().all(|d| d.platform.is_some()) =>
        {
            oci::select_platform(&index, platform, reference)?.clone()
        }
        None if index.manifests.is_empty() => {
            return Err(ImageError::invalid_image(
                &what,
                "index.json lists no manifest",
            ));
        }
        None => {
            return Err(ImageError::InvalidReference {
                reference: reference.to_owned(),
                reason: format!(
                    "{what} holds several images; name one as oci:PATH:NAME (available: {})",
                    names(&index)
                ),
            });
        }
    };
    // Indexes may nest; a small bound keeps a malicious layout from looping.
    for _ in 0..8 {
        let bytes = oci::read_verified(
            &blobs,
            &descriptor.digest,
            &format!("manifest of {what}"),
            progress,
        )?;
        let media = (!descriptor.media_type.is_empty()).then_some(descriptor.media_type.as_str());
        match oci::classify_manifest(&bytes, media, &what)? {
            ManifestKind::Image => {
                return oci::prepare_manifest(&bytes, &descriptor.digest, &blobs, &what, progress);
            }
            ManifestKind::Index => {
                let nested: Index = serde_json::from_slice(&bytes)
                    .map_err(|e| ImageError::invalid_image(&what, e))?;
                descriptor = oci::select_platform(&nested, platform, reference)?.clone();
            }
        }
    }
    Err(ImageError::invalid_image(
        what,
        "indexes nested more than 8 deep",
    ))
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerArchiveEntry {
    config: String,
    #[serde(default)]
    repo_tags: Option<Vec<String>>,
    #[serde(default)]
    layers: Vec<String>,
}

/// Reads a `docker save` archive (`manifest.json` + config + `layer.tar`s, or the OCI-shaped
/// variant of newer Docker versions, which also has this `manifest.json`). `selector` picks
/// one of several images by repo tag.
pub(crate) fn prepare_docker_archive(
    tree: &dyn FileTree,
    selector: Option<&str>,
    reference: &str,
) -> Result<PreparedImage, ImageError> {
    let what = format!("docker archive {}", tree.describe());
    let entries: Vec<DockerArchiveEntry> = read_json(tree, "manifest.json", "docker archive")?
        .ok_or_else(|| {
            ImageError::invalid_image(&what, "no manifest.json (is this a docker save archive?)")
        })?;
    let tags = |e: &DockerArchiveEntry| e.repo_tags.clone().unwrap_or_default();
    let all_tags = || entries.iter().flat_map(tags).collect::<Vec<_>>().join(", ");
    let entry = match selector {
        Some(sel) => {
            let wanted = RegistryReference::parse(sel).ok();
            entries
                .iter()
                .find(|e| {
                    tags(e).iter().any(|t| {
                        t == sel
                            || wanted
                                .as_ref()
                                .is_some_and(|w| RegistryReference::parse(t).is_ok_and(|t| &t == w))
                    })
                })
                .ok_or_else(|| ImageError::NotFound {
                    reference: reference.to_owned(),
                    detail: format!(
                        "no image tagged {sel:?} in {what} (available: {})",
                        all_tags()
                    ),
                })?
        }
        None => match entries.as_slice() {
            [one] => one,
            [] => {
                return Err(ImageError::invalid_image(
                    &what,
                    "manifest.json lists no image",
                ));
            }
            _ => {
                return Err(ImageError::InvalidReference {
                    reference: reference.to_owned(),
                    reason: format!(
                        "{what} holds several images; name one as docker-archive:PATH:NAME:TAG (available: {})",
                        all_tags()
                    ),
                });
            }
        },
    };
    let mut config_bytes = Vec::new();
    tree.open_file(&entry.config)
        .and_then(|r| {
            r.ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "missing"))
                .and_then(|mut r| r.read_to_end(&mut config_bytes))
        })
        .map_err(|e| ImageError::invalid_image(&what, format!("config {}: {e}", entry.config)))?;
    let config: oci::ConfigBlob = serde_json::from_slice(&config_bytes)
        .map_err(|e| ImageError::invalid_image(&what, format!("config {}: {e}", entry.config)))?;
    let diff_ids = config
        .rootfs
        .as_ref()
        .map(|r| r.diff_ids.clone())
        .unwrap_or_default();
    if diff_ids.len() != entry.layers.len() {
        return Err(ImageError::invalid_image(
            &what,
            format!(
                "manifest.json lists {} layers but the config {} diff_ids",
                entry.layers.len(),
                diff_ids.len()
            ),
        ));
    }
    Ok(PreparedImage {
        config_digest: sha256_digest(&config_bytes),
        manifest_digest: None,
        runtime: config.runtime(),
        platform: config.platform(),
        layers: entry
            .layers
            .iter()
            .zip(diff_ids)
            .map(|(path, diff_id)| LayerSpec {
                key: path.clone(),
                digest: None,
                diff_id: Some(diff_id),
                size: None,
            })
            .collect(),
    })
}
