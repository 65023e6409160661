//! Golden checkpoints: an image started once, cold, with execd and nothing else, then
//! checkpointed with CRIU. Every create restores one (`Fastlet::restore_from`) and claims the
//! clone with its own token, environment and entrypoint. A template is built at most once per
//! image per node, kept under `DATA_DIR/templates/<image digest>/`, and found again after a
//! restart.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use fastbox_image::ResolvedImage;
use serde::{Deserialize, Serialize};

/// What `template.json` records.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Template {
    /// What names the template on this node: the image digest for the implicit template of
    /// an image, the template id (`tpl_...`) for one created through the templates API.
    #[serde(default)]
    pub key: String,
    /// The image the template was built from (`sha256:...`).
    pub image_digest: String,
    /// The image's canonical reference.
    pub image_reference: String,
    /// The unpacked image rootfs the checkpoint was taken over (the overlay lower layer).
    pub rootfs: PathBuf,
    /// The checkpoint directory (CRIU images, writable layer, `checkpoint.json`).
    pub checkpoint: PathBuf,
    /// The execd access token inside the checkpoint: the claim authenticates with it.
    pub golden_token: String,
    /// How long the build took (cold start, readiness, dump), milliseconds.
    pub build_ms: u64,
}

/// The file that marks a finished template (written last).
const TEMPLATE_FILE: &str = "template.json";

/// Where the template named `key` lives.
pub fn template_dir(data_dir: &Path, key: &str) -> PathBuf {
    let name = key.replace(':', "-");
    data_dir.join("templates").join(name)
}

/// Reads a finished template, if there is one.
pub fn load(dir: &Path) -> Option<Template> {
    let bytes = std::fs::read(dir.join(TEMPLATE_FILE)).ok()?;
    let mut t: Template = serde_json::from_slice(&bytes).ok()?;
    if t.key.is_empty() {
        t.key = t.image_digest.clone();
    }
    Some(t)
}

/// Writes `template.json` into `dir` (the commit point of a build).
pub fn commit(dir: &Path, template: &Template) -> std::io::Result<()> {
    let tmp = dir.join(".template.json.tmp");
    std::fs::write(
        &tmp,
        serde_json::to_vec_pretty(template).expect("serializes"),
    )?;
    std::fs::rename(tmp, dir.join(TEMPLATE_FILE))
}

/// One lock per image digest, so concurrent creates of one image build its template once.
#[derive(Default)]
pub struct BuildLocks(Mutex<HashMap<String, Arc<Mutex<()>>>>);

impl BuildLocks {
    pub fn for_image(&self, digest: &str) -> Arc<Mutex<()>> {
        self.0
            .lock()
            .expect("build locks")
            .entry(digest.to_string())
            .or_default()
            .clone()
    }
}

/// Timing of one build, for logs.
pub struct BuildClock(Instant);

impl BuildClock {
    pub fn start() -> Self {
        Self(Instant::now())
    }

    pub fn ms(&self) -> u64 {
        self.0.elapsed().as_millis() as u64
    }
}

/// The template key and a short name for an image.
pub fn short_name(image: &ResolvedImage) -> String {
    let hex = image
        .digest
        .split_once(':')
        .map(|(_, h)| h)
        .unwrap_or(&image.digest);
    format!("tpl-{}", &hex[..hex.len().min(12)])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_round_trip_and_commit_last() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(load(dir.path()), None);
        let t = Template {
            key: "sha256:ab".into(),
            image_digest: "sha256:ab".into(),
            image_reference: "recipe:busybox".into(),
            rootfs: "/r".into(),
            checkpoint: "/c".into(),
            golden_token: "g".into(),
            build_ms: 5,
        };
        commit(dir.path(), &t).unwrap();
        assert_eq!(load(dir.path()), Some(t));
        assert!(template_dir(Path::new("/d"), "sha256:ab").ends_with("templates/sha256-ab"));
    }
}
