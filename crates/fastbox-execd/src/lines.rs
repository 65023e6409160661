//! Splitting process output into lines.
//!
//! The OpenSandbox contract sends one `stdout`/`stderr` event per line with the terminator
//! (`\n`, `\r` or `\r\n`) stripped, and flushes an unterminated tail when the process ends.
//! Code contexts instead keep the terminator, as a Jupyter stream message would. Bytes are
//! buffered until a line is complete so multi-byte UTF-8 sequences split across reads decode
//! correctly; a line longer than [`MAX_LINE`] is cut so a process without newlines cannot grow
//! execd's memory without bound.

/// The longest line kept in memory before it is emitted in pieces.
pub const MAX_LINE: usize = 64 * 1024;

/// Incremental line splitter for one output stream.
#[derive(Debug, Default)]
pub struct LineSplitter {
    buf: Vec<u8>,
    /// The previous chunk ended with `\r`: a leading `\n` belongs to that terminator.
    after_cr: bool,
    keep_terminator: bool,
}

impl LineSplitter {
    /// Lines come out without their terminator; `\r` and `\r\n` also end a line.
    pub fn stripping() -> Self {
        Self::default()
    }

    /// Lines come out with their `\n`; only `\n` ends a line.
    pub fn keeping() -> Self {
        LineSplitter {
            keep_terminator: true,
            ..Self::default()
        }
    }

    /// Feeds `data` and appends every completed line to `out`.
    pub fn push(&mut self, data: &[u8], out: &mut Vec<String>) {
        for &b in data {
            if self.keep_terminator {
                self.buf.push(b);
                if b == b'\n' {
                    out.push(self.take());
                }
            } else {
                let after_cr = std::mem::take(&mut self.after_cr);
                match b {
                    b'\n' if after_cr => {}
                    b'\n' => out.push(self.take()),
                    b'\r' => {
                        out.push(self.take());
                        self.after_cr = true;
                    }
                    _ => self.buf.push(b),
                }
            }
            if self.buf.len() >= MAX_LINE {
                out.push(self.take());
            }
        }
    }

    /// The unterminated tail, if any, once the stream has ended.
    pub fn finish(&mut self) -> Option<String> {
        self.after_cr = false;
        (!self.buf.is_empty()).then(|| self.take())
    }

    fn take(&mut self) -> String {
        let line = String::from_utf8_lossy(&self.buf).into_owned();
        self.buf.clear();
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(chunks: &[&[u8]]) -> (Vec<String>, Option<String>) {
        let mut s = LineSplitter::stripping();
        let mut out = Vec::new();
        for c in chunks {
            s.push(c, &mut out);
        }
        (out, s.finish())
    }

    #[test]
    fn strips_every_terminator_kind() {
        let (lines, tail) = split(&[b"a\nb\r\nc\rd"]);
        assert_eq!(lines, vec!["a", "b", "c"]);
        assert_eq!(tail.as_deref(), Some("d"));
    }

    #[test]
    fn blank_lines_are_empty_strings() {
        let (lines, tail) = split(&[b"a\n\n\nb\n"]);
        assert_eq!(lines, vec!["a", "", "", "b"]);
        assert_eq!(tail, None);
    }

    #[test]
    fn crlf_split_across_chunks_is_one_terminator() {
        let (lines, _) = split(&[b"a\r", b"\nb\n"]);
        assert_eq!(lines, vec!["a", "b"]);
    }

    #[test]
    fn utf8_split_across_chunks_decodes() {
        let bytes = "héllo\n".as_bytes();
        let (lines, _) = split(&[&bytes[..2], &bytes[2..]]);
        assert_eq!(lines, vec!["héllo"]);
    }

    #[test]
    fn keeping_mode_keeps_newlines_and_tail() {
        let mut s = LineSplitter::keeping();
        let mut out = Vec::new();
        s.push(b"a\r\nb", &mut out);
        assert_eq!(out, vec!["a\r\n"]);
        assert_eq!(s.finish().as_deref(), Some("b"));
    }

    #[test]
    fn overlong_lines_are_cut() {
        let mut s = LineSplitter::stripping();
        let mut out = Vec::new();
        s.push(&vec![b'x'; MAX_LINE + 10], &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].len(), MAX_LINE);
        assert_eq!(s.finish().map(|t| t.len()), Some(10));
    }
}
