//! `fastbox state migrate|backup|restore` against a real etcd: a one-machine state moves
//! into etcd record by record (once: a second run is refused), a backup of etcd restored
//! with `etcdctl` into a new member holds the same records, and a redb backup is a copy
//! that opens.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fastbox_state::{
    EtcdBackend, EtcdOptions, RedbBackend, SealKey, SealedBackend, StateBackend, StateUrl,
};
use fastbox_testkit::etcd::{EtcdCluster, etcd_unavailable};

/// The data directory of the commands (where migrate makes the seal key): the test's own.
fn data_dir() -> PathBuf {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().unwrap())
        .path()
        .to_path_buf()
}

fn fastbox(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_fastbox"))
        .args(args)
        .env_remove("FASTBOX_STATE")
        .env_remove("FASTBOX_STATE_SEAL_KEY")
        .env("FASTBOX_DATA_DIR", data_dir())
        .output()
        .expect("run fastbox")
}

fn etcd_at(url: &str) -> EtcdBackend {
    let StateUrl::Etcd(target) = StateUrl::parse(url).unwrap() else {
        unreachable!()
    };
    EtcdBackend::connect(target, EtcdOptions::default()).expect("connect")
}

/// A one-machine state with a few records (their bytes are copied as they are).
fn redb_state(path: &Path) {
    let redb = RedbBackend::open(path).unwrap();
    for (table, key) in [
        ("sandboxes", "s1"),
        ("sandboxes", "s2"),
        ("templates", "t1"),
        ("snapshots", "p1"),
        ("nodes", "n1"),
    ] {
        redb.put(
            table,
            key,
            format!(r#"{{"id":"{key}"}}"#).as_bytes(),
            0,
            None,
        )
        .unwrap();
    }
    // On the one-machine server's node.
    let s3 = br#"{"id":"s3","moved_from":[{"node":"local"},{"node":"n9"}],"node":"local"}"#;
    redb.put("sandboxes", "s3", s3, 0, None).unwrap();
}

fn keys(store: &dyn StateBackend, table: &str) -> Vec<String> {
    let mut keys: Vec<String> = store
        .list(table)
        .unwrap()
        .into_iter()
        .map(|e| e.key)
        .collect();
    keys.sort();
    keys
}

/// An etcd member started on a restored data directory; killed when dropped.
struct Restored(Child);

impl Drop for Restored {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_redb_state_migrates_into_etcd_once_and_backups_restore() {
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("state.redb");
    redb_state(&file);
    let etcd = EtcdCluster::start(1).expect("etcd starts");
    let url = format!("{}/fbt-migrated", etcd.state_url());
    let file_arg = file.display().to_string();

    let out = fastbox(&[
        "state",
        "migrate",
        "--from",
        &file_arg,
        "--state",
        &url,
        "--server-id",
        "srv1",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("migrated 6 record(s)"));
    let target = etcd_at(&url);
    assert_eq!(keys(&target, "sandboxes"), ["s1", "s2", "s3"]);
    assert_eq!(keys(&target, "nodes"), ["n1"]);
    // Sealed in etcd with the key made in the data directory, as the servers read them.
    let raw = target.get("templates", "t1").unwrap().unwrap().value;
    assert!(!raw.windows(4).any(|w| w == b"\"t1\""), "stored in clear");
    let (key, made) = SealKey::load_or_create(&data_dir().join("state-seal.key")).unwrap();
    assert!(!made, "migrate made the key");
    let sealed = SealedBackend::new(etcd_at(&url), key);
    assert_eq!(
        sealed.get("templates", "t1").unwrap().unwrap().value,
        br#"{"id":"t1"}"#
    );
    // The one-machine server's node goes by the server's id.
    assert_eq!(
        sealed.get("sandboxes", "s3").unwrap().unwrap().value,
        br#"{"id":"s3","moved_from":[{"node":"srv1"},{"node":"n9"}],"node":"srv1"}"#
    );
    assert_eq!(
        sealed.get("sandboxes", "s1").unwrap().unwrap().value,
        br#"{"id":"s1"}"#
    );
    // Once only.
    let again = fastbox(&["state", "migrate", "--from", &file_arg, "--state", &url]);
    assert!(!again.status.success());
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("already holds"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    // Only into etcd.
    let to_redb = fastbox(&[
        "state",
        "migrate",
        "--from",
        &file_arg,
        "--state",
        "/tmp/x.redb",
    ]);
    assert!(!to_redb.status.success());

    // A backup of etcd, restored into a new member, holds the same records.
    let snapshot = dir.path().join("etcd.snapshot");
    let snapshot_arg = snapshot.display().to_string();
    let out = fastbox(&["state", "backup", "--state", &url, "--out", &snapshot_arg]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(snapshot.metadata().unwrap().len() > 0);
    let again = fastbox(&["state", "backup", "--state", &url, "--out", &snapshot_arg]);
    assert!(
        !again.status.success(),
        "an existing backup is not overwritten"
    );

    let etcdctl = fastbox_testkit::etcd::etcd_binary()
        .unwrap()
        .with_file_name("etcdctl");
    let (client, peer) = (
        fastbox_testkit::server_port(),
        fastbox_testkit::server_port(),
    );
    let peer_url = format!("http://127.0.0.1:{peer}");
    let member_dir = dir.path().join("restored");
    let out = fastbox(&[
        "state",
        "restore",
        &snapshot_arg,
        "--etcd-data-dir",
        &member_dir.display().to_string(),
        "--name",
        "r0",
        "--initial-cluster",
        &format!("r0={peer_url}"),
        "--initial-advertise-peer-urls",
        &peer_url,
        "--etcdctl",
        &etcdctl.display().to_string(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let client_url = format!("http://127.0.0.1:{client}");
    let _member = Restored(
        Command::new(fastbox_testkit::etcd::etcd_binary().unwrap())
            .args(["--name", "r0", "--data-dir"])
            .arg(&member_dir)
            .args(["--listen-client-urls", &client_url])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("r0={peer_url}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcd on the restored directory"),
    );
    let restored_url = format!("etcd://127.0.0.1:{client}/fbt-migrated");
    let deadline = Instant::now() + Duration::from_secs(30);
    let restored = loop {
        let StateUrl::Etcd(target) = StateUrl::parse(&restored_url).unwrap() else {
            unreachable!()
        };
        match EtcdBackend::connect(target, EtcdOptions::default()) {
            Ok(backend) => break backend,
            Err(e) => assert!(Instant::now() < deadline, "restored member: {e}"),
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(keys(&restored, "sandboxes"), ["s1", "s2", "s3"]);
    assert_eq!(keys(&restored, "snapshots"), ["p1"]);

    // A redb backup is a copy that opens, with the same records.
    let copy = dir.path().join("copy.redb");
    let out = fastbox(&[
        "state",
        "backup",
        "--state",
        &file_arg,
        "--out",
        &copy.display().to_string(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let copy = RedbBackend::open(&copy).unwrap();
    assert_eq!(keys(&copy, "sandboxes"), ["s1", "s2", "s3"]);
}
