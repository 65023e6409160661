//! The embedded state store (redb, one file in the data directory): sandbox records, written
//! before the server acts on them and read back after a restart.

use std::path::Path;

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use crate::record::SandboxRecord;

const SANDBOXES: TableDefinition<&str, &[u8]> = TableDefinition::new("sandboxes");

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
    /// Opens (or creates) the store at `path`.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let db = dbr(Database::create(path))?;
        let txn = dbr(db.begin_write())?;
        dbr(txn.open_table(SANDBOXES))?;
        dbr(txn.commit())?;
        Ok(Self { db })
    }

    /// Writes `record` durably (replacing an earlier version).
    pub fn put(&self, record: &SandboxRecord) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(record).expect("records serialize");
        let txn = dbr(self.db.begin_write())?;
        {
            let mut table = dbr(txn.open_table(SANDBOXES))?;
            dbr(table.insert(record.id.as_str(), bytes.as_slice()))?;
        }
        dbr(txn.commit())
    }

    pub fn remove(&self, id: &str) -> Result<(), StoreError> {
        let txn = dbr(self.db.begin_write())?;
        {
            let mut table = dbr(txn.open_table(SANDBOXES))?;
            dbr(table.remove(id))?;
        }
        dbr(txn.commit())
    }

    /// Every record.
    pub fn load(&self) -> Result<Vec<SandboxRecord>, StoreError> {
        let txn = dbr(self.db.begin_read())?;
        let table = dbr(txn.open_table(SANDBOXES))?;
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
