//! The node's side of the proxy: the listener the instance table redirects the HTTPS and
//! plain HTTP (ports 443 and 80) of credential-proxied slots to ([`serve`]), and a sandbox's [`SlotConnector`], through which
//! the proxy resolves and connects as that sandbox would: names through the sandbox's own
//! DNS (the instance's forwarder, whose policy hook opens the answers' addresses for the
//! slot, or withholds them), connections from the sandbox's network namespace with a
//! source port of `PROXY_SOURCE_PORTS` (which the redirect lets pass), so the slot's egress
//! policy and the private ranges decide exactly as for the sandbox itself.

use std::collections::HashMap;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use fastbox_runtime::net::dns_forwarder::message::{a_query, a_records};
use fastbox_runtime::net::in_netns;
use fastbox_runtime::net::nft::PROXY_SOURCE_PORTS;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpSocket, TcpStream};

use crate::{Connector, Handled, IoFuture, Proxy, Scheme, Session};

/// How long a name's resolution may take.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long passing a connection on may take to connect.
const PASS_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The most connections one sandbox has at the proxy at once; more are closed at once (the
/// instance table also counts them against the sandbox's connection cap).
pub const MAX_CONNECTIONS_PER_SANDBOX: usize = 256;
/// The most connections the proxy holds at once, all sandboxes together.
pub const MAX_CONNECTIONS: usize = 4096;

/// A sandbox's way out, for the proxy.
pub struct SlotConnector {
    /// The slot's network namespace file.
    pub netns: PathBuf,
    /// The sandbox's DNS server (its gateway's port 53, redirected to the forwarder).
    pub dns: SocketAddr,
    /// The port of HTTPS hosts (443).
    pub https_port: u16,
    /// The port of plain HTTP hosts (80).
    pub http_port: u16,
}

impl SlotConnector {
    /// The way out of the sandbox in `slot`: its network namespace, its DNS (the gateway's
    /// port 53), hosts on ports 443 and 80.
    pub fn for_slot(slot: &fastbox_runtime::net::NetSlot) -> Self {
        Self {
            netns: slot.netns_path.clone(),
            dns: SocketAddr::from((slot.gateway, 53)),
            https_port: 443,
            http_port: 80,
        }
    }
}

impl Connector for SlotConnector {
    fn resolve<'a>(&'a self, name: &'a str, scheme: Scheme) -> IoFuture<'a, Vec<SocketAddr>> {
        let port = match scheme {
            Scheme::Https => self.https_port,
            Scheme::Http => self.http_port,
        };
        let (netns, dns, name) = (self.netns.clone(), self.dns, name.to_string());
        Box::pin(async move {
            tokio::task::spawn_blocking(move || {
                let socket = in_netns(&netns, || UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)))
                    .map_err(io::Error::other)??;
                socket.set_read_timeout(Some(RESOLVE_TIMEOUT))?;
                let id = rand_id();
                socket.send_to(&a_query(id, &name), dns)?;
                let mut buf = [0u8; 4096];
                loop {
                    let (n, from) = socket.recv_from(&mut buf)?;
                    if from != dns || n < 2 || buf[..2] != id.to_be_bytes() {
                        continue;
                    }
                    let records = a_records(&buf[..n]).map_err(io::Error::other)?;
                    return Ok(records
                        .into_iter()
                        .map(|(a, _)| SocketAddr::from((a, port)))
                        .collect());
                }
            })
            .await
            .map_err(io::Error::other)?
        })
    }

    fn connect(&self, address: SocketAddr) -> IoFuture<'_, TcpStream> {
        let netns = self.netns.clone();
        Box::pin(async move {
            let socket = tokio::task::spawn_blocking(move || {
                in_netns(&netns, bound_socket).map_err(io::Error::other)?
            })
            .await
            .map_err(io::Error::other)??;
            socket.connect(address).await
        })
    }
}

/// A TCP socket of the calling thread's network namespace, bound to a free port of
/// [`PROXY_SOURCE_PORTS`].
fn bound_socket() -> io::Result<TcpSocket> {
    let span = u32::from(PROXY_SOURCE_PORTS.end() - PROXY_SOURCE_PORTS.start()) + 1;
    let start = u32::from(rand_id()) % span;
    let mut last = None;
    for i in 0..64u32 {
        let port = *PROXY_SOURCE_PORTS.start() + ((start + i * 97) % span) as u16;
        let socket = TcpSocket::new_v4()?;
        match socket.bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port))) {
            Ok(()) => return Ok(socket),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::other("no free proxy source port")))
}

fn rand_id() -> u16 {
    let mut b = [0u8; 2];
    // A DNS id and a starting port: not secrets, and the answer is matched on its source
    // as well. getrandom cannot fail on this kernel; zero is as good a start as any.
    let _ = rustls::crypto::ring::default_provider()
        .secure_random
        .fill(&mut b);
    u16::from_be_bytes(b)
}

/// Finds the sandbox a redirected connection comes from.
pub trait Sandboxes: Send + Sync {
    /// The session of the sandbox at `address`, if this node runs one there.
    fn session(&self, address: Ipv4Addr) -> Option<Session>;
}

/// Serves the redirected connections arriving at `listener`, for as long as it runs. A
/// failed accept (out of descriptors, say) is logged and retried after a pause; a sandbox
/// over [`MAX_CONNECTIONS_PER_SANDBOX`], or the proxy over [`MAX_CONNECTIONS`], has the new
/// connection closed.
pub async fn serve(listener: TcpListener, proxy: Arc<Proxy>, sandboxes: Arc<dyn Sandboxes>) {
    let total = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let per_sandbox: Arc<std::sync::Mutex<HashMap<Ipv4Addr, usize>>> = Arc::default();
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(error = %e, "credential proxy: accept failed; trying again");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = total.clone().try_acquire_owned() else {
            tracing::warn!(peer = %peer, "credential proxy: at its connection limit; closed");
            continue;
        };
        let Some(held) = Held::take(&per_sandbox, peer) else {
            tracing::debug!(peer = %peer, "credential proxy: the sandbox is at its connection limit; closed");
            continue;
        };
        let (proxy, sandboxes) = (proxy.clone(), sandboxes.clone());
        tokio::spawn(async move {
            let _held = (held, permit);
            if let Err(e) = connection(stream, peer, &proxy, sandboxes.as_ref()).await {
                tracing::debug!(peer = %peer, error = %e, "credential proxy: connection ended");
            }
        });
    }
}

/// One of a sandbox's connections at the proxy, counted while it lives.
struct Held {
    counts: Arc<std::sync::Mutex<HashMap<Ipv4Addr, usize>>>,
    address: Ipv4Addr,
}

impl Held {
    fn take(
        counts: &Arc<std::sync::Mutex<HashMap<Ipv4Addr, usize>>>,
        peer: SocketAddr,
    ) -> Option<Self> {
        let SocketAddr::V4(peer) = peer else {
            return None;
        };
        let mut map = counts.lock().expect("connection counts lock");
        let count = map.entry(*peer.ip()).or_default();
        if *count >= MAX_CONNECTIONS_PER_SANDBOX {
            return None;
        }
        *count += 1;
        Some(Self {
            counts: counts.clone(),
            address: *peer.ip(),
        })
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut map = self.counts.lock().expect("connection counts lock");
        if let Some(count) = map.get_mut(&self.address) {
            *count -= 1;
            if *count == 0 {
                map.remove(&self.address);
            }
        }
    }
}

async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    proxy: &Proxy,
    sandboxes: &dyn Sandboxes,
) -> io::Result<()> {
    let original = original_destination(&stream)?;
    // Only the redirect's ports: anything else reached the listener directly.
    if !matches!(original.port(), 80 | 443) {
        return Err(io::Error::other("not a redirected connection"));
    }
    let SocketAddr::V4(peer) = peer else {
        return Err(io::Error::other("not a slot's address"));
    };
    let session = sandboxes
        .session(*peer.ip())
        .ok_or_else(|| io::Error::other("no sandbox at this address"))?;
    let connector = session.connector.clone();
    // The redirect takes ports 80 and 443 only.
    let handled = match original.port() {
        80 => proxy.handle_plain(stream, session).await,
        _ => proxy.handle(stream, session).await,
    };
    match handled.map_err(io::Error::other)? {
        Handled::Served => Ok(()),
        Handled::NotBound {
            mut stream, prefix, ..
        } => {
            // Untouched: on to where the sandbox aimed it, as the sandbox.
            let mut upstream = tokio::time::timeout(
                PASS_CONNECT_TIMEOUT,
                connector.connect(SocketAddr::V4(original)),
            )
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "passing the connection on"))??;
            upstream.write_all(&prefix).await?;
            tokio::io::copy_bidirectional(&mut stream, &mut upstream).await?;
            Ok(())
        }
    }
}

/// Where a redirected connection was headed.
fn original_destination(stream: &TcpStream) -> io::Result<SocketAddrV4> {
    let raw = nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::OriginalDst)
        .map_err(io::Error::from)?;
    Ok(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(raw.sin_addr.s_addr)),
        u16::from_be(raw.sin_port),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sandbox_holds_at_most_its_share_of_connections_and_gets_them_back() {
        let counts: Arc<std::sync::Mutex<HashMap<Ipv4Addr, usize>>> = Arc::default();
        let (a, b) = (
            SocketAddr::from(([10, 89, 0, 1], 40000)),
            SocketAddr::from(([10, 89, 0, 3], 40000)),
        );
        let held: Vec<Held> = (0..MAX_CONNECTIONS_PER_SANDBOX)
            .map(|_| Held::take(&counts, a).expect("under the limit"))
            .collect();
        assert!(Held::take(&counts, a).is_none(), "over the limit");
        assert!(
            Held::take(&counts, b).is_some(),
            "another sandbox is not held back"
        );
        drop(held);
        assert!(Held::take(&counts, a).is_some(), "given back");
        assert!(
            counts.lock().unwrap().is_empty(),
            "nothing counted once all are gone"
        );
    }
}
