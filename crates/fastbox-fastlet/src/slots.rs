//! Which network slot indexes of the instance's pool are taken. Admission is O(log n) under
//! one lock: the lowest free index is handed out, and an index is free again only after its
//! slot was destroyed.

use std::collections::BTreeSet;

/// The slot indexes of a pool of `capacity` slots.
#[derive(Debug)]
pub struct SlotTable {
    capacity: u32,
    used: BTreeSet<u32>,
}

impl SlotTable {
    pub fn new(capacity: u32) -> Self {
        Self {
            capacity,
            used: BTreeSet::new(),
        }
    }

    /// Takes the lowest free index, or `None` when every slot is in use.
    pub fn reserve(&mut self) -> Option<u32> {
        // The used set is dense at the bottom in steady state: the first gap is near its start.
        let mut candidate = 0;
        for &index in &self.used {
            if index != candidate {
                break;
            }
            candidate += 1;
        }
        (candidate < self.capacity).then(|| {
            self.used.insert(candidate);
            candidate
        })
    }

    /// Marks `index` as taken (recovery after a restart). False if it is out of range.
    pub fn claim(&mut self, index: u32) -> bool {
        index < self.capacity && {
            self.used.insert(index);
            true
        }
    }

    pub fn release(&mut self, index: u32) {
        self.used.remove(&index);
    }

    pub fn is_used(&self, index: u32) -> bool {
        self.used.contains(&index)
    }

    pub fn in_use(&self) -> usize {
        self.used.len()
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hands_out_the_lowest_free_index_until_full() {
        let mut t = SlotTable::new(3);
        assert_eq!(t.reserve(), Some(0));
        assert_eq!(t.reserve(), Some(1));
        assert_eq!(t.reserve(), Some(2));
        assert_eq!(t.reserve(), None);
        t.release(1);
        assert_eq!(t.reserve(), Some(1));
        assert_eq!(t.in_use(), 3);
    }

    #[test]
    fn claimed_indexes_are_skipped() {
        let mut t = SlotTable::new(4);
        assert!(t.claim(0));
        assert!(t.claim(2));
        assert!(!t.claim(9));
        assert_eq!(t.reserve(), Some(1));
        assert_eq!(t.reserve(), Some(3));
        assert_eq!(t.reserve(), None);
    }
}
