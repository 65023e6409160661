//! CRIU's post-dump action, served by this process. CRIU runs the action once the images
//! are complete and before it lets the tree run again: what must match the memory (the
//! writable layer) is captured then.
//!
//! Every process the action starts is part of the freeze (about 1-2.5 ms each here: `cp`,
//! `timeout`, `head`). So the action is a `sh` script that starts nothing on its path: it
//! asks over one FIFO (`echo` into it) and waits for the answer on another (`read`), both
//! shell built-ins, while a thread of this process does the work ([`PostDumpHook::start`])
//! and answers `ok` or `failed`. This process holds both FIFOs open (read-write) from the
//! start, so the script never waits to open one. They live in a private directory beside the
//! checkpoint, on its file system as the script of old did (CRIU executes the script, so a
//! `noexec` temporary directory would not do), never in it (a FIFO left there by a crash
//! would be read as part of the checkpoint).
//!
//! Should this process die, the tree must not stay frozen. The script reads the answer
//! through a read-only descriptor of its own and holds no write end, so once this process
//! (the only writer) is gone, before the script's read or during it, the read ends with
//! nothing: the action fails, and CRIU fails the dump and lets the tree run. The script
//! starts no process (a watchdog in the background, tried first, held CRIU's descriptors and
//! the slot's network namespace for a second after the dump). A process that is alive but
//! never answers is not waited out: the work given must bound itself (the streamer's drain
//! does).

use std::fs::{self, File};
use std::io::{self, BufRead as _, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

/// The script, and the FIFOs it asks and is answered on, in the hook's directory.
const SCRIPT: &str = ".post-dump";
const ASK_FIFO: &str = ".post-dump.ask";
const ANSWER_FIFO: &str = ".post-dump.answer";
/// What the script asks with, and the answer that lets the dump succeed.
const ASK: &str = "post-dump";
const OK: &str = "ok";
/// What [`PostDumpHook::finish`] writes to end a thread no action asked.
const STOP: &str = "stop";

#[derive(Debug, thiserror::Error)]
pub enum PostDumpError {
    #[error("post-dump action: {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

/// A post-dump action being served (see the module docs); its work's error is `E`.
pub struct PostDumpHook<E> {
    dir: tempfile::TempDir,
    /// The ask FIFO, also open in the thread: [`STOP`] is written through it.
    ask: File,
    /// The answer FIFO, open until the hook ends: an answer written before the script opens
    /// the FIFO stays there for it (a FIFO that nobody holds open loses its data).
    _answer: File,
    thread: Option<JoinHandle<Option<Result<(), E>>>>,
}

impl<E> std::fmt::Debug for PostDumpHook<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostDumpHook")
            .field("dir", &self.dir.path())
            .finish_non_exhaustive()
    }
}

impl<E: Send + 'static> PostDumpHook<E> {
    /// Writes the action script and its FIFOs into a new directory beside `beside` (the
    /// checkpoint directory; the temporary directory when it has no parent) and serves them:
    /// `work` runs when CRIU's post-dump action asks (the tree frozen, the images complete).
    pub fn start(
        beside: &Path,
        work: impl FnOnce() -> Result<(), E> + Send + 'static,
    ) -> Result<Self, PostDumpError> {
        let parent = beside
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .map_or_else(std::env::temp_dir, Path::to_path_buf);
        let dir = tempfile::Builder::new()
            .prefix(".post-dump.")
            .tempdir_in(&parent)
            .map_err(io_err("make a directory in", &parent))?;
        let path = dir.path();
        let ask = open_fifo(&path.join(ASK_FIFO))?;
        let answer = open_fifo(&path.join(ANSWER_FIFO))?;
        let script = path.join(SCRIPT);
        write_script(
            &script,
            &script_text(&path.join(ASK_FIFO), &path.join(ANSWER_FIFO)),
        )
        .map_err(io_err("write", &script))?;
        let asked = ask
            .try_clone()
            .map_err(io_err("open", &path.join(ASK_FIFO)))?;
        let answering = answer
            .try_clone()
            .map_err(io_err("open", &path.join(ANSWER_FIFO)))?;
        let thread = std::thread::Builder::new()
            .name("fastbox-post-dump".into())
            .spawn(move || serve(asked, answering, work))
            .map_err(io_err("start a thread for", path))?;
        Ok(Self {
            dir,
            ask,
            _answer: answer,
            thread: Some(thread),
        })
    }

    /// The executable to give CRIU (`--action-script`).
    pub fn script(&self) -> PathBuf {
        self.dir.path().join(SCRIPT)
    }

    /// After the dump: what the work returned, or `None` when no post-dump action asked
    /// (the dump failed before). The script and FIFOs go with the hook.
    pub fn finish(mut self) -> Option<Result<(), E>> {
        self.end()
    }
}

impl<E> PostDumpHook<E> {
    fn end(&mut self) -> Option<Result<(), E>> {
        let thread = self.thread.take()?;
        // Unread when the action asked first; it only ends a thread still waiting.
        let _ = writeln!(self.ask, "{STOP}");
        thread.join().ok().flatten()
    }
}

impl<E> Drop for PostDumpHook<E> {
    fn drop(&mut self) {
        let _ = self.end();
    }
}

/// The thread: waits for the first line on the ask FIFO; runs `work` when it is the
/// action's and answers.
fn serve<E>(
    ask: File,
    mut answer: File,
    work: impl FnOnce() -> Result<(), E>,
) -> Option<Result<(), E>> {
    let mut line = String::new();
    BufReader::new(ask).read_line(&mut line).ok()?;
    if line.trim_end() != ASK {
        return None;
    }
    let done = work();
    let reply = if done.is_ok() { OK } else { "failed" };
    let _ = writeln!(answer, "{reply}");
    Some(done)
}

/// The action script (see the module docs). It opens the answer FIFO read-write first, so
/// the read-only open that follows never waits for a writer, then closes the read-write one:
/// the writers left are this process's.
fn script_text(ask: &Path, answer: &Path) -> String {
    let (ask, answer) = (shell_quote(ask), shell_quote(answer));
    format!(
        "#!/bin/sh\n\
         # fastbox: CRIU's post-dump action, answered by process {pid}.\n\
         [ \"$CRTOOLS_SCRIPT_ACTION\" = {ASK} ] || exit 0\n\
         echo {ASK} 1<>{ask}\n\
         exec 3<>{answer} 4<{answer} 3>&-\n\
         read -r answer <&4\n\
         [ \"$answer\" = {OK} ]\n",
        pid = std::process::id()
    )
}

/// Makes FIFO `path` and opens it read-write: never blocks, and keeps it open for both ends.
fn open_fifo(path: &Path) -> Result<File, PostDumpError> {
    nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o600))
        .map_err(|e| io_err("make", path)(e.into()))?;
    fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(io_err("open", path))
}

/// CRIU executes the script as soon as the images are written: it must not be busy then.
fn write_script(path: &Path, text: &str) -> io::Result<()> {
    crate::exec_file::write_executable(path, text.as_bytes(), 0o700)
}

/// `'path'` for `sh`.
fn shell_quote(path: &Path) -> String {
    format!("'{}'", path.to_string_lossy().replace('\'', "'\\''"))
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> PostDumpError {
    let path = path.to_path_buf();
    move |source| PostDumpError::Io { what, path, source }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;
    use std::time::{Duration, Instant};

    /// Runs the script as CRIU does, for `action`; its exit status and how long it took.
    fn run_action(script: &Path, action: &str) -> (bool, Duration) {
        let clock = Instant::now();
        let status = Command::new(script)
            .env("CRTOOLS_SCRIPT_ACTION", action)
            .status()
            .unwrap();
        (status.success(), clock.elapsed())
    }

    #[test]
    fn the_action_runs_the_work_and_succeeds_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("copied");
        let checkpoint = dir.path().join("checkpoint");
        let hook = {
            let marker = marker.clone();
            PostDumpHook::start(&checkpoint, move || fs::write(&marker, "x")).unwrap()
        };
        assert_eq!(hook.script().parent().unwrap().parent(), Some(dir.path()));
        let script = hook.script();
        assert!(run_action(&hook.script(), "network-lock").0);
        assert!(!marker.exists(), "only the post-dump action runs the work");
        assert!(run_action(&hook.script(), "post-dump").0);
        assert!(marker.exists());
        assert!(hook.finish().unwrap().is_ok());
        assert!(
            !script.parent().unwrap().exists(),
            "the hook's files stayed"
        );
    }

    #[test]
    fn failed_work_fails_the_action_and_is_returned() {
        let dir = tempfile::tempdir().unwrap();
        let hook = PostDumpHook::start(&dir.path().join("c"), || Err("no room")).unwrap();
        assert!(!run_action(&hook.script(), "post-dump").0);
        assert_eq!(hook.finish(), Some(Err("no room")));
    }

    #[test]
    fn a_dump_without_the_action_lets_the_thread_go() {
        let dir = tempfile::tempdir().unwrap();
        let beside = dir.path().join("c");
        let hook = PostDumpHook::<()>::start(&beside, || panic!("never asked")).unwrap();
        let script = hook.script();
        assert!(hook.finish().is_none());
        assert!(!script.exists());
        // Dropped unfinished, too.
        let hook = PostDumpHook::<()>::start(&beside, || Ok(())).unwrap();
        let script = hook.script();
        drop(hook);
        assert!(!script.parent().unwrap().exists());
    }

    /// FIFOs as [`PostDumpHook::start`] makes them, held by nobody, and the script.
    fn unserved(dir: &Path) -> (PathBuf, PathBuf) {
        let (ask, answer) = (dir.join(ASK_FIFO), dir.join(ANSWER_FIFO));
        for fifo in [&ask, &answer] {
            nix::unistd::mkfifo(
                fifo.as_path(),
                nix::sys::stat::Mode::from_bits_truncate(0o600),
            )
            .unwrap();
        }
        let script = dir.join(SCRIPT);
        write_script(&script, &script_text(&ask, &answer)).unwrap();
        (script, answer)
    }

    #[test]
    fn a_server_that_is_gone_does_not_leave_the_tree_frozen() {
        // Gone before the action: nobody holds the FIFOs.
        let dir = tempfile::tempdir().unwrap();
        let (script, answer) = unserved(dir.path());
        let (ok, took) = run_action(&script, "post-dump");
        assert!(!ok, "the action succeeded without its server");
        assert!(took < Duration::from_secs(5), "took {took:?}");

        // Gone while the action waits: a stand-in server holds the answer FIFO, then dies.
        let mut server = Command::new("sh")
            .arg("-c")
            .arg(format!("exec 3<>{}; exec sleep 30", shell_quote(&answer)))
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let mut action = Command::new(&script)
            .env("CRTOOLS_SCRIPT_ACTION", "post-dump")
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            action.try_wait().unwrap().is_none(),
            "the action did not wait for its answer"
        );
        server.kill().unwrap();
        server.wait().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let status = loop {
            if let Some(status) = action.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "the action outlived its server");
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(!status.success(), "the action succeeded without its server");
    }
}
