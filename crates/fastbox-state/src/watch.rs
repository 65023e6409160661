//! Changes of the store as they happen, for the caches of servers sharing it.
//!
//! A [`Watch`] delivers every put and delete under the store's prefix from a revision on,
//! in revision order. It reconnects by itself after a failure, from the revision after the
//! last one it delivered; when the store no longer has that history (etcd compacted it) it
//! delivers [`WatchEvent::Reset`] and goes on from the present: the receiver reads every
//! table again.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Receiver;
use std::time::Duration;

use crate::{Entry, Revision};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    /// Record `entry.key` of `table` was written (its new version).
    Put { table: String, entry: Entry },
    /// Record `key` of `table` was removed at `revision`.
    Delete {
        table: String,
        key: String,
        revision: Revision,
    },
    /// Changes were missed (the history is gone): read every table again.
    Reset,
}

/// A stream of [`WatchEvent`]s; dropping it stops the watch.
pub struct Watch {
    rx: Receiver<WatchEvent>,
    stop: Arc<AtomicBool>,
}

impl Watch {
    /// A watch fed through `rx`, stopped by setting `stop`.
    pub(crate) fn new(rx: Receiver<WatchEvent>, stop: Arc<AtomicBool>) -> Self {
        Self { rx, stop }
    }

    /// The next event, waiting at most `wait` (None: none came, or the watch ended).
    pub fn next(&self, wait: Duration) -> Option<WatchEvent> {
        self.rx.recv_timeout(wait).ok()
    }

    /// Whether the watch ended (its feeder stopped).
    pub fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
