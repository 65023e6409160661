//! The guard process: `fastbox node-fence-guard`, its deadline on two clocks and its loop.

use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fastbox_fastlet::fence::{CgroupSource, NodeCgroups};
use nix::fcntl::{Flock, FlockArg};
use nix::sys::signal::{SigSet, Signal};

use super::{FenceGuardError, FencedMarker, Identity, LOCK_FILE, MAX_LINE, unix_millis};

/// How often a pending deadline is checked against the wall clock as well.
const WALL_CHECK: Duration = Duration::from_millis(250);

#[derive(clap::Args, Debug)]
pub struct FenceGuardArgs {
    /// The node's data directory (lock file and fence marker).
    #[arg(long)]
    pub data_dir: PathBuf,
    /// The node's instance prefix (its sandbox cgroups are `{prefix}/{id}`).
    #[arg(long)]
    pub prefix: String,
    /// Where the node's cgroups are: `detect` (as the fastlet finds them) or `unified`.
    #[arg(long, default_value_t = CgroupSource::Detect)]
    pub cgroups: CgroupSource,
}

/// A line from the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    Renew(SystemTime),
    Release,
}

fn parse_line(line: &str) -> Result<Line, String> {
    let line = line.trim_end_matches(['\n', '\r']);
    if line == "release" {
        return Ok(Line::Release);
    }
    let millis = line
        .strip_prefix("renew ")
        .and_then(|m| m.parse::<u64>().ok())
        .ok_or_else(|| format!("unknown line {line:?}"))?;
    UNIX_EPOCH
        .checked_add(Duration::from_millis(millis))
        .map(Line::Renew)
        .ok_or_else(|| format!("deadline out of range: {line:?}"))
}

/// The pending deadline, on both clocks.
#[derive(Debug, Clone, Copy)]
struct Deadline {
    wall: SystemTime,
    mono: Instant,
}

impl Deadline {
    /// `wall` converted to the monotonic clock at `now`.
    fn new(wall: SystemTime, now_wall: SystemTime, now_mono: Instant) -> Deadline {
        let left = wall.duration_since(now_wall).unwrap_or_default();
        let mono = now_mono
            .checked_add(left)
            .unwrap_or(now_mono + Duration::from_secs(365 * 24 * 3600));
        Deadline { wall, mono }
    }

    /// Due when either clock has reached it.
    fn due(&self, now_wall: SystemTime, now_mono: Instant) -> bool {
        now_mono >= self.mono || now_wall >= self.wall
    }

    /// How long to sleep before looking again.
    fn wait(&self, now_mono: Instant) -> Duration {
        self.mono
            .saturating_duration_since(now_mono)
            .min(WALL_CHECK)
    }

    fn now_due(&self) -> bool {
        self.due(SystemTime::now(), Instant::now())
    }
}

/// What the guard's threads tell its main loop.
#[derive(Debug)]
enum Event {
    Line(Result<Line, String>),
    /// The agent's pipe closed (or failed).
    Eof,
    Signal(Signal),
    Locked(Flock<File>),
}

/// Where the agent is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Agent {
    Running,
    Released,
    Gone,
}

/// `fastbox node-fence-guard`: runs until it fenced, was taken over, or its agent ended
/// without a deadline. Exit status 0, or 1 when a fence left errors.
pub fn run(args: FenceGuardArgs) -> Result<i32, FenceGuardError> {
    // Blocked before any thread starts, so every thread inherits the mask and only the
    // signal thread receives them.
    let signals = {
        let mut set = SigSet::empty();
        for s in [
            Signal::SIGUSR1,
            Signal::SIGTERM,
            Signal::SIGINT,
            Signal::SIGHUP,
        ] {
            set.add(s);
        }
        set
    };
    signals.thread_block().map_err(FenceGuardError::Signals)?;
    let cgroups =
        NodeCgroups::open(args.cgroups, &args.prefix).map_err(FenceGuardError::Cgroups)?;
    let (tx, rx) = mpsc::channel();
    spawn_thread("signals", {
        let tx = tx.clone();
        move || {
            while let Ok(signal) = signals.wait() {
                if tx.send(Event::Signal(signal)).is_err() {
                    return;
                }
            }
        }
    });
    spawn_thread("agent", {
        let tx = tx.clone();
        move || read_agent(&tx)
    });
    spawn_thread("lock", {
        let tx = tx.clone();
        let path = args.data_dir.join(LOCK_FILE);
        move || match take_lock(&path) {
            Ok(lock) => {
                let _ = tx.send(Event::Locked(lock));
            }
            Err(e) => tracing::warn!(
                "fence guard lock {}: {e} (guarding without it)",
                path.display()
            ),
        }
    });
    say("ready");
    let guard = Guard {
        cgroups,
        data_dir: args.data_dir,
    };
    // `tx` stays here: the channel never disconnects.
    let code = guard.watch(&rx);
    drop(tx);
    Ok(code)
}

struct Guard {
    cgroups: NodeCgroups,
    data_dir: PathBuf,
}

impl Guard {
    fn watch(&self, rx: &mpsc::Receiver<Event>) -> i32 {
        let mut deadline: Option<Deadline> = None;
        let mut agent = Agent::Running;
        let mut _lock: Option<Flock<File>> = None;
        loop {
            if let Some(d) = &deadline
                && d.now_due()
            {
                let reason = match agent {
                    Agent::Running => "the agent did not renew the lease in time",
                    Agent::Released => "the agent stopped and no new agent took over",
                    Agent::Gone => "the agent ended (exited or was killed)",
                };
                return self.fence(d, reason);
            }
            if agent != Agent::Running && deadline.is_none() {
                tracing::info!("the agent stopped before any renewal: nothing to guard");
                return 0;
            }
            let event = match &deadline {
                Some(d) => match rx.recv_timeout(d.wait(Instant::now())) {
                    Ok(event) => event,
                    Err(_) => continue,
                },
                None => match rx.recv() {
                    Ok(event) => event,
                    Err(_) => return 0,
                },
            };
            match event {
                Event::Line(Ok(Line::Renew(at))) if agent == Agent::Running => {
                    if deadline.is_none() {
                        say("armed");
                        tracing::info!("fence guard armed");
                    }
                    deadline = Some(Deadline::new(at, SystemTime::now(), Instant::now()));
                }
                Event::Line(Ok(line)) if agent != Agent::Running => {
                    tracing::warn!("fence guard: {line:?} after the agent stopped: ignored");
                }
                Event::Line(Ok(_)) => {
                    agent = Agent::Released;
                    self.note_end("stopped", deadline.as_ref());
                }
                Event::Line(Err(bad)) => tracing::warn!("fence guard: {bad}: ignored"),
                Event::Eof => {
                    if agent == Agent::Running {
                        agent = Agent::Gone;
                        self.note_end("ended", deadline.as_ref());
                    }
                }
                Event::Signal(Signal::SIGHUP) => {}
                Event::Signal(Signal::SIGUSR1) => match &deadline {
                    Some(d) if d.now_due() => continue,
                    _ => {
                        tracing::info!("a new agent's fence guard took over: exiting unfenced");
                        return 0;
                    }
                },
                Event::Signal(signal) => {
                    return match &deadline {
                        Some(d) => self.fence(d, &format!("the guard was stopped ({signal})")),
                        None => 0,
                    };
                }
                Event::Locked(lock) => _lock = Some(lock),
            }
        }
    }

    fn note_end(&self, how: &str, deadline: Option<&Deadline>) {
        if let Some(d) = deadline {
            tracing::warn!(
                deadline_unix_ms = unix_millis(d.wall),
                "the node agent {how}: its sandboxes are frozen at the lease deadline unless a new agent takes over"
            );
        }
    }

    /// Freezes the node, leaves the marker, logs; the exit status.
    fn fence(&self, deadline: &Deadline, reason: &str) -> i32 {
        let report = self.cgroups.freeze_all();
        let marker = FencedMarker {
            fenced_at_unix_ms: unix_millis(SystemTime::now()),
            deadline_unix_ms: unix_millis(deadline.wall),
            frozen: report.frozen.len(),
            sandboxes: report.frozen.clone(),
            errors: report.errors.iter().map(ToString::to_string).collect(),
            reason: reason.to_string(),
        };
        let written = marker.write(&self.data_dir);
        tracing::error!(
            prefix = self.cgroups.prefix(),
            frozen = marker.frozen,
            errors = marker.errors.len(),
            deadline_unix_ms = marker.deadline_unix_ms,
            "FENCED: the lease deadline passed without renewal ({reason}); every sandbox of this node is frozen"
        );
        for e in &marker.errors {
            tracing::error!("fence: {e}");
        }
        if let Err(e) = &written {
            tracing::error!("fence: {e}");
        }
        i32::from(!marker.errors.is_empty() || written.is_err())
    }
}

/// Reads the agent's lines until end of file.
fn read_agent(tx: &mpsc::Sender<Event>) {
    let mut input = BufReader::new(io::stdin());
    loop {
        let mut line = Vec::new();
        let read = (&mut input)
            .take(MAX_LINE as u64)
            .read_until(b'\n', &mut line);
        let event = match read {
            Ok(0) => Event::Eof,
            Ok(_) if line.ends_with(b"\n") => {
                Event::Line(parse_line(&String::from_utf8_lossy(&line)))
            }
            Ok(_) if line.len() >= MAX_LINE => {
                // The rest of an overlong line is skipped up to its newline.
                let _ = input.skip_until(b'\n');
                Event::Line(Err("line too long".to_string()))
            }
            // A last line without its newline: the agent ended mid-write.
            Ok(_) => Event::Line(Err(format!(
                "incomplete line {:?}",
                String::from_utf8_lossy(&line)
            ))),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::warn!("fence guard: reading the agent's pipe: {e}");
                Event::Eof
            }
        };
        let end = matches!(event, Event::Eof);
        if tx.send(event).is_err() || end {
            return;
        }
    }
}

/// Takes the data directory's guard lock (waiting for a previous guard) and names this
/// process in it.
pub(super) fn take_lock(path: &Path) -> io::Result<Flock<File>> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)?;
    let lock = Flock::lock(file, FlockArg::LockExclusive).map_err(|(_, e)| io::Error::from(e))?;
    let me = Identity::of(std::process::id())
        .ok_or_else(|| io::Error::other("no start time in /proc/self/stat"))?;
    let line = me.line();
    // Written over the old content, then cut: a reader sees the new first line.
    lock.write_all_at(line.as_bytes(), 0)?;
    lock.set_len(line.len() as u64)?;
    Ok(lock)
}

/// One line to the agent; failures are ignored (the agent may be gone).
fn say(line: &str) {
    let mut out = io::stdout().lock();
    let _ = out.write_all(format!("{line}\n").as_bytes());
    let _ = out.flush();
}

fn spawn_thread(name: &str, f: impl FnOnce() + Send + 'static) {
    if let Err(e) = std::thread::Builder::new()
        .name(format!("fence-guard-{name}"))
        .spawn(f)
    {
        tracing::error!("fence guard: start the {name} thread: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_parse() {
        let at = UNIX_EPOCH + Duration::from_millis(1_700_000_000_123);
        assert_eq!(parse_line("renew 1700000000123\n"), Ok(Line::Renew(at)));
        assert_eq!(parse_line("release\n"), Ok(Line::Release));
        for bad in ["renew\n", "renew -1\n", "renew 12x\n", "stop\n", ""] {
            assert!(parse_line(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_deadline_is_due_at_whichever_clock_reaches_it_first() {
        let (wall, mono) = (SystemTime::now(), Instant::now());
        let d = Deadline::new(wall + Duration::from_secs(10), wall, mono);
        assert!(!d.due(wall, mono));
        assert_eq!(d.wait(mono), WALL_CHECK);
        // The monotonic clock reaches it.
        assert!(d.due(wall, mono + Duration::from_secs(10)));
        // The wall clock stepped forward: early.
        assert!(d.due(
            wall + Duration::from_secs(3600),
            mono + Duration::from_secs(1)
        ));
        // The wall clock stepped back: not late.
        assert!(d.due(
            wall - Duration::from_secs(3600),
            mono + Duration::from_secs(10)
        ));
        assert_eq!(
            d.wait(mono + Duration::from_millis(9_900)),
            Duration::from_millis(100)
        );
        // A deadline already past is due at once.
        let past = Deadline::new(wall - Duration::from_secs(1), wall, mono);
        assert!(past.due(wall - Duration::from_secs(5), mono));
    }
}
