//! S3-compatible test servers on random loopback ports: `s3s-fs` and moto.
//!
//! `scripts/setup.sh` installs both into `.deps` (never as services): `s3s-fs` (objects as
//! files in a data directory, SigV4 checked against one key pair; persists across restarts)
//! and moto's `moto_server` (in memory, any credentials accepted). [`S3Server::start`] runs
//! one with a fresh data directory and random credentials on a free loopback port, waits
//! until it answers HTTP, and kills it when dropped. It creates no bucket: the tests do that
//! through the store crate (so this crate stays free of HTTP clients), with
//! [`S3Server::bucket`] as a fresh name.
//!
//! ```no_run
//! use fastbox_testkit::s3::{S3Server, S3ServerKind};
//! # fn t() {
//! fastbox_testkit::skip_unless!(S3ServerKind::Moto.unavailable());
//! let server = S3Server::start(S3ServerKind::Moto).expect("start moto");
//! println!("{} {}", server.endpoint(), server.bucket());
//! # }
//! ```

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::repo_root;

/// How long a server may take to answer after it was started.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How often a start is tried when the chosen port was taken meanwhile.
const START_ATTEMPTS: usize = 3;

/// Which server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum S3ServerKind {
    /// `s3s-fs`: files on disk, SigV4 checked, data survives a restart.
    S3sFs,
    /// moto's `moto_server`: in memory, any credentials.
    Moto,
}

impl S3ServerKind {
    /// Both kinds, for tests that run against each.
    pub const ALL: [S3ServerKind; 2] = [S3ServerKind::S3sFs, S3ServerKind::Moto];

    /// A short name for messages.
    pub fn name(self) -> &'static str {
        match self {
            S3ServerKind::S3sFs => "s3s-fs",
            S3ServerKind::Moto => "moto",
        }
    }

    /// The executable: `FASTBOX_S3S_FS_BIN` / `FASTBOX_MOTO_SERVER`, else where
    /// `scripts/setup.sh` installs it; None when it is not there.
    pub fn binary(self) -> Option<PathBuf> {
        let (variable, default) = match self {
            S3ServerKind::S3sFs => ("FASTBOX_S3S_FS_BIN", ".deps/s3s-fs/bin/s3s-fs"),
            S3ServerKind::Moto => ("FASTBOX_MOTO_SERVER", ".deps/venv/bin/moto_server"),
        };
        std::env::var_os(variable)
            .map(PathBuf::from)
            .or_else(|| Some(repo_root().join(default)))
            .filter(|path| path.exists())
    }

    /// Why this server cannot run here (for `skip_unless!`), or None.
    pub fn unavailable(self) -> Option<String> {
        match self.binary() {
            Some(_) => None,
            None => Some(format!(
                "{} is not installed (run scripts/setup.sh)",
                self.name()
            )),
        }
    }
}

/// A running test server. See the module docs.
#[derive(Debug)]
pub struct S3Server {
    kind: S3ServerKind,
    binary: PathBuf,
    port: u16,
    access_key: String,
    secret_key: String,
    bucket: String,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl S3Server {
    /// Start a server of `kind` and wait until it answers. Fails when it is not installed
    /// (check [`S3ServerKind::unavailable`] first) or does not come up.
    pub fn start(kind: S3ServerKind) -> io::Result<S3Server> {
        let binary = kind.binary().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                kind.unavailable().unwrap_or_default(),
            )
        })?;
        let dir = tempfile::Builder::new()
            .prefix(&format!("fastbox-{}-", kind.name()))
            .tempdir()?;
        std::fs::create_dir(dir.path().join("data"))?;
        let mut server = S3Server {
            kind,
            binary,
            port: 0,
            access_key: format!("AK{:016X}", rand::random::<u64>()),
            secret_key: format!("{:032x}", rand::random::<u128>()),
            bucket: fresh_bucket_name(),
            dir,
            child: None,
        };
        let mut last_error = None;
        for _ in 0..START_ATTEMPTS {
            server.port = crate::server_port();
            match server.launch() {
                Ok(()) => return Ok(server),
                Err(error) => last_error = Some(error),
            }
        }
        Err(last_error.unwrap_or_else(|| io::Error::other("the server did not start")))
    }

    /// Stop the server and start it again on the same port with the same data directory
    /// and credentials (moto loses its data; s3s-fs keeps it).
    pub fn restart(&mut self) -> io::Result<()> {
        self.stop();
        self.launch()
    }

    /// Kill the server (it is not running afterwards until [`restart`](Self::restart)).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Which server this is.
    pub fn kind(&self) -> S3ServerKind {
        self.kind
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The access key id the server accepts (moto accepts any).
    pub fn access_key(&self) -> &str {
        &self.access_key
    }

    /// The secret access key the server accepts (moto accepts any).
    pub fn secret_key(&self) -> &str {
        &self.secret_key
    }

    /// The region to sign for.
    pub fn region(&self) -> &str {
        "us-east-1"
    }

    /// A fresh bucket name for this server (not created).
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// Where s3s-fs keeps objects (`<data>/<bucket>/<key>`); unused by moto.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// What the server printed so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("server.log")
    }

    /// Start the process on `self.port` and wait until it answers.
    fn launch(&mut self) -> io::Result<()> {
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log_path())?;
        let mut command = Command::new(&self.binary);
        let port = self.port.to_string();
        match self.kind {
            S3ServerKind::S3sFs => {
                command
                    .args(["--host", "127.0.0.1", "--port", &port])
                    .args(["--access-key", &self.access_key])
                    .args(["--secret-key", &self.secret_key])
                    .arg(self.data_dir());
            }
            S3ServerKind::Moto => {
                command.args(["-H", "127.0.0.1", "-p", &port]);
            }
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.child = Some(child);
        match self.wait_ready() {
            Ok(()) => Ok(()),
            Err(error) => {
                self.stop();
                Err(io::Error::new(
                    error.kind(),
                    format!(
                        "{} on port {}: {error}; its log:\n{}",
                        self.kind.name(),
                        self.port,
                        self.log()
                    ),
                ))
            }
        }
    }

    /// Wait until an HTTP request gets an answer, or the process exits.
    fn wait_ready(&mut self) -> io::Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        let address = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port));
        loop {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                return Err(io::Error::other(format!("exited early with {status}")));
            }
            if answers_http(&address) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no HTTP answer within {READY_TIMEOUT:?}"),
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A new bucket name: `fbt-` and 16 random hex digits.
pub fn fresh_bucket_name() -> String {
    format!("fbt-{:016x}", rand::random::<u64>())
}

/// Whether something at `address` answers a plain HTTP request with a status line.
fn answers_http(address: &SocketAddr) -> bool {
    let probe = || -> io::Result<bool> {
        let mut stream = TcpStream::connect_timeout(address, Duration::from_millis(500))?;
        stream.set_read_timeout(Some(Duration::from_secs(2)))?;
        stream.write_all(b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
        let mut head = [0u8; 8];
        stream.read_exact(&mut head)?;
        Ok(head.starts_with(b"HTTP/1."))
    };
    probe().unwrap_or(false)
}
