//! Host facts a restore depends on, recorded in every manifest.
//!
//! A CRIU checkpoint carries process state that only makes sense on a compatible host: the
//! same architecture, every CPU feature the dumped processes may have detected and used (a
//! libc that picked AVX-512 code paths crashes where AVX-512 is missing), and a kernel and
//! CRIU close enough to understand the images. The kernel release and CRIU version are
//! recorded for diagnosis; the architecture and CPU features decide (see
//! [`HostFacts::restore_blockers`]).

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

const OSRELEASE: &str = "/proc/sys/kernel/osrelease";
const CPUINFO: &str = "/proc/cpuinfo";

/// Why host facts could not be read.
#[derive(Debug, thiserror::Error)]
pub enum HostFactsError {
    /// A `/proc` file could not be read.
    #[error("read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The facts of the host an artifact was made on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostFacts {
    /// Kernel release (`uname -r`).
    pub kernel: String,
    /// The CRIU version that dumped the checkpoint, if the artifact holds one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub criu_version: Option<String>,
    /// Machine architecture, as Rust names it (`x86_64`, `aarch64`).
    pub arch: String,
    /// CPU feature flags of the first processor in `/proc/cpuinfo`, sorted.
    pub cpu_features: Vec<String>,
}

impl HostFacts {
    /// The facts of this host; `criu_version` is the caller's, who knows which CRIU it runs.
    pub fn detect(criu_version: Option<String>) -> Result<Self, HostFactsError> {
        let kernel = read_proc(OSRELEASE)?.trim().to_string();
        let cpuinfo = read_proc(CPUINFO)?;
        Ok(HostFacts {
            kernel,
            criu_version,
            arch: std::env::consts::ARCH.to_string(),
            cpu_features: parse_cpu_features(&cpuinfo),
        })
    }

    /// Why an artifact made on this host cannot be restored on `target`: a different
    /// architecture, or CPU features this host had and `target` lacks. Empty when a restore
    /// may proceed. Kernel and CRIU differences are not blockers (CRIU checks what it needs).
    pub fn restore_blockers(&self, target: &HostFacts) -> Vec<String> {
        let mut blockers = Vec::new();
        if self.arch != target.arch {
            blockers.push(format!(
                "architecture {} differs from the target's {}",
                self.arch, target.arch
            ));
        }
        let available: BTreeSet<&str> = target.cpu_features.iter().map(String::as_str).collect();
        let missing: Vec<&str> = self
            .cpu_features
            .iter()
            .map(String::as_str)
            .filter(|f| !available.contains(f))
            .collect();
        if !missing.is_empty() {
            blockers.push(format!(
                "cpu features missing on the target: {}",
                missing.join(" ")
            ));
        }
        blockers
    }
}

fn read_proc(path: &str) -> Result<String, HostFactsError> {
    std::fs::read_to_string(path).map_err(|source| HostFactsError::Read {
        path: path.into(),
        source,
    })
}

/// The feature flags of the first processor: the `flags` line on x86, `Features` on arm64.
fn parse_cpu_features(cpuinfo: &str) -> Vec<String> {
    let line = cpuinfo.lines().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        matches!(key.trim(), "flags" | "Features").then_some(value)
    });
    let flags: BTreeSet<&str> = line.unwrap_or("").split_whitespace().collect();
    flags.into_iter().map(str::to_string).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(arch: &str, features: &[&str]) -> HostFacts {
        HostFacts {
            kernel: "6.1.0".into(),
            criu_version: None,
            arch: arch.into(),
            cpu_features: features.iter().map(|f| f.to_string()).collect(),
        }
    }

    #[test]
    fn cpu_features_come_sorted_from_the_first_processor() {
        let cpuinfo =
            "processor\t: 0\nflags\t\t: sse2 avx fpu avx\n\nprocessor\t: 1\nflags\t\t: zzz\n";
        assert_eq!(parse_cpu_features(cpuinfo), vec!["avx", "fpu", "sse2"]);
        let arm = "processor\t: 0\nFeatures\t: fp asimd\n";
        assert_eq!(parse_cpu_features(arm), vec!["asimd", "fp"]);
    }

    #[test]
    fn a_target_with_more_features_accepts_and_one_with_fewer_blocks() {
        let made = facts("x86_64", &["avx", "sse2"]);
        assert!(
            made.restore_blockers(&facts("x86_64", &["avx", "avx512f", "sse2"]))
                .is_empty()
        );
        let blockers = made.restore_blockers(&facts("x86_64", &["sse2"]));
        assert_eq!(blockers, vec!["cpu features missing on the target: avx"]);
        assert_eq!(
            made.restore_blockers(&facts("aarch64", &["avx", "sse2"]))
                .len(),
            1
        );
    }

    #[test]
    fn detects_this_host() {
        let facts = HostFacts::detect(Some("4.2.1".into())).unwrap();
        assert!(!facts.kernel.is_empty());
        assert_eq!(facts.arch, std::env::consts::ARCH);
        assert_eq!(facts.criu_version.as_deref(), Some("4.2.1"));
    }
}
