//! What servers sharing an etcd coordinate with, against a real etcd: the watch sees every
//! change in order (also after the member it follows is killed), a claim has one holder and
//! goes with its lease, and a fenced write lands only while its leadership holds.

use std::time::{Duration, Instant};

use fastbox_state::{
    Coordinator, EtcdBackend, EtcdOptions, Fence, SealKey, SealedBackend, StateBackend, StateError,
    StateUrl, WatchEvent,
};
use fastbox_testkit::etcd::{EtcdCluster, etcd_unavailable};

fn backend(etcd: &EtcdCluster, prefix: &str) -> EtcdBackend {
    let StateUrl::Etcd(target) =
        StateUrl::parse(&format!("{}/{prefix}", etcd.state_url())).unwrap()
    else {
        unreachable!()
    };
    EtcdBackend::connect(target, EtcdOptions::default()).expect("connect")
}

/// The watch's next event, waiting up to 20 s.
fn next(watch: &fastbox_state::Watch) -> WatchEvent {
    watch
        .next(Duration::from_secs(20))
        .expect("an event within 20 s")
}

#[test]
fn the_watch_delivers_every_change_in_order_and_follows_a_killed_member() {
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let mut etcd = EtcdCluster::start(3).expect("etcd starts");
    let store = backend(&etcd, "fbt-watch");
    let from = store.revision().unwrap() + 1;
    let watch = store.watch(from).unwrap().expect("etcd watches");

    let r1 = store.put("sandboxes", "a", b"1", 0, None).unwrap();
    let r2 = store.put("sandboxes", "a", b"2", r1, None).unwrap();
    store.delete("sandboxes", "a", r2, None).unwrap();
    // Another prefix is not seen.
    backend(&etcd, "fbt-other")
        .put("sandboxes", "x", b"x", 0, None)
        .unwrap();
    let r4 = store
        .put("templates", "t/with/slashes", b"t", 0, None)
        .unwrap();

    let put = |table: &str, key: &str, value: &[u8], revision| WatchEvent::Put {
        table: table.into(),
        entry: fastbox_state::Entry {
            key: key.into(),
            value: value.to_vec(),
            revision,
        },
    };
    assert_eq!(next(&watch), put("sandboxes", "a", b"1", r1));
    assert_eq!(next(&watch), put("sandboxes", "a", b"2", r2));
    assert!(
        matches!(next(&watch), WatchEvent::Delete { table, key, revision }
            if table == "sandboxes" && key == "a" && revision > r2)
    );
    assert_eq!(next(&watch), put("templates", "t/with/slashes", b"t", r4));

    // Every member killed in turn (one at a time): the watch goes on through the others and
    // misses nothing.
    let mut revision = 0;
    for member in 0..3 {
        etcd.kill(member);
        let deadline = Instant::now() + Duration::from_secs(30);
        let written = loop {
            match store.put(
                "sandboxes",
                "b",
                member.to_string().as_bytes(),
                revision,
                None,
            ) {
                Ok(r) => break r,
                Err(e) => assert!(Instant::now() < deadline, "no write: {e}"),
            }
        };
        revision = written;
        match next(&watch) {
            WatchEvent::Put { entry, .. } => {
                assert_eq!(entry.value, member.to_string().as_bytes());
                assert_eq!(entry.revision, written);
            }
            other => panic!("{other:?}"),
        }
        etcd.restart(member).expect("the member is back");
    }
}

#[test]
fn a_sealed_watch_opens_records_and_leaves_claims_alone() {
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let etcd = EtcdCluster::start(1).expect("etcd starts");
    let sealed = SealedBackend::new(backend(&etcd, "fbt-sealed"), SealKey::from_bytes(&[3; 32]));
    let from = sealed.coordinator().unwrap().revision().unwrap() + 1;
    let watch = sealed.watch(from).unwrap().expect("a watch");
    sealed.put("sandboxes", "s", b"secret", 0, None).unwrap();
    let coordinator = sealed.coordinator().unwrap();
    let lease = coordinator.grant(Duration::from_secs(5)).unwrap();
    coordinator.claim("servers/one", b"here", lease).unwrap();
    match next(&watch) {
        WatchEvent::Put { table, entry } => {
            assert_eq!(
                (table.as_str(), entry.value.as_slice()),
                ("sandboxes", &b"secret"[..])
            );
        }
        other => panic!("{other:?}"),
    }
    match next(&watch) {
        WatchEvent::Put { table, entry } => {
            assert_eq!(table, fastbox_state::CLUSTER_TABLE);
            assert_eq!(
                (entry.key.as_str(), entry.value.as_slice()),
                ("servers/one", &b"here"[..])
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_claim_has_one_holder_and_goes_with_its_lease() {
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let etcd = EtcdCluster::start(1).expect("etcd starts");
    let store = backend(&etcd, "fbt-claims");
    let c: &dyn Coordinator = store.coordinator().unwrap();
    let (a, b) = (
        c.grant(Duration::from_secs(2)).unwrap(),
        c.grant(Duration::from_secs(30)).unwrap(),
    );
    let first = c.claim("leader", b"a", a).unwrap();
    assert_eq!((first.value.as_slice(), first.lease), (&b"a"[..], a));
    let second = c.claim("leader", b"b", b).unwrap();
    assert_eq!(second, first, "the first holder keeps it");
    assert_eq!(c.claims("lead").unwrap().len(), 1);
    assert!(c.keep_alive(a).unwrap());

    // A fenced write lands while the leadership holds.
    let fence = Fence {
        name: "leader".into(),
        token: first.created,
    };
    let r = store.put("sandboxes", "s", b"1", 0, Some(&fence)).unwrap();
    // Not renewed, the lease runs out and the claim goes; another takes it.
    let deadline = Instant::now() + Duration::from_secs(10);
    let taken = loop {
        let holder = c.claim("leader", b"b", b).unwrap();
        if holder.lease == b {
            break holder;
        }
        assert!(Instant::now() < deadline, "the claim outlived its lease");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(taken.created > first.created);
    assert!(!c.keep_alive(a).unwrap(), "the lease is gone");
    // The old leader's fenced writes are refused as such; a conflict is told apart.
    let refused = store.put("sandboxes", "s", b"2", r, Some(&fence));
    assert!(
        matches!(refused, Err(StateError::Fenced { .. })),
        "{refused:?}"
    );
    let new_fence = Fence {
        name: "leader".into(),
        token: taken.created,
    };
    let conflict = store.put("sandboxes", "s", b"2", r + 1000, Some(&new_fence));
    assert!(
        matches!(conflict, Err(StateError::Conflict { .. })),
        "{conflict:?}"
    );
    store
        .put("sandboxes", "s", b"2", r, Some(&new_fence))
        .unwrap();
    // Revoking ends the claim at once.
    c.revoke(b).unwrap();
    assert!(c.claims("leader").unwrap().is_empty());
    c.revoke(b).unwrap();
}

#[test]
fn a_watch_from_compacted_history_starts_over_with_a_reset() {
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let etcd = EtcdCluster::start(1).expect("etcd starts");
    let store = backend(&etcd, "fbt-compact");
    let first = store.put("sandboxes", "a", b"1", 0, None).unwrap();
    let second = store.put("sandboxes", "a", b"2", first, None).unwrap();
    let c = store.coordinator().unwrap();
    c.compact(second).unwrap();
    c.compact(second).unwrap(); // again: nothing to do, no error
    let watch = store.watch(first).unwrap().expect("a watch");
    assert_eq!(next(&watch), WatchEvent::Reset);
    // And it goes on from the oldest revision etcd still has (the version at the
    // compaction may come again: applying it twice changes nothing).
    let third = store.put("sandboxes", "a", b"3", second, None).unwrap();
    loop {
        match next(&watch) {
            WatchEvent::Put { entry, .. } if entry.revision == third => break,
            WatchEvent::Put { entry, .. } => assert!(entry.revision >= second, "{entry:?}"),
            other => panic!("{other:?}"),
        }
    }
}
