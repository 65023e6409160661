//! Registered nodes: a `fastbox node` joins with the cluster's join token and gets two
//! credentials of its own; it holds a lease by heartbeats; a node whose lease ran out longer
//! ago than the margin is lost, and its running sandboxes fail (`NODE_LOST`). The control
//! API's side of it ([`ControlPlane`]): who calls, and which sandboxes a node may ask about.
//!
//! Nothing is reassigned on a call that timed out: only the lease decides. A lost node froze
//! its sandboxes before its lease ran out (its guard), so a sandbox never runs on two nodes;
//! paused sandboxes keep their checkpoint and stay `Paused`.

use std::collections::HashSet;
use std::sync::Arc;

use async_trait::async_trait;
use chrono::Utc;
use fastbox_api::lifecycle::SandboxState;
use fastbox_node_api::membership::{
    Caller, ControlPlane, Heartbeat, MembershipError, Registered, Registration, Renewal,
    check_node_id, route_keys_digest,
};
use fastbox_node_api::remote::tls::CertPin;
use fastbox_node_api::remote::{Credential, CredentialDigest, NodeClient, Timeouts};

use crate::error::ApiError;
use crate::nodes::{NodeState, NodeView};
use crate::record::{NodeRecord, SandboxRecord};

use super::lifecycle::Lifecycle;

/// The reason recorded on sandboxes that ran on a lost (or revoked) node.
pub const NODE_LOST: &str = "NODE_LOST";

/// A registered (or revoked) node as the server holds it in memory.
pub(super) struct Member {
    record: NodeRecord,
    /// The digest of the credential it presents (`None`: revoked).
    node_to_server: Option<CredentialDigest>,
}

impl Member {
    fn of(record: NodeRecord) -> Self {
        let node_to_server = match record.revoked_at {
            Some(_) => None,
            None => CredentialDigest::from_hex(&record.node_to_server_sha256),
        };
        Self {
            record,
            node_to_server,
        }
    }
}

impl Lifecycle {
    /// Accepts registrations presenting `token` from now on (`None`: none).
    pub fn set_join_token(&self, token: Option<Credential>) {
        *self.join_token.write().expect("join token lock") = token;
    }

    /// The nodes registered before this start, each added with a fresh lease (to heartbeat
    /// again before it is lost), and the revoked names. How many nodes.
    pub fn load_registered_nodes(&self) -> Result<usize, ApiError> {
        let records = self.store.load_nodes()?;
        let mut loaded = 0;
        for record in records {
            match self.admit_member(record) {
                Ok(true) => loaded += 1,
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "a registered node could not be loaded"),
            }
        }
        Ok(loaded)
    }

    /// The client of the node `record` names (refused: a URL the client cannot use, an
    /// `https://` one without its certificate's pin).
    fn client_of(&self, record: &NodeRecord) -> Result<NodeClient, String> {
        let credential: Credential = record.server_to_node.parse().map_err(|e| format!("{e}"))?;
        let client = NodeClient::new(
            record.node_id.clone(),
            &record.url,
            credential,
            Timeouts::default(),
        )
        .map_err(|e| format!("url {:?}: {e}", record.url))?;
        // The URL as the client parsed it (its scheme in lower case).
        let client = match (&record.tls_pin, client.url().starts_with("https://")) {
            (Some(pin), true) => {
                let pin: CertPin = pin.parse().map_err(|e| format!("{e}"))?;
                client.with_pinned_cert(pin).map_err(|e| e.to_string())?
            }
            (None, true) => {
                return Err(format!(
                    "url {:?}: an https node API needs its certificate's pin (tls_pin)",
                    record.url
                ));
            }
            (Some(_), false) => {
                return Err(format!(
                    "url {:?}: a certificate pin goes with an https URL",
                    record.url
                ));
            }
            (None, false) => client,
        };
        Ok(client.with_image_config(self.images.clone()))
    }

    /// Keeps `record` (a node, or a revoked name) and, unless revoked, adds its client with a
    /// lease; whether it is a node.
    pub(super) fn admit_member(&self, record: NodeRecord) -> Result<bool, ApiError> {
        let node = record.revoked_at.is_none();
        if !node {
            // Revoked (here, or on another server sharing the store).
            self.nodes.remove(&record.node_id);
        }
        // The registration this server has already (its own write, coming back through the
        // store's watch, or a change of its loss count): the node did not register again.
        let admitted = self
            .members
            .lock()
            .expect("members lock")
            .get(&record.node_id)
            .is_some_and(|m| {
                m.record.revoked_at.is_none()
                    && m.record.node_to_server_sha256 == record.node_to_server_sha256
            })
            && self.nodes.get(Some(&record.node_id)).is_ok();
        if node && !admitted {
            let client = self
                .client_of(&record)
                .map_err(|e| ApiError::Internal(format!("node {}: {e}", record.node_id)))?;
            let until = std::time::Instant::now() + self.lease_duration();
            self.nodes
                .add_leased(Arc::new(client), record.proxy_public.clone(), until);
        }
        self.members
            .lock()
            .expect("members lock")
            .insert(record.node_id.clone(), Member::of(record));
        Ok(node)
    }

    fn lease_duration(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.cfg.leases.terms.lease_ms)
    }

    /// `GET /v1/nodes`: every node, with its lease and last report.
    pub fn list_nodes(&self) -> Vec<NodeView> {
        self.nodes.views()
    }

    /// `DELETE /v1/nodes/{id}`: revokes a registered node: its credentials stop working at
    /// once (it cannot renew, so its guard freezes its sandboxes), what ran there fails
    /// (`NODE_LOST`) and its name may not join again. Paused sandboxes stay paused (they
    /// resume on another node from their published checkpoint). Called again on a revoked
    /// name, forgets it: the name may join anew. The in-process node and configured ones
    /// cannot be revoked.
    pub fn revoke_node(&self, id: &str) -> Result<(), ApiError> {
        let _serial = self.membership_changes.lock().expect("membership lock");
        let record = self
            .members
            .lock()
            .expect("members lock")
            .get(id)
            .map(|m| m.record.clone());
        let Some(mut record) = record else {
            return Err(match self.nodes.get(Some(id)) {
                Ok(_) => ApiError::Conflict(format!(
                    "node {id} did not register: it is part of this server's configuration"
                )),
                Err(_) => ApiError::NodeNotFound(id.to_string()),
            });
        };
        if record.revoked_at.is_some() {
            self.store.remove_node(id)?;
            self.members.lock().expect("members lock").remove(id);
            tracing::warn!(node = %id, "revoked node forgotten: the name may join again");
            return Ok(());
        }
        record.revoked_at = Some(Utc::now());
        record.server_to_node.clear();
        record.node_to_server_sha256.clear();
        self.store.put_node(&record)?;
        self.members
            .lock()
            .expect("members lock")
            .insert(id.to_string(), Member::of(record));
        self.nodes.remove(id);
        self.end_sandboxes_of(id, &format!("node {id} was revoked"));
        tracing::warn!(node = %id, "node revoked");
        Ok(())
    }

    /// Marks slot `slot` of node `node` admitted for a holder not recorded yet, until the
    /// guard is dropped (the record names it by then, or it was released).
    pub(super) fn admitting(&self, node: &str, slot: u32) -> Admitting<'_> {
        let key = (node.to_string(), slot);
        self.admitting
            .lock()
            .expect("admitting lock")
            .insert(key.clone());
        Admitting { lc: self, key }
    }

    /// Gives back the slots nodes report admitted and unused for longer than
    /// [`crate::config::ServerConfig::admission_grace`] that no record and no start in flight
    /// holds: admissions whose answer never arrived (a timeout, a crash before the record).
    /// Nothing is asked of a lost node.
    pub(super) async fn release_forgotten_admissions(&self) {
        // A resume another server runs may hold a slot it admitted on another node (a move
        // off a lost node) for as long as the checkpoint takes to fetch, unrecorded and in
        // that server's memory only: nothing is given back meanwhile.
        if self
            .snapshot()
            .iter()
            .any(|r| r.state() == SandboxState::Resuming && self.acted_on_elsewhere(r))
        {
            return;
        }
        let grace = self.cfg.admission_grace.as_millis() as u64;
        for (node_id, status) in self.nodes.statuses() {
            let Some(status) = status else { continue };
            let old: Vec<u32> = status
                .unused_admissions
                .iter()
                .filter(|a| a.age_ms >= grace)
                .map(|a| a.slot)
                .collect();
            if old.is_empty() {
                continue;
            }
            let Ok(node) = self.node(Some(&node_id)) else {
                continue;
            };
            let held = self.slots_held_on(&node_id);
            for slot in old.into_iter().filter(|s| !held.contains(s)) {
                // The node checks the admission is still the unused one the report named.
                if node.release_unused_admission(slot, grace).await {
                    tracing::warn!(node = %node_id, slot, "gave back a slot admitted and never used (its admission's answer was lost)");
                }
            }
        }
    }

    /// The slots of node `node_id` that records or starts in flight hold.
    fn slots_held_on(&self, node_id: &str) -> HashSet<u32> {
        let mut held: HashSet<u32> = self
            .admitting
            .lock()
            .expect("admitting lock")
            .iter()
            .filter(|(node, _)| node == node_id)
            .map(|(_, slot)| *slot)
            .collect();
        for record in self.snapshot() {
            if self.node_name(record.node.as_deref()) == node_id {
                held.extend(record.slot);
                held.extend(record.placement.as_ref().map(|p| p.slot));
            }
            for moved in &record.moved_from {
                if self.node_name(moved.node.as_deref()) == node_id {
                    held.extend(moved.slot);
                }
            }
        }
        held
    }

    /// With a shared store: extends the lease of every registered node whose lease in the
    /// store is alive (it heartbeats to another server). Every server does it before each
    /// pass of its reconciler. False when the store's leases could not be read (alone: true).
    pub(super) fn refresh_node_leases(&self) -> bool {
        let live = match self.cluster.live_nodes() {
            Ok(Some(live)) => live,
            Ok(None) => return true,
            Err(e) => {
                tracing::debug!(error = %e, "the nodes' leases in the store were not read");
                return false;
            }
        };
        let until = std::time::Instant::now() + self.lease_duration();
        for id in live {
            if self.nodes.is_lost(Some(&id)) {
                // Declared lost, its lease ran out; a lease alive again means it renewed
                // through another server since: it is back (the losses it is told, counted
                // durably, make it remove what ran there).
                if self.nodes.renew(&id, until) == Some(true) {
                    tracing::warn!(node = %id, "a lost node renewed its lease through another server");
                }
            } else {
                self.nodes.extend(&id, until);
            }
        }
        if !self.cluster.is_leader() {
            // Nothing is asked of a node whose lease ran out, here too; declaring it lost
            // (failing its sandboxes) is the leader's.
            let _ = self.nodes.newly_lost(self.cfg.leases.lost_margin);
        }
        true
    }

    /// Declares lost the nodes whose lease ran out longer ago than the margin (one pass of
    /// the reconciler); each loss is counted durably before anything else.
    ///
    /// With a shared store, a node is declared lost only right after its lease in the store
    /// was read gone (it was renewed through no server for its whole lease: its guard froze
    /// it); when the leases cannot be read, nobody is declared lost.
    pub(super) fn declare_lost_nodes(&self) {
        if !self.refresh_node_leases() {
            return;
        }
        for id in self.nodes.newly_lost(self.cfg.leases.lost_margin) {
            if !self.count_loss(&id) {
                // Changed meanwhile (with a shared store: it renewed through another server
                // after its lease ran out): not lost; the next pass decides again.
                let until = std::time::Instant::now() + self.lease_duration();
                self.nodes.renew(&id, until);
                continue;
            }
            tracing::error!(node = %id, "node lost: its lease ran out");
            self.fail_sandboxes_of(&id, &format!("node {id} was lost (its lease ran out)"));
        }
    }

    /// Counts a loss of node `id` durably, a compare-and-swap on its record; false when the
    /// record changed since this server read it (it is read again).
    fn count_loss(&self, id: &str) -> bool {
        let mut members = self.members.lock().expect("members lock");
        let Some(member) = members.get_mut(id) else {
            return true;
        };
        let mut record = member.record.clone();
        record.losses += 1;
        match self.store.put_node(&record) {
            Ok(()) => {
                member.record = record;
                true
            }
            Err(e) if e.is_conflict() => {
                if let Ok(Some(fresh)) = self.store.reload_node(id) {
                    member.record = fresh;
                }
                false
            }
            Err(e) => {
                tracing::error!(node = %id, error = %e, "the loss of a node could not be recorded");
                true
            }
        }
    }

    /// The node's losses as a renewal tells them. With a shared store, when its lease there
    /// had run out (`fresh`), its record is written again first, a compare-and-swap: a loss
    /// the leader counted meanwhile makes it fail, and the count is read again; a loss not
    /// counted yet cannot be anymore (the leader's count fails on this write). So a node is
    /// never told an old count after its loss.
    fn losses_for_renewal(&self, node_id: &str, fresh: bool) -> Result<u64, MembershipError> {
        let cached = || {
            self.members
                .lock()
                .expect("members lock")
                .get(node_id)
                .map_or(0, |m| m.record.losses)
        };
        if !fresh {
            return Ok(cached());
        }
        let unavailable = |e: crate::store::StoreError| MembershipError::Unavailable(e.to_string());
        for _ in 0..5 {
            let Some(record) = self.store.reload_node(node_id).map_err(unavailable)? else {
                return Err(MembershipError::Unknown(node_id.to_string()));
            };
            match self.store.put_node(&record) {
                Ok(()) => {
                    let losses = record.losses;
                    if let Some(member) =
                        self.members.lock().expect("members lock").get_mut(node_id)
                    {
                        member.record = record;
                    }
                    return Ok(losses);
                }
                Err(e) if e.is_conflict() => continue,
                Err(e) => return Err(unavailable(e)),
            }
        }
        Err(MembershipError::Unavailable(format!(
            "the record of node {node_id} kept changing"
        )))
    }

    /// The sandboxes on node `id` that ran or were about to: `Failed` (`NODE_LOST`). Paused
    /// ones keep their checkpoint and stay `Paused`; one whose resume was in flight goes by
    /// [`resume_cut_by_loss`] (settled by the resume's task when one still runs it, here or
    /// on another server). Nothing is asked of the node.
    fn fail_sandboxes_of(&self, id: &str, message: &str) {
        for record in self.records_on(id) {
            let busy = self.busy.lock().expect("busy lock").contains(&record.id);
            let _ = self.update(&record.id, |r| {
                match r.state() {
                    SandboxState::Resuming if busy || self.acted_on_elsewhere(r) => {}
                    SandboxState::Resuming => resume_cut_by_loss(r, message),
                    SandboxState::Pending | SandboxState::Running | SandboxState::Pausing => {
                        r.transition(SandboxState::Failed, Some(NODE_LOST), message)
                    }
                    SandboxState::Paused => r.event("NodeLost", message),
                    _ => {}
                }
                Ok(())
            });
        }
    }

    /// [`Lifecycle::fail_sandboxes_of`] for a node that is gone for good: nothing of them
    /// is left to remove there (their placement and slot are forgotten, a deletion ends).
    fn end_sandboxes_of(&self, id: &str, message: &str) {
        self.fail_sandboxes_of(id, message);
        for record in self.records_on(id) {
            let _ = self.update(&record.id, |r| {
                if r.state() != SandboxState::Paused {
                    r.placement = None;
                    r.slot = None;
                }
                if r.state() == SandboxState::Stopping {
                    r.transition(SandboxState::Terminated, None, message);
                }
                Ok(())
            });
        }
    }

    /// The records of node `id`.
    fn records_on(&self, id: &str) -> Vec<crate::record::SandboxRecord> {
        self.snapshot()
            .into_iter()
            .filter(|r| self.node_name(r.node.as_deref()) == id)
            .collect()
    }

    /// The route signing keys of the routes to sandboxes on node `node`: a registered node's
    /// own (derived from the server's and its name: it can sign no route another node
    /// accepts), else the server's.
    pub(super) fn route_signer_for(
        &self,
        node: Option<&str>,
    ) -> std::sync::Arc<fastbox_proxy::RouteSigner> {
        let name = self.node_name(node);
        let registered = self
            .members
            .lock()
            .expect("members lock")
            .get(&name)
            .is_some_and(|m| m.record.revoked_at.is_none());
        match registered {
            true => std::sync::Arc::new(self.keys.current().derive(&name)),
            false => self.keys.current(),
        }
    }

    /// Whether the records of node `id` are left alone (it is lost: nothing is asked of it
    /// until it renews its lease).
    pub(super) fn node_is_lost(&self, id: Option<&str>) -> bool {
        self.nodes.is_lost(id)
    }

    /// The name of the node `node` names (`None`: the first node).
    pub(super) fn node_name(&self, node: Option<&str>) -> String {
        node.map_or_else(|| self.nodes.first_id(), str::to_string)
    }
}

/// `host:port` with nothing else (no scheme, user, path).
fn check_proxy(proxy: &str) -> Result<(), MembershipError> {
    let bad = || MembershipError::Invalid(format!("proxy_public {proxy:?} is not host:port"));
    let (host, port) = proxy.rsplit_once(':').ok_or_else(bad)?;
    let host_ok = !host.is_empty()
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'[' | b']' | b':'));
    match (host_ok, port.parse::<u16>()) {
        (true, Ok(p)) if p > 0 => Ok(()),
        _ => Err(bad()),
    }
}

#[async_trait]
impl ControlPlane for Lifecycle {
    fn authenticate(&self, presented: &[u8]) -> Option<Caller> {
        if let Some(token) = self.join_token.read().expect("join token lock").as_ref()
            && token.matches(presented)
        {
            return Some(Caller::Joining);
        }
        let digest = CredentialDigest::of(presented);
        let members = self.members.lock().expect("members lock");
        // Every member is compared, so the time taken does not tell which one matched.
        members
            .values()
            .filter(|m| {
                m.node_to_server
                    .as_ref()
                    .is_some_and(|d| d.matches(&digest))
            })
            .map(|m| Caller::Node(m.record.node_id.clone()))
            .fold(None, |found, caller| found.or(Some(caller)))
    }

    fn holds(&self, node_id: &str, sandbox_id: &str) -> bool {
        // A sandbox another server created a moment ago may not have reached this server's
        // cache through the store's watch yet: the store has it (its intent is durable
        // before any node holds it).
        self.record(sandbox_id)
            .or_else(|_| self.refresh(sandbox_id))
            .is_ok_and(|r| self.node_name(r.node.as_deref()) == node_id)
    }

    async fn register(
        &self,
        caller: &Caller,
        registration: Registration,
    ) -> Result<Registered, MembershipError> {
        check_node_id(&registration.node_id)?;
        let proxy = registration.proxy_public.trim().to_string();
        check_proxy(&proxy)?;
        let id = registration.node_id.clone();
        let _serial = self.membership_changes.lock().expect("membership lock");
        let known = self
            .members
            .lock()
            .expect("members lock")
            .get(&id)
            .map(|m| m.record.clone());
        let refused = |why: String| Err(MembershipError::Refused(why));
        let losses = match (caller, &known) {
            (Caller::Joining, None) if self.nodes.get(Some(&id)).is_ok() => {
                return refused(format!(
                    "node id {id} is taken by a node of this server's configuration"
                ));
            }
            (Caller::Joining, None) => 0,
            (Caller::Joining, Some(r)) if r.revoked_at.is_some() => {
                return refused(format!(
                    "node {id} was revoked: it joins again only once an operator forgets it (DELETE /v1/nodes/{id} once more)"
                ));
            }
            (Caller::Joining, Some(_)) => {
                return refused(format!(
                    "node {id} is registered: it registers again with its own credential; the join token never takes over a registered name"
                ));
            }
            (Caller::Node(me), Some(r)) if *me == id && r.revoked_at.is_none() => r.losses,
            (Caller::Node(me), _) => {
                return refused(format!(
                    "node {me} may register again as itself only, not as {id}"
                ));
            }
        };
        let fresh = || {
            Credential::generate().map_err(|e| MembershipError::Failed(format!("getrandom: {e}")))
        };
        let (server_to_node, node_to_server) = (fresh()?, fresh()?);
        let record = NodeRecord {
            node_id: id.clone(),
            url: registration.url.clone(),
            tls_pin: registration.tls_pin.clone(),
            proxy_public: proxy.clone(),
            server_to_node: server_to_node.to_string(),
            node_to_server_sha256: node_to_server.digest().to_hex(),
            registered_at: Utc::now(),
            losses,
            revoked_at: None,
        };
        // Checked before it is kept: a URL the client refuses is the node's mistake.
        self.client_of(&record).map_err(MembershipError::Invalid)?;
        // Its lease in a shared store first: every server sees it alive from the start.
        self.cluster
            .renew_node(&id, self.lease_duration())
            .map_err(|e| MembershipError::Unavailable(e.to_string()))?;
        self.store
            .put_node(&record)
            .map_err(|e| MembershipError::Failed(e.to_string()))?;
        self.admit_member(record)
            .map_err(|e| MembershipError::Failed(e.to_string()))?;
        tracing::info!(node = %id, proxy = %proxy, again = known.is_some(), "node registered");
        Ok(Registered {
            server_to_node: server_to_node.to_string(),
            node_to_server: node_to_server.to_string(),
            terms: self.cfg.leases.terms,
            route_keys: Some(self.keys.current().derive(&id).file_text()),
        })
    }

    async fn heartbeat(
        &self,
        node_id: &str,
        heartbeat: Heartbeat,
    ) -> Result<Renewal, MembershipError> {
        // Renewed in a shared store first: unrenewed there, the node is not answered (it
        // tries again, and freezes if no server can renew it in time).
        let fresh = self
            .cluster
            .renew_node(node_id, self.lease_duration())
            .map_err(|e| MembershipError::Unavailable(e.to_string()))?;
        let losses = self.losses_for_renewal(node_id, fresh)?;
        // Counted from now, which is after the node sent it: the node counts from its send,
        // so its own deadline always comes first.
        let until = std::time::Instant::now() + self.lease_duration();
        let was_lost = self
            .nodes
            .renew(node_id, until)
            .ok_or_else(|| MembershipError::Unknown(node_id.to_string()))?;
        self.nodes.report(heartbeat.status);
        if was_lost {
            tracing::warn!(node = %node_id, "a lost node renewed its lease: what it ran is removed");
        }
        let keys = self.keys.current().derive(node_id).file_text();
        let held = heartbeat.route_keys_sha256.as_deref();
        let route_keys = (held != Some(route_keys_digest(&keys).as_str())).then_some(keys);
        Ok(Renewal {
            terms: self.cfg.leases.terms,
            was_lost,
            losses,
            route_keys,
        })
    }
}

impl NodeView {
    /// The state as the API writes it.
    pub fn state_text(&self) -> &'static str {
        match self.state {
            NodeState::Static => "static",
            NodeState::Ready => "ready",
            NodeState::Expired => "expired",
            NodeState::Lost => "lost",
        }
    }
}

/// A slot admitted for a holder not recorded yet ([`Lifecycle::admitting`]).
pub(super) struct Admitting<'a> {
    lc: &'a Lifecycle,
    key: (String, u32),
}

impl Drop for Admitting<'_> {
    fn drop(&mut self) {
        self.lc
            .admitting
            .lock()
            .expect("admitting lock")
            .remove(&self.key);
    }
}

/// What a sandbox becomes whose resume its node's loss cut short: `Paused` (`NODE_LOST`) on
/// its published checkpoint, and the next resume moves it (whatever the resume started on
/// the lost node, the node's fence froze before its lease could run out); `Failed`
/// (`NODE_LOST`) when the checkpoint was never published.
pub(super) fn resume_cut_by_loss(r: &mut SandboxRecord, message: &str) {
    match r.paused_manifest {
        Some(_) => r.transition(
            SandboxState::Paused,
            Some(NODE_LOST),
            &format!(
                "{message} during its resume: paused on its published checkpoint, it resumes on another node"
            ),
        ),
        None => r.transition(SandboxState::Failed, Some(NODE_LOST), message),
    }
}
