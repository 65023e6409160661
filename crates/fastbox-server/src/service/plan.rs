//! Turns a `CreateSandboxRequest` into what the node needs, or a 400 that says what is wrong.
//! Nothing is created before a request passed here.

use fastbox_api::lifecycle::{CreateSandboxRequest, ImageSpec, StringMap};
use fastbox_api::quantity::{parse_bytes, parse_cpu_millis};
use fastbox_api::templates::Template;
use fastbox_runtime::cgroup::{CgroupLimits, MIN_CPU_MILLIS};
use fastbox_runtime::spec::DEFAULT_PIDS;

use fastbox_egress::EgressPolicy;

use crate::error::ApiError;
use crate::record::SnapshotRecord;

/// Shortest `timeout` the API accepts, in seconds.
pub const MIN_TIMEOUT_SECS: i64 = 60;

/// Environment keys a request may not set.
const RESERVED_ENV: &[&str] = &["OPENSANDBOX_LIFECYCLE", "EXECD_ACCESS_TOKEN", "EXECD_ENVS"];

/// A validated create.
#[derive(Debug, Clone)]
pub struct CreatePlan {
    pub image: ImageSpec,
    pub entrypoint: Vec<String>,
    pub env: StringMap,
    pub metadata: StringMap,
    pub resource_limits: StringMap,
    pub limits: CgroupLimits,
    pub disk_bytes: Option<u64>,
    pub timeout_secs: Option<i64>,
    pub extensions: Option<StringMap>,
    /// The template (templates API) the sandbox comes from; None: the image's own.
    pub template_id: Option<String>,
    /// The egress policy (allow all when the request has none).
    pub policy: EgressPolicy,
    /// The snapshot the sandbox is restored from (its processes run on as they were).
    pub snapshot_id: Option<String>,
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::InvalidParameter(message.into())
}

fn unsupported(message: impl Into<String>) -> ApiError {
    ApiError::NotSupported(message.into())
}

/// Validates `req` against the API's rules and this server's limits.
pub fn plan(req: CreateSandboxRequest, max_timeout_secs: u64) -> Result<CreatePlan, ApiError> {
    if req.snapshot_id.is_some() {
        return Err(invalid(
            "give exactly one of image, snapshotId and templateId",
        ));
    }
    let image = req
        .image
        .ok_or_else(|| invalid("image is required: {\"image\": {\"uri\": \"...\"}}"))?;
    if image.uri.trim().is_empty() {
        return Err(invalid("image.uri must not be empty"));
    }
    let entrypoint = req.entrypoint.ok_or_else(|| {
        invalid("entrypoint is required with image, e.g. [\"tail\",\"-f\",\"/dev/null\"]")
    })?;
    if entrypoint.is_empty() || entrypoint[0].is_empty() {
        return Err(invalid("entrypoint must name a program"));
    }
    if entrypoint.iter().any(|a| a.contains('\0')) {
        return Err(invalid("entrypoint arguments must not contain NUL"));
    }
    let timeout_secs = timeout_of(req.timeout, max_timeout_secs)?;
    let env = req.env.unwrap_or_default();
    for key in env.keys() {
        if key.is_empty() || key.contains('=') || key.contains('\0') {
            return Err(invalid(format!(
                "env key {key:?} is not a valid variable name"
            )));
        }
        if RESERVED_ENV.contains(&key.as_str()) {
            return Err(invalid(format!("env key {key} is reserved")));
        }
    }
    if env.values().any(|v| v.contains('\0')) {
        return Err(invalid("env values must not contain NUL"));
    }
    let metadata = metadata_of(req.metadata)?;
    let policy = policy_of(req.network_policy.as_ref())?;
    if req.secure_access == Some(true) {
        return Err(invalid("secureAccess is not supported by this server"));
    }
    if req.volumes.as_ref().is_some_and(|v| !v.is_empty()) {
        return Err(unsupported("volumes are not supported by this server"));
    }
    if req.lifecycle.is_some() {
        return Err(unsupported(
            "lifecycle hooks are not supported by this server",
        ));
    }
    if req
        .credential_proxy
        .as_ref()
        .and_then(|c| c.get("enabled"))
        .and_then(|e| e.as_bool())
        == Some(true)
    {
        return Err(unsupported(
            "credentialProxy is not supported by this server",
        ));
    }
    if let Some(p) = &req.platform
        && (p.os != "linux" || p.arch != host_arch())
    {
        return Err(invalid(format!(
            "platform {}/{} is not this server's (linux/{})",
            p.os,
            p.arch,
            host_arch()
        )));
    }
    let resource_limits = req.resource_limits.unwrap_or_default();
    let (limits, disk_bytes) = limits_of(&resource_limits)?;
    Ok(CreatePlan {
        image,
        entrypoint,
        env,
        metadata,
        resource_limits,
        limits,
        disk_bytes,
        timeout_secs,
        extensions: req.extensions,
        template_id: None,
        policy,
        snapshot_id: None,
    })
}

/// A create with `templateId`: the template decides image, entrypoint, environment and
/// limits; the request brings only a (required) timeout, metadata, policy and extensions.
pub fn plan_from_template(
    req: CreateSandboxRequest,
    template: &Template,
    max_timeout_secs: u64,
) -> Result<CreatePlan, ApiError> {
    let refused = [
        ("image", req.image.is_some()),
        ("snapshotId", req.snapshot_id.is_some()),
        ("entrypoint", req.entrypoint.is_some()),
        ("env", req.env.is_some()),
        ("resourceLimits", req.resource_limits.is_some()),
        ("resourceRequests", req.resource_requests.is_some()),
        ("volumes", req.volumes.is_some()),
        ("platform", req.platform.is_some()),
        ("credentialProxy", req.credential_proxy.is_some()),
        ("lifecycle", req.lifecycle.is_some()),
        ("secureAccess", req.secure_access == Some(true)),
    ];
    refuse_given(&refused, "templateId: the template decides it")?;
    let timeout_secs = timeout_of(req.timeout, max_timeout_secs)?
        .ok_or_else(|| invalid("timeout is required with templateId"))?;
    let resource_limits = template.resource_limits.clone().unwrap_or_default();
    let (limits, disk_bytes) = limits_of(&resource_limits)?;
    let policy = policy_of(req.network_policy.as_ref())?;
    Ok(CreatePlan {
        image: ImageSpec {
            uri: template.image.clone(),
            auth: None,
        },
        entrypoint: template
            .entrypoint
            .clone()
            .filter(|e| !e.is_empty())
            .unwrap_or_else(default_entrypoint),
        env: template.env.clone().unwrap_or_default(),
        metadata: metadata_of(req.metadata)?,
        resource_limits,
        limits,
        disk_bytes,
        timeout_secs: Some(timeout_secs),
        extensions: req.extensions,
        template_id: Some(template.template_id.clone()),
        policy,
        snapshot_id: None,
    })
}

/// A create with `snapshotId`: the snapshot's processes run on as they were, so the
/// entrypoint may only be the recorded one or the SDK's default (both ignored), and the
/// environment cannot change. Metadata, timeout, egress policy and limits not given are the
/// snapshot source's.
pub fn plan_from_snapshot(
    req: CreateSandboxRequest,
    snapshot: &SnapshotRecord,
    max_timeout_secs: u64,
) -> Result<CreatePlan, ApiError> {
    let refused = [
        ("image", req.image.is_some()),
        ("templateId", req.template_id.is_some()),
        (
            "volumes",
            req.volumes.as_ref().is_some_and(|v| !v.is_empty()),
        ),
        ("lifecycle", req.lifecycle.is_some()),
        ("secureAccess", req.secure_access == Some(true)),
        ("env", req.env.as_ref().is_some_and(|e| !e.is_empty())),
    ];
    refuse_given(
        &refused,
        "snapshotId: the snapshot's processes run on as they were",
    )?;
    if let Some(entrypoint) = &req.entrypoint
        && *entrypoint != snapshot.entrypoint
        && *entrypoint != default_entrypoint()
    {
        return Err(invalid(format!(
            "entrypoint {entrypoint:?} cannot be given with snapshotId: the snapshot's processes run on as they were (its entrypoint is {:?})",
            snapshot.entrypoint
        )));
    }
    let timeout_secs = timeout_of(req.timeout, max_timeout_secs)?.or(snapshot.timeout_secs);
    let mut resource_limits = req
        .resource_limits
        .unwrap_or_else(|| snapshot.resource_limits.clone());
    // The writable layer must hold the snapshot's: its disk size stays unless given.
    for key in ["disk", "ephemeral-storage"] {
        if let Some(disk) = snapshot.resource_limits.get(key)
            && !resource_limits.contains_key("disk")
            && !resource_limits.contains_key("ephemeral-storage")
        {
            resource_limits.insert(key.to_string(), disk.clone());
        }
    }
    let (limits, disk_bytes) = limits_of(&resource_limits)?;
    let metadata = match req.metadata {
        Some(m) if !m.is_empty() => metadata_of(Some(m))?,
        _ => snapshot.metadata.clone(),
    };
    let policy = match &req.network_policy {
        Some(p) => policy_of(Some(p))?,
        None => snapshot.policy(),
    };
    Ok(CreatePlan {
        image: snapshot.image.clone(),
        entrypoint: snapshot.entrypoint.clone(),
        env: snapshot.env.clone(),
        metadata,
        resource_limits,
        limits,
        disk_bytes,
        timeout_secs,
        extensions: req.extensions,
        template_id: None,
        policy,
        snapshot_id: Some(snapshot.id.clone()),
    })
}

/// A 400 naming the first field of `fields` the request gave, which it may not give with
/// `with` (`"templateId: why"`).
fn refuse_given(fields: &[(&str, bool)], with: &str) -> Result<(), ApiError> {
    match fields.iter().find(|(_, given)| *given) {
        Some((field, _)) => Err(invalid(format!("{field} cannot be given with {with}"))),
        None => Ok(()),
    }
}

/// The SDK's default entrypoint: keep the sandbox alive.
pub fn default_entrypoint() -> Vec<String> {
    ["tail", "-f", "/dev/null"].map(String::from).to_vec()
}

fn timeout_of(timeout: Option<i64>, max_timeout_secs: u64) -> Result<Option<i64>, ApiError> {
    match timeout {
        None => Ok(None),
        Some(t) if t < MIN_TIMEOUT_SECS => Err(invalid(format!(
            "timeout must be at least {MIN_TIMEOUT_SECS} seconds (or null for no expiry), got {t}"
        ))),
        Some(t) if t as u64 > max_timeout_secs => Err(invalid(format!(
            "timeout must be at most {max_timeout_secs} seconds, got {t}"
        ))),
        Some(t) => Ok(Some(t)),
    }
}

fn metadata_of(metadata: Option<StringMap>) -> Result<StringMap, ApiError> {
    let metadata = metadata.unwrap_or_default();
    fastbox_api::metadata::validate(metadata.iter())
        .map_err(|e| ApiError::InvalidMetadata(e.to_string()))?;
    Ok(metadata)
}

/// The egress policy of a request (`docs/egress.md`); a bad one is a 400 naming the rule.
pub fn policy_of(
    policy: Option<&fastbox_api::lifecycle::NetworkPolicy>,
) -> Result<EgressPolicy, ApiError> {
    EgressPolicy::from_wire(policy).map_err(|e| invalid(format!("networkPolicy: {e}")))
}

fn host_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// `resourceLimits`: `cpu`, `memory`, `disk` (alias `ephemeral-storage`), `pids`.
pub fn limits_of(map: &StringMap) -> Result<(CgroupLimits, Option<u64>), ApiError> {
    let mut limits = CgroupLimits {
        cpu_millis: None,
        memory_bytes: None,
        pids: Some(DEFAULT_PIDS),
    };
    let mut disk = None;
    for (key, value) in map {
        let bad =
            |e: &dyn std::fmt::Display| invalid(format!("resourceLimits.{key} {value:?}: {e}"));
        match key.as_str() {
            "cpu" => {
                let millis = parse_cpu_millis(value).map_err(|e| bad(&e))?;
                if millis < MIN_CPU_MILLIS {
                    return Err(bad(&format!("at least {MIN_CPU_MILLIS}m")));
                }
                limits.cpu_millis = Some(millis);
            }
            "memory" => {
                let bytes = parse_bytes(value).map_err(|e| bad(&e))?;
                if bytes < 16 << 20 {
                    return Err(bad(&"at least 16Mi"));
                }
                limits.memory_bytes = Some(bytes);
            }
            "disk" | "ephemeral-storage" => {
                let bytes = parse_bytes(value).map_err(|e| bad(&e))?;
                if bytes < 64 << 20 {
                    return Err(bad(&"at least 64Mi"));
                }
                disk = Some(bytes);
            }
            "pids" => {
                let n: u64 = value.parse().map_err(|e| bad(&e))?;
                if n < 16 {
                    return Err(bad(&"at least 16"));
                }
                limits.pids = Some(n);
            }
            "gpu" | "nvidia.com/gpu" if value == "0" => {}
            "gpu" | "nvidia.com/gpu" => {
                return Err(unsupported("GPUs are not supported by this server"));
            }
            _ => {
                return Err(invalid(format!(
                    "resourceLimits.{key} is not a known resource (cpu, memory, disk, pids)"
                )));
            }
        }
    }
    Ok((limits, disk))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(json: &str) -> CreateSandboxRequest {
        serde_json::from_str(json).unwrap()
    }

    fn err(json: &str) -> ApiError {
        plan(req(json), 86_400).unwrap_err()
    }

    #[test]
    fn the_sdks_default_body_plans() {
        let p = plan(
            req(r#"{"image":{"uri":"python:3.12"},"timeout":600,"resourceLimits":{"cpu":"1","memory":"2Gi"},"entrypoint":["tail","-f","/dev/null"],"secureAccess":false}"#),
            86_400,
        )
        .unwrap();
        assert_eq!(p.limits.cpu_millis, Some(1000));
        assert_eq!(p.limits.memory_bytes, Some(2 << 30));
        assert_eq!(p.timeout_secs, Some(600));
    }

    #[test]
    fn bad_requests_say_what_is_wrong() {
        let base = r#""image":{"uri":"x"},"entrypoint":["a"]"#;
        assert!(matches!(err("{}"), ApiError::InvalidParameter(_)));
        assert!(matches!(
            err(r#"{"image":{"uri":"x"}}"#),
            ApiError::InvalidParameter(_)
        ));
        let e = err(&format!("{{{base},\"timeout\":10}}"));
        assert!(e.to_string().contains("at least 60"), "{e}");
        assert!(matches!(
            err(&format!("{{{base},\"timeout\":999999}}")),
            ApiError::InvalidParameter(_)
        ));
        let e = err(&format!(
            "{{{base},\"resourceLimits\":{{\"cpu\":\"lots\"}}}}"
        ));
        assert!(e.to_string().contains("resourceLimits.cpu"), "{e}");
        assert!(matches!(
            err(&format!("{{{base},\"resourceLimits\":{{\"fpga\":\"1\"}}}}")),
            ApiError::InvalidParameter(_)
        ));
        assert!(matches!(
            err(&format!("{{{base},\"metadata\":{{\"bad key\":\"v\"}}}}")),
            ApiError::InvalidMetadata(_)
        ));
        assert!(matches!(
            err(&format!(
                "{{{base},\"env\":{{\"EXECD_ACCESS_TOKEN\":\"x\"}}}}"
            )),
            ApiError::InvalidParameter(_)
        ));
        assert!(matches!(
            err(&format!(
                "{{{base},\"networkPolicy\":{{\"egress\":[{{\"action\":\"allow\",\"target\":\"bad target!\"}}]}}}}"
            )),
            ApiError::InvalidParameter(_)
        ));
        assert!(matches!(
            err(r#"{"snapshotId":"s"}"#),
            ApiError::InvalidParameter(_)
        ));
        plan(req(&format!("{{{base},\"networkPolicy\":{{}}}}")), 86_400).unwrap();
    }

    fn snapshot() -> SnapshotRecord {
        let mut source = crate::record::tests::record("src");
        source.resource_limits = [("disk".to_string(), "2Gi".to_string())].into();
        SnapshotRecord {
            id: "snap_1".into(),
            sandbox_id: source.id.clone(),
            name: None,
            status: fastbox_api::snapshots::SnapshotStatus {
                state: fastbox_api::snapshots::SnapshotState::Ready,
                reason: None,
                message: None,
                last_transition_at: None,
            },
            created_at: source.created_at,
            image: source.image.clone(),
            entrypoint: vec!["sleep".into(), "9".into()],
            env: [("A".to_string(), "1".to_string())].into(),
            metadata: source.metadata.clone(),
            resource_limits: source.resource_limits.clone(),
            timeout_secs: Some(900),
            network_policy: None,
            execd_token: "t".into(),
            report: None,
        }
    }

    fn from_snapshot(json: &str) -> Result<CreatePlan, ApiError> {
        plan_from_snapshot(req(json), &snapshot(), 86_400)
    }

    #[test]
    fn snapshot_creates_keep_the_processes_and_inherit_what_is_not_given() {
        // The SDK's default body: its entrypoint and limits, no env.
        let p = from_snapshot(
            r#"{"snapshotId":"snap_1","entrypoint":["tail","-f","/dev/null"],"env":{},"resourceLimits":{"cpu":"1","memory":"2Gi"}}"#,
        )
        .unwrap();
        assert_eq!(
            p.entrypoint,
            ["sleep", "9"],
            "the recorded entrypoint stays"
        );
        assert_eq!(p.snapshot_id.as_deref(), Some("snap_1"));
        assert_eq!(p.timeout_secs, Some(900), "the source's lifetime");
        assert_eq!(p.metadata.get("team").map(String::as_str), Some("a"));
        assert_eq!(p.disk_bytes, Some(2 << 30), "the source's disk stays");
        assert_eq!(p.limits.cpu_millis, Some(1000), "the create's limits win");
        let p = from_snapshot(
            r#"{"snapshotId":"snap_1","entrypoint":["sleep","9"],"timeout":120,"metadata":{"k":"v"}}"#,
        )
        .unwrap();
        assert_eq!(p.timeout_secs, Some(120));
        assert_eq!(p.metadata.len(), 1, "given metadata replaces the source's");
    }

    #[test]
    fn snapshot_creates_refuse_what_would_change_the_processes() {
        for body in [
            r#"{"snapshotId":"snap_1","entrypoint":["/bin/sh"]}"#,
            r#"{"snapshotId":"snap_1","env":{"X":"1"}}"#,
            r#"{"snapshotId":"snap_1","image":{"uri":"python:3.12"}}"#,
            r#"{"snapshotId":"snap_1","templateId":"tpl_1"}"#,
            r#"{"snapshotId":"snap_1","timeout":5}"#,
        ] {
            assert!(
                matches!(from_snapshot(body), Err(ApiError::InvalidParameter(_))),
                "{body}"
            );
        }
    }

    #[test]
    fn disk_and_pids_limits() {
        let map: StringMap = [
            ("disk".to_string(), "1Gi".to_string()),
            ("pids".to_string(), "64".to_string()),
        ]
        .into();
        let (limits, disk) = limits_of(&map).unwrap();
        assert_eq!((limits.pids, disk), (Some(64), Some(1 << 30)));
    }
}
