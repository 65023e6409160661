//! Garbage collection of a store: mark from the roots, sweep what is old and unreachable.
//!
//! [`collect_garbage`] works on any `&dyn ArtifactStore` through the listings of the store
//! contract, and takes no lock: publishes may run while it does.
//!
//! **Mark.** The roots are every index entry plus the manifests the caller pins
//! ([`GcOptions::pinned`]: what live and paused sandboxes and recorded snapshots use; the
//! store does not know them). Marking reads each root manifest, marks its files' blocks, and
//! follows `lineage.parent` (a snapshot's manifest names the template whose rootfs it
//! needs) transitively. What is reachable from these roots is *marked*.
//!
//! **The grace period.** A manifest written or re-put within [`GcOptions::grace`] is a root
//! too, and whatever only it reaches is *spared* rather than marked: a publish commits its
//! manifest before its index entry, and a snapshot may be committed before its pin is
//! recorded. Blocks and manifests that are unreachable but were written or re-put within the
//! grace period are *spared* as well: a publish writes its blocks before its manifest, and
//! every put of a present object refreshes its modification time, so a publish in flight
//! keeps both the blocks it added and those it deduplicated against, as long as the grace
//! period is longer than any publish. Everything else unreachable is *deleted*: unreachable
//! manifests first (so no manifest ever lists a deleted block), then blocks.
//!
//! **Order, and the remaining window.** The index is read and marked first; then manifests
//! are listed, young ones marked, unreachable old ones deleted; then blocks are listed and
//! swept. A put refreshes an object only if it happens before the listing that the sweep
//! uses: a publish that re-puts an *old, unreachable* object after that listing and before
//! its deletion (the listing and the deletes follow each other directly) loses it, and its
//! manifest then lists a missing object. The store contract has no conditional delete to
//! close this; the next collection reports such a manifest (see below) and publishing the
//! same source again restores the object.
//!
//! **Safety rules.** A reachable manifest this build cannot parse (a newer format version)
//! skips the whole sweep, since its blocks are unknown ([`GcReport::sweep_skipped`]). A
//! store error other than "not found" or "corrupt" aborts the collection before anything is
//! deleted or, during the sweep, stops it. A dry run ([`GcOptions::dry_run`]) deletes
//! nothing and reports what it would delete.
//!
//! **Missing objects.** Referenced manifests that are absent or corrupt, and referenced
//! blocks that are absent (confirmed with `has_block`, since the listing is a moment), are
//! reported; manifests that list a missing block or descend from a missing or broken parent
//! are *broken* (a publish that lost a race of shared blocks, `docs/artifacts.md`). With
//! [`GcOptions::drop_broken`] their index entries are removed, so the next build publishes
//! them again; the manifests themselves then go in a later collection once unreachable.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::{Duration, SystemTime};

use crate::digest::Digest;
use crate::manifest::Manifest;
use crate::store::{ArtifactStore, IndexKey, StoreError, StoredObject};

/// The default grace period: a day, longer than any publish.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(24 * 3600);

/// Why a collection failed.
#[derive(Debug, thiserror::Error)]
pub enum GcError {
    /// A store operation failed.
    #[error("garbage collection: {op}: {source}")]
    Store { op: String, source: StoreError },
}

/// How to collect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GcOptions {
    /// Objects written or re-put more recently than this are never deleted.
    pub grace: Duration,
    /// Manifests in use that the index does not name (live and paused sandboxes, recorded
    /// snapshots): roots like index entries.
    pub pinned: BTreeSet<Digest>,
    /// Report what would be deleted, delete nothing.
    pub dry_run: bool,
    /// Remove index entries whose manifest is missing, corrupt or broken.
    pub drop_broken: bool,
}

impl Default for GcOptions {
    fn default() -> Self {
        GcOptions {
            grace: DEFAULT_GRACE,
            pinned: BTreeSet::new(),
            dry_run: false,
            drop_broken: false,
        }
    }
}

/// A number of objects and their bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    /// Objects.
    pub count: u64,
    /// Their bytes.
    pub bytes: u64,
}

impl Tally {
    fn add(&mut self, object: &StoredObject) {
        self.count += 1;
        self.bytes += object.size;
    }
}

/// What a collection found of one kind of object, from the store's listing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepTally {
    /// Reachable from the index or the pins: kept.
    pub marked: Tally,
    /// Unreachable from them, but written within the grace period or reachable only from a
    /// manifest that was: kept.
    pub spared: Tally,
    /// Unreachable and older: deleted (in a dry run: would be).
    pub deleted: Tally,
    /// Unreachable and older, kept because the sweep was skipped.
    pub held_back: Tally,
}

/// The roots a collection marked from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Roots {
    /// Distinct manifests named by index entries.
    pub index: u64,
    /// Pinned manifests.
    pub pinned: u64,
    /// Manifests written within the grace period.
    pub young: u64,
}

/// What a collection did and found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Whether this was a dry run.
    pub dry_run: bool,
    /// The roots.
    pub roots: Roots,
    /// Manifests.
    pub manifests: SweepTally,
    /// Blocks.
    pub blocks: SweepTally,
    /// Referenced manifests (by the index, a pin or a `lineage.parent`) that are absent.
    pub missing_manifests: BTreeSet<Digest>,
    /// Referenced manifests whose stored bytes do not hash to their name.
    pub corrupt_manifests: BTreeSet<Digest>,
    /// Reachable manifests this build cannot read (a newer format), with the reason.
    pub unreadable_manifests: BTreeMap<Digest, String>,
    /// Blocks listed by a reachable manifest that are absent.
    pub missing_blocks: BTreeSet<Digest>,
    /// Readable manifests that list a missing block or descend from a missing, corrupt or
    /// broken parent.
    pub broken_manifests: BTreeSet<Digest>,
    /// Whether the sweep was skipped (see [`GcReport::unreadable_manifests`]).
    pub sweep_skipped: bool,
    /// Index entries removed by [`GcOptions::drop_broken`] (in a dry run: would be).
    pub dropped_index_entries: Vec<(IndexKey, Digest)>,
}

/// Mark from the index and `options.pinned`, then sweep (see the module docs).
pub fn collect_garbage(
    store: &dyn ArtifactStore,
    options: &GcOptions,
) -> Result<GcReport, GcError> {
    let cutoff = SystemTime::now()
        .checked_sub(options.grace)
        .unwrap_or(SystemTime::UNIX_EPOCH);
    let mut report = GcReport {
        dry_run: options.dry_run,
        ..GcReport::default()
    };
    let index = store.list_index().map_err(store_error("list the index"))?;
    let indexed: BTreeSet<Digest> = index.iter().map(|(_, d)| *d).collect();
    report.roots.index = indexed.len() as u64;
    report.roots.pinned = options.pinned.len() as u64;

    let mut marker = Marker::new(store);
    marker.mark(indexed.iter().chain(&options.pinned).copied(), true)?;
    let live = marker.reached();

    let manifests = store
        .list_manifests()
        .map_err(store_error("list manifests"))?;
    let young: Vec<Digest> = manifests
        .iter()
        .filter(|m| m.modified >= cutoff)
        .map(|m| m.digest)
        .collect();
    report.roots.young = young.len() as u64;
    marker.mark(young, false)?;
    let reached = marker.reached();
    report.sweep_skipped = !marker.unreadable.is_empty();

    let sweep = Sweep {
        dry_run: options.dry_run,
        cutoff,
        skip: report.sweep_skipped,
    };
    report.manifests = sweep.run(&manifests, &live.manifests, &reached.manifests, |d| {
        store.delete_manifest(d)
    })?;
    let blocks = store.list_blocks().map_err(store_error("list blocks"))?;
    report.blocks = sweep.run(&blocks, &live.blocks, &reached.blocks, |d| {
        store.delete_block(d)
    })?;

    let listed: HashSet<Digest> = blocks.iter().map(|b| b.digest).collect();
    for block in reached.blocks.difference(&listed) {
        if !store
            .has_block(block)
            .map_err(store_error(format!("check block {block}")))?
        {
            report.missing_blocks.insert(*block);
        }
    }
    report.broken_manifests = marker.broken(&report.missing_blocks);
    report.missing_manifests = marker.missing;
    report.corrupt_manifests = marker.corrupt;
    report.unreadable_manifests = marker.unreadable;
    if options.drop_broken {
        report.dropped_index_entries = drop_broken(store, &index, &report, options.dry_run)?;
    }
    tracing::info!(
        dry_run = options.dry_run,
        deleted_blocks = report.blocks.deleted.count,
        deleted_bytes = report.blocks.deleted.bytes,
        deleted_manifests = report.manifests.deleted.count,
        missing_blocks = report.missing_blocks.len(),
        broken_manifests = report.broken_manifests.len(),
        sweep_skipped = report.sweep_skipped,
        "garbage collection done"
    );
    Ok(report)
}

/// Manifests and blocks reached by marking.
#[derive(Debug, Clone, Default)]
struct Reached {
    manifests: HashSet<Digest>,
    blocks: HashSet<Digest>,
}

/// A readable manifest's references.
#[derive(Debug)]
struct Links {
    manifest: Digest,
    blocks: BTreeSet<Digest>,
    parent: Option<Digest>,
}

/// The mark phase: manifests visited, what they reference, what could not be read.
struct Marker<'a> {
    store: &'a dyn ArtifactStore,
    reached: Reached,
    links: Vec<Links>,
    missing: BTreeSet<Digest>,
    corrupt: BTreeSet<Digest>,
    unreadable: BTreeMap<Digest, String>,
}

impl<'a> Marker<'a> {
    fn new(store: &'a dyn ArtifactStore) -> Self {
        Marker {
            store,
            reached: Reached::default(),
            links: Vec::new(),
            missing: BTreeSet::new(),
            corrupt: BTreeSet::new(),
            unreadable: BTreeMap::new(),
        }
    }

    /// Mark from `roots`. `referenced` says whether the roots are references (index
    /// entries, pins) whose absence is worth reporting, or listed manifests that may have
    /// been removed since the listing. Parents are always references.
    fn mark(
        &mut self,
        roots: impl IntoIterator<Item = Digest>,
        referenced: bool,
    ) -> Result<(), GcError> {
        let mut stack: Vec<(Digest, bool)> = roots.into_iter().map(|d| (d, referenced)).collect();
        while let Some((digest, referenced)) = stack.pop() {
            if self.reached.manifests.contains(&digest) {
                continue;
            }
            let bytes = match self.store.get_manifest(&digest) {
                Ok(bytes) => bytes,
                Err(StoreError::NotFound { .. }) => {
                    if referenced {
                        self.missing.insert(digest);
                    }
                    continue;
                }
                Err(StoreError::Corrupt { .. }) => {
                    self.reached.manifests.insert(digest);
                    self.corrupt.insert(digest);
                    continue;
                }
                Err(source) => {
                    return Err(store_error(format!("read manifest {digest}"))(source));
                }
            };
            self.reached.manifests.insert(digest);
            match Manifest::from_slice(&bytes) {
                Ok(manifest) => {
                    let blocks = manifest.blocks();
                    self.reached.blocks.extend(blocks.iter().copied());
                    let parent = manifest.meta.lineage.parent;
                    if let Some(parent) = parent {
                        stack.push((parent, true));
                    }
                    self.links.push(Links {
                        manifest: digest,
                        blocks,
                        parent,
                    });
                }
                Err(e) => {
                    tracing::warn!(manifest = %digest, error = %e,
                        "a reachable manifest cannot be read; the sweep is skipped");
                    self.unreadable.insert(digest, e.to_string());
                }
            }
        }
        Ok(())
    }

    fn reached(&self) -> Reached {
        self.reached.clone()
    }

    /// Manifests listing a missing block, or descending from a missing, corrupt or broken
    /// parent.
    fn broken(&self, missing_blocks: &BTreeSet<Digest>) -> BTreeSet<Digest> {
        let mut broken: BTreeSet<Digest> = self
            .links
            .iter()
            .filter(|l| !l.blocks.is_disjoint(missing_blocks))
            .map(|l| l.manifest)
            .collect();
        loop {
            let before = broken.len();
            for links in &self.links {
                let Some(parent) = links.parent else { continue };
                if self.missing.contains(&parent)
                    || self.corrupt.contains(&parent)
                    || broken.contains(&parent)
                {
                    broken.insert(links.manifest);
                }
            }
            if broken.len() == before {
                return broken;
            }
        }
    }
}

/// How to sweep a listing.
struct Sweep {
    dry_run: bool,
    /// Objects modified at or after it are young.
    cutoff: SystemTime,
    /// Delete nothing (a reachable manifest could not be read).
    skip: bool,
}

impl Sweep {
    /// Tally `listed` against what was marked (`live`) and reached (`reached`), deleting
    /// what is unreachable and old with `delete`.
    fn run(
        &self,
        listed: &[StoredObject],
        live: &HashSet<Digest>,
        reached: &HashSet<Digest>,
        delete: impl Fn(&Digest) -> Result<(), StoreError>,
    ) -> Result<SweepTally, GcError> {
        let mut tally = SweepTally::default();
        for object in listed {
            if live.contains(&object.digest) {
                tally.marked.add(object);
            } else if reached.contains(&object.digest) || object.modified >= self.cutoff {
                tally.spared.add(object);
            } else if self.skip {
                tally.held_back.add(object);
            } else {
                if !self.dry_run {
                    delete(&object.digest)
                        .map_err(store_error(format!("delete {}", object.digest)))?;
                }
                tally.deleted.add(object);
            }
        }
        Ok(tally)
    }
}

/// Remove the index entries whose manifest is missing, corrupt or broken (each re-read
/// first, so an entry changed since the listing is left alone).
fn drop_broken(
    store: &dyn ArtifactStore,
    index: &[(IndexKey, Digest)],
    report: &GcReport,
    dry_run: bool,
) -> Result<Vec<(IndexKey, Digest)>, GcError> {
    let mut dropped = Vec::new();
    for (key, digest) in index {
        let bad = report.missing_manifests.contains(digest)
            || report.corrupt_manifests.contains(digest)
            || report.broken_manifests.contains(digest);
        if !bad {
            continue;
        }
        if !dry_run {
            let current = store
                .index_get(key)
                .map_err(store_error(format!("read index entry {key}")))?;
            if current != Some(*digest) {
                continue;
            }
            store
                .index_delete(key)
                .map_err(store_error(format!("delete index entry {key}")))?;
        }
        tracing::warn!(%key, manifest = %digest, dry_run, "dropped a broken index entry");
        dropped.push((key.clone(), *digest));
    }
    Ok(dropped)
}

/// Map a store error to a collection error naming the operation.
fn store_error(op: impl Into<String>) -> impl FnOnce(StoreError) -> GcError {
    let op = op.into();
    move |source| GcError::Store { op, source }
}
