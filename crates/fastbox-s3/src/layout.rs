//! Object keys: the local store's layout under a prefix.
//!
//! ```text
//! <prefix>/blocks/<first two hex digits>/<digest>
//! <prefix>/manifests/<digest>.json
//! <prefix>/index/<escaped key>          content "<manifest digest>\n"
//! <prefix>/tmp/<name>                   probe objects; anything here is garbage
//! ```
//!
//! Index keys are escaped with [`IndexKey::escaped`] (only `[A-Za-z0-9._-]` and `%XX`), so
//! object keys hold no character S3 treats specially. Listings parse keys back and skip what
//! does not belong (a stray object under the prefix is not an artifact).

use fastbox_artifact::{Digest, IndexKey};

const BLOCKS: &str = "blocks";
const MANIFESTS: &str = "manifests";
const INDEX: &str = "index";
const TMP: &str = "tmp";
const MANIFEST_SUFFIX: &str = ".json";

/// The keys of one store (a bucket prefix).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The prefix followed by `/`, or empty.
    root: String,
}

impl Layout {
    /// The layout under `prefix` (no leading or trailing `/`; may be empty).
    pub fn new(prefix: &str) -> Self {
        let prefix = prefix.trim_matches('/');
        Layout {
            root: if prefix.is_empty() {
                String::new()
            } else {
                format!("{prefix}/")
            },
        }
    }

    /// The key of a block.
    pub fn block(&self, digest: &Digest) -> String {
        let hex = digest.to_hex();
        format!("{}{BLOCKS}/{}/{hex}", self.root, &hex[..2])
    }

    /// The key of a manifest.
    pub fn manifest(&self, digest: &Digest) -> String {
        format!("{}{MANIFESTS}/{digest}{MANIFEST_SUFFIX}", self.root)
    }

    /// The key of an index entry.
    pub fn index(&self, key: &IndexKey) -> String {
        format!("{}{INDEX}/{}", self.root, key.escaped())
    }

    /// The key of a scratch object named `name`.
    pub fn tmp(&self, name: &str) -> String {
        format!("{}{TMP}/{name}", self.root)
    }

    /// The listing prefix of blocks (ends without `/`, as object_store lists by segment).
    pub fn blocks_dir(&self) -> String {
        format!("{}{BLOCKS}", self.root)
    }

    /// The listing prefix of manifests.
    pub fn manifests_dir(&self) -> String {
        format!("{}{MANIFESTS}", self.root)
    }

    /// The listing prefix of the index.
    pub fn index_dir(&self) -> String {
        format!("{}{INDEX}", self.root)
    }

    /// The digest a listed block key names, if it is one: the right fan-out directory and a
    /// digest name.
    pub fn parse_block(&self, key: &str) -> Option<Digest> {
        let rest = key.strip_prefix(&self.root)?.strip_prefix(BLOCKS)?;
        let (fanout, name) = rest.strip_prefix('/')?.split_once('/')?;
        let digest = Digest::from_hex(name).ok()?;
        (fanout.len() == 2 && name.starts_with(fanout)).then_some(digest)
    }

    /// The digest a listed manifest key names, if it is one.
    pub fn parse_manifest(&self, key: &str) -> Option<Digest> {
        let rest = key.strip_prefix(&self.root)?.strip_prefix(MANIFESTS)?;
        let name = rest.strip_prefix('/')?.strip_suffix(MANIFEST_SUFFIX)?;
        Digest::from_hex(name).ok()
    }

    /// The index key a listed index object names, if it is one.
    pub fn parse_index(&self, key: &str) -> Option<IndexKey> {
        let rest = key.strip_prefix(&self.root)?.strip_prefix(INDEX)?;
        IndexKey::from_escaped(rest.strip_prefix('/')?).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_through_the_parsers() {
        let digest = Digest::of(b"block");
        let key = IndexKey::try_new("python:3.12").unwrap();
        for prefix in ["", "a", "a/b/", "/a/b"] {
            let layout = Layout::new(prefix);
            assert_eq!(layout.parse_block(&layout.block(&digest)), Some(digest));
            assert_eq!(
                layout.parse_manifest(&layout.manifest(&digest)),
                Some(digest)
            );
            assert_eq!(layout.parse_index(&layout.index(&key)), Some(key.clone()));
            assert!(layout.block(&digest).starts_with(&layout.blocks_dir()));
            assert!(
                layout
                    .manifest(&digest)
                    .starts_with(&layout.manifests_dir())
            );
            assert!(layout.index(&key).starts_with(&layout.index_dir()));
        }
        let layout = Layout::new("p");
        let hex = digest.to_hex();
        assert_eq!(
            layout.block(&digest),
            format!("p/blocks/{}/{hex}", &hex[..2])
        );
        assert_eq!(layout.manifest(&digest), format!("p/manifests/{hex}.json"));
        assert_eq!(layout.index(&key), "p/index/python%3A3.12");
    }

    #[test]
    fn stray_keys_are_not_objects() {
        let layout = Layout::new("p");
        let hex = Digest::of(b"x").to_hex();
        for stray in [
            format!("p/blocks/zz/{hex}"),
            format!("p/blocks/{hex}"),
            format!("q/blocks/{}/{hex}", &hex[..2]),
            "p/blocks/ab/abc".to_string(),
            format!("p/manifests/{hex}"),
            format!("p/manifests/{hex}.json.tmp"),
        ] {
            assert_eq!(layout.parse_block(&stray), None, "{stray}");
            assert_eq!(layout.parse_manifest(&stray), None, "{stray}");
        }
        assert_eq!(layout.parse_index("p/index/%61"), None);
        assert_eq!(layout.parse_index("p/indexes/a"), None);
    }
}
