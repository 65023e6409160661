//! A plain TCP listener on the code-interpreter port (44771 by default).
//!
//! The code-interpreter SDK proves its runtime is ready by opening a TCP connection to
//! `127.0.0.1:44771` from inside the sandbox (where the reference image runs Jupyter). execd
//! runs code itself, so it just accepts there and answers any request with `200 ok`. If
//! something else already owns the port (a real Jupyter), execd leaves it alone.

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const RESPONSE: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok";

/// Binds `0.0.0.0:port` and serves it in the background; a bind failure is only logged.
/// `on_probe` runs at each connection (the SDK's readiness probe: the code interpreter is
/// wanted).
pub async fn spawn(port: u16, on_probe: impl Fn() + Send + 'static) -> Option<u16> {
    let listener = match TcpListener::bind(("0.0.0.0", port)).await {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(port, error = %e, "code-interpreter port not bound");
            return None;
        }
    };
    let bound = listener.local_addr().ok()?.port();
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                continue;
            };
            on_probe();
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                // Answer once the request head arrived, or right away for bare connections
                // that send nothing (the SDK's /dev/tcp probe closes immediately).
                let _ = tokio::time::timeout(std::time::Duration::from_secs(2), async {
                    let mut seen = Vec::new();
                    while let Ok(n) = conn.read(&mut buf).await {
                        if n == 0 {
                            break;
                        }
                        seen.extend_from_slice(&buf[..n]);
                        if seen.windows(4).any(|w| w == b"\r\n\r\n") || seen.len() > 16 * 1024 {
                            break;
                        }
                    }
                })
                .await;
                let _ = conn.write_all(RESPONSE).await;
                let _ = conn.shutdown().await;
            });
        }
    });
    Some(bound)
}
