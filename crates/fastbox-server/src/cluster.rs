//! This server among the servers that share its state store.
//!
//! Alone (the embedded redb file, whose lock keeps other processes out) a server is always
//! the leader and every operation is its own. On etcd ([`fastbox_state::Coordinator`]) a
//! server holds a lease, renewed every third of its time to live, and with it claims its
//! presence (`servers/ID`) and, when free, the leadership of the reconcilers (`leader`).
//! The leader's writes carry the leadership's fencing token ([`Cluster::fence`]): once the
//! lease ran out (the server was paused, or cut off from etcd), they are refused.
//!
//! A server also steps down by itself when it could not renew its lease for two thirds of
//! its time to live, before etcd can end it and another server can lead: two reconcilers
//! never act at once, even before the fence would refuse the old one's writes.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use fastbox_state::{Fence, LeaseId, StateBackend, StateError};

/// The claim of the reconcilers' leadership.
pub const LEADER: &str = "leader";
/// Where servers claim their presence.
pub const SERVERS: &str = "servers/";
/// Where registered nodes' leases are claimed (the claim's value is its lease's id).
pub const NODES: &str = "nodes/";

/// The id a server alone goes by.
pub const ALONE: &str = "local";

pub struct Cluster {
    id: String,
    /// A value of this process only: a restarted server waits for its old claims to go.
    incarnation: String,
    backend: Option<Arc<dyn StateBackend>>,
    ttl: Duration,
    /// Held by a round for its whole run (calls to etcd included).
    state: Mutex<Held>,
    /// When the lease was last renewed (locked only for a moment: leadership checks read it).
    renewed: Mutex<Option<Instant>>,
    leader: RwLock<Option<Fence>>,
    alive: RwLock<HashSet<String>>,
    /// Set to end the rounds ([`Cluster::halt`]).
    halted: AtomicBool,
    /// No round before then ([`Cluster::suspend_for`]).
    suspended_until: Mutex<Option<Instant>>,
}

/// What this server holds in the store.
#[derive(Default)]
struct Held {
    lease: Option<LeaseId>,
    present: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error(transparent)]
    State(#[from] StateError),
    #[error("server id {id:?}: 1-64 of [A-Za-z0-9._-]")]
    BadId { id: String },
}

impl Cluster {
    /// A server alone: always the leader, no other server.
    pub fn alone() -> Self {
        Self {
            id: ALONE.to_string(),
            incarnation: String::new(),
            backend: None,
            ttl: Duration::ZERO,
            state: Mutex::new(Held::default()),
            renewed: Mutex::new(None),
            leader: RwLock::new(None),
            alive: RwLock::new(HashSet::from([ALONE.to_string()])),
            halted: AtomicBool::new(false),
            suspended_until: Mutex::new(None),
        }
    }

    /// Server `id` among those sharing `backend` (alone when it has no coordinator), with
    /// leases of `ttl`.
    pub fn join(
        id: &str,
        backend: Arc<dyn StateBackend>,
        ttl: Duration,
    ) -> Result<Self, ClusterError> {
        if backend.coordinator().is_none() {
            return Ok(Self::alone());
        }
        if id.is_empty()
            || id.len() > 64
            || !id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        {
            return Err(ClusterError::BadId { id: id.to_string() });
        }
        Ok(Self {
            id: id.to_string(),
            incarnation: format!("{id}#{:016x}", rand_u64()),
            backend: Some(backend),
            ttl,
            state: Mutex::new(Held::default()),
            renewed: Mutex::new(None),
            leader: RwLock::new(None),
            alive: RwLock::new(HashSet::new()),
            halted: AtomicBool::new(false),
            suspended_until: Mutex::new(None),
        })
    }

    /// This server's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Whether other servers may share the store.
    pub fn is_shared(&self) -> bool {
        self.backend.is_some()
    }

    /// Whether this server leads the reconcilers now.
    pub fn is_leader(&self) -> bool {
        !self.is_shared() || self.fence().is_some()
    }

    /// The fence of this server's leadership (None alone, or when it does not lead, or
    /// when its lease was not renewed for two thirds of its time to live: it may be about
    /// to run out while a round is still waiting for etcd).
    pub fn fence(&self) -> Option<Fence> {
        let fresh = self
            .renewed
            .lock()
            .expect("renewed lock")
            .is_some_and(|at| at.elapsed() < self.ttl * 2 / 3);
        fresh
            .then(|| self.leader.read().expect("leader lock").clone())
            .flatten()
    }

    /// Whether server `id` holds its presence (always true of this server).
    pub fn is_alive(&self, id: &str) -> bool {
        id == self.id || self.alive.read().expect("alive lock").contains(id)
    }

    /// Whether server `id` is gone, read from the store now: [`Cluster::is_alive`] is as of
    /// the last round, which may be before `id` started. Not gone when the store does not
    /// answer (nothing is taken from a server that may be alive).
    pub fn is_gone(&self, id: &str) -> bool {
        if self.is_alive(id) {
            return false;
        }
        let Some(c) = self.backend.as_ref().and_then(|b| b.coordinator()) else {
            // Alone: every other server is gone.
            return true;
        };
        match c.claims(SERVERS) {
            Ok(claims) => !claims
                .iter()
                .any(|e| e.key.strip_prefix(SERVERS) == Some(id)),
            Err(e) => {
                tracing::debug!(server = %id, error = %e, "whether a server is gone was not read");
                false
            }
        }
    }

    /// One round: renew (or take) the lease, claim the presence and, when free, the
    /// leadership; read who else is present. Returns whether this server leads.
    pub fn round(&self) -> Result<bool, ClusterError> {
        let Some(backend) = &self.backend else {
            return Ok(true);
        };
        let c = backend.coordinator().expect("checked in join");
        let result = (|| -> Result<bool, ClusterError> {
            let mut held = self.state.lock().expect("cluster lock");
            // The lease lives at most its time to live from before the call that renewed it.
            let asked = Instant::now();
            let renewed = match held.lease {
                Some(lease) => c.keep_alive(lease)?,
                None => false,
            };
            if !renewed {
                // First round, or the lease ran out: everything held with it is gone.
                self.step_down("its lease ran out");
                held.present = false;
                held.lease = Some(c.grant(self.ttl)?);
            }
            *self.renewed.lock().expect("renewed lock") = Some(asked);
            let lease = held.lease.expect("granted");
            if !held.present {
                let holder = c.claim(
                    &format!("{SERVERS}{}", self.id),
                    self.incarnation.as_bytes(),
                    lease,
                )?;
                // Another incarnation of this id (a restart) holds it until its lease
                // runs out: this one waits.
                held.present = holder.lease == lease;
            }
            let leads = if held.present {
                let holder = c.claim(LEADER, self.id.as_bytes(), lease)?;
                (holder.lease == lease).then_some(holder.created)
            } else {
                None
            };
            let alive = c
                .claims(SERVERS)?
                .into_iter()
                .filter_map(|e| e.key.strip_prefix(SERVERS).map(str::to_string))
                .collect();
            *self.alive.write().expect("alive lock") = alive;
            let mut leader = self.leader.write().expect("leader lock");
            let was = leader.is_some();
            *leader = leads.map(|token| Fence {
                name: LEADER.to_string(),
                token,
            });
            if leader.is_some() && !was {
                tracing::info!(server = %self.id, token = leads, "leads the reconcilers");
            }
            Ok(leader.is_some())
        })();
        if result.is_err() {
            self.step_down_if_stale();
        }
        result
    }

    /// Rounds forever, every third of the lease's time to live (on a thread of its own).
    pub fn run(self: &Arc<Self>) {
        if !self.is_shared() {
            return;
        }
        let this = self.clone();
        std::thread::Builder::new()
            .name("cluster".into())
            .spawn(move || {
                while !this.halted.load(Ordering::Relaxed) {
                    let suspended = *this.suspended_until.lock().expect("suspend lock");
                    if suspended.is_some_and(|until| Instant::now() < until) {
                        std::thread::sleep(this.ttl / 10);
                        continue;
                    }
                    if let Err(e) = this.round() {
                        tracing::warn!(server = %this.id, error = %e, "cluster round failed");
                    }
                    std::thread::sleep(this.ttl / 3);
                }
            })
            .expect("spawn the cluster thread");
    }

    /// No round for `d`: the lease is not renewed meanwhile, as when the process is stopped
    /// (`SIGSTOP`) or cut off from etcd; then the rounds go on.
    pub fn suspend_for(&self, d: Duration) {
        *self.suspended_until.lock().expect("suspend lock") = Some(Instant::now() + d);
    }

    /// Stops the rounds: the lease is no longer renewed and runs out (what a crash does).
    pub fn halt(&self) {
        self.halted.store(true, Ordering::Relaxed);
    }

    /// Ends this server's lease (a clean stop): its presence and leadership go at once.
    pub fn leave(&self) {
        let Some(backend) = &self.backend else {
            return;
        };
        self.halt();
        self.step_down("it stops");
        let lease = self.state.lock().expect("cluster lock").lease.take();
        if let (Some(c), Some(lease)) = (backend.coordinator(), lease) {
            let _ = c.revoke(lease);
        }
    }

    /// Renews the lease of registered node `id` in the store (made anew when it ran out):
    /// whichever server a node heartbeats to, every server sees it alive
    /// ([`Cluster::live_nodes`]). True when the lease had run out (a new one was made).
    /// Nothing to do alone.
    pub fn renew_node(&self, id: &str, ttl: Duration) -> Result<bool, StateError> {
        let Some(c) = self.backend.as_ref().and_then(|b| b.coordinator()) else {
            return Ok(false);
        };
        let name = format!("{NODES}{id}");
        if let Some(claim) = c.claims(&name)?.into_iter().find(|e| e.key == name)
            && let Some(lease) = std::str::from_utf8(&claim.value)
                .ok()
                .and_then(|v| v.parse::<LeaseId>().ok())
            && c.keep_alive(lease)?
        {
            return Ok(false);
        }
        // None, or its lease ran out (the claim goes with it): a new lease. Another server
        // renewing at the same moment may claim first; then its lease is renewed.
        let lease = c.grant(ttl)?;
        let holder = c.claim(&name, lease.to_string().as_bytes(), lease)?;
        if holder.lease != lease {
            let _ = c.revoke(lease);
            c.keep_alive(holder.lease)?;
        }
        Ok(true)
    }

    /// The registered nodes whose lease in the store is alive (None alone: the server's own
    /// leases count).
    pub fn live_nodes(&self) -> Result<Option<HashSet<String>>, StateError> {
        let Some(c) = self.backend.as_ref().and_then(|b| b.coordinator()) else {
            return Ok(None);
        };
        Ok(Some(
            c.claims(NODES)?
                .into_iter()
                .filter_map(|e| e.key.strip_prefix(NODES).map(str::to_string))
                .collect(),
        ))
    }

    /// Steps down when the lease was not renewed for two thirds of its time to live.
    fn step_down_if_stale(&self) {
        let renewed = *self.renewed.lock().expect("renewed lock");
        if renewed.is_none_or(|at| at.elapsed() > self.ttl * 2 / 3) {
            self.step_down("it could not renew its lease in time");
        }
    }

    fn step_down(&self, why: &str) {
        if self.leader.write().expect("leader lock").take().is_some() {
            tracing::warn!(server = %self.id, why, "no longer leads the reconcilers");
        }
    }
}

fn rand_u64() -> u64 {
    let mut bytes = [0u8; 8];
    getrandom::fill(&mut bytes).expect("randomness");
    u64::from_le_bytes(bytes)
}
