//! A create's `volumes` (the lifecycle spec's `Volume`), checked before anything is
//! recorded: what the node is asked to mount ([`VolumeMount`]) or a 400 that says what is
//! wrong with which volume.
//!
//! `host` volumes: a directory under one of the directories the operator allows
//! (`--allow-host-volume`, none by default). The node checks the path again and opens it
//! confined to the allowed directory (`fastbox_fastlet::volumes`); this check gives the
//! caller a clear 400 before that. `pvc` volumes are the node's named volumes
//! (`fastbox_fastlet::named_volumes`), each with its size as a quota. `ossfs` volumes are
//! buckets of S3-compatible storage ([`object_storage_source`]): their keys are kept apart
//! ([`Planned::keys`]) for the node's place request only, never recorded.

use std::collections::{BTreeMap, HashSet};
use std::path::{Component, Path, PathBuf};

use fastbox_node_api::wire::{ObjectStorageKeys, VolumeMount, VolumeSource};
use serde::Deserialize;
use serde_json::Value;

use crate::error::ApiError;

/// The most volumes one sandbox may have.
pub const MAX_VOLUMES: usize = 16;
/// The size of a named volume whose create names none.
pub const DEFAULT_NAMED_BYTES: u64 = 1 << 30;
/// The largest named volume.
pub const MAX_NAMED_BYTES: u64 = 256 << 30;

/// Paths of the sandbox a volume may not be mounted on or under: the kernel's interfaces
/// and fastbox's own files.
const RESERVED_MOUNT_PATHS: &[&str] = &["/proc", "/sys", "/dev", "/.fastbox"];

/// One entry of `volumes` as the spec writes it.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Volume {
    name: String,
    #[serde(default)]
    host: Option<HostBackend>,
    #[serde(default)]
    pvc: Option<Value>,
    #[serde(default)]
    ossfs: Option<Value>,
    mount_path: String,
    #[serde(default)]
    read_only: bool,
    #[serde(default)]
    sub_path: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HostBackend {
    path: String,
}

/// `pvc`: a named volume. `storageClass` and `accessModes` mean nothing here (a volume is
/// one node's), and are accepted for the SDKs' sake.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PvcBackend {
    claim_name: String,
    #[serde(default)]
    create_if_not_exists: Option<bool>,
    #[serde(default)]
    delete_on_sandbox_termination: Option<bool>,
    #[serde(default)]
    storage: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    storage_class: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    access_modes: Option<Vec<String>>,
}

/// The volumes of a create and the keys of its object-storage ones.
#[derive(Debug, Default)]
pub struct Planned {
    pub mounts: Vec<VolumeMount>,
    /// By volume name: for the place request only.
    pub keys: BTreeMap<String, ObjectStorageKeys>,
}

/// What a create's volumes are checked against.
#[derive(Debug, Clone, Copy)]
pub struct VolumeRules<'a> {
    /// The allowed host directories.
    pub host_roots: &'a [PathBuf],
    /// Networks of the special ranges an object-storage endpoint given as an address may be
    /// in (the image pulls' `registry_allow_private`).
    pub allow_private: &'a [fastbox_image::IpNet],
}

/// [`plan_volumes`] without object-storage keys (tests).
#[cfg(test)]
pub fn volumes_of(values: &[Value], host_roots: &[PathBuf]) -> Result<Vec<VolumeMount>, ApiError> {
    plan_volumes(
        values,
        VolumeRules {
            host_roots,
            allow_private: &[],
        },
    )
    .map(|p| p.mounts)
}

/// The volumes of a create, in order, and the keys of the object-storage ones.
pub fn plan_volumes(values: &[Value], rules: VolumeRules<'_>) -> Result<Planned, ApiError> {
    let host_roots = rules.host_roots;
    if values.len() > MAX_VOLUMES {
        return Err(invalid(format!(
            "volumes: {} given, at most {MAX_VOLUMES}",
            values.len()
        )));
    }
    let mut names = HashSet::new();
    let mut mounts: Vec<VolumeMount> = Vec::with_capacity(values.len());
    let mut keys = BTreeMap::new();
    for (i, value) in values.iter().enumerate() {
        let volume: Volume = serde_json::from_value(value.clone())
            .map_err(|e| invalid(format!("volumes[{i}]: {e}")))?;
        let at = format!("volumes[{i}] ({})", volume.name);
        check_name(&volume.name).map_err(|e| invalid(format!("volumes[{i}]: name {e}")))?;
        if !names.insert(volume.name.clone()) {
            return Err(invalid(format!("{at}: another volume has this name")));
        }
        let mount_path = mount_path_of(&volume.mount_path)
            .map_err(|e| invalid(format!("{at}: mountPath {e}")))?;
        if let Some(other) = mounts
            .iter()
            .find(|m| nested(Path::new(&m.mount_path), Path::new(&mount_path)))
        {
            return Err(invalid(format!(
                "{at}: mountPath {mount_path} is on or inside volume {}'s mountPath {} (or holds it)",
                other.name, other.mount_path
            )));
        }
        let sub_path = volume
            .sub_path
            .as_deref()
            .map(sub_path_of)
            .transpose()
            .map_err(|e| invalid(format!("{at}: subPath {e}")))?;
        let source = match (&volume.host, &volume.pvc, &volume.ossfs) {
            (Some(host), None, None) => host_source(&host.path, host_roots)
                .map_err(|e| invalid(format!("{at}: host.path {e}")))?,
            (None, Some(pvc), None) => {
                named_source(pvc).map_err(|e| invalid(format!("{at}: pvc.{e}")))?
            }
            (None, None, Some(ossfs)) => {
                let (source, secret) = object_storage_source(ossfs, rules.allow_private)
                    .map_err(|e| invalid(format!("{at}: ossfs.{e}")))?;
                keys.insert(volume.name.clone(), secret);
                source
            }
            (None, None, None) => {
                return Err(invalid(format!(
                    "{at}: names no backend (host, pvc or ossfs)"
                )));
            }
            _ => {
                return Err(invalid(format!(
                    "{at}: names more than one backend (host, pvc, ossfs): exactly one is allowed"
                )));
            }
        };
        mounts.push(VolumeMount {
            name: volume.name,
            source,
            mount_path,
            read_only: volume.read_only,
            sub_path,
        });
    }
    Ok(Planned { mounts, keys })
}

fn invalid(message: String) -> ApiError {
    ApiError::InvalidParameter(message)
}

/// A DNS label: `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63 characters.
fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    match ok {
        true => Ok(()),
        false => Err(format!(
            "{name:?} is not a DNS label (lowercase letters, digits and '-', at most 63)"
        )),
    }
}

/// `path` as plain absolute components (`.` dropped), or why not.
fn plain_absolute(path: &str) -> Result<PathBuf, String> {
    if path.contains('\0') {
        return Err("contains NUL".into());
    }
    let path = Path::new(path);
    if !path.is_absolute() {
        return Err(format!("{} is not absolute", path.display()));
    }
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(name) => out.push(name),
            _ => return Err(format!("{}: '..' is not allowed", path.display())),
        }
    }
    Ok(out)
}

fn mount_path_of(path: &str) -> Result<String, String> {
    let plain = plain_absolute(path)?;
    if plain == Path::new("/") {
        return Err("/ is the sandbox's root: a volume is mounted on a directory inside it".into());
    }
    if let Some(reserved) = RESERVED_MOUNT_PATHS.iter().find(|r| plain.starts_with(r)) {
        return Err(format!(
            "{}: nothing may be mounted on or under {reserved}",
            plain.display()
        ));
    }
    Ok(plain.display().to_string())
}

fn sub_path_of(path: &str) -> Result<String, String> {
    if path.contains('\0') {
        return Err("contains NUL".into());
    }
    let p = Path::new(path);
    if p.is_absolute() {
        return Err(format!("{path} must be relative to the volume"));
    }
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::CurDir => {}
            Component::Normal(name) => out.push(name),
            _ => return Err(format!("{path}: '..' is not allowed")),
        }
    }
    if out.as_os_str().is_empty() {
        return Err(format!("{path:?} names no directory of the volume"));
    }
    Ok(out.display().to_string())
}

/// `ossfs`: a bucket of S3-compatible storage. `version` is accepted and means nothing here
/// (the node's client speaks S3).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct OssfsBackend {
    bucket: String,
    endpoint: String,
    #[serde(default)]
    version: Option<String>,
    #[serde(default)]
    options: Vec<String>,
    access_key_id: String,
    access_key_secret: String,
}

/// The FUSE client options a create may give: they tune how the bucket is spoken to, and
/// none names a host path (`passwd_file`, `use_cache`, `tmpdir` and the like are refused).
const OBJECT_STORAGE_OPTIONS: &[(&str, Option<u64>)] = &[
    // (name, the largest number it takes; None: it takes none)
    ("use_path_request_style", None),
    ("sigv2", None),
    ("sigv4", None),
    ("nomultipart", None),
    ("enable_noobj_cache", None),
    ("list_object_max_keys", Some(1000)),
    // MiB per part.
    ("multipart_size", Some(5120)),
    ("parallel_count", Some(16)),
    ("stat_cache_expire", Some(86400)),
    ("max_stat_cache_size", Some(100_000)),
];

/// An `ossfs` backend as the node's source, and its keys; or why not.
fn object_storage_source(
    value: &Value,
    allow_private: &[fastbox_image::IpNet],
) -> Result<(VolumeSource, ObjectStorageKeys), String> {
    // The error never quotes the value: it holds the keys.
    let backend: OssfsBackend = serde_json::from_value(value.clone()).map_err(|e| {
        let text = e.to_string();
        match text.split_once(" at line") {
            Some((what, _)) => what.to_string(),
            None => text,
        }
    })?;
    let bucket = &backend.bucket;
    let bucket_ok = (3..=63).contains(&bucket.len())
        && bucket
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
        && bucket.starts_with(|c: char| c.is_ascii_alphanumeric())
        && bucket.ends_with(|c: char| c.is_ascii_alphanumeric());
    if !bucket_ok {
        return Err(format!(
            "bucket {bucket:?} is not a bucket name (3 to 63 of lowercase letters, digits, '.' and '-')"
        ));
    }
    if let Some(v) = &backend.version
        && v != "1.0"
        && v != "2.0"
    {
        return Err(format!("version {v:?} is not 1.0 or 2.0"));
    }
    let endpoint =
        endpoint_of(&backend.endpoint, allow_private).map_err(|e| format!("endpoint {e}"))?;
    for option in &backend.options {
        let (name, value) = match option.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (option.as_str(), None),
        };
        let allowed = OBJECT_STORAGE_OPTIONS.iter().find(|(n, _)| *n == name);
        let fits = match (allowed, value) {
            (Some((_, None)), None) => true,
            (Some((_, Some(max))), Some(v)) => v.parse::<u64>().is_ok_and(|n| n >= 1 && n <= *max),
            _ => false,
        };
        if !fits {
            let names: Vec<String> = OBJECT_STORAGE_OPTIONS
                .iter()
                .map(|(n, max)| match max {
                    Some(max) => format!("{n}=1..{max}"),
                    None => n.to_string(),
                })
                .collect();
            return Err(format!(
                "options: {option:?} is not allowed (allowed: {})",
                names.join(", ")
            ));
        }
    }
    let key_ok =
        |k: &str| !k.is_empty() && k.len() <= 512 && k.bytes().all(|b| b.is_ascii_graphic());
    if !key_ok(&backend.access_key_id) || backend.access_key_id.contains(':') {
        return Err("accessKeyId must be visible ASCII without ':'".into());
    }
    if !key_ok(&backend.access_key_secret) {
        return Err("accessKeySecret must be visible ASCII".into());
    }
    Ok((
        VolumeSource::ObjectStorage {
            bucket: backend.bucket,
            endpoint,
            options: backend.options,
        },
        ObjectStorageKeys {
            access_key_id: backend.access_key_id,
            secret_access_key: backend.access_key_secret,
        },
    ))
}

/// `endpoint` as `scheme://host[:port]` (`https` when it names none), or why not. An address
/// in the special ranges (private, loopback, link-local, ...) is refused unless
/// `allow_private` holds it, as for image pulls; a name is checked where it is connected to:
/// the node's client runs in the sandbox's network namespace, whose policy and private-range
/// denies decide.
fn endpoint_of(endpoint: &str, allow_private: &[fastbox_image::IpNet]) -> Result<String, String> {
    let (scheme, rest) = match endpoint.split_once("://") {
        Some((s, r)) if s == "http" || s == "https" => (s, r),
        Some((s, _)) => return Err(format!("{endpoint:?}: scheme {s:?} is not http or https")),
        None => ("https", endpoint),
    };
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => (h, Some(p)),
        _ => (authority, None),
    };
    let host_ok = !host.is_empty()
        && host.len() <= 253
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-');
    let port_ok = port.is_none_or(|p| p.parse::<u16>().is_ok_and(|p| p > 0));
    if !host_ok || !port_ok {
        return Err(format!(
            "{endpoint:?} is not [http[s]://]HOST[:PORT] (no path, no user, no IPv6)"
        ));
    }
    match host.parse::<std::net::IpAddr>() {
        Ok(address) => {
            if let Some(special) = fastbox_image::classify(address)
                && !allow_private.iter().any(|n| n.contains(address))
            {
                return Err(format!(
                    "{endpoint:?}: {address} is {special}, which volumes may not reach unless the operator allows the network (registry_allow_private)"
                ));
            }
        }
        Err(_) => {
            // A name: its last label has a letter (the resolver reads `10.1`, `2130706433`
            // and `0x7f000001` as addresses), and it does not name this machine.
            let last = host.trim_end_matches('.').rsplit('.').next().unwrap_or("");
            let numeric = !last.bytes().any(|b| b.is_ascii_alphabetic())
                || last.to_ascii_lowercase().starts_with("0x");
            let lower = host.to_ascii_lowercase();
            let local = lower == "localhost" || lower.ends_with(".localhost");
            if numeric || local {
                return Err(format!(
                    "{endpoint:?}: {host} is neither an address in dotted form nor a host name of another machine"
                ));
            }
        }
    }
    Ok(format!("{scheme}://{authority}"))
}

fn host_source(path: &str, roots: &[PathBuf]) -> Result<VolumeSource, String> {
    let plain = plain_absolute(path)?;
    if roots.is_empty() {
        return Err(format!(
            "{}: host volumes are off on this server (its operator allows directories with --allow-host-volume)",
            plain.display()
        ));
    }
    if !roots.iter().any(|root| plain.starts_with(root)) {
        return Err(format!(
            "{} is not under a directory this server allows: {}",
            plain.display(),
            roots
                .iter()
                .map(|r| r.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    Ok(VolumeSource::Host {
        path: plain.display().to_string(),
    })
}

fn named_source(pvc: &Value) -> Result<VolumeSource, String> {
    let pvc: PvcBackend = serde_json::from_value(pvc.clone()).map_err(|e| format!("{e}"))?;
    check_name(&pvc.claim_name).map_err(|e| format!("claimName {e}"))?;
    let size_bytes = match &pvc.storage {
        None => DEFAULT_NAMED_BYTES,
        Some(text) => {
            fastbox_api::quantity::parse_bytes(text).map_err(|e| format!("storage {e}"))?
        }
    };
    if !(1 << 20..=MAX_NAMED_BYTES).contains(&size_bytes) {
        return Err(format!(
            "storage {} is outside 1Mi..{}Gi",
            pvc.storage.as_deref().unwrap_or_default(),
            MAX_NAMED_BYTES >> 30
        ));
    }
    Ok(VolumeSource::Named {
        name: pvc.claim_name,
        create: pvc.create_if_not_exists.unwrap_or(true),
        size_bytes,
        delete_on_termination: pvc.delete_on_sandbox_termination.unwrap_or(false),
    })
}

/// Whether one of `a` and `b` is the other or lies inside it.
fn nested(a: &Path, b: &Path) -> bool {
    a.starts_with(b) || b.starts_with(a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn roots() -> Vec<PathBuf> {
        vec![PathBuf::from("/srv/vols")]
    }

    fn one(volume: Value) -> Result<Vec<VolumeMount>, ApiError> {
        volumes_of(&[volume], &roots())
    }

    fn message(e: ApiError) -> String {
        e.to_string()
    }

    #[test]
    fn a_host_volume_under_an_allowed_directory_is_taken() {
        let got = one(json!({"name": "work", "host": {"path": "/srv/vols/./a"},
            "mountPath": "/workspace/", "readOnly": true, "subPath": "./x/y"}))
        .unwrap();
        assert_eq!(
            got,
            vec![VolumeMount {
                name: "work".into(),
                source: VolumeSource::Host {
                    path: "/srv/vols/a".into()
                },
                mount_path: "/workspace".into(),
                read_only: true,
                sub_path: Some("x/y".into()),
            }]
        );
    }

    #[test]
    fn bad_volumes_are_refused_with_what_is_wrong() {
        let cases = [
            (
                json!({"name": "w", "host": {"path": "/etc"}, "mountPath": "/w"}),
                "not under a directory",
            ),
            (
                json!({"name": "w", "host": {"path": "/srv/vols/../../etc"}, "mountPath": "/w"}),
                "'..'",
            ),
            (
                json!({"name": "w", "host": {"path": "srv/vols/a"}, "mountPath": "/w"}),
                "not absolute",
            ),
            (
                json!({"name": "w", "host": {"path": "/srv/volsx"}, "mountPath": "/w"}),
                "not under",
            ),
            (
                json!({"name": "W", "host": {"path": "/srv/vols"}, "mountPath": "/w"}),
                "DNS label",
            ),
            (
                json!({"name": "w", "host": {"path": "/srv/vols"}, "mountPath": "w"}),
                "not absolute",
            ),
            (
                json!({"name": "w", "host": {"path": "/srv/vols"}, "mountPath": "/"}),
                "sandbox's root",
            ),
            (
                json!({"name": "w", "host": {"path": "/srv/vols"}, "mountPath": "/proc/x"}),
                "/proc",
            ),
            (
                json!({"name": "w", "host": {"path": "/srv/vols"}, "mountPath": "/.fastbox"}),
                "/.fastbox",
            ),
            (
                json!({"name": "w", "host": {"path": "/srv/vols"}, "mountPath": "/w/../etc"}),
                "'..'",
            ),
            (
                json!({"name": "w", "host": {"path": "/srv/vols"}, "mountPath": "/w", "subPath": "../x"}),
                "'..'",
            ),
            (
                json!({"name": "w", "host": {"path": "/srv/vols"}, "mountPath": "/w", "subPath": "/x"}),
                "relative",
            ),
            (json!({"name": "w", "mountPath": "/w"}), "no backend"),
            (
                json!({"name": "w", "host": {"path": "/srv/vols"}, "pvc": {"claimName": "x"}, "mountPath": "/w"}),
                "more than one",
            ),
            (
                json!({"name": "w", "host": {"path": "/srv/vols"}, "mountPath": "/w", "extra": 1}),
                "unknown field",
            ),
        ];
        for (volume, expected) in cases {
            let text = message(one(volume.clone()).expect_err(&volume.to_string()));
            assert!(text.contains(expected), "{volume}: {text}");
        }
        let off = volumes_of(
            &[json!({"name": "w", "host": {"path": "/srv/vols"}, "mountPath": "/w"})],
            &[],
        );
        assert!(message(off.unwrap_err()).contains("host volumes are off"));
        for (pvc, expected) in [
            (json!({"claimName": "Bad_Name"}), "DNS label"),
            (json!({"claimName": "../x"}), "DNS label"),
            (json!({"claimName": "x", "storage": "lots"}), "storage"),
            (json!({"claimName": "x", "storage": "512Ki"}), "outside"),
            (json!({"claimName": "x", "storage": "1Ti"}), "outside"),
            (json!({"claimName": "x", "size": 1}), "unknown field"),
        ] {
            let got = one(json!({"name": "w", "pvc": pvc, "mountPath": "/w"}));
            let text = message(got.expect_err(&pvc.to_string()));
            assert!(text.contains(expected), "{pvc}: {text}");
        }
    }

    #[test]
    fn a_named_volume_takes_the_spec_defaults() {
        let got = one(
            json!({"name": "d", "pvc": {"claimName": "data", "storageClass": "x",
            "accessModes": ["ReadWriteOnce"]}, "mountPath": "/data"}),
        )
        .unwrap();
        assert_eq!(
            got[0].source,
            VolumeSource::Named {
                name: "data".into(),
                create: true,
                size_bytes: DEFAULT_NAMED_BYTES,
                delete_on_termination: false,
            }
        );
        let got = one(
            json!({"name": "d", "pvc": {"claimName": "data", "storage": "2Gi",
            "createIfNotExists": false, "deleteOnSandboxTermination": true}, "mountPath": "/data"}),
        )
        .unwrap();
        assert_eq!(
            got[0].source,
            VolumeSource::Named {
                name: "data".into(),
                create: false,
                size_bytes: 2 << 30,
                delete_on_termination: true,
            }
        );
    }

    #[test]
    fn a_bucket_is_taken_and_its_keys_kept_apart_never_in_an_error() {
        let secret = "s3cr3t-never-shown";
        let ossfs = |change: Value| {
            let mut backend = json!({"bucket": "team-data", "endpoint": "s3.example.com",
                "accessKeyId": "AKID", "accessKeySecret": secret,
                "options": ["use_path_request_style", "parallel_count=4"]});
            backend
                .as_object_mut()
                .unwrap()
                .extend(change.as_object().unwrap().clone());
            let allowed = ["10.9.0.0/16".parse().unwrap()];
            plan_volumes(
                &[json!({"name": "d", "ossfs": backend, "mountPath": "/d", "subPath": "p/q"})],
                VolumeRules {
                    host_roots: &[],
                    allow_private: &allowed,
                },
            )
        };
        let planned = ossfs(json!({})).unwrap();
        assert_eq!(
            planned.mounts[0].source,
            VolumeSource::ObjectStorage {
                bucket: "team-data".into(),
                endpoint: "https://s3.example.com".into(),
                options: vec!["use_path_request_style".into(), "parallel_count=4".into()],
            }
        );
        assert_eq!(planned.mounts[0].sub_path.as_deref(), Some("p/q"));
        assert_eq!(planned.keys["d"].secret_access_key, secret);
        assert!(
            !format!("{planned:?}").contains(secret),
            "Debug hides the keys"
        );
        // An address the operator allows passes; others of the special ranges do not.
        assert!(ossfs(json!({"endpoint": "http://10.9.1.2:9000"})).is_ok());
        for (change, expected) in [
            (json!({"endpoint": "http://10.1.2.3"}), "private"),
            (json!({"endpoint": "http://127.0.0.1:9000"}), "loopback"),
            (json!({"endpoint": "ftp://s3.example.com"}), "scheme"),
            (
                json!({"endpoint": "https://s3.example.com/path"}),
                "not [http[s]://]HOST",
            ),
            (
                json!({"endpoint": "https://user@s3.example.com"}),
                "not [http[s]://]HOST",
            ),
            (json!({"bucket": "No_Such"}), "bucket"),
            (json!({"version": "3.0"}), "version"),
            (
                json!({"options": ["passwd_file=/etc/shadow"]}),
                "not allowed",
            ),
            (json!({"options": ["use_cache=/tmp"]}), "not allowed"),
            (json!({"options": ["parallel_count=x"]}), "not allowed"),
            (
                json!({"options": ["parallel_count=1000000"]}),
                "not allowed",
            ),
            (json!({"endpoint": "http://10.1"}), "neither an address"),
            (
                json!({"endpoint": "http://2130706433:80"}),
                "neither an address",
            ),
            (
                json!({"endpoint": "http://0x7f000001"}),
                "neither an address",
            ),
            (
                json!({"endpoint": "http://localhost:9000"}),
                "neither an address",
            ),
            (json!({"accessKeyId": "a:b"}), "accessKeyId"),
            (json!({"accessKeySecret": ""}), "accessKeySecret"),
            (json!({"unknown": 1}), "unknown field"),
        ] {
            let text = message(ossfs(change.clone()).expect_err(&change.to_string()));
            assert!(text.contains(expected), "{change}: {text}");
            assert!(!text.contains(secret), "{change}: {text}");
        }
    }

    #[test]
    fn two_volumes_need_their_own_names_and_mount_paths() {
        let v = |name: &str, at: &str| json!({"name": name, "host": {"path": "/srv/vols"}, "mountPath": at});
        let same_name = volumes_of(&[v("a", "/x"), v("a", "/y")], &roots());
        assert!(message(same_name.unwrap_err()).contains("another volume has this name"));
        let nested = volumes_of(&[v("a", "/x"), v("b", "/x/y")], &roots());
        assert!(message(nested.unwrap_err()).contains("inside volume a"));
        assert_eq!(
            volumes_of(&[v("a", "/x"), v("b", "/xy")], &roots())
                .unwrap()
                .len(),
            2
        );
        let many: Vec<Value> = (0..=MAX_VOLUMES)
            .map(|i| v(&format!("v{i}"), &format!("/m{i}")))
            .collect();
        assert!(message(volumes_of(&many, &roots()).unwrap_err()).contains("at most"));
    }
}
