//! sha256 content addresses: computing them, and checking streams against them as they are read.

use std::io::{self, Read};

use sha2::{Digest as _, Sha256};

use crate::error::ImageError;

/// `sha256:<hex>` of `bytes`.
pub(crate) fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// The hex part of a validated `sha256:` digest.
pub(crate) fn digest_hex(digest: &str) -> Result<&str, ImageError> {
    crate::reference::validate_digest(digest)
        .map_err(|reason| ImageError::invalid_image("digest", reason))?;
    Ok(&digest["sha256:".len()..])
}

/// Fails with `DigestMismatch` unless `bytes` hash to `expected`.
pub(crate) fn verify_bytes(what: &str, bytes: &[u8], expected: &str) -> Result<(), ImageError> {
    let actual = sha256_digest(bytes);
    if actual != expected {
        return Err(ImageError::DigestMismatch {
            what: what.to_owned(),
            expected: expected.to_owned(),
            actual,
        });
    }
    Ok(())
}

/// A reader that hashes what passes through it.
pub(crate) struct HashingReader<R> {
    inner: R,
    hasher: Sha256,
    count: u64,
}

impl<R: Read> HashingReader<R> {
    pub(crate) fn new(inner: R) -> Self {
        HashingReader {
            inner,
            hasher: Sha256::new(),
            count: 0,
        }
    }

    /// Reads the rest of the stream, then returns `(sha256:<hex>, bytes read)`.
    pub(crate) fn finish(mut self) -> io::Result<(String, u64)> {
        io::copy(&mut self, &mut io::sink())?;
        Ok((
            format!("sha256:{}", hex::encode(self.hasher.finalize())),
            self.count,
        ))
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashing_reader_hashes_the_whole_stream_even_if_unread() {
        let mut r = HashingReader::new(&b"hello world"[..]);
        let mut first = [0u8; 5];
        r.read_exact(&mut first).unwrap();
        let (digest, count) = r.finish().unwrap();
        assert_eq!(digest, sha256_digest(b"hello world"));
        assert_eq!(count, 11);
    }

    #[test]
    fn verify_bytes_reports_both_digests() {
        let err = verify_bytes("blob", b"x", &sha256_digest(b"y")).unwrap_err();
        let msg = err.to_string();
        assert!(msg.starts_with("digest mismatch for blob"), "{msg}");
        assert!(msg.contains(&sha256_digest(b"x")));
    }
}
