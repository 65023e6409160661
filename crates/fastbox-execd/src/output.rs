//! Reading a child's stdout or stderr line by line into an event stream or a log.
//!
//! After the child has exited its pipes are drained until EOF, but a grandchild that inherited
//! them (`server &`) may keep them open forever: once the exit is known, a read that brings
//! nothing for [`DRAIN_IDLE`] ends the pump, and the unterminated tail is flushed.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::watch;

use crate::lines::LineSplitter;
use crate::logbuf::LogBuffer;
use crate::sse::{EventTx, Stream, StreamEvent};

pub const DRAIN_IDLE: Duration = Duration::from_millis(200);

/// Where output lines go.
#[derive(Clone)]
pub enum Sink {
    /// One `stdout`/`stderr` event per line.
    Events(EventTx),
    /// Appended to a log, stdout and stderr interleaved.
    Log(Arc<LogBuffer>),
}

impl Sink {
    async fn deliver(&self, stream: Stream, line: String) {
        match self {
            Sink::Events(tx) => tx.send(StreamEvent::output(stream, line)).await,
            Sink::Log(log) => log.push(line),
        }
    }
}

/// Copies `reader` into `sink` until EOF, or until it goes quiet after `exited` turns true.
pub async fn pump(
    mut reader: impl AsyncRead + Unpin,
    stream: Stream,
    sink: Sink,
    mut exited: watch::Receiver<bool>,
) {
    let mut splitter = LineSplitter::stripping();
    let mut buf = vec![0u8; 16 * 1024];
    let mut lines = Vec::new();
    let mut done = *exited.borrow();
    loop {
        let read = if done {
            match tokio::time::timeout(DRAIN_IDLE, reader.read(&mut buf)).await {
                Ok(r) => r,
                Err(_) => break,
            }
        } else {
            tokio::select! {
                r = reader.read(&mut buf) => r,
                changed = exited.changed() => {
                    // A dropped supervisor counts as an exit.
                    done = changed.is_err() || *exited.borrow();
                    continue;
                }
            }
        };
        match read {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                splitter.push(&buf[..n], &mut lines);
                for line in lines.drain(..) {
                    sink.deliver(stream, line).await;
                }
            }
        }
    }
    if let Some(tail) = splitter.finish() {
        sink.deliver(stream, tail).await;
    }
}
