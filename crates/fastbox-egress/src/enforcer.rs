//! [`EgressEnforcer`]: the policies of an instance's slots, enforced in its nft table and
//! by its DNS forwarder.
//!
//! One enforcer per instance. The node agent creates it before the DNS forwarder (it is
//! the forwarder's [`DnsHook`]) and calls [`EgressEnforcer::apply`] for every slot before
//! the sandbox in it may run (create, claim, policy change), [`EgressEnforcer::remove`]
//! when the slot is destroyed, and [`EgressEnforcer::forget_connections`] once it is gone.
//! A slot is keyed by its address, which is also the source address of the sandbox's DNS
//! queries.
//!
//! DNS answers naming an address in the fixed private ranges
//! ([`fastbox_runtime::net::PRIVATE_RANGES`]) outside the operator's `sandbox_reach`
//! ([`EgressEnforcer::with_reach`]) are withheld whole and teach the learned set nothing:
//! an allowed name cannot open what the instance table never lets through (DNS
//! rebinding).
//!
//! Fail closed: every error is returned. After an error from `apply` the slot's previous
//! state (no policy, or the previous one) is either fully in force or, when only cutting
//! connections failed, the new rules are in force but old connections may live on; either
//! way the caller must not start (or keep serving) the sandbox as if the policy held. DNS
//! for a slot without a policy is refused.

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::Instant;

use fastbox_runtime::net::dns_forwarder::{AnswerVerdict, DnsHook, DnsHookError, QueryVerdict};
use fastbox_runtime::net::{Ipv4Net, NetError, NetSlot, NetSys, RealNetSys, names, ranges};

use crate::conntrack::{self, ConntrackError, Flow};
use crate::learned::LearnedAddresses;
use crate::nft;
use crate::policy::{Action, EgressPolicy, Mode};

/// Destination port of DNS, which the instance table redirects to the forwarder whatever
/// the policy.
const DNS_PORT: u16 = 53;

/// The slot a policy is for: the host end of its veth and the sandbox's address.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SlotRef {
    /// Host end of the slot's veth (`{prefix}-{index}`): the key of the `slot_egress` map.
    pub ifname: String,
    /// The sandbox's address: source of its connections and of its DNS queries.
    pub address: Ipv4Addr,
}

impl From<&NetSlot> for SlotRef {
    fn from(slot: &NetSlot) -> Self {
        Self {
            ifname: slot.host_if.clone(),
            address: slot.address,
        }
    }
}

/// What failed.
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    /// The instance prefix (the nft table's name) is invalid.
    #[error("egress enforcer: invalid instance prefix")]
    Prefix(#[source] NetError),
    /// `nft` cannot run.
    #[error("egress enforcer: nft cannot run")]
    NftUnavailable(#[source] NetError),
    /// `conntrack` cannot run.
    #[error("egress enforcer: conntrack cannot run")]
    ConntrackUnavailable(#[source] ConntrackError),
    /// The interface name is not one of this instance's slots.
    #[error("{ifname:?} is not a slot interface of instance {table:?}")]
    NotASlot {
        /// The name given.
        ifname: String,
        /// The instance.
        table: String,
    },
    /// The address belongs to another slot that still has a policy.
    #[error(
        "address {address} is registered for slot {other}, not {ifname}; remove that slot's policy first"
    )]
    AddressInUse {
        /// The address.
        address: Ipv4Addr,
        /// The slot asking.
        ifname: String,
        /// The slot holding it.
        other: String,
    },
    /// `nft` failed (the slot's rules are as they were before the call: every script is one
    /// transaction).
    #[error("slot {ifname}: nft failed")]
    Nft {
        /// The slot.
        ifname: String,
        /// Why.
        #[source]
        source: NetError,
    },
    /// Reading or deleting connection tracking entries failed.
    #[error("slot {ifname}: cutting connections the policy denies failed")]
    Conntrack {
        /// The slot.
        ifname: String,
        /// Why.
        #[source]
        source: ConntrackError,
    },
    /// A DNS answer would overflow the slot's learned set.
    #[error("slot {ifname}: {source}")]
    LearnedSetFull {
        /// The slot.
        ifname: String,
        /// How full.
        #[source]
        source: crate::learned::Full,
    },
    /// A DNS answer arrived for a slot without a policy, or for a name it no longer allows.
    #[error("dns answer for {name:?} to {client}: not allowed (any more)")]
    AnswerNotAllowed {
        /// The querying address.
        client: IpAddr,
        /// The name.
        name: String,
    },
}

/// The policies of one instance's slots (see the module docs).
pub struct EgressEnforcer {
    table: String,
    sys: Arc<dyn NetSys>,
    slots: RwLock<Slots>,
    /// The operator's exceptions to the fixed private ranges (the instance table's
    /// `sandbox_reach`).
    reach: Vec<Ipv4Net>,
}

/// Registered slots by address.
type Slots = HashMap<Ipv4Addr, Arc<SlotEntry>>;

/// A registered slot. Lock order: the registry before a slot's state, never the other way.
#[derive(Debug)]
struct SlotEntry {
    ifname: String,
    state: Mutex<SlotState>,
}

/// A slot's policy (`None` until the first apply succeeds) and learned addresses.
#[derive(Debug, Default)]
struct SlotState {
    policy: Option<EgressPolicy>,
    learned: LearnedAddresses,
    /// The slot's chain, set and map element are in the table. An allow-all policy needs
    /// none of them (the table's fixed denies and final accept are that policy).
    installed: bool,
    /// The slot's HTTPS goes to the node's credential proxy.
    credential_proxy: bool,
}

impl std::fmt::Debug for EgressEnforcer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EgressEnforcer")
            .field("table", &self.table)
            .field("slots", &read(&self.slots).len())
            .field("reach", &self.reach)
            .finish()
    }
}

impl EgressEnforcer {
    /// The enforcer of instance `prefix` (whose nft table is `inet {prefix}`, installed by
    /// `HostNetwork`, possibly later). Fails if `nft` or `conntrack` cannot run.
    pub fn try_new(prefix: &str) -> Result<Self, EgressError> {
        Self::with_sys(prefix, Arc::new(RealNetSys))
    }

    /// [`EgressEnforcer::try_new`] over another kernel seam.
    pub fn with_sys(prefix: &str, sys: Arc<dyn NetSys>) -> Result<Self, EgressError> {
        names::validate_prefix(prefix).map_err(EgressError::Prefix)?;
        sys.run("nft", &["--version"], None)
            .map_err(EgressError::NftUnavailable)?;
        conntrack::check_installed(sys.as_ref()).map_err(EgressError::ConntrackUnavailable)?;
        Ok(Self {
            table: prefix.to_owned(),
            sys,
            slots: RwLock::new(HashMap::new()),
            reach: Vec::new(),
        })
    }

    /// The same enforcer for an instance whose sandboxes may reach `reach` inside the fixed
    /// private ranges: the `sandbox_reach` of the instance's `NetConfig`, which must be the
    /// same (DNS answers naming those networks pass and are learned).
    pub fn with_reach(mut self, reach: Vec<Ipv4Net>) -> Self {
        self.reach = reach;
        self
    }

    /// The networks inside the fixed private ranges that sandboxes may reach after all.
    pub fn reach(&self) -> &[Ipv4Net] {
        &self.reach
    }

    /// Installs `policy` on `slot`, or replaces its policy, in one nft transaction; then cuts
    /// the slot's open connections that `policy` denies. Addresses learned from names that
    /// `policy` still allows stay open; the rest are forgotten. See the module docs for what
    /// an error means.
    pub fn apply(&self, slot: &SlotRef, policy: &EgressPolicy) -> Result<(), EgressError> {
        self.apply_with(slot, policy, true)
    }

    /// [`EgressEnforcer::apply`] for a slot whose sandbox could not reach anything before
    /// (a new slot, or a pooled sandbox without a way out being claimed): there are no
    /// connections to cut, so conntrack is not consulted. An allow-all policy on a slot
    /// without installed rules costs no `nft` run at all.
    pub fn apply_to_new(&self, slot: &SlotRef, policy: &EgressPolicy) -> Result<(), EgressError> {
        self.apply_with(slot, policy, false)
    }

    fn apply_with(
        &self,
        slot: &SlotRef,
        policy: &EgressPolicy,
        cut: bool,
    ) -> Result<(), EgressError> {
        self.check_slot(&slot.ifname)?;
        let entry = self.entry_for(slot)?;
        let mut state = lock(&entry.state);
        let now = Instant::now();
        let mut learned = state.learned.clone();
        let keep = learned.retain_allowed(now, policy);
        let allow_all = policy.mode() == Mode::AllowAll;
        if allow_all {
            if state.installed {
                self.nft(&slot.ifname, &nft::remove_script(&self.table, &slot.ifname))?;
            }
        } else {
            let script = nft::apply_script(&self.table, &slot.ifname, policy, &keep);
            self.nft(&slot.ifname, &script)?;
        }
        state.installed = !allow_all;
        state.policy = Some(policy.clone());
        state.learned = learned;
        tracing::debug!(slot = %slot.ifname, mode = %policy.mode(), rules = policy.rules().len(), learned = keep.len(), "egress policy applied");
        if cut && !allow_all {
            self.cut_denied_connections(slot, &state)
        } else {
            Ok(())
        }
    }

    /// Sends the slot's HTTPS (TCP 443) to the node's credential proxy, and drops its QUIC
    /// (`on`); or ends both. Idempotent.
    pub fn route_https_to_credential_proxy(
        &self,
        slot: &SlotRef,
        on: bool,
    ) -> Result<(), EgressError> {
        self.check_slot(&slot.ifname)?;
        let entry = self.entry_for(slot)?;
        let mut state = lock(&entry.state);
        self.nft(
            &slot.ifname,
            &nft::credential_proxy_script(&self.table, &slot.ifname, on),
        )?;
        state.credential_proxy = on;
        Ok(())
    }

    /// Removes the slot's policy: its chain, set and map element, and its DNS registration.
    /// Idempotent. For a slot being destroyed: without a policy, the instance table lets
    /// the slot's traffic through (only the fixed denies apply), while DNS is refused.
    pub fn remove(&self, slot: &SlotRef) -> Result<(), EgressError> {
        self.check_slot(&slot.ifname)?;
        // Unregister first: from now on the slot's DNS is refused.
        let entry = {
            let mut slots = write(&self.slots);
            match slots.get(&slot.address) {
                Some(e) if e.ifname == slot.ifname => slots.remove(&slot.address),
                _ => None,
            }
        };
        // Wait for an apply or a DNS answer in progress on the slot.
        let state = entry.as_ref().map(|e| lock(&e.state));
        if state.as_ref().is_some_and(|s| s.installed) {
            self.nft(&slot.ifname, &nft::remove_script(&self.table, &slot.ifname))?;
        }
        if state.as_ref().is_some_and(|s| s.credential_proxy) {
            let script = nft::credential_proxy_script(&self.table, &slot.ifname, false);
            self.nft(&slot.ifname, &script)?;
        }
        tracing::debug!(slot = %slot.ifname, "egress policy removed");
        Ok(())
    }

    /// Deletes every connection tracking entry from or to the slot's address. For a slot
    /// being released, after [`EgressEnforcer::remove`] and once its veth is gone (no new
    /// flow of the address can start then): tracked flows outlive the veth, and an
    /// established one passes the instance table without meeting any policy, so the next
    /// sandbox given the address would inherit it.
    pub fn forget_connections(&self, slot: &SlotRef) -> Result<(), EgressError> {
        conntrack::forget_address(self.sys.as_ref(), slot.address).map_err(|source| {
            EgressError::Conntrack {
                ifname: slot.ifname.clone(),
                source,
            }
        })?;
        tracing::debug!(slot = %slot.ifname, address = %slot.address, "tracked connections forgotten");
        Ok(())
    }

    /// [`EgressEnforcer::forget_connections`] for every address of `net`: for an instance
    /// whose slots are all gone (its pool), so a later instance on the pool inherits no flow.
    pub fn forget_network_connections(&self, net: Ipv4Net) -> Result<(), EgressError> {
        conntrack::forget_network(self.sys.as_ref(), net).map_err(|source| EgressError::Conntrack {
            ifname: format!("{}-*", self.table),
            source,
        })
    }

    /// The policy in force for the slot with `address`, if one was applied.
    pub fn policy(&self, address: Ipv4Addr) -> Option<EgressPolicy> {
        let entry = read(&self.slots).get(&address).cloned()?;
        let state = lock(&entry.state);
        state.policy.clone()
    }

    /// The instance prefix (nft table name).
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The registry entry for `slot`, created (without a policy) if there is none.
    fn entry_for(&self, slot: &SlotRef) -> Result<Arc<SlotEntry>, EgressError> {
        let mut slots = write(&self.slots);
        let entry = slots.entry(slot.address).or_insert_with(|| {
            Arc::new(SlotEntry {
                ifname: slot.ifname.clone(),
                state: Mutex::default(),
            })
        });
        if entry.ifname != slot.ifname {
            return Err(EgressError::AddressInUse {
                address: slot.address,
                ifname: slot.ifname.clone(),
                other: entry.ifname.clone(),
            });
        }
        Ok(entry.clone())
    }

    fn check_slot(&self, ifname: &str) -> Result<(), EgressError> {
        // Only names the table's slot wildcard matches, which also keeps the name safe to
        // write into an nft script.
        if names::slot_index(&self.table, ifname).is_some() && ifname.len() <= names::MAX_IFNAME_LEN
        {
            Ok(())
        } else {
            Err(EgressError::NotASlot {
                ifname: ifname.to_owned(),
                table: self.table.clone(),
            })
        }
    }

    fn nft(&self, ifname: &str, script: &str) -> Result<(), EgressError> {
        if script.is_empty() {
            return Ok(());
        }
        self.sys
            .run("nft", &["-f", "-"], Some(script))
            .map(drop)
            .map_err(|source| EgressError::Nft {
                ifname: ifname.to_owned(),
                source,
            })
    }

    /// Deletes the conntrack entries of `slot` that its policy (in `state`) denies.
    fn cut_denied_connections(&self, slot: &SlotRef, state: &SlotState) -> Result<(), EgressError> {
        let conntrack_err = |source| EgressError::Conntrack {
            ifname: slot.ifname.clone(),
            source,
        };
        let policy = state
            .policy
            .as_ref()
            .expect("called after a successful apply");
        let now = Instant::now();
        let denied: BTreeSet<Ipv4Addr> = conntrack::flows_from(self.sys.as_ref(), slot.address)
            .map_err(conntrack_err)?
            .into_iter()
            .filter(|flow| !flow_allowed(policy, &state.learned, &self.reach, now, flow))
            .map(|flow| flow.dst)
            .collect();
        for dst in &denied {
            conntrack::delete(self.sys.as_ref(), slot.address, *dst).map_err(conntrack_err)?;
        }
        if !denied.is_empty() {
            tracing::debug!(slot = %slot.ifname, destinations = denied.len(), "connections cut by the new policy");
        }
        Ok(())
    }

    /// The slot entry of a DNS client, if it has one.
    fn entry_of(&self, client: IpAddr) -> Option<Arc<SlotEntry>> {
        let IpAddr::V4(v4) = client else {
            return None;
        };
        read(&self.slots).get(&v4).cloned()
    }
}

/// Whether a tracked connection may live on under `policy`: DNS is the forwarder's
/// business, DNS over TLS and the fixed private ranges outside `reach` never pass, the rest
/// as a new connection would be decided.
fn flow_allowed(
    policy: &EgressPolicy,
    learned: &LearnedAddresses,
    reach: &[Ipv4Net],
    now: Instant,
    flow: &Flow,
) -> bool {
    match flow.dport {
        Some(DNS_PORT) => true,
        Some(nft::DOT_PORT) if flow.proto == "tcp" || flow.proto == "udp" => false,
        _ if ranges::is_denied(flow.dst, reach) => false,
        _ => policy.allows_connection(flow.dst, learned.contains(now, flow.dst)),
    }
}

impl DnsHook for EgressEnforcer {
    fn on_query(&self, client: IpAddr, name: &str) -> QueryVerdict {
        let allowed = self.entry_of(client).is_some_and(|entry| {
            lock(&entry.state)
                .policy
                .as_ref()
                .is_some_and(|p| p.decide_name(name) == Action::Allow)
        });
        if allowed {
            QueryVerdict::Forward
        } else {
            QueryVerdict::Refuse
        }
    }

    fn on_answer(
        &self,
        client: IpAddr,
        name: &str,
        addresses: &[(Ipv4Addr, u32)],
    ) -> Result<AnswerVerdict, DnsHookError> {
        let not_allowed = || EgressError::AnswerNotAllowed {
            client,
            name: name.to_owned(),
        };
        let entry = self.entry_of(client).ok_or_else(not_allowed)?;
        let mut state = lock(&entry.state);
        let allowed = state
            .policy
            .as_ref()
            .is_some_and(|p| p.decide_name(name) == Action::Allow);
        if !allowed {
            return Err(not_allowed().into());
        }
        // DNS rebinding: an allowed name answered with an address the table never lets
        // through. The whole answer is withheld (a public address beside a private one is
        // the classic rebinding answer) and nothing of it is learned.
        let private: Vec<Ipv4Addr> = addresses
            .iter()
            .map(|(addr, _)| *addr)
            .filter(|addr| ranges::is_denied(*addr, &self.reach))
            .collect();
        if !private.is_empty() {
            tracing::info!(slot = %entry.ifname, %name, addresses = ?private, "dns answer withheld: it names private addresses");
            return Ok(AnswerVerdict::Withhold);
        }
        let now = Instant::now();
        let writes = state
            .learned
            .learn(now, name, addresses, nft::MAX_LEARNED)
            .map_err(|source| EgressError::LearnedSetFull {
                ifname: entry.ifname.clone(),
                source,
            })?;
        if !state.installed {
            // Allow-all: no set to write; the addresses are remembered for a later policy.
            return Ok(AnswerVerdict::Pass);
        }
        let script = nft::learn_script(&self.table, &entry.ifname, &writes);
        if let Err(e) = self.nft(&entry.ifname, &script) {
            state.learned.unwritten(now, &writes);
            return Err(e.into());
        }
        Ok(AnswerVerdict::Pass)
    }
}

fn lock(m: &Mutex<SlotState>) -> MutexGuard<'_, SlotState> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn read(slots: &RwLock<Slots>) -> std::sync::RwLockReadGuard<'_, Slots> {
    slots.read().unwrap_or_else(PoisonError::into_inner)
}

fn write(slots: &RwLock<Slots>) -> std::sync::RwLockWriteGuard<'_, Slots> {
    slots.write().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::policy::Rule;

    /// Records every command; every command succeeds (conntrack deletes nothing).
    #[derive(Default)]
    struct RecordingSys {
        calls: Mutex<Vec<String>>,
    }

    impl RecordingSys {
        fn calls(&self) -> Vec<String> {
            self.calls.lock().unwrap().clone()
        }
    }

    impl NetSys for RecordingSys {
        fn run(
            &self,
            program: &str,
            args: &[&str],
            stdin: Option<&str>,
        ) -> Result<String, NetError> {
            let mut call = format!("{program} {}", args.join(" "));
            if let Some(input) = stdin {
                call = format!("{call} <<{input}");
            }
            self.calls.lock().unwrap().push(call);
            Ok(String::new())
        }
        fn create_netns(&self, _: &str) -> Result<PathBuf, NetError> {
            unimplemented!()
        }
        fn remove_netns(&self, _: &str) -> Result<(), NetError> {
            unimplemented!()
        }
        fn netns_exists(&self, _: &str) -> bool {
            false
        }
        fn link_exists(&self, _: &str) -> bool {
            false
        }
        fn list_netns(&self) -> Result<Vec<String>, NetError> {
            Ok(Vec::new())
        }
        fn list_links(&self) -> Result<Vec<String>, NetError> {
            Ok(Vec::new())
        }
        fn write_sysctl(&self, _: &str, _: &str) -> Result<(), NetError> {
            Ok(())
        }
        fn read_sysctl(&self, _: &str) -> Result<String, NetError> {
            Ok(String::new())
        }
    }

    fn enforcer(reach: &[&str]) -> (Arc<RecordingSys>, EgressEnforcer, SlotRef) {
        let sys = Arc::new(RecordingSys::default());
        let reach = reach.iter().map(|r| r.parse().unwrap()).collect();
        let enforcer = EgressEnforcer::with_sys("fbu", sys.clone())
            .unwrap()
            .with_reach(reach);
        let slot = SlotRef {
            ifname: "fbu-3".into(),
            address: Ipv4Addr::new(10, 66, 0, 7),
        };
        (sys, enforcer, slot)
    }

    fn learn_calls(sys: &RecordingSys) -> Vec<String> {
        sys.calls()
            .into_iter()
            .filter(|c| c.contains("add element inet fbu learned_fbu-3"))
            .collect()
    }

    #[test]
    fn answers_naming_private_addresses_are_withheld_and_teach_nothing() {
        let (sys, enforcer, slot) = enforcer(&[]);
        let policy = EgressPolicy::from_pairs(
            Action::Deny,
            &[("allow", "rebind.test"), ("allow", "ok.test")],
        )
        .unwrap();
        enforcer.apply_to_new(&slot, &policy).unwrap();
        let client = IpAddr::from(slot.address);
        let public = (Ipv4Addr::new(198, 51, 100, 7), 300);
        for private in [
            [10, 200, 0, 1],
            [172, 16, 0, 1],
            [192, 168, 1, 1],
            [100, 64, 0, 1],
            [169, 254, 169, 254],
            [127, 0, 0, 1],
            [0, 0, 0, 0],
            [224, 0, 0, 1],
            [255, 255, 255, 255],
        ] {
            let private = (Ipv4Addr::from(private), 300);
            for answer in [vec![private], vec![public, private]] {
                assert_eq!(
                    enforcer.on_answer(client, "rebind.test", &answer).unwrap(),
                    AnswerVerdict::Withhold,
                    "{answer:?}"
                );
            }
        }
        assert!(learn_calls(&sys).is_empty(), "{:#?}", sys.calls());
        assert_eq!(
            enforcer.on_answer(client, "ok.test", &[public]).unwrap(),
            AnswerVerdict::Pass
        );
        assert_eq!(learn_calls(&sys).len(), 1, "{:#?}", sys.calls());
        assert!(learn_calls(&sys)[0].contains("198.51.100.7 timeout"));
        // A name the policy does not allow is still an error (SERVFAIL), private or not.
        assert!(
            enforcer
                .on_answer(client, "other.test", &[(Ipv4Addr::new(10, 0, 0, 1), 60)])
                .is_err()
        );
    }

    #[test]
    fn answers_inside_the_operators_reach_are_learned() {
        let (sys, enforcer, slot) = enforcer(&["10.200.0.0/24"]);
        let policy = EgressPolicy::from_pairs(Action::Deny, &[("allow", "db.test")]).unwrap();
        enforcer.apply_to_new(&slot, &policy).unwrap();
        let client = IpAddr::from(slot.address);
        let inside = (Ipv4Addr::new(10, 200, 0, 1), 60);
        assert_eq!(
            enforcer.on_answer(client, "db.test", &[inside]).unwrap(),
            AnswerVerdict::Pass
        );
        assert!(learn_calls(&sys)[0].contains("10.200.0.1 timeout"));
        let outside = (Ipv4Addr::new(10, 200, 1, 1), 60);
        assert_eq!(
            enforcer.on_answer(client, "db.test", &[outside]).unwrap(),
            AnswerVerdict::Withhold
        );
    }

    #[test]
    fn allow_all_slots_are_filtered_too() {
        let (_sys, enforcer, slot) = enforcer(&[]);
        enforcer
            .apply_to_new(&slot, &EgressPolicy::allow_all())
            .unwrap();
        let client = IpAddr::from(slot.address);
        assert_eq!(
            enforcer
                .on_answer(client, "any.test", &[(Ipv4Addr::new(192, 168, 0, 10), 60)])
                .unwrap(),
            AnswerVerdict::Withhold
        );
        assert_eq!(
            enforcer
                .on_answer(client, "any.test", &[(Ipv4Addr::new(203, 0, 113, 10), 60)])
                .unwrap(),
            AnswerVerdict::Pass
        );
    }

    #[test]
    fn forgetting_connections_deletes_both_directions_of_the_address() {
        let (sys, enforcer, slot) = enforcer(&[]);
        enforcer.forget_connections(&slot).unwrap();
        let calls = sys.calls();
        assert_eq!(
            &calls[calls.len() - 2..],
            [
                "conntrack -D -f ipv4 -s 10.66.0.7",
                "conntrack -D -f ipv4 -d 10.66.0.7"
            ]
        );
        enforcer
            .forget_network_connections("10.66.0.0/24".parse().unwrap())
            .unwrap();
        let calls = sys.calls();
        assert_eq!(
            &calls[calls.len() - 2..],
            [
                "conntrack -D -f ipv4 -s 10.66.0.0/24",
                "conntrack -D -f ipv4 -d 10.66.0.0/24"
            ]
        );
    }

    #[test]
    fn tracked_flows_to_private_ranges_never_live_on_unless_reached() {
        let now = Instant::now();
        let learned = LearnedAddresses::default();
        let open = EgressPolicy::allow_all();
        let explicit = EgressPolicy::try_new(
            Action::Deny,
            vec![Rule::parse(0, "allow", "10.200.0.1").unwrap()],
        )
        .unwrap();
        let reach: Vec<Ipv4Net> = vec!["10.200.0.0/24".parse().unwrap()];
        let to = |dst| flow("tcp", dst, Some(80));
        for policy in [&open, &explicit] {
            assert!(!flow_allowed(
                policy,
                &learned,
                &[],
                now,
                &to([10, 200, 0, 1])
            ));
            assert!(flow_allowed(
                policy,
                &learned,
                &reach,
                now,
                &to([10, 200, 0, 1])
            ));
        }
        assert!(!flow_allowed(
            &open,
            &learned,
            &reach,
            now,
            &to([10, 200, 1, 1])
        ));
        assert!(!flow_allowed(
            &open,
            &learned,
            &[],
            now,
            &to([169, 254, 169, 254])
        ));
        // Reach lifts the fixed deny only: the policy still decides.
        let deny = EgressPolicy::deny_all();
        assert!(!flow_allowed(
            &deny,
            &learned,
            &reach,
            now,
            &to([10, 200, 0, 1])
        ));
        // DNS to a private resolver is redirected to the forwarder: not a flow to cut.
        assert!(flow_allowed(
            &open,
            &learned,
            &[],
            now,
            &flow("udp", [10, 0, 0, 53], Some(53))
        ));
    }

    fn flow(proto: &str, dst: [u8; 4], dport: Option<u16>) -> Flow {
        Flow {
            proto: proto.into(),
            dst: Ipv4Addr::from(dst),
            dport,
        }
    }

    #[test]
    fn open_connections_live_on_only_where_a_new_one_would_pass() {
        let now = Instant::now();
        let mut learned = LearnedAddresses::default();
        learned
            .learn(now, "ok.test", &[(Ipv4Addr::new(192, 0, 2, 1), 60)], 10)
            .unwrap();
        let policy = EgressPolicy::try_new(
            Action::Deny,
            vec![
                Rule::parse(0, "allow", "ok.test").unwrap(),
                Rule::parse(1, "allow", "198.51.100.0/24").unwrap(),
            ],
        )
        .unwrap();
        let allowed = |f: &Flow| flow_allowed(&policy, &learned, &[], now, f);
        assert!(allowed(&flow("tcp", [192, 0, 2, 1], Some(443))), "learned");
        assert!(
            allowed(&flow("tcp", [198, 51, 100, 9], Some(22))),
            "address rule"
        );
        assert!(allowed(&flow("icmp", [198, 51, 100, 9], None)));
        assert!(!allowed(&flow("tcp", [192, 0, 2, 2], Some(443))), "default");
        assert!(
            allowed(&flow("udp", [192, 0, 2, 2], Some(53))),
            "dns is redirected"
        );
        assert!(!allowed(&flow("tcp", [192, 0, 2, 1], Some(853))), "dot");
        assert!(
            !allowed(&flow("udp", [198, 51, 100, 9], Some(853))),
            "dot over udp"
        );
        let open = EgressPolicy::allow_all();
        assert!(flow_allowed(
            &open,
            &learned,
            &[],
            now,
            &flow("tcp", [203, 0, 113, 1], Some(80))
        ));
        assert!(!flow_allowed(
            &open,
            &learned,
            &[],
            now,
            &flow("tcp", [203, 0, 113, 1], Some(853))
        ));
    }
}
