//! Command-line flags: `fastbox-execd [--port 44772] [--code-port 44771] [--log-dir DIR]
//! [--isolation] [--listen-fd N] [-- ENTRYPOINT ARGV...]`. Hand-parsed: a few flags do not
//! justify an argument-parser crate in a binary copied into every sandbox.

use std::ffi::OsString;
use std::path::PathBuf;

pub const DEFAULT_PORT: u16 = 44772;
pub const DEFAULT_CODE_PORT: u16 = 44771;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cli {
    pub port: u16,
    /// 0 disables the code-interpreter readiness listener.
    pub code_port: u16,
    pub log_dir: Option<PathBuf>,
    /// Offer isolated sessions (`/v1/isolated`): the sandbox was started with the seccomp
    /// variant that allows building them.
    pub isolation: bool,
    /// Serve on this inherited, listening Unix socket instead of a TCP port: an isolated
    /// session's own execd.
    pub listen_fd: Option<i32>,
    pub entrypoint: Vec<String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CliError {
    #[error("{0} needs a value")]
    MissingValue(String),
    #[error("invalid port {0:?}")]
    BadPort(String),
    #[error("invalid descriptor {0:?}")]
    BadFd(String),
    #[error("unknown argument {0:?}")]
    Unknown(String),
    #[error("arguments must be UTF-8")]
    NotUtf8,
    #[error("usage")]
    Help,
}

pub const USAGE: &str = "usage: fastbox-execd [--port 44772] [--code-port 44771] [--log-dir DIR] [--isolation] [--listen-fd N] [-- ENTRYPOINT ARGV...]\n\
environment: EXECD_ACCESS_TOKEN (required header X-EXECD-ACCESS-TOKEN), EXECD_ENVS (env file for children), EXECD_LOG (log filter)";

pub fn parse(args: impl IntoIterator<Item = OsString>) -> Result<Cli, CliError> {
    let mut cli = Cli {
        port: DEFAULT_PORT,
        code_port: DEFAULT_CODE_PORT,
        log_dir: None,
        isolation: false,
        listen_fd: None,
        entrypoint: Vec::new(),
    };
    let mut args = args
        .into_iter()
        .map(|a| a.into_string().map_err(|_| CliError::NotUtf8));
    while let Some(arg) = args.next() {
        let arg = arg?;
        if arg == "--" {
            cli.entrypoint = args.collect::<Result<_, _>>()?;
            break;
        }
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        let mut value = |name: &str| -> Result<String, CliError> {
            match inline.clone() {
                Some(v) => Ok(v),
                None => args
                    .next()
                    .ok_or_else(|| CliError::MissingValue(name.to_string()))?,
            }
        };
        match flag.as_str() {
            "--port" => cli.port = port(&value("--port")?)?,
            "--code-port" => cli.code_port = port(&value("--code-port")?)?,
            "--log-dir" => cli.log_dir = Some(PathBuf::from(value("--log-dir")?)),
            "--isolation" => cli.isolation = true,
            "--listen-fd" => {
                let v = value("--listen-fd")?;
                cli.listen_fd = Some(v.parse().map_err(|_| CliError::BadFd(v))?);
            }
            "-h" | "--help" => return Err(CliError::Help),
            _ => return Err(CliError::Unknown(arg)),
        }
    }
    Ok(cli)
}

fn port(s: &str) -> Result<u16, CliError> {
    s.parse().map_err(|_| CliError::BadPort(s.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(args: &[&str]) -> Result<Cli, CliError> {
        parse(args.iter().map(OsString::from))
    }

    #[test]
    fn defaults() {
        let c = p(&[]).unwrap();
        assert_eq!(
            (c.port, c.code_port, c.log_dir, c.entrypoint.len()),
            (44772, 44771, None, 0)
        );
    }

    #[test]
    fn flags_and_entrypoint() {
        let c = p(&[
            "--port",
            "1",
            "--code-port=0",
            "--log-dir",
            "/l",
            "--",
            "tail",
            "-f",
            "--port",
        ])
        .unwrap();
        assert_eq!(c.port, 1);
        assert_eq!(c.code_port, 0);
        assert_eq!(c.log_dir, Some(PathBuf::from("/l")));
        assert_eq!(c.entrypoint, vec!["tail", "-f", "--port"]);
        let c = p(&["--isolation", "--listen-fd=3"]).unwrap();
        assert!(c.isolation);
        assert_eq!(c.listen_fd, Some(3));
        assert_eq!(p(&["--listen-fd", "x"]), Err(CliError::BadFd("x".into())));
    }

    #[test]
    fn errors() {
        assert_eq!(p(&["--port"]), Err(CliError::MissingValue("--port".into())));
        assert_eq!(p(&["--port", "x"]), Err(CliError::BadPort("x".into())));
        assert_eq!(p(&["--nope"]), Err(CliError::Unknown("--nope".into())));
    }
}
