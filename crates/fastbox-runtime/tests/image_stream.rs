//! `criu dump --stream` into [`Capture`] with the real CRIU (root; skipped with the reason
//! otherwise): a process holding 32 MiB of pseudo-random memory is dumped live, its images
//! captured into memory and written out, and then restored from them with its memory
//! intact. The sandbox of fastbox (netns, cgroups, execd, a writable layer copied at
//! post-dump) is snapshotted this way end to end by `crates/fastbox-cli/tests/snapshot_e2e.rs`.

use std::path::Path;
use std::time::{Duration, Instant};

use fastbox_runtime::criu_stats;
use fastbox_runtime::image_stream::Capture;
use fastbox_runtime::post_dump::PostDumpHook;

mod common;
use common::*;

/// Dumps the holder on `pid` with `--leave-running --stream` into `dir/images`, its post-dump
/// action waiting on the capture's drain as fastbox's does; returns whether CRIU succeeded
/// and the capture's bytes.
fn streamed_dump(criu: &Path, pid: i32, dir: &Path) -> (bool, u64) {
    for sub in ["images", "work"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
    }
    let capture = Capture::start(&dir.join("images"), 48 << 20).unwrap();
    let drain = capture.drain();
    let hook = PostDumpHook::start(&dir.join("images"), move || drain.wait()).unwrap();
    let script = hook.script();
    let pid = pid.to_string();
    let dumped = spawn(
        criu,
        &[
            "dump",
            "-t",
            &pid,
            "--leave-running",
            "--stream",
            "--action-script",
            script.to_str().unwrap(),
            "-o",
            "dump.log",
            "-v3",
        ],
        dir,
    )
    .wait()
    .is_ok_and(|s| s.success());
    let drained = hook.finish();
    assert_eq!(
        drained.is_some_and(|d| d.is_ok()),
        dumped,
        "the action answers ok exactly when the dump succeeds"
    );
    let bytes = if dumped {
        capture.finish().unwrap()
    } else {
        drop(capture);
        0
    };
    (dumped, bytes)
}

#[test]
fn a_streamed_live_dump_restores_with_the_memory_it_had() {
    let (criu, _lock) = criu_or_skip!();
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let holder = start_holder(port);
    let (dumped, bytes) = streamed_dump(&criu, holder.pid, dir.path());
    let log = dir.path().join("work/dump.log");
    assert!(
        dumped,
        "criu dump --stream failed:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    assert!(bytes > 32 << 20, "captured {bytes} bytes");
    // Left running, and its memory unchanged.
    let (now, at_start) = ask(port).expect("the holder runs on after a live dump");
    assert_eq!(now, at_start);
    // The images are files now; CRIU wrote no stats-dump, its log gives the freeze.
    let images = dir.path().join("images");
    assert!(
        !images
            .join(fastbox_runtime::image_stream::SOCKET_NAME)
            .exists()
    );
    let pages: u64 = std::fs::read_dir(&images)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("pages-"))
        .map(|e| e.metadata().unwrap().len())
        .sum();
    assert!(pages >= 32 << 20, "pages images hold {pages} bytes");
    let frozen = criu_stats::frozen_from_log(&log).expect("the freeze in the dump log");
    assert!(
        frozen.frozen_time_us > 0 && frozen.frozen_time_us < 10_000_000,
        "{frozen:?}"
    );
    // The live one goes (its port is the restored one's).
    kill(holder.pid);
    assert!(ends(holder.pid));
    drop(holder);

    // Restored whole from the written images: the same memory answers again.
    let pidfile = dir.path().join("restored.pid");
    let restored = spawn(
        &criu,
        &[
            "restore",
            "--restore-detached",
            "-o",
            "restore.log",
            "-v2",
            "--pidfile",
            pidfile.to_str().unwrap(),
        ],
        dir.path(),
    )
    .wait()
    .is_ok_and(|s| s.success());
    assert!(
        restored,
        "criu restore failed:\n{}",
        std::fs::read_to_string(dir.path().join("work/restore.log")).unwrap_or_default()
    );
    let pid = restored_pid(dir.path()).expect("the restored pid");
    let deadline = Instant::now() + Duration::from_secs(10);
    let answer = loop {
        if let Some(answer) = ask(port) {
            break answer;
        }
        assert!(
            Instant::now() < deadline,
            "the restored holder does not answer"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    kill(pid);
    assert!(ends(pid));
    assert_eq!(answer.0, answer.1, "the restored memory is what it was");
}

#[test]
fn a_dump_that_never_streams_lets_the_capture_go() {
    // No CRIU: the capture is made and dropped, and cleans up after itself.
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("images");
    let capture = Capture::start(&images, 1 << 20).unwrap();
    assert!(
        images
            .join(fastbox_runtime::image_stream::SOCKET_NAME)
            .exists()
    );
    assert_eq!(capture.finish().unwrap(), 0);
    assert!(
        !images
            .join(fastbox_runtime::image_stream::SOCKET_NAME)
            .exists()
    );
}
