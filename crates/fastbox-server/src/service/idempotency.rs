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
        let digest = sha256_hex(body);
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
