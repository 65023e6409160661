//! Image reference syntax: which source serves a reference, and registry reference
//! normalization (the rules of `distribution/reference`, Docker Hub included).

use std::fmt;
use std::path::{Path, PathBuf};

use crate::config::ImageConfig;
use crate::error::ImageError;
use crate::recipe::Recipe;

/// The registry that unqualified names (`python:3.12`) belong to.
pub const DOCKER_HUB: &str = "docker.io";

/// Where a reference is served from, decided by `ImageSource::parse`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageSource {
    /// `dir:/path` or an absolute path: a rootfs directory used in place.
    Dir(PathBuf),
    /// `oci:/path[:tag]`: an OCI image layout directory.
    OciLayout {
        path: PathBuf,
        selector: Option<String>,
    },
    /// `oci-archive:/path.tar[:tag]`: an OCI image layout in a tar file.
    OciArchive {
        path: PathBuf,
        selector: Option<String>,
    },
    /// `docker-archive:/path.tar[:name:tag]`: the output of `docker save`.
    DockerArchive {
        path: PathBuf,
        selector: Option<String>,
    },
    /// `recipe:<name>` or an offline alias: a rootfs built on this machine.
    Recipe(Recipe),
    /// Anything else: an image in an OCI distribution registry.
    Registry(RegistryReference),
}

impl ImageSource {
    /// Classifies `reference`. Offline aliases win over registries; local path forms may touch
    /// the filesystem to split `path:tag` (the longest existing prefix is the path).
    pub fn parse(reference: &str, cfg: &ImageConfig) -> Result<ImageSource, ImageError> {
        let reference = reference.trim();
        let invalid = |reason: &str| ImageError::InvalidReference {
            reference: reference.to_owned(),
            reason: reason.to_owned(),
        };
        if reference.is_empty() {
            return Err(invalid("empty reference"));
        }
        fn local<'r>(rest: &'r str, reference: &str) -> Result<&'r str, ImageError> {
            if rest.is_empty() {
                Err(ImageError::InvalidReference {
                    reference: reference.to_owned(),
                    reason: "missing path after the scheme".to_owned(),
                })
            } else {
                Ok(rest)
            }
        }
        if let Some(rest) = reference.strip_prefix("dir:") {
            return Ok(ImageSource::Dir(PathBuf::from(local(rest, reference)?)));
        }
        if let Some(rest) = reference.strip_prefix("oci:") {
            let (path, selector) = split_path_selector(local(rest, reference)?);
            return Ok(ImageSource::OciLayout { path, selector });
        }
        if let Some(rest) = reference.strip_prefix("oci-archive:") {
            let (path, selector) = split_path_selector(local(rest, reference)?);
            return Ok(ImageSource::OciArchive { path, selector });
        }
        if let Some(rest) = reference.strip_prefix("docker-archive:") {
            let (path, selector) = split_path_selector(local(rest, reference)?);
            return Ok(ImageSource::DockerArchive { path, selector });
        }
        if let Some(name) = reference.strip_prefix("recipe:") {
            return Recipe::from_name(name)
                .map(ImageSource::Recipe)
                .ok_or_else(|| {
                    invalid(&format!(
                        "unknown recipe (known: {})",
                        Recipe::ALL
                            .iter()
                            .map(|r| r.name())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ))
                });
        }
        if reference.starts_with('/') {
            return Ok(ImageSource::Dir(PathBuf::from(reference)));
        }
        if let Some(recipe) = cfg.alias_for(reference) {
            return Ok(ImageSource::Recipe(recipe));
        }
        let reference = reference.strip_prefix("docker://").unwrap_or(reference);
        RegistryReference::parse(reference).map(ImageSource::Registry)
    }
}

/// Splits `/path/x.tar:name:tag` into the longest existing path prefix and the rest.
fn split_path_selector(s: &str) -> (PathBuf, Option<String>) {
    if Path::new(s).exists() {
        return (PathBuf::from(s), None);
    }
    for (i, _) in s.match_indices(':') {
        let (path, rest) = (&s[..i], &s[i + 1..]);
        if !path.is_empty() && Path::new(path).exists() {
            return (
                PathBuf::from(path),
                (!rest.is_empty()).then(|| rest.to_owned()),
            );
        }
    }
    (PathBuf::from(s), None)
}

/// A normalized registry reference: `registry/repository[:tag][@digest]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RegistryReference {
    /// `docker.io`, `ghcr.io`, `127.0.0.1:5000` (as written, Docker Hub aliases folded).
    pub registry: String,
    /// `library/python`, `org/app`.
    pub repository: String,
    /// `Some("latest")` when neither tag nor digest was given.
    pub tag: Option<String>,
    /// `sha256:<64 hex>` when pinned.
    pub digest: Option<String>,
}

impl RegistryReference {
    /// Parses and normalizes (`python:3.12` -> `docker.io/library/python:3.12`).
    pub fn parse(reference: &str) -> Result<RegistryReference, ImageError> {
        let invalid = |reason: String| ImageError::InvalidReference {
            reference: reference.to_owned(),
            reason,
        };
        if reference.len() > 4096 {
            return Err(invalid("longer than 4096 bytes".into()));
        }
        let (name_tag, digest) = match reference.split_once('@') {
            Some((n, d)) => {
                validate_digest(d).map_err(invalid)?;
                (n, Some(d.to_owned()))
            }
            None => (reference, None),
        };
        let last_slash = name_tag.rfind('/').map_or(0, |i| i + 1);
        let (name, tag) = match name_tag[last_slash..].rfind(':') {
            Some(i) => {
                let i = last_slash + i;
                (&name_tag[..i], Some(&name_tag[i + 1..]))
            }
            None => (name_tag, None),
        };
        if let Some(tag) = tag {
            validate_tag(tag).map_err(invalid)?;
        }
        let (registry, repository) = match name.split_once('/') {
            Some((first, rest))
                if first.contains('.') || first.contains(':') || first == "localhost" =>
            {
                (first.to_owned(), rest.to_owned())
            }
            _ => (DOCKER_HUB.to_owned(), name.to_owned()),
        };
        let registry = match registry.as_str() {
            "index.docker.io" | "registry-1.docker.io" => DOCKER_HUB.to_owned(),
            _ => registry,
        };
        validate_registry(&registry).map_err(invalid)?;
        let repository = if registry == DOCKER_HUB && !repository.contains('/') {
            format!("library/{repository}")
        } else {
            repository
        };
        validate_repository(&repository).map_err(invalid)?;
        let tag = match (tag, &digest) {
            (Some(t), _) => Some(t.to_owned()),
            (None, None) => Some("latest".to_owned()),
            (None, Some(_)) => None,
        };
        Ok(RegistryReference {
            registry,
            repository,
            tag,
            digest,
        })
    }

    /// The fully qualified form, e.g. `docker.io/library/python:3.12`.
    pub fn canonical(&self) -> String {
        self.to_string()
    }

    /// What goes after `/manifests/`: the digest when pinned, else the tag.
    pub fn manifest_reference(&self) -> &str {
        self.digest
            .as_deref()
            .or(self.tag.as_deref())
            .unwrap_or("latest")
    }
}

impl fmt::Display for RegistryReference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(tag) = &self.tag {
            write!(f, ":{tag}")?;
        }
        if let Some(digest) = &self.digest {
            write!(f, "@{digest}")?;
        }
        Ok(())
    }
}

/// Only sha256 digests are accepted: it is what every registry and layout uses.
pub(crate) fn validate_digest(d: &str) -> Result<(), String> {
    let Some(hex) = d.strip_prefix("sha256:") else {
        return Err(format!("digest {d:?} is not sha256:<64 hex digits>"));
    };
    if hex.len() != 64
        || !hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return Err(format!(
            "digest {d:?} is not sha256:<64 lower-case hex digits>"
        ));
    }
    Ok(())
}

fn validate_tag(tag: &str) -> Result<(), String> {
    let ok = !tag.is_empty()
        && tag.len() <= 128
        && tag.bytes().enumerate().all(|(i, b)| {
            b.is_ascii_alphanumeric() || b == b'_' || (i > 0 && (b == b'.' || b == b'-'))
        });
    if ok {
        Ok(())
    } else {
        Err(format!(
            "tag {tag:?} must match [A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}}"
        ))
    }
}

fn validate_registry(registry: &str) -> Result<(), String> {
    let (host, port) = if let Some(rest) = registry.strip_prefix('[') {
        // [ipv6]:port
        let Some((h, after)) = rest.split_once(']') else {
            return Err(format!("registry {registry:?} has an unclosed ["));
        };
        if h.is_empty() || !h.bytes().all(|b| b.is_ascii_hexdigit() || b == b':') {
            return Err(format!(
                "registry {registry:?} has a malformed ipv6 address"
            ));
        }
        (h, after.strip_prefix(':'))
    } else {
        match registry.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (registry, None),
        }
    };
    if host.is_empty()
        || !host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-' || b == b':')
    {
        return Err(format!("registry host {host:?} is not a valid host name"));
    }
    if let Some(p) = port
        && p.parse::<u16>().is_err()
    {
        return Err(format!("registry port {p:?} is not a number below 65536"));
    }
    Ok(())
}

/// Path components: `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*`, joined by `/`.
fn validate_repository(repository: &str) -> Result<(), String> {
    if repository.is_empty() || repository.len() > 255 {
        return Err("repository name must be 1 to 255 characters".into());
    }
    for component in repository.split('/') {
        let bytes = component.as_bytes();
        let lower_alnum = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
        let ok = !bytes.is_empty()
            && lower_alnum(&bytes[0])
            && lower_alnum(&bytes[bytes.len() - 1])
            && bytes
                .iter()
                .all(|b| lower_alnum(b) || matches!(b, b'.' | b'_' | b'-'))
            && !component.contains("..")
            && !component.contains("___")
            && !component.contains("._")
            && !component.contains("_.")
            && !component.contains(".-")
            && !component.contains("-.")
            && !component.contains("_-")
            && !component.contains("-_");
        if !ok {
            return Err(format!(
                "repository component {component:?} must be lower-case letters and digits separated by '.', '_', '__' or dashes"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(s: &str) -> RegistryReference {
        RegistryReference::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn docker_hub_names_are_normalized() {
        assert_eq!(
            reg("python:3.12").canonical(),
            "docker.io/library/python:3.12"
        );
        assert_eq!(reg("python").canonical(), "docker.io/library/python:latest");
        assert_eq!(reg("org/app").canonical(), "docker.io/org/app:latest");
        assert_eq!(
            reg("index.docker.io/library/busybox:1").canonical(),
            "docker.io/library/busybox:1"
        );
        assert_eq!(
            reg("docker.io/python").canonical(),
            "docker.io/library/python:latest"
        );
    }

    #[test]
    fn registry_hosts_and_ports_are_recognized() {
        let r = reg("127.0.0.1:5000/team/app:v1.2");
        assert_eq!(
            (r.registry.as_str(), r.repository.as_str(), r.tag.as_deref()),
            ("127.0.0.1:5000", "team/app", Some("v1.2"))
        );
        let r = reg("localhost/app");
        assert_eq!(
            (r.registry.as_str(), r.repository.as_str()),
            ("localhost", "app")
        );
        let r = reg("ghcr.io/owner/repo/sub:tag");
        assert_eq!(
            (r.registry.as_str(), r.repository.as_str()),
            ("ghcr.io", "owner/repo/sub")
        );
        let r = reg("[::1]:5000/app:1");
        assert_eq!(r.registry, "[::1]:5000");
        let r = reg("localhost:5000/app");
        assert_eq!(
            (r.registry.as_str(), r.tag.as_deref()),
            ("localhost:5000", Some("latest"))
        );
    }

    #[test]
    fn digest_references_have_no_default_tag() {
        let d = format!("sha256:{}", "a".repeat(64));
        let r = reg(&format!("127.0.0.1:5000/app@{d}"));
        assert_eq!(
            (
                r.tag.as_deref(),
                r.digest.as_deref(),
                r.manifest_reference()
            ),
            (None, Some(d.as_str()), d.as_str())
        );
        let r = reg(&format!("app:1@{d}"));
        assert_eq!(r.canonical(), format!("docker.io/library/app:1@{d}"));
        assert_eq!(r.manifest_reference(), d);
    }

    #[test]
    fn bad_syntax_is_rejected_with_a_reason() {
        for bad in [
            "Python:3",
            "python:",
            "python:-x",
            "app@sha256:abc",
            "app@md5:0123",
            "a//b",
            "a/-b",
            "host:99999/app",
            "app:tag:more",
            "",
        ] {
            let err = RegistryReference::parse(bad)
                .err()
                .unwrap_or_else(|| panic!("{bad:?} accepted"));
            assert!(
                err.to_string().starts_with("invalid image reference"),
                "{err}"
            );
        }
    }

    #[test]
    fn sources_are_classified_by_prefix() {
        let cfg = ImageConfig::default();
        let p = |s| ImageSource::parse(s, &cfg).unwrap();
        assert_eq!(p("dir:/x"), ImageSource::Dir("/x".into()));
        assert_eq!(p("/srv/rootfs"), ImageSource::Dir("/srv/rootfs".into()));
        assert_eq!(p("recipe:busybox"), ImageSource::Recipe(Recipe::Busybox));
        assert_eq!(p("fastbox/busybox"), ImageSource::Recipe(Recipe::Busybox));
        assert_eq!(
            p("python:3.12"),
            ImageSource::Recipe(Recipe::DebianBookwormPython3)
        );
        assert!(matches!(p("python:3.12-slim"), ImageSource::Registry(_)));
        assert!(
            matches!(p("docker://alpine"), ImageSource::Registry(r) if r.repository == "library/alpine")
        );
        assert!(ImageSource::parse("recipe:nope", &cfg).is_err());
        assert!(ImageSource::parse("oci:", &cfg).is_err());
    }

    #[test]
    fn local_paths_split_off_selectors_only_after_an_existing_path() {
        let dir = tempfile::tempdir().unwrap();
        let tar = dir.path().join("img.tar");
        std::fs::write(&tar, b"").unwrap();
        let t = tar.to_str().unwrap();
        let cfg = ImageConfig::default();
        assert_eq!(
            ImageSource::parse(&format!("docker-archive:{t}:app:v1"), &cfg).unwrap(),
            ImageSource::DockerArchive {
                path: tar.clone(),
                selector: Some("app:v1".into())
            }
        );
        assert_eq!(
            ImageSource::parse(&format!("oci-archive:{t}"), &cfg).unwrap(),
            ImageSource::OciArchive {
                path: tar.clone(),
                selector: None
            }
        );
        assert_eq!(
            ImageSource::parse("oci:/does/not:exist", &cfg).unwrap(),
            ImageSource::OciLayout {
                path: "/does/not:exist".into(),
                selector: None
            }
        );
    }
}
