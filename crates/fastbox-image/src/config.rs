//! Typed configuration of the image cache, validated once by `ImageCache::try_new`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::ImageError;
use crate::netguard::IpNet;
use crate::recipe::Recipe;
use crate::reference::RegistryReference;

/// Where images are cached and how references are served.
///
/// Every field has a default (`ImageConfig::default()`), so a TOML section may name only what
/// it changes. Unknown fields are rejected.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ImageConfig {
    /// Host-wide cache shared by every fastbox instance (`/var/lib/fastbox/cache`).
    pub cache_dir: PathBuf,
    /// Image references served by a built-in offline recipe instead of a registry:
    /// reference -> recipe name (`debian-bookworm-python3`, `busybox`). Keys are compared both
    /// literally and after Docker Hub normalization (`python` == `docker.io/library/python:latest`).
    /// An empty map sends every registry reference to its registry; `fastbox/busybox` -> `busybox`
    /// is always present unless the map names `fastbox/busybox` itself.
    pub offline_aliases: BTreeMap<String, String>,
    /// Registries (`host` or `host:port`) spoken to over plain http. Loopback hosts always are.
    /// Being configured by the operator, they are also reached wherever they resolve (at the
    /// port of their entry, any port for a bare host), private networks included.
    pub insecure_registries: Vec<String>,
    /// The API endpoint that serves `docker.io` references (a configured registry too:
    /// reached wherever it resolves).
    pub docker_hub_endpoint: String,
    /// Networks (`10.0.0.0/8`, `127.0.0.1`, `fd00::/8`) that registries, their token realms
    /// and their redirects may be reached in although they are special (private, loopback,
    /// link-local, CGNAT, unique-local, ...: `SPECIAL_RANGES`). Empty by default: a pull never
    /// connects into those networks (server-side request forgery), except to the registries
    /// configured above.
    pub registry_allow_private: Vec<IpNet>,
    /// The platform picked from multi-platform images, `os/arch[/variant]`; defaults to the host's.
    pub platform: String,
    /// Debian mirror URI for the debootstrap recipe; `None` derives it from `apt_sources`.
    pub debian_mirror: Option<String>,
    /// apt source files or directories (`*.sources` deb822, `*.list` one-line) searched for a mirror.
    pub apt_sources: Vec<PathBuf>,
    /// `debootstrap` executable (looked up in `PATH` when not absolute).
    pub debootstrap: PathBuf,
    /// A statically linked busybox, the whole of the `busybox` recipe.
    pub busybox: PathBuf,
    /// Per-operation timeout of registry requests (connect, each read), seconds.
    pub registry_timeout_secs: u64,
}

/// The recipe every default alias points at.
pub const DEFAULT_PYTHON_RECIPE: &str = "debian-bookworm-python3";

/// The recipe the code-interpreter image's names point at (Python and Node.js).
pub const CODE_INTERPRETER_RECIPE: &str = "debian-bookworm-code-interpreter";

impl Default for ImageConfig {
    fn default() -> Self {
        let offline_aliases = [
            "python:3.12",
            "python:3.11",
            "python:3",
            "python",
            "debian:bookworm",
            "debian",
            "ubuntu",
        ]
        .into_iter()
        .map(|r| (r.to_owned(), DEFAULT_PYTHON_RECIPE.to_owned()))
        .chain(
            [
                "opensandbox/code-interpreter:latest",
                "opensandbox/code-interpreter",
                "code-interpreter",
            ]
            .into_iter()
            .map(|r| (r.to_owned(), CODE_INTERPRETER_RECIPE.to_owned())),
        )
        .collect();
        ImageConfig {
            cache_dir: PathBuf::from("/var/lib/fastbox/cache"),
            offline_aliases,
            insecure_registries: Vec::new(),
            docker_hub_endpoint: "registry-1.docker.io".to_owned(),
            registry_allow_private: Vec::new(),
            platform: host_platform(),
            debian_mirror: None,
            apt_sources: vec![
                PathBuf::from("/etc/apt/sources.list.d"),
                PathBuf::from("/etc/apt/sources.list"),
            ],
            debootstrap: PathBuf::from("debootstrap"),
            busybox: PathBuf::from("/bin/busybox"),
            registry_timeout_secs: 120,
        }
    }
}

/// `linux/<GOARCH-style arch>` of the machine this was compiled for.
pub fn host_platform() -> String {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "arm" => "arm",
        "powerpc64" => "ppc64le",
        "s390x" => "s390x",
        "riscv64" => "riscv64",
        other => other,
    };
    format!("linux/{arch}")
}

impl ImageConfig {
    /// Checks what serde cannot: absolute cache path, known recipes, platform syntax.
    pub fn validate(&self) -> Result<(), ImageError> {
        if !self.cache_dir.is_absolute() {
            return Err(ImageError::Config(format!(
                "cache_dir must be absolute, got {}",
                self.cache_dir.display()
            )));
        }
        for (alias, recipe) in &self.offline_aliases {
            if Recipe::from_name(recipe).is_none() {
                return Err(ImageError::Config(format!(
                    "offline alias {alias:?} names unknown recipe {recipe:?} (known: {})",
                    Recipe::ALL
                        .iter()
                        .map(|r| r.name())
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
        }
        let parts: Vec<&str> = self.platform.split('/').collect();
        if !(2..=3).contains(&parts.len()) || parts.iter().any(|p| p.is_empty()) {
            return Err(ImageError::Config(format!(
                "platform must be os/arch[/variant], got {:?}",
                self.platform
            )));
        }
        if self.docker_hub_endpoint.is_empty() || self.docker_hub_endpoint.contains('/') {
            return Err(ImageError::Config(format!(
                "docker_hub_endpoint must be a host[:port], got {:?}",
                self.docker_hub_endpoint
            )));
        }
        Ok(())
    }

    /// The recipe serving `reference`, if an offline alias (or the builtin busybox one) names it.
    pub fn alias_for(&self, reference: &str) -> Option<Recipe> {
        let normalized = RegistryReference::parse(reference)
            .ok()
            .map(|r| r.canonical());
        let matches = |key: &str| {
            key == reference
                || normalized.as_deref().is_some_and(|n| {
                    RegistryReference::parse(key).is_ok_and(|k| k.canonical() == n)
                })
        };
        if let Some((_, recipe)) = self.offline_aliases.iter().find(|(key, _)| matches(key)) {
            return Recipe::from_name(recipe);
        }
        if matches(BUSYBOX_ALIAS) {
            Some(Recipe::Busybox)
        } else {
            None
        }
    }
}

/// The builtin reference of the busybox recipe.
pub const BUSYBOX_ALIAS: &str = "fastbox/busybox";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_aliases_map_python_and_debian_to_the_recipe() {
        let cfg = ImageConfig::default();
        for r in [
            "python:3.12",
            "python",
            "python:latest",
            "docker.io/library/python:3.11",
            "debian",
            "ubuntu:latest",
        ] {
            assert_eq!(cfg.alias_for(r), Some(Recipe::DebianBookwormPython3), "{r}");
        }
        for r in [
            "opensandbox/code-interpreter:latest",
            "docker.io/opensandbox/code-interpreter",
            "code-interpreter",
        ] {
            assert_eq!(
                cfg.alias_for(r),
                Some(Recipe::DebianBookwormCodeInterpreter),
                "{r}"
            );
        }
        for r in [
            "python:3.12-slim",
            "ghcr.io/x/python:3.12",
            "alpine",
            "ubuntu:22.04",
        ] {
            assert_eq!(cfg.alias_for(r), None, "{r}");
        }
    }

    #[test]
    fn busybox_alias_is_builtin_even_with_empty_alias_map() {
        let cfg = ImageConfig {
            offline_aliases: BTreeMap::new(),
            ..ImageConfig::default()
        };
        assert_eq!(cfg.alias_for("fastbox/busybox"), Some(Recipe::Busybox));
        assert_eq!(
            cfg.alias_for("docker.io/fastbox/busybox:latest"),
            Some(Recipe::Busybox)
        );
        assert_eq!(cfg.alias_for("python:3.12"), None);
    }

    #[test]
    fn validate_rejects_unknown_recipe_and_relative_cache() {
        let mut cfg = ImageConfig::default();
        cfg.offline_aliases.insert("x".into(), "nope".into());
        assert!(
            cfg.validate()
                .unwrap_err()
                .to_string()
                .contains("unknown recipe")
        );
        let cfg = ImageConfig {
            cache_dir: "rel".into(),
            ..ImageConfig::default()
        };
        assert!(cfg.validate().is_err());
        assert!(ImageConfig::default().validate().is_ok());
    }

    #[test]
    fn config_rejects_unknown_fields() {
        let err = serde_json::from_str::<ImageConfig>(r#"{"cache_dirr": "/x"}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field"));
        let cfg: ImageConfig = serde_json::from_str(r#"{"cache_dir": "/x"}"#).unwrap();
        assert_eq!(
            cfg.offline_aliases.len(),
            ImageConfig::default().offline_aliases.len()
        );
    }
}
