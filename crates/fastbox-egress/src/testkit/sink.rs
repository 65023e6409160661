//! A sink for throughput measurements: the server reads each connection to its end, then
//! answers with the number of bytes it read (8 bytes, big-endian) and closes; [`blast`] is
//! the client side.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use super::server::{Stoppable, serve_each};

/// Read and write size of both ends.
const CHUNK: usize = 256 * 1024;

/// How long [`blast`] waits on one write or on the count (a stalled connection fails
/// instead of hanging the test).
const STALL_TIMEOUT: Duration = Duration::from_secs(30);

/// A TCP server that counts what each client sends and answers with the count once the
/// client closes its sending half.
pub struct SinkServer {
    addr: SocketAddr,
    _accept: Stoppable,
}

impl SinkServer {
    /// Serves on `listener` (bound in whatever network namespace it was made).
    pub fn serve(listener: TcpListener) -> io::Result<Self> {
        let (addr, accept) = serve_each(listener, drain)?;
        Ok(Self {
            addr,
            _accept: accept,
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

fn drain(mut stream: TcpStream) {
    let mut buf = vec![0u8; CHUNK];
    let mut total: u64 = 0;
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => total += n as u64,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
    let _ = stream.write_all(&total.to_be_bytes());
}

/// Sends `bytes` bytes to a [`SinkServer`] over `stream`, closes the sending half and
/// returns the count the server read (equal to `bytes` unless something is wrong). Time it
/// for the throughput: it returns once everything arrived.
pub fn blast(stream: &mut TcpStream, bytes: u64) -> io::Result<u64> {
    stream.set_write_timeout(Some(STALL_TIMEOUT))?;
    stream.set_read_timeout(Some(STALL_TIMEOUT))?;
    let buf = vec![0x5au8; CHUNK];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(CHUNK as u64) as usize;
        stream.write_all(&buf[..n])?;
        left -= n as u64;
    }
    stream.shutdown(Shutdown::Write)?;
    let mut count = [0u8; 8];
    stream.read_exact(&mut count)?;
    Ok(u64::from_be_bytes(count))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn the_sink_counts_every_byte_a_blast_sends() {
        let sink = SinkServer::serve(TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap()).unwrap();
        for bytes in [0, 1, CHUNK as u64, 3 * CHUNK as u64 + 5] {
            let mut stream = TcpStream::connect(sink.addr()).unwrap();
            assert_eq!(blast(&mut stream, bytes).unwrap(), bytes);
        }
    }
}
