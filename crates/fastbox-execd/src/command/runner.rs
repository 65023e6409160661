//! Running one command: spawn, stream or log its output, enforce the timeout, record the end.

use std::sync::Arc;
use std::time::Instant;

use axum::response::Response;
use nix::sys::signal::Signal;
use tokio::sync::watch;

use crate::ids;
use crate::output::{Sink, pump};
use crate::process::{self, Spawned, signal_group};
use crate::sse::{self, Stream, StreamEvent};
use crate::state::AppState;

use super::request::CommandSpec;
use super::store::CommandRecord;

/// Starts `spec` and returns its event stream: `init`, then output and the terminal event for
/// a foreground command, or `execution_complete` at once for a background one.
pub async fn run(state: &AppState, spec: CommandSpec) -> Response {
    let id = ids::uuid_v4();
    let (tx, rx) = sse::channel();
    tx.send(StreamEvent::init(&id)).await;
    let started = Instant::now();
    let CommandSpec {
        content,
        launch,
        background,
        timeout,
    } = spec;
    match process::launch(&state.reaper, launch) {
        Err(e) => {
            tracing::info!(command = %id, error = %e, "spawn failed");
            state.commands.insert(CommandRecord::failed(
                id,
                content,
                background,
                e.to_string(),
            ));
            tx.send(StreamEvent::error(
                "CommandExecError",
                e.to_string(),
                vec![e.to_string()],
            ))
            .await;
        }
        Ok(child) => {
            tracing::info!(command = %id, pid = child.pid, background, "command started");
            let record = state
                .commands
                .insert(CommandRecord::running(id, content, background, child.pid));
            let sink = match &record.log {
                Some(log) => {
                    tx.send(StreamEvent::complete(started.elapsed())).await;
                    Sink::Log(Arc::clone(log))
                }
                None => Sink::Events(tx),
            };
            tokio::spawn(supervise(child, record, sink, timeout, started));
        }
    }
    sse::response(rx)
}

async fn supervise(
    mut child: Spawned,
    record: Arc<CommandRecord>,
    sink: Sink,
    timeout: Option<std::time::Duration>,
    started: Instant,
) {
    let (exited_tx, exited_rx) = watch::channel(false);
    let pumps = [
        child
            .stdout
            .take()
            .map(|r| tokio::spawn(pump(r, Stream::Stdout, sink.clone(), exited_rx.clone()))),
        child
            .stderr
            .take()
            .map(|r| tokio::spawn(pump(r, Stream::Stderr, sink.clone(), exited_rx))),
    ];
    let status = match timeout {
        None => (&mut child.exit).await,
        Some(limit) => match tokio::time::timeout(limit, &mut child.exit).await {
            Ok(status) => status,
            Err(_) => {
                tracing::info!(command = %record.id, "timeout, killing process group");
                record.mark_timed_out();
                signal_group(child.pid, Signal::SIGKILL);
                (&mut child.exit).await
            }
        },
    };
    let _ = exited_tx.send(true);
    for p in pumps.into_iter().flatten() {
        let _ = p.await;
    }
    record.finish(status);
    tracing::info!(command = %record.id, code = status.code(), "command finished");
    if let Sink::Events(tx) = sink {
        tx.send(StreamEvent::finished(status, started.elapsed()))
            .await;
    }
}
