//! The state-store seam: where the server keeps its records (sandboxes, templates,
//! snapshots, nodes).
//!
//! Two backends answer the same [`StateBackend`] trait:
//! - [`RedbBackend`], the embedded default: one redb file in the data directory, for one
//!   machine, no service to run.
//! - [`EtcdBackend`], for several servers sharing one state (`--state etcd://...`): etcd's
//!   gRPC API, with failover across the members, user/password auth and TLS with a CA of
//!   the operator's choice.
//!
//! Over etcd, values are sealed ([`SealedBackend`]): encrypted under a key only the servers
//! hold, so etcd's operators and backups never see the tokens and credentials in them.
//!
//! Records are opaque bytes in named tables. Every record carries a [`Revision`] and every
//! write names the revision it replaces: [`StateBackend::put`] and [`StateBackend::delete`]
//! are compare-and-swaps, so no writer ever overwrites a change it has not seen
//! ([`StateError::Conflict`] tells it to read again). Revision 0 means "absent": a put
//! expecting 0 creates, and fails if the record exists.
//!
//! ```
//! use fastbox_state::{RedbBackend, StateBackend, StateError};
//! let dir = tempfile::tempdir().unwrap();
//! let store = RedbBackend::open(&dir.path().join("state.redb")).unwrap();
//! let first = store.put("sandboxes", "a", b"{}", 0, None).unwrap();
//! // A second create of the same record, or a write from a stale revision, is refused.
//! assert!(matches!(
//!     store.put("sandboxes", "a", b"{}", 0, None),
//!     Err(StateError::Conflict { .. })
//! ));
//! let second = store.put("sandboxes", "a", br#"{"n":1}"#, first, None).unwrap();
//! assert!(second > first);
//! store.delete("sandboxes", "a", second, None).unwrap();
//! assert!(store.get("sandboxes", "a").unwrap().is_none());
//! ```

mod cluster;
mod delegate;
mod etcd;
mod redb_backend;
mod sealed;
mod url;
mod watch;

pub use cluster::{CLUSTER_TABLE, Coordinator, Fence, Holder, LeaseId};
pub use delegate::Delegate;
pub use etcd::{EtcdBackend, EtcdOptions, WriteCounts, off_worker};
pub use redb_backend::RedbBackend;
pub use sealed::{SealKey, SealedBackend};
pub use url::{DEFAULT_PREFIX, EtcdTarget, StateUrl, StateUrlError};
pub use watch::{Watch, WatchEvent};

/// A record's version: 0 is "absent"; every write gives the record a larger one.
pub type Revision = u64;

/// A condition on another record: a write made under it lands only while record `key` of
/// `table` is at `revision` (an idempotency key still naming the create that writes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Guard {
    pub table: String,
    pub key: String,
    pub revision: Revision,
}

/// One stored record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub key: String,
    pub value: Vec<u8>,
    pub revision: Revision,
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum StateError {
    /// The record is not at the revision the writer expected: someone else changed it (or it
    /// exists, for a create; or it is gone).
    #[error("state store: {table}/{key} changed since it was read (expected revision {expected})")]
    Conflict {
        table: String,
        key: String,
        expected: Revision,
    },
    /// The store could not be reached, or did not answer in time: nothing is known to be
    /// written.
    #[error("state store unavailable: {0}")]
    Unavailable(String),
    /// The store is out of space (etcd's quota): it reads, but takes no write until its
    /// operator makes room.
    #[error(
        "state store full: {0}; compact and defragment etcd (etcdctl defrag), then disarm its alarm (etcdctl alarm disarm)"
    )]
    Full(String),
    /// A write made as the leader after the leadership passed on (its fence is gone).
    #[error("state store: {table}/{key}: refused, this server is no longer the leader")]
    Fenced { table: String, key: String },
    /// The store answered with an error that a retry will not cure.
    #[error("state store: {0}")]
    Failed(String),
}

impl StateError {
    /// True when the store could not be reached (an API answers 503 for it).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::Unavailable(_))
    }
}

/// A store of records in named tables, every write a compare-and-swap.
pub trait StateBackend: Send + Sync {
    /// Every record of `table`.
    fn list(&self, table: &str) -> Result<Vec<Entry>, StateError>;

    /// Record `key` of `table`, if any.
    fn get(&self, table: &str, key: &str) -> Result<Option<Entry>, StateError>;

    /// Writes `value` as record `key` if its revision is `expected` (0: it must not exist),
    /// and, with a `fence`, only while the leadership it names holds. Returns the record's
    /// new revision.
    fn put(
        &self,
        table: &str,
        key: &str,
        value: &[u8],
        expected: Revision,
        fence: Option<&Fence>,
    ) -> Result<Revision, StateError>;

    /// Creates record `key` (it must not exist) only while the `guard` holds; a guard that
    /// does not is a [`StateError::Conflict`] naming the guard's record. A writer whose
    /// create did not answer can then give the guard up (change or remove its record) and
    /// know the create will never land after that.
    fn create_under(
        &self,
        table: &str,
        key: &str,
        value: &[u8],
        guard: &Guard,
    ) -> Result<Revision, StateError>;

    /// Removes record `key` if its revision is `expected` and the `guard` holds (a guard at
    /// revision 0: its record must be absent); a guard that does not is a
    /// [`StateError::Conflict`] naming the guard's record.
    fn delete_under(
        &self,
        table: &str,
        key: &str,
        expected: Revision,
        guard: &Guard,
    ) -> Result<(), StateError>;

    /// Removes record `key` if its revision is `expected` (and the `fence` holds).
    /// Removing an absent record with `expected` 0 is a no-op.
    fn delete(
        &self,
        table: &str,
        key: &str,
        expected: Revision,
        fence: Option<&Fence>,
    ) -> Result<(), StateError>;

    /// Where the records are, for logs and errors (never a credential).
    fn describe(&self) -> String;

    /// Every change from revision `from` on (None: the store has no other writer to watch
    /// for, as the embedded file, whose lock keeps other processes out).
    fn watch(&self, from: Revision) -> Result<Option<Watch>, StateError> {
        let _ = from;
        Ok(None)
    }

    /// Leases and claims, for servers sharing the store (None: one server alone).
    fn coordinator(&self) -> Option<&dyn Coordinator> {
        None
    }
}

/// Opens the store `url` names: a path (or `redb:PATH`) for the embedded file, or
/// `etcd://`/`etcds://` for etcd ([`StateUrl`]), its values sealed with `seal` when given.
pub fn open(
    url: &StateUrl,
    options: EtcdOptions,
    seal: Option<SealKey>,
) -> Result<Box<dyn StateBackend>, StateError> {
    let backend: Box<dyn StateBackend> = match (url, seal) {
        (StateUrl::Redb(path), None) => Box::new(RedbBackend::open(path)?),
        (StateUrl::Redb(path), Some(key)) => {
            Box::new(SealedBackend::new(RedbBackend::open(path)?, key))
        }
        (StateUrl::Etcd(target), None) => Box::new(EtcdBackend::connect(target.clone(), options)?),
        (StateUrl::Etcd(target), Some(key)) => Box::new(SealedBackend::new(
            EtcdBackend::connect(target.clone(), options)?,
            key,
        )),
    };
    Ok(backend)
}
