//! Erofs images through the `mkfs.erofs` CLI, with the flags that make them reproducible.

use std::io::ErrorKind;
use std::path::Path;
use std::process::Command;

use super::PackError;

const MKFS_EROFS: &str = "mkfs.erofs";

/// Every inode timestamp and the superblock's build time.
const FIXED_TIMESTAMP: &str = "-T0";
/// A fixed filesystem UUID instead of a random one.
const FIXED_UUID: &str = "-U00000000-0000-0000-0000-000000000000";

/// Whether `mkfs.erofs` can be run.
pub fn available() -> bool {
    Command::new(MKFS_EROFS).arg("--help").output().is_ok()
}

/// Write an erofs image of `rootfs` to `out` (created or truncated).
pub fn write(rootfs: &Path, out: &Path) -> Result<(), PackError> {
    let output = Command::new(MKFS_EROFS)
        .args(["--quiet", FIXED_TIMESTAMP, FIXED_UUID])
        .arg(out)
        .arg(rootfs)
        .output()
        .map_err(|e| match e.kind() {
            ErrorKind::NotFound => PackError::ErofsToolMissing,
            _ => PackError::Io {
                op: "run",
                path: MKFS_EROFS.into(),
                source: e,
            },
        })?;
    if !output.status.success() {
        return Err(PackError::Erofs {
            status: output.status.to_string(),
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_string(),
        });
    }
    Ok(())
}
