//! One contract, both backends: the embedded redb file and a real etcd (one member, and
//! three with the leader killed mid-writes).

use std::sync::Arc;
use std::time::{Duration, Instant};

use fastbox_state::{
    EtcdBackend, EtcdOptions, Guard, RedbBackend, StateBackend, StateError, StateUrl,
};
use fastbox_testkit::etcd::{EtcdCluster, etcd_unavailable};

fn conflict<T: std::fmt::Debug>(r: Result<T, StateError>) -> bool {
    matches!(r, Err(StateError::Conflict { .. }))
}

/// What every backend must do.
fn contract(store: &dyn StateBackend) {
    // Create, and only once.
    let r1 = store.put("sandboxes", "a", b"one", 0, None).unwrap();
    assert!(r1 > 0);
    assert!(conflict(store.put("sandboxes", "a", b"again", 0, None)));
    let got = store.get("sandboxes", "a").unwrap().unwrap();
    assert_eq!((got.value.as_slice(), got.revision), (&b"one"[..], r1));

    // Writes name the revision they replace.
    assert!(conflict(store.put(
        "sandboxes",
        "a",
        b"stale",
        r1 + 1000,
        None
    )));
    let r2 = store.put("sandboxes", "a", b"two", r1, None).unwrap();
    assert!(r2 > r1);
    assert!(conflict(store.put("sandboxes", "a", b"stale", r1, None)));
    assert_eq!(store.get("sandboxes", "a").unwrap().unwrap().value, b"two");

    // Any bytes.
    let bytes: Vec<u8> = (0..=255u8).collect();
    store.put("sandboxes", "b", &bytes, 0, None).unwrap();
    assert_eq!(store.get("sandboxes", "b").unwrap().unwrap().value, bytes);

    // Tables are apart, even when one's name starts another's.
    store.put("snap", "a", b"snap", 0, None).unwrap();
    store.put("snapshots", "x", b"x", 0, None).unwrap();
    let mut keys: Vec<String> = store
        .list("sandboxes")
        .unwrap()
        .into_iter()
        .map(|e| e.key)
        .collect();
    keys.sort();
    assert_eq!(keys, ["a", "b"]);
    let snap = store.list("snap").unwrap();
    assert_eq!(snap.len(), 1);
    assert_eq!(
        (snap[0].key.as_str(), snap[0].value.as_slice()),
        ("a", &b"snap"[..])
    );
    assert!(store.list("nothing-here").unwrap().is_empty());
    assert!(store.get("nothing-here", "a").unwrap().is_none());

    // Deletes too.
    assert!(conflict(store.delete("sandboxes", "a", r1, None)));
    store.delete("sandboxes", "a", r2, None).unwrap();
    assert!(store.get("sandboxes", "a").unwrap().is_none());
    assert!(conflict(store.delete("sandboxes", "a", r2, None)));
    store.delete("sandboxes", "never", 0, None).unwrap();
    assert!(conflict(store.delete("snap", "a", 0, None)), "it exists");
    // A record created again starts over from "absent".
    let r3 = store.put("sandboxes", "a", b"three", 0, None).unwrap();
    assert!(r3 > r2);

    // A create under a guard lands only while the guard's record is at its revision.
    let g1 = store.put("keys", "k", b"key", 0, None).unwrap();
    let guard = Guard {
        table: "keys".into(),
        key: "k".into(),
        revision: g1,
    };
    store.create_under("sandboxes", "c", b"c", &guard).unwrap();
    assert_eq!(store.get("sandboxes", "c").unwrap().unwrap().value, b"c");
    assert!(
        conflict(store.create_under("sandboxes", "c", b"again", &guard)),
        "it exists"
    );
    let g2 = store.put("keys", "k", b"changed", g1, None).unwrap();
    assert!(guard_failed(store.create_under(
        "sandboxes",
        "d",
        b"d",
        &guard
    )));
    store.delete("keys", "k", g2, None).unwrap();
    let gone = Guard {
        revision: g2,
        ..guard
    };
    assert!(guard_failed(store.create_under(
        "sandboxes",
        "d",
        b"d",
        &gone
    )));
    assert!(
        store.get("sandboxes", "d").unwrap().is_none(),
        "nothing landed"
    );

    // A removal under a guard at revision 0: only while the guard's record is absent.
    let g3 = store.put("keys", "k", b"again", 0, None).unwrap();
    let absent = Guard {
        table: "keys".into(),
        key: "k".into(),
        revision: 0,
    };
    let c = store.get("sandboxes", "c").unwrap().unwrap().revision;
    assert!(guard_failed(store.delete_under(
        "sandboxes",
        "c",
        c,
        &absent
    )));
    assert!(store.get("sandboxes", "c").unwrap().is_some(), "kept");
    store.delete("keys", "k", g3, None).unwrap();
    assert!(conflict(store.delete_under(
        "sandboxes",
        "c",
        c + 1000,
        &absent
    )));
    store.delete_under("sandboxes", "c", c, &absent).unwrap();
    assert!(store.get("sandboxes", "c").unwrap().is_none());
}

/// A conflict that names the guard's record, not the one created.
fn guard_failed<T: std::fmt::Debug>(r: Result<T, StateError>) -> bool {
    matches!(r, Err(StateError::Conflict { table, key, .. }) if table == "keys" && key == "k")
}

/// Writers racing on one record: a read-modify-write loop with compare-and-swap loses no
/// increment.
fn counter_race(store: Arc<dyn StateBackend>) {
    const WRITERS: usize = 4;
    const EACH: usize = 15;
    store.put("counters", "n", b"0", 0, None).unwrap();
    let threads: Vec<_> = (0..WRITERS)
        .map(|_| {
            let store = store.clone();
            std::thread::spawn(move || {
                let mut conflicts = 0;
                for _ in 0..EACH {
                    loop {
                        let e = store.get("counters", "n").unwrap().unwrap();
                        let n: usize = std::str::from_utf8(&e.value).unwrap().parse().unwrap();
                        match store.put(
                            "counters",
                            "n",
                            (n + 1).to_string().as_bytes(),
                            e.revision,
                            None,
                        ) {
                            Ok(_) => break,
                            Err(StateError::Conflict { .. }) => conflicts += 1,
                            Err(e) => panic!("{e}"),
                        }
                    }
                }
                conflicts
            })
        })
        .collect();
    let conflicts: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    let e = store.get("counters", "n").unwrap().unwrap();
    assert_eq!(e.value, (WRITERS * EACH).to_string().as_bytes());
    eprintln!(
        "{} increments, {conflicts} conflicts retried",
        WRITERS * EACH
    );
}

/// Many writers at once, on keys of their own and one shared: every write answers as it
/// would alone (etcd's backend commits concurrent writes together), with the revision the
/// record then has.
fn many_writers(store: Arc<dyn StateBackend>) {
    const WRITERS: usize = 8;
    const EACH: usize = 12;
    store.put("shared", "n", b"0", 0, None).unwrap();
    let threads: Vec<_> = (0..WRITERS)
        .map(|i| {
            let store = store.clone();
            std::thread::spawn(move || {
                for j in 0..EACH {
                    let key = format!("w{i}-{j}");
                    let created = store.put("own", &key, b"new", 0, None).unwrap();
                    assert!(conflict(store.put("own", &key, b"again", 0, None)));
                    let updated = store.put("own", &key, b"updated", created, None).unwrap();
                    assert!(updated > created);
                    assert_eq!(store.get("own", &key).unwrap().unwrap().revision, updated);
                    // A guarded create, its guard removed at once by another write.
                    let guard_key = format!("g{i}-{j}");
                    let g = store.put("guards", &guard_key, b"g", 0, None).unwrap();
                    let guard = Guard {
                        table: "guards".into(),
                        key: guard_key.clone(),
                        revision: g,
                    };
                    store
                        .create_under("guarded", &key, b"made", &guard)
                        .unwrap();
                    store.delete("guards", &guard_key, g, None).unwrap();
                    let late = store.create_under("guarded", &format!("{key}-late"), b"x", &guard);
                    assert!(
                        matches!(&late, Err(StateError::Conflict { table, .. }) if table == "guards"),
                        "{late:?}"
                    );
                    loop {
                        let e = store.get("shared", "n").unwrap().unwrap();
                        let n: usize = std::str::from_utf8(&e.value).unwrap().parse().unwrap();
                        match store.put("shared", "n", (n + 1).to_string().as_bytes(), e.revision, None) {
                            Ok(_) => break,
                            Err(StateError::Conflict { .. }) => continue,
                            Err(e) => panic!("{e}"),
                        }
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let own = store.list("own").unwrap();
    assert_eq!(own.len(), WRITERS * EACH);
    assert!(own.iter().all(|e| e.value == b"updated"));
    assert_eq!(store.list("guarded").unwrap().len(), WRITERS * EACH);
    assert!(store.list("guards").unwrap().is_empty());
    let n = store.get("shared", "n").unwrap().unwrap();
    assert_eq!(n.value, (WRITERS * EACH).to_string().as_bytes());
}

fn etcd_backend(etcd: &EtcdCluster, prefix: &str) -> EtcdBackend {
    let StateUrl::Etcd(target) =
        StateUrl::parse(&format!("{}/{prefix}", etcd.state_url())).unwrap()
    else {
        unreachable!()
    };
    EtcdBackend::connect(target, EtcdOptions::default()).expect("connect to etcd")
}

#[test]
fn redb_keeps_the_contract() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.redb");
    let store = RedbBackend::open(&path).unwrap();
    contract(&store);
    let store = Arc::new(store);
    counter_race(store.clone());
    many_writers(store.clone());
    drop(store);
    // Everything is still there after reopening, revisions included.
    let store = RedbBackend::open(&path).unwrap();
    let n = store.get("counters", "n").unwrap().unwrap();
    assert!(conflict(store.put(
        "counters",
        "n",
        b"x",
        n.revision - 1,
        None
    )));
    store.put("counters", "n", b"x", n.revision, None).unwrap();
}

#[test]
fn redb_records_written_before_revisions_read_as_revision_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.redb");
    {
        // What an earlier fastbox wrote: JSON by id, no revisions table.
        let db = redb::Database::create(&path).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let def: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("sandboxes");
            let mut t = txn.open_table(def).unwrap();
            t.insert("old", &br#"{"id":"old"}"#[..]).unwrap();
        }
        txn.commit().unwrap();
    }
    let store = RedbBackend::open(&path).unwrap();
    let old = store.list("sandboxes").unwrap();
    assert_eq!(old.len(), 1);
    assert_eq!(old[0].revision, 1);
    let next = store.put("sandboxes", "old", b"{}", 1, None).unwrap();
    assert!(next > 1);
}

#[test]
fn etcd_keeps_the_contract() {
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let etcd = EtcdCluster::start(1).expect("etcd starts");
    let store = etcd_backend(&etcd, "fbt-contract");
    assert!(
        store.describe().contains("/fbt-contract"),
        "{}",
        store.describe()
    );
    contract(&store);
    let store = Arc::new(store);
    counter_race(store.clone());
    let before = store.write_counts();
    many_writers(store.clone());
    let after = store.write_counts();
    let (writes, transactions) = (
        after.writes - before.writes,
        after.transactions - before.transactions,
    );
    eprintln!("{writes} concurrent writes in {transactions} transactions");
    assert!(transactions < writes, "concurrent writes went together");
    // Another prefix is another state.
    let other = etcd_backend(&etcd, "fbt-other");
    assert!(other.list("sandboxes").unwrap().is_empty());
}

#[test]
fn etcd_unreachable_is_unavailable_within_the_timeout() {
    // A port nothing listens on (bound, then closed).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let StateUrl::Etcd(target) = StateUrl::parse(&format!("etcd://127.0.0.1:{port}")).unwrap()
    else {
        unreachable!()
    };
    let options = EtcdOptions {
        timeout: Duration::from_millis(800),
        ..EtcdOptions::default()
    };
    let started = Instant::now();
    let error = EtcdBackend::connect(target, options)
        .err()
        .expect("refused");
    assert!(error.is_unavailable(), "{error}");
    assert!(error.to_string().contains(&port.to_string()), "{error}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn etcd_writes_ride_out_the_loss_of_the_leader() {
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let mut etcd = EtcdCluster::start(3).expect("etcd starts");
    let store = Arc::new(etcd_backend(&etcd, "fbt-leader"));
    let mut revision = store.put("sandboxes", "s", b"0", 0, None).unwrap();
    let leader = (0..100)
        .find_map(|_| {
            etcd.leader().or_else(|| {
                std::thread::sleep(Duration::from_millis(100));
                None
            })
        })
        .expect("a leader");
    // A writer goes on while the leader is killed: each write names the last revision,
    // and every one of them succeeds (after a stall of about one election).
    let writer = {
        let store = store.clone();
        std::thread::spawn(move || {
            let mut slowest = Duration::ZERO;
            for i in 1..=60u32 {
                let started = Instant::now();
                revision = store
                    .put("sandboxes", "s", i.to_string().as_bytes(), revision, None)
                    .unwrap_or_else(|e| panic!("write {i} failed: {e}"));
                slowest = slowest.max(started.elapsed());
                std::thread::sleep(Duration::from_millis(50));
            }
            slowest
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    etcd.kill(leader);
    let slowest = writer.join().expect("no write failed");
    eprintln!("the slowest write took {slowest:?} (leader m{leader} killed)");
    assert_eq!(store.get("sandboxes", "s").unwrap().unwrap().value, b"60");
}

#[test]
fn an_etcd_out_of_space_is_told_as_such_and_still_reads() {
    fastbox_testkit::skip_unless!(etcd_unavailable());
    // A quota of 2 MiB: a few large records fill it.
    let etcd = EtcdCluster::start_one_with(&["--quota-backend-bytes", "2097152"]).expect("etcd");
    let store = etcd_backend(&etcd, "fbt-full");
    let value = vec![b'x'; 512 * 1024];
    let mut full = None;
    for i in 0..40 {
        match store.put("sandboxes", &format!("s{i}"), &value, 0, None) {
            Ok(_) => {}
            Err(e) => {
                full = Some(e);
                break;
            }
        }
    }
    let full = full.expect("the quota ran out");
    assert!(matches!(full, StateError::Full(_)), "{full}");
    assert!(full.to_string().contains("etcdctl defrag"), "{full}");
    assert!(
        store.get("sandboxes", "s0").unwrap().is_some(),
        "reads go on"
    );
}
