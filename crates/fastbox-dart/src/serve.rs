//! Running the peer server on its own small tokio runtime.
//!
//! A node that has no axum server of its own (a test, `fastbox verify p2p`, a tool) starts
//! [`PeerServer::serve`] on a listener it bound, and stops it with
//! [`PeerServer::shutdown`], which is abrupt on purpose: the runtime is dropped, so every
//! connection (including bodies still streaming) is cut, as when the process dies. Origin
//! fetches already running on blocking threads finish and keep their block. A node with
//! its own server mounts [`crate::router`] instead.

use std::net::{SocketAddr, TcpListener};

use tokio::runtime::Runtime;

use crate::server::{PeerState, router};

/// Worker threads of a peer server's runtime.
const WORKER_THREADS: usize = 2;

/// Why the peer server did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Preparing the listener or the runtime failed.
    #[error("{op}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// What failed.
        source: std::io::Error,
    },
}

/// A peer server running on its own runtime until shut down or dropped.
#[derive(Debug)]
pub struct PeerServer {
    addr: SocketAddr,
    runtime: Option<Runtime>,
}

impl PeerServer {
    /// Serve [`router`]`(state)` on `listener` (already bound, so callers can learn the
    /// port before they build the membership).
    pub fn serve(listener: TcpListener, state: PeerState) -> Result<Self, StartError> {
        let io = |op| move |source| StartError::Io { op, source };
        let addr = listener
            .local_addr()
            .map_err(io("read the listener's address"))?;
        listener
            .set_nonblocking(true)
            .map_err(io("make the listener non-blocking"))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(WORKER_THREADS)
            .thread_name("dart-peer")
            .enable_all()
            .build()
            .map_err(io("start the peer server's runtime"))?;
        let listener = {
            let _entered = runtime.enter();
            tokio::net::TcpListener::from_std(listener).map_err(io("register the listener"))?
        };
        runtime.spawn(async move {
            if let Err(e) = axum::serve(listener, router(state)).await {
                tracing::error!(error = %e, "the peer server stopped");
            }
        });
        Ok(PeerServer {
            addr,
            runtime: Some(runtime),
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stop now: close the listener and cut every open connection.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Drop for PeerServer {
    fn drop(&mut self) {
        self.stop();
    }
}
