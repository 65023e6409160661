//! Lazy restores with the real CRIU (root, CRIU >= 4.2 with non-cooperative userfaultfd;
//! skipped with the reason otherwise). A process holding 32 MiB of pseudo-random memory (this
//! test binary itself, re-run as `common::memory_holder` in its own pid namespace) is dumped; its
//! pages image is then taken away and served lazily from blocks in memory, and the process is
//! restored with `criu restore --lazy-pages`:
//!
//! - through the daemon and page server alone ([`LazyDaemon`]): memory intact;
//! - through a [`LazySession`]: memory intact, the pages image complete afterwards;
//! - with a block source that fails after the restore's own blocks: the transfer fails, its
//!   watcher kills the restored process, and the incomplete pages image is removed;
//! - with a transfer slower than its timeout: the watcher kills the restored process;
//! - with the restored process killed mid-transfer: the transfer ends at once (failed: its
//!   pages image is not complete, and removed), without fetching the rest.
//!
//! The restored sandbox of fastbox (netns, cgroups, execd) is restored lazily end to end by
//! `fastbox bench lazy` (`crates/fastbox-cli/tests/bench_lazy.rs`).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use fastbox_runtime::criu::Criu;
use fastbox_runtime::lazy::blocks::LazyFile;
use fastbox_runtime::lazy::daemon::LazyDaemon;
use fastbox_runtime::lazy::pagemap::{PAGE_SIZE, Pagemap, task_pagemaps};
use fastbox_runtime::lazy::restore::{LazyError, LazyPages, LazySession, RemoteFile};
use fastbox_runtime::lazy::server::PageServer;
use fastbox_runtime::lazy::testkit::MemorySource;

mod common;
use common::*;

/// The blocks the tests cut pages images into (small, so there are many).
const BLOCK: usize = 256 << 10;

/// Dumps a fresh holder into `dir/images`; returns its port.
fn dump_holder(criu: &Path, dir: &Path) -> u16 {
    for sub in ["images", "work"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
    }
    let port = free_port();
    let holder = start_holder(port);
    let pid = holder.pid.to_string();
    let dumped = spawn(criu, &["dump", "-t", &pid, "-o", "dump.log", "-v2"], dir)
        .wait()
        .is_ok_and(|s| s.success());
    drop(holder);
    if !dumped {
        let log = std::fs::read_to_string(dir.join("work/dump.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(30).collect();
        panic!("criu dump failed:\n{}", tail.join("\n"));
    }
    port
}

/// `criu restore --lazy-pages`, started; its pidfile is `DIR/restored.pid`.
fn start_restore(criu: &Path, dir: &Path) -> Child {
    let pidfile = dir.join("restored.pid");
    let pidfile = pidfile.to_str().unwrap();
    spawn(
        criu,
        &[
            "restore",
            "--lazy-pages",
            "--restore-detached",
            "-o",
            "restore.log",
            "-v2",
            "--pidfile",
            pidfile,
        ],
        dir,
    )
}

/// The dumped holder's one task pages image, taken out of `images`: its name and bytes, and
/// its pagemap.
fn take_pages(images: &Path) -> (String, Vec<u8>, Pagemap) {
    let mut tasks = task_pagemaps(images).unwrap();
    assert_eq!(tasks.len(), 1, "one task");
    let (_, pagemap) = tasks.remove(0);
    let name = pagemap.pages_file_name();
    let path = images.join(&name);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let lazy = pagemap.lazy_pages();
    assert!(
        lazy >= (32 << 20) / PAGE_SIZE,
        "the memory is lazy: {lazy} pages"
    );
    (name, bytes, pagemap)
}

/// How the blocks of a test checkpoint come.
#[derive(Clone, Copy)]
enum Blocks {
    /// Every block, each after this delay.
    Delayed(Duration),
    /// The blocks of the restore's own (eager) pages; every other fetch fails.
    OnlyEager,
}

/// The holder dumped into a fresh directory, its pages image served from a [`MemorySource`]:
/// the directory, its port, the source and the session's settings.
fn lazy_checkpoint(
    criu: &Path,
    how: Blocks,
) -> (tempfile::TempDir, u16, Arc<MemorySource>, LazyPages) {
    let dir = tempfile::tempdir().unwrap();
    let port = dump_holder(criu, dir.path());
    let (name, bytes, pagemap) = take_pages(&dir.path().join("images"));
    let delay = match how {
        Blocks::Delayed(delay) => delay,
        Blocks::OnlyEager => Duration::ZERO,
    };
    let (mut source, blocks) = MemorySource::of(&bytes, BLOCK, delay);
    if let Blocks::OnlyEager = how {
        let eager = pagemap.eager_ranges().into_iter().flat_map(|range| {
            let first = range.start as usize / BLOCK;
            first..=(range.end as usize - 1) / BLOCK
        });
        source.only = Some(eager.map(|i| blocks[i].clone()).collect());
    }
    let source = Arc::new(source);
    let pages = LazyPages {
        source: source.clone(),
        block_size: BLOCK as u64,
        files: BTreeMap::from([(
            name,
            RemoteFile {
                size: bytes.len() as u64,
                blocks,
            },
        )]),
        complete: Vec::new(),
        fetch_workers: 2,
        restore_timeout: Duration::from_secs(60),
        transfer_timeout: None,
    };
    (dir, port, source, pages)
}

fn start_session(criu: &Path, dir: &Path, pages: &LazyPages) -> LazySession {
    start_guarded_session(criu, dir, pages, None)
}

fn start_guarded_session(
    criu: &Path,
    dir: &Path,
    pages: &LazyPages,
    freeze_on_failure: Option<(&Path, &str)>,
) -> LazySession {
    LazySession::start(
        &Criu::at(criu).unwrap(),
        &dir.join("images"),
        &dir.join("work"),
        &dir.join("lazy.log"),
        pages,
        freeze_on_failure,
    )
    .unwrap()
}

/// Runs the lazy restore of `dir` that `session` serves, checks that the restored holder's
/// memory is intact (on `port`) and that its transfer succeeded without the kill action, then
/// ends the holder; returns the transfer's report.
fn restore_intact(
    criu: &Path,
    dir: &Path,
    port: u16,
    session: LazySession,
) -> fastbox_runtime::lazy::restore::TransferReport {
    let mut restore = start_restore(criu, dir);
    let (kill_restored, killed) = killer(dir);
    assert!(
        restore.wait().unwrap().success(),
        "lazy restore; logs in {}",
        dir.display()
    );
    let answer = answer_of(dir, port);
    let report = session.watch(kill_restored).wait();
    if let Some(pid) = restored_pid(dir) {
        kill(pid);
    }
    assert_eq!(answer.0, answer.1, "memory restored lazily is intact");
    let report = report.unwrap();
    assert!(!killed.load(Ordering::SeqCst));
    report
}

/// Waits (30 s at most) until the holder restored into `dir` answers on `port`.
fn answer_of(dir: &Path, port: u16) -> (u64, u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(answer) = ask(port) {
            return answer;
        }
        assert!(
            Instant::now() < deadline,
            "the restored process never answered; logs in {}",
            dir.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A kill action for [`LazySession::watch`] that kills the restored process of `dir` and
/// records that it ran.
fn killer(dir: &Path) -> (impl FnOnce() + Send + 'static, Arc<AtomicBool>) {
    let (dir, killed) = (dir.to_path_buf(), Arc::new(AtomicBool::new(false)));
    let flag = killed.clone();
    let kill_restored = move || {
        flag.store(true, Ordering::SeqCst);
        if let Some(pid) = restored_pid(&dir) {
            kill(pid);
        }
    };
    (kill_restored, killed)
}

/// Ends the `criu restore` (a restore whose pages never came still waits) and reaps it.
fn end(mut restore: Child) {
    let _ = restore.kill();
    let _ = restore.wait();
}

#[test]
fn the_daemon_and_page_server_restore_memory_intact() {
    let (criu, _one_at_a_time) = criu_or_skip!();
    let dir = tempfile::tempdir().unwrap();
    let port = dump_holder(&criu, dir.path());
    let images = dir.path().join("images");
    let mut tasks = task_pagemaps(&images).unwrap();
    let (pid, pagemap) = tasks.remove(0);
    let (name, bytes, taken) = take_pages(&images);
    let lazy = taken.lazy_pages();
    let (source, digests) = MemorySource::of(&bytes, BLOCK, Duration::from_millis(2));
    let file = Arc::new(
        LazyFile::create(
            &images.join(name),
            bytes.len() as u64,
            BLOCK as u64,
            digests,
            Arc::new(source),
        )
        .unwrap(),
    );
    for range in pagemap.eager_ranges() {
        file.ensure(range).unwrap();
    }
    let mut server = PageServer::new();
    server.add_task(pid, Arc::new(pagemap), file.clone());
    let prefetch = file.prefetch(2);
    let daemon = LazyDaemon::start(
        Command::new(&criu),
        &images,
        &dir.path().join("work"),
        &dir.path().join("lazy.log"),
        Some(server),
    )
    .unwrap();
    let restored = start_restore(&criu, dir.path()).wait().unwrap();
    assert!(
        restored.success(),
        "lazy restore; logs in {}",
        dir.path().display()
    );
    let pid = restored_pid(dir.path()).expect("restored pid");
    let answer = ask(port);
    let report = daemon.wait();
    kill(pid);
    let (now, at_start) = answer.expect("the restored process answers");
    assert_eq!(now, at_start, "memory restored lazily is intact");
    let report = report.unwrap();
    assert!(report.served.closed);
    assert!(report.served.pages >= lazy, "{report:?}");
    prefetch.wait().unwrap();
    assert!(file.is_complete());
}

#[test]
fn a_session_restores_memory_intact_and_completes_the_pages_image() {
    let (criu, _one_at_a_time) = criu_or_skip!();
    let (dir, port, source, pages) =
        lazy_checkpoint(&criu, Blocks::Delayed(Duration::from_millis(2)));
    let session = start_session(&criu, dir.path(), &pages);
    let before = session.fetched_before_restore();
    let blocks = pages.files.values().map(|f| f.blocks.len() as u64).sum();
    assert!(
        before.blocks >= 1 && before.blocks < blocks,
        "only the restore's own blocks come first: {before:?} of {blocks}"
    );
    let report = restore_intact(&criu, dir.path(), port, session);
    assert!(report.served.closed);
    assert_eq!(report.fetched.blocks, blocks, "each block fetched once");
    assert_eq!(source.fetch_count() as u64, blocks);
    assert_eq!(report.before_restore, before);
    let (name, file) = pages.files.iter().next().unwrap();
    let on_disk = std::fs::metadata(dir.path().join("images").join(name)).unwrap();
    assert_eq!(on_disk.len(), file.size, "the pages image stays, complete");
}

#[test]
fn a_failing_block_source_kills_the_restored_process() {
    let (criu, _one_at_a_time) = criu_or_skip!();
    let (dir, _port, _source, pages) = lazy_checkpoint(&criu, Blocks::OnlyEager);
    let session = start_session(&criu, dir.path(), &pages);
    let restore = start_restore(&criu, dir.path());
    let (kill_restored, killed) = killer(dir.path());
    let err = session
        .watch(kill_restored)
        .wait()
        .expect_err("the transfer fails");
    end(restore);
    assert!(matches!(err, LazyError::Daemon(_)), "{err}");
    assert!(
        killed.load(Ordering::SeqCst),
        "the watcher ran the kill action"
    );
    if let Some(pid) = restored_pid(dir.path()) {
        assert!(ends(pid), "the restored process is gone");
    }
    let name = pages.files.keys().next().unwrap();
    assert!(
        !dir.path().join("images").join(name).exists(),
        "an incomplete pages image does not stay"
    );
}

#[test]
fn a_failed_daemon_freezes_the_tree_through_its_guard() {
    let (criu, _one_at_a_time) = criu_or_skip!();
    let (dir, _port, _source, pages) = lazy_checkpoint(&criu, Blocks::OnlyEager);
    // A plain file stands in for the cgroup's freeze file: the guard writes to it whoever
    // watches (here nobody: the session is never watched, as after a `kill -9`).
    let freeze = dir.path().join("freezer.state");
    std::fs::write(&freeze, "THAWED\n").unwrap();
    let session = start_guarded_session(&criu, dir.path(), &pages, Some((&freeze, "FROZEN")));
    let restore = start_restore(&criu, dir.path());
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::fs::read_to_string(&freeze).unwrap().trim() != "FROZEN" {
        assert!(
            Instant::now() < deadline,
            "the guard never froze the tree; logs in {}",
            dir.path().display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(session);
    end(restore);
    if let Some(pid) = restored_pid(dir.path()) {
        kill(pid);
    }
}

#[test]
fn a_local_checkpoint_restores_lazily_from_its_own_files() {
    let (criu, _one_at_a_time) = criu_or_skip!();
    let dir = tempfile::tempdir().unwrap();
    let port = dump_holder(&criu, dir.path());
    let images = dir.path().join("images");
    let pages = LazyPages::local(&images, Duration::from_secs(60), None).unwrap();
    assert!(pages.files.is_empty());
    assert_eq!(pages.complete.len(), 1, "{pages:?}");
    let before: Vec<u8> = std::fs::read(images.join(&pages.complete[0])).unwrap();
    let session = start_session(&criu, dir.path(), &pages);
    assert_eq!(
        session.fetched_before_restore().blocks,
        0,
        "nothing to fetch"
    );
    let report = restore_intact(&criu, dir.path(), port, session);
    let lazy: u64 = task_pagemaps(&images)
        .unwrap()
        .iter()
        .map(|(_, map)| map.lazy_pages())
        .sum();
    assert!(
        lazy >= (32 << 20) / PAGE_SIZE,
        "the memory was lazy: {lazy} pages"
    );
    // No page server: the daemon read the pages images itself.
    assert_eq!(report.served.pages, 0, "{report:?}");
    assert_eq!(report.fetched.blocks, 0, "nothing fetched: {report:?}");
    let after = std::fs::read(images.join(&pages.complete[0])).unwrap();
    assert!(
        before == after,
        "the checkpoint's pages image is left as it was"
    );
}

#[test]
fn a_transfer_past_its_timeout_kills_the_restored_process() {
    let (criu, _one_at_a_time) = criu_or_skip!();
    // 128 blocks at 300 ms each over 2 workers: about 20 s, against a 2 s timeout.
    let (dir, port, _source, mut pages) =
        lazy_checkpoint(&criu, Blocks::Delayed(Duration::from_millis(300)));
    pages.transfer_timeout = Some(Duration::from_secs(2));
    let session = start_session(&criu, dir.path(), &pages);
    let mut restore = start_restore(&criu, dir.path());
    assert!(
        restore.wait().unwrap().success(),
        "lazy restore; logs in {}",
        dir.path().display()
    );
    let (kill_restored, killed) = killer(dir.path());
    let clock = Instant::now();
    let err = session
        .watch(kill_restored)
        .wait()
        .expect_err("the transfer is too slow");
    assert!(
        clock.elapsed() < Duration::from_secs(15),
        "{:?}",
        clock.elapsed()
    );
    assert!(err.to_string().contains("did not finish within"), "{err}");
    assert!(killed.load(Ordering::SeqCst));
    let pid = restored_pid(dir.path()).expect("the restore finished before the timeout");
    assert!(ends(pid), "the restored process is gone");
    assert!(ask(port).is_none());
}

#[test]
fn a_restored_process_that_dies_mid_transfer_ends_the_transfer() {
    let (criu, _one_at_a_time) = criu_or_skip!();
    // 128 blocks at 100 ms each over 2 workers: about 6 s of transfer.
    let (dir, _port, _source, pages) =
        lazy_checkpoint(&criu, Blocks::Delayed(Duration::from_millis(100)));
    let session = start_session(&criu, dir.path(), &pages);
    let mut restore = start_restore(&criu, dir.path());
    assert!(restore.wait().unwrap().success());
    let pid = restored_pid(dir.path()).expect("restored pid");
    let clock = Instant::now();
    kill(pid);
    let (kill_restored, _) = killer(dir.path());
    let err = session
        .watch(kill_restored)
        .wait()
        .expect_err("its pages never all came");
    assert!(matches!(err, LazyError::Incomplete(_)), "{err}");
    assert!(
        clock.elapsed() < Duration::from_secs(3),
        "the transfer ended with the process, not with the background fetch: {:?}",
        clock.elapsed()
    );
    let name = pages.files.keys().next().unwrap();
    assert!(!dir.path().join("images").join(name).exists());
}
