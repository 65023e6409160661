//! A long-lived interpreter (bash, or the python driver) fed one execution at a time.
//!
//! Bash sessions and code contexts keep state between runs, so they cannot be one process per
//! run. Each run writes a script to the interpreter's stdin that ends by printing a random
//! sentinel (fresh from getrandom for every run) on stdout, followed by a trailer (the exit
//! code, or the python driver's JSON result), and the same sentinel on stderr. Output before
//! the sentinels is the run's output; since a sentinel holds no newline, every complete line
//! before it can be streamed as soon as it arrives. An interpreter that dies mid-run (`exit`
//! in a session) or is killed by a timeout is reported and replaced on the next run.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::{ChildStderr, ChildStdin, ChildStdout};
use tokio::sync::{Mutex, watch};

use crate::ids;
use crate::lines::LineSplitter;
use crate::process::{LaunchError, Spawned};
use crate::reaper::ExitStatus;
use crate::sse::{EventTx, Stream, StreamEvent};

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunEnd {
    /// Both sentinels arrived; the text after the stdout sentinel.
    Done(String),
    /// The interpreter exited during the run.
    Died(ExitStatus),
    /// The run exceeded its timeout and the interpreter's process group was killed.
    TimedOut,
}

pub struct Repl {
    pub pid: i32,
    io: Mutex<Io>,
    exit: watch::Receiver<Option<ExitStatus>>,
    /// Lines keep their `\n` (code contexts) or lose it (sessions).
    keep_terminators: bool,
}

struct Io {
    stdin: ChildStdin,
    out: SentinelReader<ChildStdout>,
    err: SentinelReader<ChildStderr>,
}

impl Repl {
    /// Wraps a child spawned with piped stdin, stdout and stderr.
    pub fn new(mut child: Spawned, keep_terminators: bool) -> Result<Self, LaunchError> {
        let missing = || LaunchError::Spawn {
            program: "interpreter".into(),
            source: std::io::Error::other("missing pipe"),
        };
        let io = Io {
            stdin: child.stdin.take().ok_or_else(missing)?,
            out: SentinelReader::new(child.stdout.take().ok_or_else(missing)?),
            err: SentinelReader::new(child.stderr.take().ok_or_else(missing)?),
        };
        let (tx, rx) = watch::channel(None);
        let exit = child.exit;
        tokio::spawn(async move {
            let status = exit.await;
            let _ = tx.send(Some(status));
        });
        Ok(Repl {
            pid: child.pid,
            io: Mutex::new(io),
            exit: rx,
            keep_terminators,
        })
    }

    pub fn is_alive(&self) -> bool {
        self.exit.borrow().is_none()
    }

    /// A new sentinel for one run.
    pub fn sentinel() -> String {
        format!("__FASTBOX_{}__", ids::random_hex(16))
    }

    /// Sends `script` (which must print `sentinel` as described above) and streams the output
    /// to `tx` until the run ends. Runs on one interpreter are serialized.
    pub async fn run(
        &self,
        script: &[u8],
        sentinel: &str,
        tx: &EventTx,
        timeout: Option<Duration>,
    ) -> RunEnd {
        let mut io = self.io.lock().await;
        let Io { stdin, out, err } = &mut *io;
        let keep = self.keep_terminators;
        let work = async {
            if stdin.write_all(script).await.is_err() || stdin.flush().await.is_err() {
                return None;
            }
            let (o, e) = tokio::join!(
                out.read_until(sentinel.as_bytes(), Stream::Stdout, tx, keep),
                err.read_until(sentinel.as_bytes(), Stream::Stderr, tx, keep),
            );
            match (o, e) {
                (Some(trailer), Some(_)) => Some(trailer),
                _ => None,
            }
        };
        let finished = match timeout {
            None => Some(work.await),
            Some(limit) => tokio::time::timeout(limit, work).await.ok(),
        };
        match finished {
            Some(Some(trailer)) => RunEnd::Done(trailer),
            Some(None) => RunEnd::Died(self.wait_exit().await),
            None => {
                crate::process::signal_group(self.pid, nix::sys::signal::Signal::SIGKILL);
                let _ = self.wait_exit().await;
                RunEnd::TimedOut
            }
        }
    }

    async fn wait_exit(&self) -> ExitStatus {
        let mut rx = self.exit.clone();
        let waited =
            tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|s| s.is_some())).await;
        match waited {
            Ok(Ok(s)) => s.unwrap_or(ExitStatus::Signaled(libc::SIGKILL)),
            _ => ExitStatus::Signaled(libc::SIGKILL),
        }
    }

    /// Sends `sig` to the interpreter process only (python turns SIGINT into KeyboardInterrupt).
    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid), sig);
    }

    /// Kills the interpreter and everything it started.
    pub fn kill(&self) {
        crate::process::signal_group(self.pid, nix::sys::signal::Signal::SIGKILL);
    }
}

impl Drop for Repl {
    fn drop(&mut self) {
        if self.is_alive() {
            self.kill();
        }
    }
}

/// Reads one stream up to a sentinel, emitting the lines before it.
struct SentinelReader<R> {
    reader: R,
    pending: Vec<u8>,
}

impl<R: AsyncRead + Unpin> SentinelReader<R> {
    fn new(reader: R) -> Self {
        SentinelReader {
            reader,
            pending: Vec::new(),
        }
    }

    /// `None` on EOF before the sentinel's line was complete.
    async fn read_until(
        &mut self,
        sentinel: &[u8],
        stream: Stream,
        tx: &EventTx,
        keep: bool,
    ) -> Option<String> {
        let mut splitter = if keep {
            LineSplitter::keeping()
        } else {
            LineSplitter::stripping()
        };
        let mut lines = Vec::new();
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            if let Some(pos) = find(&self.pending, sentinel) {
                if let Some(nl) = self.pending[pos..].iter().position(|&b| b == b'\n') {
                    splitter.push(&self.pending[..pos], &mut lines);
                    lines.extend(splitter.finish());
                    for line in lines.drain(..) {
                        tx.send(StreamEvent::output(stream, line)).await;
                    }
                    let trailer =
                        String::from_utf8_lossy(&self.pending[pos + sentinel.len()..pos + nl])
                            .trim()
                            .to_string();
                    self.pending.drain(..pos + nl + 1);
                    return Some(trailer);
                }
            } else if let Some(last_nl) = self.pending.iter().rposition(|&b| b == b'\n') {
                splitter.push(&self.pending[..=last_nl], &mut lines);
                self.pending.drain(..=last_nl);
                for line in lines.drain(..) {
                    tx.send(StreamEvent::output(stream, line)).await;
                }
            }
            match self.reader.read(&mut buf).await {
                Ok(0) | Err(_) => {
                    splitter.push(&std::mem::take(&mut self.pending), &mut lines);
                    lines.extend(splitter.finish());
                    for line in lines.drain(..) {
                        tx.send(StreamEvent::output(stream, line)).await;
                    }
                    return None;
                }
                Ok(n) => self.pending.extend_from_slice(&buf[..n]),
            }
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Quotes `s` as one POSIX shell word.
pub fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// The script one bash run sends: the command is `eval`ed in the interpreter itself (so `cd`
/// and `export` persist) with stdin from /dev/null (so it cannot eat the next script), in
/// `cwd` for this run only when one is given.
pub fn shell_script(command: &str, cwd: Option<&str>, sentinel: &str) -> String {
    let mut s = String::new();
    match cwd {
        Some(dir) => s.push_str(&format!(
            "__fb_prev=\"$PWD\"\ncd -- {} && eval {} < /dev/null\n__fb_ec=$?\ncd -- \"$__fb_prev\" 2>/dev/null\n",
            shell_quote(dir),
            shell_quote(command)
        )),
        None => s.push_str(&format!("eval {} < /dev/null\n__fb_ec=$?\n", shell_quote(command))),
    }
    s.push_str(&format!(
        "printf '%s %d\\n' '{sentinel}' \"$__fb_ec\"\nprintf '%s\\n' '{sentinel}' >&2\n"
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_survives_single_quotes() {
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
    }

    #[test]
    fn script_prints_sentinels_on_both_streams() {
        let s = shell_script("echo hi", Some("/tmp"), "S");
        assert!(s.contains("cd -- '/tmp' && eval 'echo hi' < /dev/null"));
        assert!(s.contains("printf '%s %d\\n' 'S' \"$__fb_ec\""));
        assert!(s.ends_with(">&2\n"));
    }
}
