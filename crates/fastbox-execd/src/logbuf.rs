//! A bounded, line-indexed log kept in memory.
//!
//! Background command output and the entrypoint's output live here instead of in files: an
//! idle execd keeps nothing open on the sandbox's writable layer and a checkpoint carries the
//! log with it. Lines are numbered from 0 for the life of the buffer, so a reader's cursor stays
//! valid when old lines are dropped to respect the byte budget.

use std::collections::VecDeque;
use std::sync::Mutex;

/// Default budget: enough for long builds, small next to a sandbox's memory limit.
pub const DEFAULT_BUDGET: usize = 8 * 1024 * 1024;

pub struct LogBuffer {
    inner: Mutex<Inner>,
    /// A file every line is also appended to (`--log-dir`).
    mirror: Option<Mutex<std::fs::File>>,
}

struct Inner {
    lines: VecDeque<String>,
    /// Index of `lines[0]`.
    first: u64,
    bytes: usize,
    budget: usize,
}

impl LogBuffer {
    pub fn new(budget: usize) -> Self {
        LogBuffer {
            inner: Mutex::new(Inner {
                lines: VecDeque::new(),
                first: 0,
                bytes: 0,
                budget,
            }),
            mirror: None,
        }
    }

    /// A buffer that also appends every line to `file`.
    pub fn with_file(budget: usize, file: std::fs::File) -> Self {
        LogBuffer {
            mirror: Some(Mutex::new(file)),
            ..Self::new(budget)
        }
    }

    /// Appends one line (without its terminator), dropping the oldest lines over budget.
    pub fn push(&self, line: String) {
        if let Some(file) = &self.mirror {
            use std::io::Write;
            let mut f = file.lock().unwrap_or_else(|e| e.into_inner());
            let _ = f
                .write_all(line.as_bytes())
                .and_then(|()| f.write_all(b"\n"));
        }
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.bytes += line.len() + 1;
        g.lines.push_back(line);
        while g.bytes > g.budget && g.lines.len() > 1 {
            if let Some(old) = g.lines.pop_front() {
                g.bytes -= old.len() + 1;
                g.first += 1;
            }
        }
    }

    /// Lines from index `cursor` on (clamped to what is still kept), each ending in `\n`, and
    /// the cursor to pass next time.
    pub fn read_from(&self, cursor: u64) -> (String, u64) {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let end = g.first + g.lines.len() as u64;
        let start = cursor.clamp(g.first, end);
        let mut text = String::new();
        for line in g.lines.iter().skip((start - g.first) as usize) {
            text.push_str(line);
            text.push('\n');
        }
        (text, end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_reads_only_new_lines() {
        let log = LogBuffer::new(1024);
        log.push("a".into());
        log.push(String::new());
        assert_eq!(log.read_from(0), ("a\n\n".to_string(), 2));
        log.push("b".into());
        assert_eq!(log.read_from(2), ("b\n".to_string(), 3));
        assert_eq!(log.read_from(99), (String::new(), 3));
    }

    #[test]
    fn budget_drops_oldest_lines_but_keeps_numbering() {
        let log = LogBuffer::new(6);
        for l in ["aa", "bb", "cc"] {
            log.push(l.into());
        }
        assert_eq!(log.read_from(0), ("bb\ncc\n".to_string(), 3));
        assert_eq!(log.read_from(2), ("cc\n".to_string(), 3));
    }
}
