//! Built-in recipes: root file systems made on this machine, for hosts without a registry.
//!
//! - `debian-bookworm-python3`: `debootstrap --variant=minbase` from the machine's own Debian
//!   mirror, with what users of the `python` image expect on the path (python3 and pip, curl,
//!   wget, git, ca-certificates, procps). `pip install` works as on that image: Debian's
//!   `EXTERNALLY-MANAGED` marker is removed. Takes minutes once.
//! - `debian-bookworm-code-interpreter`: the same with Node.js, TypeScript, Go and a JDK, for
//!   code contexts in every language the code interpreter offers (what
//!   `opensandbox/code-interpreter` answers to).
//! - `busybox`: the host's static busybox and its applet symlinks, `/etc/passwd`, `/etc/group`.
//!   Takes milliseconds; used by tests as a minimal rootfs.
//!
//! A recipe's digest hashes what it is made of (recipe version, suite, packages; the busybox
//! binary), not the bytes debootstrap happened to write: two hosts with the same recipe
//! agree on the name even though package timestamps differ.

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Instant;

use crate::config::ImageConfig;
use crate::digest::sha256_digest;
use crate::error::ImageError;
use crate::progress::{Progress, mib};
use crate::resolved::ImageRuntimeConfig;

/// A built-in recipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Recipe {
    DebianBookwormPython3,
    DebianBookwormCodeInterpreter,
    Busybox,
}

const DEBIAN_SUITE: &str = "bookworm";
const DEBIAN_VARIANT: &str = "minbase";
const DEBIAN_INCLUDE: &[&str] = &[
    "python3",
    "python3-pip",
    "ca-certificates",
    "curl",
    "wget",
    "git",
    "procps",
];
/// What the code-interpreter recipe adds to [`DEBIAN_INCLUDE`].
const CODE_INTERPRETER_INCLUDE: &[&str] = &[
    "python3-matplotlib",
    "nodejs",
    "node-typescript",
    "golang-go",
    "openjdk-17-jdk-headless",
];
/// Bump when the recipe's output changes, so caches rebuild.
const RECIPE_VERSION: u32 = 2;

const PATH_ENV: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

impl Recipe {
    pub const ALL: &'static [Recipe] = &[
        Recipe::DebianBookwormPython3,
        Recipe::DebianBookwormCodeInterpreter,
        Recipe::Busybox,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Recipe::DebianBookwormPython3 => "debian-bookworm-python3",
            Recipe::DebianBookwormCodeInterpreter => "debian-bookworm-code-interpreter",
            Recipe::Busybox => "busybox",
        }
    }

    /// The Debian packages a debootstrap recipe installs (None: not a debootstrap recipe).
    fn packages(self) -> Option<Vec<&'static str>> {
        match self {
            Recipe::DebianBookwormPython3 => Some(DEBIAN_INCLUDE.to_vec()),
            Recipe::DebianBookwormCodeInterpreter => Some(
                DEBIAN_INCLUDE
                    .iter()
                    .chain(CODE_INTERPRETER_INCLUDE)
                    .copied()
                    .collect(),
            ),
            Recipe::Busybox => None,
        }
    }

    pub fn from_name(name: &str) -> Option<Recipe> {
        Recipe::ALL.iter().copied().find(|r| r.name() == name)
    }

    /// The recipe an image's canonical reference (`recipe:NAME`) names, if any.
    pub fn of_reference(canonical_reference: &str) -> Option<Recipe> {
        canonical_reference
            .strip_prefix("recipe:")
            .and_then(Recipe::from_name)
    }

    /// `KEY=VALUE` pairs the image's own template is built with: the code interpreter's
    /// holds warm Python and Node.js interpreters (execd's `FASTBOX_WARM_CODE`).
    pub fn golden_env(self) -> &'static [&'static str] {
        match self {
            Recipe::DebianBookwormCodeInterpreter => &["FASTBOX_WARM_CODE=python,javascript"],
            _ => &[],
        }
    }
}

/// What a build produced besides the files.
#[derive(Debug, Clone)]
pub(crate) struct RecipeOutput {
    pub served_by: String,
    pub runtime: ImageRuntimeConfig,
}

fn recipe_err(recipe: Recipe, reason: impl Into<String>) -> ImageError {
    ImageError::Recipe {
        recipe: recipe.name().to_owned(),
        reason: reason.into(),
    }
}

/// The content address of a recipe's output on this host.
pub(crate) fn digest(recipe: Recipe, cfg: &ImageConfig) -> Result<String, ImageError> {
    match recipe.packages() {
        Some(packages) => Ok(sha256_digest(
            format!(
                "fastbox-recipe\0{}\0v{RECIPE_VERSION}\0suite={DEBIAN_SUITE}\0variant={DEBIAN_VARIANT}\0include={}",
                recipe.name(),
                packages.join(",")
            )
            .as_bytes(),
        )),
        None => {
            let binary = fs::read(&cfg.busybox).map_err(|e| {
                recipe_err(recipe, format!("cannot read {} ({e}); install busybox-static", cfg.busybox.display()))
            })?;
            let mut input = format!("fastbox-recipe\0busybox\0v{RECIPE_VERSION}\0").into_bytes();
            input.extend_from_slice(&binary);
            Ok(sha256_digest(&input))
        }
    }
}

/// Builds `recipe` into the empty directory `rootfs`.
pub(crate) fn build(
    recipe: Recipe,
    cfg: &ImageConfig,
    rootfs: &Path,
    logs_dir: &Path,
    progress: &dyn Progress,
) -> Result<RecipeOutput, ImageError> {
    match recipe.packages() {
        None => build_busybox(cfg, rootfs, progress),
        Some(packages) => build_debootstrap(recipe, &packages, cfg, rootfs, logs_dir, progress),
    }
}

/// The mirror the recipe downloads from: the configured one, else the machine's apt sources.
pub(crate) fn debian_mirror(cfg: &ImageConfig) -> Result<String, ImageError> {
    if let Some(m) = &cfg.debian_mirror {
        return Ok(m.clone());
    }
    let sources = crate::apt::read_sources(&cfg.apt_sources);
    crate::apt::pick_mirror(&sources, DEBIAN_SUITE).ok_or_else(|| ImageError::NoDebianMirror {
        searched: cfg
            .apt_sources
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
    })
}

fn build_debootstrap(
    recipe: Recipe,
    packages: &[&str],
    cfg: &ImageConfig,
    rootfs: &Path,
    logs_dir: &Path,
    progress: &dyn Progress,
) -> Result<RecipeOutput, ImageError> {
    if !nix::unistd::geteuid().is_root() {
        return Err(recipe_err(recipe, "debootstrap needs root"));
    }
    let mirror = debian_mirror(cfg)?;
    let started = Instant::now();
    progress.message(&format!(
        "building offline recipe {} with debootstrap {DEBIAN_SUITE} from {mirror} (takes a few minutes, once per host)",
        recipe.name()
    ));
    // debootstrap wants to create the target itself, or find it empty.
    let log_path = logs_dir.join(format!("{}-{}.log", recipe.name(), crate::cache::nonce()));
    let mut log =
        fs::File::create(&log_path).map_err(ImageError::io("cannot create log", &log_path))?;
    let mut child = Command::new(&cfg.debootstrap)
        .arg(format!("--variant={DEBIAN_VARIANT}"))
        .arg(format!("--include={}", packages.join(",")))
        .arg("--components=main")
        .arg(DEBIAN_SUITE)
        .arg(rootfs)
        .arg(&mirror)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .env("LC_ALL", "C")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            recipe_err(
                recipe,
                format!(
                    "cannot run {} ({e}); install debootstrap",
                    cfg.debootstrap.display()
                ),
            )
        })?;
    let (tx, rx) = mpsc::channel::<String>();
    let stdout = child.stdout.take().expect("piped");
    let stderr = child.stderr.take().expect("piped");
    let status = std::thread::scope(|s| {
        for stream in [
            Box::new(stdout) as Box<dyn std::io::Read + Send>,
            Box::new(stderr),
        ] {
            let tx = tx.clone();
            s.spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        drop(tx);
        for line in rx {
            let _ = writeln!(log, "{line}");
            if !line.trim().is_empty() {
                progress.message(&format!("debootstrap: {line}"));
            }
        }
        child.wait()
    })
    .map_err(|e| recipe_err(recipe, format!("waiting for debootstrap: {e}")))?;
    drop(log);
    if !status.success() {
        let mut tail = tail_lines(&log_path, 25);
        let inner = rootfs.join("debootstrap/debootstrap.log");
        if inner.exists() {
            tail.push_str("\n--- debootstrap/debootstrap.log ---\n");
            tail.push_str(&tail_lines(&inner, 25));
            // Keep the inner log next to ours: the staging directory is about to go.
            let _ = fs::copy(&inner, log_path.with_extension("inner.log"));
        }
        return Err(ImageError::Debootstrap {
            recipe: recipe.name().to_owned(),
            status: status.to_string(),
            log: log_path,
            log_tail: tail,
        });
    }
    // Package caches are not part of the image.
    for dir in ["var/cache/apt/archives", "var/lib/apt/lists"] {
        if let Ok(entries) = fs::read_dir(rootfs.join(dir)) {
            for e in entries.flatten() {
                if e.file_type().is_ok_and(|t| t.is_file()) && e.file_name() != "lock" {
                    let _ = fs::remove_file(e.path());
                }
            }
        }
    }
    let python = fs::read_link(rootfs.join("usr/bin/python3")).map_err(|e| {
        recipe_err(
            recipe,
            format!("debootstrap finished but usr/bin/python3 is missing: {e}"),
        )
    })?;
    let version = python
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("python"))
        .unwrap_or("3")
        .to_owned();
    // As on the python image, `pip install` installs (PEP 668's marker refuses it).
    let marker = format!("usr/lib/python{version}/EXTERNALLY-MANAGED");
    remove_built_file(rootfs, &marker).map_err(|e| recipe_err(recipe, format!("{marker}: {e}")))?;
    progress.message(&format!(
        "built {} (python {version}) in {:.1}s, {}",
        recipe.name(),
        started.elapsed().as_secs_f64(),
        mib(dir_size(rootfs))
    ));
    Ok(RecipeOutput {
        served_by: match recipe {
            Recipe::DebianBookwormCodeInterpreter => {
                format!("debian-{DEBIAN_SUITE}-python{version}-nodejs")
            }
            _ => format!("debian-{DEBIAN_SUITE}-python{version}"),
        },
        runtime: ImageRuntimeConfig {
            cmd: vec!["/bin/bash".into()],
            env: vec![PATH_ENV.into(), "LANG=C.UTF-8".into()],
            ..ImageRuntimeConfig::default()
        },
    })
}

/// Removes file `rel` of a tree this recipe just built, when it is there. Every directory on
/// the way must be a directory, not a symlink: nothing outside `rootfs` is ever touched.
fn remove_built_file(rootfs: &Path, rel: &str) -> std::io::Result<()> {
    let mut at = rootfs.to_path_buf();
    let parts: Vec<&str> = rel.split('/').collect();
    let (name, dirs) = parts.split_last().expect("a relative path");
    for dir in dirs {
        at.push(dir);
        match fs::symlink_metadata(&at) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(std::io::Error::other(format!(
                    "{} is not a directory",
                    at.display()
                )));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        }
    }
    match fs::remove_file(at.join(name)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

fn tail_lines(path: &Path, n: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Bytes of regular files under `dir` (hard links counted once per link).
pub(crate) fn dir_size(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(e.path()),
                Ok(t) if t.is_file() => total += e.metadata().map(|m| m.len()).unwrap_or(0),
                _ => {}
            }
        }
    }
    total
}

/// True unless the ELF file has a program interpreter (i.e. is dynamically linked).
fn is_static_elf(bytes: &[u8]) -> bool {
    const PT_INTERP: u32 = 3;
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" || bytes[4] != 2 || bytes[5] != 1 {
        return true; // not a 64-bit little-endian ELF: cannot tell, let the build try
    }
    let u16_at = |o: usize| u16::from_le_bytes([bytes[o], bytes[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(bytes[0x20..0x28].try_into().expect("8 bytes")) as usize;
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    (0..phnum).all(|i| {
        let o = phoff + i * phentsize;
        bytes
            .get(o..o + 4)
            .is_none_or(|t| u32::from_le_bytes(t.try_into().expect("4 bytes")) != PT_INTERP)
    })
}

fn busybox_version(bytes: &[u8]) -> Option<String> {
    let marker = b"BusyBox v";
    let at = bytes.windows(marker.len()).position(|w| w == marker)? + marker.len();
    let version: String = bytes[at..]
        .iter()
        .take_while(|b| b.is_ascii_alphanumeric() || **b == b'.')
        .map(|b| *b as char)
        .collect();
    (!version.is_empty()).then_some(version)
}

fn build_busybox(
    cfg: &ImageConfig,
    rootfs: &Path,
    progress: &dyn Progress,
) -> Result<RecipeOutput, ImageError> {
    let recipe = Recipe::Busybox;
    let binary = fs::read(&cfg.busybox).map_err(|e| {
        recipe_err(
            recipe,
            format!("cannot read {}: {e}", cfg.busybox.display()),
        )
    })?;
    if !is_static_elf(&binary) {
        return Err(recipe_err(
            recipe,
            format!(
                "{} is dynamically linked; install busybox-static",
                cfg.busybox.display()
            ),
        ));
    }
    progress.message(&format!(
        "building recipe busybox from {}",
        cfg.busybox.display()
    ));
    let io = |what: &'static str, p: &Path| ImageError::io(what, p.to_path_buf());
    for (dir, mode) in [
        ("bin", 0o755),
        ("sbin", 0o755),
        ("usr/bin", 0o755),
        ("usr/sbin", 0o755),
        ("etc", 0o755),
        ("dev", 0o755),
        ("proc", 0o555),
        ("sys", 0o555),
        ("run", 0o755),
        ("var/tmp", 0o1777),
        ("home", 0o755),
        ("root", 0o700),
        ("tmp", 0o1777),
    ] {
        let p = rootfs.join(dir);
        fs::create_dir_all(&p).map_err(io("cannot create", &p))?;
        fs::set_permissions(&p, fs::Permissions::from_mode(mode))
            .map_err(io("cannot chmod", &p))?;
    }
    let target = rootfs.join("bin/busybox");
    fs::write(&target, &binary).map_err(io("cannot write", &target))?;
    fs::set_permissions(&target, fs::Permissions::from_mode(0o755))
        .map_err(io("cannot chmod", &target))?;
    // The applet list comes from the source binary: the copy was just written by this
    // (threaded) process, and a child forked elsewhere meanwhile may still hold it open for
    // writing, which makes running it fail with ETXTBSY.
    let list = Command::new(&cfg.busybox)
        .arg("--list-full")
        .output()
        .map_err(|e| recipe_err(recipe, format!("cannot run busybox --list-full: {e}")))?;
    if !list.status.success() {
        return Err(recipe_err(
            recipe,
            format!("busybox --list-full failed: {}", list.status),
        ));
    }
    let mut applets = 0;
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        let applet = applet.trim().trim_start_matches('/');
        if applet.is_empty()
            || applet == "bin/busybox"
            || applet.split('/').any(|c| c == ".." || c.is_empty())
        {
            continue;
        }
        let link: PathBuf = rootfs.join(applet);
        if let Some(parent) = link.parent() {
            fs::create_dir_all(parent).map_err(io("cannot create", parent))?;
        }
        if link.symlink_metadata().is_err() {
            std::os::unix::fs::symlink("/bin/busybox", &link).map_err(io("cannot link", &link))?;
            applets += 1;
        }
    }
    for (file, text) in [
        (
            "etc/passwd",
            "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
        ),
        ("etc/group", "root:x:0:\nnogroup:x:65534:\n"),
        ("etc/hostname", "fastbox\n"),
    ] {
        let p = rootfs.join(file);
        fs::write(&p, text).map_err(io("cannot write", &p))?;
    }
    let version = busybox_version(&binary).unwrap_or_else(|| "unknown".into());
    progress.message(&format!(
        "built busybox {version} rootfs with {applets} applets"
    ));
    Ok(RecipeOutput {
        served_by: format!("busybox-{version}"),
        runtime: ImageRuntimeConfig {
            cmd: vec!["/bin/sh".into()],
            env: vec![PATH_ENV.into()],
            ..ImageRuntimeConfig::default()
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_built_file_is_removed_only_inside_the_tree() {
        let dir = tempfile::tempdir().unwrap();
        let (rootfs, outside) = (dir.path().join("rootfs"), dir.path().join("outside"));
        fs::create_dir_all(rootfs.join("usr/lib/python3.11")).unwrap();
        fs::create_dir_all(outside.join("python3.11")).unwrap();
        fs::write(rootfs.join("usr/lib/python3.11/EXTERNALLY-MANAGED"), "x").unwrap();
        fs::write(outside.join("python3.11/EXTERNALLY-MANAGED"), "x").unwrap();
        remove_built_file(&rootfs, "usr/lib/python3.11/EXTERNALLY-MANAGED").unwrap();
        assert!(
            !rootfs
                .join("usr/lib/python3.11/EXTERNALLY-MANAGED")
                .exists()
        );
        // Absent: nothing to do.
        remove_built_file(&rootfs, "usr/lib/python3.11/EXTERNALLY-MANAGED").unwrap();
        remove_built_file(&rootfs, "usr/nowhere/x").unwrap();
        // A symlinked directory on the way is refused, and what it points at stays.
        fs::remove_dir_all(rootfs.join("usr/lib")).unwrap();
        std::os::unix::fs::symlink(&outside, rootfs.join("usr/lib")).unwrap();
        assert!(remove_built_file(&rootfs, "usr/lib/python3.11/EXTERNALLY-MANAGED").is_err());
        assert!(outside.join("python3.11/EXTERNALLY-MANAGED").exists());
    }

    #[test]
    fn recipe_names_round_trip() {
        for r in Recipe::ALL {
            assert_eq!(Recipe::from_name(r.name()), Some(*r));
        }
        assert_eq!(Recipe::from_name("debian"), None);
    }

    #[test]
    fn static_elf_detection() {
        if let Ok(sh) = fs::read("/bin/sh") {
            assert!(
                !is_static_elf(&sh),
                "/bin/sh is dynamically linked on Debian"
            );
        }
        assert!(is_static_elf(b"#!/bin/sh\n"));
    }

    #[test]
    fn busybox_version_is_read_from_the_binary() {
        assert_eq!(
            busybox_version(b"xx\0BusyBox v1.35.0 (Debian) multi-call").as_deref(),
            Some("1.35.0")
        );
        assert_eq!(busybox_version(b"nothing"), None);
    }

    #[test]
    fn configured_mirror_wins_over_apt_sources() {
        let cfg = ImageConfig {
            debian_mirror: Some("http://m/debian".into()),
            apt_sources: vec![],
            ..ImageConfig::default()
        };
        assert_eq!(debian_mirror(&cfg).unwrap(), "http://m/debian");
        let cfg = ImageConfig {
            apt_sources: vec!["/nonexistent".into()],
            ..ImageConfig::default()
        };
        assert!(matches!(
            debian_mirror(&cfg),
            Err(ImageError::NoDebianMirror { .. })
        ));
    }

    #[test]
    fn debootstrap_digest_is_stable_and_distinct() {
        let cfg = ImageConfig::default();
        let a = digest(Recipe::DebianBookwormPython3, &cfg).unwrap();
        assert_eq!(a, digest(Recipe::DebianBookwormPython3, &cfg).unwrap());
        let cfg2 = ImageConfig {
            debian_mirror: Some("http://other/debian".into()),
            ..cfg
        };
        assert_eq!(
            a,
            digest(Recipe::DebianBookwormPython3, &cfg2).unwrap(),
            "the mirror is not part of the identity"
        );
        assert_ne!(
            a,
            digest(Recipe::DebianBookwormCodeInterpreter, &cfg2).unwrap(),
            "each recipe its own name"
        );
    }
}
