//! The cgroup code against temporary directories shaped like cgroupfs (v1 and v2). No root.

use std::fs;
use std::path::Path;

use super::*;

const MI: u64 = 1 << 20;

fn read(path: impl AsRef<Path>) -> String {
    let path = path.as_ref();
    fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
        .trim()
        .to_string()
}

/// `/sys/fs/cgroup` of a v1 host with every controller on its own mount.
fn fake_v1(dir: &Path) -> CgroupRoot {
    for c in Controller::V1 {
        fs::create_dir(dir.join(c.name())).unwrap();
    }
    fs::write(dir.join("cpuset/cpuset.cpus"), "0-3\n").unwrap();
    fs::write(dir.join("cpuset/cpuset.mems"), "0\n").unwrap();
    fs::write(
        dir.join("memory/memory.memsw.limit_in_bytes"),
        "9223372036854771712\n",
    )
    .unwrap();
    let root = CgroupRoot::at(dir, CgroupVersion::V1).unwrap();
    assert!(!root.kernel());
    root
}

/// A cgroup2 mount with cpu, memory and pids available.
fn fake_v2(dir: &Path, controllers: &str) -> CgroupRoot {
    fs::write(dir.join("cgroup.controllers"), controllers).unwrap();
    fs::write(dir.join("cgroup.subtree_control"), "").unwrap();
    CgroupRoot::at(dir, CgroupVersion::V2).unwrap()
}

fn limits(cpu: u64, memory: u64, pids: u64) -> CgroupLimits {
    CgroupLimits {
        cpu_millis: Some(cpu),
        memory_bytes: Some(memory),
        pids: Some(pids),
    }
}

#[test]
fn v1_create_writes_limits_devices_and_cpuset() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let root = fake_v1(d);
    let cg = Cgroup::create(&root, "fb", "sbx1", &limits(500, 64 * MI, 20)).unwrap();
    assert_eq!(cg.version(), CgroupVersion::V1);
    assert_eq!(cg.paths().len(), 7);
    assert_eq!(read(d.join("cpu/fb/sbx1/cpu.cfs_period_us")), "100000");
    assert_eq!(read(d.join("cpu/fb/sbx1/cpu.cfs_quota_us")), "50000");
    assert_eq!(
        read(d.join("memory/fb/sbx1/memory.limit_in_bytes")),
        (64 * MI).to_string()
    );
    assert_eq!(
        read(d.join("memory/fb/sbx1/memory.memsw.limit_in_bytes")),
        (64 * MI).to_string()
    );
    assert_eq!(read(d.join("memory/fb/sbx1/memory.oom_control")), "0");
    assert_eq!(read(d.join("pids/fb/sbx1/pids.max")), "20");
    for dir in ["cpuset/fb", "cpuset/fb/sbx1"] {
        assert_eq!(read(d.join(dir).join("cpuset.cpus")), "0-3");
        assert_eq!(read(d.join(dir).join("cpuset.mems")), "0");
    }
    assert_eq!(read(d.join("devices/fb/sbx1/devices.deny")), "a");
    // A stand-in keeps only the last write; the kernel appends each rule.
    assert_eq!(
        read(d.join("devices/fb/sbx1/devices.allow")),
        *DEVICE_RULES.last().unwrap()
    );
    for c in ["freezer", "cpuacct"] {
        assert!(d.join(c).join("fb/sbx1").is_dir(), "{c}");
    }
}

#[test]
fn v1_unlimited_writes_the_kernels_spelling_of_no_limit() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let root = fake_v1(d);
    Cgroup::create(&root, "fb", "s", &CgroupLimits::default()).unwrap();
    assert_eq!(read(d.join("cpu/fb/s/cpu.cfs_quota_us")), "-1");
    assert_eq!(read(d.join("memory/fb/s/memory.limit_in_bytes")), "-1");
    assert_eq!(
        read(d.join("memory/fb/s/memory.memsw.limit_in_bytes")),
        "-1"
    );
    assert_eq!(read(d.join("pids/fb/s/pids.max")), "max");
}

#[test]
fn v1_comounted_cpu_and_cpuacct_are_one_hierarchy() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    for dir in ["cpu,cpuacct", "memory", "pids", "freezer"] {
        fs::create_dir(d.join(dir)).unwrap();
    }
    std::os::unix::fs::symlink("cpu,cpuacct", d.join("cpu")).unwrap();
    std::os::unix::fs::symlink("cpu,cpuacct", d.join("cpuacct")).unwrap();
    let root = CgroupRoot::at(d, CgroupVersion::V1).unwrap();
    assert_eq!(
        root.mount_of(Controller::Cpu),
        root.mount_of(Controller::Cpuacct)
    );
    assert_eq!(root.mount_of(Controller::Cpuset), None);
    let cg = Cgroup::create(&root, "fb", "s", &limits(250, MI, 5)).unwrap();
    assert_eq!(cg.paths().len(), 4);
    let criu: Vec<String> = cg.criu_cgroup_roots().iter().map(|r| r.to_arg()).collect();
    assert_eq!(
        criu,
        [
            "cpu,cpuacct:/fb/s",
            "memory:/fb/s",
            "pids:/fb/s",
            "freezer:/fb/s"
        ]
    );
    let cpu_dir = fs::canonicalize(d.join("cpu,cpuacct")).unwrap();
    assert_eq!(read(cpu_dir.join("fb/s/cpu.cfs_quota_us")), "25000");
}

#[test]
fn v2_create_enables_controllers_down_the_prefix_and_writes_limits() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let root = fake_v2(d, "cpuset cpu io memory hugetlb pids rdma misc\n");
    let cg = Cgroup::create(&root, "fb/slots", "sbx", &limits(1500, 512 * MI, 64)).unwrap();
    assert_eq!(cg.paths(), [d.join("fb/slots/sbx")]);
    for dir in [d.to_path_buf(), d.join("fb"), d.join("fb/slots")] {
        assert_eq!(
            read(dir.join("cgroup.subtree_control")),
            "+cpu +memory +pids",
            "{}",
            dir.display()
        );
    }
    let leaf = d.join("fb/slots/sbx");
    assert_eq!(read(leaf.join("cpu.max")), "150000 100000");
    assert_eq!(read(leaf.join("memory.max")), (512 * MI).to_string());
    assert_eq!(read(leaf.join("memory.swap.max")), "0");
    assert_eq!(read(leaf.join("pids.max")), "64");
    assert!(!leaf.join("devices.allow").exists());
    assert_eq!(
        cg.criu_cgroup_roots(),
        [CriuCgroupRoot {
            controller: None,
            path: "/fb/slots/sbx".into()
        }]
    );
    assert_eq!(cg.criu_cgroup_roots()[0].to_arg(), "/fb/slots/sbx");

    // Already enabled controllers are not written again; a second sandbox works.
    fs::write(d.join("cgroup.subtree_control"), "cpu memory pids").unwrap();
    Cgroup::create(&root, "fb/slots", "sbx2", &CgroupLimits::default()).unwrap();
    assert_eq!(read(d.join("cgroup.subtree_control")), "cpu memory pids");
    let leaf2 = d.join("fb/slots/sbx2");
    assert_eq!(read(leaf2.join("cpu.max")), "max 100000");
    assert_eq!(read(leaf2.join("memory.max")), "max");
    assert_eq!(read(leaf2.join("pids.max")), "max");
}

#[test]
fn the_device_policy_is_files_on_v1_and_nothing_on_a_v2_stand_in() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    // v2: the device program is for the kernel only; a stand-in directory gets no file.
    fs::create_dir(d.join("v2")).unwrap();
    let root = fake_v2(&d.join("v2"), "cpu memory pids");
    let cg = Cgroup::create(&root, "fb", "s", &CgroupLimits::default()).unwrap();
    cg.apply_device_policy().unwrap();
    assert_eq!(cg.device_programs().unwrap(), Vec::<u32>::new());
    let leaf = d.join("v2/fb/s");
    let mut files: Vec<String> = fs::read_dir(&leaf)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        ["cpu.max", "memory.max", "memory.swap.max", "pids.max"]
    );

    // v1: applying again writes the same files again.
    fs::create_dir(d.join("v1")).unwrap();
    let root = fake_v1(&d.join("v1"));
    let cg = Cgroup::create(&root, "fb", "s", &CgroupLimits::default()).unwrap();
    fs::remove_file(d.join("v1/devices/fb/s/devices.deny")).unwrap();
    cg.apply_device_policy().unwrap();
    assert_eq!(read(d.join("v1/devices/fb/s/devices.deny")), "a");
    assert_eq!(cg.device_programs().unwrap(), Vec::<u32>::new());
}

#[test]
fn v2_missing_controller_is_an_error_only_when_its_limit_is_asked_for() {
    let tmp = tempfile::tempdir().unwrap();
    let root = fake_v2(tmp.path(), "cpu pids");
    let err = Cgroup::create(&root, "fb", "a", &limits(100, MI, 10)).unwrap_err();
    assert!(
        matches!(
            err,
            CgroupError::ControllerMissing {
                controller: Controller::Memory,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string()
            .starts_with("cgroup controller memory is not available under"),
        "{err}"
    );
    // Nothing was created.
    assert!(!tmp.path().join("fb/a").exists());
    let no_memory = CgroupLimits {
        memory_bytes: None,
        ..limits(100, MI, 10)
    };
    Cgroup::create(&root, "fb", "a", &no_memory).unwrap();
    assert_eq!(
        read(tmp.path().join("cgroup.subtree_control")),
        "+cpu +pids"
    );
}

#[test]
fn creating_an_existing_cgroup_fails_and_keeps_it() {
    let tmp = tempfile::tempdir().unwrap();
    let root = fake_v2(tmp.path(), "cpu memory pids");
    Cgroup::create(&root, "fb", "dup", &limits(100, MI, 10)).unwrap();
    let err = Cgroup::create(&root, "fb", "dup", &limits(100, MI, 10)).unwrap_err();
    assert!(matches!(err, CgroupError::Exists { .. }), "{err}");
    assert!(err.to_string().ends_with("fb/dup already exists"), "{err}");
    assert!(tmp.path().join("fb/dup/memory.max").exists());
}

#[test]
fn a_failed_create_leaves_nothing_behind() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let root = fake_v1(d);
    // The pids hierarchy (after cpu, cpuacct, cpuset, memory) cannot take the prefix.
    fs::write(d.join("pids/fb"), "not a directory").unwrap();
    let err = Cgroup::create(&root, "fb", "s", &limits(100, MI, 10)).unwrap_err();
    assert!(
        matches!(err, CgroupError::Io { op: "mkdir", .. }),
        "{err:?}"
    );
    assert!(err.to_string().starts_with("mkdir "), "{err}");
    for c in ["cpu", "cpuacct", "cpuset", "memory"] {
        assert!(!d.join(c).join("fb/s").exists(), "{c} left behind");
    }
    assert!(Cgroup::open(&root, "fb", "s").is_none());
}

#[test]
fn invalid_limits_and_names_are_rejected() {
    let tmp = tempfile::tempdir().unwrap();
    let root = fake_v2(tmp.path(), "cpu memory pids");
    let cases = [
        (limits(5, MI, 1), "invalid cpu limit 5: below 10 millicores"),
        (
            limits(20_000_000, MI, 1),
            "invalid cpu limit 20000000: above 10000 cpus",
        ),
        (limits(100, 0, 1), "invalid memory limit 0: zero bytes"),
        (limits(100, MI, 0), "invalid pids limit 0: zero tasks"),
    ];
    for (l, want) in cases {
        let err = Cgroup::create(&root, "fb", "x", &l)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with(want), "{err}");
    }
    for (prefix, id) in [("", "x"), ("../etc", "x"), ("fb", "a/b"), ("fb", "..")] {
        let err = Cgroup::create(&root, prefix, id, &CgroupLimits::default()).unwrap_err();
        assert!(matches!(err, CgroupError::InvalidName { .. }), "{err}");
    }
    assert!(fs::read_dir(tmp.path()).unwrap().all(|e| {
        let e = e.unwrap();
        !e.file_type().unwrap().is_dir()
    }));
}

#[test]
fn pids_are_written_to_every_hierarchy_and_read_back() {
    let tmp = tempfile::tempdir().unwrap();
    let root = fake_v1(tmp.path());
    let cg = Cgroup::create(&root, "fb", "p", &CgroupLimits::default()).unwrap();
    assert_eq!(cg.procs().unwrap(), Vec::<i32>::new());
    cg.add_pid(4321).unwrap();
    for file in cg.procs_files() {
        assert_eq!(read(&file), "4321", "{}", file.display());
    }
    assert_eq!(cg.procs().unwrap(), [4321]);
    // The pre-exec path writes "0" (the writer itself) through files opened earlier.
    let files = cg.open_procs().unwrap();
    files.join_current().unwrap();
    for file in cg.procs_files() {
        assert_eq!(read(&file), "0");
    }
}

#[test]
fn freeze_and_thaw_write_the_state_files() {
    let tmp = tempfile::tempdir().unwrap();
    let root = fake_v1(tmp.path());
    let cg = Cgroup::create(&root, "fb", "f", &CgroupLimits::default()).unwrap();
    cg.freeze().unwrap();
    assert_eq!(
        read(tmp.path().join("freezer/fb/f/freezer.state")),
        "FROZEN"
    );
    assert!(cg.is_frozen().unwrap());
    cg.thaw().unwrap();
    assert_eq!(
        read(tmp.path().join("freezer/fb/f/freezer.state")),
        "THAWED"
    );
    assert!(!cg.is_frozen().unwrap());

    let tmp2 = tempfile::tempdir().unwrap();
    let root = fake_v2(tmp2.path(), "cpu memory pids");
    let cg = Cgroup::create(&root, "fb", "f", &CgroupLimits::default()).unwrap();
    cg.freeze().unwrap();
    assert_eq!(read(tmp2.path().join("fb/f/cgroup.freeze")), "1");
    // The kernel's report wins when there is one.
    fs::write(
        tmp2.path().join("fb/f/cgroup.events"),
        "populated 1\nfrozen 1\n",
    )
    .unwrap();
    assert!(cg.is_frozen().unwrap());
    fs::write(
        tmp2.path().join("fb/f/cgroup.events"),
        "populated 1\nfrozen 0\n",
    )
    .unwrap();
    cg.thaw().unwrap();
    assert_eq!(read(tmp2.path().join("fb/f/cgroup.freeze")), "0");
}

#[test]
fn freezing_without_a_freezer_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    fs::create_dir(d.join("memory")).unwrap();
    let root = CgroupRoot::at(d, CgroupVersion::V1).unwrap();
    let cg = Cgroup::create(&root, "fb", "f", &CgroupLimits::default()).unwrap();
    let err = cg.freeze().unwrap_err();
    assert!(
        matches!(
            err,
            CgroupError::ControllerMissing {
                controller: Controller::Freezer,
                ..
            }
        ),
        "{err}"
    );
    // Nothing to kill, no freezer needed.
    cg.kill_all().unwrap();
}

#[test]
fn oom_kills_cpu_and_memory_are_read_from_the_kernel_files() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let root = fake_v1(d);
    let cg = Cgroup::create(&root, "fb", "o", &CgroupLimits::default()).unwrap();
    fs::write(
        d.join("memory/fb/o/memory.oom_control"),
        "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
    )
    .unwrap();
    assert_eq!(cg.memory_events_oom_kills().unwrap(), 2);
    fs::write(d.join("cpuacct/fb/o/cpuacct.usage"), "1500000000\n").unwrap();
    assert_eq!(
        cg.cpu_usage().unwrap(),
        std::time::Duration::from_millis(1500)
    );
    fs::write(d.join("memory/fb/o/memory.usage_in_bytes"), "4096\n").unwrap();
    assert_eq!(cg.memory_current().unwrap(), 4096);

    let tmp2 = tempfile::tempdir().unwrap();
    let d2 = tmp2.path();
    let root = fake_v2(d2, "cpu memory pids");
    let cg = Cgroup::create(&root, "fb", "o", &CgroupLimits::default()).unwrap();
    fs::write(
        d2.join("fb/o/memory.events"),
        "low 0\nhigh 0\nmax 7\noom 3\noom_kill 3\noom_group_kill 0\n",
    )
    .unwrap();
    assert_eq!(cg.memory_events_oom_kills().unwrap(), 3);
    fs::write(
        d2.join("fb/o/cpu.stat"),
        "usage_usec 250000\nuser_usec 200000\nsystem_usec 50000\n",
    )
    .unwrap();
    assert_eq!(
        cg.cpu_usage().unwrap(),
        std::time::Duration::from_millis(250)
    );
    fs::write(d2.join("fb/o/memory.events"), "oom 1\n").unwrap();
    let err = cg.memory_events_oom_kills().unwrap_err();
    assert!(err.to_string().contains("unexpected content"), "{err}");
}

#[test]
fn remove_leaked_and_remove_prefix() {
    for version in [CgroupVersion::V1, CgroupVersion::V2] {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        let root = match version {
            CgroupVersion::V1 => fake_v1(d),
            CgroupVersion::V2 => fake_v2(d, "cpu memory pids"),
        };
        let per_sandbox = root.hierarchies().len();
        assert!(leaked(&root, "fb/t").is_empty());
        assert!(Cgroup::open(&root, "fb/t", "a").is_none());
        let a = Cgroup::create(&root, "fb/t", "a", &limits(100, MI, 10)).unwrap();
        let b = Cgroup::create(&root, "fb/t", "b", &limits(100, MI, 10)).unwrap();
        assert_eq!(leaked(&root, "fb/t").len(), 2 * per_sandbox);
        assert!(Cgroup::open(&root, "fb/t", "a").is_some());
        // A nested cgroup made inside the sandbox goes too.
        fs::create_dir(a.paths()[0].join("inner")).unwrap();
        a.kill_all().unwrap();
        a.remove().unwrap();
        a.remove().unwrap(); // idempotent
        assert_eq!(leaked(&root, "fb/t"), {
            let mut v = b.paths();
            v.sort();
            v
        });
        // The prefix stays while it holds a sandbox.
        remove_prefix(&root, "fb/t").unwrap();
        assert!(root.hierarchies()[0].mount.join("fb/t").is_dir());
        b.remove().unwrap();
        assert!(leaked(&root, "fb/t").is_empty(), "{version:?}");
        remove_prefix(&root, "fb/t").unwrap();
        for h in root.hierarchies() {
            assert!(!h.mount.join("fb").exists(), "{}", h.mount.display());
        }
        remove_prefix(&root, "fb/t").unwrap();
        assert!(leaked(&root, "../x").is_empty());
    }
}

#[test]
fn limits_serde_defaults_to_unlimited_and_rejects_unknown_fields() {
    let l: CgroupLimits = serde_json::from_str(r#"{"memory_bytes": 1024}"#).unwrap();
    assert_eq!(
        l,
        CgroupLimits {
            memory_bytes: Some(1024),
            ..Default::default()
        }
    );
    assert!(serde_json::from_str::<CgroupLimits>(r#"{"memory": 1}"#).is_err());
}

#[test]
fn at_refuses_a_v1_directory_without_controllers() {
    let tmp = tempfile::tempdir().unwrap();
    let err = CgroupRoot::at(tmp.path(), CgroupVersion::V1).unwrap_err();
    assert!(matches!(err, CgroupError::NotMounted { .. }), "{err}");
    let err = CgroupRoot::at(&tmp.path().join("missing"), CgroupVersion::V2).unwrap_err();
    assert!(err.to_string().starts_with("stat "), "{err}");
}
