//! The part of CRIU's page-server protocol (`criu/page-xfer.c`) that `criu lazy-pages
//! --page-server` speaks to fetch pages.
//!
//! Every message starts with a 32-byte `struct page_server_iov { u32 cmd; u64 nr_pages;
//! u64 vaddr; u64 dst_id; }` in host byte order with C layout (4 bytes of padding after
//! `cmd`). The low 16 bits of `cmd` are the command, the high 16 bits its flags. The lazy-pages
//! daemon sends `PS_IOV_GET(nr_pages, vaddr, dst_id = the task's pid in its pid namespace)`;
//! the answer is `PS_IOV_ADD_F` with flags `PE_PRESENT`, the same `vaddr` and `dst_id`, and
//! `nr_pages` no larger than asked (fewer is allowed: the daemon asks again for the rest),
//! followed by exactly that many pages. Answers go out in request order. At the end the daemon
//! sends `PS_IOV_CLOSE` (or `PS_IOV_FORCE_CLOSE` over an inherited socket) and waits for a
//! 4-byte status, 0 for success.

use std::io::{self, Read, Write};

use super::pagemap::PE_PRESENT;

/// Size of one `struct page_server_iov` on the wire.
pub const IOV_LEN: usize = 32;
/// Pages follow (with flags in the high bits).
pub const PS_IOV_ADD_F: u32 = 6;
/// A request for pages.
pub const PS_IOV_GET: u32 = 7;
/// The end of a session over a connection the daemon made.
pub const PS_IOV_CLOSE: u32 = 0x1023;
/// The end of a session over an inherited socket.
pub const PS_IOV_FORCE_CLOSE: u32 = 0x1024;

const CMD_BITS: u32 = 16;
const CMD_MASK: u32 = (1 << CMD_BITS) - 1;

/// One `struct page_server_iov`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Iov {
    pub cmd: u32,
    pub nr_pages: u64,
    pub vaddr: u64,
    pub dst_id: u64,
}

impl Iov {
    /// The command without its flags.
    pub fn command(&self) -> u32 {
        self.cmd & CMD_MASK
    }

    /// The header of an answer to `request` carrying `nr_pages` pages.
    pub fn pages_answer(request: &Iov, nr_pages: u64) -> Self {
        Self {
            cmd: (PE_PRESENT << CMD_BITS) | PS_IOV_ADD_F,
            nr_pages,
            vaddr: request.vaddr,
            dst_id: request.dst_id,
        }
    }

    /// The wire bytes.
    pub fn to_bytes(&self) -> [u8; IOV_LEN] {
        let mut out = [0u8; IOV_LEN];
        out[0..4].copy_from_slice(&self.cmd.to_ne_bytes());
        out[8..16].copy_from_slice(&self.nr_pages.to_ne_bytes());
        out[16..24].copy_from_slice(&self.vaddr.to_ne_bytes());
        out[24..32].copy_from_slice(&self.dst_id.to_ne_bytes());
        out
    }

    /// From wire bytes.
    pub fn from_bytes(bytes: &[u8; IOV_LEN]) -> Self {
        let u64_at = |i: usize| {
            let mut word = [0u8; 8];
            word.copy_from_slice(&bytes[i..i + 8]);
            u64::from_ne_bytes(word)
        };
        Self {
            cmd: u32::from_ne_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
            nr_pages: u64_at(8),
            vaddr: u64_at(16),
            dst_id: u64_at(24),
        }
    }

    /// Reads the next message; `None` at a clean end of stream (before its first byte).
    pub fn read_from(reader: &mut impl Read) -> io::Result<Option<Self>> {
        let mut buf = [0u8; IOV_LEN];
        let mut got = 0;
        while got < IOV_LEN {
            match reader.read(&mut buf[got..]) {
                Ok(0) if got == 0 => return Ok(None),
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(Some(Self::from_bytes(&buf)))
    }

    /// Writes the message.
    pub fn write_to(&self, writer: &mut impl Write) -> io::Result<()> {
        writer.write_all(&self.to_bytes())
    }
}

/// The status word that ends a session (0: every page was sent).
pub fn write_close_status(writer: &mut impl Write, status: i32) -> io::Result<()> {
    writer.write_all(&status.to_ne_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layout_is_criu_s() {
        let iov = Iov {
            cmd: PS_IOV_GET,
            nr_pages: 16,
            vaddr: 0x7f00_0000_1000,
            dst_id: 1,
        };
        let bytes = iov.to_bytes();
        assert_eq!(&bytes[0..8], &[7, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&bytes[8..16], &16u64.to_le_bytes());
        assert_eq!(Iov::from_bytes(&bytes), iov);
        let answer = Iov::pages_answer(&iov, 3);
        assert_eq!(answer.command(), PS_IOV_ADD_F);
        assert_eq!(answer.cmd >> 16, PE_PRESENT);
        assert_eq!((answer.vaddr, answer.dst_id), (iov.vaddr, iov.dst_id));
    }

    #[test]
    fn a_stream_ends_cleanly_only_between_messages() {
        let bytes = Iov::default().to_bytes();
        let mut whole = &bytes[..];
        assert!(Iov::read_from(&mut whole).unwrap().is_some());
        assert!(Iov::read_from(&mut whole).unwrap().is_none());
        let mut cut = &bytes[..10];
        assert!(Iov::read_from(&mut cut).is_err());
    }
}
