//! The templates API (`/v1/templates`, OpenSandbox 1.1.1 "fsb" templates): a template is a
//! golden checkpoint of an image, with the entrypoint, environment and limits its sandboxes get.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::lifecycle::{PaginationInfo, StringMap};

/// `POST /v1/templates`.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct CreateTemplateRequest {
    pub image: String,
    /// Where the template's artifact is published: `local` (this node's artifact store) or
    /// `file:///dir`.
    pub publish: String,
    pub resource_limits: Option<StringMap>,
    pub entrypoint: Option<Vec<String>>,
    pub env: Option<StringMap>,
    pub metadata: Option<StringMap>,
    pub readiness: Option<TemplateReadiness>,
    /// `native` or `overlaybd`; fastbox stores every template in its own block format.
    pub format: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemplateReadiness {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup_seconds: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub enum TemplatePhase {
    Pending,
    Building,
    Succeeded,
    Failed,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemplateStatus {
    pub phase: TemplatePhase,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest_ref: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// A template as the API returns it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Template {
    pub template_id: String,
    pub image: String,
    pub publish: String,
    pub format: String,
    pub status: TemplateStatus,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_limits: Option<StringMap>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entrypoint: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<StringMap>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<StringMap>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readiness: Option<TemplateReadiness>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ListTemplatesResponse {
    pub items: Vec<Template>,
    pub pagination: PaginationInfo,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sdks_request_parses_and_the_answer_has_no_nulls() {
        let req: CreateTemplateRequest = serde_json::from_str(
            r#"{"image":"python:3.12","publish":"local","resourceLimits":{"cpu":"1"},"format":"overlaybd"}"#,
        )
        .unwrap();
        assert_eq!(req.publish, "local");
        let t = Template {
            template_id: "tpl_x".into(),
            image: req.image,
            publish: req.publish,
            format: "native".into(),
            status: TemplateStatus {
                phase: TemplatePhase::Pending,
                manifest_ref: None,
                message: None,
            },
            created_at: Utc::now(),
            updated_at: Utc::now(),
            resource_limits: None,
            entrypoint: None,
            env: None,
            metadata: None,
            readiness: None,
        };
        let text = serde_json::to_string(&t).unwrap();
        assert!(
            !text.contains("null") && text.contains("\"templateId\""),
            "{text}"
        );
    }
}
