//! The embedded state store (redb, one file in the data directory): sandbox records, written
//! before the server acts on them and read back after a restart.

use std::path::Path;

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use fastbox_api::templates::Template;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::record::{NodeRecord, SandboxRecord, SnapshotRecord};

const SANDBOXES: TableDefinition<&str, &[u8]> = TableDefinition::new("sandboxes");
const TEMPLATES: TableDefinition<&str, &[u8]> = TableDefinition::new("templates");
const SNAPSHOTS: TableDefinition<&str, &[u8]> = TableDefinition::new("snapshots");
const NODES: TableDefinition<&str, &[u8]> = TableDefinition::new("nodes");

/// How long opening the store waits for a lock held by what a crashed run left.
pub const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The store's tables: id -> JSON.
type Table = TableDefinition<'static, &'static str, &'static [u8]>;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("state store: {0}")]
    Db(#[from] redb::Error),
    #[error("state store: record {id} is unreadable: {source}")]
    Corrupt {
        id: String,
        source: serde_json::Error,
    },
}

/// redb has an error type per operation; they all convert into `redb::Error`.
fn dbr<T, E: Into<redb::Error>>(r: Result<T, E>) -> Result<T, StoreError> {
    r.map_err(|e| StoreError::Db(e.into()))
}

pub struct Store {
    db: Database,
}

impl Store {
    /// Opens (or creates) the store at `path`. After a crash, a child process of the previous
    /// run caught between its fork and its exec may share the file's lock for a moment: the
    /// open waits up to [`LOCK_WAIT`] for it.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let deadline = std::time::Instant::now() + LOCK_WAIT;
        let db = loop {
            match Database::create(path) {
                Err(redb::DatabaseError::DatabaseAlreadyOpen)
                    if std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                other => break dbr(other)?,
            }
        };
        let txn = dbr(db.begin_write())?;
        dbr(txn.open_table(SANDBOXES))?;
        dbr(txn.open_table(TEMPLATES))?;
        dbr(txn.open_table(SNAPSHOTS))?;
        dbr(txn.open_table(NODES))?;
        dbr(txn.commit())?;
        Ok(Self { db })
    }

    /// Writes `record` durably (replacing an earlier version).
    pub fn put(&self, record: &SandboxRecord) -> Result<(), StoreError> {
        self.put_in(SANDBOXES, &record.id, record)
    }

    pub fn remove(&self, id: &str) -> Result<(), StoreError> {
        self.remove_from(SANDBOXES, id)
    }

    /// Every sandbox record.
    pub fn load(&self) -> Result<Vec<SandboxRecord>, StoreError> {
        self.load_from(SANDBOXES)
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

    /// Writes a registered node durably.
    pub fn put_node(&self, node: &NodeRecord) -> Result<(), StoreError> {
        self.put_in(NODES, &node.node_id, node)
    }

    pub fn remove_node(&self, id: &str) -> Result<(), StoreError> {
        self.remove_from(NODES, id)
    }

    /// Every registered node.
    pub fn load_nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        self.load_from(NODES)
    }

    fn put_in<T: Serialize>(&self, def: Table, key: &str, value: &T) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(value).expect("records serialize");
        let txn = dbr(self.db.begin_write())?;
        {
            let mut table = dbr(txn.open_table(def))?;
            dbr(table.insert(key, bytes.as_slice()))?;
        }
        dbr(txn.commit())
    }

    fn remove_from(&self, def: Table, key: &str) -> Result<(), StoreError> {
        let txn = dbr(self.db.begin_write())?;
        {
            let mut table = dbr(txn.open_table(def))?;
            dbr(table.remove(key))?;
        }
        dbr(txn.commit())
    }

    fn load_from<T: DeserializeOwned>(&self, def: Table) -> Result<Vec<T>, StoreError> {
        let txn = dbr(self.db.begin_read())?;
        let table = dbr(txn.open_table(def))?;
        let mut out = Vec::new();
        for item in dbr(table.iter())? {
            let (key, value) = dbr(item)?;
            let record =
                serde_json::from_slice(value.value()).map_err(|source| StoreError::Corrupt {
                    id: key.value().to_string(),
                    source,
                })?;
            out.push(record);
        }
        Ok(out)
    }
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
            store.put(&b).unwrap();
            b.slot = Some(7);
            store.put(&b).unwrap();
            store.put(&record("c")).unwrap();
            store.remove("c").unwrap();
        }
        let store = Store::open(&path).unwrap();
        let mut all = store.load().unwrap();
        all.sort_by(|x, y| x.id.cmp(&y.id));
        assert_eq!(all.len(), 2);
        assert_eq!(all[1].slot, Some(7));
    }
}
