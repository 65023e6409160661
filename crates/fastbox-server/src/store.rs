//! The server's records in the state store (`fastbox_state`: the embedded redb file by
//! default, or etcd): sandboxes, templates, snapshots and nodes as JSON, written before the
//! server acts on them and read back after a restart.
//!
//! Nothing is written blind: every write is a compare-and-swap against the revision of the
//! version it replaces. A sandbox record carries its revision (`SandboxRecord::revision`);
//! for the other records the store remembers the revision of each as this server last read
//! or wrote it. A write that meets a change it has not seen fails (see
//! [`StoreError::is_conflict`]); the caller reads the record again ([`Store::reload`]) and
//! decides anew.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use fastbox_api::templates::Template;
use fastbox_state::{Entry, RedbBackend, Revision, StateBackend, StateError};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::record::{IdempotentCreate, NodeRecord, SandboxRecord, SnapshotRecord};

pub const SANDBOXES: &str = "sandboxes";
pub const TEMPLATES: &str = "templates";
pub const SNAPSHOTS: &str = "snapshots";
pub const NODES: &str = "nodes";
/// Creates made with an `Idempotency-Key`, by a digest of the key.
pub const IDEMPOTENCY: &str = "idempotency";
/// Every table of the server's records (what `fastbox state migrate` copies).
pub const TABLES: [&str; 5] = [SANDBOXES, TEMPLATES, SNAPSHOTS, NODES, IDEMPOTENCY];
/// Files every server of a shared store uses alike (file name -> contents), sealed in the
/// store like every record.
pub type SharedFiles = std::collections::BTreeMap<String, String>;

/// The table of the store's own records, and its canary ([`Store::check_canary`]).
const META: &str = "meta";
const CANARY: &str = "canary";
/// The key the reachability probe reads (never written).
const PROBE_KEY: &str = "-probe-";

pub use fastbox_state::StateUrl;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    State(StateError),
    #[error("state store: record {id} is unreadable: {source}")]
    Corrupt {
        id: String,
        source: serde_json::Error,
    },
}

impl StoreError {
    /// Someone else changed the record since this server read it.
    pub fn is_conflict(&self) -> bool {
        matches!(self, Self::State(StateError::Conflict { .. }))
    }
}

impl From<StateError> for StoreError {
    fn from(e: StateError) -> Self {
        Self::State(e)
    }
}

pub struct Store {
    backend: Arc<dyn StateBackend>,
    /// The last operation found the store unreachable (what the server answers from its
    /// cache meanwhile may be stale).
    unreachable: Arc<AtomicBool>,
    /// The revision of each record (table, id) as this server last read or wrote it.
    revisions: Mutex<HashMap<(&'static str, String), Revision>>,
}

impl Store {
    /// Opens (or creates) the embedded store at `path`.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        Ok(Self::with_backend(Arc::new(RedbBackend::open(path)?)))
    }

    /// The records in `backend`.
    pub fn with_backend(backend: Arc<dyn StateBackend>) -> Self {
        Self {
            backend,
            unreachable: Arc::new(AtomicBool::new(false)),
            revisions: Mutex::new(HashMap::new()),
        }
    }

    /// True while the store cannot be reached: reads answer from the server's last known
    /// state (`X-Fastbox-Stale`).
    pub fn is_unreachable(&self) -> bool {
        self.unreachable.load(Ordering::Relaxed)
    }

    /// Looks at the store every `every` on a thread of its own (so the server notices an
    /// unreachable store without a write failing, and its return), for as long as the
    /// process runs.
    pub fn watch_reachability(&self, every: std::time::Duration) {
        let (backend, unreachable) = (self.backend.clone(), self.unreachable.clone());
        std::thread::Builder::new()
            .name("state-probe".into())
            .spawn(move || {
                loop {
                    let reached = !matches!(
                        backend.get(SANDBOXES, PROBE_KEY),
                        Err(StateError::Unavailable(_))
                    );
                    if unreachable.swap(!reached, Ordering::Relaxed) == reached {
                        match reached {
                            true => tracing::info!("the state store answers again"),
                            false => tracing::warn!(
                                "the state store does not answer: changes are refused (503) \
                                 and reads are answered from what this server knows"
                            ),
                        }
                    }
                    std::thread::sleep(every);
                }
            })
            .expect("spawn the state probe");
    }

    /// Notes whether `result` reached the store.
    fn noted<T>(&self, result: Result<T, StateError>) -> Result<T, StoreError> {
        let unreachable = matches!(result, Err(StateError::Unavailable(_)));
        self.unreachable.store(unreachable, Ordering::Relaxed);
        Ok(result?)
    }

    /// Checks that this server reads the records the others write: a canary record, written
    /// by the first server, must open with this server's seal key (a server given another
    /// key fails here, at its start, naming both keys).
    pub fn check_canary(&self) -> Result<(), StoreError> {
        match self.noted(self.backend.get(META, CANARY))? {
            Some(_) => Ok(()),
            None => match self.noted(self.backend.put(META, CANARY, b"fastbox", 0, None)) {
                Ok(_) => Ok(()),
                // Written by another server meanwhile: read it.
                Err(e) if e.is_conflict() => self.noted(self.backend.get(META, CANARY)).map(drop),
                Err(e) => Err(e),
            },
        }
    }

    /// The files shared under `name` by the servers of this store (the control API's TLS
    /// identity, the join token), by file name.
    pub fn shared_files(&self, name: &str) -> Result<Option<SharedFiles>, StoreError> {
        match self.noted(self.backend.get(META, &format!("files/{name}")))? {
            Some(entry) => self.decode(META, entry).map(Some),
            None => Ok(None),
        }
    }

    /// Shares `files` under `name`, unless some are shared there already (a conflict).
    pub fn share_files(&self, name: &str, files: &SharedFiles) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(files).expect("records serialize");
        self.noted(
            self.backend
                .put(META, &format!("files/{name}"), &bytes, 0, None),
        )
        .map(drop)
    }

    /// The store's current revision (0 for a store no other server shares).
    pub fn revision(&self) -> Result<Revision, StoreError> {
        match self.backend.coordinator() {
            Some(c) => self.noted(c.revision()),
            None => Ok(0),
        }
    }

    /// Drops the store's history before `revision` (nothing to do alone).
    pub fn compact(&self, revision: Revision) -> Result<(), StoreError> {
        match self.backend.coordinator() {
            Some(c) => self.noted(c.compact(revision)),
            None => Ok(()),
        }
    }

    /// Every change from revision `from` on (None: no other server shares the store).
    pub fn watch(&self, from: Revision) -> Result<Option<fastbox_state::Watch>, StoreError> {
        self.noted(self.backend.watch(from))
    }

    /// The backend (for the cluster's leases and claims).
    pub fn backend(&self) -> Arc<dyn StateBackend> {
        self.backend.clone()
    }

    /// Where the records are, for logs.
    pub fn describe(&self) -> String {
        self.backend.describe()
    }

    /// Writes `record` durably if the store still has it at `record.revision` (0: a new
    /// record); returns its new revision.
    pub fn put(&self, record: &SandboxRecord) -> Result<Revision, StoreError> {
        let bytes = serde_json::to_vec(record).expect("records serialize");
        self.noted(self.backend.put(
            SANDBOXES,
            &record.id,
            &bytes,
            record.revision,
            fence().as_ref(),
        ))
    }

    /// Creates `record` (new: it must not exist) only while the `guard` holds (its
    /// idempotency key still names it); returns its revision.
    pub fn create_under(
        &self,
        record: &SandboxRecord,
        guard: &fastbox_state::Guard,
    ) -> Result<Revision, StoreError> {
        let bytes = serde_json::to_vec(record).expect("records serialize");
        self.noted(
            self.backend
                .create_under(SANDBOXES, &record.id, &bytes, guard),
        )
    }

    /// Removes `record` if the store still has it at `record.revision`.
    pub fn remove(&self, record: &SandboxRecord) -> Result<(), StoreError> {
        self.noted(
            self.backend
                .delete(SANDBOXES, &record.id, record.revision, fence().as_ref()),
        )
    }

    /// Every sandbox record, each with its revision.
    pub fn load(&self) -> Result<Vec<SandboxRecord>, StoreError> {
        self.noted(self.backend.list(SANDBOXES))?
            .into_iter()
            .map(sandbox)
            .collect()
    }

    /// Sandbox `id` as the store has it now (None: gone), after a conflict.
    pub fn reload(&self, id: &str) -> Result<Option<SandboxRecord>, StoreError> {
        self.noted(self.backend.get(SANDBOXES, id))?
            .map(sandbox)
            .transpose()
    }

    /// Writes a template durably.
    pub fn put_template(&self, template: &Template) -> Result<(), StoreError> {
        self.put_in(TEMPLATES, &template.template_id, template)
    }

    pub fn remove_template(&self, id: &str) -> Result<(), StoreError> {
        self.remove_from(TEMPLATES, id)
    }

    /// Every template.
    pub fn load_templates(&self) -> Result<Vec<Template>, StoreError> {
        self.load_from(TEMPLATES)
    }

    /// Writes a snapshot record durably.
    pub fn put_snapshot(&self, snapshot: &SnapshotRecord) -> Result<(), StoreError> {
        self.put_in(SNAPSHOTS, &snapshot.id, snapshot)
    }

    pub fn remove_snapshot(&self, id: &str) -> Result<(), StoreError> {
        self.remove_from(SNAPSHOTS, id)
    }

    /// Every snapshot record.
    pub fn load_snapshots(&self) -> Result<Vec<SnapshotRecord>, StoreError> {
        self.load_from(SNAPSHOTS)
    }

    /// The create made with idempotency key `key` (a digest of the client's key), if any.
    pub fn idempotent_create(&self, key: &str) -> Result<Option<IdempotentCreate>, StoreError> {
        match self.noted(self.backend.get(IDEMPOTENCY, key))? {
            Some(entry) => self.decode(IDEMPOTENCY, entry).map(Some),
            None => Ok(None),
        }
    }

    /// Records the create of idempotency key `key`, unless one is recorded (a conflict).
    /// Returns the key's revision: the guard of the sandbox's creation
    /// ([`Store::idempotency_guard`]).
    pub fn record_idempotent_create(
        &self,
        key: &str,
        create: &IdempotentCreate,
    ) -> Result<Revision, StoreError> {
        let bytes = serde_json::to_vec(create).expect("records serialize");
        let revision = self.noted(self.backend.put(IDEMPOTENCY, key, &bytes, 0, None))?;
        self.remember(IDEMPOTENCY, key, Some(revision));
        Ok(revision)
    }

    /// The guard of a create recorded under idempotency key `key` at `revision`: its sandbox
    /// is created only while the key is there, unchanged.
    pub fn idempotency_guard(key: &str, revision: Revision) -> fastbox_state::Guard {
        fastbox_state::Guard {
            table: IDEMPOTENCY.to_string(),
            key: key.to_string(),
            revision,
        }
    }

    /// Forgets idempotency key `key`.
    pub fn remove_idempotent_create(&self, key: &str) -> Result<(), StoreError> {
        self.remove_from(IDEMPOTENCY, key)
    }

    /// Forgets idempotency key `key` if it is still at `revision` (the one its create
    /// recorded) and sandbox `id`, the one it was recorded for, is not recorded.
    pub fn give_back_idempotent_create(
        &self,
        key: &str,
        revision: Revision,
        id: &str,
    ) -> Result<(), StoreError> {
        let absent = fastbox_state::Guard {
            table: SANDBOXES.to_string(),
            key: id.to_string(),
            revision: 0,
        };
        self.noted(
            self.backend
                .delete_under(IDEMPOTENCY, key, revision, &absent),
        )?;
        self.remember(IDEMPOTENCY, key, None);
        Ok(())
    }

    /// Every idempotency key and its create.
    pub fn idempotent_creates(&self) -> Result<Vec<(String, IdempotentCreate)>, StoreError> {
        self.noted(self.backend.list(IDEMPOTENCY))?
            .into_iter()
            .map(|entry| {
                let key = entry.key.clone();
                self.decode(IDEMPOTENCY, entry).map(|c| (key, c))
            })
            .collect()
    }

    /// Writes a registered node durably.
    pub fn put_node(&self, node: &NodeRecord) -> Result<(), StoreError> {
        self.put_in(NODES, &node.node_id, node)
    }

    pub fn remove_node(&self, id: &str) -> Result<(), StoreError> {
        self.remove_from(NODES, id)
    }

    /// Node `id` as the store has it now.
    pub fn reload_node(&self, id: &str) -> Result<Option<NodeRecord>, StoreError> {
        match self.noted(self.backend.get(NODES, id))? {
            Some(entry) => self.decode(NODES, entry).map(Some),
            None => Ok(None),
        }
    }

    /// Every registered node.
    pub fn load_nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        self.load_from(NODES)
    }

    /// A record of `table` another server wrote (a watch's change), when it is newer than
    /// the version this server knows: decoded, its revision remembered. None when this
    /// server knows that version or a later one.
    pub fn changed<T: DeserializeOwned>(
        &self,
        table: &'static str,
        entry: Entry,
    ) -> Result<Option<T>, StoreError> {
        if self.known(table, &entry.key) >= entry.revision {
            return Ok(None);
        }
        self.decode(table, entry).map(Some)
    }

    /// Whether record `key` of `table`, removed at `revision` by another server, is newer
    /// than what this server knows (then it forgets the revision).
    pub fn removed(&self, table: &'static str, key: &str, revision: Revision) -> bool {
        let newer = self.known(table, key) < revision;
        if newer {
            self.remember(table, key, None);
        }
        newer
    }

    /// A sandbox record of a watch's change.
    pub fn sandbox_of(entry: Entry) -> Result<SandboxRecord, StoreError> {
        sandbox(entry)
    }

    fn known(&self, table: &'static str, key: &str) -> Revision {
        self.revisions
            .lock()
            .expect("revisions lock")
            .get(&(table, key.to_string()))
            .copied()
            .unwrap_or(0)
    }

    fn remember(&self, table: &'static str, key: &str, revision: Option<Revision>) {
        let mut revisions = self.revisions.lock().expect("revisions lock");
        match revision {
            Some(revision) => revisions.insert((table, key.to_string()), revision),
            None => revisions.remove(&(table, key.to_string())),
        };
    }

    fn put_in<T: Serialize>(
        &self,
        table: &'static str,
        key: &str,
        value: &T,
    ) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(value).expect("records serialize");
        let revision = self.noted(self.backend.put(
            table,
            key,
            &bytes,
            self.known(table, key),
            fence().as_ref(),
        ))?;
        self.remember(table, key, Some(revision));
        Ok(())
    }

    fn remove_from(&self, table: &'static str, key: &str) -> Result<(), StoreError> {
        self.noted(
            self.backend
                .delete(table, key, self.known(table, key), fence().as_ref()),
        )?;
        self.remember(table, key, None);
        Ok(())
    }

    fn load_from<T: DeserializeOwned>(&self, table: &'static str) -> Result<Vec<T>, StoreError> {
        self.noted(self.backend.list(table))?
            .into_iter()
            .map(|entry| self.decode(table, entry))
            .collect()
    }

    fn decode<T: DeserializeOwned>(
        &self,
        table: &'static str,
        entry: Entry,
    ) -> Result<T, StoreError> {
        let record =
            serde_json::from_slice(&entry.value).map_err(|source| StoreError::Corrupt {
                id: entry.key.clone(),
                source,
            })?;
        self.remember(table, &entry.key, Some(entry.revision));
        Ok(record)
    }
}

tokio::task_local! {
    /// The leadership the writes of this task are made under (the reconciler's), refused
    /// once it passed on.
    pub static FENCE: Option<fastbox_state::Fence>;
}

/// The fence of the running task's writes, if any.
fn fence() -> Option<fastbox_state::Fence> {
    FENCE.try_with(Clone::clone).ok().flatten()
}

/// A stored sandbox record, with its revision.
fn sandbox(entry: Entry) -> Result<SandboxRecord, StoreError> {
    let mut record: SandboxRecord =
        serde_json::from_slice(&entry.value).map_err(|source| StoreError::Corrupt {
            id: entry.key.clone(),
            source,
        })?;
    record.revision = entry.revision;
    Ok(record)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::tests::record;

    #[test]
    fn records_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        {
            let store = Store::open(&path).unwrap();
            store.put(&record("a")).unwrap();
            let mut b = record("b");
            b.revision = store.put(&b).unwrap();
            b.slot = Some(7);
            store.put(&b).unwrap();
            let mut c = record("c");
            c.revision = store.put(&c).unwrap();
            store.remove(&c).unwrap();
        }
        let store = Store::open(&path).unwrap();
        let mut all = store.load().unwrap();
        all.sort_by(|x, y| x.id.cmp(&y.id));
        assert_eq!(all.len(), 2);
        assert_eq!(all[1].slot, Some(7));
    }

    #[test]
    fn a_change_made_elsewhere_is_never_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        let store = Store::open(&path).unwrap();
        let mut a = record("a");
        a.revision = store.put(&a).unwrap();
        // Another writer of the same state (another server) changes it.
        let other = Store::with_backend(store.backend.clone());
        let mut theirs = other.load().unwrap().pop().unwrap();
        assert_eq!(theirs.revision, a.revision);
        theirs.slot = Some(9);
        other.put(&theirs).unwrap();
        // This server's write from the old version is refused, and a reload shows theirs.
        a.slot = Some(1);
        let error = store.put(&a).unwrap_err();
        assert!(error.is_conflict(), "{error}");
        assert!(store.remove(&a).unwrap_err().is_conflict());
        let now = store.reload("a").unwrap().unwrap();
        assert_eq!(now.slot, Some(9));
        let mut next = now;
        next.slot = Some(2);
        store.put(&next).unwrap();
        // A create of an id that exists is refused too.
        assert!(store.put(&record("a")).unwrap_err().is_conflict());
        // Templates, snapshots and nodes: this server's last seen revision.
        let template: Template = serde_json::from_value(serde_json::json!({
            "templateId": "t", "image": "x", "publish": "p", "format": "f",
            "status": {"phase": "Succeeded"},
            "createdAt": "2026-01-01T00:00:00Z", "updatedAt": "2026-01-01T00:00:00Z",
        }))
        .unwrap();
        store.put_template(&template).unwrap();
        other.load_templates().unwrap();
        other.put_template(&template).unwrap();
        assert!(store.put_template(&template).unwrap_err().is_conflict());
        store.load_templates().unwrap();
        store.put_template(&template).unwrap();
    }
}
