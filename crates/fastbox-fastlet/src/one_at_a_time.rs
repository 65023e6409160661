//! One operation at a time on the sandbox in a slot: a removal asked while a pause of the
//! same sandbox dumps it waits until the dump is over, instead of killing processes under
//! CRIU (a dump interrupted that way left the sandbox frozen, its processes never exiting),
//! and two dumps of one sandbox (a pause and a fork's snapshot) never run at once. A start
//! holds the turn of the slot reserved for it, so a removal or release of a start whose
//! server went away waits until the start ended and its result is known to the node.
//!
//! A turn is owned (`'static`): it moves into the thread that does the work, so it is held
//! until the work ends even when the call that asked for it is dropped (its caller hung up).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

type Lock = Arc<tokio::sync::Mutex<()>>;

/// Per-sandbox locks, each kept only while held or waited for.
#[derive(Default)]
pub struct OneAtATime {
    locks: Arc<Mutex<HashMap<u32, Lock>>>,
}

/// Holds slot `slot`'s lock until dropped.
pub struct Turn {
    locks: Arc<Mutex<HashMap<u32, Lock>>>,
    slot: u32,
    lock: Lock,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl OneAtATime {
    /// Waits for the turn of the sandbox in slot `slot`.
    pub async fn turn(&self, slot: u32) -> Turn {
        let lock = self
            .locks
            .lock()
            .expect("locks lock")
            .entry(slot)
            .or_default()
            .clone();
        let guard = lock.clone().lock_owned().await;
        Turn {
            locks: self.locks.clone(),
            slot,
            lock,
            guard: Some(guard),
        }
    }

    /// How many slots have a lock now (held or waited for).
    pub fn len(&self) -> usize {
        self.locks.lock().expect("locks lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut locks = self.locks.lock().expect("locks lock");
        // The map's copy and this one: nobody waits, the entry goes.
        if Arc::strong_count(&self.lock) <= 2 {
            locks.remove(&self.slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_second_operation_waits_for_the_first() {
        let ops = Arc::new(OneAtATime::default());
        let first = ops.turn(1).await;
        let other = ops.turn(2).await;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let waiter = {
            let ops = ops.clone();
            tokio::spawn(async move {
                let _turn = ops.turn(1).await;
                tx.send(()).unwrap();
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(rx.try_recv().is_err(), "the second ran during the first");
        drop(first);
        waiter.await.unwrap();
        assert!(rx.try_recv().is_ok());
        drop(other);
        assert!(ops.is_empty(), "locks are kept only while used");
    }

    #[tokio::test]
    async fn a_turn_moved_into_its_work_outlives_a_dropped_caller() {
        let ops = Arc::new(OneAtATime::default());
        let (started_tx, started_rx) = tokio::sync::oneshot::channel();
        let caller = {
            let ops = ops.clone();
            tokio::spawn(async move {
                let turn = ops.turn(7).await;
                let work = crate::blocking::run("t", move || {
                    let _turn = turn;
                    let _ = started_tx.send(());
                    std::thread::sleep(Duration::from_millis(300));
                });
                work.await
            })
        };
        started_rx.await.unwrap();
        caller.abort();
        let _ = caller.await;
        let early = tokio::time::timeout(Duration::from_millis(100), ops.turn(7)).await;
        assert!(
            early.is_err(),
            "the turn ended with its caller, not its work"
        );
        let later = tokio::time::timeout(Duration::from_secs(5), ops.turn(7)).await;
        assert!(later.is_ok(), "the turn never ended");
    }
}
