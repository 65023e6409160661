//! The cache's eviction policy: a segmented LRU with pins, in memory, no I/O.
//!
//! Two segments, each ordered from least to most recently used:
//!
//! - **probation**: where every admitted block starts;
//! - **protected**: where a block moves on its second access (a hit). Protected may hold at
//!   most [`PROTECTED_SHARE_PERCENT`] of the budget; when a promotion overfills it, its least
//!   recently used blocks go back to the most recently used end of probation (demotion, not
//!   eviction).
//!
//! Eviction takes the least recently used *unpinned* block of probation, and touches
//! protected only when probation has nothing evictable left. A one-shot scan therefore
//! cycles through probation and never displaces a block that was read twice. Pinned blocks
//! (any holder pins them) are skipped; when pins alone exceed the budget the cache stays
//! over it rather than failing.
//!
//! Costs: every operation is `O(log n)` in the number of cached blocks (a hash map plus one
//! ordered map per segment keyed by a recency tick), except that eviction walks past pinned
//! blocks at the cold end of a segment (`O(pinned)` in the worst case). Memory is about a
//! hundred bytes per cached block.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::digest::Digest;

/// The share of the budget the protected segment may hold, in percent.
pub const PROTECTED_SHARE_PERCENT: u64 = 80;

/// Version of the persisted [`PolicyState`].
const STATE_VERSION: u32 = 1;

/// Which segment a block is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Segment {
    Probation,
    Protected,
}

/// One cached block.
#[derive(Debug, Clone, Copy)]
struct Entry {
    size: u64,
    segment: Segment,
    /// Recency: the key in its segment's map; larger is more recent.
    rank: u64,
    /// Which admission this entry is: a block evicted and admitted again gets a new one, so
    /// a reader that found a bad file removes only the entry it read.
    generation: u64,
}

/// The order of the two segments, written to disk and restored at open.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyState {
    version: u32,
    /// Probation, least recently used first.
    probation: Vec<Digest>,
    /// Protected, least recently used first.
    protected: Vec<Digest>,
}

/// Sizes of the segments, for statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Occupancy {
    pub blocks: u64,
    pub bytes: u64,
    pub probation_bytes: u64,
    pub protected_bytes: u64,
    pub pinned_bytes: u64,
}

/// Segmented LRU over cached blocks, plus pins by holder. See the module docs.
#[derive(Debug)]
pub struct Policy {
    budget: u64,
    tick: u64,
    entries: HashMap<Digest, Entry>,
    probation: BTreeMap<u64, Digest>,
    protected: BTreeMap<u64, Digest>,
    bytes: u64,
    protected_bytes: u64,
    pins_by_holder: HashMap<String, HashSet<Digest>>,
    pin_counts: HashMap<Digest, usize>,
}

impl Policy {
    /// An empty policy for `budget` bytes.
    pub fn new(budget: u64) -> Self {
        Policy {
            budget,
            tick: 0,
            entries: HashMap::new(),
            probation: BTreeMap::new(),
            protected: BTreeMap::new(),
            bytes: 0,
            protected_bytes: 0,
            pins_by_holder: HashMap::new(),
            pin_counts: HashMap::new(),
        }
    }

    /// Rebuild the policy from the blocks found on disk and the persisted order. Blocks the
    /// state does not know go to the cold end of probation; names in the state that are not
    /// on disk are ignored. Call [`Policy::evict_over_budget`] afterwards.
    pub fn restore(budget: u64, on_disk: &[(Digest, u64)], state: Option<&PolicyState>) -> Self {
        let mut policy = Policy::new(budget);
        let sizes: HashMap<Digest, u64> = on_disk.iter().copied().collect();
        let (probation, protected) = match state {
            Some(state) if state.version == STATE_VERSION => {
                (state.probation.as_slice(), state.protected.as_slice())
            }
            _ => (&[][..], &[][..]),
        };
        let known: HashSet<&Digest> = probation.iter().chain(protected).collect();
        let mut unknown: Vec<&(Digest, u64)> =
            on_disk.iter().filter(|(d, _)| !known.contains(d)).collect();
        unknown.sort();
        for (digest, size) in unknown {
            policy.admit(digest, *size);
        }
        for digest in probation {
            if let Some(size) = sizes.get(digest) {
                policy.admit(digest, *size);
            }
        }
        for digest in protected {
            if let Some(size) = sizes.get(digest) {
                policy.admit(digest, *size);
                policy.promote(digest);
            }
        }
        policy
    }

    /// The persisted form: both segments in recency order.
    pub fn state(&self) -> PolicyState {
        PolicyState {
            version: STATE_VERSION,
            probation: self.probation.values().copied().collect(),
            protected: self.protected.values().copied().collect(),
        }
    }

    /// The byte budget.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Bytes cached.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether `digest` is cached.
    pub fn contains(&self, digest: &Digest) -> bool {
        self.entries.contains_key(digest)
    }

    /// The generation of `digest`'s entry, if cached.
    pub fn generation(&self, digest: &Digest) -> Option<u64> {
        self.entries.get(digest).map(|e| e.generation)
    }

    /// Admit a block into probation (most recently used end). Returns false, changing
    /// nothing, when it is already cached: a second insert is not an access.
    pub fn admit(&mut self, digest: &Digest, size: u64) -> bool {
        if self.entries.contains_key(digest) {
            return false;
        }
        let rank = self.next_tick();
        self.entries.insert(
            *digest,
            Entry {
                size,
                segment: Segment::Probation,
                rank,
                generation: rank,
            },
        );
        self.probation.insert(rank, *digest);
        self.bytes += size;
        true
    }

    /// Record an access (a hit): probation promotes to protected, protected moves to its
    /// most recently used end. Returns false when `digest` is not cached.
    pub fn touch(&mut self, digest: &Digest) -> bool {
        if !self.entries.contains_key(digest) {
            return false;
        }
        self.promote(digest);
        true
    }

    /// Remove `digest`'s entry, but only if it is the admission `generation` (any, when
    /// None). Returns whether it was removed.
    pub fn remove(&mut self, digest: &Digest, generation: Option<u64>) -> bool {
        match self.entries.get(digest) {
            Some(entry) if generation.is_none_or(|g| g == entry.generation) => {}
            _ => return false,
        }
        self.unlink(digest).is_some()
    }

    /// Remove least recently used unpinned blocks, probation first, until the cache fits
    /// its budget or nothing evictable is left. Returns what was removed.
    pub fn evict_over_budget(&mut self) -> Vec<Digest> {
        let mut victims = Vec::new();
        while self.bytes > self.budget {
            let Some(victim) = self
                .coldest_unpinned(Segment::Probation)
                .or_else(|| self.coldest_unpinned(Segment::Protected))
            else {
                break;
            };
            self.unlink(&victim);
            victims.push(victim);
        }
        victims
    }

    /// Add `digests` to `holder`'s pins (present or not yet cached).
    pub fn pin(&mut self, holder: &str, digests: impl IntoIterator<Item = Digest>) {
        let held = self.pins_by_holder.entry(holder.to_string()).or_default();
        for digest in digests {
            if held.insert(digest) {
                *self.pin_counts.entry(digest).or_default() += 1;
            }
        }
    }

    /// Drop every pin of `holder`.
    pub fn unpin(&mut self, holder: &str) {
        for digest in self.pins_by_holder.remove(holder).unwrap_or_default() {
            if let Some(count) = self.pin_counts.get_mut(&digest) {
                *count -= 1;
                if *count == 0 {
                    self.pin_counts.remove(&digest);
                }
            }
        }
    }

    /// Whether any holder pins `digest`.
    pub fn is_pinned(&self, digest: &Digest) -> bool {
        self.pin_counts.contains_key(digest)
    }

    /// How full the cache and its segments are.
    pub fn occupancy(&self) -> Occupancy {
        let pinned_bytes = self
            .pin_counts
            .keys()
            .filter_map(|d| self.entries.get(d))
            .map(|e| e.size)
            .sum();
        Occupancy {
            blocks: self.entries.len() as u64,
            bytes: self.bytes,
            probation_bytes: self.bytes - self.protected_bytes,
            protected_bytes: self.protected_bytes,
            pinned_bytes,
        }
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn segment_mut(&mut self, segment: Segment) -> &mut BTreeMap<u64, Digest> {
        match segment {
            Segment::Probation => &mut self.probation,
            Segment::Protected => &mut self.protected,
        }
    }

    /// Move `digest` (cached) to the most recently used end of protected, then demote from
    /// protected's cold end while it holds more than its share (never the block just
    /// promoted).
    fn promote(&mut self, digest: &Digest) {
        let Some(entry) = self.entries.get(digest).copied() else {
            return;
        };
        self.segment_mut(entry.segment).remove(&entry.rank);
        if entry.segment == Segment::Probation {
            self.protected_bytes += entry.size;
        }
        self.place(digest, Segment::Protected);
        let cap = self.protected_cap();
        while self.protected_bytes > cap && self.protected.len() > 1 {
            let Some((_, coldest)) = self.protected.pop_first() else {
                break;
            };
            if let Some(size) = self.entries.get(&coldest).map(|e| e.size) {
                self.protected_bytes -= size;
            }
            self.place(&coldest, Segment::Probation);
        }
    }

    /// The most protected may hold: its share of the budget (without overflow).
    fn protected_cap(&self) -> u64 {
        self.budget / 100 * PROTECTED_SHARE_PERCENT
            + self.budget % 100 * PROTECTED_SHARE_PERCENT / 100
    }

    /// Put a cached entry (already removed from its segment's map) at the most recently used
    /// end of `segment`.
    fn place(&mut self, digest: &Digest, segment: Segment) {
        let rank = self.next_tick();
        if let Some(entry) = self.entries.get_mut(digest) {
            entry.segment = segment;
            entry.rank = rank;
            self.segment_mut(segment).insert(rank, *digest);
        }
    }

    fn coldest_unpinned(&self, segment: Segment) -> Option<Digest> {
        let map = match segment {
            Segment::Probation => &self.probation,
            Segment::Protected => &self.protected,
        };
        map.values().find(|d| !self.is_pinned(d)).copied()
    }

    /// Remove an entry from every structure.
    fn unlink(&mut self, digest: &Digest) -> Option<Entry> {
        let entry = self.entries.remove(digest)?;
        self.segment_mut(entry.segment).remove(&entry.rank);
        self.bytes -= entry.size;
        if entry.segment == Segment::Protected {
            self.protected_bytes -= entry.size;
        }
        Some(entry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(n: u32) -> Digest {
        Digest::of(&n.to_le_bytes())
    }

    #[test]
    fn a_scan_evicts_probation_and_spares_a_block_accessed_twice() {
        let mut policy = Policy::new(10);
        policy.admit(&d(0), 1);
        assert!(policy.touch(&d(0)));
        for n in 1..100 {
            policy.admit(&d(n), 1);
            policy.evict_over_budget();
        }
        assert!(policy.contains(&d(0)));
        assert_eq!(policy.occupancy().bytes, 10);
        assert_eq!(policy.occupancy().protected_bytes, 1);
        // The nine most recent scan blocks are what is left of probation.
        assert!((91..100).all(|n| policy.contains(&d(n))));
    }

    #[test]
    fn protected_is_capped_by_demotion_not_eviction() {
        let mut policy = Policy::new(10);
        for n in 0..10 {
            policy.admit(&d(n), 1);
            policy.touch(&d(n));
        }
        let occupancy = policy.occupancy();
        assert_eq!(occupancy.protected_bytes, 8);
        assert_eq!(occupancy.bytes, 10);
        assert!(policy.evict_over_budget().is_empty());
        // The two least recently promoted went back to probation and go first.
        policy.admit(&d(10), 1);
        assert_eq!(policy.evict_over_budget(), vec![d(0)]);
    }

    #[test]
    fn eviction_falls_back_to_protected_and_skips_pins() {
        let mut policy = Policy::new(10);
        policy.pin("sandbox", [d(0)]);
        policy.admit(&d(0), 5);
        for n in 1..3 {
            policy.admit(&d(n), 3);
            policy.touch(&d(n));
        }
        assert_eq!(policy.occupancy().protected_bytes, 6);
        // Probation holds only the pinned block: the coldest protected block goes.
        assert_eq!(policy.evict_over_budget(), vec![d(1)]);
        assert_eq!(policy.occupancy().pinned_bytes, 5);
    }

    #[test]
    fn pins_beyond_the_budget_leave_the_cache_over_it() {
        let mut policy = Policy::new(2);
        policy.pin("a", (0..3).map(d));
        policy.pin("b", [d(0)]);
        for n in 0..3 {
            policy.admit(&d(n), 1);
        }
        assert!(policy.evict_over_budget().is_empty());
        assert_eq!(policy.occupancy().bytes, 3);
        policy.unpin("a");
        // d(0) is still pinned by b.
        assert_eq!(policy.evict_over_budget(), vec![d(1)]);
        assert!(policy.is_pinned(&d(0)) && !policy.is_pinned(&d(2)));
    }

    #[test]
    fn a_second_admission_is_not_an_access() {
        let mut policy = Policy::new(10);
        assert!(policy.admit(&d(0), 1));
        assert!(!policy.admit(&d(0), 1));
        assert_eq!(policy.occupancy().protected_bytes, 0);
        assert_eq!(policy.occupancy().bytes, 1);
    }

    #[test]
    fn removal_is_fenced_by_generation() {
        let mut policy = Policy::new(10);
        policy.admit(&d(0), 1);
        let first = policy.generation(&d(0)).unwrap();
        assert!(policy.remove(&d(0), Some(first)));
        policy.admit(&d(0), 1);
        assert!(!policy.remove(&d(0), Some(first)));
        assert!(policy.remove(&d(0), None));
        assert_eq!(policy.occupancy(), Occupancy::default());
    }

    #[test]
    fn state_round_trips_and_unknown_blocks_start_cold_in_probation() {
        let mut policy = Policy::new(10);
        for n in 0..4 {
            policy.admit(&d(n), 1);
        }
        policy.touch(&d(2));
        let state = policy.state();
        let json = serde_json::to_vec(&state).unwrap();
        let state: PolicyState = serde_json::from_slice(&json).unwrap();
        // d(1) vanished from disk; d(9) appeared.
        let on_disk: Vec<_> = [0, 2, 3, 9].into_iter().map(|n| (d(n), 1)).collect();
        let mut restored = Policy::restore(3, &on_disk, Some(&state));
        assert_eq!(restored.occupancy().protected_bytes, 1);
        assert!(!restored.contains(&d(1)));
        // Over budget by one: the unknown block is the coldest.
        assert_eq!(restored.evict_over_budget(), vec![d(9)]);
        assert_eq!(restored.evict_over_budget(), Vec::<Digest>::new());
        assert_eq!(restored.state().protected, vec![d(2)]);
        assert_eq!(restored.state().probation, vec![d(0), d(3)]);
    }
}
