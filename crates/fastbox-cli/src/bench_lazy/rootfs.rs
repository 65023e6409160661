//! The image the benchmark's sandboxes run: the image's rootfs plus the memory holder
//! (`holder`), which is this `fastbox` binary with the dynamic loader and the libraries it
//! was linked against (found with `ldd`), under [`HOLDER_DIR`].
//!
//! The copy is made of hard links where it can be (`cp -al`, the image cache and the run
//! directory are usually on one filesystem), so even a large image costs little; it is the
//! overlay's read-only lower layer, like any image, so it is not part of the checkpoint and
//! neither restore mode fetches it.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail, ensure};

/// Where the holder and its libraries are inside the sandbox.
pub const HOLDER_DIR: &str = "/.fastbox-bench";

/// A rootfs with the holder in it.
#[derive(Debug)]
pub struct HolderRootfs {
    /// The rootfs directory (the overlay's lower layer).
    pub dir: PathBuf,
    /// Inside the sandbox: the loader, which runs the binary with the libraries beside it.
    loader: String,
}

impl HolderRootfs {
    /// Makes `dir` (which must not exist) from `image` with `exe` in it.
    pub fn build(image: &Path, dir: &Path, exe: &Path) -> anyhow::Result<Self> {
        copy_tree(image, dir)?;
        let holder_dir = dir.join(HOLDER_DIR.trim_start_matches('/'));
        let lib = holder_dir.join("lib");
        fs::create_dir_all(&lib).with_context(|| format!("create {}", lib.display()))?;
        let ldd = Command::new("ldd")
            .arg(exe)
            .output()
            .context("run ldd (libc-bin)")?;
        ensure!(
            ldd.status.success(),
            "ldd {}: {}",
            exe.display(),
            String::from_utf8_lossy(&ldd.stderr).trim()
        );
        let libraries = parse_ldd(&String::from_utf8_lossy(&ldd.stdout))?;
        let mut loader = None;
        for library in &libraries {
            let name = library.name();
            fs::copy(&library.path, lib.join(&name))
                .with_context(|| format!("copy {}", library.path.display()))?;
            if library.is_loader {
                loader = Some(format!("{HOLDER_DIR}/lib/{name}"));
            }
        }
        let loader = loader.context("ldd names no dynamic loader (a static binary?)")?;
        link_or_copy(exe, &holder_dir.join("fastbox"))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            loader,
        })
    }

    /// The shell command that starts the holder of `mib` MiB in the background, in a session
    /// of its own, with its stdio on `/dev/null` (what CRIU needs of a process it dumps).
    pub fn start_command(&self, mib: u64) -> String {
        format!(
            "setsid {} --library-path {HOLDER_DIR}/lib {HOLDER_DIR}/fastbox bench lazy-holder \
             --port {} --mib {mib} </dev/null >/dev/null 2>&1 &",
            self.loader,
            super::holder::PORT
        )
    }
}

/// One line of `ldd`: a library (or the loader) and the file it resolves to.
#[derive(Debug, PartialEq, Eq)]
struct Library {
    /// The name the binary asks for (`libc.so.6`), or the loader's path.
    wanted: String,
    path: PathBuf,
    is_loader: bool,
}

impl Library {
    /// The file name it gets in the holder's library directory.
    fn name(&self) -> String {
        Path::new(&self.wanted)
            .file_name()
            .map_or_else(|| self.wanted.clone(), |n| n.to_string_lossy().into_owned())
    }
}

/// The libraries of `ldd` output: `name => /path (0x...)` lines and the loader's
/// `/path (0x...)` line; the vDSO (no file) is skipped, a library not found is an error.
fn parse_ldd(text: &str) -> anyhow::Result<Vec<Library>> {
    let mut out = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if let Some((wanted, rest)) = line.split_once("=>") {
            let path = rest.split_whitespace().next().unwrap_or("");
            if !path.starts_with('/') {
                bail!("ldd: {line}");
            }
            out.push(Library {
                wanted: wanted.trim().to_string(),
                path: PathBuf::from(path),
                is_loader: false,
            });
        } else if let Some(path) = line
            .split_whitespace()
            .next()
            .filter(|p| p.starts_with('/'))
        {
            out.push(Library {
                wanted: path.to_string(),
                path: PathBuf::from(path),
                is_loader: true,
            });
        }
    }
    Ok(out)
}

/// `cp -al from/. to`, or `cp -a` where hard links cannot be made.
fn copy_tree(from: &Path, to: &Path) -> anyhow::Result<()> {
    ensure!(!to.exists(), "{} already exists", to.display());
    for flags in ["-al", "-a"] {
        fs::create_dir_all(to).with_context(|| format!("create {}", to.display()))?;
        let status = Command::new("cp")
            .arg(flags)
            .arg(from.join("."))
            .arg(to)
            .status()
            .context("run cp")?;
        if status.success() {
            return Ok(());
        }
        fs::remove_dir_all(to).with_context(|| format!("remove {}", to.display()))?;
    }
    bail!("could not copy {} to {}", from.display(), to.display())
}

fn link_or_copy(from: &Path, to: &Path) -> anyhow::Result<()> {
    if fs::hard_link(from, to).is_err() {
        fs::copy(from, to).with_context(|| format!("copy {}", from.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_output_names_the_libraries_and_the_loader() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                    \tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x00007f5d)\n\
                    \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f5e)\n\
                    \t/lib64/ld-linux-x86-64.so.2 (0x00007f5f)\n";
        let libraries = parse_ldd(text).unwrap();
        let names: Vec<(String, bool)> =
            libraries.iter().map(|l| (l.name(), l.is_loader)).collect();
        assert_eq!(
            names,
            [
                ("libgcc_s.so.1".to_string(), false),
                ("libc.so.6".to_string(), false),
                ("ld-linux-x86-64.so.2".to_string(), true)
            ]
        );
        assert_eq!(
            libraries[1].path,
            Path::new("/lib/x86_64-linux-gnu/libc.so.6")
        );
        assert!(parse_ldd("\tlibfoo.so.1 => not found\n").is_err());
    }

    #[test]
    fn the_holder_and_its_libraries_go_into_a_copy_of_the_image() {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("image");
        fs::create_dir_all(image.join("bin")).unwrap();
        fs::write(image.join("bin/sh"), b"#!").unwrap();
        let exe = std::env::current_exe().unwrap();
        let rootfs = HolderRootfs::build(&image, &dir.path().join("rootfs"), &exe).unwrap();
        assert_eq!(fs::read(rootfs.dir.join("bin/sh")).unwrap(), b"#!");
        let inside = |p: &str| rootfs.dir.join(p.trim_start_matches('/'));
        assert!(inside(&format!("{HOLDER_DIR}/fastbox")).is_file());
        assert!(inside(&format!("{HOLDER_DIR}/lib/libc.so.6")).is_file());
        assert!(inside(&rootfs.loader).is_file());
        let command = rootfs.start_command(64);
        assert!(
            command.starts_with(&format!("setsid {}", rootfs.loader)),
            "{command}"
        );
        assert!(
            command.contains("bench lazy-holder --port 7070 --mib 64"),
            "{command}"
        );
        assert!(
            HolderRootfs::build(&image, &rootfs.dir, &exe).is_err(),
            "an existing directory is not reused"
        );
    }
}
