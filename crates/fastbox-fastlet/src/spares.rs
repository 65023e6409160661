//! Spare slots: network slots with an empty writable layer, made ahead of demand by a
//! background thread so that a restore only renames a directory and mounts an overlay (see
//! [`crate::host::Spare`]). Taking one is O(1) under one lock; the filler makes another.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};

use crate::host::Spare;

/// The spares of one node, kept at a target count.
#[derive(Debug)]
pub struct SparePool {
    target: usize,
    state: Mutex<State>,
    room: Condvar,
}

#[derive(Debug, Default)]
struct State {
    ready: VecDeque<Spare>,
    /// A spare is being made (counts towards the target).
    making: usize,
    stopped: bool,
}

impl SparePool {
    pub fn new(target: usize) -> Self {
        Self {
            target,
            state: Mutex::new(State::default()),
            room: Condvar::new(),
        }
    }

    pub fn target(&self) -> usize {
        self.target
    }

    /// Whether a ready spare is slot `index`.
    pub fn holds(&self, index: u32) -> bool {
        self.state
            .lock()
            .expect("spares lock")
            .ready
            .iter()
            .any(|s| s.index == index)
    }

    /// A ready spare, if any; wakes the filler.
    pub fn take(&self) -> Option<Spare> {
        let spare = self.state.lock().expect("spares lock").ready.pop_front();
        if spare.is_some() {
            self.room.notify_one();
        }
        spare
    }

    /// For the filler: blocks until the pool is below its target, then counts one spare as
    /// being made. False once the pool is stopped.
    pub fn wait_for_room(&self) -> bool {
        let mut state = self.state.lock().expect("spares lock");
        loop {
            if state.stopped {
                return false;
            }
            if state.ready.len() + state.making < self.target {
                state.making += 1;
                return true;
            }
            state = self.room.wait(state).expect("spares lock");
        }
    }

    /// For the filler: the spare it was making, or `None` when making it failed. Returns
    /// the spare back when the pool was stopped meanwhile: the caller removes it, then calls
    /// [`SparePool::discarded`].
    pub fn made(&self, spare: Option<Spare>) -> Option<Spare> {
        let mut state = self.state.lock().expect("spares lock");
        match spare {
            Some(spare) if state.stopped => Some(spare),
            Some(spare) => {
                state.making -= 1;
                state.ready.push_back(spare);
                None
            }
            None => {
                state.making -= 1;
                self.room.notify_all();
                None
            }
        }
    }

    /// A spare handed back by [`SparePool::made`] is removed.
    pub fn discarded(&self) {
        self.state.lock().expect("spares lock").making -= 1;
        self.room.notify_all();
    }

    /// Stops the filler, waits for a spare in the making (the filler removes it), and hands
    /// out every ready spare (for removal).
    pub fn drain(&self) -> Vec<Spare> {
        let mut state = self.state.lock().expect("spares lock");
        state.stopped = true;
        self.room.notify_all();
        while state.making > 0 {
            state = self.room.wait(state).expect("spares lock");
        }
        state.ready.drain(..).collect()
    }

    pub fn ready(&self) -> usize {
        self.state.lock().expect("spares lock").ready.len()
    }
}
