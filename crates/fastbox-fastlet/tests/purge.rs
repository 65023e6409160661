//! `fastbox purge` (`host::purge`) of a stopped instance removes its cgroups even when no
//! sandbox directory names them (a spare a crash interrupted), processes inside included,
//! and leaves nothing `host::leftovers` would list. Privileged: real cgroups.

use fastbox_fastlet::host::{leftovers, purge};
use fastbox_runtime::cgroup::{Cgroup, CgroupLimits, CgroupRoot};

#[test]
fn purge_removes_cgroups_that_no_sandbox_directory_names() {
    fastbox_testkit::skip_unless!(fastbox_testkit::privileged_unavailable());
    let prefix = fastbox_testkit::run_prefix("4");
    let root = CgroupRoot::detect().expect("cgroups");
    let limits = CgroupLimits::default();
    let spare = Cgroup::create(&root, &prefix, "spare-0", &limits).expect("spare cgroup");
    let orphan = Cgroup::create(&root, &prefix, "gone-sandbox", &limits).expect("cgroup");
    let mut sleeper = std::process::Command::new("sleep")
        .arg("600")
        .spawn()
        .expect("sleep");
    orphan
        .add_pid(sleeper.id() as i32)
        .expect("join the cgroup");
    assert!(
        leftovers(&prefix).iter().any(|l| l.contains("spare-0")),
        "{:?}",
        leftovers(&prefix)
    );

    let data_dir = tempfile::tempdir().unwrap();
    purge(&prefix, data_dir.path()).expect("purge");
    let left = leftovers(&prefix);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let mut killed = false;
    while std::time::Instant::now() < deadline {
        if sleeper.try_wait().expect("the sleeper's status").is_some() {
            killed = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // Reaped either way (a no-op when the purge killed it).
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    if !killed || !left.is_empty() {
        // Clean up what the purge did not, then fail.
        for cg in [spare, orphan] {
            let _ = cg.kill_all().and_then(|()| cg.remove());
        }
        let _ = fastbox_runtime::cgroup::remove_prefix(&root, &prefix);
    }
    assert!(left.is_empty(), "purge left {left:?}");
    assert!(killed, "the process in an orphaned cgroup was not killed");
}
