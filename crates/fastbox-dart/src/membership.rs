//! The delivery group: who its members are and which of them owns a block.
//!
//! Membership is a list of `id=host:port` entries (from configuration today, from the state
//! store later) and is replaced whole at run time ([`crate::Delivery::set_members`]): there
//! is no join protocol, every node computes ownership from the list it was given.
//!
//! **Ownership** is rendezvous (highest-random-weight) hashing: the weight of member `m` for
//! block `d` is the first 8 bytes (big-endian) of `blake3(id(m) || 0x00 || d)`, and the
//! member with the highest weight owns the block (ties, which need a 64-bit collision, go to
//! the smaller id). When a member leaves, only the blocks it owned move (each to the member
//! with the next-highest weight); when one joins, it takes over only the blocks for which it
//! has the highest weight. [`Membership::ranked`] gives the whole order, which is also the
//! order in which a node asks the other peers.

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use fastbox_artifact::Digest;

/// Longest node id accepted.
pub const MAX_NODE_ID_LEN: usize = 64;

/// Why a node id, a member entry or a member list is not valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MembershipError {
    /// A node id outside `[A-Za-z0-9._-]{1,64}`.
    #[error("node id {0:?} is not 1 to 64 characters of [A-Za-z0-9._-]")]
    InvalidNodeId(String),
    /// An entry that is not `id=host:port`.
    #[error("member {0:?} is not of the form id=host:port")]
    InvalidMember(String),
    /// An address without a host or a valid port.
    #[error("member address {0:?} is not host:port with a port in 1-65535")]
    InvalidAddress(String),
    /// Two entries with the same id.
    #[error("node id {0} appears twice in the member list")]
    DuplicateId(NodeId),
}

/// A node's name in the delivery group: 1 to 64 characters of `[A-Za-z0-9._-]`, so it fits
/// an HTTP header and a metric label unescaped.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(String);

impl NodeId {
    /// A node id, checked.
    pub fn try_new(id: impl Into<String>) -> Result<Self, MembershipError> {
        let id = id.into();
        let valid = !id.is_empty()
            && id.len() <= MAX_NODE_ID_LEN
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if valid {
            Ok(NodeId(id))
        } else {
            Err(MembershipError::InvalidNodeId(id))
        }
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for NodeId {
    type Err = MembershipError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        NodeId::try_new(s)
    }
}

/// One member of the group: its id and the `host:port` its peer server listens on.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Member {
    /// The member's id.
    pub id: NodeId,
    /// `host:port` of its peer server (a name, an IPv4 address, or `[v6]`).
    pub addr: String,
}

impl Member {
    /// A member, its address checked.
    pub fn try_new(id: NodeId, addr: impl Into<String>) -> Result<Self, MembershipError> {
        let addr = addr.into();
        let valid = match addr.rsplit_once(':') {
            Some((host, port)) => {
                !host.is_empty()
                    && !host.contains(['/', '?', '#', '@', ' '])
                    && port.parse::<u16>().is_ok_and(|p| p != 0)
            }
            None => false,
        };
        if valid {
            Ok(Member { id, addr })
        } else {
            Err(MembershipError::InvalidAddress(addr))
        }
    }

    /// The base URL of its peer server.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl FromStr for Member {
    type Err = MembershipError;

    /// Parse `id=host:port`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (id, addr) = s
            .trim()
            .split_once('=')
            .ok_or_else(|| MembershipError::InvalidMember(s.to_string()))?;
        Member::try_new(NodeId::try_new(id)?, addr)
    }
}

impl fmt::Display for Member {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.id, self.addr)
    }
}

/// The current member list, with rendezvous ownership over it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Membership {
    members: Vec<Member>,
}

impl Membership {
    /// A membership of `members` (ids must be distinct; order does not matter).
    pub fn try_new(members: Vec<Member>) -> Result<Self, MembershipError> {
        let mut seen = BTreeSet::new();
        for member in &members {
            if !seen.insert(&member.id) {
                return Err(MembershipError::DuplicateId(member.id.clone()));
            }
        }
        Ok(Membership { members })
    }

    /// Parse entries of the form `id=host:port`.
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<Self, MembershipError> {
        let members = entries
            .iter()
            .map(|entry| entry.as_ref().parse())
            .collect::<Result<Vec<Member>, _>>()?;
        Membership::try_new(members)
    }

    /// Every member, in the order given.
    pub fn members(&self) -> &[Member] {
        &self.members
    }

    /// The member with this id, if any.
    pub fn get(&self, id: &NodeId) -> Option<&Member> {
        self.members.iter().find(|m| &m.id == id)
    }

    /// The member that owns `digest`, or None for an empty group.
    pub fn owner(&self, digest: &Digest) -> Option<&Member> {
        self.members
            .iter()
            .max_by(|a, b| rank_key(a, digest).cmp(&rank_key(b, digest)))
    }

    /// Every member by descending weight for `digest`: the owner first.
    pub fn ranked(&self, digest: &Digest) -> Vec<&Member> {
        let mut ranked: Vec<&Member> = self.members.iter().collect();
        ranked.sort_by(|a, b| rank_key(b, digest).cmp(&rank_key(a, digest)));
        ranked
    }
}

/// Sort key of a member for a block: higher is preferred (weight, then the smaller id).
fn rank_key<'a>(member: &'a Member, digest: &Digest) -> (u64, std::cmp::Reverse<&'a NodeId>) {
    (weight(&member.id, digest), std::cmp::Reverse(&member.id))
}

/// The rendezvous weight of `node` for `digest`.
pub fn weight(node: &NodeId, digest: &Digest) -> u64 {
    let mut hasher = blake3::Hasher::new();
    hasher.update(node.as_str().as_bytes());
    hasher.update(&[0]);
    hasher.update(digest.as_bytes());
    let hash = hasher.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&hash.as_bytes()[..8]);
    u64::from_be_bytes(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(ids: &[&str]) -> Membership {
        let entries: Vec<String> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| format!("{id}=127.0.0.1:{}", 7000 + i))
            .collect();
        Membership::parse(&entries).unwrap()
    }

    fn digests(n: usize) -> Vec<Digest> {
        (0..n).map(|i| Digest::of(&i.to_le_bytes())).collect()
    }

    #[test]
    fn parses_members_and_rejects_bad_entries() {
        let m: Member = "node-1=10.0.0.1:7443".parse().unwrap();
        assert_eq!(m.id.as_str(), "node-1");
        assert_eq!(m.base_url(), "http://10.0.0.1:7443");
        assert_eq!(m.to_string(), "node-1=10.0.0.1:7443");
        assert!("[::1]:80".parse::<Member>().is_err());
        assert!("x=[::1]:80".parse::<Member>().is_ok());
        for bad in [
            "nohost",
            "a=host",
            "a=host:0",
            "a=host:99999",
            "a b=h:1",
            "=h:1",
            "a=:1",
        ] {
            assert!(bad.parse::<Member>().is_err(), "{bad}");
        }
        assert!(matches!(
            Membership::parse(&["a=h:1", "a=h:2"]),
            Err(MembershipError::DuplicateId(_))
        ));
        assert!(NodeId::try_new("x".repeat(MAX_NODE_ID_LEN + 1)).is_err());
    }

    #[test]
    fn every_node_computes_the_same_owner_whatever_the_list_order() {
        let a = group(&["a", "b", "c"]);
        let b = group(&["c", "a", "b"]);
        for d in digests(200) {
            assert_eq!(a.owner(&d).unwrap().id, b.owner(&d).unwrap().id);
            assert_eq!(a.ranked(&d)[0].id, a.owner(&d).unwrap().id);
        }
    }

    #[test]
    fn ownership_spreads_over_members() {
        let g = group(&["a", "b", "c"]);
        let mut counts = std::collections::HashMap::new();
        for d in digests(3000) {
            *counts.entry(g.owner(&d).unwrap().id.clone()).or_insert(0) += 1;
        }
        for (id, n) in counts {
            assert!((700..=1300).contains(&n), "{id} owns {n} of 3000");
        }
    }

    #[test]
    fn a_leaving_member_moves_only_its_blocks_to_the_next_in_rank() {
        let before = group(&["a", "b", "c"]);
        let after = group(&["a", "b"]);
        for d in digests(500) {
            let old = before.ranked(&d);
            let new_owner = &after.owner(&d).unwrap().id;
            if old[0].id.as_str() == "c" {
                assert_eq!(new_owner, &old[1].id);
            } else {
                assert_eq!(new_owner, &old[0].id);
            }
        }
    }

    #[test]
    fn a_joining_member_takes_only_blocks_it_weighs_most_for() {
        let before = group(&["a", "b"]);
        let after = group(&["a", "b", "d"]);
        let mut moved = 0;
        for d in digests(500) {
            let new_owner = &after.owner(&d).unwrap().id;
            if new_owner.as_str() == "d" {
                moved += 1;
            } else {
                assert_eq!(new_owner, &before.owner(&d).unwrap().id);
            }
        }
        assert!(moved > 0);
    }

    #[test]
    fn an_empty_group_has_no_owner() {
        assert!(Membership::default().owner(&Digest::of(b"x")).is_none());
    }
}
