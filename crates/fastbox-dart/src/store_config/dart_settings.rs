//! How a node takes part in a DART delivery group: [`DartSettings`], checked from the
//! pieces operators give (node id, listen address, member list, group secret).
//!
//! The rules, so a half-configured group fails at start instead of fetching everything from
//! the origin in silence:
//! - no member list and no listen address: no DART (the node reads its origin through its
//!   block cache alone);
//! - a member list needs a listen address, a node id and the group secret (at least 16
//!   bytes, the same on every node), and the other way round;
//! - a node id that the list does not name is allowed (the node reads through the group but
//!   owns no block; `docs/dart.md`); [`DartSettings::in_group`] tells.

use std::net::SocketAddr;

use crate::auth::AuthError;
use crate::{GroupSecret, Membership, MembershipError, NodeId};

/// The environment variable that carries the group secret.
pub const DART_KEY_ENV: &str = "FASTBOX_DART_KEY";

/// Why DART settings are incomplete or invalid.
#[derive(Debug, thiserror::Error)]
pub enum DartSettingsError {
    /// Peers without an address to serve them on.
    #[error("DART peers need a listen address (--dart-listen) for this node's peer server")]
    MissingListen,
    /// A listen address without peers.
    #[error("a DART listen address needs the member list (--dart-peers id=host:port,...)")]
    MissingPeers,
    /// Peers without this node's id.
    #[error("DART peers need this node's id (--node-id)")]
    MissingNodeId,
    /// Peers without the group secret.
    #[error(
        "DART peers need the group secret: set {DART_KEY_ENV} (at least 16 bytes, the same on every node)"
    )]
    MissingKey,
    /// A bad node id or member entry.
    #[error("DART members: {0}")]
    Members(#[from] MembershipError),
    /// A secret that is too short.
    #[error("{DART_KEY_ENV}: {0}")]
    Key(#[from] AuthError),
}

/// A node's place in its delivery group. `Debug` never shows the secret.
#[derive(Debug, Clone)]
pub struct DartSettings {
    /// This node's id.
    pub node: NodeId,
    /// Where this node's peer server listens.
    pub listen: SocketAddr,
    /// The group, this node included.
    pub members: Membership,
    /// The group secret peers sign their requests with.
    pub secret: GroupSecret,
}

impl DartSettings {
    /// Check the pieces (see the module docs): `Ok(None)` when neither peers nor a listen
    /// address are given.
    pub fn from_parts(
        node: Option<&str>,
        listen: Option<SocketAddr>,
        peers: &[String],
        key: Option<&str>,
    ) -> Result<Option<Self>, DartSettingsError> {
        let peers: Vec<&str> = peers
            .iter()
            .map(|p| p.trim())
            .filter(|p| !p.is_empty())
            .collect();
        let listen = match (listen, peers.is_empty()) {
            (None, true) => return Ok(None),
            (None, false) => return Err(DartSettingsError::MissingListen),
            (Some(_), true) => return Err(DartSettingsError::MissingPeers),
            (Some(listen), false) => listen,
        };
        let node = NodeId::try_new(node.ok_or(DartSettingsError::MissingNodeId)?)?;
        let members = Membership::parse(&peers)?;
        let key = key
            .filter(|k| !k.is_empty())
            .ok_or(DartSettingsError::MissingKey)?;
        let secret = GroupSecret::try_new(key.as_bytes().to_vec())?;
        Ok(Some(DartSettings {
            node,
            listen,
            members,
            secret,
        }))
    }

    /// Whether the member list names this node (a node outside it owns no block).
    pub fn in_group(&self) -> bool {
        self.members.get(&self.node).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "0123456789abcdef-group";

    fn peers() -> Vec<String> {
        vec!["n1=10.0.0.1:7443".into(), "n2=10.0.0.2:7443".into()]
    }

    #[test]
    fn nothing_given_is_no_dart_and_a_full_set_is_a_group() {
        assert!(
            DartSettings::from_parts(Some("n1"), None, &[], Some(KEY))
                .unwrap()
                .is_none()
        );
        let listen: SocketAddr = "0.0.0.0:7443".parse().unwrap();
        let dart = DartSettings::from_parts(Some("n1"), Some(listen), &peers(), Some(KEY))
            .unwrap()
            .unwrap();
        assert_eq!(dart.node.as_str(), "n1");
        assert_eq!(dart.members.members().len(), 2);
        assert!(dart.in_group());
        assert!(
            !format!("{dart:?}").contains(KEY),
            "the secret is not printed"
        );
        let outside = DartSettings::from_parts(Some("n9"), Some(listen), &peers(), Some(KEY))
            .unwrap()
            .unwrap();
        assert!(!outside.in_group());
    }

    #[test]
    fn every_missing_or_bad_piece_is_named() {
        let listen = Some("127.0.0.1:7443".parse().unwrap());
        let error = |node, listen, peers: &[String], key| {
            DartSettings::from_parts(node, listen, peers, key)
                .unwrap_err()
                .to_string()
        };
        assert!(error(Some("n1"), None, &peers(), Some(KEY)).contains("--dart-listen"));
        assert!(error(Some("n1"), listen, &[], Some(KEY)).contains("--dart-peers"));
        assert!(error(None, listen, &peers(), Some(KEY)).contains("--node-id"));
        assert!(error(Some("n1"), listen, &peers(), None).contains(DART_KEY_ENV));
        assert!(error(Some("n1"), listen, &peers(), Some("")).contains(DART_KEY_ENV));
        let short = error(Some("n1"), listen, &peers(), Some("short"));
        assert!(
            short.contains(DART_KEY_ENV) && short.contains("16"),
            "{short}"
        );
        assert!(error(Some("n 1"), listen, &peers(), Some(KEY)).contains("node id"));
        let bad_member = error(Some("n1"), listen, &["n1=nowhere".to_string()], Some(KEY));
        assert!(bad_member.contains("nowhere"), "{bad_member}");
    }
}
