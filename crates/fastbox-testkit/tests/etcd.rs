//! The etcd test clusters (`fastbox_testkit::etcd`) against the real etcd: one member, and
//! three that keep serving writes with one killed and catch it up when it returns.

use std::time::{Duration, Instant};

use fastbox_testkit::etcd::{EtcdCluster, etcd_unavailable};

/// base64 of "fbt-key" and of "one", "two".
const KEY: &str = "ZmJ0LWtleQ==";
const ONE: &str = "b25l";
const TWO: &str = "dHdv";

#[test]
fn one_member_serves_reads_and_writes() {
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let etcd = EtcdCluster::start(1).expect("etcd starts");
    assert_eq!(etcd.endpoints().len(), 1);
    etcd.put(0, KEY, ONE).expect("put");
    let got = etcd.get(0, KEY).expect("get");
    assert!(got.contains(&format!(r#""value":"{ONE}""#)), "{got}");
}

#[test]
fn three_members_survive_the_loss_of_one() {
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let mut etcd = EtcdCluster::start(3).expect("etcd starts");
    let endpoints = etcd.endpoints();
    assert_eq!(endpoints.len(), 3);
    assert_eq!(
        endpoints
            .iter()
            .collect::<std::collections::BTreeSet<_>>()
            .len(),
        3,
        "{endpoints:?}"
    );
    etcd.put(0, KEY, ONE).expect("put");
    let got = etcd.get(2, KEY).expect("a read through another member");
    assert!(got.contains(ONE), "{got}");

    // One member killed: the other two are a quorum, writes go on (after an election, when
    // it was the leader: a stall of about one election timeout, 2.5 s).
    etcd.kill(0);
    let killed = Instant::now();
    loop {
        match etcd.put(1, KEY, TWO) {
            Ok(_) => break,
            Err(e) => assert!(
                killed.elapsed() < Duration::from_secs(30),
                "no write within 30 s of the kill: {e}"
            ),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("writes stalled {:?} after the kill", killed.elapsed());
    let got = etcd.get(2, KEY).expect("get");
    assert!(got.contains(TWO), "{got}");
    assert!(etcd.get(0, KEY).is_err(), "a killed member answers nothing");

    // It comes back and catches up.
    etcd.restart(0).expect("the member starts again");
    let got = etcd
        .get(0, KEY)
        .expect("a read through the returned member");
    assert!(got.contains(TWO), "{got}");
}
