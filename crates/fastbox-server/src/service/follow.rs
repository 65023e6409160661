//! The caches of a server sharing its state store, kept up to date with what the other
//! servers write: a thread reads the store's watch and applies each change that is newer
//! than what this server holds (its own writes come back too, and are skipped).
//!
//! Sandboxes, templates, snapshots and registered nodes are followed: a node that registers
//! with one server is reached by every server (its lease is in the store too).

use std::sync::{Arc, Weak};
use std::time::Duration;

use fastbox_state::WatchEvent;

use crate::error::ApiError;
use crate::record::{NodeRecord, SandboxRecord};
use crate::store::{NODES, SANDBOXES, SNAPSHOTS, Store, StoreError, TEMPLATES};

use super::lifecycle::Lifecycle;

impl Lifecycle {
    /// Starts following the store's changes from the revision the records were loaded at
    /// (nothing to follow when no other server shares the store).
    pub fn follow_store(self: &Arc<Self>) -> Result<(), ApiError> {
        let Some(watch) = self.store.watch(self.loaded_at + 1)? else {
            return Ok(());
        };
        let this: Weak<Self> = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("state-follow".into())
            .spawn(move || {
                while !watch.stopped() {
                    let event = watch.next(Duration::from_millis(500));
                    let Some(lc) = this.upgrade() else {
                        break;
                    };
                    if let Some(event) = event
                        && let Err(e) = lc.apply(event)
                    {
                        tracing::warn!(error = %e, "a change of the state store was not applied");
                    }
                }
            })
            .map_err(|e| ApiError::Internal(format!("cannot follow the state store: {e}")))?;
        Ok(())
    }

    /// Applies one change of the store to the caches.
    fn apply(&self, event: WatchEvent) -> Result<(), StoreError> {
        match event {
            WatchEvent::Put { table, entry } => match table.as_str() {
                SANDBOXES => {
                    let record = Store::sandbox_of(entry)?;
                    let mut records = self.records.lock().expect("records lock");
                    if records
                        .get(&record.id)
                        .is_none_or(|r| r.revision < record.revision)
                    {
                        records.insert(record.id.clone(), record);
                    }
                }
                TEMPLATES => {
                    let key = entry.key.clone();
                    if let Some(template) = self.store.changed(TEMPLATES, entry)? {
                        self.templates
                            .lock()
                            .expect("templates lock")
                            .insert(key, template);
                    }
                }
                SNAPSHOTS => {
                    let key = entry.key.clone();
                    if let Some(snapshot) = self.store.changed(SNAPSHOTS, entry)? {
                        self.snapshots
                            .lock()
                            .expect("snapshots lock")
                            .insert(key, snapshot);
                    }
                }
                NODES => {
                    if let Some(record) = self.store.changed::<NodeRecord>(NODES, entry)?
                        && let Err(e) = self.admit_member(record)
                    {
                        tracing::warn!(error = %e, "a node registered with another server is not reached");
                    }
                }
                _ => {}
            },
            WatchEvent::Delete {
                table,
                key,
                revision,
            } => match table.as_str() {
                SANDBOXES => {
                    let mut records = self.records.lock().expect("records lock");
                    if records.get(&key).is_some_and(|r| r.revision < revision) {
                        records.remove(&key);
                    }
                }
                TEMPLATES if self.store.removed(TEMPLATES, &key, revision) => {
                    self.templates.lock().expect("templates lock").remove(&key);
                }
                SNAPSHOTS if self.store.removed(SNAPSHOTS, &key, revision) => {
                    self.snapshots.lock().expect("snapshots lock").remove(&key);
                }
                NODES if self.store.removed(NODES, &key, revision) => {
                    self.members.lock().expect("members lock").remove(&key);
                    self.nodes.remove(&key);
                }
                _ => {}
            },
            WatchEvent::Reset => self.reload()?,
        }
        Ok(())
    }

    /// Reads every record again (the watch missed changes).
    fn reload(&self) -> Result<(), StoreError> {
        let records = self.store.load()?;
        *self.records.lock().expect("records lock") = records
            .into_iter()
            .map(|r: SandboxRecord| (r.id.clone(), r))
            .collect();
        *self.templates.lock().expect("templates lock") = self
            .store
            .load_templates()?
            .into_iter()
            .map(|t| (t.template_id.clone(), t))
            .collect();
        *self.snapshots.lock().expect("snapshots lock") = self
            .store
            .load_snapshots()?
            .into_iter()
            .map(|s| (s.id.clone(), s))
            .collect();
        tracing::info!("read every record again (the state watch missed changes)");
        Ok(())
    }
}
