//! Creates with an `Idempotency-Key`: a client that retries a create (its answer was lost,
//! its server died) with the same key gets the sandbox the first attempt made, never a
//! second one, whichever server it reaches.
//!
//! The key is recorded (by a digest of it, with a digest of the request) before the
//! sandbox's own record, with the id the sandbox will have; the record is a create-only
//! write, so of two attempts racing on two servers one records it and the other waits for
//! that sandbox. The sandbox's record is created only while the key is there, unchanged
//! ([`fastbox_state::Guard`]).
//!
//! A create that fails gives the key back (a retry runs it again), but only while the store
//! holds no record of its sandbox (one write, conditional on that): a failure may be this
//! server's alone (the store took the write and its answer was lost; the server was
//! stopped long enough for another to take the create over, which finishes it). Once the
//! key is given back, a write of the record still on its way can no longer land: its guard
//! is gone. Keys are kept
//! [`IDEMPOTENCY_TTL`], then collected by the leader's reconciler.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use fastbox_api::lifecycle::{CreateSandboxRequest, Sandbox};
use sha2::{Digest, Sha256};

use crate::error::ApiError;
use crate::record::IdempotentCreate;
use crate::store::Store;

use super::lifecycle::Lifecycle;

/// How long a key is kept.
pub const IDEMPOTENCY_TTL: Duration = Duration::from_secs(24 * 3600);
/// How often the leader collects keys older than that.
const COLLECT_EVERY: Duration = Duration::from_secs(600);
/// How long a retry waits for the sandbox of a create still starting elsewhere.
const WAIT_FOR_FIRST: Duration = Duration::from_secs(10);

/// The sandbox an Idempotency-Key was recorded for, and the guard of its record's creation
/// (the key, at the revision recorded).
pub(super) struct KeyedCreate {
    pub id: String,
    pub guard: fastbox_state::Guard,
}

/// The longest key a client may send.
pub const MAX_KEY_LEN: usize = 255;

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// The digest that tells a retry from another request: of the request's JSON without the
/// credentials it carries (a registry password, object-storage keys), so no digest of a
/// secret is ever recorded; a retry that differs only in them counts as the same request.
fn request_digest(body: &[u8]) -> String {
    let Ok(mut value) = serde_json::from_slice::<serde_json::Value>(body) else {
        return sha256_hex(body);
    };
    if let Some(auth) = value
        .pointer_mut("/image/auth")
        .and_then(|a| a.as_object_mut())
    {
        auth.remove("password");
    }
    if let Some(volumes) = value.get_mut("volumes").and_then(|v| v.as_array_mut()) {
        for volume in volumes {
            if let Some(ossfs) = volume.get_mut("ossfs").and_then(|o| o.as_object_mut()) {
                ossfs.remove("accessKeyId");
                ossfs.remove("accessKeySecret");
            }
        }
    }
    sha256_hex(&serde_json::to_vec(&value).unwrap_or_default())
}

impl Lifecycle {
    /// `POST /v1/sandboxes` with `Idempotency-Key: key`; `body` is the request as sent (its
    /// digest tells a retry from a different request). Returns the sandbox, and whether it
    /// was made by an earlier attempt.
    pub async fn create_once(
        self: &Arc<Self>,
        req: CreateSandboxRequest,
        key: &str,
        body: &[u8],
    ) -> Result<(Sandbox, bool), ApiError> {
        if key.is_empty()
            || key.len() > MAX_KEY_LEN
            || !key.bytes().all(|b| b.is_ascii_graphic() || b == b' ')
        {
            return Err(ApiError::InvalidParameter(format!(
                "Idempotency-Key: 1 to {MAX_KEY_LEN} printable ASCII characters"
            )));
        }
        let slot = sha256_hex(key.as_bytes());
        let digest = request_digest(body);
        let deadline = Instant::now() + WAIT_FOR_FIRST;
        let keyed = loop {
            if let Some(first) = self.store.idempotent_create(&slot)? {
                if first.request_sha256 != digest {
                    return Err(ApiError::Conflict(
                        "this Idempotency-Key was used with another request".into(),
                    ));
                }
                // Made by an earlier attempt (here or on another server, maybe still
                // starting: its record follows the key's).
                if let Some(sandbox) = self.await_sandbox(&first.sandbox_id, deadline).await {
                    return Ok((sandbox, true));
                }
                return Err(ApiError::Conflict(format!(
                    "the create of this Idempotency-Key (sandbox {}) has not recorded its \
                     sandbox; retry later, or use another key",
                    first.sandbox_id
                )));
            }
            let id = uuid::Uuid::new_v4().to_string();
            let create = IdempotentCreate {
                sandbox_id: id.clone(),
                request_sha256: digest.clone(),
                created_at: Utc::now(),
            };
            match self.store.record_idempotent_create(&slot, &create) {
                Ok(revision) => {
                    break KeyedCreate {
                        id,
                        guard: Store::idempotency_guard(&slot, revision),
                    };
                }
                // Another attempt recorded it first: its sandbox is the answer.
                Err(e) if e.is_conflict() => continue,
                Err(e) => return Err(e.into()),
            }
        };
        match self.create_as(req, Some(&keyed)).await {
            Ok(sandbox) => Ok((sandbox, false)),
            Err(e) => {
                self.give_back_key(&keyed);
                Err(e)
            }
        }
    }

    /// Gives the key of a failed create back, unless the store holds its sandbox's record
    /// (the failure was this server's alone: a retry gets that sandbox). The removal is
    /// itself conditional on the record's absence, so a record landing meanwhile keeps it.
    fn give_back_key(&self, keyed: &KeyedCreate) {
        let guard = &keyed.guard;
        match self
            .store
            .give_back_idempotent_create(&guard.key, guard.revision, &keyed.id)
        {
            Ok(()) => {}
            Err(e) if e.is_conflict() => {
                tracing::warn!(sandbox = %keyed.id, "a create failed here but its sandbox is recorded: its Idempotency-Key stays with it");
            }
            Err(e) => {
                tracing::warn!(sandbox = %keyed.id, error = %e, "a failed create's Idempotency-Key is kept: the store did not take its removal");
            }
        }
    }

    /// Sandbox `id` once this server knows it, until `deadline`.
    async fn await_sandbox(&self, id: &str, deadline: Instant) -> Option<Sandbox> {
        loop {
            if let Ok(sandbox) = self.get(id) {
                return Some(sandbox);
            }
            // Not followed yet: ask the store itself.
            if let Ok(Some(record)) = self.store.reload(id) {
                return Some(record.to_wire());
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Forgets the keys older than [`IDEMPOTENCY_TTL`] (at most every ten minutes).
    pub(super) fn collect_idempotency_keys(&self) {
        {
            let mut last = self.idempotency_collected.lock().expect("collected lock");
            if last.is_some_and(|at| at.elapsed() < COLLECT_EVERY) {
                return;
            }
            *last = Some(Instant::now());
        }
        let Ok(creates) = self.store.idempotent_creates() else {
            return;
        };
        let ttl = chrono::Duration::from_std(IDEMPOTENCY_TTL).expect("24 h");
        for (slot, create) in creates {
            if create.created_at + ttl <= Utc::now()
                && let Err(e) = self.store.remove_idempotent_create(&slot)
            {
                tracing::warn!(error = %e, "an old Idempotency-Key was not collected");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_digest_holds_no_credential() {
        let body = |password: &str, secret: &str| {
            serde_json::json!({
                "image": {"uri": "r/i", "auth": {"username": "u", "password": password}},
                "volumes": [{"name": "d", "mountPath": "/d",
                             "ossfs": {"bucket": "b", "endpoint": "e", "accessKeyId": "k",
                                       "accessKeySecret": secret}}],
            })
            .to_string()
        };
        let a = request_digest(body("p1", "s1").as_bytes());
        assert_eq!(
            a,
            request_digest(body("p2", "s2").as_bytes()),
            "credentials left out"
        );
        let other = body("p1", "s1").replace("\"r/i\"", "\"r/other\"");
        assert_ne!(a, request_digest(other.as_bytes()), "the rest counts");
        // Not JSON: the bytes as they are.
        assert_eq!(request_digest(b"junk"), sha256_hex(b"junk"));
    }
}
