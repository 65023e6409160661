//! Warm pools: per template, sandboxes restored ahead of demand and left unclaimed (the
//! template's token, no entrypoint, egress denied). A create takes one in O(1) under one lock
//! and claims it; a refill thread restores replacements in the background.
//!
//! Each template's pool is kept between `min` and `max`: at `min` when idle, and at the
//! number of creates of the template in the last [`DEMAND_WINDOW`] (hits and misses) when
//! that is more, so a burst finds the pool as large as the previous one was (up to `max`).
//! A pool above its target shrinks only by claims.

use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex};

use crate::agent::Placement;
use crate::template::Template;

/// Sandbox names of pooled sandboxes start with this (their directories and cgroups too).
pub const POOL_ID_PREFIX: &str = "pool-";

/// The file in a pooled sandbox's directory that records its slot (for clean-up after a
/// restart of the process).
pub const POOL_SLOT_FILE: &str = "pool-slot";

/// An unclaimed, restored sandbox.
#[derive(Debug, Clone)]
pub struct Pooled {
    pub placement: Placement,
    /// The key of its template.
    pub template: String,
}

/// The pools of one node and what they should hold.
pub struct WarmPools {
    /// Sandboxes kept per template when idle.
    min: usize,
    /// Most sandboxes kept per template.
    max: usize,
    state: Mutex<PoolState>,
    wake: Condvar,
}

/// How far back creates count as demand.
pub const DEMAND_WINDOW: std::time::Duration = std::time::Duration::from_secs(30);

#[derive(Default)]
struct PoolState {
    templates: HashMap<String, Template>,
    ready: HashMap<String, VecDeque<Pooled>>,
    /// When each template's sandboxes were asked for, within [`DEMAND_WINDOW`].
    demand: HashMap<String, VecDeque<std::time::Instant>>,
    /// Refills handed out by `next_to_fill` and not yet `filled`, per template.
    filling: HashMap<String, usize>,
    /// The slots pooled sandboxes are on their way in or out of (restored by a refill, or
    /// taken by a claim not yet routed), with the sandbox each holds.
    held_slots: HashMap<u32, String>,
    stopping: bool,
    /// When a sandbox was last taken: refills wait out a burst (a restore takes a core
    /// for ~100 ms, which the burst's claims would otherwise share).
    last_take: Option<std::time::Instant>,
}

/// A slot a pooled sandbox is on its way in or out of ([`WarmPools::hold_slot`]).
pub struct HeldSlot<'a> {
    pools: &'a WarmPools,
    slot: u32,
    id: String,
}

impl Drop for HeldSlot<'_> {
    fn drop(&mut self) {
        // Unless a claim took the slot's sandbox meanwhile and holds the slot now.
        let mut state = self.pools.lock();
        if state.held_slots.get(&self.slot) == Some(&self.id) {
            state.held_slots.remove(&self.slot);
        }
    }
}

/// A refill waits until no sandbox was taken for this long, unless its pool is empty.
pub const REFILL_QUIET: std::time::Duration = std::time::Duration::from_millis(50);

impl PoolState {
    /// Creates of template `key` within the window (older entries are dropped).
    fn demand(&mut self, key: &str, now: std::time::Instant) -> usize {
        let Some(times) = self.demand.get_mut(key) else {
            return 0;
        };
        while times
            .front()
            .is_some_and(|t| now.duration_since(*t) > DEMAND_WINDOW)
        {
            times.pop_front();
        }
        times.len()
    }
}

impl WarmPools {
    /// Pools of `min..=max` sandboxes per template (`max` 0: no pools; `min` is capped at
    /// `max`).
    pub fn new(min: usize, max: usize) -> Self {
        Self {
            min: min.min(max),
            max,
            state: Mutex::new(PoolState::default()),
            wake: Condvar::new(),
        }
    }

    /// The most sandboxes kept per template.
    pub fn max(&self) -> usize {
        self.max
    }

    /// How many sandboxes of template `key` are wanted now.
    fn target(&self, state: &mut PoolState, key: &str) -> usize {
        let now = std::time::Instant::now();
        state.demand(key, now).clamp(self.min, self.max)
    }

    /// Keeps sandboxes of `template` from now on.
    pub fn register(&self, template: &Template) {
        if self.max == 0 {
            return;
        }
        let mut state = self.lock();
        state
            .templates
            .entry(template.key.clone())
            .or_insert_with(|| template.clone());
        self.wake.notify_all();
    }

    /// Stops keeping sandboxes of template `key` (ready ones stay until taken or drained).
    pub fn unregister(&self, key: &str) {
        self.lock().templates.remove(key);
    }

    /// Takes a ready sandbox of template `key`, if there is one (and wakes the refill). Every
    /// call counts as demand, hit or miss.
    pub fn take(&self, key: &str) -> Option<Pooled> {
        let mut state = self.lock();
        let now = std::time::Instant::now();
        if self.max > 0 {
            state
                .demand
                .entry(key.to_string())
                .or_default()
                .push_back(now);
            let _ = state.demand(key, now);
        }
        let taken = state.ready.get_mut(key).and_then(VecDeque::pop_front);
        if taken.is_some() {
            state.last_take = Some(std::time::Instant::now());
            self.wake.notify_all();
        }
        taken
    }

    /// Adds a freshly restored sandbox; hands it back when the pools stopped meanwhile (the
    /// caller removes it).
    pub fn put(&self, pooled: Pooled) -> Option<Pooled> {
        let mut state = self.lock();
        if state.stopping {
            return Some(pooled);
        }
        state
            .ready
            .entry(pooled.template.clone())
            .or_default()
            .push_back(pooled);
        None
    }

    /// The refill of template `key` handed out by [`WarmPools::next_to_fill`] is over (done
    /// or failed).
    pub fn filled(&self, key: &str) {
        let mut state = self.lock();
        if let Some(n) = state.filling.get_mut(key) {
            *n = n.saturating_sub(1);
        }
        self.wake.notify_all();
    }

    /// Ready sandboxes per template.
    pub fn sizes(&self) -> HashMap<String, usize> {
        self.lock()
            .ready
            .iter()
            .map(|(k, v)| (k.clone(), v.len()))
            .collect()
    }

    /// The id of the sandbox in slot `slot`: a ready one, one still being restored there,
    /// or one taken and not yet routed; None when there is none.
    pub fn in_slot(&self, slot: u32) -> Option<String> {
        let state = self.lock();
        state.held_slots.get(&slot).cloned().or_else(|| {
            state
                .ready
                .values()
                .flatten()
                .find(|p| p.placement.slot == slot)
                .map(|p| p.placement.handle.id.clone())
        })
    }

    /// Slot `slot` holds sandbox `id` until the guard goes: a refill's, from its
    /// reservation until the sandbox is [`WarmPools::put`] (or given up); a claim's, from
    /// [`WarmPools::take`] until it is routed. Meanwhile a stale release of it is refused.
    pub fn hold_slot(&self, slot: u32, id: &str) -> HeldSlot<'_> {
        self.lock().held_slots.insert(slot, id.to_string());
        HeldSlot {
            pools: self,
            slot,
            id: id.to_string(),
        }
    }

    /// Runtime ids of the ready (unclaimed) sandboxes.
    pub fn ids(&self) -> Vec<String> {
        self.lock()
            .ready
            .values()
            .flatten()
            .map(|p| p.placement.handle.id.clone())
            .collect()
    }

    /// Blocks until a template is short of sandboxes (returns it) or the pools stop (None).
    pub fn next_to_fill(&self) -> Option<Template> {
        let mut state = self.lock();
        loop {
            if state.stopping {
                return None;
            }
            let keys: Vec<String> = state.templates.keys().cloned().collect();
            let mut short = None;
            for key in keys {
                let ready = state.ready.get(&key).map_or(0, VecDeque::len);
                let filling = state.filling.get(&key).copied().unwrap_or(0);
                if ready + filling < self.target(&mut state, &key) {
                    short = Some((key, ready));
                    break;
                }
            }
            let short = short.map(|(key, ready)| (state.templates[&key].clone(), ready));
            let quiet = state.last_take.map_or(REFILL_QUIET, |at| at.elapsed());
            match short {
                Some((t, ready)) if ready == 0 || quiet >= REFILL_QUIET => {
                    *state.filling.entry(t.key.clone()).or_default() += 1;
                    return Some(t);
                }
                Some(_) => {
                    let wait = REFILL_QUIET.saturating_sub(quiet);
                    state = self
                        .wake
                        .wait_timeout(state, wait)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                None => state = self.wake.wait(state).unwrap_or_else(|e| e.into_inner()),
            }
        }
    }

    /// Stops the refill, waits for a refill in flight to finish (it removes what it made),
    /// and hands back every ready sandbox (for removal).
    pub fn drain(&self) -> Vec<Pooled> {
        let mut state = self.lock();
        state.stopping = true;
        self.wake.notify_all();
        while state.filling.values().any(|n| *n > 0) {
            state = self.wake.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        state.ready.drain().flat_map(|(_, q)| q).collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fastbox_runtime::sandbox::SandboxHandle;

    fn template(digest: &str) -> Template {
        Template {
            key: digest.into(),
            image_digest: digest.into(),
            image_reference: "r".into(),
            rootfs: "/r".into(),
            checkpoint: "/c".into(),
            golden_token: "g".into(),
            build_ms: 1,
        }
    }

    fn pooled(digest: &str, n: u32) -> Pooled {
        Pooled {
            placement: Placement {
                slot: n,
                address: std::net::Ipv4Addr::new(10, 0, 0, n as u8),
                handle: SandboxHandle::unstarted(&format!("pool-{n}"), "p", "/x".into()),
            },
            template: digest.into(),
        }
    }

    #[test]
    fn takes_in_order_and_asks_for_refills() {
        let pools = WarmPools::new(2, 2);
        pools.register(&template("a"));
        assert_eq!(pools.next_to_fill().unwrap().key, "a");
        assert!(pools.put(pooled("a", 1)).is_none());
        pools.filled("a");
        assert_eq!(pools.next_to_fill().unwrap().key, "a");
        assert!(pools.put(pooled("a", 2)).is_none());
        pools.filled("a");
        assert_eq!(pools.take("a").unwrap().placement.slot, 1);
        assert_eq!(pools.take("b").map(|p| p.placement.slot), None);
        assert_eq!(pools.next_to_fill().unwrap().key, "a");
        assert_eq!(pools.sizes()["a"], 1);
        pools.filled("a");
        let drained = pools.drain();
        assert_eq!(drained.len(), 1);
        assert!(pools.next_to_fill().is_none());
        // A refill that ends after the drain gets its sandbox back.
        assert_eq!(pools.put(pooled("a", 3)).unwrap().placement.slot, 3);
    }

    #[test]
    fn a_pooled_slot_has_a_holder_from_its_reservation_to_its_claims_route() {
        let pools = WarmPools::new(1, 1);
        pools.register(&template("a"));
        assert_eq!(pools.in_slot(4), None);
        let filling = pools.hold_slot(4, "pool-4");
        assert_eq!(
            pools.in_slot(4).as_deref(),
            Some("pool-4"),
            "while restoring"
        );
        assert!(pools.put(pooled("a", 4)).is_none());
        assert_eq!(pools.in_slot(4).as_deref(), Some("pool-4"), "once ready");
        assert_eq!(pools.take("a").unwrap().placement.slot, 4);
        {
            let _claiming = pools.hold_slot(4, "claimed");
            // The refill's guard going after the claim took its sandbox leaves the claim's.
            drop(filling);
            assert_eq!(pools.in_slot(4).as_deref(), Some("claimed"), "until routed");
        }
        assert_eq!(
            pools.in_slot(4),
            None,
            "routed: its route names it from here"
        );
        // A refill given up frees its slot's holder.
        drop(pools.hold_slot(5, "pool-5"));
        assert_eq!(pools.in_slot(5), None);
    }

    #[test]
    fn refills_in_flight_count_and_the_drain_waits_for_them() {
        let pools = std::sync::Arc::new(WarmPools::new(2, 2));
        pools.register(&template("a"));
        assert!(pools.next_to_fill().is_some());
        assert!(pools.next_to_fill().is_some());
        // Two in flight fill the target: a third refill is not handed out.
        assert!(!wants_more_counting_flight(&pools));
        let drainer = {
            let pools = pools.clone();
            std::thread::spawn(move || pools.drain().len())
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(
            !drainer.is_finished(),
            "the drain waits for refills in flight"
        );
        assert!(pools.put(pooled("a", 1)).is_some());
        pools.filled("a");
        pools.filled("a");
        assert_eq!(drainer.join().unwrap(), 0);
    }

    #[test]
    fn a_zero_target_keeps_nothing() {
        let pools = WarmPools::new(0, 0);
        pools.register(&template("a"));
        pools.drain();
        assert!(pools.next_to_fill().is_none());
    }

    /// Whether a refill of `a` would be handed out now, refills in flight counted.
    fn wants_more_counting_flight(pools: &WarmPools) -> bool {
        let mut state = pools.lock();
        let ready = state.ready.get("a").map_or(0, VecDeque::len);
        let flight = state.filling.get("a").copied().unwrap_or(0);
        ready + flight < pools.target(&mut state, "a")
    }

    /// Whether the refill would restore another sandbox of `a` now (without blocking).
    fn wants_more(pools: &WarmPools) -> bool {
        let mut state = pools.lock();
        let ready = state.ready.get("a").map_or(0, VecDeque::len);
        ready < pools.target(&mut state, "a")
    }

    #[test]
    fn demand_grows_the_pool_up_to_max() {
        let pools = WarmPools::new(1, 3);
        pools.register(&template("a"));
        assert!(pools.put(pooled("a", 1)).is_none());
        assert!(!wants_more(&pools), "idle: min");
        // A burst of four creates: one hit, three misses.
        assert!(pools.take("a").is_some());
        for _ in 0..3 {
            assert!(pools.take("a").is_none());
        }
        for n in 2..=4 {
            assert!(wants_more(&pools));
            assert!(pools.put(pooled("a", n)).is_none());
        }
        assert!(!wants_more(&pools), "capped at max");
        assert_eq!(pools.sizes()["a"], 3);
    }
}
