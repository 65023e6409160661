//! Secrets taken out of what comes back: a response that echoes a credential's value or a
//! placeholder shows [`MASK`] instead, in its headers and in its body, however the body is
//! split into chunks.

/// What a secret is replaced with.
pub const MASK: &str = "[REDACTED]";

/// Redacts a stream of chunks.
#[derive(Debug)]
pub struct Redactor {
    /// Longest first, so the longest secret wins at a position.
    needles: Vec<Vec<u8>>,
    /// Bytes held back: they may begin a secret the next chunk ends.
    pending: Vec<u8>,
}

impl Redactor {
    /// A redactor of every string of `set` (empty ones ignored).
    pub fn new(set: &[String]) -> Self {
        let mut needles: Vec<Vec<u8>> = set
            .iter()
            .filter(|s| !s.is_empty())
            .map(|s| s.as_bytes().to_vec())
            .collect();
        needles.sort_by_key(|n| std::cmp::Reverse(n.len()));
        Self {
            needles,
            pending: Vec::new(),
        }
    }

    /// Takes `chunk`; returns what may be sent now.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<u8> {
        let mut buf = std::mem::take(&mut self.pending);
        buf.extend_from_slice(chunk);
        let (out, held) = self.scan(&buf, false);
        self.pending = buf[held..].to_vec();
        out
    }

    /// What is left once the stream ended.
    pub fn finish(mut self) -> Vec<u8> {
        let buf = std::mem::take(&mut self.pending);
        self.scan(&buf, true).0
    }

    /// `value` redacted whole (a header's value).
    pub fn redact(&self, value: &[u8]) -> Vec<u8> {
        self.scan(value, true).0
    }

    /// `buf` with every whole secret masked, up to the first position where a secret could
    /// begin and run past the end (unless `last`); returns the output and where it stopped.
    fn scan(&self, buf: &[u8], last: bool) -> (Vec<u8>, usize) {
        let mut out = Vec::with_capacity(buf.len());
        let mut i = 0;
        'outer: while i < buf.len() {
            let rest = &buf[i..];
            for needle in &self.needles {
                if rest.starts_with(needle) {
                    out.extend_from_slice(MASK.as_bytes());
                    i += needle.len();
                    continue 'outer;
                }
            }
            if !last
                && self
                    .needles
                    .iter()
                    .any(|n| n.len() > rest.len() && n.starts_with(rest))
            {
                return (out, i);
            }
            out.push(buf[i]);
            i += 1;
        }
        (out, buf.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn redacted_in_chunks(set: &[&str], text: &str, size: usize) -> String {
        let set: Vec<String> = set.iter().map(|s| s.to_string()).collect();
        let mut r = Redactor::new(&set);
        let mut out = Vec::new();
        for chunk in text.as_bytes().chunks(size) {
            out.extend(r.push(chunk));
        }
        out.extend(r.finish());
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn secrets_are_masked_however_the_body_is_split() {
        let text = "token=ghp_abc123; again ghp_abc123 and ghp_ab at the end ghp_abc";
        let want = "token=[REDACTED]; again [REDACTED] and ghp_ab at the end ghp_abc";
        for size in 1..=text.len() {
            assert_eq!(
                redacted_in_chunks(&["ghp_abc123"], text, size),
                want,
                "chunks of {size}"
            );
        }
    }

    #[test]
    fn the_longest_secret_wins_and_nothing_else_changes() {
        assert_eq!(
            redacted_in_chunks(&["abc", "abcdef"], "xxabcdefyyabczz", 4),
            "xx[REDACTED]yy[REDACTED]zz"
        );
        assert_eq!(redacted_in_chunks(&[], "plain", 2), "plain");
        let r = Redactor::new(&["s3cr3t".to_string()]);
        assert_eq!(r.redact(b"Bearer s3cr3t"), b"Bearer [REDACTED]");
    }
}
