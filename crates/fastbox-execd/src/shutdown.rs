//! Graceful exit on SIGTERM: every process group execd started gets SIGTERM, then SIGKILL
//! when the grace period ends. As PID 1, execd's exit then tears down the pid namespace.

use std::time::Duration;

use nix::sys::signal::Signal;

use crate::process::signal_group;
use crate::state::AppState;

pub async fn terminate_children(state: &AppState, grace: Duration) {
    let groups = || {
        let mut g: Vec<i32> = state.commands.running().iter().map(|r| r.pgid).collect();
        g.extend(state.entrypoint.get().and_then(|e| e.running_pgid()));
        g
    };
    for pgid in groups() {
        signal_group(pgid, Signal::SIGTERM);
    }
    let deadline = tokio::time::Instant::now() + grace;
    while !groups().is_empty() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for pgid in groups() {
        signal_group(pgid, Signal::SIGKILL);
    }
}
