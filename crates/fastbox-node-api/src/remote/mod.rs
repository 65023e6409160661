//! The node boundary over HTTP, so a node can run in another process on another host.
//!
//! Two directions, each an axum router on one side and a `reqwest` client on the other:
//! - the server asks a node: [`node_router`] serves a [`NodeAgent`] on the node,
//!   [`NodeClient`] is the server's [`NodeAgent`] that calls it;
//! - a node asks the control plane: [`control_router`] serves the server's [`EgressApi`] and
//!   [`AccessApi`], [`ControlClient`] is the node's [`EgressApi`] and [`AccessApi`] that
//!   calls it.
//!
//! # Authentication
//!
//! Every request carries a [`Credential`] (256 random bits, 64 lowercase hex digits) in
//! `X-Fastbox-Credential`; both routers check it on every route in constant time before
//! anything else. A missing one is 401 `MISSING_CREDENTIAL`, a wrong one 401
//! `INVALID_CREDENTIAL`, both in the lifecycle API's `{code, message}` envelope, and neither
//! names the value received or expected. A node has two credentials, both its own: the
//! server's calls to it carry one (its router checks it), its calls back to the server carry
//! the other (the control router checks it). What is taken from one node lets one call that
//! node and call the server as that node, never call another node. (The control routes do
//! not yet check that the sandbox a call names is on the calling node.) Not `Authorization`:
//! the proxy route passes the caller's `Authorization` through to the sandbox untouched.
//!
//! # Encryption
//!
//! The arguments carry sandbox tokens and registry credentials, and the access route carries
//! secure sandboxes' access tokens. Over a network both APIs run over TLS ([`tls`]): each
//! listener has a self-signed certificate of its own, and each client accepts exactly the
//! one certificate it was given ([`NodeClient::with_pinned_cert`],
//! [`ControlClient::with_pinned_cert`]). `http://` URLs still work (tests, one host).
//!
//! # The node API
//!
//! `POST /node/v1/{verb}` for every verb of [`NodeAgent`] but `proxy` and `check_image`;
//! `{verb}` is the method's name (`admit`, `place`, `clone_snapshot`, `status`, ...). The
//! body is a JSON object of the method's arguments by name (`{"spec": ..., "slot": 3}`;
//! `{}` for none), at most [`MAX_BODY`]. The answer is 200 with the method's result as JSON,
//! serde's form of `Result<T, NodeError>` (`{"Ok": ...}` or `{"Err": {"kind": ..., "message":
//! ...}}`), infallible methods answering `Ok` always. Other statuses are the router's own: 400
//! `NODE::BAD_REQUEST` (a body that does not parse), 404 `NODE::UNKNOWN_VERB`, 413 (a body
//! over the limit), 401 as above.
//!
//! [`NodeClient`] maps what cannot be an answer to [`NodeErrorKind`]s: no connection, a
//! timeout, a 5xx, or a 200 whose body does not parse or is over the limit are
//! [`NodeErrorKind::Unreachable`] (whether the node acted is unknown), and so is a 401 (the
//! node refused the server's credential: nothing was done, but the node is of no use to this
//! server until the configuration is fixed, which the lifecycle API answers as 503); another
//! 4xx of the router (the node refused the call itself: nothing was done) is
//! [`NodeErrorKind::Failed`]. Every
//! message names the node and the verb. Nothing is retried here: every verb is safe to repeat
//! and the server decides when to.
//!
//! Timeouts are per verb ([`Timeouts`]): seconds for questions (`status`, `is_alive`,
//! `admit`, slots, `has_snapshot`, `snapshot_keys`), minutes for removals and policies, half
//! an hour for starts, checkpoints and image pulls, two hours for template builds (a build
//! waits for its readiness gate, up to an hour, besides its dump and publish).
//!
//! `check_image` has no route: it is a syntax check, answered by the client with the node's
//! own parser ([`fastbox_image::ImageSource::parse`]) against the node's image configuration
//! ([`NodeClient::with_image_config`]; the default configuration's aliases otherwise).
//!
//! The trait's infallible verbs cannot say that a node did not answer; the client logs a
//! warning and answers what destroys nothing: `is_alive` true and `adopt` `Adopted` (the
//! sandbox is kept, the reconciler asks again), `has_snapshot`, `finish_interrupted_pause`
//! and `release_unused_admission` false, `snapshot_keys` empty, `status` a node without free slots; `release_slot`,
//! `claim_slot` and `discard_interrupted_snapshot` are lost.
//!
//! # The proxy route
//!
//! `ANY /node/v1/proxy/{id}/{port}` and `ANY /node/v1/proxy/{id}/{port}/{path}` carry
//! [`NodeAgent::proxy`]: the request's method, query, headers and body (streamed, never
//! buffered, no size limit, no timeout once connected: event streams run as long as the
//! sandbox keeps them open) reach `agent.proxy`, whose answer streams back the same way.
//! - `{id}` and `{path}` are each percent-encoded as one segment: every byte but RFC 3986's
//!   unreserved ones (letters, digits, `-`, `.`, `_`, `~`), `/` included. The URL parser
//!   would otherwise resolve a `..` in a sandbox path and climb out of the proxy route into
//!   a verb route, with the server's credential. The node decodes each exactly once, so
//!   `path` arrives as the server gave it. A `path` must be empty or start with `/`, an
//!   `{id}` must not be `.` or `..` (refused as a bad route). The query travels as it came
//!   (the URL parser percent-encodes a `'` in it).
//! - `X-Fastbox-Unsigned: allowed|refused` carries [`Unsigned`] (required).
//! - `X-Fastbox-Client: ADDRESS:PORT`, when the server knew its caller's address, becomes the
//!   request's `ConnectInfo` on the node, so the node proxy counts failed credential checks
//!   per real client, not per server.
//! - `strip` is applied by the client: those headers (the server's API key) never leave the
//!   server, and the node is not trusted with them. The client also removes hop-by-hop
//!   headers and its own `X-Fastbox-*` headers from the caller's request, and moves `Host`
//!   to `X-Forwarded-Host` unless that is set; the router removes its `X-Fastbox-*` headers
//!   before the agent sees the request.
//! - An answer the router or the agent makes instead of the sandbox carries
//!   `X-Fastbox-Refusal: 1`: the agent's [`ProxyRefusal`] as JSON (with a status to match:
//!   400 bad route, 404 not running, 403 forbidden, 401 unsigned, the node proxy's own status
//!   for `Answered`, 502 upstream), or the router's envelope (401, 400). The router removes
//!   that header from a sandbox's answer, so a sandbox cannot forge a refusal.
//! - WebSocket and other HTTP/1.1 upgrades go through the same client (TLS and pin
//!   included) with the same route and headers, `Connection` and `Upgrade` kept; once the
//!   node answers 101 its connection leaves the pool and is spliced with the caller's, as
//!   the node proxy splices the node's with the sandbox's.
//!
//! # The control API
//!
//! `POST /control/v1/egress/policy` (`{"id"}`), `POST /control/v1/egress/change` (`{"id",
//! "change", "via"}`, `change` one of `{"replace": NetworkPolicy}`, `{"patch": [NetworkRule]}`,
//! `{"delete": [target]}`) and `POST /control/v1/access` (`{"id"}`), answered 200 with JSON:
//! the egress routes `{"Ok": PolicyStatusResponse}` or `{"Err": {"status", "code",
//! "message"}}`, the access route `null` (no such sandbox), `"open"` or `{"secure": TOKEN}`.
//! Only the access route sends a sandbox's access token, as its text; the node keeps it in
//! memory ([`ControlClient`] caches answers for a few seconds: a sandbox's access rule is
//! fixed at its create). A control plane that does not answer is a 503 for the egress
//! operations and no such sandbox for the access check (the request is refused).
//!
//! [`NodeAgent`]: crate::NodeAgent
//! [`NodeAgent::proxy`]: crate::NodeAgent::proxy
//! [`NodeErrorKind`]: crate::NodeErrorKind
//! [`NodeErrorKind::Unreachable`]: crate::NodeErrorKind::Unreachable
//! [`NodeErrorKind::Failed`]: crate::NodeErrorKind::Failed
//! [`EgressApi`]: crate::control::EgressApi
//! [`AccessApi`]: crate::control::AccessApi
//! [`Unsigned`]: crate::wire::Unsigned
//! [`ProxyRefusal`]: crate::wire::ProxyRefusal

mod control;
mod credential;
mod http_util;
mod node_client;
mod node_server;
pub mod tls;
mod verbs;

pub use control::{
    ControlClient, DEFAULT_ACCESS_TTL, MembershipCallError, SingleNode, control_router,
};
pub use credential::{Credential, CredentialDigest, CredentialError};
pub use node_client::{ClientError, NodeClient, Timeouts};
pub use node_server::node_router;

/// The header of the [`Credential`] on every route.
pub const CREDENTIAL_HEADER: &str = "x-fastbox-credential";
/// The proxy route's [`crate::wire::Unsigned`]: `allowed` or `refused`.
pub const UNSIGNED_HEADER: &str = "x-fastbox-unsigned";
/// The proxy route's client address (`ADDRESS:PORT`), when the server knew it.
pub const CLIENT_HEADER: &str = "x-fastbox-client";
/// Marks an answer of the proxy route that is not the sandbox's.
pub const REFUSAL_HEADER: &str = "x-fastbox-refusal";

/// Longest JSON body of a verb or control call, either way (the proxy route has no limit).
pub const MAX_BODY: usize = 16 << 20;
