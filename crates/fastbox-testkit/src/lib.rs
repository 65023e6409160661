//! Dev-only helpers shared by fastbox's tests: the privileged-test guard and per-run names.
//!
//! Privileged tests run for real as root in CI. When a prerequisite is truly missing they
//! report `skipped: <reason>` on stderr and return, never pass silently: `skip_unless!` prints
//! the reason in a form the test log shows.

pub mod chaos;
pub mod etcd;
pub mod s3;
pub mod transitions;

use std::path::PathBuf;

/// A loopback port, free when picked, for a server a test starts by port number. It lies
/// below the host's ephemeral range (`net.ipv4.ip_local_port_range`), so no outgoing
/// connection of another test takes it between the pick and the server's bind (a port the
/// kernel handed out for `127.0.0.1:0` could be: CI saw `fastbox up` fail with "Address
/// already in use" that way).
pub fn server_port() -> u16 {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let from = low.saturating_sub(20_000).max(1024);
    for _ in 0..200 {
        let port = from + rand::random::<u16>() % low.saturating_sub(from).max(1);
        if std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, port)).is_ok() {
            return port;
        }
    }
    std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// Why a privileged test cannot run here, or None when it can.
pub fn privileged_unavailable() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("needs root (namespaces, mounts, cgroups)".into());
    }
    None
}

/// Return early from a test, printing why, when `$reason` (an `Option<String>`) is Some.
#[macro_export]
macro_rules! skip_unless {
    ($reason:expr) => {
        if let Some(reason) = $reason {
            eprintln!("skipped: {reason}");
            return;
        }
    };
}

/// The per-run prefix of host-wide names: `FASTBOX_TEST_PREFIX` when CI sets it, otherwise
/// `fbt` + 4 random hex digits. Tests append their own one-letter tag so parallel tests differ;
/// a purge by prefix removes everything of the tag, so two suites must never share a letter:
/// `a`-`e` sandbox_e2e, `n` `o` runtime network tests, `s` tests/sdk, `g` `h` artifact tests,
/// `f` the egress matrix, `0` egress enforcement, `1` egress private network, `2` bench_restore,
/// `3` egress throughput, `9` the runtime's cgroup v2 device tests, `4` the
/// fastlet purge test, `5` the hostile-image escape test, `7` the fastlet staging tests
/// (plus a letter per test), `8` the secure-access route tests (escape_routes), the letters of
/// `UP_SERVER_TAGS` (`crates/fastbox-cli/tests/common/server.rs`; `m` is the egress e2e)
/// `fastbox up` tests. Every character of `[a-z0-9]` is taken: new suites use
/// [`run_prefix_pair`].
pub fn run_prefix(tag: &str) -> String {
    let base = std::env::var("FASTBOX_TEST_PREFIX")
        .unwrap_or_else(|_| format!("fbt{:04x}", rand::random::<u16>()));
    format!("{base}{tag}")
}

/// The prefix of a suite with a two-character tag, for suites that came after every
/// one-character tag of [`run_prefix`] was taken: the run prefix's first six characters and
/// `tag` (8 bytes, the most an instance prefix may have). The tag's first character must be
/// a letter beyond `f` (not a hex digit, so the prefix differs from every `run_prefix(tag)`,
/// whose seventh character is one) other than `y` and `z` (fastbox-cli's `short_run_prefix`
/// for one-off runs that add a character of their own). In use: `xc` `xd` fastbox-egress
/// tests/tenant_limits.rs; `rn` `rs` `rw` fastbox-cli tests/remote_node.rs; `ng` fastbox-cli
/// tests/fence_guard.rs; `kp` fastbox-cli tests/server_e2e.rs (pool 10.217.60.0/24); `jn` `js` `jm` `jt` fastbox-cli tests/remote_node.rs; `v` and any one character: fastbox-cli tests/verify_cluster.rs
/// (the run prefix's first six characters and `v`, each instance of the scenario adding one).
pub fn run_prefix_pair(tag: &str) -> String {
    let mut chars = tag.chars();
    let (Some(first), Some(_), None) = (chars.next(), chars.next(), chars.next()) else {
        panic!("tag {tag:?}: two characters");
    };
    assert!(
        first.is_ascii_lowercase() && !first.is_ascii_hexdigit() && !matches!(first, 'y' | 'z'),
        "tag {tag:?}: the first character must be a letter in g..=x"
    );
    let base = run_prefix("");
    format!("{}{tag}", &base[..base.len().min(6)])
}

/// The repository root (`FASTBOX_REPO`, else derived from this crate's location).
pub fn repo_root() -> PathBuf {
    std::env::var_os("FASTBOX_REPO")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.."))
}

/// The CRIU binary the tests use: `FASTBOX_CRIU`, else the one `scripts/setup.sh` installs.
pub fn criu_path() -> Option<PathBuf> {
    std::env::var_os("FASTBOX_CRIU")
        .map(PathBuf::from)
        .or_else(|| Some(repo_root().join(".deps/criu/bin/criu")))
        .filter(|p| p.exists())
}

/// The static execd binary: `FASTBOX_EXECD_BIN`, else the repository's static build.
pub fn execd_path() -> Option<PathBuf> {
    std::env::var_os("FASTBOX_EXECD_BIN")
        .map(PathBuf::from)
        .or_else(|| Some(repo_root().join("target/x86_64-unknown-linux-gnu/release/fastbox-execd")))
        .filter(|p| p.exists())
}
