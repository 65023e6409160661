//! The artifacts the state store says are in use: the pins of the artifact store's garbage
//! collection (`crate::artifact_gc`; which records pin what is in `artifact_gc::refs`).

use crate::artifact_gc::ArtifactRefs;

use super::lifecycle::Lifecycle;

impl Lifecycle {
    /// What the sandbox, snapshot and template records use now.
    pub fn artifact_refs(&self) -> ArtifactRefs {
        let sandboxes = self.snapshot();
        let snapshots: Vec<_> = self
            .snapshots
            .lock()
            .expect("snapshots lock")
            .values()
            .cloned()
            .collect();
        let templates: Vec<_> = self
            .templates
            .lock()
            .expect("templates lock")
            .values()
            .cloned()
            .collect();
        ArtifactRefs::of(&sandboxes, &snapshots, &templates)
    }
}
