//! The execd binary, content-addressed: a sandbox records the digest of the execd it was
//! started with so a checkpoint is restored with exactly that binary.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// An execd binary stored under its blake3 digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecdBinary {
    /// Hex blake3 of the binary.
    pub digest: String,
    /// Host path: `<store>/execd/<digest>/fastbox-execd`, read-only.
    pub path: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum ExecdBinaryError {
    #[error("execd binary {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("execd binary {path} is not a static executable (it must run in any rootfs)")]
    NotStatic { path: PathBuf },
}

impl ExecdBinary {
    /// Copy `source` into `store` under its digest (idempotent) and return the stored binary.
    pub fn import(source: &Path, store: &Path) -> Result<Self, ExecdBinaryError> {
        let io_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| ExecdBinaryError::Io { path, source }
        };
        let bytes = fs::read(source).map_err(io_err(source))?;
        if !is_static_elf(&bytes) {
            return Err(ExecdBinaryError::NotStatic {
                path: source.to_path_buf(),
            });
        }
        let digest = blake3::hash(&bytes).to_hex().to_string();
        let dir = store.join("execd").join(&digest);
        let path = dir.join("fastbox-execd");
        if !path.exists() {
            fs::create_dir_all(&dir).map_err(io_err(&dir))?;
            let tmp = dir.join(format!(".tmp-{}", std::process::id()));
            crate::exec_file::write_executable(&tmp, &bytes, 0o555).map_err(io_err(&tmp))?;
            fs::rename(&tmp, &path).map_err(io_err(&path))?;
        }
        Ok(Self { digest, path })
    }

    /// The binary stored under `digest`, if present.
    pub fn lookup(store: &Path, digest: &str) -> Option<Self> {
        let path = store.join("execd").join(digest).join("fastbox-execd");
        path.exists().then(|| Self {
            digest: digest.to_string(),
            path,
        })
    }
}

/// True for an ELF executable without a `PT_INTERP` program header (statically linked).
fn is_static_elf(bytes: &[u8]) -> bool {
    const PT_INTERP: u32 = 3;
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" || bytes[4] != 2 {
        return false;
    }
    let u16_at = |o: usize| u16::from_le_bytes([bytes[o], bytes[o + 1]]) as usize;
    let u64_at = |o: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[o..o + 8]);
        u64::from_le_bytes(b) as usize
    };
    let (phoff, phentsize, phnum) = (u64_at(0x20), u16_at(0x36), u16_at(0x38));
    (0..phnum).all(|i| {
        let o = phoff + i * phentsize;
        o + 4 <= bytes.len()
            && u32::from_le_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]) != PT_INTERP
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamic_binaries_are_refused() {
        let store = tempfile::tempdir().unwrap();
        let err = ExecdBinary::import(Path::new("/bin/ls"), store.path()).unwrap_err();
        assert!(matches!(err, ExecdBinaryError::NotStatic { .. }), "{err}");
    }

    #[test]
    fn static_binaries_are_stored_under_their_digest() {
        let busybox = Path::new("/bin/busybox");
        if !busybox.exists() || !is_static_elf(&fs::read(busybox).unwrap()) {
            eprintln!("skipped: no static /bin/busybox (install busybox-static)");
            return;
        }
        let store = tempfile::tempdir().unwrap();
        let a = ExecdBinary::import(busybox, store.path()).unwrap();
        let b = ExecdBinary::import(busybox, store.path()).unwrap();
        assert_eq!(a, b);
        assert_eq!(
            a.digest,
            blake3::hash(&fs::read(busybox).unwrap())
                .to_hex()
                .to_string()
        );
        assert_eq!(ExecdBinary::lookup(store.path(), &a.digest), Some(a));
    }
}
