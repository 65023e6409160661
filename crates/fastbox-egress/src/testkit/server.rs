//! Test servers on std threads that stop when dropped, and the echo server.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use nix::sys::socket::{Shutdown, shutdown};

/// Tells a server thread it should return.
#[derive(Clone, Debug)]
pub struct StopFlag(Arc<AtomicBool>);

impl StopFlag {
    /// Whether the owner is stopping the thread.
    pub fn is_stopped(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// A thread blocked on a socket. Dropping it raises the flag, shuts the socket down (which
/// wakes a blocked `accept` or `recv`) and joins the thread.
pub struct Stoppable {
    socket: OwnedFd,
    stop: StopFlag,
    thread: Option<JoinHandle<()>>,
}

impl Stoppable {
    /// Runs `serve` on a new thread; `socket` (a duplicate of the one `serve` blocks on) is
    /// what dropping shuts down.
    pub fn spawn(
        socket: OwnedFd,
        serve: impl FnOnce(StopFlag) + Send + 'static,
    ) -> io::Result<Self> {
        let stop = StopFlag(Arc::new(AtomicBool::new(false)));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("test-server".into())
            .spawn(move || serve(flag))?;
        Ok(Self {
            socket,
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Stoppable {
    fn drop(&mut self) {
        self.stop.0.store(true, Ordering::SeqCst);
        // Unconnected UDP sockets report ENOTCONN but are woken all the same.
        let _ = shutdown(self.socket.as_raw_fd(), Shutdown::Both);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A TCP server that greets every client with the address it was reached at (one line:
/// `10.0.0.1\n`), then echoes whatever the client sends.
pub struct EchoServer {
    addr: SocketAddr,
    _accept: Stoppable,
}

/// Accepts on `listener` until stopped, handling each connection on its own thread; returns
/// the listening address and the accept loop.
pub(super) fn serve_each(
    listener: TcpListener,
    handle: fn(TcpStream),
) -> io::Result<(SocketAddr, Stoppable)> {
    let addr = listener.local_addr()?;
    let fd = listener.try_clone()?;
    let accept = Stoppable::spawn(fd.into(), move |stop| {
        for stream in listener.incoming() {
            if stop.is_stopped() {
                return;
            }
            if let Ok(stream) = stream {
                std::thread::spawn(move || handle(stream));
            }
        }
    })?;
    Ok((addr, accept))
}

impl EchoServer {
    /// Serves on `listener` (bound in whatever network namespace it was made).
    pub fn serve(listener: TcpListener) -> io::Result<Self> {
        let (addr, accept) = serve_each(listener, echo)?;
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

fn echo(mut stream: TcpStream) {
    let Ok(local) = stream.local_addr() else {
        return;
    };
    if writeln!(stream, "{}", local.ip()).is_err() {
        return;
    }
    let mut buf = [0u8; 4096];
    while let Ok(n) = stream.read(&mut buf) {
        if n == 0 || stream.write_all(&buf[..n]).is_err() {
            return;
        }
    }
}
