//! The addresses a slot learned from DNS answers, mirrored from its nft set.
//!
//! Each address remembers which names it was learned from, and until when each name's
//! answer holds it open (`max(TTL, 60 s)` from the answer). The kernel's set element lives
//! until the latest of those, plus a little slack, so repeated answers do not rewrite the set
//! on every query: the set is written only when an answer outlives what the kernel holds.
//! When the policy changes, only addresses with at least one name the new policy still
//! allows are kept ([`LearnedAddresses::retain_allowed`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use crate::policy::{Action, EgressPolicy};

/// Shortest time an answer's addresses stay open, whatever its TTL.
pub const MIN_HOLD: Duration = Duration::from_secs(60);

/// Added to what the kernel holds when an element is (re)written, so answers within that
/// margin do not rewrite it.
pub const SLACK: Duration = Duration::from_secs(10);

/// Most names remembered per address (the ones expiring first are forgotten).
pub const MAX_NAMES_PER_ADDRESS: usize = 16;

/// The learned addresses of one slot.
#[derive(Clone, Debug, Default)]
pub struct LearnedAddresses {
    entries: HashMap<Ipv4Addr, Entry>,
}

#[derive(Clone, Debug)]
struct Entry {
    /// Name -> until when its answer holds the address open.
    names: BTreeMap<String, Instant>,
    /// Until when the kernel's element lives.
    kernel_until: Instant,
}

/// The set holds as many addresses as it may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the slot already holds {0} learned addresses")]
pub struct Full(pub usize);

impl LearnedAddresses {
    /// Records an answer for `name` at `now`; returns the elements to write to the kernel
    /// (address, timeout), empty when the kernel already holds them long enough. Fails,
    /// recording nothing, when new addresses would exceed `capacity`.
    pub fn learn(
        &mut self,
        now: Instant,
        name: &str,
        answers: &[(Ipv4Addr, u32)],
        capacity: usize,
    ) -> Result<Vec<(Ipv4Addr, Duration)>, Full> {
        self.prune(now);
        let new: HashSet<Ipv4Addr> = answers
            .iter()
            .map(|(addr, _)| *addr)
            .filter(|addr| !self.entries.contains_key(addr))
            .collect();
        let new = new.len();
        if self.entries.len() + new > capacity {
            return Err(Full(self.entries.len()));
        }
        let mut writes = Vec::new();
        for &(addr, ttl) in answers {
            let hold = MIN_HOLD.max(Duration::from_secs(u64::from(ttl)));
            let until = now + hold;
            let entry = self.entries.entry(addr).or_insert_with(|| Entry {
                names: BTreeMap::new(),
                kernel_until: now,
            });
            let held = entry.names.entry(name.to_owned()).or_insert(until);
            *held = (*held).max(until);
            if entry.names.len() > MAX_NAMES_PER_ADDRESS {
                let first = entry
                    .names
                    .iter()
                    .min_by_key(|(_, t)| **t)
                    .map(|(n, _)| n.clone());
                entry.names.remove(&first.expect("more than one name"));
            }
            if entry.kernel_until < until {
                entry.kernel_until = until + SLACK;
                writes.push((addr, hold + SLACK));
            }
        }
        Ok(writes)
    }

    /// Forgets that the kernel holds `addrs` (their write failed), so the next answer
    /// writes them again.
    pub fn unwritten(&mut self, now: Instant, addrs: &[(Ipv4Addr, Duration)]) {
        for (addr, _) in addrs {
            if let Some(entry) = self.entries.get_mut(addr) {
                entry.kernel_until = now;
            }
        }
    }

    /// What stays under `policy`: addresses with a name it allows, each until the latest
    /// of those names' answers; everything else is forgotten. Returns the elements the
    /// kernel's set must hold now (address, remaining time).
    pub fn retain_allowed(
        &mut self,
        now: Instant,
        policy: &EgressPolicy,
    ) -> Vec<(Ipv4Addr, Duration)> {
        self.prune(now);
        self.entries.retain(|_, entry| {
            entry
                .names
                .retain(|name, _| policy.decide_name(name) == Action::Allow);
            !entry.names.is_empty()
        });
        let mut kept: Vec<(Ipv4Addr, Duration)> = self
            .entries
            .iter_mut()
            .map(|(addr, entry)| {
                let until = *entry
                    .names
                    .values()
                    .max()
                    .expect("pruned entries have names");
                entry.kernel_until = until;
                (*addr, until - now)
            })
            .collect();
        kept.sort();
        kept
    }

    /// Whether `addr` is open at `now`.
    pub fn contains(&self, now: Instant, addr: Ipv4Addr) -> bool {
        self.entries
            .get(&addr)
            .is_some_and(|e| e.names.values().any(|until| *until > now))
    }

    /// How many addresses are remembered (expired ones included until the next change).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Drops expired names, and addresses left without one.
    fn prune(&mut self, now: Instant) {
        self.entries.retain(|_, entry| {
            entry.names.retain(|_, until| *until > now);
            !entry.names.is_empty()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Rule;

    const A: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
    const B: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 2);

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn answers_hold_addresses_for_their_ttl_but_at_least_a_minute() {
        let now = Instant::now();
        let mut book = LearnedAddresses::default();
        let writes = book.learn(now, "a.test", &[(A, 5), (B, 300)], 10).unwrap();
        assert_eq!(writes, [(A, MIN_HOLD + SLACK), (B, secs(300) + SLACK)]);
        assert!(book.contains(now + secs(59), A));
        assert!(!book.contains(now + secs(60), A));
        assert!(book.contains(now + secs(299), B));
    }

    #[test]
    fn the_kernel_is_written_only_when_an_answer_outlives_what_it_holds() {
        let now = Instant::now();
        let mut book = LearnedAddresses::default();
        book.learn(now, "a.test", &[(A, 60)], 10).unwrap();
        assert!(
            book.learn(now + secs(5), "a.test", &[(A, 60)], 10)
                .unwrap()
                .is_empty()
        );
        assert!(
            book.learn(now + secs(9), "b.test", &[(A, 30)], 10)
                .unwrap()
                .is_empty()
        );
        let later = book
            .learn(now + secs(11), "a.test", &[(A, 60)], 10)
            .unwrap();
        assert_eq!(later, [(A, MIN_HOLD + SLACK)]);
        book.unwritten(now + secs(11), &later);
        assert_eq!(
            book.learn(now + secs(12), "a.test", &[(A, 60)], 10)
                .unwrap(),
            [(A, MIN_HOLD + SLACK)],
            "a failed write is retried"
        );
    }

    #[test]
    fn a_full_book_refuses_new_addresses_but_refreshes_known_ones() {
        let now = Instant::now();
        let mut book = LearnedAddresses::default();
        book.learn(now, "a.test", &[(A, 60)], 1).unwrap();
        assert_eq!(book.learn(now, "b.test", &[(B, 60)], 1), Err(Full(1)));
        assert!(!book.contains(now, B));
        assert!(book.learn(now, "c.test", &[(A, 600)], 1).is_ok());
        // Expired addresses make room.
        assert!(book.learn(now + secs(601), "b.test", &[(B, 60)], 1).is_ok());
        assert_eq!(book.len(), 1);
    }

    #[test]
    fn a_policy_change_keeps_addresses_of_names_it_still_allows() {
        let now = Instant::now();
        let mut book = LearnedAddresses::default();
        book.learn(now, "keep.test", &[(A, 120)], 10).unwrap();
        book.learn(now, "drop.test", &[(A, 600), (B, 600)], 10)
            .unwrap();
        let policy = EgressPolicy::try_new(
            Action::Deny,
            vec![Rule::parse(0, "allow", "keep.test").unwrap()],
        )
        .unwrap();
        let kept = book.retain_allowed(now + secs(20), &policy);
        assert_eq!(
            kept,
            [(A, secs(100))],
            "A stays for keep.test's answer only"
        );
        assert!(!book.contains(now + secs(20), B));
        assert!(!book.contains(now + secs(121), A));
        assert!(
            book.retain_allowed(now, &EgressPolicy::deny_all())
                .is_empty()
        );
        assert!(book.is_empty());
    }

    #[test]
    fn each_address_remembers_a_bounded_number_of_names() {
        let now = Instant::now();
        let mut book = LearnedAddresses::default();
        for i in 0..(MAX_NAMES_PER_ADDRESS as u32 + 5) {
            book.learn(now, &format!("n{i}.test"), &[(A, 100 + i)], 10)
                .unwrap();
        }
        let names = &book.entries[&A].names;
        assert_eq!(names.len(), MAX_NAMES_PER_ADDRESS);
        assert!(
            !names.contains_key("n0.test"),
            "the earliest-expiring name goes"
        );
    }
}
