//! Warm pools: per template, sandboxes restored ahead of demand and left unclaimed (the
//! template's token, no entrypoint, egress denied). A create takes one in O(1) under one lock
//! and claims it; a refill thread restores replacements in the background.

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
    /// Sandboxes kept per template.
    target: usize,
    state: Mutex<PoolState>,
    wake: Condvar,
}

#[derive(Default)]
struct PoolState {
    templates: HashMap<String, Template>,
    ready: HashMap<String, VecDeque<Pooled>>,
    stopping: bool,
    /// When a sandbox was last taken: refills wait out a burst (a restore takes a core
    /// for ~100 ms, which the burst's claims would otherwise share).
    last_take: Option<std::time::Instant>,
}

/// A refill waits until no sandbox was taken for this long, unless its pool is empty.
pub const REFILL_QUIET: std::time::Duration = std::time::Duration::from_millis(50);

impl WarmPools {
    pub fn new(target: usize) -> Self {
        Self {
            target,
            state: Mutex::new(PoolState::default()),
            wake: Condvar::new(),
        }
    }

    pub fn target(&self) -> usize {
        self.target
    }

    /// Keeps `target` sandboxes of `template` from now on.
    pub fn register(&self, template: &Template) {
        if self.target == 0 {
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

    /// Takes a ready sandbox of template `key`, if there is one (and wakes the refill).
    pub fn take(&self, key: &str) -> Option<Pooled> {
        let mut state = self.lock();
        let taken = state.ready.get_mut(key)?.pop_front();
        if taken.is_some() {
            state.last_take = Some(std::time::Instant::now());
            self.wake.notify_all();
        }
        taken
    }

    /// Adds a freshly restored sandbox.
    pub fn put(&self, pooled: Pooled) {
        self.lock()
            .ready
            .entry(pooled.template.clone())
            .or_default()
            .push_back(pooled);
    }

    /// Ready sandboxes per template.
    pub fn sizes(&self) -> HashMap<String, usize> {
        self.lock()
            .ready
            .iter()
            .map(|(k, v)| (k.clone(), v.len()))
            .collect()
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
            let ready = |t: &Template| state.ready.get(&t.key).map_or(0, VecDeque::len);
            let short = state.templates.values().find(|t| ready(t) < self.target);
            let quiet = state.last_take.map_or(REFILL_QUIET, |at| at.elapsed());
            match short {
                Some(t) if ready(t) == 0 || quiet >= REFILL_QUIET => return Some(t.clone()),
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

    /// Stops the refill and hands back every ready sandbox (for removal).
    pub fn drain(&self) -> Vec<Pooled> {
        let mut state = self.lock();
        state.stopping = true;
        self.wake.notify_all();
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
        let pools = WarmPools::new(2);
        pools.register(&template("a"));
        assert_eq!(pools.next_to_fill().unwrap().key, "a");
        pools.put(pooled("a", 1));
        pools.put(pooled("a", 2));
        assert_eq!(pools.take("a").unwrap().placement.slot, 1);
        assert_eq!(pools.take("b").map(|p| p.placement.slot), None);
        assert_eq!(pools.next_to_fill().unwrap().key, "a");
        assert_eq!(pools.sizes()["a"], 1);
        let drained = pools.drain();
        assert_eq!(drained.len(), 1);
        assert!(pools.next_to_fill().is_none());
    }

    #[test]
    fn a_zero_target_keeps_nothing() {
        let pools = WarmPools::new(0);
        pools.register(&template("a"));
        pools.drain();
        assert!(pools.next_to_fill().is_none());
    }
}
