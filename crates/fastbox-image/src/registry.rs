//! A client of the OCI distribution API (v2): manifests, blobs, and the auth dance
//! (anonymous, HTTP basic, and bearer tokens fetched from the realm a 401 names).
//!
//! Blocking by design (`reqwest::blocking`): call it from a plain thread or `spawn_blocking`,
//! never from inside an async task.
//!
//! Every connection goes through `netguard`: the registry, its token realm and every redirect
//! hop are refused in private and other special networks unless the operator allowed them.
//! What a registry sends is bounded (manifests and token answers at 4 MiB, blobs at their
//! manifest size), and nothing of an error answer's body reaches an error message: the
//! status and, from the distribution spec's fixed vocabulary, the error codes.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest::StatusCode;
use reqwest::Url;
use reqwest::blocking::{Client, RequestBuilder, Response};
use serde::Deserialize;
use sha2::{Digest as _, Sha256};

use crate::auth::{Challenge, parse_challenges};
use crate::config::ImageConfig;
use crate::digest::{digest_hex, sha256_digest};
use crate::error::ImageError;
use crate::netguard::{AddressPolicy, GuardedResolver, find_refusal, redirect_policy};
use crate::oci::{self, BlobSource, Index, ManifestKind, PreparedImage, media};
use crate::progress::{Progress, mib};
use crate::reference::{DOCKER_HUB, RegistryReference};
use crate::resolved::RegistryAuth;

/// The largest manifest (or index) read; the distribution spec asks registries to accept
/// manifests of at least 4 MiB.
const MANIFEST_LIMIT: u64 = 4 * 1024 * 1024;
/// The largest token answer read from a realm.
const TOKEN_LIMIT: u64 = 4 * 1024 * 1024;
/// How much of an error answer is read (to find its error codes) before it is dropped.
const ERROR_BODY_LIMIT: u64 = 64 * 1024;

#[derive(Debug, Clone)]
enum AuthState {
    Anonymous,
    Basic,
    Bearer(String),
}

/// A session with one repository of one registry.
pub(crate) struct RegistryClient<'a> {
    http: Client,
    reference: &'a RegistryReference,
    base: String,
    auth: Option<&'a RegistryAuth>,
    insecure: Vec<String>,
    policy: Arc<AddressPolicy>,
    state: Mutex<AuthState>,
}

/// Hosts spoken to over plain http without being configured: this machine.
pub(crate) fn is_loopback_host(host_port: &str) -> bool {
    let host = if let Some(rest) = host_port.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        host_port.rsplit_once(':').map_or(host_port, |(h, _)| h)
    };
    host == "localhost"
        || host == "::1"
        || host
            .parse::<std::net::Ipv4Addr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn plain_http_allowed(host_port: &str, insecure: &[String]) -> bool {
    let host = host_port.rsplit_once(':').map_or(host_port, |(h, _)| h);
    is_loopback_host(host_port) || insecure.iter().any(|i| i == host_port || i == host)
}

impl<'a> RegistryClient<'a> {
    pub(crate) fn try_new(
        cfg: &ImageConfig,
        reference: &'a RegistryReference,
        auth: Option<&'a RegistryAuth>,
    ) -> Result<Self, ImageError> {
        let host = if reference.registry == DOCKER_HUB {
            cfg.docker_hub_endpoint.as_str()
        } else {
            reference.registry.as_str()
        };
        let scheme = if plain_http_allowed(host, &cfg.insecure_registries) {
            "http"
        } else {
            "https"
        };
        let policy = Arc::new(address_policy(cfg));
        Ok(RegistryClient {
            http: http_client(cfg, policy.clone())?,
            reference,
            base: format!("{scheme}://{host}"),
            auth,
            insecure: cfg.insecure_registries.clone(),
            policy,
            state: Mutex::new(AuthState::Anonymous),
        })
    }

    /// Sends `request` to `url` once the address policy accepts it; the resolver and the
    /// redirect policy check the rest at connect time. `via` names what `url` is.
    fn send(&self, request: RequestBuilder, url: &str, via: &str) -> Result<Response, ImageError> {
        let parsed = Url::parse(url).map_err(|e| ImageError::InvalidReference {
            reference: self.reference.canonical(),
            reason: format!("{via} url {url} is invalid: {e}"),
        })?;
        if let Err(refusal) = self.policy.check_url(&parsed) {
            return Err(self.refused(&refusal, via));
        }
        request.send().map_err(|e| {
            let own_host = parsed.host_str().map(|h| h.trim_matches(['[', ']']));
            // The redirect policy refuses hops; the resolver refuses names, the request's own
            // or a hop's.
            match find_refusal(&e) {
                Some(r)
                    if !e.is_redirect()
                        && own_host.is_some_and(|h| h.eq_ignore_ascii_case(r.host())) =>
                {
                    self.refused(r, via)
                }
                Some(r) => self.refused(r, &format!("a redirect from {via}")),
                None => self.unreachable(url, e),
            }
        })
    }

    fn refused(&self, refusal: &crate::netguard::Refusal, via: &str) -> ImageError {
        ImageError::AddressRefused {
            registry: self.registry(),
            target: refusal.target(),
            via: via.to_owned(),
            reason: refusal.reason(),
        }
    }

    fn url(&self, tail: &str) -> String {
        format!("{}/v2/{}/{tail}", self.base, self.reference.repository)
    }

    fn registry(&self) -> String {
        self.reference.registry.clone()
    }

    fn unreachable(&self, url: &str, source: reqwest::Error) -> ImageError {
        ImageError::Unreachable {
            registry: self.registry(),
            url: url.to_owned(),
            reason: error_chain(&source.without_url()),
        }
    }

    fn denied(&self, status: StatusCode) -> ImageError {
        match self.auth {
            Some(a) => ImageError::AuthFailed {
                registry: self.registry(),
                repository: self.reference.repository.clone(),
                username: a.username.clone(),
                status: status.as_u16(),
            },
            None => ImageError::AuthRequired {
                registry: self.registry(),
                repository: self.reference.repository.clone(),
            },
        }
    }

    /// GET with the session's credentials. A 401 runs the challenge it carries and retries:
    /// at most one fresh bearer token per call (tokens expire during long pulls) and one
    /// switch to basic credentials.
    fn get(&self, url: &str, accept: &[&str]) -> Result<Response, ImageError> {
        let mut fetched_token = false;
        loop {
            let mut request = self.http.get(url);
            if !accept.is_empty() {
                request = request.header(reqwest::header::ACCEPT, accept.join(", "));
            }
            let state = self.state.lock().unwrap_or_else(|e| e.into_inner()).clone();
            request = match (&state, self.auth) {
                (AuthState::Basic, Some(a)) => request.basic_auth(&a.username, Some(&a.password)),
                (AuthState::Bearer(token), _) => request.bearer_auth(token),
                _ => request,
            };
            let response = self.send(request, url, "the registry")?;
            let status = response.status();
            if status == StatusCode::FORBIDDEN {
                return Err(self.denied(status));
            }
            if status != StatusCode::UNAUTHORIZED {
                return Ok(response);
            }
            let challenges: Vec<Challenge> = response
                .headers()
                .get_all(reqwest::header::WWW_AUTHENTICATE)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .flat_map(parse_challenges)
                .collect();
            let next = if let Some(bearer) = challenges.iter().find(|c| c.scheme == "bearer") {
                if fetched_token {
                    return Err(self.denied(status));
                }
                fetched_token = true;
                AuthState::Bearer(self.fetch_token(bearer)?)
            } else if challenges.iter().any(|c| c.scheme == "basic") {
                if self.auth.is_none() || matches!(state, AuthState::Basic) {
                    return Err(self.denied(status));
                }
                AuthState::Basic
            } else if challenges.is_empty() {
                return Err(self.denied(status));
            } else {
                return Err(ImageError::Registry {
                    registry: self.registry(),
                    url: url.to_owned(),
                    status: status.as_u16(),
                    detail: format!(
                        "unsupported authentication challenge {:?}",
                        challenges
                            .iter()
                            .map(|c| shown_token(&c.scheme))
                            .collect::<Vec<_>>()
                    ),
                });
            };
            *self.state.lock().unwrap_or_else(|e| e.into_inner()) = next;
        }
    }

    /// The token dance: GET realm?service=..&scope=.. (with basic credentials if any).
    fn fetch_token(&self, challenge: &Challenge) -> Result<String, ImageError> {
        let realm = challenge
            .params
            .get("realm")
            .ok_or_else(|| ImageError::Registry {
                registry: self.registry(),
                url: self.base.clone(),
                status: 401,
                detail: "bearer challenge without a realm".into(),
            })?;
        let realm_url = Url::parse(realm).map_err(|e| ImageError::Registry {
            registry: self.registry(),
            url: self.base.clone(),
            status: 401,
            detail: format!("its bearer realm is not a url: {e}"),
        })?;
        // Where the realm is matters before what would be sent to it.
        if let Err(refusal) = self.policy.check_url(&realm_url) {
            return Err(self.refused(&refusal, "its token realm"));
        }
        let realm_host = match (realm_url.host_str(), realm_url.port()) {
            (Some(h), Some(p)) => format!("{h}:{p}"),
            (Some(h), None) => h.to_owned(),
            (None, _) => String::new(),
        };
        let plain = realm_url.scheme() == "http";
        if !(plain || realm_url.scheme() == "https")
            || (plain && self.auth.is_some() && !plain_http_allowed(&realm_host, &self.insecure))
        {
            return Err(ImageError::Registry {
                registry: self.registry(),
                url: self.base.clone(),
                status: 401,
                detail: format!(
                    "refusing to send credentials to token realm {realm} over {}",
                    realm_url.scheme()
                ),
            });
        }
        let default_scope = format!("repository:{}:pull", self.reference.repository);
        let scope = challenge
            .params
            .get("scope")
            .cloned()
            .unwrap_or(default_scope);
        let mut query: Vec<(&str, &str)> = vec![("scope", scope.as_str())];
        if let Some(service) = challenge.params.get("service") {
            query.push(("service", service));
        }
        let mut request = self.http.get(realm_url.clone()).query(&query);
        if let Some(a) = self.auth {
            request = request.basic_auth(&a.username, Some(&a.password));
        }
        let response = self.send(request, realm_url.as_str(), "its token realm")?;
        let status = response.status();
        if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
            return Err(self.denied(status));
        }
        if !status.is_success() {
            return Err(ImageError::Registry {
                registry: self.registry(),
                url: realm.clone(),
                status: status.as_u16(),
                detail: status_detail(response),
            });
        }
        #[derive(Deserialize)]
        struct TokenResponse {
            #[serde(default)]
            token: Option<String>,
            #[serde(default)]
            access_token: Option<String>,
        }
        let bytes = read_capped(response, TOKEN_LIMIT).map_err(|e| ImageError::Registry {
            registry: self.registry(),
            url: realm.clone(),
            status: status.as_u16(),
            detail: match e {
                Capped::TooLarge => format!("token response larger than {}", mib(TOKEN_LIMIT)),
                Capped::Io(e) => format!("token response: {e}"),
            },
        })?;
        // serde's messages quote what they met: only the position is shown.
        let body: TokenResponse =
            serde_json::from_slice(&bytes).map_err(|e| ImageError::Registry {
                registry: self.registry(),
                url: realm.clone(),
                status: status.as_u16(),
                detail: format!(
                    "token response is not the expected json (line {} column {})",
                    e.line(),
                    e.column()
                ),
            })?;
        body.token
            .or(body.access_token)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| ImageError::Registry {
                registry: self.registry(),
                url: realm.clone(),
                status: status.as_u16(),
                detail: "token response carries no token".into(),
            })
    }

    fn check(&self, response: Response, url: &str) -> Result<Response, ImageError> {
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let detail = status_detail(response);
        if status == StatusCode::NOT_FOUND {
            return Err(ImageError::NotFound {
                reference: self.reference.canonical(),
                detail,
            });
        }
        Err(ImageError::Registry {
            registry: self.registry(),
            url: url.to_owned(),
            status: status.as_u16(),
            detail,
        })
    }

    /// A manifest (or index) by tag or digest, with its content type.
    pub(crate) fn fetch_manifest(
        &self,
        reference: &str,
    ) -> Result<(Vec<u8>, Option<String>), ImageError> {
        let url = self.url(&format!("manifests/{reference}"));
        let response = self.check(self.get(&url, media::MANIFEST_ACCEPT)?, &url)?;
        let content_type = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let bytes = read_capped(response, MANIFEST_LIMIT).map_err(|e| match e {
            Capped::TooLarge => ImageError::invalid_image(
                format!("manifest {url}"),
                format!("larger than {}", mib(MANIFEST_LIMIT)),
            ),
            Capped::Io(e) => ImageError::Registry {
                registry: self.registry(),
                url: url.clone(),
                status: 200,
                detail: format!("manifest body: {e}"),
            },
        })?;
        Ok((bytes, content_type))
    }

    /// Downloads a blob to `dest` (via a temporary file in `dest`'s directory), verifying its
    /// digest and size; `dest` appears only once complete and verified.
    pub(crate) fn download_blob(
        &self,
        digest: &str,
        size: Option<u64>,
        dest: &Path,
        progress: &dyn Progress,
    ) -> Result<(), ImageError> {
        let hex = digest_hex(digest)?;
        let url = self.url(&format!("blobs/{digest}"));
        let mut response = self.check(self.get(&url, &[])?, &url)?;
        let total = size.filter(|s| *s > 0).or(response.content_length());
        let dir = dest.parent().unwrap_or(Path::new("."));
        let tmp: PathBuf = dir.join(format!(".{hex}.{}.partial", crate::cache::nonce()));
        let result = (|| -> Result<(), ImageError> {
            let mut file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp)
                .map_err(ImageError::io("cannot create", &tmp))?;
            let mut hasher = Sha256::new();
            let mut done: u64 = 0;
            let mut buf = vec![0u8; 256 * 1024];
            loop {
                let n = match response.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        return Err(ImageError::Registry {
                            registry: self.registry(),
                            url: url.clone(),
                            status: 200,
                            detail: format!("download interrupted after {}: {e}", mib(done)),
                        });
                    }
                };
                done += n as u64;
                // A registry that sends more than the manifest says is cut off at once,
                // not when the disk is full.
                if let Some(expected) = size.filter(|s| *s > 0)
                    && done > expected
                {
                    return Err(ImageError::invalid_image(
                        format!("blob {url}"),
                        format!("larger than the manifest's {expected} bytes"),
                    ));
                }
                hasher.update(&buf[..n]);
                file.write_all(&buf[..n])
                    .map_err(ImageError::io("cannot write", &tmp))?;
                progress.bytes(done, total);
            }
            file.sync_all()
                .map_err(ImageError::io("cannot sync", &tmp))?;
            let actual = format!("sha256:{}", hex::encode(hasher.finalize()));
            if actual != digest {
                return Err(ImageError::DigestMismatch {
                    what: format!("blob downloaded from {url}"),
                    expected: digest.to_owned(),
                    actual,
                });
            }
            if let Some(expected) = size.filter(|s| *s > 0)
                && expected != done
            {
                return Err(ImageError::invalid_image(
                    format!("blob {url}"),
                    format!("size {done} differs from the manifest's {expected}"),
                ));
            }
            fs::rename(&tmp, dest).map_err(ImageError::io("cannot store blob", dest))
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result
    }
}

/// "error sending request: tcp connect error: Connection refused (os error 111)".
fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut current = Some(error);
    while let Some(e) = current {
        let text = e.to_string();
        // Transport errors repeat their cause in their own text; keep each piece once.
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        current = e.source();
    }
    parts.join(": ")
}

/// The error codes of the distribution spec: the only part of an error answer an error
/// message carries (a fixed vocabulary, so nothing an internal service wrote comes back).
const ERROR_CODES: &[&str] = &[
    "BLOB_UNKNOWN",
    "BLOB_UPLOAD_INVALID",
    "BLOB_UPLOAD_UNKNOWN",
    "DIGEST_INVALID",
    "MANIFEST_BLOB_UNKNOWN",
    "MANIFEST_INVALID",
    "MANIFEST_UNKNOWN",
    "MANIFEST_UNVERIFIED",
    "NAME_INVALID",
    "NAME_UNKNOWN",
    "SIZE_INVALID",
    "TAG_INVALID",
    "UNAUTHORIZED",
    "DENIED",
    "UNSUPPORTED",
    "TOOMANYREQUESTS",
];

/// What an error answer may say: its known error codes (`MANIFEST_UNKNOWN`), or that its body
/// is not shown. The body itself (an internal service's error page, a stack trace) is read at
/// most `ERROR_BODY_LIMIT` bytes and dropped; its start goes to the debug log only.
fn status_detail(response: Response) -> String {
    #[derive(Deserialize)]
    struct Errors {
        errors: Vec<ErrorItem>,
    }
    #[derive(Deserialize)]
    struct ErrorItem {
        #[serde(default)]
        code: String,
    }
    let status = response.status().as_u16();
    let mut body = Vec::new();
    let _ = response.take(ERROR_BODY_LIMIT).read_to_end(&mut body);
    let mut codes: Vec<&str> = serde_json::from_slice::<Errors>(&body)
        .map(|e| e.errors)
        .unwrap_or_default()
        .iter()
        .filter_map(|i| ERROR_CODES.iter().find(|c| **c == i.code).copied())
        .collect();
    codes.dedup();
    if !body.is_empty() {
        let start: String = String::from_utf8_lossy(&body).chars().take(300).collect();
        tracing::debug!(status, body = ?start, "registry error body (not shown to callers)");
    }
    if codes.is_empty() {
        "error body not shown".into()
    } else {
        format!("error code {}", codes.join(", "))
    }
}

/// A challenge scheme as it may appear in a message: a short token, or `?`.
fn shown_token(s: &str) -> &str {
    if !s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
        s
    } else {
        "?"
    }
}

/// Why a bounded body was not read.
enum Capped {
    TooLarge,
    Io(io::Error),
}

/// The body, refused when it is (or says it is) larger than `limit`.
fn read_capped(response: Response, limit: u64) -> Result<Vec<u8>, Capped> {
    if response.content_length().is_some_and(|n| n > limit) {
        return Err(Capped::TooLarge);
    }
    let mut bytes = Vec::new();
    response
        .take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(Capped::Io)?;
    if bytes.len() as u64 > limit {
        return Err(Capped::TooLarge);
    }
    Ok(bytes)
}

/// The address policy of `cfg`: its allowed networks, and the registries it names (insecure
/// registries and the Docker Hub endpoint), which are reached wherever they resolve.
pub(crate) fn address_policy(cfg: &ImageConfig) -> AddressPolicy {
    AddressPolicy::new(
        &cfg.registry_allow_private,
        cfg.insecure_registries
            .iter()
            .map(String::as_str)
            .chain([cfg.docker_hub_endpoint.as_str()]),
    )
}

/// The crate's one way to make an http client: the guarded resolver, the checked redirects,
/// no proxy from the environment (the checks must see the addresses connected to; the crate
/// reads no environment), timeouts from `cfg`.
pub(crate) fn http_client(
    cfg: &ImageConfig,
    policy: Arc<AddressPolicy>,
) -> Result<Client, ImageError> {
    let timeout = Duration::from_secs(cfg.registry_timeout_secs.max(1));
    Client::builder()
        .connect_timeout(timeout)
        .timeout(timeout)
        .user_agent(concat!("fastbox-image/", env!("CARGO_PKG_VERSION")))
        .no_proxy()
        .dns_resolver(Arc::new(GuardedResolver::new(policy.clone())))
        .redirect(redirect_policy(policy))
        .build()
        .map_err(|e| ImageError::Config(format!("cannot build the http client: {e}")))
}

/// Registry blobs, downloaded once into the cache's blob store and read from there.
pub(crate) struct RegistryBlobs<'a> {
    pub client: &'a RegistryClient<'a>,
    pub blob_dir: &'a Path,
}

impl BlobSource for RegistryBlobs<'_> {
    fn open(
        &self,
        key: &str,
        size: Option<u64>,
        progress: &dyn Progress,
    ) -> Result<Box<dyn Read + '_>, ImageError> {
        let path = self.blob_dir.join(digest_hex(key)?);
        if !path.exists() {
            if size.is_some_and(|s| s > 1024 * 1024) {
                progress.message(&format!(
                    "downloading {} ({})",
                    oci::short(key),
                    mib(size.unwrap_or(0))
                ));
            }
            self.client.download_blob(key, size, &path, progress)?;
        }
        Ok(Box::new(io::BufReader::new(
            File::open(&path).map_err(ImageError::io("cannot open blob", &path))?,
        )))
    }
}

/// Fetches the manifest of the reference (following an index to the configured platform)
/// and its config.
pub(crate) fn prepare(
    client: &RegistryClient<'_>,
    blobs: &RegistryBlobs<'_>,
    platform: &str,
    progress: &dyn Progress,
) -> Result<PreparedImage, ImageError> {
    let reference = client.reference;
    let shown = reference.canonical();
    progress.message(&format!("fetching manifest of {shown}"));
    let (mut bytes, mut content_type) = client.fetch_manifest(reference.manifest_reference())?;
    let mut digest = sha256_digest(&bytes);
    if let Some(pinned) = &reference.digest
        && &digest != pinned
    {
        return Err(ImageError::DigestMismatch {
            what: format!("manifest of {shown}"),
            expected: pinned.clone(),
            actual: digest,
        });
    }
    for _ in 0..4 {
        match oci::classify_manifest(
            &bytes,
            content_type.as_deref(),
            &format!("manifest of {shown}"),
        )? {
            ManifestKind::Image => {
                return oci::prepare_manifest(&bytes, &digest, blobs, &shown, progress);
            }
            ManifestKind::Index => {
                let index: Index = serde_json::from_slice(&bytes)
                    .map_err(|e| ImageError::invalid_image(format!("index of {shown}"), e))?;
                let chosen = oci::select_platform(&index, platform, &shown)?;
                let wanted = chosen.digest.clone();
                progress.message(&format!(
                    "platform {platform}: manifest {}",
                    oci::short(&wanted)
                ));
                (bytes, content_type) = client.fetch_manifest(&wanted)?;
                digest = sha256_digest(&bytes);
                if digest != wanted {
                    return Err(ImageError::DigestMismatch {
                        what: format!("manifest of {shown} for {platform}"),
                        expected: wanted,
                        actual: digest,
                    });
                }
            }
        }
    }
    Err(ImageError::invalid_image(
        format!("manifest of {shown}"),
        "indexes nested more than 4 deep",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts_use_plain_http() {
        for h in [
            "localhost",
            "localhost:5000",
            "127.0.0.1:5000",
            "127.1.2.3",
            "[::1]:5000",
        ] {
            assert!(plain_http_allowed(h, &[]), "{h}");
        }
        for h in ["ghcr.io", "10.0.0.1:5000", "registry.local:5000"] {
            assert!(!plain_http_allowed(h, &[]), "{h}");
        }
        assert!(plain_http_allowed(
            "registry.local:5000",
            &["registry.local".into()]
        ));
        assert!(plain_http_allowed(
            "registry.local:5000",
            &["registry.local:5000".into()]
        ));
        assert!(!plain_http_allowed(
            "registry.local:5001",
            &["registry.local:5000".into()]
        ));
    }
}
