//! The privileged end-to-end fixture: one fastbox instance (its own prefix and address
//! pool), a busybox-only rootfs and the static execd. Every test builds its own instance and
//! tears it down, then checks that nothing carrying its prefix is left on the host.

#![allow(dead_code)]

pub mod execd;
pub mod node;
pub mod server;

use std::cell::RefCell;
use std::path::{Path, PathBuf};

use fastbox_cli::local_sandbox::{LocalHost, LocalSandbox, SlotSource, StartOptions};
use fastbox_runtime::criu::Criu;
use fastbox_runtime::execd_binary::ExecdBinary;
use fastbox_runtime::net::NetSlot;
use fastbox_runtime::sandbox::SandboxHandle;

pub struct Fixture {
    pub host: Option<LocalHost>,
    pub rootfs: PathBuf,
    pub execd: ExecdBinary,
    pub prefix: String,
    pub dir: tempfile::TempDir,
    /// Sandboxes not yet destroyed: removed by `Drop` when a test fails half-way.
    live: RefCell<Vec<(SandboxHandle, NetSlot)>>,
}

/// Why these tests cannot run here, if they cannot.
pub fn unavailable() -> Option<String> {
    if let Some(reason) = fastbox_testkit::privileged_unavailable() {
        return Some(reason);
    }
    if fastbox_testkit::execd_path().is_none() {
        return Some(
            "no static execd: scripts/test.sh builds it (or set FASTBOX_EXECD_BIN)".into(),
        );
    }
    None
}

/// `fastbox ARGS` as a user runs a one-off command (a benchmark, a scenario): with `data_dir`
/// and the tests' image cache, static execd and CRIU appended.
pub fn fastbox_run(args: &[&str], data_dir: &Path) -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_fastbox"));
    cmd.args(args)
        .arg("--data-dir")
        .arg(data_dir)
        .arg("--cache-dir")
        .arg(server::test_cache_dir())
        .arg("--execd")
        .arg(fastbox_testkit::execd_path().expect("static execd"))
        .arg("--criu")
        .arg(fastbox_testkit::criu_path().expect("CRIU"));
    cmd
}

/// The prefix of a one-off run whose own parts add a character (at most 7): the run prefix's
/// first six characters and `tag`, a letter that is not a hex digit, so no other suite's
/// prefix (the run prefix and its own tag) starts with it.
pub fn short_run_prefix(tag: char) -> String {
    assert!(
        !tag.is_ascii_hexdigit(),
        "tag {tag:?} must not be a hex digit"
    );
    let base = fastbox_testkit::run_prefix("");
    format!("{}{tag}", &base[..base.len().min(6)])
}

/// A fresh instance for one test. `pool` picks the test's own /24 (10.213.<pool>.0/24) so
/// parallel tests never share addresses.
pub fn fixture(tag: &str, pool: u8) -> Fixture {
    let prefix = fastbox_testkit::run_prefix(tag);
    let dir = tempfile::tempdir().expect("tempdir");
    let cache = fastbox_image::ImageCache::try_new(fastbox_image::ImageConfig {
        cache_dir: std::env::temp_dir().join("fastbox-test-cache"),
        ..Default::default()
    })
    .expect("image cache");
    let rootfs = cache
        .resolve("fastbox/busybox", None, &fastbox_image::NoProgress)
        .expect("busybox rootfs")
        .rootfs;
    let execd = ExecdBinary::import(&fastbox_testkit::execd_path().unwrap(), dir.path())
        .expect("import execd");
    let pool =
        fastbox_runtime::net::Ipv4Pool::try_new(std::net::Ipv4Addr::new(10, 213, pool, 0), 24)
            .unwrap();
    let host = LocalHost::try_new(
        &prefix,
        dir.path(),
        env!("CARGO_BIN_EXE_fastbox").as_ref(),
        pool,
    )
    .expect("host network");
    Fixture {
        host: Some(host),
        rootfs,
        execd,
        prefix,
        dir,
        live: RefCell::new(Vec::new()),
    }
}

impl Fixture {
    pub fn host(&self) -> &LocalHost {
        self.host.as_ref().unwrap()
    }

    pub fn start(&self, slot: u32, opts: StartOptions) -> LocalSandbox {
        let opts = StartOptions {
            id: if opts.id.is_empty() {
                format!("{}-{slot}", self.prefix)
            } else {
                opts.id
            },
            ..opts
        };
        let sb = self
            .host()
            .start(&self.rootfs, &self.execd, slot, &opts)
            .expect("sandbox starts");
        self.track(&sb);
        sb
    }

    /// Restore `checkpoint` as a new sandbox in `slot`.
    pub fn restore(&self, criu: &Criu, checkpoint: &Path, slot: u32, id: &str) -> LocalSandbox {
        let opts = StartOptions {
            id: id.to_string(),
            ..Default::default()
        };
        let sb = self
            .host()
            .restore(
                criu,
                checkpoint,
                &self.rootfs,
                self.dir.path(),
                SlotSource::Fresh(slot),
                &opts,
            )
            .expect("restore answers");
        self.track(&sb);
        sb
    }

    /// Checkpoint `sb` into `out` (the sandbox stops and is removed).
    pub fn checkpoint(&self, criu: &Criu, sb: &LocalSandbox, out: &Path) {
        self.host().checkpoint(criu, sb, out).expect("checkpoint");
        self.untrack(sb);
    }

    pub fn destroy(&self, sb: &LocalSandbox) {
        self.host().destroy(sb).expect("destroy");
        self.untrack(sb);
    }

    fn track(&self, sb: &LocalSandbox) {
        self.live
            .borrow_mut()
            .push((sb.handle.clone(), sb.slot.clone()));
    }

    fn untrack(&self, sb: &LocalSandbox) {
        self.live.borrow_mut().retain(|(h, _)| h.id != sb.handle.id);
    }

    /// Run a shell command in the sandbox; returns (exit code, stdout, stderr).
    pub fn sh(sandbox: &LocalSandbox, script: &str) -> (i32, String, String) {
        let (mut out, mut err) = (String::new(), String::new());
        let argv = vec!["/bin/sh".to_string(), "-c".to_string(), script.to_string()];
        let code = sandbox
            .execd
            .run(&argv, |e| {
                let text = e.text.clone().unwrap_or_default();
                let text = if text == "\n" { String::new() } else { text };
                match e.kind.as_str() {
                    "stdout" => out.push_str(&format!("{text}\n")),
                    "stderr" => err.push_str(&format!("{text}\n")),
                    "error" => err.push_str(&format!("error event: {e:?}\n")),
                    _ => {}
                }
            })
            .expect("command runs");
        (code, out, err)
    }

    /// Tear the instance down and assert nothing with its prefix is left on the host.
    pub fn finish(mut self) {
        assert!(
            self.live.borrow().is_empty(),
            "the test left sandboxes running"
        );
        let host = self.host.take().unwrap();
        host.teardown().expect("teardown");
        let leftovers = fastbox_cli::local_sandbox::leftovers(&self.prefix);
        assert!(leftovers.is_empty(), "leaked host state: {leftovers:?}");
    }
}

impl Drop for Fixture {
    /// A failed test still removes what it made, so later runs start clean.
    fn drop(&mut self) {
        let Some(host) = self.host.take() else { return };
        for (handle, slot) in self.live.borrow_mut().drain(..) {
            let _ = fastbox_runtime::sandbox::destroy(&handle, &host.cgroups);
            let _ = host.network.destroy_slot(&slot);
        }
        let _ = host.teardown();
        let _ = fastbox_runtime::net::HostNetwork::purge(&self.prefix);
    }
}
