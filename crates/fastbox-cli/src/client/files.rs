//! `fastbox sandbox cp` and `cat`: single files between this machine (or stdin/stdout, `-`)
//! and a sandbox (`ID:/absolute/path`), through execd's upload and download routes.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use fastbox_runtime::spec::EXECD_PORT;

use super::connection::ServerArgs;
use super::execd::ExecdClient;

/// Permission bits of a file uploaded from stdin.
const STDIN_MODE: u32 = 0o644;

/// One side of a copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A path on this machine.
    Local(PathBuf),
    /// `-`: stdin as a source, stdout as a destination.
    Stdio,
    /// `ID:/absolute/path` in a sandbox.
    Sandbox { id: String, path: String },
}

impl Location {
    /// `ID:/path` when the part before the first `:` has no `/` and the rest is absolute
    /// (so `./a:b` and `/tmp/x:y` stay local); `-` for stdio; anything else is local.
    pub fn parse(arg: &str) -> Self {
        if arg == "-" {
            return Self::Stdio;
        }
        match arg.split_once(':') {
            Some((id, path)) if !id.is_empty() && !id.contains('/') && path.starts_with('/') => {
                Self::Sandbox {
                    id: id.to_string(),
                    path: path.to_string(),
                }
            }
            _ => Self::Local(PathBuf::from(arg)),
        }
    }
}

#[derive(clap::Args, Debug)]
pub struct CpArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    /// Source: a local path, `-` (stdin) or `ID:/absolute/path`.
    pub src: String,
    /// Destination: a local path, `-` (stdout) or `ID:/absolute/path`; a sandbox path ending
    /// in `/` or an existing local directory receives the file under its own name.
    pub dst: String,
}

#[derive(clap::Args, Debug)]
pub struct CatArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    /// The sandbox id.
    pub id: String,
    /// Absolute path of the file in the sandbox.
    pub path: String,
}

pub fn cp(args: CpArgs) -> anyhow::Result<i32> {
    match (Location::parse(&args.src), Location::parse(&args.dst)) {
        (Location::Sandbox { .. }, Location::Sandbox { .. }) => {
            bail!("cp copies between this machine and one sandbox; both sides are sandboxes")
        }
        (local, Location::Sandbox { id, path }) => upload(&args.server, local, &id, &path),
        (Location::Sandbox { id, path }, local) => download(&args.server, &id, &path, local),
        _ => bail!("cp: one side must be a sandbox path, ID:/absolute/path"),
    }
}

pub fn cat(args: CatArgs) -> anyhow::Result<i32> {
    download(&args.server, &args.id, &args.path, Location::Stdio)
}

fn execd(server: &ServerArgs, id: &str) -> anyhow::Result<ExecdClient> {
    let api = server.client()?;
    let endpoint = api.endpoint(id, EXECD_PORT)?;
    Ok(ExecdClient::try_new(api.scheme(), &endpoint)?)
}

fn upload(server: &ServerArgs, src: Location, id: &str, path: &str) -> anyhow::Result<i32> {
    match src {
        Location::Local(local) => {
            let file = File::open(&local).with_context(|| format!("open {}", local.display()))?;
            let meta = file
                .metadata()
                .with_context(|| format!("stat {}", local.display()))?;
            if !meta.is_file() {
                bail!("{} is not a regular file", local.display());
            }
            let dest = into_directory(path, &local)?;
            let mode = meta.permissions().mode();
            execd(server, id)?.upload(&dest, mode, file, Some(meta.len()))?;
        }
        Location::Stdio => {
            if path.ends_with('/') {
                bail!("{path} names a directory; give the file's full path when copying stdin");
            }
            execd(server, id)?.upload(path, STDIN_MODE, std::io::stdin(), None)?;
        }
        Location::Sandbox { .. } => unreachable!("cp checks that one side is local"),
    }
    Ok(0)
}

/// `dir/` + the local file's name, or `path` itself.
fn into_directory(path: &str, local: &Path) -> anyhow::Result<String> {
    if !path.ends_with('/') {
        return Ok(path.to_string());
    }
    let name = local
        .file_name()
        .with_context(|| format!("{} has no file name", local.display()))?;
    Ok(format!("{path}{}", name.to_string_lossy()))
}

fn download(server: &ServerArgs, id: &str, path: &str, dst: Location) -> anyhow::Result<i32> {
    let mut content = execd(server, id)?.download(path)?;
    match dst {
        Location::Stdio => {
            let mut out = std::io::stdout().lock();
            content
                .copy_to(&mut out)
                .with_context(|| format!("download {path}"))?;
            out.flush()?;
        }
        Location::Local(local) => {
            let local = if local.is_dir() {
                let name = Path::new(path)
                    .file_name()
                    .with_context(|| format!("{path} has no file name"))?;
                local.join(name)
            } else {
                local
            };
            let mut file =
                File::create(&local).with_context(|| format!("create {}", local.display()))?;
            content
                .copy_to(&mut file)
                .with_context(|| format!("download {path} to {}", local.display()))?;
        }
        Location::Sandbox { .. } => unreachable!("cp checks that one side is local"),
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_paths_need_an_id_and_an_absolute_path() {
        assert_eq!(
            Location::parse("abc-1:/tmp/x"),
            Location::Sandbox {
                id: "abc-1".into(),
                path: "/tmp/x".into()
            }
        );
        assert_eq!(Location::parse("-"), Location::Stdio);
        for local in ["./a:/b", "/tmp/x:/y", "a:b", ":/x", "file.txt"] {
            assert_eq!(
                Location::parse(local),
                Location::Local(local.into()),
                "{local}"
            );
        }
    }

    #[test]
    fn a_trailing_slash_receives_the_local_name() {
        let local = Path::new("/home/u/notes.txt");
        assert_eq!(into_directory("/tmp/", local).unwrap(), "/tmp/notes.txt");
        assert_eq!(into_directory("/tmp/n.txt", local).unwrap(), "/tmp/n.txt");
    }
}
