//! Every command execd has started, running or finished, by id.
//!
//! Finished commands are kept at least 24 hours (the SDK documents this) and swept when new
//! commands are added, so an idle execd runs no timer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use nix::sys::signal::Signal;
use serde::Serialize;

use crate::clock::rfc3339;
use crate::logbuf::{DEFAULT_BUDGET, LogBuffer};
use crate::process::signal_group;
use crate::reaper::ExitStatus;

pub const RETENTION: Duration = Duration::from_secs(24 * 3600);
/// Time between SIGTERM and SIGKILL when a command is interrupted.
pub const INTERRUPT_GRACE: Duration = Duration::from_secs(2);

pub struct CommandRecord {
    pub id: String,
    pub content: String,
    pub background: bool,
    /// Process group (= pid of the leader); 0 if the spawn failed.
    pub pgid: i32,
    pub started_at: SystemTime,
    /// Combined stdout and stderr of background commands.
    pub log: Option<Arc<LogBuffer>>,
    state: Mutex<RunState>,
}

#[derive(Default)]
struct RunState {
    running: bool,
    exit_code: Option<i32>,
    error: Option<String>,
    finished_at: Option<SystemTime>,
    timed_out: bool,
}

#[derive(Debug, Serialize)]
pub struct CommandStatusResponse {
    pub id: String,
    pub content: String,
    pub running: bool,
    pub exit_code: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub started_at: String,
    pub finished_at: Option<String>,
}

impl CommandRecord {
    pub fn running(id: String, content: String, background: bool, pgid: i32) -> Self {
        CommandRecord {
            id,
            content,
            background,
            pgid,
            started_at: SystemTime::now(),
            log: background.then(|| Arc::new(LogBuffer::new(DEFAULT_BUDGET))),
            state: Mutex::new(RunState {
                running: true,
                ..RunState::default()
            }),
        }
    }

    /// A command that never started.
    pub fn failed(id: String, content: String, background: bool, error: String) -> Self {
        let rec = Self::running(id, content, background, 0);
        {
            let mut s = rec.lock();
            s.running = false;
            s.error = Some(error);
            s.finished_at = Some(SystemTime::now());
        }
        rec
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RunState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn is_running(&self) -> bool {
        self.lock().running
    }

    pub fn mark_timed_out(&self) {
        self.lock().timed_out = true;
    }

    pub fn finish(&self, status: ExitStatus) {
        let mut s = self.lock();
        s.running = false;
        s.exit_code = Some(status.code());
        s.finished_at = Some(SystemTime::now());
        if s.timed_out {
            s.error = Some("command timed out".into());
        } else if !status.success() {
            s.error = Some(status.describe());
        }
    }

    /// SIGTERM to the whole group, SIGKILL after a grace period if it is still running.
    pub fn interrupt(self: &Arc<Self>) {
        if !self.is_running() {
            return;
        }
        signal_group(self.pgid, Signal::SIGTERM);
        let rec = Arc::clone(self);
        tokio::spawn(async move {
            tokio::time::sleep(INTERRUPT_GRACE).await;
            if rec.is_running() {
                signal_group(rec.pgid, Signal::SIGKILL);
            }
        });
    }

    pub fn status(&self) -> CommandStatusResponse {
        let s = self.lock();
        CommandStatusResponse {
            id: self.id.clone(),
            content: self.content.clone(),
            running: s.running,
            exit_code: s.exit_code,
            error: s.error.clone(),
            started_at: rfc3339(self.started_at),
            finished_at: s.finished_at.map(rfc3339),
        }
    }

    fn expired(&self, now: SystemTime) -> bool {
        let s = self.lock();
        s.finished_at
            .is_some_and(|t| now.duration_since(t).unwrap_or_default() > RETENTION)
    }
}

#[derive(Default)]
pub struct CommandStore {
    map: Mutex<HashMap<String, Arc<CommandRecord>>>,
}

impl CommandStore {
    pub fn insert(&self, rec: CommandRecord) -> Arc<CommandRecord> {
        let rec = Arc::new(rec);
        let now = SystemTime::now();
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.retain(|_, r| !r.expired(now));
        map.insert(rec.id.clone(), Arc::clone(&rec));
        rec
    }

    pub fn get(&self, id: &str) -> Option<Arc<CommandRecord>> {
        self.map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()
    }

    /// Every command still running (for shutdown).
    pub fn running(&self) -> Vec<Arc<CommandRecord>> {
        self.map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter(|r| r.is_running())
            .cloned()
            .collect()
    }
}
