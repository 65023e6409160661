//! The templates API: a template is a golden checkpoint of an image with the entrypoint,
//! environment and limits its sandboxes get. Creating one records it (`Pending`) and builds it
//! in the background (`Building` -> `Succeeded` or `Failed`); creates with its id restore it.

use std::sync::Arc;

use chrono::Utc;
use fastbox_api::lifecycle::{PaginationInfo, StringMap};
use fastbox_api::templates::{
    CreateTemplateRequest, ListTemplatesResponse, Template, TemplatePhase, TemplateStatus,
};
use fastbox_node_api::recipe::{GoldenRecipe, Readiness};

use crate::error::ApiError;

use super::lifecycle::Lifecycle;
use super::plan::{Rules, default_entrypoint, limits_of};

/// How `template`'s golden checkpoint is built: its environment baked in, its entrypoint (the
/// SDK's default when it has none) started cold as the warm-up command, and its readiness
/// gate passed before the dump. Its sandboxes get those processes from the checkpoint.
fn golden_recipe(template: &Template) -> Result<GoldenRecipe, ApiError> {
    let readiness = template
        .readiness
        .as_ref()
        .map(|r| Readiness::parse(r.probe.as_deref(), r.warmup_seconds))
        .transpose()
        .map_err(|e| ApiError::InvalidParameter(e.to_string()))?;
    Ok(GoldenRecipe {
        isolation: false,
        env: template
            .env
            .iter()
            .flatten()
            .map(|(k, v)| format!("{k}={v}"))
            .collect(),
        warm_up: template
            .entrypoint
            .clone()
            .filter(|e| !e.is_empty())
            .unwrap_or_else(default_entrypoint),
        readiness,
    })
}

/// Publish targets this server accepts: its own artifact store.
const PUBLISH_TARGETS: &[&str] = &["local", "file://"];

impl Lifecycle {
    /// `POST /v1/templates`: validates, records `Pending`, builds in the background.
    pub fn create_template(
        self: &Arc<Self>,
        req: CreateTemplateRequest,
    ) -> Result<Template, ApiError> {
        let invalid = |m: String| ApiError::InvalidParameter(m);
        if req.image.trim().is_empty() {
            return Err(invalid("image is required".into()));
        }
        if !PUBLISH_TARGETS.iter().any(|p| req.publish.starts_with(p)) {
            return Err(ApiError::NotSupported(format!(
                "publish {:?}: this server publishes to its node's artifact store only (\"local\": the directory or S3 origin of --artifact-store)",
                req.publish
            )));
        }
        if let Some(format) = &req.format
            && !matches!(format.as_str(), "native" | "overlaybd")
        {
            return Err(invalid(format!(
                "format {format:?} is not native or overlaybd"
            )));
        }
        self.nodes
            .first()
            .check_image(&req.image)
            .map_err(|e| invalid(format!("image: {e}")))?;
        self.check_local_image(&req.image)?;
        let limits = req.resource_limits.clone().unwrap_or_default();
        limits_of(&limits, &Rules::of(&self.cfg))?;
        let env = req.env.clone().unwrap_or_default();
        if let Some(key) = env.keys().find(|k| k.is_empty() || k.contains('=')) {
            return Err(invalid(format!("env key {key:?} is not a variable name")));
        }
        fastbox_api::metadata::validate(req.metadata.as_ref().unwrap_or(&StringMap::new()).iter())
            .map_err(|e| ApiError::InvalidMetadata(e.to_string()))?;
        if let Some(entrypoint) = &req.entrypoint
            && entrypoint.iter().any(|a| a.contains('\0'))
        {
            return Err(invalid("entrypoint arguments must not contain NUL".into()));
        }
        if let Some(r) = &req.readiness {
            Readiness::parse(r.probe.as_deref(), r.warmup_seconds)
                .map_err(|e| invalid(e.to_string()))?;
        }
        let now = Utc::now();
        let template = Template {
            template_id: format!("tpl_{}", uuid::Uuid::new_v4()),
            image: req.image,
            publish: req.publish,
            format: "native".into(),
            status: TemplateStatus {
                phase: TemplatePhase::Pending,
                manifest_ref: None,
                message: None,
            },
            created_at: now,
            updated_at: now,
            resource_limits: req.resource_limits,
            entrypoint: req.entrypoint,
            env: req.env,
            metadata: req.metadata,
            readiness: req.readiness,
        };
        self.store.put_template(&template)?;
        self.templates
            .lock()
            .expect("templates lock")
            .insert(template.template_id.clone(), template.clone());
        let this = self.clone();
        let id = template.template_id.clone();
        tokio::spawn(async move { this.build_template(&id).await });
        Ok(template)
    }

    /// After a restart: builds that were waiting or running start again (their node work
    /// is idempotent: a golden checkpoint the node finished is found, not rebuilt).
    pub(super) fn recover_templates(self: &Arc<Self>) {
        let interrupted: Vec<String> = self
            .templates
            .lock()
            .expect("templates lock")
            .values()
            .filter(|t| {
                matches!(
                    t.status.phase,
                    TemplatePhase::Pending | TemplatePhase::Building
                )
            })
            .map(|t| t.template_id.clone())
            .collect();
        for id in interrupted {
            let this = self.clone();
            tokio::spawn(async move { this.build_template(&id).await });
        }
    }

    /// Builds template `id`: resolve the image, then the golden checkpoint of its recipe.
    async fn build_template(self: &Arc<Self>, id: &str) {
        let Ok(template) = self.set_phase(id, TemplatePhase::Building, None) else {
            return;
        };
        let recipe = match golden_recipe(&template) {
            Ok(recipe) => recipe,
            Err(e) => {
                let _ = self.set_phase(id, TemplatePhase::Failed, Some(e.to_string()));
                return;
            }
        };
        // Built on the first node; another node builds its own golden checkpoint from the
        // same image and recipe at its first create of the template.
        let built = self
            .nodes
            .first()
            .build_template(&template.template_id, &template.image, &recipe)
            .await;
        let result = match built {
            Ok(built) => {
                let message = format!(
                    "golden checkpoint built in {} ms, published in {:.1} s ({} blocks, {} new)",
                    built.build_ms, built.publish_seconds, built.blocks, built.new_blocks
                );
                self.set_manifest(id, built.manifest)
                    .and_then(|_| self.set_phase(id, TemplatePhase::Succeeded, Some(message)))
            }
            Err(e) => self.set_phase(id, TemplatePhase::Failed, Some(e.to_string())),
        };
        if let Err(e) = result {
            tracing::warn!(template = %id, error = %e, "could not record the template build");
        }
    }

    fn set_phase(
        &self,
        id: &str,
        phase: TemplatePhase,
        message: Option<String>,
    ) -> Result<Template, ApiError> {
        let mut templates = self.templates.lock().expect("templates lock");
        let template = templates
            .get_mut(id)
            .ok_or_else(|| ApiError::TemplateNotFound(id.to_string()))?;
        let mut next = template.clone();
        next.status.phase = phase;
        next.status.message = message;
        next.updated_at = Utc::now();
        self.store.put_template(&next)?;
        *template = next.clone();
        Ok(next)
    }

    fn set_manifest(&self, id: &str, manifest: String) -> Result<Template, ApiError> {
        let mut templates = self.templates.lock().expect("templates lock");
        let template = templates
            .get_mut(id)
            .ok_or_else(|| ApiError::TemplateNotFound(id.to_string()))?;
        let mut next = template.clone();
        next.status.manifest_ref = Some(manifest);
        self.store.put_template(&next)?;
        *template = next.clone();
        Ok(next)
    }

    /// The recipe of template `id`'s golden checkpoint (creates of a template that a node has
    /// not built yet, or built with an older execd, build it again from this).
    pub(super) fn golden_recipe_of(&self, id: &str) -> Result<GoldenRecipe, ApiError> {
        golden_recipe(&self.get_template(id)?)
    }

    /// `GET /v1/templates/{id}`.
    pub fn get_template(&self, id: &str) -> Result<Template, ApiError> {
        self.templates
            .lock()
            .expect("templates lock")
            .get(id)
            .cloned()
            .ok_or_else(|| ApiError::TemplateNotFound(id.to_string()))
    }

    /// A template sandboxes can be created from (`Succeeded`), or 404.
    pub(super) fn ready_template(&self, id: &str) -> Result<Template, ApiError> {
        match self.get_template(id)? {
            t if t.status.phase == TemplatePhase::Succeeded => Ok(t),
            t => Err(ApiError::TemplateNotFound(format!(
                "{id} (its build is {:?}, not Succeeded)",
                t.status.phase
            ))),
        }
    }

    /// `GET /v1/templates`: metadata filter, newest first, paginated.
    pub fn list_templates(
        &self,
        metadata: &[(String, String)],
        page: u32,
        page_size: u32,
    ) -> ListTemplatesResponse {
        let empty = StringMap::new();
        let mut items: Vec<Template> = self
            .templates
            .lock()
            .expect("templates lock")
            .values()
            .filter(|t| {
                let m = t.metadata.as_ref().unwrap_or(&empty);
                metadata.iter().all(|(k, v)| m.get(k) == Some(v))
            })
            .cloned()
            .collect();
        items.sort_by_key(|t| std::cmp::Reverse(t.created_at));
        let (pagination, range) = PaginationInfo::of(page, page_size, items.len());
        ListTemplatesResponse {
            items: items[range].to_vec(),
            pagination,
        }
    }

    /// `DELETE /v1/templates/{id}`: forgets it and removes its golden checkpoint from every
    /// node. Sandboxes created from it keep running.
    pub async fn delete_template(&self, id: &str) -> Result<(), ApiError> {
        self.get_template(id)?;
        self.store.remove_template(id)?;
        self.templates.lock().expect("templates lock").remove(id);
        let nodes = self.nodes.all();
        let removals = futures::future::join_all(nodes.iter().map(|n| n.remove_template(id))).await;
        let failed: Vec<String> = nodes
            .iter()
            .zip(removals)
            .filter_map(|(n, r)| r.err().map(|e| format!("node {}: {e}", n.node_id())))
            .collect();
        match failed.is_empty() {
            true => Ok(()),
            false => Err(ApiError::Internal(format!(
                "remove template files: {}",
                failed.join("; ")
            ))),
        }
    }
}
