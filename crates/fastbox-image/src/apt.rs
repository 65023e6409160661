//! The Debian mirror this machine already uses, read from its apt sources (deb822 `.sources`
//! files and one-line `.list` files), so the debootstrap recipe never hard-codes a host.

use std::fs;
use std::path::{Path, PathBuf};

/// One `deb` source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AptSource {
    pub uri: String,
    pub suites: Vec<String>,
}

/// Every enabled `deb` source in `paths` (files, or directories of `*.sources` / `*.list`).
pub(crate) fn read_sources(paths: &[PathBuf]) -> Vec<AptSource> {
    let mut out = Vec::new();
    for path in paths {
        if path.is_dir() {
            let mut files: Vec<PathBuf> = fs::read_dir(path)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "sources" || e == "list"))
                .collect();
            files.sort();
            for f in files {
                out.extend(read_file(&f));
            }
        } else {
            out.extend(read_file(path));
        }
    }
    out
}

fn read_file(path: &Path) -> Vec<AptSource> {
    let Ok(text) = fs::read_to_string(path) else {
        return Vec::new();
    };
    if path.extension().is_some_and(|e| e == "sources") {
        parse_deb822(&text)
    } else {
        parse_one_line(&text)
    }
}

/// deb822 paragraphs: `Types:`, `URIs:`, `Suites:`, `Enabled:`.
pub(crate) fn parse_deb822(text: &str) -> Vec<AptSource> {
    let mut out = Vec::new();
    for paragraph in text.split("\n\n").flat_map(|p| p.split("\r\n\r\n")) {
        let mut fields: Vec<(String, String)> = Vec::new();
        for line in paragraph.lines() {
            if line.trim_start().starts_with('#') || line.trim().is_empty() {
                continue;
            }
            if line.starts_with([' ', '\t']) {
                if let Some((_, v)) = fields.last_mut() {
                    v.push(' ');
                    v.push_str(line.trim());
                }
                continue;
            }
            if let Some((k, v)) = line.split_once(':') {
                fields.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
            }
        }
        let get = |k: &str| {
            fields
                .iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
                .unwrap_or("")
        };
        if get("enabled").eq_ignore_ascii_case("no")
            || !get("types").split_whitespace().any(|t| t == "deb")
        {
            continue;
        }
        let suites: Vec<String> = get("suites")
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        for uri in get("uris").split_whitespace() {
            out.push(AptSource {
                uri: uri.trim_end_matches('/').to_owned(),
                suites: suites.clone(),
            });
        }
    }
    out
}

/// `deb [options] uri suite components...` lines.
pub(crate) fn parse_one_line(text: &str) -> Vec<AptSource> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        let Some(rest) = line
            .strip_prefix("deb ")
            .or_else(|| line.strip_prefix("deb\t"))
        else {
            continue;
        };
        let rest = rest.trim_start();
        let rest = match rest.strip_prefix('[') {
            Some(r) => r.split_once(']').map_or("", |(_, after)| after),
            None => rest,
        };
        let mut words = rest.split_whitespace();
        if let (Some(uri), Some(suite)) = (words.next(), words.next()) {
            out.push(AptSource {
                uri: uri.trim_end_matches('/').to_owned(),
                suites: vec![suite.to_owned()],
            });
        }
    }
    out
}

/// The source that carries `suite`, else the first that is not a security archive.
pub(crate) fn pick_mirror(sources: &[AptSource], suite: &str) -> Option<String> {
    let usable = |s: &&AptSource| {
        s.uri.starts_with("http://") || s.uri.starts_with("https://") || s.uri.starts_with("file:/")
    };
    sources
        .iter()
        .filter(usable)
        .find(|s| s.suites.iter().any(|x| x == suite))
        .or_else(|| {
            sources
                .iter()
                .filter(usable)
                .find(|s| s.suites.iter().all(|x| !x.ends_with("-security")))
        })
        .map(|s| s.uri.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEB822: &str = "Types: deb\n# a comment\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\nComponents: main\n\nTypes: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\nComponents: main\n\nTypes: deb-src\nURIs: http://src.example/debian\nSuites: bookworm\n";

    #[test]
    fn deb822_sources_yield_the_suite_mirror() {
        let s = parse_deb822(DEB822);
        assert_eq!(s.len(), 2, "deb-src is skipped");
        assert_eq!(
            pick_mirror(&s, "bookworm").as_deref(),
            Some("http://mirror.example/debian")
        );
    }

    #[test]
    fn disabled_paragraphs_are_skipped() {
        let s = parse_deb822(
            "Types: deb\nEnabled: no\nURIs: http://a/\nSuites: bookworm\n\nTypes: deb\nURIs: http://b/\nSuites: bookworm\n",
        );
        assert_eq!(pick_mirror(&s, "bookworm").as_deref(), Some("http://b"));
    }

    #[test]
    fn one_line_sources_with_options() {
        let s = parse_one_line(
            "# comment\ndeb-src http://src/ bookworm main\ndeb [arch=amd64 signed-by=/k.gpg] http://sec/debian-security bookworm-security main\ndeb http://m/debian/ trixie main # tail\n",
        );
        assert_eq!(s.len(), 2);
        // No source carries bookworm: the first non-security mirror serves every suite.
        assert_eq!(
            pick_mirror(&s, "bookworm").as_deref(),
            Some("http://m/debian")
        );
    }

    #[test]
    fn nothing_usable_gives_none() {
        assert_eq!(
            pick_mirror(
                &parse_one_line("deb cdrom:[x]/ bookworm main\n"),
                "bookworm"
            ),
            None
        );
        assert!(read_sources(&[PathBuf::from("/nonexistent/apt")]).is_empty());
    }
}
