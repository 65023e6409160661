//! Checkpoints whose memory is still in the artifact store (`docs/cluster.md`, "Resuming on
//! another node").
//!
//! A sandbox paused on one node resumes on another from the pause checkpoint that node
//! published. Almost all of a checkpoint is its memory (`criu/pages-N.img`), so the node that
//! resumes it materializes everything else (pagemaps, core images, the writable layer, the
//! rootfs) and leaves the pages images in the store: [`RemotePages`], kept in the checkpoint
//! directory as [`FILE`], lists each one's size and blocks. The resume is then a lazy restore
//! (`fastbox_runtime::lazy`): the sandbox runs once everything but its memory is restored, a
//! page it touches is fetched on its fault (the one block it lies in), and every other block
//! comes in the background, all through the node's artifact store (its block cache, DART
//! peers, the origin) and verified against its digest.
//!
//! While [`FILE`] is there the checkpoint's pages images are not complete: a restore of it
//! must be lazy ([`RemotePages::lazy_pages`]) and takes whatever pages image a cut transfer
//! left (one with holes) away first ([`RemotePages::remove_partial`]). When a transfer has
//! put every page in place the images directory is whole and [`RemotePages::clear`] removes
//! the file: the checkpoint is then like one taken on this node.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use fastbox_artifact::{ArtifactStore, BLOCK_SIZE, Digest, LeftOut, zero_block_digest};
use fastbox_runtime::lazy::blocks::{BlockSource, SourceError};
use fastbox_runtime::lazy::restore::{Fetched, LazyPages, RemoteFile};
use serde::{Deserialize, Serialize};

/// The file in a checkpoint directory that lists the pages images not yet local.
pub const FILE: &str = "remote-pages.json";
/// Where the checkpoint directory, and a pages image in it, are in a published tree.
const CHECKPOINT_PREFIX: &str = "checkpoint/";
const IMAGES_PREFIX: &str = "checkpoint/criu/";
/// Threads fetching a lazy resume's blocks.
const FETCH_WORKERS: usize = 8;
/// The waits before a block fetch that failed is tried again (a store that answers no block
/// is retried this long before the restore fails).
const RETRY_WAITS: [Duration; 3] = [
    Duration::from_millis(100),
    Duration::from_millis(500),
    Duration::from_secs(2),
];
/// The slowest copy-in a transfer's timeout allows for (bytes per second), beyond its floor.
const SLOWEST_TRANSFER_BYTES_PER_SEC: u64 = 4 << 20;

/// Whether `path` (in a published checkpoint's tree) is a pages image of its CRIU images.
pub fn is_pages_image(path: &str) -> bool {
    path.strip_prefix(IMAGES_PREFIX)
        .is_some_and(|name| !name.contains('/') && is_pages_name(name))
}

/// `pages-N.img`, N decimal: nothing else names a pages image (and nothing that could leave
/// the images directory).
fn is_pages_name(name: &str) -> bool {
    name.strip_prefix("pages-")
        .and_then(|rest| rest.strip_suffix(".img"))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Whether `path` (in a published checkpoint's tree) is where this node keeps its list of
/// remote pages images: no published checkpoint may carry one.
pub fn is_list_path(path: &str) -> bool {
    path == format!("{CHECKPOINT_PREFIX}{FILE}")
}

/// The pages images of a checkpoint that are in the artifact store, not in its images
/// directory, by file name (`pages-1.img`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemotePages {
    pub files: BTreeMap<String, RemotePagesFile>,
}

/// One pages image: its size and its blocks (hex digests), in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemotePagesFile {
    pub size: u64,
    pub blocks: Vec<String>,
}

impl RemotePages {
    /// The pages images a materialization left out ([`is_pages_image`] chose them).
    pub fn from_left_out(left: &[LeftOut]) -> Self {
        let files = left
            .iter()
            .filter_map(|l| {
                let name = l.path.strip_prefix(IMAGES_PREFIX)?;
                Some((
                    name.to_string(),
                    RemotePagesFile {
                        size: l.size,
                        blocks: l.blocks.iter().map(Digest::to_hex).collect(),
                    },
                ))
            })
            .collect();
        Self { files }
    }

    /// Their total size.
    pub fn bytes(&self) -> u64 {
        self.files.values().map(|f| f.size).sum()
    }

    /// How long copying them in may take: `floor`, or longer for more bytes than the
    /// slowest transfer expected copies in that time.
    pub fn transfer_timeout(&self, floor: Duration) -> Duration {
        floor.max(Duration::from_secs(
            self.bytes() / SLOWEST_TRANSFER_BYTES_PER_SEC,
        ))
    }

    /// Writes every pages image of the list into `images` from `source`, whole (for a
    /// restore that does not start before its memory is in place), then clears the list of
    /// checkpoint `checkpoint`.
    pub fn fetch_whole(
        &self,
        source: &dyn BlockSource,
        images: &Path,
        checkpoint: &Path,
    ) -> Result<(), SourceError> {
        self.remove_partial(images);
        for (name, file) in self.files.iter().filter(|(n, _)| is_pages_name(n)) {
            let partial = images.join(format!("{name}.fetching"));
            let written = Self::fetch_file(source, name, file, &partial, &images.join(name));
            if written.is_err() {
                let _ = std::fs::remove_file(&partial);
            }
            written?;
        }
        Self::clear(checkpoint);
        Ok(())
    }

    /// What checkpoint directory `checkpoint` still lacks, if anything.
    pub fn read(checkpoint: &Path) -> Option<Self> {
        let text = std::fs::read(checkpoint.join(FILE)).ok()?;
        let parsed = serde_json::from_slice::<Self>(&text).map_err(|e| e.to_string());
        match parsed.and_then(
            |pages| match pages.files.keys().find(|n| !is_pages_name(n)) {
                Some(bad) => Err(format!("{bad:?} does not name a pages image")),
                None => Ok(pages),
            },
        ) {
            Ok(pages) => Some(pages),
            Err(e) => {
                // Unreadable: the pages are not known to be local, so nothing may restore it
                // as if they were; a restore refuses an empty list with a clear error.
                tracing::warn!(path = %checkpoint.display(), error = %e, "unreadable list of remote pages images");
                Some(Self::default())
            }
        }
    }

    /// Records the list in checkpoint directory `checkpoint`.
    pub fn write(&self, checkpoint: &Path) -> std::io::Result<()> {
        let text = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(checkpoint.join(FILE), text)
    }

    /// The checkpoint in `checkpoint` is whole: its list goes.
    pub fn clear(checkpoint: &Path) {
        let _ = std::fs::remove_file(checkpoint.join(FILE));
    }

    /// Removes the pages images of the list from `images`: a transfer cut short (a crash)
    /// leaves them with holes, and a lazy restore needs none there.
    pub fn remove_partial(&self, images: &Path) {
        // `read` lets no other name through.
        for name in self.files.keys().filter(|n| is_pages_name(n)) {
            let _ = std::fs::remove_file(images.join(name));
        }
    }

    /// Writes pages image `name` (`file`) from `source` into `partial`, then renames it
    /// `path`.
    fn fetch_file(
        source: &dyn BlockSource,
        name: &str,
        file: &RemotePagesFile,
        partial: &Path,
        path: &Path,
    ) -> Result<(), SourceError> {
        use std::io::Write;
        let mut out = std::fs::File::create(partial)?;
        let mut left = file.size;
        for digest in &file.blocks {
            let block = source.get_block(digest)?;
            let take = (block.len() as u64).min(left) as usize;
            out.write_all(&block[..take])?;
            left -= take as u64;
        }
        if left > 0 {
            return Err(format!("{name}: its blocks hold {left} bytes less than its size").into());
        }
        out.sync_all()?;
        std::fs::rename(partial, path)?;
        Ok(())
    }

    /// A lazy restore's pages: these files, from `source`.
    pub fn lazy_pages(
        &self,
        source: Arc<dyn BlockSource>,
        restore_timeout: Duration,
        transfer_timeout: Option<Duration>,
    ) -> LazyPages {
        let files = self
            .files
            .iter()
            .map(|(name, f)| {
                let remote = RemoteFile {
                    size: f.size,
                    blocks: f.blocks.clone(),
                };
                (name.clone(), remote)
            })
            .collect();
        LazyPages {
            source,
            block_size: BLOCK_SIZE as u64,
            files,
            complete: Vec::new(),
            fetch_workers: FETCH_WORKERS,
            restore_timeout,
            transfer_timeout,
        }
    }
}

/// The blocks of an artifact store as a lazy restore's source: read (and verified) by the
/// store, counted, each after an optional fixed delay that stands for a remote origin's
/// latency (`fastbox bench lazy`). A full zero block is not fetched (a materialization leaves
/// it a hole): it costs no delay and is not counted.
pub struct StoreBlocks {
    store: Arc<dyn ArtifactStore>,
    delay: Duration,
    blocks: AtomicU64,
    bytes: AtomicU64,
}

impl StoreBlocks {
    pub fn new(store: Arc<dyn ArtifactStore>) -> Self {
        Self::delayed(store, Duration::ZERO)
    }

    /// Every fetched block waits `delay` first.
    pub fn delayed(store: Arc<dyn ArtifactStore>, delay: Duration) -> Self {
        Self {
            store,
            delay,
            blocks: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        }
    }

    /// Blocks fetched so far, and their bytes.
    pub fn fetched(&self) -> Fetched {
        Fetched {
            blocks: self.blocks.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
        }
    }
}

impl BlockSource for StoreBlocks {
    fn get_block(&self, digest: &str) -> Result<Vec<u8>, SourceError> {
        let digest = Digest::from_hex(digest)?;
        if digest == zero_block_digest() {
            return Ok(vec![0; BLOCK_SIZE]);
        }
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay);
        }
        let mut waits = RETRY_WAITS.iter();
        let bytes = loop {
            match self.store.get_block(&digest) {
                Ok(bytes) => break bytes,
                // A block the store does not have will not appear by waiting.
                Err(e @ fastbox_artifact::StoreError::NotFound { .. }) => return Err(e.into()),
                Err(e) => match waits.next() {
                    Some(wait) => {
                        tracing::debug!(block = %digest, error = %e, "block fetch failed: trying again");
                        std::thread::sleep(*wait);
                    }
                    None => return Err(e.into()),
                },
            }
        };
        self.blocks.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fastbox_artifact::LocalStore;
    use std::time::Instant;

    #[test]
    fn only_the_pages_images_of_the_criu_images_are_left_remote() {
        assert!(is_pages_image("checkpoint/criu/pages-1.img"));
        assert!(is_pages_image("checkpoint/criu/pages-12.img"));
        assert!(!is_pages_image("checkpoint/criu/pagemap-1.img"));
        assert!(!is_pages_image("checkpoint/criu/pages-1.img.log"));
        assert!(!is_pages_image("checkpoint/upper/pages-1.img"));
        assert!(!is_pages_image("checkpoint/criu/x/pages-1.img"));
        assert!(!is_pages_image("rootfs.erofs"));
        assert!(!is_pages_image("checkpoint/criu/pages-.img"));
        assert!(!is_pages_image("checkpoint/criu/pages-1a.img"));
        assert!(is_list_path("checkpoint/remote-pages.json"));
        assert!(!is_list_path("checkpoint/upper/remote-pages.json"));
    }

    /// A store whose first `failures` block reads fail as an I/O error would.
    struct Flaky {
        inner: Arc<dyn ArtifactStore>,
        failures: AtomicU64,
    }

    impl ArtifactStore for Flaky {
        fn get_block(&self, digest: &Digest) -> Result<Vec<u8>, fastbox_artifact::StoreError> {
            let left = self.failures.load(Ordering::Relaxed);
            if left > 0 {
                self.failures.store(left - 1, Ordering::Relaxed);
                return Err(fastbox_artifact::StoreError::Io {
                    op: "get",
                    location: digest.to_hex(),
                    source: std::io::Error::other("connection reset"),
                });
            }
            self.inner.get_block(digest)
        }
        fastbox_artifact::forward_store!(inner; put_block, stream_block, has_block, delete_block, list_blocks, manifests, index);
    }

    #[test]
    fn a_failed_block_fetch_is_tried_again_but_a_missing_block_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let inner: Arc<dyn ArtifactStore> = Arc::new(LocalStore::open(dir.path()).unwrap());
        let block = b"some pages".to_vec();
        let digest = Digest::of(&block);
        inner.put_block(&digest, &block).unwrap();
        let flaky = |failures| {
            StoreBlocks::new(Arc::new(Flaky {
                inner: inner.clone(),
                failures: AtomicU64::new(failures),
            }))
        };
        assert_eq!(flaky(2).get_block(&digest.to_hex()).unwrap(), block);
        assert!(
            flaky(RETRY_WAITS.len() as u64 + 1)
                .get_block(&digest.to_hex())
                .is_err()
        );
        let clock = Instant::now();
        let missing = Digest::of(b"never stored");
        assert!(flaky(0).get_block(&missing.to_hex()).is_err());
        assert!(clock.elapsed() < RETRY_WAITS[0], "not retried");
    }

    #[test]
    fn a_whole_fetch_writes_each_pages_image_and_clears_the_list() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn ArtifactStore> =
            Arc::new(LocalStore::open(dir.path().join("store")).unwrap());
        let (a, b) = (vec![1u8; BLOCK_SIZE], vec![2u8; 10]);
        for block in [&a, &b] {
            store.put_block(&Digest::of(block), block).unwrap();
        }
        let checkpoint = dir.path().join("checkpoint");
        let images = checkpoint.join("criu");
        std::fs::create_dir_all(&images).unwrap();
        let size = (BLOCK_SIZE + 10) as u64;
        let pages = RemotePages {
            files: BTreeMap::from([(
                "pages-1.img".to_string(),
                RemotePagesFile {
                    size,
                    blocks: vec![Digest::of(&a).to_hex(), Digest::of(&b).to_hex()],
                },
            )]),
        };
        pages.write(&checkpoint).unwrap();
        // What a cut transfer left is replaced.
        std::fs::write(images.join("pages-1.img"), b"holes").unwrap();
        pages
            .fetch_whole(&StoreBlocks::new(store), &images, &checkpoint)
            .unwrap();
        let written = std::fs::read(images.join("pages-1.img")).unwrap();
        assert_eq!(written.len() as u64, size);
        assert_eq!(&written[..BLOCK_SIZE], &a[..]);
        assert_eq!(&written[BLOCK_SIZE..], &b[..]);
        assert_eq!(RemotePages::read(&checkpoint), None, "whole now");
        assert_eq!(
            pages.transfer_timeout(Duration::from_secs(600)),
            Duration::from_secs(600)
        );
        // 16 GiB at the slowest rate allowed for: 4096 s, over the floor.
        let mut large = pages.clone();
        large.files.get_mut("pages-1.img").unwrap().size = 16 << 30;
        assert_eq!(
            large.transfer_timeout(Duration::from_secs(600)),
            Duration::from_secs(4096)
        );
    }

    #[test]
    fn a_list_naming_anything_but_pages_images_is_not_trusted() {
        let dir = tempfile::tempdir().unwrap();
        for bad in [
            "../../etc/pages-1.img",
            "pages-/../x.img",
            "core-1.img",
            "pages-1.img/x",
        ] {
            let text = format!(r#"{{"files":{{"{bad}":{{"size":1,"blocks":[]}}}}}}"#);
            std::fs::write(dir.path().join(FILE), text).unwrap();
            assert_eq!(
                RemotePages::read(dir.path()),
                Some(RemotePages::default()),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_list_round_trips_and_clearing_it_leaves_a_whole_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let digest = Digest::of(b"block");
        let left = vec![
            LeftOut {
                path: "checkpoint/criu/pages-1.img".into(),
                size: 7,
                blocks: vec![digest],
            },
            LeftOut {
                path: "elsewhere".into(),
                size: 1,
                blocks: vec![digest],
            },
        ];
        let pages = RemotePages::from_left_out(&left);
        assert_eq!(pages.files.len(), 1);
        assert_eq!(pages.bytes(), 7);
        assert_eq!(RemotePages::read(dir.path()), None);
        pages.write(dir.path()).unwrap();
        assert_eq!(RemotePages::read(dir.path()), Some(pages.clone()));

        let images = dir.path().join("criu");
        std::fs::create_dir(&images).unwrap();
        std::fs::write(images.join("pages-1.img"), b"holes").unwrap();
        std::fs::write(images.join("pagemap-1.img"), b"map").unwrap();
        pages.remove_partial(&images);
        assert!(!images.join("pages-1.img").exists());
        assert!(images.join("pagemap-1.img").exists());

        let lazy = pages.lazy_pages(
            Arc::new(StoreBlocks::new(Arc::new(
                LocalStore::open(dir.path().join("store")).unwrap(),
            ))),
            Duration::from_secs(1),
            None,
        );
        assert_eq!(lazy.files["pages-1.img"].blocks, vec![digest.to_hex()]);
        assert!(lazy.complete.is_empty());

        RemotePages::clear(dir.path());
        assert_eq!(RemotePages::read(dir.path()), None);
    }

    #[test]
    fn an_unreadable_list_still_says_the_pages_are_not_local() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(FILE), b"{not json").unwrap();
        assert_eq!(RemotePages::read(dir.path()), Some(RemotePages::default()));
    }

    #[test]
    fn blocks_are_delayed_verified_and_counted_and_zero_blocks_are_free() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(LocalStore::open(dir.path()).unwrap());
        let block = b"some block".to_vec();
        let digest = Digest::of(&block);
        store.put_block(&digest, &block).unwrap();
        let source = StoreBlocks::delayed(store, Duration::from_millis(30));

        let clock = Instant::now();
        assert_eq!(source.get_block(&digest.to_hex()).unwrap(), block);
        assert!(clock.elapsed() >= Duration::from_millis(30));
        assert_eq!(source.fetched().blocks, 1);
        assert_eq!(source.fetched().bytes, block.len() as u64);

        let zero = source.get_block(&zero_block_digest().to_hex()).unwrap();
        assert_eq!(zero.len(), BLOCK_SIZE);
        assert_eq!(source.fetched().blocks, 1, "a zero block is not fetched");
        assert!(
            source.get_block(&Digest::of(b"absent").to_hex()).is_err(),
            "a block the store lacks is an error"
        );
    }
}
