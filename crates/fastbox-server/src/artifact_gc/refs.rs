//! What the state store says is in use, as artifact references: the pins of a collection.
//!
//! | record | in use |
//! |---|---|
//! | a sandbox whose record names a pause checkpoint (`Pausing`, `Paused`, `Resuming`, ...) | the checkpoint's key |
//! | a sandbox resumed from a checkpoint that is not removed yet (a lazy resume still fetching its memory from it) | that checkpoint's key |
//! | a sandbox that is not final (not `Terminated`, `Failed`) | its image's template key (the image reference), its template id |
//! | a snapshot `Creating` or `Ready` (or in a state this build does not know) | its id |
//! | a template of the templates API, unless `Failed` | its id, and the manifest its record names (`blake3:<hex>`) |
//!
//! Keys are index keys: [`super::ArtifactCollector`] resolves them through the store's index
//! at each collection. A manifest a record names by digest is pinned as it is. Lineage is the
//! collector's business: a checkpoint's manifest names its template as `lineage.parent`,
//! which the collection follows.

use std::collections::BTreeSet;

use fastbox_api::lifecycle::SandboxState;
use fastbox_api::snapshots::SnapshotState;
use fastbox_api::templates::{Template, TemplatePhase};
use fastbox_artifact::Digest;

use crate::record::{SandboxRecord, SnapshotRecord};

/// The prefix of a manifest reference in a template record (`blake3:<hex>`).
const MANIFEST_REF_PREFIX: &str = "blake3:";

/// Artifact references in use. See the module docs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ArtifactRefs {
    /// Index keys whose manifests are in use.
    pub keys: BTreeSet<String>,
    /// Manifests in use, by digest.
    pub manifests: BTreeSet<Digest>,
}

impl ArtifactRefs {
    /// What `sandboxes`, `snapshots` and `templates` use.
    pub fn of(
        sandboxes: &[SandboxRecord],
        snapshots: &[SnapshotRecord],
        templates: &[Template],
    ) -> Self {
        let mut refs = ArtifactRefs::default();
        for sandbox in sandboxes {
            refs.keys.extend(sandbox.paused_checkpoint.iter().cloned());
            // A resume on another node fetches the memory from it while the sandbox runs.
            refs.keys.extend(sandbox.resumed_from.iter().cloned());
            if !matches!(
                sandbox.state(),
                SandboxState::Terminated | SandboxState::Failed
            ) {
                refs.keys.insert(sandbox.image.uri.clone());
                refs.keys.extend(sandbox.template_id.iter().cloned());
            }
        }
        for snapshot in snapshots {
            if !matches!(
                snapshot.state(),
                SnapshotState::Failed | SnapshotState::Deleting
            ) {
                refs.keys.insert(snapshot.id.clone());
            }
        }
        for template in templates {
            if template.status.phase == TemplatePhase::Failed {
                continue;
            }
            refs.keys.insert(template.template_id.clone());
            let named = template
                .status
                .manifest_ref
                .as_deref()
                .and_then(|r| r.strip_prefix(MANIFEST_REF_PREFIX))
                .and_then(|hex| Digest::from_hex(hex).ok());
            refs.manifests.extend(named);
        }
        refs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::tests::record;
    use fastbox_api::lifecycle::{ImageSpec, StringMap};
    use fastbox_api::snapshots::SnapshotStatus;
    use fastbox_api::templates::TemplateStatus;

    fn snapshot_record(id: &str, sandbox_id: &str) -> SnapshotRecord {
        SnapshotRecord {
            id: id.into(),
            sandbox_id: sandbox_id.into(),
            name: None,
            status: SnapshotStatus {
                state: SnapshotState::Creating,
                reason: None,
                message: None,
                last_transition_at: None,
            },
            created_at: chrono::Utc::now(),
            image: ImageSpec {
                uri: "python:3.12".into(),
                auth: None,
            },
            entrypoint: vec![],
            env: StringMap::new(),
            metadata: StringMap::new(),
            resource_limits: StringMap::new(),
            timeout_secs: None,
            network_policy: None,
            execd_token: "t".into(),
            node: None,
            manifest: None,
            report: None,
            secure_access: false,
            volumes: Vec::new(),
            credential_proxy: false,
            taken_by: None,
        }
    }

    fn template(id: &str, phase: TemplatePhase, manifest_ref: Option<String>) -> Template {
        let now = chrono::Utc::now();
        Template {
            template_id: id.into(),
            image: "python:3.12".into(),
            publish: "local".into(),
            format: "native".into(),
            status: TemplateStatus {
                phase,
                manifest_ref,
                message: None,
            },
            created_at: now,
            updated_at: now,
            resource_limits: None,
            entrypoint: None,
            env: None,
            metadata: None,
            readiness: None,
        }
    }

    fn in_state(id: &str, state: SandboxState) -> SandboxRecord {
        let mut r = record(id);
        r.transition(state, None, "");
        r
    }

    #[test]
    fn live_and_paused_sandboxes_recorded_snapshots_and_templates_are_in_use() {
        let mut paused = in_state("paused", SandboxState::Paused);
        paused.image.uri = "fastbox/busybox".into();
        paused.paused_checkpoint = Some("pause-paused-1a2b3c4d".into());
        let mut running = in_state("running", SandboxState::Running);
        running.template_id = Some("tpl_a".into());
        running.resumed_from = Some("pause-running-99887766".into());
        let mut gone = in_state("gone", SandboxState::Terminated);
        gone.image.uri = "debian:12".into();
        let mut failed_pause = in_state("failed", SandboxState::Failed);
        failed_pause.paused_checkpoint = Some("pause-failed-00000000".into());

        let mut ready = snapshot_record("snap_ready", "running");
        ready.transition(SnapshotState::Ready, None, "");
        let creating = snapshot_record("snap_creating", "running");
        let mut deleting = snapshot_record("snap_deleting", "running");
        deleting.transition(SnapshotState::Deleting, None, "");
        let mut failed = snapshot_record("snap_failed", "running");
        failed.transition(SnapshotState::Failed, None, "");

        let digest = Digest::of(b"a template manifest");
        let templates = [
            template(
                "tpl_a",
                TemplatePhase::Succeeded,
                Some(format!("blake3:{}", digest.to_hex())),
            ),
            template("tpl_building", TemplatePhase::Building, None),
            template("tpl_failed", TemplatePhase::Failed, None),
            template(
                "tpl_odd",
                TemplatePhase::Succeeded,
                Some("sha256:zz".into()),
            ),
        ];

        let refs = ArtifactRefs::of(
            &[paused, running, gone, failed_pause],
            &[ready, creating, deleting, failed],
            &templates,
        );
        let keys: Vec<&str> = refs.keys.iter().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "fastbox/busybox",
                "pause-failed-00000000",
                "pause-paused-1a2b3c4d",
                "pause-running-99887766",
                "python:3.12",
                "snap_creating",
                "snap_ready",
                "tpl_a",
                "tpl_building",
                "tpl_odd",
            ],
            "a pause checkpoint is pinned while a record names it; terminated sandboxes, failed and deleting snapshots and failed templates pin nothing"
        );
        assert_eq!(refs.manifests, BTreeSet::from([digest]));
    }
}
