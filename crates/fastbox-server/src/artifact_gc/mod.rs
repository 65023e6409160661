//! Garbage collection of the node's artifact store while the server runs.
//!
//! A collection is `fastbox_artifact::collect_garbage` on the origin (never through the
//! node block cache) with the server's **pins**: the manifests that what the state store
//! records uses ([`ArtifactRefs`]: live and paused sandboxes, recorded snapshots, templates).
//! Index entries are roots of every collection anyway; the pins protect what an index entry
//! does not name (any more):
//! - keys are resolved through the index at each collection, and the collector
//!   **remembers** each key's manifest for as long as a record names the key: if the index
//!   entry of a paused sandbox's checkpoint disappears (an operator's mistake, a collection
//!   elsewhere that dropped it as broken), its manifest stays pinned here (in memory: an
//!   entry that disappears while the server is down is not covered);
//! - manifests a record names by digest (templates of the templates API) are pinned as they
//!   are.
//!
//! An index read that fails (other than "absent") aborts the collection before anything is
//! deleted: a pin that cannot be resolved is never treated as no pin. The grace period
//! covers what is being written (a publish's blocks, a checkpoint committed before its key is
//! recorded). [`collect_periodically`] runs collections on a schedule, one at a time, on a
//! plain thread; [`ArtifactCollector::stats`] feeds `/metrics`.

pub mod refs;
pub mod report;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use fastbox_artifact::{
    ArtifactStore, Digest, GcError, GcOptions, GcReport, IndexKey, StoreError, collect_garbage,
};

pub use refs::ArtifactRefs;

use crate::service::Lifecycle;

/// The first periodic collection runs this long after the start (or one interval, when
/// that is shorter), so a server restarted more often than its interval still collects.
pub const FIRST_COLLECTION_AFTER: Duration = Duration::from_secs(600);

/// Why a collection failed (nothing was deleted when the pins could not be resolved).
#[derive(Debug, thiserror::Error)]
pub enum CollectError {
    /// The index entry of a key in use could not be read.
    #[error("artifact garbage collection: read the index entry of {key} (in use): {source}")]
    Resolve { key: String, source: StoreError },
    /// The collection itself failed.
    #[error(transparent)]
    Gc(#[from] GcError),
}

/// Totals of this server's collections.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GcStats {
    /// Collections run (dry runs included).
    pub runs: u64,
    /// Collections that failed.
    pub failures: u64,
    /// Manifests deleted.
    pub deleted_manifests: u64,
    /// Blocks deleted.
    pub deleted_blocks: u64,
    /// Bytes of deleted manifests and blocks.
    pub deleted_bytes: u64,
    /// Manifests pinned by the last collection.
    pub pinned: u64,
    /// Unix seconds of the last successful collection (0: none yet).
    pub last_success_unix: u64,
}

#[derive(Debug, Default)]
struct Counters {
    runs: AtomicU64,
    failures: AtomicU64,
    deleted_manifests: AtomicU64,
    deleted_blocks: AtomicU64,
    deleted_bytes: AtomicU64,
    pinned: AtomicU64,
    last_success_unix: AtomicU64,
}

/// Collects one store's garbage with the server's pins. See the module docs.
pub struct ArtifactCollector {
    store: Arc<dyn ArtifactStore>,
    grace: Duration,
    /// Key -> the manifest it resolved to last, for keys still in use.
    remembered: Mutex<BTreeMap<String, Digest>>,
    counters: Counters,
}

impl ArtifactCollector {
    /// A collector of `store` (the origin) that never deletes objects younger than `grace`.
    pub fn new(store: Arc<dyn ArtifactStore>, grace: Duration) -> Self {
        ArtifactCollector {
            store,
            grace,
            remembered: Mutex::new(BTreeMap::new()),
            counters: Counters::default(),
        }
    }

    /// The manifests `refs` pin: its manifests, and each key's manifest by the index (or, if
    /// the entry is gone, the one remembered for it). Blocks on the store.
    pub fn pins(&self, refs: &ArtifactRefs) -> Result<BTreeSet<Digest>, CollectError> {
        let mut remembered = self
            .remembered
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        remembered.retain(|key, _| refs.keys.contains(key));
        let mut pinned = refs.manifests.clone();
        for key in &refs.keys {
            // A key the index cannot hold (an odd image reference) was never published.
            let Ok(index_key) = IndexKey::try_new(key.as_str()) else {
                continue;
            };
            match self.store.index_get(&index_key) {
                Ok(Some(digest)) => {
                    remembered.insert(key.clone(), digest);
                    pinned.insert(digest);
                }
                Ok(None) => {
                    if let Some(digest) = remembered.get(key) {
                        tracing::warn!(key = %key, manifest = %digest, "the index entry of an artifact in use is gone; its manifest stays pinned");
                        pinned.insert(*digest);
                    }
                }
                Err(source) => {
                    return Err(CollectError::Resolve {
                        key: key.clone(),
                        source,
                    });
                }
            }
        }
        *self
            .remembered
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = remembered;
        Ok(pinned)
    }

    /// One collection with the pins of `refs`. Blocks on the store.
    pub fn collect(&self, refs: &ArtifactRefs) -> Result<GcReport, CollectError> {
        let c = &self.counters;
        c.runs.fetch_add(1, Ordering::Relaxed);
        let result = self.pins(refs).and_then(|pinned| {
            c.pinned.store(pinned.len() as u64, Ordering::Relaxed);
            let options = GcOptions {
                grace: self.grace,
                pinned,
                dry_run: false,
                drop_broken: false,
            };
            Ok(collect_garbage(self.store.as_ref(), &options)?)
        });
        match &result {
            Ok(report) => {
                c.deleted_manifests
                    .fetch_add(report.manifests.deleted.count, Ordering::Relaxed);
                c.deleted_blocks
                    .fetch_add(report.blocks.deleted.count, Ordering::Relaxed);
                c.deleted_bytes.fetch_add(
                    report.manifests.deleted.bytes + report.blocks.deleted.bytes,
                    Ordering::Relaxed,
                );
                let now = SystemTime::now()
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                c.last_success_unix.store(now, Ordering::Relaxed);
            }
            Err(_) => {
                c.failures.fetch_add(1, Ordering::Relaxed);
            }
        }
        result
    }

    /// The totals so far.
    pub fn stats(&self) -> GcStats {
        let c = &self.counters;
        let read = |v: &AtomicU64| v.load(Ordering::Relaxed);
        GcStats {
            runs: read(&c.runs),
            failures: read(&c.failures),
            deleted_manifests: read(&c.deleted_manifests),
            deleted_blocks: read(&c.deleted_blocks),
            deleted_bytes: read(&c.deleted_bytes),
            pinned: read(&c.pinned),
            last_success_unix: read(&c.last_success_unix),
        }
    }
}

/// Runs a collection every `interval` (the first after `min(interval,`
/// [`FIRST_COLLECTION_AFTER`]`)`) with the pins of `lifecycle`'s records, until `stop` turns
/// true. Each one runs on a plain thread and is logged.
pub async fn collect_periodically(
    collector: Arc<ArtifactCollector>,
    lifecycle: Arc<Lifecycle>,
    interval: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut wait = interval.min(FIRST_COLLECTION_AFTER);
    loop {
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            _ = stop.wait_for(|stopped| *stopped) => return,
        }
        wait = interval;
        let refs = lifecycle.artifact_refs();
        let collector = collector.clone();
        let collected = tokio::task::spawn_blocking(move || collector.collect(&refs)).await;
        match collected.expect("the collection panicked") {
            Ok(report) => {
                tracing::info!(summary = %report::summary(&report), "artifact garbage collected")
            }
            Err(e) => tracing::warn!(error = %e, "artifact garbage collection failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fastbox_artifact::{ArtifactKind, HostFacts, LocalStore, ManifestMeta, publish_index};

    /// A store with two published artifacts: `template` and a checkpoint `pause-a-1` whose
    /// parent is the template, each of one file of its own bytes.
    struct Fixture {
        _dir: tempfile::TempDir,
        store: Arc<LocalStore>,
        template: Digest,
        checkpoint: Digest,
    }

    fn publish(
        store: &LocalStore,
        root: &std::path::Path,
        key: &str,
        meta: ManifestMeta,
    ) -> Digest {
        let tree = root.join(key);
        std::fs::create_dir_all(&tree).unwrap();
        std::fs::write(tree.join("data.img"), format!("the bytes of {key}")).unwrap();
        let key = IndexKey::try_new(key).unwrap();
        publish_index(store, &key, &tree, meta, &fastbox_artifact::NoProgress)
            .unwrap()
            .manifest
    }

    fn meta(kind: ArtifactKind) -> ManifestMeta {
        ManifestMeta::new(
            kind,
            Digest::of(b"execd"),
            HostFacts {
                kernel: "6.1.0-test".into(),
                criu_version: Some("4.2.1".into()),
                arch: "x86_64".into(),
                cpu_features: vec![],
            },
        )
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(LocalStore::open(dir.path().join("store")).unwrap());
        let template = publish(
            &store,
            dir.path(),
            "fastbox/busybox",
            meta(ArtifactKind::Template),
        );
        let mut checkpoint_meta = meta(ArtifactKind::Checkpoint);
        checkpoint_meta.lineage.parent = Some(template);
        let checkpoint = publish(&store, dir.path(), "pause-a-1", checkpoint_meta);
        Fixture {
            _dir: dir,
            store,
            template,
            checkpoint,
        }
    }

    fn refs(keys: &[&str]) -> ArtifactRefs {
        ArtifactRefs {
            keys: keys.iter().map(|k| k.to_string()).collect(),
            manifests: BTreeSet::new(),
        }
    }

    fn gone(store: &LocalStore, key: &str) {
        store
            .index_delete(&IndexKey::try_new(key).unwrap())
            .unwrap();
    }

    #[test]
    fn a_paused_checkpoint_whose_index_entry_vanished_is_never_swept() {
        let f = fixture();
        let collector = ArtifactCollector::new(f.store.clone(), Duration::ZERO);
        let paused = refs(&["pause-a-1", "fastbox/busybox"]);
        assert_eq!(
            collector.pins(&paused).unwrap(),
            BTreeSet::from([f.template, f.checkpoint])
        );

        // Both index entries disappear while the records still name the keys.
        gone(&f.store, "pause-a-1");
        gone(&f.store, "fastbox/busybox");
        let report = collector.collect(&paused).unwrap();
        assert_eq!(report.manifests.deleted.count, 0, "{report:?}");
        assert_eq!(report.blocks.deleted.count, 0, "{report:?}");
        assert!(f.store.has_manifest(&f.checkpoint).unwrap());
        assert!(f.store.has_manifest(&f.template).unwrap());
        assert_eq!(collector.stats().pinned, 2);

        // Once no record names the keys, the unindexed artifacts go (grace zero).
        let report = collector.collect(&ArtifactRefs::default()).unwrap();
        assert_eq!(report.manifests.deleted.count, 2, "{report:?}");
        assert!(!f.store.has_manifest(&f.checkpoint).unwrap());
        assert!(!f.store.has_manifest(&f.template).unwrap());
        let stats = collector.stats();
        assert_eq!(
            (stats.runs, stats.failures, stats.deleted_manifests),
            (2, 0, 2)
        );
        assert!(
            stats.deleted_blocks >= 2 && stats.last_success_unix > 0,
            "{stats:?}"
        );
    }

    #[test]
    fn a_pinned_checkpoint_keeps_its_parent_template_and_unpinned_ones_go() {
        let f = fixture();
        let collector = ArtifactCollector::new(f.store.clone(), Duration::ZERO);
        // Only the checkpoint's key is in use, and its entry is gone after one collection
        // resolved it: the template comes along as its parent.
        collector.collect(&refs(&["pause-a-1"])).unwrap();
        gone(&f.store, "pause-a-1");
        gone(&f.store, "fastbox/busybox");
        let report = collector.collect(&refs(&["pause-a-1"])).unwrap();
        assert_eq!(report.roots.pinned, 1);
        assert_eq!(report.manifests.deleted.count, 0, "{report:?}");
        assert!(f.store.has_manifest(&f.template).unwrap());

        // A key that was never resolved pins nothing: a collection that starts after the
        // entry is gone sweeps the artifact.
        let fresh = ArtifactCollector::new(f.store.clone(), Duration::ZERO);
        let report = fresh.collect(&refs(&["pause-a-1"])).unwrap();
        assert_eq!(report.manifests.deleted.count, 2, "{report:?}");
    }

    #[test]
    fn manifests_named_by_digest_are_pinned_as_they_are() {
        let f = fixture();
        gone(&f.store, "fastbox/busybox");
        gone(&f.store, "pause-a-1");
        let collector = ArtifactCollector::new(f.store.clone(), Duration::ZERO);
        let report = collector
            .collect(&ArtifactRefs {
                keys: BTreeSet::new(),
                manifests: BTreeSet::from([f.template]),
            })
            .unwrap();
        assert_eq!(
            report.manifests.deleted.count, 1,
            "only the checkpoint goes"
        );
        assert!(f.store.has_manifest(&f.template).unwrap());
        assert!(!f.store.has_manifest(&f.checkpoint).unwrap());
    }

    #[test]
    fn an_unreadable_index_aborts_before_anything_is_deleted() {
        let f = fixture();
        let collector = ArtifactCollector::new(f.store.clone(), Duration::ZERO);
        // The index entry of a key in use is a directory: reading it fails (not "absent").
        gone(&f.store, "pause-a-1");
        let entry = f
            .store
            .root()
            .join("index")
            .join(IndexKey::try_new("pause-a-1").unwrap().escaped());
        std::fs::create_dir(&entry).unwrap();
        let error = collector.collect(&refs(&["pause-a-1"])).unwrap_err();
        assert!(matches!(error, CollectError::Resolve { .. }), "{error:?}");
        assert!(error.to_string().contains("pause-a-1"), "{error}");
        assert!(f.store.has_manifest(&f.checkpoint).unwrap());
        assert_eq!(collector.stats().failures, 1);
    }
}
