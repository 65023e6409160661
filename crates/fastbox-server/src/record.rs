//! A sandbox as the server records it: the request, the state machine's position, where it
//! runs, and its lifecycle events. Persisted as JSON in the state store.

use chrono::{DateTime, Utc};
use fastbox_api::lifecycle::{
    ImageSpec, NetworkPolicy, Sandbox, SandboxState, SandboxStatus, StringMap,
};
use fastbox_api::snapshots::{Snapshot, SnapshotState, SnapshotStatus};
use fastbox_egress_policy::EgressPolicy;
use fastbox_node_api::wire::{NodePlacement, SandboxTokens};
use serde::{Deserialize, Serialize};

/// A create made with an `Idempotency-Key`: the sandbox it made, and a digest of its request
/// (a retry with the same key and another request is refused).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdempotentCreate {
    pub sandbox_id: String,
    pub request_sha256: String,
    pub created_at: DateTime<Utc>,
}

/// At most this many events are kept per sandbox (the oldest go first).
pub const MAX_EVENTS: usize = 200;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub id: String,
    /// The state store's revision of this version of the record (0: not stored yet); a
    /// write of a change names it ([`crate::store::Store::put`]). Not part of the record.
    #[serde(skip)]
    pub revision: fastbox_state::Revision,
    /// The server whose operation on it is in flight (a create, pause, resume or removal):
    /// set as the record enters such a state, cleared as it leaves. The leader takes the
    /// operation over when that server is gone (`service::converge`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acting: Option<String>,
    /// The image, with its credentials (kept so an interrupted create can be retried; the
    /// state directory is root-only and the credentials are never logged or returned).
    pub image: ImageSpec,
    pub entrypoint: Vec<String>,
    pub env: StringMap,
    pub metadata: StringMap,
    pub resource_limits: StringMap,
    #[serde(default)]
    pub extensions: Option<StringMap>,
    pub created_at: DateTime<Utc>,
    pub expires_at: Option<DateTime<Utc>>,
    pub status: SandboxStatus,
    /// `X-EXECD-ACCESS-TOKEN` of this sandbox's execd.
    pub execd_token: String,
    /// The node it was admitted into (`None`: the first node; records of a server that had
    /// one node only). Its slot and placement are that node's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The network slot reserved for it (recorded before the start, so recovery finds it).
    pub slot: Option<u32>,
    /// Where it runs, once started.
    pub placement: Option<NodePlacement>,
    pub events: Vec<Event>,
    /// The template (templates API) it was created from, if any.
    #[serde(default)]
    pub template_id: Option<String>,
    /// The egress policy in force, canonical (`None`: allow all).
    #[serde(default)]
    pub network_policy: Option<NetworkPolicy>,
    /// `OPENSANDBOX-EGRESS-AUTH` of the egress endpoint (port 18080).
    #[serde(default)]
    pub egress_token: String,
    /// The snapshot it was restored from, if any.
    #[serde(default)]
    pub snapshot_id: Option<String>,
    /// While paused (and resuming): the node checkpoint its processes are in.
    #[serde(default)]
    pub paused_checkpoint: Option<String>,
    /// While paused: that checkpoint's manifest in the artifact store (`blake3` hex), from
    /// which another node can resume it when its own is lost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_manifest: Option<String>,
    /// After it moved off lost nodes to resume elsewhere: what it left on each (a sandbox
    /// may move again before the first is back), each removed once its node is back.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "one_or_many"
    )]
    pub moved_from: Vec<MovedFrom>,
    /// After a resume, until its checkpoint is removed: the checkpoint it was resumed from.
    /// A restart that finds the sandbox's memory still being copied in (a lazy resume)
    /// resumes it from there again.
    #[serde(default)]
    pub resumed_from: Option<String>,
    /// A resume asked for while the sandbox was `Pausing`: it runs once the pause ends
    /// `Paused` (dropped when the pause fails, which leaves the sandbox running).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub resume_after_pause: bool,
    /// `secureAccess: true`: the token its endpoints need in `OpenSandbox-Secure-Access`
    /// (each sandbox its own, clones included). `None`: its endpoints are open by URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secure_access: Option<SecureAccess>,
    /// The volumes mounted into it (see `service::volumes`). A sandbox with volumes is not
    /// paused, snapshotted or forked (yet).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<fastbox_node_api::wire::VolumeMount>,
    /// `credentialProxy.enabled`: its HTTPS goes through its node's credential proxy, and it
    /// has a Credential Vault (in that node's memory only: never here).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub credential_proxy: bool,
}

/// What a sandbox left on the node it moved off (see [`SandboxRecord::moved_from`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MovedFrom {
    /// The node (`None`: the first node).
    pub node: Option<String>,
    /// The slot it kept there while paused.
    pub slot: Option<u32>,
    /// The pause checkpoint there.
    pub checkpoint: Option<String>,
}

/// `moved_from` as stored: a list, or the one entry (or none) records held before a sandbox
/// could move twice.
fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<MovedFrom>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Stored {
        Many(Vec<MovedFrom>),
        One(Option<MovedFrom>),
    }
    Ok(match Stored::deserialize(d)? {
        Stored::Many(many) => many,
        Stored::One(one) => one.into_iter().collect(),
    })
}

/// The access token of a `secureAccess` sandbox, as recorded. `Debug` never shows it.
#[derive(Clone, Serialize, Deserialize)]
pub struct SecureAccess {
    token: String,
}

impl SecureAccess {
    /// A new random token (`fastbox_proxy::AccessToken::generate`).
    pub fn generate() -> Result<Self, getrandom::Error> {
        Ok(Self {
            token: fastbox_proxy::AccessToken::generate()?.expose().to_string(),
        })
    }

    /// The token, to check a request against.
    pub fn token(&self) -> fastbox_proxy::AccessToken {
        fastbox_proxy::AccessToken::from_recorded(self.token.clone())
    }

    /// The token's text, for the endpoint's `headers` only.
    pub fn expose(&self) -> &str {
        &self.token
    }
}

impl std::fmt::Debug for SecureAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecureAccess(<redacted>)")
    }
}

/// A node that registered with this server, as the state store keeps it.
#[derive(Clone, Serialize, Deserialize)]
pub struct NodeRecord {
    pub node_id: String,
    /// Base URL of its node API.
    pub url: String,
    /// For an `https://` URL: the pin of its node API's certificate (SHA-256 hex), as it
    /// registered it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_pin: Option<String>,
    /// `host:port` of its node proxy for clients.
    pub proxy_public: String,
    /// The credential the server presents to it (kept as it is: the server sends it).
    pub server_to_node: String,
    /// SHA-256 (hex) of the credential it presents to the server (never kept as it is).
    pub node_to_server_sha256: String,
    pub registered_at: DateTime<Utc>,
    /// How many times it was declared lost (its heartbeats carry it: a node thaws what its
    /// fence froze only when this did not change meanwhile).
    #[serde(default)]
    pub losses: u64,
    /// Revoked: its credentials were dropped and its name may not join again until an
    /// operator forgets it (a second `DELETE /v1/nodes/{id}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_at: Option<DateTime<Utc>>,
}

impl std::fmt::Debug for NodeRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeRecord")
            .field("node_id", &self.node_id)
            .field("url", &self.url)
            .field("proxy_public", &self.proxy_public)
            .field("registered_at", &self.registered_at)
            .field("losses", &self.losses)
            .field("revoked_at", &self.revoked_at)
            .finish_non_exhaustive()
    }
}

/// One lifecycle event (`GET .../diagnostics/events`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    pub at: DateTime<Utc>,
    pub kind: String,
    pub message: String,
}

impl SandboxRecord {
    pub fn state(&self) -> SandboxState {
        self.status.state
    }

    /// The recorded egress policy. Records hold only validated policies; one that no longer
    /// parses (a newer server's) denies everything rather than allowing it.
    pub fn policy(&self) -> EgressPolicy {
        EgressPolicy::from_wire(self.network_policy.as_ref())
            .unwrap_or_else(|_| EgressPolicy::deny_all())
    }

    /// The credentials of its endpoints.
    pub fn tokens(&self) -> SandboxTokens {
        SandboxTokens {
            execd: self.execd_token.clone(),
            egress: self.egress_token.clone(),
        }
    }

    /// Moves to `state` with an optional reason and message, and records the event.
    pub fn transition(&mut self, state: SandboxState, reason: Option<&str>, message: &str) {
        let now = Utc::now();
        self.status = SandboxStatus {
            state,
            reason: reason.map(str::to_string),
            message: (!message.is_empty()).then(|| message.to_string()),
            last_transition_at: Some(now),
        };
        let kind = match reason {
            Some(r) => format!("{state} ({r})"),
            None => state.to_string(),
        };
        self.event(&kind, message);
    }

    /// Records an event without a state change.
    pub fn event(&mut self, kind: &str, message: &str) {
        if self.events.len() >= MAX_EVENTS {
            self.events.remove(0);
        }
        self.events.push(Event {
            at: Utc::now(),
            kind: kind.to_string(),
            message: message.to_string(),
        });
    }

    /// The events as text lines, oldest first.
    pub fn events_text(&self) -> String {
        self.events
            .iter()
            .map(|e| {
                let at = e.at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
                if e.message.is_empty() {
                    format!("{at} {}\n", e.kind)
                } else {
                    format!("{at} {}: {}\n", e.kind, e.message)
                }
            })
            .collect()
    }

    /// The API's view: no credentials, no internal placement.
    pub fn to_wire(&self) -> Sandbox {
        Sandbox {
            id: self.id.clone(),
            status: self.status.clone(),
            entrypoint: self.entrypoint.clone(),
            created_at: self.created_at,
            image: Some(ImageSpec {
                uri: self.image.uri.clone(),
                auth: None,
            }),
            snapshot_id: self.snapshot_id.clone(),
            platform: None,
            metadata: (!self.metadata.is_empty()).then(|| self.metadata.clone()),
            extensions: self.extensions.clone(),
            expires_at: self.expires_at,
        }
    }

    /// Whether every `filter` entry is in the metadata.
    pub fn matches_metadata(&self, filter: &[(String, String)]) -> bool {
        filter
            .iter()
            .all(|(k, v)| self.metadata.get(k).is_some_and(|have| have == v))
    }
}

/// A snapshot as the server records it: its state, and the settings of the sandbox it was
/// taken of, which its clones get unless their create says otherwise.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotRecord {
    pub id: String,
    pub sandbox_id: String,
    pub name: Option<String>,
    pub status: SnapshotStatus,
    pub created_at: DateTime<Utc>,
    /// The source's image (without credentials), entrypoint, environment, metadata and
    /// limits.
    pub image: ImageSpec,
    pub entrypoint: Vec<String>,
    pub env: StringMap,
    pub metadata: StringMap,
    pub resource_limits: StringMap,
    /// The source's lifetime in seconds (its expiry minus its creation), if it had one.
    pub timeout_secs: Option<i64>,
    /// The source's egress policy.
    pub network_policy: Option<NetworkPolicy>,
    /// The execd token inside the snapshot (the clones' execd is re-keyed with it).
    pub execd_token: String,
    /// What taking it cost (CRIU's freeze window and the rest), once taken.
    #[serde(default)]
    pub report: Option<String>,
    /// Whether the source had `secureAccess`: its clones do too, each with its own token.
    #[serde(default)]
    pub secure_access: bool,
    /// The node its checkpoint is on (the source's; `None`: the first node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Its manifest in the artifact store (`blake3` hex), once taken: another node restores
    /// it from there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest: Option<String>,
    /// The source's volumes: its clones mount the same ones (the same host directories, the
    /// same named volumes; never a copy), so they start only on the snapshot's node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<fastbox_node_api::wire::VolumeMount>,
    /// Whether the source had `credentialProxy`: its clones do too (they trust the proxy's
    /// CA already), each with a Credential Vault of its own, empty at first.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub credential_proxy: bool,
    /// The server that takes it (with a shared store, another server that starts leaves a
    /// snapshot being taken to it while it lives).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub taken_by: Option<String>,
}

impl SnapshotRecord {
    pub fn state(&self) -> SnapshotState {
        self.status.state
    }

    /// Moves to `state` with an optional reason and message.
    pub fn transition(&mut self, state: SnapshotState, reason: Option<&str>, message: &str) {
        self.status = SnapshotStatus {
            state,
            reason: reason.map(str::to_string),
            message: (!message.is_empty()).then(|| message.to_string()),
            last_transition_at: Some(Utc::now()),
        };
    }

    /// The source's recorded egress policy (deny all when it no longer parses).
    pub fn policy(&self) -> EgressPolicy {
        EgressPolicy::from_wire(self.network_policy.as_ref())
            .unwrap_or_else(|_| EgressPolicy::deny_all())
    }

    pub fn to_wire(&self) -> Snapshot {
        Snapshot {
            id: self.id.clone(),
            sandbox_id: self.sandbox_id.clone(),
            name: self.name.clone(),
            status: self.status.clone(),
            created_at: self.created_at,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub fn record(id: &str) -> SandboxRecord {
        SandboxRecord {
            id: id.into(),
            revision: 0,
            acting: None,
            image: ImageSpec {
                uri: "python:3.12".into(),
                auth: Some(fastbox_api::lifecycle::ImageAuth {
                    username: Some("u".into()),
                    password: Some("secret".into()),
                }),
            },
            entrypoint: vec!["tail".into()],
            env: StringMap::new(),
            metadata: [("team".to_string(), "a".to_string())].into(),
            resource_limits: StringMap::new(),
            extensions: None,
            created_at: Utc::now(),
            expires_at: None,
            status: SandboxStatus {
                state: SandboxState::Pending,
                reason: None,
                message: None,
                last_transition_at: None,
            },
            execd_token: "t".into(),
            node: None,
            slot: None,
            placement: None,
            events: vec![],
            template_id: None,
            network_policy: None,
            egress_token: "e".into(),
            snapshot_id: None,
            paused_checkpoint: None,
            paused_manifest: None,
            moved_from: Vec::new(),
            resume_after_pause: false,
            resumed_from: None,
            secure_access: None,
            volumes: Vec::new(),
            credential_proxy: false,
        }
    }

    #[test]
    fn wire_view_hides_credentials_and_keeps_no_nulls() {
        let r = record("a");
        let text = serde_json::to_string(&r.to_wire()).unwrap();
        assert!(!text.contains("secret") && !text.contains("null"), "{text}");
    }

    #[test]
    fn secure_access_is_recorded_never_shown_and_optional() {
        let mut r = record("a");
        let text = serde_json::to_string(&r).unwrap();
        assert!(!text.contains("secure_access"), "{text}");
        let old: SandboxRecord = serde_json::from_str(&text).unwrap();
        assert!(old.secure_access.is_none());

        r.secure_access = Some(SecureAccess::generate().unwrap());
        let token = r.secure_access.as_ref().unwrap().expose().to_string();
        assert_eq!(token.len(), 43);
        assert!(!format!("{r:?}").contains(&token));
        assert!(
            !serde_json::to_string(&r.to_wire())
                .unwrap()
                .contains(&token)
        );
        let back: SandboxRecord =
            serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        let recorded = back.secure_access.unwrap();
        assert_eq!(recorded.expose(), token);
        assert!(recorded.token().matches(token.as_bytes()));
        assert_ne!(SecureAccess::generate().unwrap().expose(), token);
    }

    #[test]
    fn moves_are_a_list_and_older_records_of_one_move_still_read() {
        let mut r = record("a");
        let text = serde_json::to_string(&r).unwrap();
        assert!(!text.contains("moved_from"), "{text}");
        let moved = |node: &str| MovedFrom {
            node: Some(node.into()),
            slot: Some(3),
            checkpoint: Some(format!("pause-a-{node}")),
        };
        r.moved_from = vec![moved("n1"), moved("n2")];
        let back: SandboxRecord =
            serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back.moved_from, r.moved_from);
        // As stored before: one move, or none.
        let mut old: serde_json::Value = serde_json::to_value(&r).unwrap();
        old["moved_from"] = serde_json::to_value(moved("n1")).unwrap();
        let back: SandboxRecord = serde_json::from_value(old.clone()).unwrap();
        assert_eq!(back.moved_from, [moved("n1")]);
        old["moved_from"] = serde_json::Value::Null;
        let back: SandboxRecord = serde_json::from_value(old).unwrap();
        assert!(back.moved_from.is_empty());
    }

    #[test]
    fn transitions_are_events() {
        let mut r = record("a");
        r.transition(SandboxState::Failed, Some("PROCESS_LOST"), "gone");
        assert_eq!(r.status.reason.as_deref(), Some("PROCESS_LOST"));
        assert!(r.events_text().contains("Failed (PROCESS_LOST): gone"));
        for _ in 0..MAX_EVENTS + 5 {
            r.event("x", "");
        }
        assert_eq!(r.events.len(), MAX_EVENTS);
    }

    #[test]
    fn metadata_filters() {
        let r = record("a");
        assert!(r.matches_metadata(&[]));
        assert!(r.matches_metadata(&[("team".into(), "a".into())]));
        assert!(!r.matches_metadata(&[("team".into(), "b".into())]));
    }
}
