//! The embedded store: one redb file, for one machine.
//!
//! Each table holds `key -> value`; a `revisions` table holds each record's revision
//! (`table NUL key -> u64`) and `meta` the last revision given out. A record written before
//! revisions existed has none stored and reads as revision 1 (the counter starts above it).
//! Every put and delete checks and bumps the revision in one write transaction. The file's
//! lock keeps every other process out, so there is no other writer to watch for and never
//! a second leader: fences are not needed here and are ignored.

use std::path::Path;
use std::time::{Duration, Instant};

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition, TableError};

use crate::{Entry, Fence, Guard, Revision, StateBackend, StateError};

const REVISIONS: TableDefinition<&str, u64> = TableDefinition::new("revisions");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const COUNTER: &str = "revision";
/// The revision of a record stored without one.
const LEGACY_REVISION: Revision = 1;

/// How long opening the store waits for a lock held by what a crashed run left.
pub const LOCK_WAIT: Duration = Duration::from_secs(10);

fn table(name: &str) -> TableDefinition<'_, &'static str, &'static [u8]> {
    TableDefinition::new(name)
}

fn revision_key(table: &str, key: &str) -> String {
    format!("{table}\0{key}")
}

/// redb has an error type per operation; they all convert into `redb::Error`.
fn dbr<T, E: Into<redb::Error>>(r: Result<T, E>) -> Result<T, StateError> {
    r.map_err(|e| StateError::Failed(e.into().to_string()))
}

pub struct RedbBackend {
    db: Database,
    path: std::path::PathBuf,
}

impl RedbBackend {
    /// Opens (or creates) the file at `path`. After a crash, a child process of the previous
    /// run caught between its fork and its exec may share the file's lock for a moment: the
    /// open waits up to [`LOCK_WAIT`] for it.
    pub fn open(path: &Path) -> Result<Self, StateError> {
        let deadline = Instant::now() + LOCK_WAIT;
        let db = loop {
            match Database::create(path) {
                Err(redb::DatabaseError::DatabaseAlreadyOpen) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                other => {
                    break other.map_err(|e| {
                        StateError::Failed(format!("{}: {}", path.display(), redb::Error::from(e)))
                    })?;
                }
            }
        };
        let txn = dbr(db.begin_write())?;
        dbr(txn.open_table(REVISIONS))?;
        {
            let mut meta = dbr(txn.open_table(META))?;
            if dbr(meta.get(COUNTER))?.is_none() {
                dbr(meta.insert(COUNTER, LEGACY_REVISION))?;
            }
        }
        dbr(txn.commit())?;
        Ok(Self {
            db,
            path: path.to_path_buf(),
        })
    }

    /// Checks record `key` is at `expected` (and the `guard`'s record at its revision), then
    /// applies `write` (None: remove) with a new revision, all in one transaction.
    fn swap(
        &self,
        name: &str,
        key: &str,
        expected: Revision,
        write: Option<&[u8]>,
        guard: Option<&Guard>,
    ) -> Result<Revision, StateError> {
        let txn = dbr(self.db.begin_write())?;
        if let Some(guard) = guard {
            let revision = {
                let records = dbr(txn.open_table(table(&guard.table)))?;
                let revisions = dbr(txn.open_table(REVISIONS))?;
                match dbr(records.get(guard.key.as_str()))?.is_some() {
                    false => 0,
                    true => dbr(revisions.get(revision_key(&guard.table, &guard.key).as_str()))?
                        .map_or(LEGACY_REVISION, |v| v.value()),
                }
            };
            if revision != guard.revision {
                return Err(StateError::Conflict {
                    table: guard.table.clone(),
                    key: guard.key.clone(),
                    expected: guard.revision,
                });
            }
        }
        let next = {
            let mut records = dbr(txn.open_table(table(name)))?;
            let mut revisions = dbr(txn.open_table(REVISIONS))?;
            let mut meta = dbr(txn.open_table(META))?;
            let rkey = revision_key(name, key);
            let exists = dbr(records.get(key))?.is_some();
            let current = match exists {
                false => 0,
                true => dbr(revisions.get(rkey.as_str()))?.map_or(LEGACY_REVISION, |v| v.value()),
            };
            if current != expected {
                return Err(StateError::Conflict {
                    table: name.to_string(),
                    key: key.to_string(),
                    expected,
                });
            }
            let next = dbr(meta.get(COUNTER))?.map_or(LEGACY_REVISION, |v| v.value()) + 1;
            dbr(meta.insert(COUNTER, next))?;
            match write {
                Some(value) => {
                    dbr(records.insert(key, value))?;
                    dbr(revisions.insert(rkey.as_str(), next))?;
                }
                None => {
                    dbr(records.remove(key))?;
                    dbr(revisions.remove(rkey.as_str()))?;
                }
            }
            next
        };
        dbr(txn.commit())?;
        Ok(next)
    }
}

impl StateBackend for RedbBackend {
    fn list(&self, name: &str) -> Result<Vec<Entry>, StateError> {
        let txn = dbr(self.db.begin_read())?;
        let records = match txn.open_table(table(name)) {
            Ok(t) => t,
            Err(TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
            Err(e) => return dbr(Err(e)),
        };
        let revisions = dbr(txn.open_table(REVISIONS))?;
        let mut out = Vec::new();
        for item in dbr(records.iter())? {
            let (key, value) = dbr(item)?;
            let key = key.value().to_string();
            let revision = dbr(revisions.get(revision_key(name, &key).as_str()))?
                .map_or(LEGACY_REVISION, |v| v.value());
            out.push(Entry {
                key,
                value: value.value().to_vec(),
                revision,
            });
        }
        Ok(out)
    }

    fn get(&self, name: &str, key: &str) -> Result<Option<Entry>, StateError> {
        let txn = dbr(self.db.begin_read())?;
        let records = match txn.open_table(table(name)) {
            Ok(t) => t,
            Err(TableError::TableDoesNotExist(_)) => return Ok(None),
            Err(e) => return dbr(Err(e)),
        };
        let Some(value) = dbr(records.get(key))? else {
            return Ok(None);
        };
        let revisions = dbr(txn.open_table(REVISIONS))?;
        let revision = dbr(revisions.get(revision_key(name, key).as_str()))?
            .map_or(LEGACY_REVISION, |v| v.value());
        Ok(Some(Entry {
            key: key.to_string(),
            value: value.value().to_vec(),
            revision,
        }))
    }

    fn put(
        &self,
        name: &str,
        key: &str,
        value: &[u8],
        expected: Revision,
        _fence: Option<&Fence>,
    ) -> Result<Revision, StateError> {
        self.swap(name, key, expected, Some(value), None)
    }

    fn create_under(
        &self,
        name: &str,
        key: &str,
        value: &[u8],
        guard: &Guard,
    ) -> Result<Revision, StateError> {
        self.swap(name, key, 0, Some(value), Some(guard))
    }

    fn delete(
        &self,
        name: &str,
        key: &str,
        expected: Revision,
        _fence: Option<&Fence>,
    ) -> Result<(), StateError> {
        if expected == 0 && self.get(name, key)?.is_none() {
            return Ok(());
        }
        self.swap(name, key, expected, None, None).map(drop)
    }

    fn delete_under(
        &self,
        name: &str,
        key: &str,
        expected: Revision,
        guard: &Guard,
    ) -> Result<(), StateError> {
        self.swap(name, key, expected, None, Some(guard)).map(drop)
    }

    fn describe(&self) -> String {
        format!("redb file {}", self.path.display())
    }
}
