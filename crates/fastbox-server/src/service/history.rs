//! The store's history, compacted by the leader: etcd keeps every version of every record
//! until told otherwise, and a busy cluster's keyspace grows into etcd's space quota. The
//! leader drops the history older than [`KEEP`] (a watch lagging further behind reads
//! everything again), so etcd's own auto-compaction need not be configured.

use std::time::{Duration, Instant};

use super::lifecycle::Lifecycle;

/// How much history is kept (between this and twice this).
pub const KEEP: Duration = Duration::from_secs(300);

impl Lifecycle {
    /// Compacts the history up to the revision noted [`KEEP`] ago, and notes the present.
    pub(super) fn compact_history(&self) {
        if !self.cluster.is_shared() {
            return;
        }
        let mut mark = self.history_mark.lock().expect("history lock");
        if mark.is_some_and(|(at, _)| at.elapsed() < KEEP) {
            return;
        }
        let Ok(now) = self.store.revision() else {
            return;
        };
        if let Some((_, before)) = *mark {
            match self.store.compact(before) {
                Ok(()) => tracing::info!(revision = before, "compacted the state's history"),
                Err(e) => tracing::warn!(error = %e, "compacting the state's history failed"),
            }
        }
        *mark = Some((Instant::now(), now));
    }
}
