//! Running filesystem work as a given uid/gid (`/v1/filesystem/{uid}/{gid}/...`).
//!
//! Linux keeps a filesystem uid/gid and the supplementary groups per thread at the syscall
//! level, so the work runs on a fresh thread that switches with raw `setgroups`, `setfsgid`
//! and `setfsuid` syscalls (glibc's `setgroups` wrapper would broadcast the change to every
//! thread of execd) and then exits, never to be reused. Files created there are owned by that
//! identity, and because the kernel drops `CAP_DAC_OVERRIDE` and friends when the fsuid leaves
//! 0, ordinary permission checks apply. Work without an identity runs on tokio's blocking pool.

use std::path::PathBuf;

use super::FilesError;
use crate::identity::Accounts;

/// The identity of an identity-scoped files request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsIdentity {
    pub uid: u32,
    pub gid: u32,
}

/// Runs `work` synchronously as `who` (or as execd) off the async executor.
pub async fn run<T, F>(who: Option<FsIdentity>, work: F) -> Result<T, FilesError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, FilesError> + Send + 'static,
{
    match who {
        None => tokio::task::spawn_blocking(work)
            .await
            .map_err(|e| FilesError::Internal(e.to_string()))?,
        Some(id) => {
            let (tx, rx) = tokio::sync::oneshot::channel();
            std::thread::Builder::new()
                .name("execd-fsid".into())
                .spawn(move || {
                    let result = become_identity(id).and_then(|()| work());
                    let _ = tx.send(result);
                })
                .map_err(|e| FilesError::Internal(e.to_string()))?;
            rx.await
                .map_err(|_| FilesError::Internal("identity worker panicked".into()))?
        }
    }
}

/// Switches the calling thread's filesystem identity. Only for a thread that then exits.
fn become_identity(id: FsIdentity) -> Result<(), FilesError> {
    let groups = Accounts::system().credentials(id.uid, Some(id.gid)).groups;
    let failed = |what: &str| {
        FilesError::Identity(format!(
            "{what} failed for {}:{}: {}",
            id.uid,
            id.gid,
            std::io::Error::last_os_error()
        ))
    };
    // SAFETY: raw syscalls that only change credentials of the calling thread; `groups`
    // outlives the call.
    unsafe {
        if libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) != 0 {
            return Err(failed("setgroups"));
        }
        libc::syscall(libc::SYS_setfsgid, id.gid);
        libc::syscall(libc::SYS_setfsuid, id.uid);
        // setfs*id report the previous value, never an error: read the ids back to check.
        let fsgid = libc::syscall(libc::SYS_setfsgid, u32::MAX);
        let fsuid = libc::syscall(libc::SYS_setfsuid, u32::MAX);
        if fsuid != i64::from(id.uid) || fsgid != i64::from(id.gid) {
            return Err(failed("setfsuid"));
        }
    }
    Ok(())
}

/// Absolute form of a request path: `~` is the daemon's home, relative paths are relative to
/// execd's working directory.
pub fn resolve(raw: &str, home: &str) -> PathBuf {
    let expanded = if raw == "~" {
        PathBuf::from(home)
    } else if let Some(rest) = raw.strip_prefix("~/") {
        PathBuf::from(home).join(rest)
    } else {
        PathBuf::from(raw)
    };
    if expanded.is_absolute() {
        expanded
    } else {
        std::env::current_dir()
            .unwrap_or_else(|_| PathBuf::from("/"))
            .join(expanded)
    }
}
