//! Identifiers and tokens, each drawn from getrandom(2) at the moment of use.
//!
//! execd is checkpointed by CRIU and restored many times: a PRNG seeded at start would hand
//! every clone the same sequence. The kernel RNG is the host's and is not cloned, so every id
//! comes straight from it and nothing random is kept in memory.

/// A random RFC 4122 version-4 UUID string, the id shape the reference execd uses.
pub fn uuid_v4() -> String {
    let mut b = [0u8; 16];
    fill(&mut b);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex(&b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// `n` random bytes as lowercase hex, e.g. for stream sentinels.
pub fn random_hex(n: usize) -> String {
    let mut b = vec![0u8; n];
    fill(&mut b);
    hex(&b)
}

/// Fills `buf` from getrandom(2), called directly: in a static glibc binary the `getrandom`
/// crate cannot find the libc symbol (it looks it up with dlsym) and falls back to opening
/// `/dev/urandom`, which may not exist in the sandbox and would stay open afterwards.
fn fill(buf: &mut [u8]) {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = &mut buf[filled..];
        // SAFETY: `rest` is valid for writes of `rest.len()` bytes.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            // Only a kernel without getrandom(2) or a seccomp filter denying it gets here; an
            // id that is not random would silently break clone safety, so there is no fallback.
            panic!("getrandom(2) failed: {err}");
        }
        filled += n as usize;
    }
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 0xf) as usize] as char);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_has_version_and_variant_bits() {
        let id = uuid_v4();
        assert_eq!(id.len(), 36);
        assert_eq!(&id[14..15], "4");
        assert!(matches!(&id[19..20], "8" | "9" | "a" | "b"));
        assert_ne!(uuid_v4(), id);
    }

    #[test]
    fn random_hex_has_requested_length() {
        assert_eq!(random_hex(8).len(), 16);
    }
}
