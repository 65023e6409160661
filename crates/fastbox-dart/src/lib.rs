//! DART: artifact blocks delivered among the nodes of a delivery group, in front of the
//! origin store, so that each block comes from the origin about once per cluster.
//!
//! A node's reads go through [`Delivery`], an [`ArtifactStore`](fastbox_artifact::ArtifactStore):
//! its own blocks ([`NodeBlocks`]: the node block cache), then the block's **owner** (chosen by
//! rendezvous hashing over the current [`Membership`]), then other peers that hold the block,
//! then the origin. A node serves its peers with [`router`] (an axum `Router`; [`PeerServer`]
//! runs it on its own runtime). The owner of a block fetches it from the origin once: all
//! concurrent requests for it, local and from peers, join one **single flight**, and peers
//! receive the bytes **while the owner is still receiving them**. Failed or slow peers cost
//! one timeout each until their **circuit breaker** opens; the origin is always the last
//! resort. Peers **authenticate** each other with HMAC-SHA256 signatures under a group
//! secret ([`auth`]). Every block from a peer or the origin is verified against its digest
//! before it is used or kept. Membership comes from configuration (`id=host:port` entries)
//! and is replaced at run time with [`Delivery::set_members`].
//!
//! `docs/dart.md` describes the protocol, the defaults and the counters.
//!
//! Modules, from the bottom up: [`membership`] (ids, members, rendezvous), [`auth`]
//! (signatures), [`breaker`], [`counters`], [`node_blocks`] (the local seam), `flight` (the
//! origin single flight), [`client`] (the blocking peer client), [`server`] (the peer
//! server's routes), [`serve`] (running them), [`delivery`] (the read path). Beside them,
//! [`store_config`]: the configuration of a node's artifact store (its origin's location,
//! the block cache's budget, its DART settings), parsed and checked without running
//! anything.
//!
//! Threads: [`Delivery`] is synchronous and may be called from any thread, including
//! `spawn_blocking` threads (its HTTP client owns no async runtime); the peer server runs
//! the blocking parts (local reads, the origin fetch) on blocking threads.
//!
//! Features: `testkit` adds `testkit::CountingOrigin`, an origin that counts reads and can
//! stream slowly, for this crate's tests and others'.

pub mod auth;
pub mod breaker;
pub mod client;
pub mod counters;
pub mod delivery;
mod flight;
pub mod membership;
mod node;
pub mod node_blocks;
pub mod protocol;
pub mod serve;
pub mod server;
pub mod store_config;
#[cfg(feature = "testkit")]
pub mod testkit;

pub use auth::GroupSecret;
pub use breaker::BreakerConfig;
pub use client::{PeerClient, PeerError, PeerTimeouts};
pub use counters::CounterSnapshot;
pub use delivery::{DartConfig, Delivery};
pub use membership::{Member, Membership, MembershipError, NodeId};
pub use node_blocks::NodeBlocks;
pub use protocol::FetchMode;
pub use serve::{PeerServer, StartError};
pub use server::{PeerState, ServeError, router};
