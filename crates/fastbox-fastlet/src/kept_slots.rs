//! The slot indexes paused sandboxes keep (their address), on disk: one empty-named file per
//! index under `DATA_DIR/kept-slots`, holding the sandbox's id. A paused sandbox has no
//! network namespace, so nothing else on the host says its index is taken; a node that
//! restarts holds these indexes until the server resumes the sandbox into its index or
//! removes it (which releases the index and its file). Without them a restarted node handed
//! the index to a new sandbox, and the paused one's later removal tore that one's network
//! down.

use std::path::{Path, PathBuf};

/// The kept indexes of one node.
#[derive(Debug, Clone)]
pub struct KeptSlots {
    dir: PathBuf,
}

impl KeptSlots {
    pub fn new(data_dir: &Path) -> Self {
        Self {
            dir: data_dir.join("kept-slots"),
        }
    }

    /// Index `slot` is kept by sandbox `id`. Best effort: a failure is logged (the index is
    /// then only held while this process lives).
    pub fn keep(&self, slot: u32, id: &str) {
        let written = std::fs::create_dir_all(&self.dir)
            .and_then(|()| std::fs::write(self.dir.join(slot.to_string()), id));
        if let Err(e) = written {
            tracing::warn!(slot, sandbox = %id, error = %e, "could not record a kept slot");
        }
    }

    /// Index `slot` is free again.
    pub fn forget(&self, slot: u32) {
        match std::fs::remove_file(self.dir.join(slot.to_string())) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(slot, error = %e, "could not forget a kept slot"),
        }
    }

    /// The sandbox that keeps index `slot`, if one does.
    pub fn holder(&self, slot: u32) -> Option<String> {
        std::fs::read_to_string(self.dir.join(slot.to_string())).ok()
    }

    /// Every kept index, sorted.
    pub fn list(&self) -> Vec<u32> {
        let mut slots: Vec<u32> = std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .collect();
        slots.sort_unstable();
        slots
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_slots_are_listed_until_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let kept = KeptSlots::new(dir.path());
        assert!(kept.list().is_empty());
        kept.keep(7, "a");
        kept.keep(3, "b");
        kept.keep(7, "a");
        assert_eq!(kept.list(), [3, 7]);
        kept.forget(7);
        kept.forget(9);
        assert_eq!(KeptSlots::new(dir.path()).list(), [3]);
    }
}
