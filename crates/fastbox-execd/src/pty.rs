//! Interactive terminals over WebSocket (`/pty`), the reference execd's PTY protocol.
//!
//! `POST /pty {cwd?, command?}` registers a session; the shell (or `command` under the shell)
//! starts on a pseudo-terminal when the first client connects to `GET /pty/{id}/ws`. Output is
//! kept in a 1 MiB replay ring with absolute byte offsets, so a client reconnecting with
//! `?since=N` gets what it missed. One client at a time (a second gets 409).
//!
//! Frames, server to client: binary `0x01 data` (output), binary `0x03 offset(8, BE) data`
//! (replay), text JSON `{"type":"connected","session_id","mode":"pty"}`, `{"type":"exit",
//! "exit_code"}`, `{"type":"pong"}`, `{"type":"error","error","code"}`. Client to server:
//! binary `0x00 data` (stdin) or text JSON `{"type":"stdin","data"}`, `{"type":"resize",
//! "cols","rows"}`, `{"type":"signal","signal":"SIGINT"}`, `{"type":"ping"}`.

use std::collections::{HashMap, VecDeque};
use std::ffi::OsString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, State};
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use serde::Deserialize;
use tokio::io::unix::AsyncFd;
use tokio::sync::{broadcast, watch};

use crate::error::ApiError;
use crate::extract::OptionalJson;
use crate::ids;
use crate::process::{self, Launch, Stdio3};
use crate::query::QueryPairs;
use crate::reaper::ExitStatus;
use crate::state::AppState;

const REPLAY_BYTES: usize = 1024 * 1024;
const BIN_STDIN: u8 = 0x00;
const BIN_STDOUT: u8 = 0x01;
const BIN_REPLAY: u8 = 0x03;

#[derive(Debug, thiserror::Error)]
pub enum PtyError {
    #[error("pty session {0} not found")]
    NotFound(String),
    #[error("another client is already connected to pty session {0}")]
    AlreadyConnected(String),
    #[error("cannot start pty: {0}")]
    Start(String),
}

pub struct PtySession {
    pub id: String,
    cwd: Option<String>,
    command: Option<String>,
    /// Set while a WebSocket client is attached.
    attached: AtomicBool,
    term: Mutex<Option<Arc<Term>>>,
    launch: Mutex<LaunchState>,
}

#[derive(Default, Clone, Copy)]
struct LaunchState {
    attempted: bool,
    failed: bool,
}

/// A started terminal: the master side, the output ring and the exit watch.
struct Term {
    master: AsyncFd<OwnedFd>,
    pgid: i32,
    replay: Mutex<Replay>,
    output: broadcast::Sender<Bytes>,
    exit: watch::Receiver<Option<ExitStatus>>,
}

#[derive(Default)]
struct Replay {
    buf: VecDeque<u8>,
    /// Total bytes ever produced; `buf` holds the last `buf.len()` of them.
    end: u64,
}

impl Replay {
    fn push(&mut self, data: &[u8]) {
        self.buf.extend(data);
        self.end += data.len() as u64;
        let excess = self.buf.len().saturating_sub(REPLAY_BYTES);
        self.buf.drain(..excess);
    }

    /// Bytes from absolute offset `since` (clamped to what is kept) and the end offset.
    fn since(&self, since: u64) -> (Vec<u8>, u64) {
        let start = self.end - self.buf.len() as u64;
        let from = since.clamp(start, self.end);
        let skip = (from - start) as usize;
        (self.buf.iter().skip(skip).copied().collect(), self.end)
    }
}

#[derive(Default)]
pub struct PtyStore {
    map: Mutex<HashMap<String, Arc<PtySession>>>,
}

impl PtyStore {
    fn get(&self, id: &str) -> Option<Arc<PtySession>> {
        self.map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()
    }
}

fn fd_read(fd: &OwnedFd, buf: &mut [u8]) -> std::io::Result<usize> {
    // SAFETY: `buf` is valid for writes of its length and `fd` is open.
    let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

fn fd_write(fd: &OwnedFd, buf: &[u8]) -> std::io::Result<usize> {
    // SAFETY: `buf` is valid for reads of its length and `fd` is open.
    let n = unsafe { libc::write(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

impl Term {
    async fn write_all(&self, mut data: &[u8]) -> std::io::Result<()> {
        while !data.is_empty() {
            let mut guard = self.master.writable().await?;
            match guard.try_io(|fd| fd_write(fd.get_ref(), data)) {
                Ok(Ok(n)) => data = &data[n..],
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
        Ok(())
    }

    fn resize(&self, cols: u16, rows: u16) {
        let ws = libc::winsize {
            ws_row: rows,
            ws_col: cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCSWINSZ reads a `winsize` that lives for the call.
        unsafe { libc::ioctl(self.master.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
    }

    fn exit_code(&self) -> Option<i32> {
        self.exit.borrow().map(ExitStatus::code)
    }
}

impl PtySession {
    /// Starts the terminal if this is the first attach.
    fn ensure_started(&self, state: &AppState) -> Result<Arc<Term>, PtyError> {
        let mut slot = self.term.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = slot.as_ref() {
            return Ok(Arc::clone(t));
        }
        self.launch
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .attempted = true;
        let term =
            start_term(state, self.cwd.as_deref(), self.command.as_deref()).inspect_err(|_| {
                self.launch.lock().unwrap_or_else(|e| e.into_inner()).failed = true;
            })?;
        *slot = Some(Arc::clone(&term));
        Ok(term)
    }

    fn kill(&self) {
        if let Some(t) = self.term.lock().unwrap_or_else(|e| e.into_inner()).as_ref()
            && t.exit.borrow().is_none()
        {
            process::signal_group(t.pgid, nix::sys::signal::Signal::SIGKILL);
        }
    }
}

fn start_term(
    state: &AppState,
    cwd: Option<&str>,
    command: Option<&str>,
) -> Result<Arc<Term>, PtyError> {
    let err = |e: &dyn std::fmt::Display| PtyError::Start(e.to_string());
    let mut ctx = state
        .child_context(&HashMap::new(), cwd, None, None)
        .map_err(|e| err(&e))?;
    if crate::env::get(&ctx.env, "TERM").is_none() {
        crate::env::set(&mut ctx.env, "TERM", "xterm-256color");
    }
    let pty = nix::pty::openpty(None, None).map_err(|e| err(&e))?;
    // openpty(3) makes both ends inheritable: the master would leak into every process execd
    // starts later (and into an isolated session's keeper); the slave reaches the shell as
    // its standard streams only.
    for fd in [pty.master.as_raw_fd(), pty.slave.as_raw_fd()] {
        // SAFETY: plain fcntl on descriptors we own.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    let shell = process::shell(&ctx.env);
    let args = match command {
        Some(c) if !c.trim().is_empty() => vec![OsString::from("-c"), OsString::from(c)],
        _ => vec![OsString::from("-i")],
    };
    let child = process::launch(
        &state.reaper,
        Launch {
            program: shell,
            args,
            env: ctx.env,
            cwd: ctx.cwd.map(PathBuf::from),
            user: None,
            stdio: Stdio3::Tty(pty.slave),
        },
    )
    .map_err(|e| err(&e))?;
    // SAFETY: plain fcntl on an fd we own.
    unsafe {
        let fd = pty.master.as_raw_fd();
        libc::fcntl(
            fd,
            libc::F_SETFL,
            libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK,
        );
    }
    // SAFETY: `pty.master` is an open OwnedFd moved into the AsyncFd, which owns it (and so
    // keeps it open and unchanged) for its whole lifetime.
    let master = unsafe { AsyncFd::register(pty.master) }.map_err(|e| err(&e.to_string()))?;
    let (exit_tx, exit_rx) = watch::channel(None);
    let (output, _) = broadcast::channel(256);
    let term = Arc::new(Term {
        master,
        pgid: child.pid,
        replay: Mutex::new(Replay::default()),
        output,
        exit: exit_rx,
    });
    let reader = Arc::clone(&term);
    let exit = child.exit;
    tokio::spawn(async move {
        let mut buf = vec![0u8; 32 * 1024];
        loop {
            let Ok(mut guard) = reader.master.readable().await else {
                break;
            };
            match guard.try_io(|fd| fd_read(fd.get_ref(), &mut buf)) {
                Ok(Ok(0)) | Ok(Err(_)) => break, // EIO once the last slave fd closed
                Ok(Ok(n)) => {
                    let data = Bytes::copy_from_slice(&buf[..n]);
                    let mut replay = reader.replay.lock().unwrap_or_else(|e| e.into_inner());
                    replay.push(&data);
                    let _ = reader.output.send(data);
                }
                Err(_would_block) => continue,
            }
        }
        let status = exit.await;
        let _ = exit_tx.send(Some(status));
    });
    Ok(term)
}

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/pty", post(create_pty))
        .route("/pty/{id}", get(pty_status).delete(delete_pty))
        .route("/pty/{id}/ws", get(pty_ws))
}

#[derive(Debug, Default, Deserialize)]
struct CreatePtyRequest {
    cwd: Option<String>,
    command: Option<String>,
}

async fn create_pty(
    State(state): State<AppState>,
    OptionalJson(req): OptionalJson<CreatePtyRequest>,
) -> Response {
    let id = ids::uuid_v4();
    let session = Arc::new(PtySession {
        id: id.clone(),
        cwd: req.cwd.filter(|c| !c.is_empty()),
        command: req.command,
        attached: AtomicBool::new(false),
        term: Mutex::new(None),
        launch: Mutex::new(LaunchState::default()),
    });
    state
        .ptys
        .map
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(id.clone(), session);
    (
        StatusCode::CREATED,
        axum::Json(serde_json::json!({ "session_id": id })),
    )
        .into_response()
}

async fn pty_status(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let s = state
        .ptys
        .get(&id)
        .ok_or_else(|| PtyError::NotFound(id.clone()))?;
    let term = s.term.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let launch = *s.launch.lock().unwrap_or_else(|e| e.into_inner());
    Ok(axum::Json(serde_json::json!({
        "session_id": id,
        "running": term.as_ref().is_some_and(|t| t.exit.borrow().is_none()),
        "output_offset": term.as_ref().map(|t| t.replay.lock().unwrap_or_else(|e| e.into_inner()).end).unwrap_or(0),
        "launch_attempted": launch.attempted,
        "launch_failed": launch.failed,
    }))
    .into_response())
}

async fn delete_pty(State(state): State<AppState>, Path(id): Path<String>) -> Result<(), ApiError> {
    let s = state
        .ptys
        .map
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&id)
        .ok_or(PtyError::NotFound(id))?;
    s.kill();
    Ok(())
}

async fn pty_ws(
    State(state): State<AppState>,
    Path(id): Path<String>,
    uri: Uri,
    ws: WebSocketUpgrade,
) -> Result<Response, ApiError> {
    let session = state
        .ptys
        .get(&id)
        .ok_or_else(|| PtyError::NotFound(id.clone()))?;
    if session.attached.swap(true, Ordering::SeqCst) {
        return Err(PtyError::AlreadyConnected(id).into());
    }
    let since = QueryPairs::from_uri(&uri)
        .get("since")
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Ok(ws.on_upgrade(move |socket| async move {
        attach(socket, &state, &session, since).await;
        session.attached.store(false, Ordering::SeqCst);
    }))
}

fn json_frame(v: serde_json::Value) -> Message {
    Message::Text(v.to_string().into())
}

#[derive(Debug, Deserialize)]
struct ClientFrame {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    data: String,
    #[serde(default)]
    cols: u16,
    #[serde(default)]
    rows: u16,
    #[serde(default)]
    signal: String,
}

async fn attach(mut socket: WebSocket, state: &AppState, session: &PtySession, since: u64) {
    let term = match session.ensure_started(state) {
        Ok(t) => t,
        Err(e) => {
            let _ = socket
                .send(json_frame(serde_json::json!({"type": "error", "error": e.to_string(), "code": "START_FAILED"})))
                .await;
            return;
        }
    };
    // Snapshot and subscribe under the ring's lock so no output falls between them.
    let (snapshot, end, mut live) = {
        let replay = term.replay.lock().unwrap_or_else(|e| e.into_inner());
        let (bytes, end) = replay.since(since);
        (bytes, end, term.output.subscribe())
    };
    if !snapshot.is_empty() {
        let mut frame = Vec::with_capacity(9 + snapshot.len());
        frame.push(BIN_REPLAY);
        frame.extend_from_slice(&end.to_be_bytes());
        frame.extend_from_slice(&snapshot);
        if socket.send(Message::Binary(frame.into())).await.is_err() {
            return;
        }
    }
    let connected =
        serde_json::json!({"type": "connected", "session_id": session.id, "mode": "pty"});
    if socket.send(json_frame(connected)).await.is_err() {
        return;
    }
    let mut exit = term.exit.clone();
    loop {
        tokio::select! {
            out = live.recv() => match out {
                Ok(data) => {
                    let mut frame = Vec::with_capacity(1 + data.len());
                    frame.push(BIN_STDOUT);
                    frame.extend_from_slice(&data);
                    if socket.send(Message::Binary(frame.into())).await.is_err() {
                        return;
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => continue,
                Err(broadcast::error::RecvError::Closed) => {}
            },
            _ = async { let _ = exit.wait_for(|s| s.is_some()).await; } => {
                // Deliver output that raced with the exit, then the exit frame.
                while let Ok(data) = live.try_recv() {
                    let mut frame = vec![BIN_STDOUT];
                    frame.extend_from_slice(&data);
                    let _ = socket.send(Message::Binary(frame.into())).await;
                }
                let code = term.exit_code();
                let _ = socket.send(json_frame(serde_json::json!({"type": "exit", "exit_code": code}))).await;
                let _ = socket.send(Message::Close(None)).await;
                return;
            }
            msg = socket.recv() => {
                let Some(Ok(msg)) = msg else { return };
                let reply = match msg {
                    Message::Binary(b) if b.first() == Some(&BIN_STDIN) => {
                        term.write_all(&b[1..]).await.err().map(|e| stdin_error(&e))
                    }
                    Message::Text(t) => match serde_json::from_str::<ClientFrame>(&t) {
                        Ok(f) => handle_frame(&term, f).await,
                        Err(e) => Some(serde_json::json!({"type": "error", "error": e.to_string(), "code": "INVALID_FRAME"})),
                    },
                    Message::Close(_) => return,
                    _ => None,
                };
                if let Some(r) = reply
                    && socket.send(json_frame(r)).await.is_err()
                {
                    return;
                }
            }
        }
    }
}

fn stdin_error(e: &std::io::Error) -> serde_json::Value {
    serde_json::json!({"type": "error", "error": e.to_string(), "code": "STDIN_WRITE_FAILED"})
}

async fn handle_frame(term: &Term, f: ClientFrame) -> Option<serde_json::Value> {
    match f.kind.as_str() {
        "stdin" => term
            .write_all(f.data.as_bytes())
            .await
            .err()
            .map(|e| stdin_error(&e)),
        "resize" => {
            if f.cols > 0 && f.rows > 0 {
                term.resize(f.cols, f.rows);
            }
            None
        }
        "signal" => {
            let name = f.signal.to_ascii_uppercase();
            let name = if name.starts_with("SIG") {
                name
            } else {
                format!("SIG{name}")
            };
            match nix::sys::signal::Signal::from_str(&name) {
                Ok(sig) => {
                    process::signal_group(term.pgid, sig);
                    None
                }
                Err(_) => Some(
                    serde_json::json!({"type": "error", "error": format!("unknown signal {}", f.signal), "code": "INVALID_FRAME"}),
                ),
            }
        }
        "ping" => Some(serde_json::json!({"type": "pong"})),
        other => Some(
            serde_json::json!({"type": "error", "error": format!("unknown frame type {other:?}"), "code": "INVALID_FRAME"}),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_keeps_absolute_offsets() {
        let mut r = Replay::default();
        r.push(b"hello");
        assert_eq!(r.since(0), (b"hello".to_vec(), 5));
        assert_eq!(r.since(3), (b"lo".to_vec(), 5));
        assert_eq!(r.since(9), (Vec::new(), 5));
        r.push(&vec![b'x'; REPLAY_BYTES]);
        let (bytes, end) = r.since(0);
        assert_eq!(bytes.len(), REPLAY_BYTES);
        assert_eq!(end, 5 + REPLAY_BYTES as u64);
    }
}
