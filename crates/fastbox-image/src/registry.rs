//! A client of the OCI distribution API (v2): manifests, blobs, and the auth dance
//! (anonymous, HTTP basic, and bearer tokens fetched from the realm a 401 names).
//!
//! Blocking by design (`reqwest::blocking`): call it from a plain thread or `spawn_blocking`,
//! never from inside an async task.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use reqwest::StatusCode;
use reqwest::blocking::{Client, Response};
use serde::Deserialize;
use sha2::{Digest as _, Sha256};

use crate::auth::{Challenge, parse_challenges};
use crate::config::ImageConfig;
use crate::digest::{digest_hex, sha256_digest};
use crate::error::ImageError;
use crate::oci::{self, BlobSource, Index, ManifestKind, PreparedImage, media};
use crate::progress::{Progress, mib};
use crate::reference::{DOCKER_HUB, RegistryReference};
use crate::resolved::RegistryAuth;

const MANIFEST_LIMIT: u64 = 8 * 1024 * 1024;

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
        let timeout = Duration::from_secs(cfg.registry_timeout_secs.max(1));
        let http = Client::builder()
            .connect_timeout(timeout)
            .timeout(timeout)
            .user_agent(concat!("fastbox-image/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| ImageError::Config(format!("cannot build the http client: {e}")))?;
        Ok(RegistryClient {
            http,
            reference,
            base: format!("{scheme}://{host}"),
            auth,
            insecure: cfg.insecure_registries.clone(),
            state: Mutex::new(AuthState::Anonymous),
        })
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
            let response = request.send().map_err(|e| self.unreachable(url, e))?;
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
                            .map(|c| c.scheme.as_str())
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
        let realm_url = reqwest::Url::parse(realm).map_err(|e| ImageError::Registry {
            registry: self.registry(),
            url: self.base.clone(),
            status: 401,
            detail: format!("bearer realm {realm:?} is not a url: {e}"),
        })?;
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
        let response = request.send().map_err(|e| self.unreachable(realm, e))?;
        let status = response.status();
        if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
            return Err(self.denied(status));
        }
        if !status.is_success() {
            return Err(ImageError::Registry {
                registry: self.registry(),
                url: realm.clone(),
                status: status.as_u16(),
                detail: body_detail(response),
            });
        }
        #[derive(Deserialize)]
        struct TokenResponse {
            #[serde(default)]
            token: Option<String>,
            #[serde(default)]
            access_token: Option<String>,
        }
        let body: TokenResponse = response.json().map_err(|e| ImageError::Registry {
            registry: self.registry(),
            url: realm.clone(),
            status: status.as_u16(),
            detail: format!("token response is not json: {e}"),
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
        let detail = body_detail(response);
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
        let mut bytes = Vec::new();
        response
            .take(MANIFEST_LIMIT + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| ImageError::Registry {
                registry: self.registry(),
                url: url.clone(),
                status: 200,
                detail: format!("manifest body: {e}"),
            })?;
        if bytes.len() as u64 > MANIFEST_LIMIT {
            return Err(ImageError::invalid_image(
                format!("manifest {url}"),
                format!("larger than {}", mib(MANIFEST_LIMIT)),
            ));
        }
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
                hasher.update(&buf[..n]);
                file.write_all(&buf[..n])
                    .map_err(ImageError::io("cannot write", &tmp))?;
                done += n as u64;
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

/// `CODE: message` from a registry error body, or the start of the body.
fn body_detail(response: Response) -> String {
    #[derive(Deserialize)]
    struct Errors {
        errors: Vec<ErrorItem>,
    }
    #[derive(Deserialize)]
    struct ErrorItem {
        #[serde(default)]
        code: String,
        #[serde(default)]
        message: String,
    }
    let mut body = Vec::new();
    let _ = response.take(64 * 1024).read_to_end(&mut body);
    if let Ok(e) = serde_json::from_slice::<Errors>(&body)
        && !e.errors.is_empty()
    {
        return e
            .errors
            .iter()
            .map(|i| format!("{}: {}", i.code, i.message))
            .collect::<Vec<_>>()
            .join("; ");
    }
    let text = String::from_utf8_lossy(&body);
    let text = text.trim();
    if text.is_empty() {
        "empty body".into()
    } else {
        text.chars().take(300).collect()
    }
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
