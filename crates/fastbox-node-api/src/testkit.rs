//! [`FakeNode`]: an in-memory [`NodeAgent`] for tests of what sits above the node boundary
//! (the lifecycle server's state machine, transports), without root, namespaces or CRIU.
//! Behind the `testkit` feature.
//!
//! It behaves like a node of N slots:
//! - [`NodeAgent::admit`] hands out the lowest free slot ([`NodeErrorKind::NoCapacity`] when
//!   none is free), [`NodeAgent::release_slot`] and [`NodeAgent::claim_slot`] give it back and
//!   take it again;
//! - starts ([`NodeAgent::place`], [`NodeAgent::clone_snapshot`], [`NodeAgent::resume`]) fill a
//!   slot with a sandbox: its address follows from the slot ([`FakeNode::address_of`]), its
//!   handle carries a generated id and the node's incarnation (see [`FakeNode::restart`]);
//!   a start into a slot that already holds the same sandbox answers that start;
//! - [`NodeAgent::remove`] and [`NodeAgent::release_keeping_address`] empty slots, idempotently
//!   (the second keeps the slot for its sandbox, as a pause does);
//! - checkpoints live under their keys: [`NodeAgent::pause`] commits one and stops the
//!   sandbox, [`NodeAgent::stage_snapshot`] stages one, [`NodeAgent::commit_snapshot`] commits
//!   it; staged ones do not survive a [`FakeNode::restart`], committed ones do;
//! - images are known by reference ([`FakeNode::add_image`]); an unknown one is
//!   [`NodeErrorKind::BadImage`] at [`NodeAgent::resolve_image`];
//! - [`NodeAgent::proxy`] answers `200` with `{id}:{port}:{path}` for a running sandbox.
//!
//! And it lets a test act on it:
//! - [`FakeNode::fail_next`]: the next call of a verb fails before it acts;
//!   [`FakeNode::fail_next_after_acting`]: it acts, then answers an error (a lost answer);
//! - [`FakeNode::hold`] / [`FakeNode::hold_after`]: calls of a verb wait, before or after they
//!   act, until [`FakeNode::release`]; [`FakeNode::wait_held`] returns once one waits, so a
//!   test can look at the intermediate state (and can drop the caller's runtime there to
//!   crash it);
//! - [`FakeNode::kill`]: a sandbox's processes die behind the caller's back;
//!   [`FakeNode::restart`]: the node restarts, its sandboxes running on or lost;
//!   [`FakeNode::defer_teardowns`]: removals free their slots only at
//!   [`FakeNode::finish_teardowns`] (the in-process node's reaper does that);
//! - every call is recorded in order ([`FakeNode::calls`], [`FakeNode::count`]), and whatever
//!   breaks the node protocol (a start into a slot nobody admitted, a release of a slot that
//!   holds a sandbox, ...) is noted in [`FakeNode::violations`], which a test should find
//!   empty.
//!
//! It is deterministic: no clock, no sleep, no thread; its futures are ready at once unless a
//! gate holds them, and they need no particular executor.
//!
//! ```
//! use std::future::Future;
//! use std::task::{Context, Poll, Waker};
//!
//! use fastbox_node_api::testkit::{FakeNode, SlotState, Verb};
//! use fastbox_node_api::{NodeAgent, NodeError, NodeErrorKind};
//!
//! fn block_on<F: Future>(f: F) -> F::Output {
//!     let mut f = std::pin::pin!(f);
//!     let mut cx = Context::from_waker(Waker::noop());
//!     loop {
//!         if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
//!             return v;
//!         }
//!     }
//! }
//!
//! let node = FakeNode::new(1).with_image("python:3.12");
//! node.fail_next(Verb::Admit, NodeError::failed("injected"));
//! assert!(block_on(node.admit()).is_err());
//! assert_eq!(block_on(node.admit()).unwrap(), 0);
//! assert_eq!(node.slot(0), SlotState::Reserved);
//! let full = block_on(node.admit()).unwrap_err();
//! assert_eq!(full.kind, NodeErrorKind::NoCapacity);
//! assert_eq!(node.count(Verb::Admit), 3);
//! assert!(node.violations().is_empty());
//! ```

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::future::Future;
use std::net::Ipv4Addr;
use std::pin::Pin;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

use async_trait::async_trait;
use axum::body::Body;
use axum::response::Response;
use fastbox_egress_policy::EgressPolicy;
use http::{HeaderName, Request};

use crate::recipe::GoldenRecipe;
use crate::wire::{
    Adoption, CheckpointFetch, ImageInfo, NodeHandle, NodePlacement, NodeStatus, PhaseTiming,
    PlaceSpec, Placed, ProxyRefusal, RegistryCredentials, RemoveReport, RestoreSpec,
    SandboxSettings, SandboxTokens, SnapshotReport, SnapshotSource, StartReport, TemplateBuilt,
    Unsigned, UnusedAdmission,
};
use crate::{NodeAgent, NodeError, NodeErrorKind, NodeResult};

/// The node id of [`FakeNode::new`].
pub const FAKE_NODE_ID: &str = "fake-node";

/// The pool name [`NodeAgent::status`] reports pre-restored sandboxes under.
pub const FAKE_POOL: &str = "fake-pool";

/// A method of [`NodeAgent`] (`node_id` aside): what calls are recorded, failed and held by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Verb {
    Admit,
    ReleaseSlot,
    ClaimSlot,
    ReleaseUnusedAdmission,
    CheckImage,
    ResolveImage,
    Place,
    CloneSnapshot,
    Resume,
    IsAlive,
    Adopt,
    Remove,
    ReleaseKeepingAddress,
    Pause,
    FinishInterruptedPause,
    StageSnapshot,
    CommitSnapshot,
    HasSnapshot,
    FetchCheckpoint,
    RemoveSnapshot,
    DiscardInterruptedSnapshot,
    SnapshotKeys,
    BuildTemplate,
    RemoveTemplate,
    SetEgressPolicy,
    Proxy,
    Status,
}

impl Verb {
    /// Whether the verb answers an error (a `NodeResult`, or the proxy's refusal), so that
    /// [`FakeNode::fail_next`] can inject one.
    pub fn can_fail(self) -> bool {
        matches!(
            self,
            Self::Admit
                | Self::CheckImage
                | Self::ResolveImage
                | Self::Place
                | Self::CloneSnapshot
                | Self::Resume
                | Self::Remove
                | Self::ReleaseKeepingAddress
                | Self::Pause
                | Self::StageSnapshot
                | Self::CommitSnapshot
                | Self::RemoveSnapshot
                | Self::FetchCheckpoint
                | Self::BuildTemplate
                | Self::RemoveTemplate
                | Self::SetEgressPolicy
                | Self::Proxy
        )
    }

    /// Whether calls of the verb can be held ([`FakeNode::hold`]): every async one.
    pub fn can_hold(self) -> bool {
        self != Self::CheckImage
    }
}

/// One recorded call: its verb and what it named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub verb: Verb,
    /// The sandbox named (a start's: its spec's id).
    pub id: Option<String>,
    /// The checkpoint, template or image reference named (the proxy's: `{port}:{path}`).
    pub key: Option<String>,
    /// The slot named (a placement's, or the slot argument).
    pub slot: Option<u32>,
}

impl Call {
    fn new(verb: Verb) -> Self {
        Self {
            verb,
            id: None,
            key: None,
            slot: None,
        }
    }

    fn id(mut self, id: &str) -> Self {
        self.id = Some(id.to_string());
        self
    }

    fn key(mut self, key: &str) -> Self {
        self.key = Some(key.to_string());
        self
    }

    fn slot(mut self, slot: impl Into<Option<u32>>) -> Self {
        self.slot = slot.into();
        self
    }
}

impl std::fmt::Display for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}(", self.verb)?;
        let mut sep = "";
        if let Some(id) = &self.id {
            write!(f, "id={id}")?;
            sep = ", ";
        }
        if let Some(key) = &self.key {
            write!(f, "{sep}key={key}")?;
            sep = ", ";
        }
        if let Some(slot) = self.slot {
            write!(f, "{sep}slot={slot}")?;
        }
        write!(f, ")")
    }
}

/// What a slot holds, as a test sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotState {
    Free,
    /// Admitted or claimed; nothing started in it yet.
    Reserved,
    /// Sandbox `id` is in it (`alive` false once [`FakeNode::kill`]ed).
    Sandbox {
        id: String,
        alive: bool,
    },
    /// Kept for sandbox `id` (paused, or between a failed resume and the next): its address,
    /// no processes.
    Kept {
        id: String,
    },
    /// A pre-restored sandbox of the pool ([`FakeNode::fill_pool`]), waiting for a claim.
    Pooled,
    /// Emptied by a removal whose teardown has not finished ([`FakeNode::defer_teardowns`]):
    /// not handed out.
    TearingDown,
}

/// What a sandbox was started from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// A restore of the image's (or a template's) golden checkpoint; the image reference.
    Image(String),
    /// Claimed from the pool.
    Pool,
    /// Cloned from snapshot `key`.
    Clone(String),
    /// Resumed from pause checkpoint `key`.
    Resume(String),
}

/// A sandbox of the fake node.
#[derive(Debug, Clone, PartialEq)]
pub struct FakeSandbox {
    pub id: String,
    pub placement: NodePlacement,
    /// False once its processes are gone ([`FakeNode::kill`]).
    pub alive: bool,
    pub origin: Origin,
    /// The template key of a place with one.
    pub template: Option<String>,
    /// The egress policy in force.
    pub policy: EgressPolicy,
    pub tokens: SandboxTokens,
    pub env: Vec<String>,
    /// Adopting it answers [`Adoption::MemoryIncomplete`] ([`FakeNode::set_memory_incomplete`]).
    pub memory_incomplete: bool,
}

/// Whether a checkpoint is only staged or committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointState {
    /// A live snapshot's dump, before its commit (lost at a restart).
    Staged,
    Committed,
}

/// A checkpoint of the fake node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeCheckpoint {
    pub key: String,
    pub state: CheckpointState,
    /// The sandbox it was taken of.
    pub source: String,
}

/// What happens to the sandboxes when the node restarts ([`FakeNode::restart`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restart {
    /// Sandboxes alive run on (and are adopted); everything else the node held in memory
    /// goes.
    KeepSandboxes,
    /// Every sandbox's processes are gone too.
    LoseSandboxes,
}

/// Where a gate or an injected failure sits in a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum At {
    /// Before the call acts.
    Before,
    /// After it acted, before it answers.
    After,
}

#[derive(Debug, Clone)]
enum Content {
    Free,
    Reserved,
    Sandbox(Box<FakeSandbox>),
    Kept(String),
    Pooled,
}

#[derive(Debug, Clone)]
struct Slot {
    content: Content,
    /// Removed, the slot index not free yet (deferred teardowns).
    teardown_pending: bool,
}

#[derive(Debug, Default)]
struct State {
    slots: Vec<Slot>,
    images: BTreeMap<String, ImageInfo>,
    checkpoints: BTreeMap<String, FakeCheckpoint>,
    /// Slots admitted and not named by a call since, and when.
    admitted: BTreeMap<u32, std::time::Instant>,
    /// Every checkpoint fetched from the store, and how, in order.
    fetches: Vec<(String, CheckpointFetch)>,
    templates: BTreeSet<String>,
    calls: Vec<Call>,
    violations: Vec<String>,
    failures: HashMap<(Verb, At), VecDeque<NodeError>>,
    gates: HashMap<Verb, At>,
    waiting: HashMap<Verb, usize>,
    wakers: Vec<Waker>,
    incarnation: u64,
    started: u64,
    deferred_teardowns: bool,
}

/// An in-memory node of N slots (see the [module](self) documentation).
#[derive(Debug)]
pub struct FakeNode {
    node_id: String,
    state: Mutex<State>,
}

impl FakeNode {
    /// A node of `slots` free slots, knowing no image, in incarnation 1.
    pub fn new(slots: u32) -> Self {
        let state = State {
            slots: (0..slots)
                .map(|_| Slot {
                    content: Content::Free,
                    teardown_pending: false,
                })
                .collect(),
            incarnation: 1,
            ..State::default()
        };
        Self {
            node_id: FAKE_NODE_ID.to_string(),
            state: Mutex::new(state),
        }
    }

    /// The same, named `node_id`.
    pub fn with_node_id(mut self, node_id: &str) -> Self {
        self.node_id = node_id.to_string();
        self
    }

    /// The same, knowing image `reference` (no environment of its own).
    pub fn with_image(self, reference: &str) -> Self {
        self.add_image(reference, &[]);
        self
    }

    /// Makes image `reference` known (its `KEY=VALUE` environment `env`); what
    /// [`NodeAgent::resolve_image`] answers for it.
    pub fn add_image(&self, reference: &str, env: &[&str]) -> ImageInfo {
        let info = ImageInfo {
            reference: reference.to_string(),
            canonical_reference: reference.to_string(),
            digest: fake_digest(reference),
            env: env.iter().map(|e| e.to_string()).collect(),
        };
        self.lock()
            .images
            .insert(reference.to_string(), info.clone());
        info
    }

    /// Forgets image `reference`.
    pub fn remove_image(&self, reference: &str) {
        self.lock().images.remove(reference);
    }

    /// The address of slot `slot`: one `/31` per slot in `10.200.0.0/16`, the sandbox's end.
    pub fn address_of(slot: u32) -> Ipv4Addr {
        let pair = slot * 2 + 1;
        Ipv4Addr::new(10, 200, (pair >> 8) as u8, (pair & 0xff) as u8)
    }

    // Failures and gates.

    /// The next call of `verb` fails with `error` before it acts (queued: several calls fail
    /// in turn). Panics for a verb that cannot fail ([`Verb::can_fail`]).
    pub fn fail_next(&self, verb: Verb, error: NodeError) {
        self.inject(verb, At::Before, error);
    }

    /// The next call of `verb` acts, then answers `error` (an answer lost on the way, as
    /// [`NodeErrorKind::Unreachable`] means).
    pub fn fail_next_after_acting(&self, verb: Verb, error: NodeError) {
        self.inject(verb, At::After, error);
    }

    fn inject(&self, verb: Verb, at: At, error: NodeError) {
        assert!(verb.can_fail(), "{verb:?} answers no error: it cannot fail");
        self.lock()
            .failures
            .entry((verb, at))
            .or_default()
            .push_back(error);
    }

    /// Calls of `verb` wait before they act until [`FakeNode::release`].
    pub fn hold(&self, verb: Verb) {
        self.set_gate(verb, At::Before);
    }

    /// Calls of `verb` act, then wait before they answer until [`FakeNode::release`] (a crash
    /// of the caller there finds the work done and unrecorded).
    pub fn hold_after(&self, verb: Verb) {
        self.set_gate(verb, At::After);
    }

    fn set_gate(&self, verb: Verb, at: At) {
        assert!(
            verb.can_hold(),
            "{verb:?} is synchronous: it cannot be held"
        );
        let mut s = self.lock();
        s.gates.insert(verb, at);
        let wakers = std::mem::take(&mut s.wakers);
        drop(s);
        wakers.into_iter().for_each(Waker::wake);
    }

    /// The registration of this fake when its node API listens at `url` (plain HTTP, its
    /// proxy named after its id).
    pub fn registration(&self, url: String) -> crate::membership::Registration {
        let id = self.node_id.clone();
        crate::membership::Registration {
            proxy_public: format!("{id}.nodes.test:8091"),
            node_id: id,
            url,
            tls_pin: None,
        }
    }

    /// Lets the held calls of `verb` go on, and the later ones pass.
    pub fn release(&self, verb: Verb) {
        let mut s = self.lock();
        s.gates.remove(&verb);
        let wakers = std::mem::take(&mut s.wakers);
        drop(s);
        wakers.into_iter().for_each(Waker::wake);
    }

    /// Opens every gate.
    pub fn release_all(&self) {
        let mut s = self.lock();
        s.gates.clear();
        let wakers = std::mem::take(&mut s.wakers);
        drop(s);
        wakers.into_iter().for_each(Waker::wake);
    }

    /// Ready once a call of `verb` waits at its gate (bound it with a timeout: it waits for as
    /// long as no such call comes).
    pub fn wait_held(&self, verb: Verb) -> impl Future<Output = ()> + Send + '_ {
        Held {
            node: self,
            verb,
            count: 1,
        }
    }

    /// How many calls of `verb` wait at its gate now.
    pub fn held(&self, verb: Verb) -> usize {
        self.lock().waiting.get(&verb).copied().unwrap_or(0)
    }

    // Acting behind the caller's back.

    /// The processes of sandbox `id` die (it stays in its slot, not alive). False when the
    /// node has no such sandbox.
    pub fn kill(&self, id: &str) -> bool {
        let mut s = self.lock();
        let mut found = false;
        for slot in &mut s.slots {
            if let Content::Sandbox(sb) = &mut slot.content
                && sb.id == id
            {
                sb.alive = false;
                found = true;
            }
        }
        found
    }

    /// Adopting sandbox `id` answers [`Adoption::MemoryIncomplete`] (a lazy restore whose
    /// memory transfer a restart cut short). False when the node has no such sandbox.
    pub fn set_memory_incomplete(&self, id: &str) -> bool {
        let mut s = self.lock();
        let mut found = false;
        for slot in &mut s.slots {
            if let Content::Sandbox(sb) = &mut slot.content
                && sb.id == id
            {
                sb.memory_incomplete = true;
                found = true;
            }
        }
        found
    }

    /// The node restarts: its incarnation goes up; admitted, claimed and kept slots, the
    /// pool and staged snapshots are forgotten (slots come back only through
    /// [`NodeAgent::claim_slot`] and [`NodeAgent::adopt`]); committed checkpoints, templates
    /// and images stay; sandboxes alive run on ([`Restart::KeepSandboxes`]) or are gone.
    /// Calls, failures, gates and violations are the test's, and stay.
    pub fn restart(&self, what: Restart) {
        let mut s = self.lock();
        s.incarnation += 1;
        s.checkpoints
            .retain(|_, c| c.state == CheckpointState::Committed);
        for slot in &mut s.slots {
            slot.teardown_pending = false;
            let keep = matches!(&slot.content, Content::Sandbox(sb) if sb.alive)
                && what == Restart::KeepSandboxes;
            if !keep {
                slot.content = Content::Free;
            }
        }
    }

    /// Turns up to `count` free slots into pre-restored pool sandboxes; a place that may use
    /// the pool claims one (its admitted slot is then the caller's to release). Returns how
    /// many were made.
    pub fn fill_pool(&self, count: usize) -> usize {
        let mut s = self.lock();
        let mut made = 0;
        for slot in &mut s.slots {
            if made == count {
                break;
            }
            if matches!(slot.content, Content::Free) && !slot.teardown_pending {
                slot.content = Content::Pooled;
                made += 1;
            }
        }
        made
    }

    /// With `true`, a removal empties its slot but frees it only at
    /// [`FakeNode::finish_teardowns`] (as the in-process node's reaper does); until then it is
    /// not handed out, a claim of it is a no-op, and a start into it is a violation.
    pub fn defer_teardowns(&self, deferred: bool) {
        self.lock().deferred_teardowns = deferred;
    }

    /// Finishes the pending teardowns: their slots are free. A slot that holds something by
    /// then (claimed or started into meanwhile) is freed all the same, as the reaper frees its
    /// index: a violation. Returns how many finished.
    pub fn finish_teardowns(&self) -> usize {
        let mut s = self.lock();
        let mut finished = Vec::new();
        for (index, slot) in s.slots.iter_mut().enumerate() {
            if slot.teardown_pending {
                slot.teardown_pending = false;
                let held = describe(&slot.content);
                slot.content = Content::Free;
                finished.push((index, held));
            }
        }
        for (index, held) in &finished {
            if let Some(held) = held {
                s.violations.push(format!(
                    "a teardown freed slot {index} while it held {held}"
                ));
            }
        }
        finished.len()
    }

    // Looking.

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<Call> {
        self.lock().calls.clone()
    }

    /// The calls of `verb`, in order.
    pub fn calls_of(&self, verb: Verb) -> Vec<Call> {
        self.lock()
            .calls
            .iter()
            .filter(|c| c.verb == verb)
            .cloned()
            .collect()
    }

    /// How many calls of `verb` were made.
    pub fn count(&self, verb: Verb) -> usize {
        self.lock().calls.iter().filter(|c| c.verb == verb).count()
    }

    /// Forgets the calls recorded so far.
    pub fn clear_calls(&self) {
        self.lock().calls.clear();
    }

    /// What broke the node protocol so far (empty when the caller behaved).
    pub fn violations(&self) -> Vec<String> {
        self.lock().violations.clone()
    }

    /// The node's incarnation: 1, then one more at every [`FakeNode::restart`].
    pub fn incarnation(&self) -> u64 {
        self.lock().incarnation
    }

    /// What slot `slot` holds (panics when out of range).
    pub fn slot(&self, slot: u32) -> SlotState {
        let s = self.lock();
        slot_state(&s.slots[slot as usize])
    }

    /// What every slot holds, by index.
    pub fn slots(&self) -> Vec<SlotState> {
        self.lock().slots.iter().map(slot_state).collect()
    }

    /// How many slots are free (not counting those whose teardown is pending).
    pub fn free_slots(&self) -> u32 {
        self.lock().free_slots()
    }

    /// Sandbox `id` (alive or not), if the node has it.
    pub fn sandbox(&self, id: &str) -> Option<FakeSandbox> {
        self.lock()
            .slots
            .iter()
            .find_map(|slot| match &slot.content {
                Content::Sandbox(sb) if sb.id == id => Some((**sb).clone()),
                _ => None,
            })
    }

    /// Every sandbox of the node, by slot.
    pub fn sandboxes(&self) -> Vec<FakeSandbox> {
        self.lock()
            .slots
            .iter()
            .filter_map(|slot| match &slot.content {
                Content::Sandbox(sb) => Some((**sb).clone()),
                _ => None,
            })
            .collect()
    }

    /// Checkpoint `key`, if the node has it.
    pub fn checkpoint(&self, key: &str) -> Option<FakeCheckpoint> {
        self.lock().checkpoints.get(key).cloned()
    }

    /// Every checkpoint, by key.
    pub fn checkpoints(&self) -> Vec<FakeCheckpoint> {
        self.lock().checkpoints.values().cloned().collect()
    }

    /// Every checkpoint fetched from the store ([`NodeAgent::fetch_checkpoint`]), and how.
    pub fn fetches(&self) -> Vec<(String, CheckpointFetch)> {
        self.lock().fetches.clone()
    }

    /// The keys of the templates built.
    pub fn templates(&self) -> Vec<String> {
        self.lock().templates.iter().cloned().collect()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    // The parts of every call.

    /// Records `call`, waits at its verb's gate, then answers an injected failure.
    async fn enter(&self, call: Call) -> NodeResult<()> {
        let verb = call.verb;
        self.lock().record(call);
        Gate::new(self, verb, At::Before).await;
        self.injected(verb, At::Before).map_or(Ok(()), Err)
    }

    /// After the call acted: waits at its verb's gate, then answers an injected failure or
    /// `result`.
    async fn leave<T>(&self, verb: Verb, result: NodeResult<T>) -> NodeResult<T> {
        Gate::new(self, verb, At::After).await;
        match self.injected(verb, At::After) {
            Some(error) => Err(error),
            None => result,
        }
    }

    /// [`FakeNode::enter`] and [`FakeNode::leave`] around `act`, for the verbs that cannot
    /// fail.
    async fn infallible<T>(&self, call: Call, act: impl FnOnce(&mut State) -> T) -> T {
        let verb = call.verb;
        self.lock().record(call);
        Gate::new(self, verb, At::Before).await;
        let answer = act(&mut self.lock());
        Gate::new(self, verb, At::After).await;
        answer
    }

    /// [`FakeNode::enter`], `act`, [`FakeNode::leave`].
    async fn fallible<T>(
        &self,
        call: Call,
        act: impl FnOnce(&mut State) -> NodeResult<T>,
    ) -> NodeResult<T> {
        let verb = call.verb;
        self.enter(call).await?;
        let result = act(&mut self.lock());
        self.leave(verb, result).await
    }

    fn injected(&self, verb: Verb, at: At) -> Option<NodeError> {
        self.lock()
            .failures
            .get_mut(&(verb, at))
            .and_then(VecDeque::pop_front)
    }
}

impl State {
    /// Records `call`; a call that names a slot uses the slot's admission, if any.
    fn record(&mut self, call: Call) {
        if let Some(slot) = call.slot {
            self.admitted.remove(&slot);
        }
        self.calls.push(call);
    }

    fn free_slots(&self) -> u32 {
        self.slots
            .iter()
            .filter(|s| matches!(s.content, Content::Free) && !s.teardown_pending)
            .count() as u32
    }

    fn violation(&mut self, what: String) {
        self.violations.push(what);
    }

    fn slot_mut(&mut self, verb: Verb, slot: u32) -> NodeResult<&mut Slot> {
        if slot as usize >= self.slots.len() {
            self.violation(format!(
                "{verb:?} named slot {slot}, beyond the node's {}",
                self.slots.len()
            ));
            return Err(NodeError::failed(format!("no slot {slot} on this node")));
        }
        Ok(&mut self.slots[slot as usize])
    }

    /// The live sandbox at `placement` (its slot holds it, with that handle).
    fn at(&self, placement: &NodePlacement) -> Option<&FakeSandbox> {
        match &self.slots.get(placement.slot as usize)?.content {
            Content::Sandbox(sb) if sb.placement.handle == placement.handle => Some(&**sb),
            _ => None,
        }
    }

    fn at_mut(&mut self, placement: &NodePlacement) -> Option<&mut FakeSandbox> {
        match &mut self.slots.get_mut(placement.slot as usize)?.content {
            Content::Sandbox(sb) if sb.placement.handle == placement.handle => Some(&mut **sb),
            _ => None,
        }
    }

    fn alive_named(&mut self, id: &str) -> Option<&mut FakeSandbox> {
        self.slots
            .iter_mut()
            .find_map(|slot| match &mut slot.content {
                Content::Sandbox(sb) if sb.id == id && sb.alive => Some(&mut **sb),
                _ => None,
            })
    }

    /// Checks slot `slot` for a start of sandbox `id`: `Some` answers an earlier start of the
    /// same sandbox there; `kept_ok` accepts a slot kept for it (a resume, or a create
    /// started again after a restart: the in-process node restores into a kept slot alike).
    fn start_slot(
        &mut self,
        verb: Verb,
        id: &str,
        slot: u32,
        kept_ok: bool,
    ) -> NodeResult<Option<Placed>> {
        let entry = self.slot_mut(verb, slot)?.clone();
        if entry.teardown_pending {
            self.violation(format!(
                "{verb:?} of {id} into slot {slot}, whose teardown has not finished"
            ));
        }
        match &entry.content {
            Content::Reserved => Ok(None),
            Content::Kept(owner) if kept_ok && owner == id => Ok(None),
            Content::Sandbox(sb) if sb.id == id && sb.alive => Ok(Some(Placed {
                placement: sb.placement.clone(),
                report: report("existing", slot),
            })),
            Content::Sandbox(sb) if sb.id == id => Ok(None),
            Content::Free => {
                if !entry.teardown_pending {
                    self.violation(format!(
                        "{verb:?} of {id} into slot {slot}, which nobody admitted or claimed"
                    ));
                }
                Ok(None)
            }
            other => {
                let held = describe(other).unwrap_or_default();
                self.violation(format!(
                    "{verb:?} of {id} into slot {slot}, which holds {held}"
                ));
                Err(NodeError::failed(format!("slot {slot} is in use")))
            }
        }
    }

    /// Starts sandbox `id` in slot `slot`.
    fn start(
        &mut self,
        slot: u32,
        id: &str,
        origin: Origin,
        common: &SandboxSettings,
        env: Vec<String>,
        template: Option<String>,
    ) -> Placed {
        self.started += 1;
        let placement = NodePlacement {
            slot,
            address: FakeNode::address_of(slot),
            handle: NodeHandle(serde_json::json!({
                "sandbox": format!("fake-{}", self.started),
                "incarnation": self.incarnation,
            })),
        };
        let source = match &origin {
            Origin::Image(_) => "restore",
            Origin::Pool => "pool",
            Origin::Clone(_) => "clone",
            Origin::Resume(_) => "resume",
        };
        self.slots[slot as usize] = Slot {
            content: Content::Sandbox(Box::new(FakeSandbox {
                id: id.to_string(),
                placement: placement.clone(),
                alive: true,
                origin,
                template,
                policy: common.policy.clone(),
                tokens: common.tokens.clone(),
                env,
                memory_incomplete: false,
            })),
            teardown_pending: self.slots[slot as usize].teardown_pending,
        };
        Placed {
            placement,
            report: report(source, slot),
        }
    }

    /// Removes sandbox `id` (and a slot kept for it) from every slot but `except`: the caller
    /// named another slot for it, so this is a violation.
    fn drop_elsewhere(&mut self, verb: Verb, id: &str, except: Option<u32>) {
        let mut stray = Vec::new();
        for (index, slot) in self.slots.iter_mut().enumerate() {
            if except == Some(index as u32) {
                continue;
            }
            let named = match &slot.content {
                Content::Sandbox(sb) => sb.id == id,
                Content::Kept(owner) => owner == id,
                _ => false,
            };
            if named {
                slot.content = Content::Free;
                stray.push(index);
            }
        }
        for index in stray {
            self.violation(format!(
                "{verb:?} of {id} named slot {except:?}, but {id} held slot {index}"
            ));
        }
    }

    /// Empties slot `slot` of sandbox `id` (free, or pending teardown). A slot holding
    /// someone else's is left alone: a violation.
    fn empty(&mut self, verb: Verb, id: &str, slot: u32) {
        let deferred = self.deferred_teardowns;
        let Ok(entry) = self.slot_mut(verb, slot) else {
            return;
        };
        let foreign = match &entry.content {
            Content::Sandbox(sb) if sb.id != id => describe(&entry.content),
            Content::Kept(owner) if owner != id => describe(&entry.content),
            Content::Pooled => describe(&entry.content),
            _ => None,
        };
        if let Some(held) = foreign {
            self.violation(format!(
                "{verb:?} of {id} named slot {slot}, which holds {held}"
            ));
            return;
        }
        let was_used = !matches!(entry.content, Content::Free);
        entry.content = Content::Free;
        if deferred && was_used {
            entry.teardown_pending = true;
        }
    }
}

/// A slot's content in words, `None` when it is free.
fn describe(content: &Content) -> Option<String> {
    match content {
        Content::Free => None,
        Content::Reserved => Some("a reservation".into()),
        Content::Sandbox(sb) => Some(format!("sandbox {}", sb.id)),
        Content::Kept(id) => Some(format!("the kept address of {id}")),
        Content::Pooled => Some("a pooled sandbox".into()),
    }
}

fn slot_state(slot: &Slot) -> SlotState {
    match &slot.content {
        Content::Free if slot.teardown_pending => SlotState::TearingDown,
        Content::Free => SlotState::Free,
        Content::Reserved => SlotState::Reserved,
        Content::Sandbox(sb) => SlotState::Sandbox {
            id: sb.id.clone(),
            alive: sb.alive,
        },
        Content::Kept(id) => SlotState::Kept { id: id.clone() },
        Content::Pooled => SlotState::Pooled,
    }
}

fn report(source: &str, slot: u32) -> StartReport {
    StartReport {
        source: source.to_string(),
        phases: vec![PhaseTiming {
            name: "fake".into(),
            ms: 0.0,
            detail: false,
        }],
        total_ms: 0.0,
        summary: format!("fake {source} in slot {slot}"),
    }
}

fn snapshot_report(key: &str) -> SnapshotReport {
    SnapshotReport {
        summary: format!("fake checkpoint {key}"),
        // Published: another node fetches it by this (`fetch_checkpoint`).
        manifest: Some(format!("fake-manifest-{key}")),
        bytes: 0,
        streamed: false,
    }
}

/// `sha256:` and 64 hex digits that depend only on `text`.
fn fake_digest(text: &str) -> String {
    let mut digest = String::from("sha256:");
    for round in 0..4u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ round;
        for b in text.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        digest.push_str(&format!("{h:016x}"));
    }
    digest
}

/// A call waiting at its verb's gate (counted in [`State::waiting`] while it waits).
struct Gate<'a> {
    node: &'a FakeNode,
    verb: Verb,
    at: At,
    counted: bool,
}

impl<'a> Gate<'a> {
    fn new(node: &'a FakeNode, verb: Verb, at: At) -> Self {
        Self {
            node,
            verb,
            at,
            counted: false,
        }
    }
}

impl Future for Gate<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let mut s = this.node.lock();
        if s.gates.get(&this.verb) != Some(&this.at) {
            if this.counted {
                this.counted = false;
                *s.waiting.entry(this.verb).or_default() -= 1;
            }
            return Poll::Ready(());
        }
        let mut wake = Vec::new();
        if !this.counted {
            this.counted = true;
            *s.waiting.entry(this.verb).or_default() += 1;
            // Whoever waits for a held call looks again.
            wake = std::mem::take(&mut s.wakers);
        }
        s.wakers.push(cx.waker().clone());
        drop(s);
        wake.into_iter().for_each(Waker::wake);
        Poll::Pending
    }
}

impl Drop for Gate<'_> {
    fn drop(&mut self) {
        // A caller dropped while held (its runtime shut down: a crash).
        if self.counted {
            *self.node.lock().waiting.entry(self.verb).or_default() -= 1;
        }
    }
}

/// [`FakeNode::wait_held`].
struct Held<'a> {
    node: &'a FakeNode,
    verb: Verb,
    count: usize,
}

impl Future for Held<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut s = self.node.lock();
        if s.waiting.get(&self.verb).copied().unwrap_or(0) >= self.count {
            return Poll::Ready(());
        }
        s.wakers.push(cx.waker().clone());
        Poll::Pending
    }
}

#[async_trait]
impl NodeAgent for FakeNode {
    fn node_id(&self) -> &str {
        &self.node_id
    }

    async fn admit(&self) -> NodeResult<u32> {
        self.fallible(Call::new(Verb::Admit), |s| {
            let free = s
                .slots
                .iter()
                .position(|slot| matches!(slot.content, Content::Free) && !slot.teardown_pending);
            match free {
                Some(index) => {
                    s.slots[index].content = Content::Reserved;
                    s.admitted.insert(index as u32, std::time::Instant::now());
                    Ok(index as u32)
                }
                None => Err(NodeError::new(
                    NodeErrorKind::NoCapacity,
                    format!("all {} slots are in use", s.slots.len()),
                )),
            }
        })
        .await
    }

    async fn release_slot(&self, slot: u32) {
        self.infallible(Call::new(Verb::ReleaseSlot).slot(slot), |s| {
            let Ok(entry) = s.slot_mut(Verb::ReleaseSlot, slot) else {
                return;
            };
            let held = match &entry.content {
                Content::Free | Content::Reserved => None,
                other => describe(other),
            };
            // Its index is free again, whatever it held (the in-process node does the same).
            entry.content = Content::Free;
            if let Some(held) = held {
                s.violation(format!("ReleaseSlot of slot {slot}, which held {held}"));
            }
        })
        .await
    }

    async fn release_unused_admission(&self, slot: u32, min_age_ms: u64) -> bool {
        // Named by the call's slot, the admission would count as used: not recorded with it.
        let call = Call::new(Verb::ReleaseUnusedAdmission).key(&slot.to_string());
        self.infallible(call, |s| {
            let old_enough = s
                .admitted
                .get(&slot)
                .is_some_and(|at| at.elapsed().as_millis() as u64 >= min_age_ms);
            if old_enough {
                s.admitted.remove(&slot);
                if let Some(entry) = s.slots.get_mut(slot as usize) {
                    entry.content = Content::Free;
                }
            }
            old_enough
        })
        .await
    }

    async fn claim_slot(&self, slot: u32) {
        self.infallible(Call::new(Verb::ClaimSlot).slot(slot), |s| {
            if let Ok(entry) = s.slot_mut(Verb::ClaimSlot, slot)
                && matches!(entry.content, Content::Free)
            {
                entry.content = Content::Reserved;
            }
        })
        .await
    }

    fn check_image(&self, reference: &str) -> NodeResult<()> {
        let mut s = self.lock();
        s.calls.push(Call::new(Verb::CheckImage).key(reference));
        if let Some(error) = s
            .failures
            .get_mut(&(Verb::CheckImage, At::Before))
            .and_then(VecDeque::pop_front)
        {
            return Err(error);
        }
        if reference.is_empty()
            || reference
                .chars()
                .any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(NodeError::new(
                NodeErrorKind::BadImage,
                format!("{reference:?} is not an image reference"),
            ));
        }
        Ok(())
    }

    async fn resolve_image(
        &self,
        reference: &str,
        _auth: Option<RegistryCredentials>,
    ) -> NodeResult<ImageInfo> {
        self.fallible(Call::new(Verb::ResolveImage).key(reference), |s| {
            s.images.get(reference).cloned().ok_or_else(|| {
                NodeError::new(
                    NodeErrorKind::BadImage,
                    format!("{reference}: no such image on the fake node"),
                )
            })
        })
        .await
    }

    async fn place(&self, spec: PlaceSpec, slot: u32) -> NodeResult<Placed> {
        let call = Call::new(Verb::Place)
            .id(&spec.id)
            .key(&spec.image.reference)
            .slot(slot);
        self.fallible(call, |s| {
            if !s.images.values().any(|i| i.digest == spec.image.digest) {
                return Err(NodeError::new(
                    NodeErrorKind::BadImage,
                    format!("{}: the fake node does not have it", spec.image.reference),
                ));
            }
            if let Some(existing) = s.start_slot(Verb::Place, &spec.id, slot, true)? {
                return Ok(existing);
            }
            let template = spec.template.as_ref().map(|t| t.key.clone());
            let pooled = spec
                .use_pool
                .then(|| {
                    s.slots
                        .iter()
                        .position(|x| matches!(x.content, Content::Pooled))
                })
                .flatten();
            let (into, origin) = match pooled {
                // The admitted slot stays reserved: the caller releases it.
                Some(index) => (index as u32, Origin::Pool),
                None => (slot, Origin::Image(spec.image.reference.clone())),
            };
            Ok(s.start(into, &spec.id, origin, &spec.common, spec.env, template))
        })
        .await
    }

    async fn clone_snapshot(&self, key: &str, spec: RestoreSpec, slot: u32) -> NodeResult<Placed> {
        let call = Call::new(Verb::CloneSnapshot)
            .id(&spec.id)
            .key(key)
            .slot(slot);
        self.fallible(call, |s| {
            if !s.checkpoints.contains_key(key) {
                return Err(NodeError::not_found(format!(
                    "snapshot {key}: this node does not have it"
                )));
            }
            if let Some(existing) = s.start_slot(Verb::CloneSnapshot, &spec.id, slot, false)? {
                return Ok(existing);
            }
            let origin = Origin::Clone(key.to_string());
            Ok(s.start(slot, &spec.id, origin, &spec.common, spec.env, None))
        })
        .await
    }

    async fn resume(&self, key: &str, spec: RestoreSpec, slot: u32) -> NodeResult<Placed> {
        let id = spec.id.clone();
        let call = Call::new(Verb::Resume).id(&id).key(key).slot(slot);
        let resumed = async {
            self.enter(call).await?;
            let result = {
                let mut s = self.lock();
                let committed = s
                    .checkpoints
                    .get(key)
                    .is_some_and(|c| c.state == CheckpointState::Committed);
                if committed {
                    match s.start_slot(Verb::Resume, &id, slot, true) {
                        Ok(Some(existing)) => Ok(existing),
                        Ok(None) => {
                            let origin = Origin::Resume(key.to_string());
                            Ok(s.start(slot, &id, origin, &spec.common, spec.env, None))
                        }
                        Err(e) => Err(e),
                    }
                } else {
                    Err(NodeError::not_found(format!(
                        "checkpoint {key}: this node does not have it"
                    )))
                }
            };
            self.leave(Verb::Resume, result).await
        }
        .await;
        if resumed.is_err() {
            // As the in-process node: the slot (its address) stays the sandbox's.
            let mut s = self.lock();
            if let Some(entry) = s.slots.get_mut(slot as usize)
                && matches!(entry.content, Content::Reserved | Content::Free)
            {
                entry.content = Content::Kept(id);
            }
        }
        resumed
    }

    async fn is_alive(&self, placement: &NodePlacement) -> bool {
        let call = Call::new(Verb::IsAlive).slot(placement.slot);
        self.infallible(call, |s| s.at(placement).is_some_and(|sb| sb.alive))
            .await
    }

    async fn adopt(
        &self,
        id: &str,
        placement: &NodePlacement,
        tokens: &SandboxTokens,
        policy: &EgressPolicy,
        _credential_proxy: bool,
    ) -> Adoption {
        let call = Call::new(Verb::Adopt).id(id).slot(placement.slot);
        self.infallible(call, |s| {
            // Its slot is the record's, whatever became of the sandbox (until it is removed).
            if let Some(entry) = s.slots.get_mut(placement.slot as usize)
                && matches!(entry.content, Content::Free)
            {
                entry.content = Content::Reserved;
            }
            match s.at_mut(placement) {
                Some(sb) if sb.id == id && sb.memory_incomplete => Adoption::MemoryIncomplete,
                Some(sb) if sb.id == id && sb.alive => {
                    sb.tokens = tokens.clone();
                    sb.policy = policy.clone();
                    Adoption::Adopted
                }
                _ => Adoption::Gone,
            }
        })
        .await
    }

    async fn remove(
        &self,
        id: &str,
        placement: Option<&NodePlacement>,
        slot: Option<u32>,
    ) -> NodeResult<RemoveReport> {
        let target = placement.map(|p| p.slot).or(slot);
        let call = Call::new(Verb::Remove).id(id).slot(target);
        self.fallible(call, |s| {
            s.drop_elsewhere(Verb::Remove, id, target);
            if let Some(target) = target {
                s.empty(Verb::Remove, id, target);
            }
            Ok(RemoveReport {
                processes_gone_ms: 0,
                total_ms: 0,
            })
        })
        .await
    }

    async fn release_keeping_address(
        &self,
        id: &str,
        _placement: Option<&NodePlacement>,
        slot: u32,
    ) -> NodeResult<()> {
        let call = Call::new(Verb::ReleaseKeepingAddress).id(id).slot(slot);
        self.fallible(call, |s| {
            s.drop_elsewhere(Verb::ReleaseKeepingAddress, id, Some(slot));
            let entry = s.slot_mut(Verb::ReleaseKeepingAddress, slot)?;
            let foreign = match &entry.content {
                Content::Sandbox(sb) if sb.id != id => describe(&entry.content),
                Content::Kept(owner) if owner != id => describe(&entry.content),
                Content::Pooled => describe(&entry.content),
                _ => None,
            };
            if let Some(held) = foreign {
                s.violation(format!(
                    "ReleaseKeepingAddress of {id} named slot {slot}, which holds {held}"
                ));
                return Err(NodeError::failed(format!("slot {slot} holds {held}")));
            }
            entry.content = Content::Kept(id.to_string());
            Ok(())
        })
        .await
    }

    async fn pause(&self, id: &str, source: &SnapshotSource) -> NodeResult<SnapshotReport> {
        let call = Call::new(Verb::Pause)
            .id(id)
            .key(&source.key)
            .slot(source.placement.slot);
        self.fallible(call, |s| {
            match s.at(&source.placement) {
                Some(sb) if sb.id == id && sb.alive => {}
                Some(sb) if sb.id == id => {
                    return Err(NodeError::failed(format!(
                        "pause of {id}: its processes are gone"
                    )));
                }
                _ => {
                    return Err(NodeError::not_found(format!(
                        "sandbox {id} is not running on this node"
                    )));
                }
            }
            s.checkpoints.insert(
                source.key.clone(),
                FakeCheckpoint {
                    key: source.key.clone(),
                    state: CheckpointState::Committed,
                    source: id.to_string(),
                },
            );
            s.slots[source.placement.slot as usize].content = Content::Kept(id.to_string());
            Ok(snapshot_report(&source.key))
        })
        .await
    }

    async fn finish_interrupted_pause(&self, source: &SnapshotSource) -> bool {
        let call = Call::new(Verb::FinishInterruptedPause)
            .key(&source.key)
            .slot(source.placement.slot);
        self.infallible(call, |s| {
            s.checkpoints
                .get(&source.key)
                .is_some_and(|c| c.state == CheckpointState::Committed)
        })
        .await
    }

    async fn stage_snapshot(&self, source: &SnapshotSource, _short_freeze: bool) -> NodeResult<()> {
        let call = Call::new(Verb::StageSnapshot)
            .key(&source.key)
            .slot(source.placement.slot);
        self.fallible(call, |s| {
            let id = match s.at(&source.placement) {
                Some(sb) if sb.alive => sb.id.clone(),
                Some(sb) => {
                    return Err(NodeError::failed(format!(
                        "snapshot of {}: its processes are gone",
                        sb.id
                    )));
                }
                None => {
                    return Err(NodeError::not_found(format!(
                        "no sandbox at slot {} with that handle",
                        source.placement.slot
                    )));
                }
            };
            if s.checkpoints.contains_key(&source.key) {
                return Err(NodeError::failed(format!(
                    "snapshot {}: there is one under this key already",
                    source.key
                )));
            }
            s.checkpoints.insert(
                source.key.clone(),
                FakeCheckpoint {
                    key: source.key.clone(),
                    state: CheckpointState::Staged,
                    source: id,
                },
            );
            Ok(())
        })
        .await
    }

    async fn commit_snapshot(
        &self,
        key: &str,
        placement: &NodePlacement,
    ) -> NodeResult<SnapshotReport> {
        let call = Call::new(Verb::CommitSnapshot)
            .key(key)
            .slot(placement.slot);
        let committed = self
            .fallible(call, |s| match s.checkpoints.get_mut(key) {
                Some(c) if c.state == CheckpointState::Staged => {
                    c.state = CheckpointState::Committed;
                    Ok(snapshot_report(key))
                }
                _ => Err(NodeError::not_found(format!(
                    "snapshot {key}: none is staged"
                ))),
            })
            .await;
        if committed.is_err() {
            // As the in-process node: a commit takes the staged dump, which a failure drops.
            let mut s = self.lock();
            if s.checkpoints
                .get(key)
                .is_some_and(|c| c.state == CheckpointState::Staged)
            {
                s.checkpoints.remove(key);
            }
        }
        committed
    }

    async fn has_snapshot(&self, key: &str) -> bool {
        self.infallible(Call::new(Verb::HasSnapshot).key(key), |s| {
            s.checkpoints
                .get(key)
                .is_some_and(|c| c.state == CheckpointState::Committed)
        })
        .await
    }

    async fn fetch_checkpoint(
        &self,
        key: &str,
        manifest: &str,
        _execd_token: &str,
        fetch: CheckpointFetch,
    ) -> NodeResult<()> {
        let manifest = manifest.to_string();
        self.fallible(Call::new(Verb::FetchCheckpoint).key(key), move |s| {
            if manifest.is_empty() {
                return Err(NodeError::failed("no manifest"));
            }
            s.fetches.push((key.to_string(), fetch));
            s.checkpoints
                .entry(key.to_string())
                .or_insert_with(|| FakeCheckpoint {
                    key: key.to_string(),
                    state: CheckpointState::Committed,
                    source: format!("artifact {manifest}"),
                });
            Ok(())
        })
        .await
    }

    async fn remove_snapshot(&self, key: &str) -> NodeResult<()> {
        self.fallible(Call::new(Verb::RemoveSnapshot).key(key), |s| {
            s.checkpoints.remove(key);
            Ok(())
        })
        .await
    }

    async fn discard_interrupted_snapshot(&self, key: &str) {
        let call = Call::new(Verb::DiscardInterruptedSnapshot).key(key);
        self.infallible(call, |s| {
            if s.checkpoints
                .get(key)
                .is_some_and(|c| c.state == CheckpointState::Staged)
            {
                s.checkpoints.remove(key);
            }
        })
        .await
    }

    async fn snapshot_keys(&self) -> Vec<String> {
        self.infallible(Call::new(Verb::SnapshotKeys), |s| {
            s.checkpoints.keys().cloned().collect()
        })
        .await
    }

    async fn build_template(
        &self,
        key: &str,
        image: &str,
        _recipe: &GoldenRecipe,
    ) -> NodeResult<TemplateBuilt> {
        self.fallible(Call::new(Verb::BuildTemplate).key(key), |s| {
            if !s.images.contains_key(image) {
                return Err(NodeError::new(
                    NodeErrorKind::BadImage,
                    format!("{image}: no such image on the fake node"),
                ));
            }
            s.templates.insert(key.to_string());
            Ok(TemplateBuilt {
                manifest: format!("blake3:{}", &fake_digest(key)["sha256:".len()..]),
                build_ms: 0,
                publish_seconds: 0.0,
                blocks: 0,
                new_blocks: 0,
            })
        })
        .await
    }

    async fn remove_template(&self, key: &str) -> NodeResult<()> {
        self.fallible(Call::new(Verb::RemoveTemplate).key(key), |s| {
            s.templates.remove(key);
            Ok(())
        })
        .await
    }

    async fn set_egress_policy(&self, id: &str, policy: &EgressPolicy) -> NodeResult<()> {
        self.fallible(Call::new(Verb::SetEgressPolicy).id(id), |s| {
            match s.alive_named(id) {
                Some(sb) => {
                    sb.policy = policy.clone();
                    Ok(())
                }
                None => Err(NodeError::not_found(format!(
                    "sandbox {id} is not running on this node"
                ))),
            }
        })
        .await
    }

    async fn proxy(
        &self,
        id: &str,
        port: u16,
        path: &str,
        _unsigned: Unsigned,
        _strip: &[HeaderName],
        _req: Request<Body>,
    ) -> Result<Response, ProxyRefusal> {
        let call = Call::new(Verb::Proxy).id(id).key(&format!("{port}:{path}"));
        let answered = self
            .fallible(call, |s| {
                Ok(s.alive_named(id).map(|_| format!("{id}:{port}:{path}")))
            })
            .await;
        match answered {
            Err(e) => Err(ProxyRefusal::Upstream(e.message)),
            Ok(None) => Err(ProxyRefusal::NotRunning(id.to_string())),
            Ok(Some(body)) => Ok(http::Response::builder()
                .status(http::StatusCode::OK)
                .header("x-fake-node", self.node_id.as_str())
                .body(Body::from(body))
                .expect("a valid response")),
        }
    }

    async fn status(&self) -> NodeStatus {
        let node_id = self.node_id.clone();
        self.infallible(Call::new(Verb::Status), move |s| {
            let pooled = s
                .slots
                .iter()
                .filter(|x| matches!(x.content, Content::Pooled))
                .count();
            NodeStatus {
                node_id,
                slots: s.slots.len() as u32,
                free_slots: s.free_slots(),
                pools: (pooled > 0)
                    .then(|| (FAKE_POOL.to_string(), pooled))
                    .into_iter()
                    .collect(),
                memory_available_bytes: None,
                sandboxes: Some(
                    s.slots
                        .iter()
                        .filter(|x| matches!(x.content, Content::Sandbox(..)))
                        .count() as u32,
                ),
                unused_admissions: s
                    .admitted
                    .iter()
                    .map(|(slot, at)| UnusedAdmission {
                        slot: *slot,
                        age_ms: at.elapsed().as_millis() as u64,
                    })
                    .collect(),
                delivery: None,
            }
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Polls `f` until it is ready (the fake's futures need no executor).
    fn block_on<F: Future>(f: F) -> F::Output {
        let mut f = std::pin::pin!(f);
        let mut cx = Context::from_waker(Waker::noop());
        loop {
            if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
                return v;
            }
        }
    }

    /// Polls `f` once.
    fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
        Pin::new(f).poll(&mut Context::from_waker(Waker::noop()))
    }

    const IMAGE: &str = "python:3.12";

    fn settings() -> SandboxSettings {
        SandboxSettings {
            limits: Default::default(),
            disk_bytes: None,
            tokens: SandboxTokens {
                execd: "e".into(),
                egress: "g".into(),
            },
            policy: EgressPolicy::allow_all(),
            credential_proxy: false,
        }
    }

    fn place_spec(node: &FakeNode, id: &str) -> PlaceSpec {
        PlaceSpec {
            id: id.into(),
            image: block_on(node.resolve_image(IMAGE, None)).unwrap(),
            template: None,
            use_pool: true,
            entrypoint: vec!["sleep".into()],
            env: vec![],
            volumes: Vec::new(),
            volume_keys: Default::default(),
            isolation: false,
            common: settings(),
        }
    }

    fn restore_spec(id: &str) -> RestoreSpec {
        RestoreSpec {
            id: id.into(),
            moved: false,
            env: vec![],
            volumes: Vec::new(),
            common: settings(),
        }
    }

    fn source(key: &str, placement: &NodePlacement) -> SnapshotSource {
        SnapshotSource {
            key: key.into(),
            placement: placement.clone(),
            execd_token: "e".into(),
            image_reference: IMAGE.into(),
            volumes: Vec::new(),
        }
    }

    #[test]
    fn slots_fill_and_free() {
        let node = FakeNode::new(2).with_image(IMAGE);
        let slot = block_on(node.admit()).unwrap();
        let placed = block_on(node.place(place_spec(&node, "a"), slot)).unwrap();
        assert_eq!(placed.placement.slot, 0);
        assert_eq!(placed.placement.address, FakeNode::address_of(0));
        assert!(block_on(node.is_alive(&placed.placement)));
        // The same start again answers the first.
        let again = block_on(node.place(place_spec(&node, "a"), slot)).unwrap();
        assert_eq!(again.placement, placed.placement);
        assert_eq!(block_on(node.admit()).unwrap(), 1);
        let full = block_on(node.admit()).unwrap_err();
        assert_eq!(full.kind, NodeErrorKind::NoCapacity);
        block_on(node.remove("a", Some(&placed.placement), Some(0))).unwrap();
        block_on(node.remove("a", Some(&placed.placement), Some(0))).unwrap();
        assert!(!block_on(node.is_alive(&placed.placement)));
        assert_eq!(node.slot(0), SlotState::Free);
        block_on(node.release_slot(1));
        assert_eq!(node.free_slots(), 2);
        assert!(node.violations().is_empty(), "{:?}", node.violations());
        assert_eq!(node.count(Verb::Remove), 2);
    }

    #[test]
    fn unknown_and_malformed_images_are_bad_images() {
        let node = FakeNode::new(1).with_image(IMAGE);
        assert!(node.check_image(IMAGE).is_ok());
        assert_eq!(
            node.check_image("a b").unwrap_err().kind,
            NodeErrorKind::BadImage
        );
        let e = block_on(node.resolve_image("nope:1", None)).unwrap_err();
        assert_eq!(e.kind, NodeErrorKind::BadImage);
        let info = block_on(node.resolve_image(IMAGE, None)).unwrap();
        assert_eq!(info.digest.len(), "sha256:".len() + 64);
    }

    #[test]
    fn pause_keeps_the_slot_and_resume_fills_it_again() {
        let node = FakeNode::new(1).with_image(IMAGE);
        let slot = block_on(node.admit()).unwrap();
        let placed = block_on(node.place(place_spec(&node, "a"), slot)).unwrap();
        block_on(node.pause("a", &source("pause-a", &placed.placement))).unwrap();
        assert_eq!(node.slot(0), SlotState::Kept { id: "a".into() });
        assert!(block_on(node.has_snapshot("pause-a")));
        assert!(!block_on(node.is_alive(&placed.placement)));
        let resumed = block_on(node.resume("pause-a", restore_spec("a"), 0)).unwrap();
        assert_eq!(resumed.placement.address, placed.placement.address);
        assert_ne!(resumed.placement.handle, placed.placement.handle);
        assert_eq!(
            node.sandbox("a").unwrap().origin,
            Origin::Resume("pause-a".into())
        );
        assert!(node.violations().is_empty(), "{:?}", node.violations());
    }

    #[test]
    fn a_failed_resume_keeps_the_slot() {
        let node = FakeNode::new(1);
        block_on(node.claim_slot(0));
        let e = block_on(node.resume("pause-x", restore_spec("a"), 0)).unwrap_err();
        assert_eq!(e.kind, NodeErrorKind::NotFound);
        assert_eq!(node.slot(0), SlotState::Kept { id: "a".into() });
    }

    #[test]
    fn snapshots_stage_commit_and_go() {
        let node = FakeNode::new(2).with_image(IMAGE);
        let slot = block_on(node.admit()).unwrap();
        let placed = block_on(node.place(place_spec(&node, "a"), slot)).unwrap();
        block_on(node.stage_snapshot(&source("snap", &placed.placement), true)).unwrap();
        assert!(!block_on(node.has_snapshot("snap")));
        // A clone restores from the staged dump.
        let slot = block_on(node.admit()).unwrap();
        block_on(node.clone_snapshot("snap", restore_spec("b"), slot)).unwrap();
        block_on(node.commit_snapshot("snap", &placed.placement)).unwrap();
        assert!(block_on(node.has_snapshot("snap")));
        assert_eq!(block_on(node.snapshot_keys()), ["snap"]);
        block_on(node.remove_snapshot("snap")).unwrap();
        block_on(node.remove_snapshot("snap")).unwrap();
        assert!(node.checkpoints().is_empty());
    }

    #[test]
    fn injected_failures_come_in_turn_before_or_after_acting() {
        let node = FakeNode::new(2);
        node.fail_next(Verb::Admit, NodeError::failed("one"));
        node.fail_next(Verb::Admit, NodeError::failed("two"));
        assert_eq!(block_on(node.admit()).unwrap_err().message, "one");
        assert_eq!(block_on(node.admit()).unwrap_err().message, "two");
        assert_eq!(node.free_slots(), 2);
        node.fail_next_after_acting(Verb::Admit, NodeError::failed("lost"));
        assert!(block_on(node.admit()).is_err());
        assert_eq!(node.slot(0), SlotState::Reserved, "it acted");
    }

    #[test]
    #[should_panic(expected = "cannot fail")]
    fn infallible_verbs_refuse_failures() {
        FakeNode::new(1).fail_next(Verb::IsAlive, NodeError::failed("x"));
    }

    #[test]
    fn held_calls_wait_until_released() {
        let node = FakeNode::new(1);
        node.hold(Verb::Admit);
        let mut admit = Box::pin(node.admit());
        let mut held = Box::pin(node.wait_held(Verb::Admit));
        assert!(poll_once(&mut held).is_pending());
        assert!(poll_once(&mut admit).is_pending());
        assert!(poll_once(&mut held).is_ready());
        assert_eq!(node.held(Verb::Admit), 1);
        assert_eq!(node.slot(0), SlotState::Free, "held before acting");
        node.release(Verb::Admit);
        assert_eq!(block_on(admit), Ok(0));
        assert_eq!(node.held(Verb::Admit), 0);

        node.hold_after(Verb::ReleaseSlot);
        let mut release = Box::pin(node.release_slot(0));
        assert!(poll_once(&mut release).is_pending());
        assert_eq!(node.slot(0), SlotState::Free, "held after acting");
        // A caller dropped while held (a crash) is no longer counted.
        drop(release);
        assert_eq!(node.held(Verb::ReleaseSlot), 0);
    }

    #[test]
    fn restarts_keep_or_lose_sandboxes() {
        for (what, alive) in [
            (Restart::KeepSandboxes, true),
            (Restart::LoseSandboxes, false),
        ] {
            let node = FakeNode::new(3).with_image(IMAGE);
            let slot = block_on(node.admit()).unwrap();
            let placed = block_on(node.place(place_spec(&node, "a"), slot)).unwrap();
            let reserved = block_on(node.admit()).unwrap();
            block_on(node.stage_snapshot(&source("snap", &placed.placement), false)).unwrap();
            node.restart(what);
            assert_eq!(node.incarnation(), 2);
            assert_eq!(node.slot(reserved), SlotState::Free);
            assert!(node.checkpoint("snap").is_none(), "staged: gone");
            let adoption = block_on(node.adopt(
                "a",
                &placed.placement,
                &settings().tokens,
                &EgressPolicy::allow_all(),
                false,
            ));
            let expected = if alive {
                Adoption::Adopted
            } else {
                Adoption::Gone
            };
            assert_eq!(adoption, expected);
            assert_ne!(node.slot(0), SlotState::Free, "adopt takes the slot");
        }
    }

    #[test]
    fn killed_sandboxes_are_not_alive_and_cannot_pause() {
        let node = FakeNode::new(1).with_image(IMAGE);
        let slot = block_on(node.admit()).unwrap();
        let placed = block_on(node.place(place_spec(&node, "a"), slot)).unwrap();
        assert!(node.kill("a"));
        assert!(!block_on(node.is_alive(&placed.placement)));
        let e = block_on(node.pause("a", &source("p", &placed.placement))).unwrap_err();
        assert_eq!(e.kind, NodeErrorKind::Failed);
        let e = block_on(node.set_egress_policy("a", &EgressPolicy::deny_all())).unwrap_err();
        assert_eq!(e.kind, NodeErrorKind::NotFound);
    }

    #[test]
    fn pool_claims_leave_the_admitted_slot_to_the_caller() {
        let node = FakeNode::new(2).with_image(IMAGE);
        assert_eq!(node.fill_pool(1), 1);
        let slot = block_on(node.admit()).unwrap();
        assert_eq!(slot, 1);
        let placed = block_on(node.place(place_spec(&node, "a"), slot)).unwrap();
        assert_eq!(placed.placement.slot, 0);
        assert_eq!(placed.report.source, "pool");
        assert_eq!(node.slot(1), SlotState::Reserved);
    }

    #[test]
    fn protocol_breaches_are_violations() {
        let node = FakeNode::new(2).with_image(IMAGE);
        // A start into a slot nobody admitted.
        let placed = block_on(node.place(place_spec(&node, "a"), 1)).unwrap();
        // A release of a slot holding a sandbox.
        block_on(node.release_slot(placed.placement.slot));
        let v = node.violations();
        assert_eq!(v.len(), 2, "{v:?}");
        assert!(v[0].contains("nobody admitted"), "{v:?}");
        assert!(v[1].contains("held sandbox a"), "{v:?}");
    }

    #[test]
    fn deferred_teardowns_free_slots_later() {
        let node = FakeNode::new(1).with_image(IMAGE);
        node.defer_teardowns(true);
        let slot = block_on(node.admit()).unwrap();
        block_on(node.place(place_spec(&node, "a"), slot)).unwrap();
        block_on(node.remove("a", None, Some(slot))).unwrap();
        assert_eq!(node.slot(0), SlotState::TearingDown);
        assert_eq!(
            block_on(node.admit()).unwrap_err().kind,
            NodeErrorKind::NoCapacity
        );
        assert_eq!(node.finish_teardowns(), 1);
        assert_eq!(node.slot(0), SlotState::Free);
        assert!(node.violations().is_empty(), "{:?}", node.violations());
    }

    #[test]
    fn the_proxy_answers_for_running_sandboxes() {
        let node = FakeNode::new(1).with_image(IMAGE);
        let slot = block_on(node.admit()).unwrap();
        block_on(node.place(place_spec(&node, "a"), slot)).unwrap();
        let req = || Request::new(Body::empty());
        let ok = block_on(node.proxy("a", 8080, "x", Unsigned::Allowed, &[], req())).unwrap();
        assert_eq!(ok.status(), http::StatusCode::OK);
        let refused = block_on(node.proxy("b", 8080, "x", Unsigned::Allowed, &[], req()));
        assert!(matches!(refused, Err(ProxyRefusal::NotRunning(_))));
        let status = block_on(node.status());
        assert_eq!((status.slots, status.free_slots), (1, 0));
    }
}
