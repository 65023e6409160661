//! Progress reporting: resolution can take minutes (debootstrap, large layers), so callers get
//! human-readable lines and byte counts as they happen.

use std::io::Write;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Receives progress of one resolution. Implementations must be cheap: `bytes` is called for
/// every chunk read from the network.
pub trait Progress: Send + Sync {
    /// A step started or finished ("downloading layer 2/5 ...", "I: Retrieving Packages").
    fn message(&self, message: &str);
    /// Bytes of the current download so far, and its size when known.
    fn bytes(&self, done: u64, total: Option<u64>);
}

/// Discards progress.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;

impl Progress for NoProgress {
    fn message(&self, _message: &str) {}
    fn bytes(&self, _done: u64, _total: Option<u64>) {}
}

/// Prints progress lines to stderr, byte counts at most twice a second.
#[derive(Debug)]
pub struct StderrProgress {
    last_bytes: Mutex<Option<Instant>>,
}

impl StderrProgress {
    pub fn new() -> Self {
        StderrProgress {
            last_bytes: Mutex::new(None),
        }
    }
}

impl Default for StderrProgress {
    fn default() -> Self {
        Self::new()
    }
}

impl Progress for StderrProgress {
    fn message(&self, message: &str) {
        let _ = writeln!(std::io::stderr().lock(), "[image] {message}");
    }

    fn bytes(&self, done: u64, total: Option<u64>) {
        let mut last = self.last_bytes.lock().unwrap_or_else(|e| e.into_inner());
        let finished = total == Some(done);
        if !finished && last.is_some_and(|t| t.elapsed() < Duration::from_millis(500)) {
            return;
        }
        *last = Some(Instant::now());
        let line = match total {
            Some(t) if t > 0 => {
                format!("[image]   {} / {} ({}%)", mib(done), mib(t), done * 100 / t)
            }
            _ => format!("[image]   {}", mib(done)),
        };
        let _ = writeln!(std::io::stderr().lock(), "{line}");
    }
}

pub(crate) fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}
