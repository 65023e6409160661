//! Several servers sharing one state store (a real etcd) and one fake node: what one server
//! changes, the others see; one leads the reconcilers; when a server dies in the middle of
//! an operation, the leader finishes it; a leadership that passed on writes nothing more.
//!
//! Each server runs on a runtime of its own; dropping it (with its cluster rounds halted)
//! is a crash: every task it had in flight ends where it was.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{IMAGE, Server, fake, request, serve, until};
use fastbox_api::lifecycle::SandboxState;
use fastbox_node_api::NodeAgent;
use fastbox_node_api::testkit::{FakeNode, Verb};
use fastbox_server::config::Settings;
use fastbox_server::store::FENCE;
use fastbox_testkit::etcd::{EtcdCluster, etcd_unavailable};

#[test]
fn what_one_server_changes_the_other_sees_and_one_leads() {
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let etcd = EtcdCluster::start(1).expect("etcd");
    let node = fake();
    let a = Server::start("a", &etcd, "fbt-servers-1", std::slice::from_ref(&node));
    let b = Server::start("b", &etcd, "fbt-servers-1", std::slice::from_ref(&node));
    until("one leader", || {
        a.cluster.is_leader() != b.cluster.is_leader()
    });
    until("a sees b", || a.cluster.is_alive("b"));

    let id = a.create();
    until("running on a", || {
        a.state(&id) == Some(SandboxState::Running)
    });
    until("seen running on b", || {
        b.state(&id) == Some(SandboxState::Running)
    });
    let patch = serde_json::json!({"team": "blue"});
    b.lc.patch_metadata(&id, patch.as_object().unwrap().clone())
        .expect("patch on b");
    until("the patch seen on a", || {
        a.lc.get(&id)
            .ok()
            .and_then(|s| s.metadata)
            .is_some_and(|m| m.get("team").map(String::as_str) == Some("blue"))
    });
    // A change from a's stale copy is decided again on b's version, not written over it.
    let patch = serde_json::json!({"owner": "x"});
    a.lc.patch_metadata(&id, patch.as_object().unwrap().clone())
        .expect("patch on a");
    until("both patches on b", || {
        b.lc.get(&id)
            .ok()
            .and_then(|s| s.metadata)
            .is_some_and(|m| m.len() == 2)
    });

    b.delete(&id);
    until("terminated on a", || {
        a.state(&id) == Some(SandboxState::Terminated)
    });
    assert_eq!(node.count(Verb::Place), 1, "placed once");

    // One Idempotency-Key sent to both servers: one sandbox.
    let body = br#"{"image":{"uri":"registry.test/app:1"}}"#;
    let (on_a, replayed_a) = a
        .runtime
        .block_on(a.lc.create_once(request(), "retry-me", body))
        .expect("through a");
    let (on_b, replayed_b) = b
        .runtime
        .block_on(b.lc.create_once(request(), "retry-me", body))
        .expect("through b");
    assert_eq!(on_a.id, on_b.id);
    assert!(!replayed_a && replayed_b);
    assert_eq!(node.count(Verb::Place), 2, "placed once more");
    assert!(node.violations().is_empty(), "{:?}", node.violations());
    a.cluster.leave();
    b.cluster.leave();
}

#[test]
fn the_leader_finishes_what_a_dead_server_left_and_an_old_leader_writes_nothing() {
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let etcd = EtcdCluster::start(1).expect("etcd");
    let node = fake();
    let a = Server::start("a", &etcd, "fbt-servers-2", std::slice::from_ref(&node));
    until("a leads", || a.cluster.is_leader());
    let b = Server::start("b", &etcd, "fbt-servers-2", std::slice::from_ref(&node));
    let id = a.create();
    until("running", || b.state(&id) == Some(SandboxState::Running));

    // a deletes, and dies while its node call is held: the record stays Stopping, a's.
    node.hold(Verb::Remove);
    a.delete(&id);
    until("the removal held", || node.held(Verb::Remove) > 0);
    until("stopping on b", || {
        b.state(&id) == Some(SandboxState::Stopping)
    });
    let old_fence = a.cluster.fence().expect("a led");
    a.crash();
    let crashed = Instant::now();
    node.release(Verb::Remove);

    // b leads once a's lease ran out, and finishes the removal.
    let took = until("terminated through b", || {
        b.state(&id) == Some(SandboxState::Terminated)
    });
    assert!(b.cluster.is_leader());
    let events = b.lc.diagnostics_events(&id, "all").expect("events");
    assert!(format!("{events:?}").contains("TakenOver"), "{events:?}");
    eprintln!(
        "a crashed; b finished its removal {:?} later ({took:?} of waiting)",
        crashed.elapsed()
    );

    // A write under a's old leadership is refused.
    let other = b.create();
    until("running", || b.state(&other) == Some(SandboxState::Running));
    let patch = serde_json::json!({"late": "write"});
    let late = b.runtime.block_on(FENCE.scope(Some(old_fence), async {
        b.lc.patch_metadata(&other, patch.as_object().unwrap().clone())
    }));
    let error = late.expect_err("fenced");
    assert!(
        error.to_string().contains("no longer the leader"),
        "{error}"
    );
    b.cluster.leave();
}

#[test]
fn a_delete_during_a_pause_a_follower_drives_ends_the_sandbox() {
    delete_during_a_pause_of_b(false, "fbt-servers-5");
}

#[test]
fn a_delete_through_another_server_leaves_the_pause_to_its_server() {
    delete_during_a_pause_of_b(true, "fbt-servers-6");
}

/// b (a follower) pauses a sandbox, its node call held; the sandbox is deleted through b, or
/// through a (the leader) when `through_a`. Nothing is removed while the pause runs (two
/// servers never act on one sandbox at once); once it ends, b removes the sandbox, and the
/// pause's end never turns it back to `Paused`.
fn delete_during_a_pause_of_b(through_a: bool, prefix: &str) {
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let etcd = EtcdCluster::start(1).expect("etcd");
    let node = fake();
    let a = Server::start("a", &etcd, prefix, std::slice::from_ref(&node));
    until("a leads", || a.cluster.is_leader());
    let b = Server::start("b", &etcd, prefix, std::slice::from_ref(&node));
    until("a sees b", || a.cluster.is_alive("b"));
    let id = b.create();
    until("running", || b.state(&id) == Some(SandboxState::Running));
    until("seen running on a", || {
        a.state(&id) == Some(SandboxState::Running)
    });

    node.hold(Verb::Pause);
    {
        let _in_runtime = b.runtime.enter();
        b.lc.pause(&id).expect("pause");
    }
    until("the pause held", || node.held(Verb::Pause) > 0);
    let deleter = if through_a { &a } else { &b };
    until("pausing where it is deleted", || {
        deleter.state(&id) == Some(SandboxState::Pausing)
    });
    deleter.delete(&id);
    until("stopping on a", || {
        a.state(&id) == Some(SandboxState::Stopping)
    });
    // A few reconciler ticks (200 ms here) while the pause is held: nobody removes.
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(node.count(Verb::Remove), 0, "removed during the pause");
    node.release(Verb::Pause);

    until("terminated", || {
        a.state(&id) == Some(SandboxState::Terminated)
    });
    assert!(!b.cluster.is_leader());
    let events = format!("{:?}", a.lc.diagnostics_events(&id, "all").expect("events"));
    assert!(!events.contains("Paused:"), "{events}");
    assert!(!events.contains("TakenOver"), "b lived: {events}");
    assert_eq!(node.count(Verb::Remove), 1, "{events}");
    assert!(node.violations().is_empty(), "{:?}", node.violations());
    a.cluster.leave();
    b.cluster.leave();
}

/// The failover figures of the closing notes (`--ignored`, about two minutes): 20 times, the
/// leader dies while its removal of a sandbox waits on the node; reported are how long the
/// reconcilers had no leader, and how long until the new leader finished the removal, as
/// p50/p99. Nothing is asserted about the times.
#[test]
#[ignore = "a measurement: run with --ignored --nocapture"]
fn failover_figures() {
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let etcd = EtcdCluster::start(3).expect("etcd");
    let node = fake();
    let prefix = "fbt-failover";
    let mut leader = Server::start("s0", &etcd, prefix, std::slice::from_ref(&node));
    until("s0 leads", || leader.cluster.is_leader());
    let mut follower = Server::start("s1", &etcd, prefix, std::slice::from_ref(&node));
    let (mut gaps, mut takeovers) = (Vec::new(), Vec::new());
    for round in 0..20 {
        let id = leader.create();
        until("running", || {
            follower.state(&id) == Some(SandboxState::Running)
        });
        node.hold(Verb::Remove);
        leader.delete(&id);
        until("held", || node.held(Verb::Remove) > 0);
        until("stopping", || {
            follower.state(&id) == Some(SandboxState::Stopping)
        });
        leader.crash();
        let crashed = Instant::now();
        node.release(Verb::Remove);
        until("a new leader", || follower.cluster.is_leader());
        gaps.push(crashed.elapsed());
        until("taken over", || {
            follower.state(&id) == Some(SandboxState::Terminated)
        });
        takeovers.push(crashed.elapsed());
        eprintln!(
            "round {round}: leader after {:?}, removal finished after {:?}",
            gaps[round], takeovers[round]
        );
        // The follower leads; a new server joins as the next round's follower.
        leader = follower;
        follower = Server::start(
            &format!("s{}", round + 2),
            &etcd,
            prefix,
            std::slice::from_ref(&node),
        );
    }
    let pct = |v: &mut Vec<Duration>, p: f64| {
        v.sort();
        v[((v.len() as f64 - 1.0) * p).round() as usize]
    };
    eprintln!(
        "failover over 20 kills, 4 s leases, 3 etcd members: no leader p50 {:?} p99 {:?}; \
         the dead leader's removal finished p50 {:?} p99 {:?}",
        pct(&mut gaps, 0.5),
        pct(&mut gaps, 0.99),
        pct(&mut takeovers, 0.5),
        pct(&mut takeovers, 0.99)
    );
}

#[test]
fn a_node_registered_with_one_server_is_reached_and_kept_alive_by_every_server() {
    use fastbox_node_api::membership::Heartbeat;
    use fastbox_node_api::remote::{ControlClient, Credential, control_router};
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let etcd = EtcdCluster::start(1).expect("etcd");
    let local = fake();
    let leases = |s: &mut Settings| s.node_lease_ms = Some(2_000);
    let a = Server::start_with(
        "a",
        &etcd,
        "fbt-servers-3",
        std::slice::from_ref(&local),
        leases,
    );
    until("a leads", || a.cluster.is_leader());
    let b = Server::start_with(
        "b",
        &etcd,
        "fbt-servers-3",
        std::slice::from_ref(&local),
        leases,
    );
    let join = Credential::generate().unwrap();
    let mut controls = Vec::new();
    for server in [&a, &b] {
        server.lc.set_join_token(Some(join.clone()));
        let lc = server.lc.clone();
        controls.push(serve(
            &server.runtime,
            control_router(lc.clone(), lc.clone(), lc),
        ));
    }

    // n1 registers with a, and serves its node API.
    let n1 = Arc::new(FakeNode::new(4).with_node_id("n1").with_image(IMAGE));
    let registered = register_and_serve(&a, &controls[0], &n1, &join);

    // b reaches it: a create through b lands there.
    until("b knows n1", || {
        b.lc.list_nodes().iter().any(|n| n.id == "n1")
    });
    let on_n1 = (0..8)
        .find_map(|_| {
            let id = b.create();
            until("running", || b.state(&id) == Some(SandboxState::Running));
            if n1.sandbox(&id).is_some() {
                return Some(id);
            }
            b.delete(&id);
            None
        })
        .expect("a create through b on n1");

    // n1 heartbeats to b only: a (the leader) keeps it alive too.
    let to_b =
        ControlClient::new(&controls[1], registered.node_to_server.parse().unwrap()).unwrap();
    let beat = |client: &ControlClient| {
        b.runtime.block_on(async {
            client
                .heartbeat(&Heartbeat {
                    status: n1.status().await,
                    route_keys_sha256: None,
                })
                .await
        })
    };
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(6) {
        beat(&to_b).expect("b renews");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        a.state(&on_n1),
        Some(SandboxState::Running),
        "not lost on a"
    );
    assert!(a.cluster.is_leader());

    // Heartbeats to either server (a first); a dies: they go on through b, which leads,
    // and the node is never lost.
    let either = ControlClient::new(
        &format!("{},{}", controls[0], controls[1]),
        registered.node_to_server.parse().unwrap(),
    )
    .unwrap();
    beat(&either).expect("a renews");
    a.crash();
    let crashed = Instant::now();
    while crashed.elapsed() < Duration::from_secs(10) {
        beat(&either).expect("b renews once a is gone");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(b.cluster.is_leader());
    assert_eq!(b.state(&on_n1), Some(SandboxState::Running), "not lost");

    // No heartbeat to anyone: once its lease in the store ran out, the leader declares it
    // lost.
    let silent = Instant::now();
    until("NODE_LOST", || {
        b.lc.get(&on_n1)
            .is_ok_and(|s| s.status.reason.as_deref() == Some("NODE_LOST"))
    });
    eprintln!(
        "declared lost {:?} after its last heartbeat",
        silent.elapsed()
    );

    // It heartbeats again: told its loss.
    let renewal = beat(&either).expect("renewed");
    assert_eq!(renewal.losses, 1);
    b.cluster.leave();
}

/// A node asks a server about a sandbox another server created a moment ago, before the
/// store's watch brought it to this server's cache: the server reads the store and answers
/// (a node proxy's 404 right after a create that answered, otherwise).
#[test]
fn a_server_that_has_not_heard_of_a_new_sandbox_yet_answers_its_node_from_the_store() {
    use fastbox_node_api::membership::ControlPlane;
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let etcd = EtcdCluster::start(1).expect("etcd");
    let node = fake();
    let a = Server::start("a", &etcd, "fbt-servers-holds", std::slice::from_ref(&node));
    let lagging =
        Server::start_unfollowing("b", &etcd, "fbt-servers-holds", std::slice::from_ref(&node));
    let id = a.create();
    until("running on a", || {
        a.state(&id) == Some(SandboxState::Running)
    });
    let node_id = node.node_id().to_string();
    assert!(
        lagging.lc.holds(&node_id, &id),
        "the node holds the sandbox its record names"
    );
    assert!(!lagging.lc.holds("another-node", &id));
    assert!(!lagging.lc.holds(&node_id, "no-such-sandbox"));
    a.cluster.leave();
    lagging.cluster.leave();
}

/// Node `fake` registers through the control API at `control`, presenting `credential` (the
/// join token, or its own to register again), and serves its node API on `server`'s runtime
/// with the credential the answer brings.
fn register_and_serve(
    server: &Server,
    control: &str,
    fake: &Arc<FakeNode>,
    credential: &fastbox_node_api::remote::Credential,
) -> fastbox_node_api::membership::Registered {
    use fastbox_node_api::remote::{ControlClient, node_router};
    // The node API listens before the registration names it (the credential comes with the
    // answer): a listener first, the router once registered.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let registered = server
        .runtime
        .block_on(ControlClient::register(
            control,
            None,
            credential,
            &fake.registration(url),
        ))
        .expect("registered");
    let router = node_router(fake.clone(), registered.server_to_node.parse().unwrap());
    listener.set_nonblocking(true).unwrap();
    server.runtime.spawn(async move {
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        axum::serve(listener, router.into_make_service())
            .await
            .unwrap();
    });
    registered
}

/// Node n1 registers again with the leader while a create through another server waits on
/// it: the leader leaves that create to its server (it is neither placed twice nor undone),
/// and the create ends running there. A node that registered a moment ago seen again through
/// the store's watch was this case's usual cause: a ping right after the create got a 404.
#[test]
fn a_create_another_server_has_in_flight_on_a_node_that_registers_again_is_left_to_it() {
    use fastbox_node_api::remote::{Credential, control_router};
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let etcd = EtcdCluster::start(1).expect("etcd");
    const PREFIX: &str = "fbt-servers-rejoin";
    let local = fake();
    let a = Server::start("a", &etcd, PREFIX, std::slice::from_ref(&local));
    until("a leads", || a.cluster.is_leader());
    // (b's create comes before a's next round has seen b: a asks the store whether b is gone.)
    let b = Server::start("b", &etcd, PREFIX, std::slice::from_ref(&local));
    let join = Credential::generate().unwrap();
    a.lc.set_join_token(Some(join.clone()));
    let lc = a.lc.clone();
    let control = serve(&a.runtime, control_router(lc.clone(), lc.clone(), lc));
    let n1 = Arc::new(FakeNode::new(4).with_node_id("n1").with_image(IMAGE));
    let registered = register_and_serve(&a, &control, &n1, &join);
    until("b knows n1", || {
        b.lc.list_nodes().iter().any(|n| n.id == "n1")
    });

    // A create through b whose start waits on n1 (the others land on the local node).
    n1.hold(Verb::Place);
    let id = (0..16)
        .find_map(|_| {
            let id = b.create();
            until("placed", || {
                n1.held(Verb::Place) > 0 || b.state(&id) == Some(SandboxState::Running)
            });
            (n1.held(Verb::Place) > 0).then_some(id)
        })
        .expect("a create through b on n1");
    until("pending on a", || {
        a.state(&id) == Some(SandboxState::Pending)
    });

    // n1 registers again with a, with its own credential; a's reconciler (every 200 ms)
    // takes its sandboxes back.
    let own: Credential = registered.node_to_server.parse().unwrap();
    register_and_serve(&a, &control, &n1, &own);
    std::thread::sleep(Duration::from_millis(1500));
    let about_it: Vec<_> = n1
        .calls()
        .into_iter()
        .filter(|c| c.id.as_deref() == Some(id.as_str()))
        .collect();
    assert!(
        about_it.iter().all(|c| c.verb == Verb::Place) && about_it.len() == 1,
        "the create through b was acted on by a: {about_it:?}\n{:?}",
        a.lc.diagnostics_events(&id, "all")
    );

    // b's start goes on, and the sandbox runs on n1, for both servers.
    n1.release(Verb::Place);
    until("running through b", || {
        b.state(&id) == Some(SandboxState::Running)
    });
    until("running on a", || {
        a.state(&id) == Some(SandboxState::Running)
    });
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(a.state(&id), Some(SandboxState::Running));
    assert!(n1.sandbox(&id).is_some(), "{:?}", n1.calls());
    assert!(n1.violations().is_empty(), "{:?}", n1.violations());
    a.cluster.leave();
    b.cluster.leave();
}

/// One etcd and one fake node, servers `first` then `second` on them (the first leads),
/// and a sandbox created through a, running and seen so by b.
struct TwoServers {
    etcd: EtcdCluster,
    node: Arc<FakeNode>,
    a: Server,
    b: Server,
    id: String,
}

impl TwoServers {
    fn start(prefix: &str, b_leads: bool) -> Self {
        let etcd = EtcdCluster::start(1).expect("etcd");
        let node = fake();
        let start = |id: &str| Server::start(id, &etcd, prefix, std::slice::from_ref(&node));
        let (a, b) = match b_leads {
            false => {
                let a = start("a");
                until("a leads", || a.cluster.is_leader());
                (a, start("b"))
            }
            true => {
                let b = start("b");
                until("b leads", || b.cluster.is_leader());
                (start("a"), b)
            }
        };
        let id = a.create();
        until("running, seen by b", || {
            b.state(&id) == Some(SandboxState::Running)
        });
        TwoServers {
            etcd,
            node,
            a,
            b,
            id,
        }
    }

    /// A snapshot of the sandbox through a, its dump held at the node; its id.
    fn snapshot_held_by_a(&self) -> String {
        self.node.hold(Verb::StageSnapshot);
        let snapshot = {
            let _in_runtime = self.a.runtime.enter();
            self.a
                .lc
                .create_snapshot(&self.id, None)
                .expect("snapshot")
                .id
        };
        until("the dump at the node", || {
            self.node.held(Verb::StageSnapshot) == 1
        });
        until("b sees it", || self.b.lc.get_snapshot(&snapshot).is_ok());
        snapshot
    }
}

/// Whether `server` has snapshot `id` ready.
fn snapshot_ready(server: &Server, id: &str) -> bool {
    use fastbox_api::snapshots::SnapshotState;
    server
        .lc
        .get_snapshot(id)
        .is_ok_and(|s| s.status.state == SnapshotState::Ready)
}

/// Two egress policy changes of one sandbox, through two servers at once, both computed
/// from the same recorded policy: the second to be recorded is computed again on the first,
/// so both land, and the policy in force on the node is the one recorded.
#[test]
fn policy_changes_through_two_servers_at_once_both_land() {
    use fastbox_api::lifecycle::NetworkRule;
    use fastbox_node_api::control::PolicyChange;
    fastbox_testkit::skip_unless!(etcd_unavailable());
    // (`etcd` bound: it stops once dropped.)
    let TwoServers {
        etcd: _etcd,
        node,
        a,
        b,
        id,
    } = TwoServers::start("fbt-servers-policy", false);
    let deny = |target: &str| {
        PolicyChange::Patch(vec![NetworkRule {
            action: "deny".into(),
            target: target.into(),
        }])
    };
    node.hold(Verb::SetEgressPolicy);
    let through = |server: &Server, target: &str| {
        let (lc, id, change) = (server.lc.clone(), id.clone(), deny(target));
        server
            .runtime
            .spawn(async move { lc.change_network_policy(id, change).await })
    };
    let on_a = through(&a, "a.example.test");
    until("a's change at the node", || {
        node.held(Verb::SetEgressPolicy) == 1
    });
    let on_b = through(&b, "b.example.test");
    until("both at the node", || node.held(Verb::SetEgressPolicy) == 2);
    node.release(Verb::SetEgressPolicy);
    a.runtime.block_on(on_a).unwrap().expect("a's change");
    b.runtime.block_on(on_b).unwrap().expect("b's change");

    let targets = |server: &Server| -> Vec<String> {
        let policy = server.lc.network_policy(&id).unwrap().policy.unwrap();
        let mut targets: Vec<String> = policy
            .egress
            .into_iter()
            .flatten()
            .map(|r| r.target)
            .collect();
        targets.sort();
        targets
    };
    until("both rules recorded, seen by both servers", || {
        targets(&a) == ["a.example.test", "b.example.test"]
            && targets(&b) == ["a.example.test", "b.example.test"]
    });
    let in_force = node.sandbox(&id).expect("on the node").policy.to_wire();
    assert_eq!(
        Some(in_force),
        a.lc.network_policy(&id).unwrap().policy,
        "the node runs what is recorded"
    );
    a.cluster.leave();
    b.cluster.leave();
}

/// A server starts while another takes a snapshot: its recovery of interrupted snapshots
/// leaves that one to the server taking it (it neither discards the node's dump nor takes
/// it again), and the snapshot ends `Ready`.
#[test]
fn a_server_that_starts_leaves_a_snapshot_another_server_takes_to_it() {
    fastbox_testkit::skip_unless!(etcd_unavailable());
    const PREFIX: &str = "fbt-servers-snapshot";
    let two = TwoServers::start(PREFIX, false);
    let snapshot = two.snapshot_held_by_a();

    // c starts meanwhile, and recovers what its start recovers.
    let c = Server::start("c", &two.etcd, PREFIX, std::slice::from_ref(&two.node));
    until("c sees the snapshot", || {
        c.lc.get_snapshot(&snapshot).is_ok()
    });
    c.runtime.block_on(c.lc.recover_snapshots());
    for verb in [Verb::DiscardInterruptedSnapshot, Verb::HasSnapshot] {
        assert!(
            two.node.calls_of(verb).is_empty(),
            "{verb:?}: c recovered a's snapshot in flight: {:?}",
            two.node.calls()
        );
    }
    assert_eq!(
        two.node.calls_of(Verb::StageSnapshot).len(),
        1,
        "taken once"
    );

    two.node.release(Verb::StageSnapshot);
    until("ready, seen by c", || snapshot_ready(&c, &snapshot));
    for server in [&two.a, &two.b, &c] {
        server.cluster.leave();
    }
}

/// The server taking a snapshot dies: the leader takes the snapshot over once the store says
/// that server is gone, and takes it again from the source, which still runs.
#[test]
fn the_leader_takes_over_a_snapshot_of_a_server_that_died() {
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let two = TwoServers::start("fbt-servers-snapshot-gone", true);
    let snapshot = two.snapshot_held_by_a();
    let TwoServers {
        etcd: _etcd,
        node,
        a,
        b,
        ..
    } = two;
    a.crash();
    let crashed = Instant::now();
    // (Released once b took it over: a's dump, cut by the crash, never goes on.)
    until("b took it over", || {
        !node.calls_of(Verb::DiscardInterruptedSnapshot).is_empty()
    });
    node.release(Verb::StageSnapshot);
    while !snapshot_ready(&b, &snapshot) {
        assert!(
            crashed.elapsed() < Duration::from_secs(30),
            "not ready through b: {:?}\n{:?}",
            b.lc.get_snapshot(&snapshot),
            node.calls()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!(
        "a crashed; b took its snapshot over and it was ready {:?} later",
        crashed.elapsed()
    );
    b.cluster.leave();
}

/// A pause through one server while another takes a snapshot of the sandbox is refused as
/// busy (as it is through the server taking it), and goes once the snapshot is taken.
#[test]
fn a_pause_through_another_server_waits_for_a_snapshot_in_flight() {
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let two = TwoServers::start("fbt-servers-snapshot-busy", false);
    let snapshot = two.snapshot_held_by_a();
    let TwoServers {
        etcd: _etcd,
        node,
        a,
        b,
        id,
    } = two;
    let pause = || {
        let _in_runtime = b.runtime.enter();
        b.lc.pause(&id)
    };
    let refused = pause().expect_err("busy");
    assert!(refused.to_string().contains("busy"), "{refused}");
    assert!(node.calls_of(Verb::Pause).is_empty(), "{:?}", node.calls());

    node.release(Verb::StageSnapshot);
    until("ready, seen by b", || snapshot_ready(&b, &snapshot));
    pause().expect("paused once the snapshot is taken");
    until("paused", || b.state(&id) == Some(SandboxState::Paused));
    a.cluster.leave();
    b.cluster.leave();
}
