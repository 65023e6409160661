//! The etcd store, for several servers sharing one state.
//!
//! Record `key` of `table` is the etcd key `PREFIX/table/key`; its revision is etcd's
//! `mod_revision`. A put is one transaction: compare the key's `mod_revision` (or, for a
//! create, that the key does not exist), then write. A call that had to be retried after a
//! failure that may have applied it and then meets a conflict reads the key back: finding
//! its own value (or, for a delete, nothing) means the first attempt landed.

mod batch;
mod client;
mod coordinate;
mod proto;
mod watch;

use std::sync::Arc;

use serde_json::{Value, json};

pub use batch::WriteCounts;
use batch::{Batcher, Write};
use client::{EtcdClient, Method, b64, int, unb64};
pub use client::{EtcdOptions, off_worker};

use crate::url::EtcdTarget;
use crate::{
    CLUSTER_TABLE, Coordinator, Entry, Fence, Guard, Revision, StateBackend, StateError, Watch,
};

pub struct EtcdBackend {
    client: Arc<EtcdClient>,
    batcher: Batcher,
}

impl EtcdBackend {
    /// Connects to `target` and checks that it answers (a range read of the prefix).
    pub fn connect(target: EtcdTarget, options: EtcdOptions) -> Result<Self, StateError> {
        let backend = Self {
            client: Arc::new(EtcdClient::new(target, &options)?),
            batcher: Batcher::default(),
        };
        backend.client.call(
            Method::Range,
            &json!({"key": b64(backend.client.target().prefix.as_bytes()), "count_only": true}),
        )?;
        Ok(backend)
    }

    /// How many writes this backend sent, in how many transactions (concurrent writes go
    /// together).
    pub fn write_counts(&self) -> WriteCounts {
        self.batcher.counts()
    }

    /// Writes a snapshot of the whole etcd keyspace (every prefix, as `etcdctl snapshot
    /// save` does) to `out`; returns its size. `etcdctl snapshot restore` makes a member's
    /// data directory of it.
    pub fn snapshot(&self, out: &mut dyn std::io::Write) -> Result<u64, StateError> {
        let mut written = 0u64;
        let mut last_remaining = None;
        self.client
            .stream(Method::Snapshot, &json!({}), None, |message| {
                let blob = unb64(message.get("blob").unwrap_or(&Value::Null))?;
                out.write_all(&blob)
                    .map_err(|e| StateError::Failed(format!("writing the snapshot: {e}")))?;
                written += blob.len() as u64;
                last_remaining = Some(int(message.get("remaining_bytes")));
                Ok(())
            })?;
        match last_remaining {
            Some(0) if written > 0 => Ok(written),
            _ => Err(StateError::Unavailable(format!(
                "etcd {}: the snapshot stream ended early ({written} bytes)",
                self.client.target()
            ))),
        }
    }

    fn key(&self, table: &str, key: &str) -> String {
        format!("{}/{table}/{key}", self.client.target().prefix)
    }

    /// The etcd key of coordination claim `name`.
    fn claim_key(&self, name: &str) -> String {
        self.key(CLUSTER_TABLE, name)
    }

    /// The prefix of `table`'s keys.
    fn table_prefix(&self, table: &str) -> String {
        format!("{}/{table}/", self.client.target().prefix)
    }

    /// A compare-and-swap: `request` runs if `key` is at `expected` (and the `fence` and the
    /// `guard` hold).
    #[allow(clippy::too_many_arguments)]
    fn swap(
        &self,
        table: &str,
        key: &str,
        expected: Revision,
        fence: Option<&Fence>,
        guard: Option<&Guard>,
        request: Value,
        landed: impl Fn(Option<&Entry>) -> bool,
    ) -> Result<Revision, StateError> {
        let full = b64(self.key(table, key).as_bytes());
        let mut compare = vec![if expected == 0 {
            json!({"key": full, "target": "CREATE", "create_revision": "0", "result": "EQUAL"})
        } else {
            json!({"key": full, "target": "MOD", "mod_revision": expected.to_string(), "result": "EQUAL"})
        }];
        let mut failure = Vec::new();
        let mut reads = Vec::new();
        if let Some(fence) = fence {
            let fence_key = b64(self.claim_key(&fence.name).as_bytes());
            compare.push(json!({
                "key": fence_key, "target": "CREATE",
                "create_revision": fence.token.to_string(), "result": "EQUAL"
            }));
            // What the fence key is now, to tell a lost leadership from a conflict.
            failure.push(json!({"request_range": {"key": fence_key}}));
        }
        if let Some(guard) = guard {
            let guard_key = b64(self.key(&guard.table, &guard.key).as_bytes());
            compare.push(match guard.revision {
                0 => json!({
                    "key": guard_key, "target": "CREATE", "create_revision": "0", "result": "EQUAL"
                }),
                revision => json!({
                    "key": guard_key, "target": "MOD",
                    "mod_revision": revision.to_string(), "result": "EQUAL"
                }),
            });
            failure.push(json!({"request_range": {"key": guard_key}}));
            reads.push(guard_key);
        }
        let bytes = request
            .pointer("/request_put/value")
            .and_then(Value::as_str)
            .map_or(0, str::len);
        let answer = self.batcher.commit(
            &self.client,
            Write {
                key: full,
                reads,
                bytes,
                txn: json!({"compare": compare, "success": [request], "failure": failure}),
            },
        )?;
        if answer.body.get("succeeded").and_then(Value::as_bool) == Some(true) {
            return Ok(int(answer.body.pointer("/header/revision")));
        }
        if let Some(fence) = fence {
            let created = answer
                .body
                .pointer("/responses/0/response_range/kvs/0/create_revision");
            if int(created) != fence.token {
                return Err(StateError::Fenced {
                    table: table.to_string(),
                    key: key.to_string(),
                });
            }
        }
        if answer.retried {
            let current = self.get(table, key)?;
            if landed(current.as_ref()) {
                return Ok(current.map_or(0, |e| e.revision));
            }
        }
        if let Some(guard) = guard {
            let at = usize::from(fence.is_some());
            let kv = answer
                .body
                .pointer(&format!("/responses/{at}/response_range/kvs/0"));
            let revision = kv.map_or(0, |kv| int(kv.get("mod_revision")));
            if revision != guard.revision {
                return Err(StateError::Conflict {
                    table: guard.table.clone(),
                    key: guard.key.clone(),
                    expected: guard.revision,
                });
            }
        }
        Err(StateError::Conflict {
            table: table.to_string(),
            key: key.to_string(),
            expected,
        })
    }

    fn entries(&self, body: &Value, strip: &str) -> Result<Vec<Entry>, StateError> {
        let mut out = Vec::new();
        for kv in body
            .get("kvs")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let key = String::from_utf8(unb64(&kv["key"])?)
                .map_err(|_| StateError::Failed("etcd sent a key that is not UTF-8".into()))?;
            let Some(key) = key.strip_prefix(strip) else {
                continue;
            };
            out.push(Entry {
                key: key.to_string(),
                value: unb64(&kv["value"])?,
                revision: int(kv.get("mod_revision")),
            });
        }
        Ok(out)
    }
}

impl StateBackend for EtcdBackend {
    fn list(&self, table: &str) -> Result<Vec<Entry>, StateError> {
        let prefix = self.table_prefix(table);
        let mut end = prefix.clone().into_bytes();
        *end.last_mut().expect("prefix ends in /") += 1;
        let answer = self.client.call(
            Method::Range,
            &json!({"key": b64(prefix.as_bytes()), "range_end": b64(&end)}),
        )?;
        self.entries(&answer.body, &prefix)
    }

    fn get(&self, table: &str, key: &str) -> Result<Option<Entry>, StateError> {
        let full = self.key(table, key);
        let answer = self
            .client
            .call(Method::Range, &json!({"key": b64(full.as_bytes())}))?;
        let prefix = self.table_prefix(table);
        Ok(self.entries(&answer.body, &prefix)?.pop())
    }

    fn put(
        &self,
        table: &str,
        key: &str,
        value: &[u8],
        expected: Revision,
        fence: Option<&Fence>,
    ) -> Result<Revision, StateError> {
        let full = b64(self.key(table, key).as_bytes());
        let request = json!({"request_put": {"key": full, "value": b64(value)}});
        self.swap(table, key, expected, fence, None, request, |current| {
            current.is_some_and(|e| e.value == value)
        })
    }

    fn create_under(
        &self,
        table: &str,
        key: &str,
        value: &[u8],
        guard: &Guard,
    ) -> Result<Revision, StateError> {
        let full = b64(self.key(table, key).as_bytes());
        let request = json!({"request_put": {"key": full, "value": b64(value)}});
        self.swap(table, key, 0, None, Some(guard), request, |current| {
            current.is_some_and(|e| e.value == value)
        })
    }

    fn delete(
        &self,
        table: &str,
        key: &str,
        expected: Revision,
        fence: Option<&Fence>,
    ) -> Result<(), StateError> {
        if expected == 0 {
            // Absent is what the caller saw: nothing to remove, unless it appeared since.
            return match self.get(table, key)? {
                None => Ok(()),
                Some(_) => Err(StateError::Conflict {
                    table: table.to_string(),
                    key: key.to_string(),
                    expected,
                }),
            };
        }
        let full = b64(self.key(table, key).as_bytes());
        let request = json!({"request_delete_range": {"key": full}});
        self.swap(table, key, expected, fence, None, request, |current| {
            current.is_none()
        })
        .map(drop)
    }

    fn delete_under(
        &self,
        table: &str,
        key: &str,
        expected: Revision,
        guard: &Guard,
    ) -> Result<(), StateError> {
        let full = b64(self.key(table, key).as_bytes());
        let request = json!({"request_delete_range": {"key": full}});
        self.swap(
            table,
            key,
            expected,
            None,
            Some(guard),
            request,
            |current| current.is_none(),
        )
        .map(drop)
    }

    fn describe(&self) -> String {
        format!("etcd {}", self.client.target())
    }

    fn watch(&self, from: Revision) -> Result<Option<Watch>, StateError> {
        watch::start(self.client.clone(), from).map(Some)
    }

    fn coordinator(&self) -> Option<&dyn Coordinator> {
        Some(self)
    }
}
