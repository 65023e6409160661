//! Splicing an upgraded connection (WebSocket or any HTTP/1.1 `Upgrade`).
//!
//! When the upstream answers `101 Switching Protocols`, the proxy answers the client with the
//! same 101; once hyper has sent it, both connections are raw byte streams and a spawned task
//! copies between them until either side closes. The task owns both connections, so the
//! request handler returns immediately and the spliced session outlives it.

use std::net::SocketAddr;

use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;

/// Spawns the task that joins the client's and the upstream's upgraded connections.
pub(crate) fn spawn_splice(client: OnUpgrade, upstream: OnUpgrade, upstream_addr: SocketAddr) {
    tokio::spawn(async move {
        let (client, upstream) = match tokio::try_join!(client, upstream) {
            Ok(pair) => pair,
            Err(error) => {
                tracing::debug!(upstream = %upstream_addr, %error, "upgrade did not complete");
                return;
            }
        };
        let mut client = TokioIo::new(client);
        let mut upstream = TokioIo::new(upstream);
        match tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
            Ok((to_upstream, to_client)) => tracing::debug!(
                upstream = %upstream_addr,
                to_upstream,
                to_client,
                "upgraded connection closed"
            ),
            Err(error) => {
                tracing::debug!(upstream = %upstream_addr, %error, "upgraded connection failed");
            }
        }
    });
}
