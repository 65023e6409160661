//! Leases and claims in etcd (see [`crate::Coordinator`]).

use std::time::Duration;

use serde_json::{Value, json};

use super::EtcdBackend;
use super::client::{Method, b64, int, unb64};
use crate::{CLUSTER_TABLE, Coordinator, Entry, Holder, LeaseId, Revision, StateError};

/// An id of etcd's JSON form (a string of an int64).
fn lease_id(value: Option<&Value>) -> LeaseId {
    match value {
        Some(Value::String(s)) => s.parse().unwrap_or(0),
        Some(Value::Number(n)) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

impl Coordinator for EtcdBackend {
    fn grant(&self, ttl: Duration) -> Result<LeaseId, StateError> {
        let answer = self.client.call(
            Method::LeaseGrant,
            &json!({"TTL": ttl.as_secs().max(1).to_string()}),
        )?;
        match lease_id(answer.body.get("ID")) {
            0 => Err(StateError::Failed(format!(
                "etcd granted no lease: {}",
                answer.body
            ))),
            id => Ok(id),
        }
    }

    fn keep_alive(&self, lease: LeaseId) -> Result<bool, StateError> {
        let answer = self
            .client
            .call(Method::LeaseKeepAlive, &json!({"ID": lease.to_string()}))?;
        Ok(int(answer.body.get("TTL")) > 0)
    }

    fn revoke(&self, lease: LeaseId) -> Result<(), StateError> {
        match self
            .client
            .call(Method::LeaseRevoke, &json!({"ID": lease.to_string()}))
        {
            Ok(_) => Ok(()),
            Err(StateError::Failed(message)) if message.contains("not found") => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn claim(&self, name: &str, value: &[u8], lease: LeaseId) -> Result<Holder, StateError> {
        let key = b64(self.claim_key(name).as_bytes());
        let answer = self.client.call(
            Method::Txn,
            &json!({
                "compare": [{"key": key, "target": "CREATE", "create_revision": "0", "result": "EQUAL"}],
                "success": [{"request_put": {"key": key, "value": b64(value), "lease": lease.to_string()}}],
                "failure": [{"request_range": {"key": key}}],
            }),
        )?;
        if answer.body.get("succeeded").and_then(Value::as_bool) == Some(true) {
            return Ok(Holder {
                value: value.to_vec(),
                created: int(answer.body.pointer("/header/revision")),
                lease,
            });
        }
        let kv = answer
            .body
            .pointer("/responses/0/response_range/kvs/0")
            .ok_or_else(|| {
                // Gone between the compare and the read (its lease ran out): none holds it.
                StateError::Unavailable(format!("the claim {name} changed while it was read"))
            })?;
        Ok(Holder {
            value: unb64(&kv["value"])?,
            created: int(kv.get("create_revision")),
            lease: lease_id(kv.get("lease")),
        })
    }

    fn claims(&self, prefix: &str) -> Result<Vec<Entry>, StateError> {
        let start = self.claim_key(prefix);
        let mut end = start.clone().into_bytes();
        match end.last_mut() {
            Some(last) => *last += 1,
            None => end.push(0),
        }
        let answer = self.client.call(
            Method::Range,
            &json!({"key": b64(start.as_bytes()), "range_end": b64(&end)}),
        )?;
        let strip = format!("{}/{CLUSTER_TABLE}/", self.client.target().prefix);
        let mut out = Vec::new();
        for kv in answer
            .body
            .get("kvs")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let full = String::from_utf8(unb64(&kv["key"])?).unwrap_or_default();
            if let Some(name) = full.strip_prefix(&strip) {
                out.push(Entry {
                    key: name.to_string(),
                    value: unb64(&kv["value"])?,
                    revision: int(kv.get("create_revision")),
                });
            }
        }
        Ok(out)
    }

    fn compact(&self, revision: Revision) -> Result<(), StateError> {
        match self
            .client
            .call(Method::Compact, &json!({"revision": revision.to_string()}))
        {
            Ok(_) => Ok(()),
            // Compacted as far already (by another server, or etcd's own auto-compaction).
            Err(StateError::Failed(message)) if message.contains("compacted") => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn revision(&self) -> Result<Revision, StateError> {
        let answer = self.client.call(
            Method::Range,
            &json!({"key": b64(self.client.target().prefix.as_bytes()), "count_only": true}),
        )?;
        Ok(int(answer.body.pointer("/header/revision")))
    }
}
