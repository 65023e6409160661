//! The fencing witness of `verify cluster`: a collector on the run's test host (its own
//! network namespace on the bridge) to which test sandboxes report, every 100 ms, their token
//! and a count kept in their own memory. The collector notes where each report came from:
//! sandboxes leave their node masqueraded as the node's address, so the source says which
//! node ran the sandbox, whatever the sandbox claims.
//!
//! A sandbox that ran on two nodes at once (a fenced node's copy still running while another
//! node resumed it) shows as reports from two sources whose spans overlap.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// How often a reporter reports.
const EVERY: &str = "0.1";

/// One report as received.
#[derive(Debug, Clone)]
pub struct Report {
    pub token: String,
    /// The count the sandbox kept in its memory.
    pub count: u64,
    pub from: Ipv4Addr,
    pub at: Instant,
}

/// The collector: a thread accepting reports until dropped.
pub struct Collector {
    pub addr: SocketAddr,
    reports: Arc<Mutex<Vec<Report>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Collector {
    /// Listens on `ip` (a free port) in network namespace `netns`.
    pub fn start(netns: &str, ip: Ipv4Addr) -> anyhow::Result<Self> {
        let (bound, listening) = std::sync::mpsc::channel();
        let reports = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (sink, stopped) = (reports.clone(), stop.clone());
        let netns = netns.to_string();
        let thread = std::thread::Builder::new()
            .name("collector".into())
            .spawn(move || {
                // This thread alone moves into the test host's namespace.
                let listener = crate::scenario_net::enter_thread(&netns).and_then(|()| {
                    let l = TcpListener::bind((ip, 0)).context("bind the collector")?;
                    l.set_nonblocking(true)?;
                    Ok(l)
                });
                let listener = match listener {
                    Ok(l) => {
                        let _ = bound.send(l.local_addr().map_err(anyhow::Error::from));
                        l
                    }
                    Err(e) => {
                        let _ = bound.send(Err(e));
                        return;
                    }
                };
                serve(&listener, &sink, &stopped);
            })
            .context("start the collector's thread")?;
        let addr = listening.recv().context("the collector's thread ended")??;
        Ok(Self {
            addr,
            reports,
            stop,
            thread: Some(thread),
        })
    }

    /// The shell line that makes a sandbox report as `token` in the background.
    pub fn reporter(&self, token: &str) -> String {
        format!(
            "(i=0; while :; do i=$((i+1)); echo \"{token} $i\" | nc -w 1 {} {} ; \
             sleep {EVERY}; done) > /dev/null 2>&1 &",
            self.addr.ip(),
            self.addr.port()
        )
    }

    /// Every report so far.
    pub fn reports(&self) -> Vec<Report> {
        self.reports.lock().expect("collector lock").clone()
    }

    /// The reports of `token` so far.
    pub fn of(&self, token: &str) -> Vec<Report> {
        self.reports()
            .into_iter()
            .filter(|r| r.token == token)
            .collect()
    }

    /// Waits until `token` reported from `from`, at most `within`.
    pub fn wait_for(&self, token: &str, from: Ipv4Addr, within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        while !self.of(token).iter().any(|r| r.from == from) {
            if Instant::now() >= deadline {
                bail!("{token} did not report from {from} within {within:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn serve(listener: &TcpListener, sink: &Mutex<Vec<Report>>, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, peer)) => {
                let at = Instant::now();
                let std::net::IpAddr::V4(from) = peer.ip() else {
                    continue;
                };
                let _ = stream.set_nonblocking(false);
                let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
                let mut line = String::new();
                if BufReader::new(&stream).read_line(&mut line).is_err() {
                    continue;
                }
                let mut words = line.split_whitespace();
                let (Some(token), Some(count)) = (words.next(), words.next()) else {
                    continue;
                };
                let Ok(count) = count.parse() else { continue };
                sink.lock().expect("collector lock").push(Report {
                    token: token.to_string(),
                    count,
                    from,
                    at,
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

/// Where one token reported from: per source, its first and last report.
pub fn spans(reports: &[Report]) -> BTreeMap<Ipv4Addr, (Instant, Instant)> {
    let mut spans: BTreeMap<Ipv4Addr, (Instant, Instant)> = BTreeMap::new();
    for r in reports {
        let span = spans.entry(r.from).or_insert((r.at, r.at));
        span.0 = span.0.min(r.at);
        span.1 = span.1.max(r.at);
    }
    spans
}

/// The tokens that reported from two sources in overlapping spans (ran on two nodes at
/// once), each with its spans.
pub fn doubles(reports: &[Report]) -> Vec<String> {
    let mut by_token: BTreeMap<&str, Vec<Report>> = BTreeMap::new();
    for r in reports {
        by_token.entry(&r.token).or_default().push(r.clone());
    }
    let mut found = Vec::new();
    for (token, reports) in by_token {
        let spans: Vec<_> = spans(&reports).into_iter().collect();
        for (i, (a, (a0, a1))) in spans.iter().enumerate() {
            for (b, (b0, b1)) in &spans[i + 1..] {
                if a0 <= b1 && b0 <= a1 {
                    found.push(format!("{token} reported from {a} and {b} at once"));
                }
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(token: &str, from: [u8; 4], ms: u64, base: Instant) -> Report {
        Report {
            token: token.into(),
            count: ms,
            from: Ipv4Addr::from(from),
            at: base + Duration::from_millis(ms),
        }
    }

    #[test]
    fn a_token_that_moved_is_not_a_double_but_one_on_two_nodes_at_once_is() {
        let t = Instant::now();
        let moved = [
            report("a", [10, 0, 0, 2], 0, t),
            report("a", [10, 0, 0, 2], 100, t),
            report("a", [10, 0, 0, 3], 200, t),
            report("a", [10, 0, 0, 3], 300, t),
        ];
        assert!(doubles(&moved).is_empty());
        let mut twice = moved.to_vec();
        twice.push(report("a", [10, 0, 0, 2], 250, t));
        twice.push(report("b", [10, 0, 0, 2], 250, t));
        assert_eq!(
            doubles(&twice),
            ["a reported from 10.0.0.2 and 10.0.0.3 at once"]
        );
    }
}
