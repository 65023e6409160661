//! Turns a `CreateSandboxRequest` into what the node needs, or a 400 that says what is wrong.
//! Nothing is created before a request passed here.

use std::path::{Path, PathBuf};

use fastbox_api::lifecycle::{CreateSandboxRequest, ImageSpec, StringMap};
use fastbox_api::limits::{CgroupLimits, DEFAULT_DISK_BYTES};
use fastbox_api::quantity::{parse_bytes, parse_cpu_millis};
use fastbox_api::templates::Template;

use fastbox_egress_policy::EgressPolicy;

use crate::config::{MIN_RESOURCES, ResourcePolicy, ServerConfig, format_bytes, format_cpu};
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
    /// `secureAccess`: its endpoints need its own access token (or a signed route).
    pub secure_access: bool,
    /// Mounted before the entrypoint starts ([`super::volumes`]).
    pub volumes: Vec<fastbox_node_api::wire::VolumeMount>,
    /// The keys of its object-storage volumes, by volume name: for the place request only
    /// (never recorded, so a create restarted after a server restart has none).
    pub volume_keys: std::collections::BTreeMap<String, fastbox_node_api::wire::ObjectStorageKeys>,
    /// `credentialProxy.enabled`: its HTTPS goes through the node's credential proxy.
    pub credential_proxy: bool,
}

/// What a create is validated against: this server's settings.
#[derive(Debug, Clone, Copy)]
pub struct Rules<'a> {
    /// Upper bound of `timeout`.
    pub max_timeout_secs: u64,
    /// Limits of creates that name none, and the most a create may name.
    pub resources: ResourcePolicy,
    /// Where writable layers are made: a disk larger than its file system's free space is
    /// refused.
    pub data_dir: &'a Path,
    /// Directories whose subdirectories may be mounted as host volumes.
    pub host_volume_roots: &'a [PathBuf],
    /// Networks of the special ranges an object-storage endpoint address may be in.
    pub allow_private: &'a [fastbox_image::IpNet],
}

impl<'a> Rules<'a> {
    pub fn of(cfg: &'a ServerConfig) -> Self {
        Rules {
            max_timeout_secs: cfg.max_timeout.as_secs(),
            resources: cfg.resources,
            data_dir: &cfg.data_dir,
            host_volume_roots: &cfg.host_volume_roots,
            allow_private: &cfg.registry_allow_private,
        }
    }
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::InvalidParameter(message.into())
}

fn unsupported(message: impl Into<String>) -> ApiError {
    ApiError::NotSupported(message.into())
}

/// Validates `req` against the API's rules and this server's limits.
pub fn plan(req: CreateSandboxRequest, rules: &Rules) -> Result<CreatePlan, ApiError> {
    let max_timeout_secs = rules.max_timeout_secs;
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
    let credential_proxy =
        credential_proxy_of(req.credential_proxy.as_ref(), req.network_policy.is_some())?;
    isolation_of(req.extensions.as_ref())?;
    let metadata = metadata_of(req.metadata)?;
    let policy = policy_of(req.network_policy.as_ref())?;
    let super::volumes::Planned {
        mounts: volumes,
        keys: volume_keys,
    } = super::volumes::plan_volumes(
        req.volumes.as_deref().unwrap_or_default(),
        super::volumes::VolumeRules {
            host_roots: rules.host_volume_roots,
            allow_private: rules.allow_private,
        },
    )?;
    if req.lifecycle.is_some() {
        return Err(unsupported(
            "lifecycle hooks are not supported by this server",
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
    let (limits, disk_bytes) = limits_of(&resource_limits, rules)?;
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
        secure_access: req.secure_access == Some(true),
        volumes,
        volume_keys,
        credential_proxy,
    })
}

/// A create with `templateId`: the template decides image, entrypoint, environment and
/// limits; the request brings only a (required) timeout, metadata, policy and extensions.
pub fn plan_from_template(
    req: CreateSandboxRequest,
    template: &Template,
    rules: &Rules,
) -> Result<CreatePlan, ApiError> {
    let max_timeout_secs = rules.max_timeout_secs;
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
    isolation_of(req.extensions.as_ref())?;
    let timeout_secs = timeout_of(req.timeout, max_timeout_secs)?
        .ok_or_else(|| invalid("timeout is required with templateId"))?;
    let resource_limits = template.resource_limits.clone().unwrap_or_default();
    let (limits, disk_bytes) = limits_of(&resource_limits, rules)?;
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
        secure_access: false,
        volumes: Vec::new(),
        volume_keys: Default::default(),
        credential_proxy: false,
    })
}

/// A create with `snapshotId`: the snapshot's processes run on as they were, so the
/// entrypoint may only be the recorded one or the SDK's default (both ignored), and the
/// environment cannot change. Metadata, timeout, egress policy and limits not given are the
/// snapshot source's.
pub fn plan_from_snapshot(
    req: CreateSandboxRequest,
    snapshot: &SnapshotRecord,
    rules: &Rules,
) -> Result<CreatePlan, ApiError> {
    let max_timeout_secs = rules.max_timeout_secs;
    let refused = [
        ("image", req.image.is_some()),
        ("templateId", req.template_id.is_some()),
        (
            "volumes",
            req.volumes.as_ref().is_some_and(|v| !v.is_empty()),
        ),
        ("lifecycle", req.lifecycle.is_some()),
        ("env", req.env.as_ref().is_some_and(|e| !e.is_empty())),
    ];
    refuse_given(
        &refused,
        "snapshotId: the snapshot's processes run on as they were",
    )?;
    if isolation_of(req.extensions.as_ref())? {
        return Err(invalid(format!(
            "extension {ISOLATION_EXTENSION} cannot be given with snapshotId: a clone offers isolated sessions when its snapshot's sandbox did"
        )));
    }
    if credential_proxy_asked(req.credential_proxy.as_ref())? && !snapshot.credential_proxy {
        return Err(invalid(
            "credentialProxy cannot be given with snapshotId: a clone keeps its snapshot's (this snapshot's sandbox had none)",
        ));
    }
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
    let (limits, disk_bytes) = limits_of(&resource_limits, rules)?;
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
        // A clone of a secure sandbox is secure (`false` is the SDK's default, not a
        // request to open it); `true` makes a clone of any sandbox secure.
        secure_access: snapshot.secure_access || req.secure_access == Some(true),
        volumes: snapshot.volumes.clone(),
        volume_keys: Default::default(),
        credential_proxy: snapshot.credential_proxy,
    })
}

/// A 400 naming the first field of `fields` the request gave, which it may not give with
/// `with` (`"templateId: why"`).
/// `extensions` key of a create that offers isolated sessions (`/v1/isolated` of execd),
/// named as upstream names it.
pub const ISOLATION_EXTENSION: &str = "bootstrap.execd.isolation";

/// Whether `extensions` ask for isolated sessions: `"enable"`; `"disable"` or absent: not.
pub fn isolation_of(extensions: Option<&StringMap>) -> Result<bool, ApiError> {
    match extensions
        .and_then(|e| e.get(ISOLATION_EXTENSION))
        .map(String::as_str)
    {
        None | Some("disable") => Ok(false),
        Some("enable") => Ok(true),
        Some(other) => Err(invalid(format!(
            "extension {ISOLATION_EXTENSION} must be \"enable\" or \"disable\", not {other:?}"
        ))),
    }
}

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
/// `credentialProxy.enabled` of a request (`{"enabled": bool}` and nothing else). It needs
/// a `networkPolicy`: the proxy reaches hosts only as the sandbox would, under its policy.
fn credential_proxy_of(
    given: Option<&serde_json::Value>,
    network_policy: bool,
) -> Result<bool, ApiError> {
    let enabled = credential_proxy_asked(given)?;
    if enabled && !network_policy {
        return Err(invalid(
            "credentialProxy.enabled needs a networkPolicy (defaultAction deny is recommended)",
        ));
    }
    Ok(enabled)
}

/// Whether the request's `credentialProxy` (if any) is `{"enabled": true}`.
fn credential_proxy_asked(given: Option<&serde_json::Value>) -> Result<bool, ApiError> {
    let Some(value) = given else {
        return Ok(false);
    };
    let bad = || invalid("credentialProxy must be {\"enabled\": true|false}");
    let object = value.as_object().ok_or_else(bad)?;
    if object.keys().any(|k| k != "enabled") {
        return Err(bad());
    }
    match object.get("enabled") {
        None => Ok(false),
        Some(enabled) => enabled.as_bool().ok_or_else(bad),
    }
}

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

/// One limit of a `resourceLimits` map: its key as given, its text and its value.
#[derive(Debug, Clone, Copy)]
struct Given<'m> {
    key: &'m str,
    text: &'m str,
    value: u64,
}

/// The limits a `resourceLimits` map names, each checked against the least a sandbox needs.
#[derive(Debug, Default)]
struct Named<'m> {
    cpu: Option<Given<'m>>,
    memory: Option<Given<'m>>,
    disk: Option<Given<'m>>,
    pids: Option<Given<'m>>,
}

/// `resourceLimits`: `cpu`, `memory`, `disk` (alias `ephemeral-storage`), `pids`.
fn named_limits(map: &StringMap) -> Result<Named<'_>, ApiError> {
    let mut named = Named::default();
    for (key, value) in map {
        let bad =
            |e: &dyn std::fmt::Display| invalid(format!("resourceLimits.{key} {value:?}: {e}"));
        let given = |n| {
            Some(Given {
                key,
                text: value,
                value: n,
            })
        };
        let at_least = |n: u64, min: u64, show: fn(u64) -> String| {
            if n < min {
                Err(bad(&format!("at least {}", show(min))))
            } else {
                Ok(n)
            }
        };
        match key.as_str() {
            "cpu" => {
                let millis = parse_cpu_millis(value).map_err(|e| bad(&e))?;
                let millis = at_least(millis, MIN_RESOURCES.cpu_millis, |m| format!("{m}m"))?;
                named.cpu = given(millis);
            }
            "memory" => {
                let bytes = parse_bytes(value).map_err(|e| bad(&e))?;
                named.memory = given(at_least(bytes, MIN_RESOURCES.memory_bytes, format_bytes)?);
            }
            "disk" | "ephemeral-storage" => {
                let bytes = parse_bytes(value).map_err(|e| bad(&e))?;
                named.disk = given(at_least(bytes, MIN_RESOURCES.disk_bytes, format_bytes)?);
            }
            "pids" => {
                let n: u64 = value.parse().map_err(|e| bad(&e))?;
                named.pids = given(at_least(n, MIN_RESOURCES.pids, |n| n.to_string())?);
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
    Ok(named)
}

/// The limits `named` gives, the defaults of `resources` for the others. The disk is `None`
/// when it is the runtime's own default size (what pooled sandboxes and spare slots have).
fn with_defaults(named: &Named, resources: &ResourcePolicy) -> (CgroupLimits, Option<u64>) {
    let defaults = &resources.defaults;
    let value = |g: Option<Given>| g.map(|g| g.value);
    let limits = CgroupLimits {
        cpu_millis: Some(value(named.cpu).unwrap_or(defaults.cpu_millis)),
        memory_bytes: Some(value(named.memory).unwrap_or(defaults.memory_bytes)),
        pids: Some(value(named.pids).unwrap_or(defaults.pids)),
    };
    let disk = value(named.disk).unwrap_or(defaults.disk_bytes);
    (limits, (disk != DEFAULT_DISK_BYTES).then_some(disk))
}

/// A named limit, the maximum, the setting that sets it, how the maximum is written.
type Check<'m> = (Option<Given<'m>>, u64, &'static str, fn(u64) -> String);

/// A create's `resourceLimits` (the request's, its template's or its snapshot's): checked
/// against the operator's maximums, a named disk against the free space of the data
/// directory's file system, and the operator's defaults for what it does not name.
pub fn limits_of(map: &StringMap, rules: &Rules) -> Result<(CgroupLimits, Option<u64>), ApiError> {
    let named = named_limits(map)?;
    let max = &rules.resources.max;
    let checks: [Check; 4] = [
        (named.cpu, max.cpu_millis, "--max-cpu", format_cpu),
        (named.memory, max.memory_bytes, "--max-memory", format_bytes),
        (named.disk, max.disk_bytes, "--max-disk", format_bytes),
        (named.pids, max.pids, "--max-pids", |n| n.to_string()),
    ];
    for (given, maximum, setting, show) in checks {
        if let Some(g) = given
            && g.value > maximum
        {
            return Err(ApiError::AboveMaximum {
                resource: g.key.to_string(),
                requested: g.text.to_string(),
                maximum: show(maximum),
                setting,
            });
        }
    }
    if let Some(disk) = named.disk {
        let free = free_bytes(rules.data_dir).map_err(|e| {
            ApiError::Internal(format!(
                "cannot read the free space of {}: {e}",
                rules.data_dir.display()
            ))
        })?;
        if disk.value > free {
            return Err(ApiError::InsufficientDisk {
                resource: disk.key.to_string(),
                requested: disk.text.to_string(),
                free: approx_bytes(free),
            });
        }
    }
    Ok(with_defaults(&named, &rules.resources))
}

/// The limits of a sandbox that was admitted already (a restarted create, a resume, a clone):
/// its recorded `resourceLimits` and the defaults for the others, without the maximums.
pub fn recorded_limits(
    map: &StringMap,
    resources: &ResourcePolicy,
) -> Result<(CgroupLimits, Option<u64>), ApiError> {
    Ok(with_defaults(&named_limits(map)?, resources))
}

/// Bytes an unprivileged writer may still use in the file system of `path` (statvfs).
pub fn free_bytes(path: &Path) -> std::io::Result<u64> {
    let st = nix::sys::statvfs::statvfs(path).map_err(std::io::Error::from)?;
    Ok((st.blocks_available() as u64).saturating_mul(st.fragment_size() as u64))
}

/// `37.2 GiB`, `512.0 MiB`, `100 B`.
fn approx_bytes(bytes: u64) -> String {
    const UNITS: [(u32, &str); 5] = [
        (50, "PiB"),
        (40, "TiB"),
        (30, "GiB"),
        (20, "MiB"),
        (10, "KiB"),
    ];
    for (shift, unit) in UNITS {
        if bytes >= 1 << shift {
            return format!("{:.1} {unit}", bytes as f64 / (1u64 << shift) as f64);
        }
    }
    format!("{bytes} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(json: &str) -> CreateSandboxRequest {
        serde_json::from_str(json).unwrap()
    }

    /// The default settings, layers made in the file system of the temporary directory.
    fn rules() -> Rules<'static> {
        Rules {
            max_timeout_secs: 86_400,
            resources: ResourcePolicy::default(),
            data_dir: Path::new("/tmp"),
            host_volume_roots: &[],
            allow_private: &[],
        }
    }

    fn err(json: &str) -> ApiError {
        plan(req(json), &rules()).unwrap_err()
    }

    #[test]
    fn the_sdks_default_body_plans() {
        let p = plan(
            req(r#"{"image":{"uri":"python:3.12"},"timeout":600,"resourceLimits":{"cpu":"1","memory":"2Gi"},"entrypoint":["tail","-f","/dev/null"],"secureAccess":false}"#),
            &rules(),
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
        plan(req(&format!("{{{base},\"networkPolicy\":{{}}}}")), &rules()).unwrap();
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
            secure_access: false,
            node: None,
            manifest: None,
            volumes: Vec::new(),
            credential_proxy: false,
            taken_by: None,
        }
    }

    fn from_snapshot(json: &str) -> Result<CreatePlan, ApiError> {
        plan_from_snapshot(req(json), &snapshot(), &rules())
    }

    #[test]
    fn credential_proxy_needs_a_policy_and_clones_keep_their_snapshots() {
        let base = r#""image":{"uri":"python:3.12"},"entrypoint":["tail"],"timeout":600"#;
        let policy = r#""networkPolicy":{"defaultAction":"deny"}"#;
        let planned = |extra: &str| plan(req(&format!("{{{base},{extra}}}")), &rules());
        let on = r#""credentialProxy":{"enabled":true}"#;
        assert!(planned(&format!("{on},{policy}")).unwrap().credential_proxy);
        let err = planned(on).unwrap_err().to_string();
        assert!(err.contains("networkPolicy"), "{err}");
        let off = r#""credentialProxy":{"enabled":false}"#;
        assert!(!planned(off).unwrap().credential_proxy);
        assert!(!planned(r#""credentialProxy":{}"#).unwrap().credential_proxy);
        for bad in [
            r#""credentialProxy":{"enabled":"yes"}"#,
            r#""credentialProxy":{"enabled":true,"mitm":1}"#,
            r#""credentialProxy":true"#,
        ] {
            let err = planned(&format!("{bad},{policy}")).unwrap_err().to_string();
            assert!(err.contains("credentialProxy"), "{bad}: {err}");
        }
        // A clone keeps its snapshot's: on with it, refused when asked of one without.
        let clone = |json: &str, proxied: bool| {
            let mut snap = snapshot();
            snap.credential_proxy = proxied;
            plan_from_snapshot(req(json), &snap, &rules())
        };
        let asked = r#"{"snapshotId":"s","credentialProxy":{"enabled":true}}"#;
        assert!(
            clone(r#"{"snapshotId":"s"}"#, true)
                .unwrap()
                .credential_proxy
        );
        assert!(clone(asked, true).unwrap().credential_proxy);
        let err = clone(asked, false).unwrap_err().to_string();
        assert!(err.contains("credentialProxy"), "{err}");
        assert!(
            !clone(r#"{"snapshotId":"s"}"#, false)
                .unwrap()
                .credential_proxy
        );
    }

    #[test]
    fn secure_access_is_planned_and_clones_of_secure_sandboxes_stay_secure() {
        let base = r#""image":{"uri":"python:3.12"},"entrypoint":["tail"],"timeout":600"#;
        for (body, secure) in [
            (format!("{{{base},\"secureAccess\":true}}"), true),
            (format!("{{{base},\"secureAccess\":false}}"), false),
            (format!("{{{base}}}"), false),
        ] {
            assert_eq!(
                plan(req(&body), &rules()).unwrap().secure_access,
                secure,
                "{body}"
            );
        }
        let mut secure_source = snapshot();
        secure_source.secure_access = true;
        for body in [
            r#"{"snapshotId":"snap_1"}"#,
            r#"{"snapshotId":"snap_1","secureAccess":false}"#,
        ] {
            let p = plan_from_snapshot(req(body), &secure_source, &rules()).unwrap();
            assert!(p.secure_access, "{body}");
        }
        assert!(
            !from_snapshot(r#"{"snapshotId":"snap_1"}"#)
                .unwrap()
                .secure_access
        );
        assert!(
            from_snapshot(r#"{"snapshotId":"snap_1","secureAccess":true}"#)
                .unwrap()
                .secure_access
        );
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
        let (limits, disk) = limits_of(&map, &rules()).unwrap();
        assert_eq!((limits.pids, disk), (Some(64), Some(1 << 30)));
    }

    fn limits(
        pairs: &[(&str, &str)],
        rules: &Rules,
    ) -> Result<(CgroupLimits, Option<u64>), ApiError> {
        let map: StringMap = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        limits_of(&map, rules)
    }

    #[test]
    fn creates_that_name_no_limit_get_the_defaults() {
        let (cgroup, disk) = limits(&[], &rules()).unwrap();
        assert_eq!(cgroup.cpu_millis, Some(1000));
        assert_eq!(cgroup.memory_bytes, Some(512 << 20));
        assert_eq!(cgroup.pids, Some(fastbox_api::limits::DEFAULT_PIDS));
        assert_eq!(
            disk, None,
            "the runtime's own layer size, which pooled sandboxes and spares have"
        );
        // The operator's defaults; the ones a create names win.
        let mut custom = rules();
        custom.resources.defaults = crate::config::Resources {
            cpu_millis: 500,
            memory_bytes: 1 << 30,
            disk_bytes: 2 << 30,
            pids: 100,
        };
        let (cgroup, disk) = limits(&[("memory", "256Mi")], &custom).unwrap();
        assert_eq!(
            (cgroup.cpu_millis, cgroup.memory_bytes, cgroup.pids, disk),
            (Some(500), Some(256 << 20), Some(100), Some(2 << 30))
        );
        let p = plan(
            req(r#"{"image":{"uri":"python:3.12"},"entrypoint":["sh"]}"#),
            &custom,
        )
        .unwrap();
        assert_eq!(p.limits.memory_bytes, Some(1 << 30));
        assert!(
            p.resource_limits.is_empty(),
            "the record keeps what was asked"
        );
        // Records admitted earlier get the defaults too, and no maximum.
        let (cgroup, _) = recorded_limits(
            &[("memory".to_string(), "1Ti".to_string())].into(),
            &custom.resources,
        )
        .unwrap();
        assert_eq!(
            (cgroup.cpu_millis, cgroup.memory_bytes),
            (Some(500), Some(1 << 40))
        );
    }

    #[test]
    fn limits_above_the_maximums_are_400s_naming_the_resource_the_value_and_the_maximum() {
        let rules = rules();
        for (key, value, maximum, setting) in [
            ("memory", "1Ti", "16Gi", "--max-memory"),
            ("memory", "17179869185", "16Gi", "--max-memory"),
            ("cpu", "4001m", "4", "--max-cpu"),
            ("cpu", "64", "4", "--max-cpu"),
            ("disk", "65Gi", "64Gi", "--max-disk"),
            ("ephemeral-storage", "1Pi", "64Gi", "--max-disk"),
            ("pids", "4097", "4096", "--max-pids"),
        ] {
            let e = limits(&[(key, value)], &rules).unwrap_err();
            assert!(matches!(e, ApiError::AboveMaximum { .. }), "{key}: {e:?}");
            assert_eq!(e.status(), axum::http::StatusCode::BAD_REQUEST);
            assert_eq!(e.code(), "SANDBOX::INVALID_PARAMETER");
            let message = e.to_string();
            for part in [
                format!("resourceLimits.{key}"),
                format!("{value:?}"),
                format!("maximum of {maximum}"),
                setting.to_string(),
            ] {
                assert!(message.contains(&part), "{part} not in {message}");
            }
        }
        // Equal to the maximum is accepted.
        let (cgroup, disk) = limits(
            &[
                ("cpu", "4"),
                ("memory", "16Gi"),
                ("disk", "64Gi"),
                ("pids", "4096"),
            ],
            &Rules {
                data_dir: Path::new("/"),
                host_volume_roots: &[],
                allow_private: &[],
                ..rules
            },
        )
        .or_else(|e| match e {
            // This machine may have less than 64 GiB free: the same with a smaller disk.
            ApiError::InsufficientDisk { .. } => limits(
                &[
                    ("cpu", "4"),
                    ("memory", "16Gi"),
                    ("disk", "64Mi"),
                    ("pids", "4096"),
                ],
                &rules,
            ),
            e => Err(e),
        })
        .unwrap();
        assert_eq!(
            (cgroup.cpu_millis, cgroup.memory_bytes, cgroup.pids),
            (Some(4000), Some(16 << 30), Some(4096))
        );
        assert!(disk.is_some());
        // A whole create with more than the maximum is refused before anything happens.
        let e = err(
            r#"{"image":{"uri":"python:3.12"},"entrypoint":["sh"],"resourceLimits":{"memory":"1Ti"}}"#,
        );
        assert!(matches!(e, ApiError::AboveMaximum { .. }), "{e:?}");
        // So are a template's and a snapshot's.
        let template = Template {
            template_id: "tpl_1".into(),
            image: "python:3.12".into(),
            publish: "local".into(),
            format: "native".into(),
            status: fastbox_api::templates::TemplateStatus {
                phase: fastbox_api::templates::TemplatePhase::Succeeded,
                manifest_ref: None,
                message: None,
            },
            created_at: chrono::Utc::now(),
            updated_at: chrono::Utc::now(),
            resource_limits: Some([("pids".to_string(), "100000".to_string())].into()),
            entrypoint: None,
            env: None,
            metadata: None,
            readiness: None,
        };
        let e = plan_from_template(
            req(r#"{"templateId":"tpl_1","timeout":600}"#),
            &template,
            &rules,
        )
        .unwrap_err();
        assert!(matches!(e, ApiError::AboveMaximum { .. }), "{e:?}");
        let e =
            from_snapshot(r#"{"snapshotId":"snap_1","resourceLimits":{"cpu":"8"}}"#).unwrap_err();
        assert!(matches!(e, ApiError::AboveMaximum { .. }), "{e:?}");
    }

    #[test]
    fn a_disk_larger_than_the_free_space_is_a_400() {
        let dir = tempfile::tempdir().unwrap();
        let free = free_bytes(dir.path()).unwrap();
        assert!(
            free > 64 << 20,
            "the test needs 64 MiB free in {}",
            dir.path().display()
        );
        let mut rules = rules();
        rules.data_dir = dir.path();
        rules.resources.max.disk_bytes = u64::MAX;
        let too_much = (free + (1 << 30)).to_string();
        let e = limits(&[("disk", &too_much)], &rules).unwrap_err();
        assert!(matches!(e, ApiError::InsufficientDisk { .. }), "{e:?}");
        assert_eq!(e.status(), axum::http::StatusCode::BAD_REQUEST);
        let message = e.to_string();
        assert!(
            message.contains("resourceLimits.disk")
                && message.contains(&too_much)
                && message.contains("free"),
            "{message}"
        );
        let (_, disk) = limits(&[("disk", "64Mi")], &rules).unwrap();
        assert_eq!(disk, Some(64 << 20));
        // The default is not checked: it is sparse and the operator's choice.
        limits(&[], &rules).unwrap();
    }
}
