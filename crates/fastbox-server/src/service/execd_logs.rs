//! The entrypoint's output, read from the sandbox's execd for `diagnostics/logs`.
//!
//! Whatever answers on execd's port lives in the sandbox the tenant controls, so its answer
//! is read up to [`MAX_LOG_BYTES`] and no further: the rest is never read, and the answer is
//! marked truncated. An honest execd keeps at most 8 MiB of the entrypoint's output, so its
//! log is never cut.

use std::net::Ipv4Addr;
use std::time::Duration;

use fastbox_api::limits::EXECD_PORT;

use super::lifecycle::EXECD_TOKEN_HEADER;

/// Most of the entrypoint's log a diagnostics answer carries: twice execd's own budget.
pub const MAX_LOG_BYTES: usize = 16 * 1024 * 1024;

/// How long execd has for the whole answer.
const TIMEOUT: Duration = Duration::from_secs(5);

/// The entrypoint's output as execd's `/fastbox/entrypoint/logs` has it, cut at
/// [`MAX_LOG_BYTES`]; `true` when it was cut.
pub async fn entrypoint_logs(
    address: Ipv4Addr,
    token: &str,
) -> Result<(String, bool), reqwest::Error> {
    logs_at(
        &format!("http://{address}:{EXECD_PORT}/fastbox/entrypoint/logs"),
        token,
        MAX_LOG_BYTES,
    )
    .await
}

async fn logs_at(url: &str, token: &str, cap: usize) -> Result<(String, bool), reqwest::Error> {
    let resp = reqwest::Client::new()
        .get(url)
        .header(EXECD_TOKEN_HEADER, token)
        .timeout(TIMEOUT)
        .send()
        .await?
        .error_for_status()?;
    let (bytes, cut) = read_capped(resp, cap).await?;
    Ok((String::from_utf8_lossy(&bytes).into_owned(), cut))
}

/// Up to `cap` bytes of `resp`'s body, and whether there was more (left unread: the
/// connection is dropped).
pub async fn read_capped(
    mut resp: reqwest::Response,
    cap: usize,
) -> Result<(Vec<u8>, bool), reqwest::Error> {
    let mut out = Vec::new();
    while let Some(chunk) = resp.chunk().await? {
        let room = cap - out.len();
        if chunk.len() > room {
            out.extend_from_slice(&chunk[..room]);
            return Ok((out, true));
        }
        out.extend_from_slice(&chunk);
    }
    Ok((out, false))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A one-request HTTP server on loopback answering `len` bytes of `x`, declared with a
    /// Content-Length or streamed chunked without end (`len` = None). Returns its URL.
    async fn server(len: Option<usize>) -> String {
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut req = [0u8; 4096];
            let _ = s.read(&mut req).await;
            let chunk = vec![b'x'; 64 * 1024];
            match len {
                Some(len) => {
                    let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {len}\r\n\r\n");
                    s.write_all(head.as_bytes()).await.unwrap();
                    let mut left = len;
                    while left > 0 {
                        let n = left.min(chunk.len());
                        if s.write_all(&chunk[..n]).await.is_err() {
                            return;
                        }
                        left -= n;
                    }
                }
                None => {
                    let head = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n";
                    s.write_all(head.as_bytes()).await.unwrap();
                    let frame =
                        [format!("{:x}\r\n", chunk.len()).as_bytes(), &chunk, b"\r\n"].concat();
                    while s.write_all(&frame).await.is_ok() {}
                }
            }
        });
        format!("http://{addr}/fastbox/entrypoint/logs")
    }

    #[tokio::test]
    async fn a_log_within_the_cap_is_read_whole() {
        let url = server(Some(100_000)).await;
        let (text, cut) = logs_at(&url, "t", 1 << 20).await.unwrap();
        assert_eq!((text.len(), cut), (100_000, false));
    }

    #[tokio::test]
    async fn an_oversized_log_is_cut_at_the_cap_and_marked() {
        let url = server(Some(3 << 20)).await;
        let (text, cut) = logs_at(&url, "t", 1 << 20).await.unwrap();
        assert_eq!((text.len(), cut), (1 << 20, true));
    }

    #[tokio::test]
    async fn an_endless_log_is_cut_at_the_cap_without_waiting_for_its_end() {
        let url = server(None).await;
        let (text, cut) = logs_at(&url, "t", 1 << 20).await.unwrap();
        assert_eq!((text.len(), cut), (1 << 20, true));
    }
}
