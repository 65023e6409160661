//! Running the async S3 client from synchronous callers.
//!
//! The artifact store trait is synchronous and is called from plain threads and from tokio's
//! `spawn_blocking` threads alike. [`Bridge`] owns a small private multi-thread tokio runtime;
//! every operation is spawned onto it and the calling thread waits on a std channel for the
//! result. It never calls `Runtime::block_on`, which panics on a thread that is inside another
//! runtime. (Calling from an async task's own thread would still block that worker: callers
//! use `spawn_blocking`, as for every other store.)
//!
//! Streams come back through a bounded tokio channel whose receiving end blocks the caller
//! (`blocking_recv`), so a slow consumer slows the download instead of buffering it. When the
//! consumer stops early, the channel closes and the producing task ends, dropping the
//! connection.
//!
//! Dropping the bridge shuts the runtime down in the background, which is safe from any
//! thread, including an async one.

use std::future::Future;
use std::sync::mpsc;

use futures::{Stream, StreamExt};
use tokio::runtime::{Builder, Runtime};

/// Chunks buffered between a download and its consumer.
const STREAM_BUFFER: usize = 4;

/// Why the bridge failed.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    /// The runtime could not be started.
    #[error("start the S3 client's runtime: {0}")]
    Start(#[source] std::io::Error),
    /// The runtime stopped before the operation finished.
    #[error("the S3 client's runtime stopped before the operation finished")]
    Stopped,
}

/// A private tokio runtime and the way into it. See the module docs.
#[derive(Debug)]
pub struct Bridge {
    runtime: Option<Runtime>,
    handle: tokio::runtime::Handle,
}

impl Bridge {
    /// Start the runtime (`threads` workers, named `fastbox-s3`).
    pub fn new(threads: usize) -> Result<Self, BridgeError> {
        let runtime = Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .thread_name("fastbox-s3")
            .enable_all()
            .build()
            .map_err(BridgeError::Start)?;
        let handle = runtime.handle().clone();
        Ok(Bridge {
            runtime: Some(runtime),
            handle,
        })
    }

    /// Run `future` on the runtime and wait for its output on this thread.
    pub fn run<F>(&self, future: F) -> Result<F::Output, BridgeError>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let (tx, rx) = mpsc::sync_channel(1);
        self.handle.spawn(async move {
            // The receiver is gone only if the caller's thread died; nothing to do then.
            let _ = tx.send(future.await);
        });
        rx.recv().map_err(|_| BridgeError::Stopped)
    }

    /// Pull the stream that `open` produces on the runtime, and hand its items to `each` on
    /// this thread as they arrive, in order. `each` returning false stops the stream. Returns
    /// the error that `open` failed with, if any.
    pub fn stream<Open, Fut, S, T, E>(
        &self,
        open: Open,
        mut each: impl FnMut(Result<T, E>) -> bool,
    ) -> Result<Result<(), E>, BridgeError>
    where
        Open: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<S, E>> + Send,
        S: Stream<Item = Result<T, E>> + Send + Unpin,
        T: Send + 'static,
        E: Send + 'static,
    {
        let (tx, mut rx) = tokio::sync::mpsc::channel(STREAM_BUFFER);
        let (opened_tx, opened_rx) = mpsc::sync_channel(1);
        self.handle.spawn(async move {
            let mut stream = match open().await {
                Ok(stream) => {
                    let _ = opened_tx.send(Ok(()));
                    stream
                }
                Err(error) => {
                    let _ = opened_tx.send(Err(error));
                    return;
                }
            };
            while let Some(item) = stream.next().await {
                if tx.send(item).await.is_err() {
                    break; // the consumer stopped
                }
            }
        });
        match opened_rx.recv().map_err(|_| BridgeError::Stopped)? {
            Ok(()) => {}
            Err(error) => return Ok(Err(error)),
        }
        while let Some(item) = rx.blocking_recv() {
            if !each(item) {
                break;
            }
        }
        Ok(Ok(()))
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_futures_from_plain_threads_and_from_inside_another_runtime() {
        let bridge = std::sync::Arc::new(Bridge::new(1).unwrap());
        assert_eq!(bridge.run(async { 7 }).unwrap(), 7);

        let outer = Builder::new_multi_thread().enable_all().build().unwrap();
        let inner = bridge.clone();
        let got = outer
            .block_on(outer.spawn_blocking(move || {
                inner
                    .run(async {
                        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                        8
                    })
                    .unwrap()
            }))
            .unwrap();
        assert_eq!(got, 8);
        // Dropping the bridge inside an async context must not panic.
        outer.block_on(async move { drop(bridge) });
    }

    #[test]
    fn streams_items_in_order_and_stops_early() {
        let bridge = Bridge::new(1).unwrap();
        let mut seen = Vec::new();
        let result = bridge
            .stream(
                || async { Ok::<_, ()>(futures::stream::iter((0..100).map(Ok))) },
                |item| {
                    seen.push(item.unwrap());
                    seen.len() < 10
                },
            )
            .unwrap();
        assert_eq!(result, Ok(()));
        assert_eq!(seen, (0..10).collect::<Vec<_>>());

        let failed = bridge
            .stream(
                || async { Err::<futures::stream::Empty<Result<u8, &str>>, _>("no") },
                |_| true,
            )
            .unwrap();
        assert_eq!(failed, Err("no"));
    }
}
