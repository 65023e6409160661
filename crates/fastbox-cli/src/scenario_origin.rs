//! A scenario's origin (`verify p2p`, `verify cluster`): an `s3s-fs` server (installed by `scripts/setup.sh` into
//! `.deps/s3s-fs`) on the bridge's address and a random port, with random credentials and a
//! fresh data directory; killed when dropped.

use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// How long the server may take to listen.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// A running `s3s-fs`.
pub struct Origin {
    child: Child,
    pub addr: SocketAddr,
    pub access_key: String,
    pub secret_key: String,
    pub bucket: String,
}

impl Origin {
    /// Starts `bin` serving `data_dir` on `ip`, and creates the bucket.
    pub fn start(bin: &Path, ip: Ipv4Addr, data_dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(data_dir)
            .with_context(|| format!("create {}", data_dir.display()))?;
        let port = TcpListener::bind((ip, 0))
            .and_then(|l| l.local_addr())
            .with_context(|| format!("find a free port on {ip}"))?
            .port();
        let access_key = format!("fb{:016x}", rand::random::<u64>());
        let secret_key = format!("{:032x}", rand::random::<u128>());
        let child = Command::new(bin)
            .args(["--host", &ip.to_string(), "--port", &port.to_string()])
            .args(["--access-key", &access_key, "--secret-key", &secret_key])
            .arg(data_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("start {}", bin.display()))?;
        let mut origin = Self {
            child,
            addr: SocketAddr::from((ip, port)),
            access_key,
            secret_key,
            bucket: "fastbox-artifacts".into(),
        };
        let start = Instant::now();
        while TcpStream::connect_timeout(&origin.addr, Duration::from_millis(200)).is_err() {
            if let Some(status) = origin.child.try_wait()? {
                bail!("{} exited at start: {status}", bin.display());
            }
            if start.elapsed() > START_TIMEOUT {
                bail!(
                    "{} did not listen on {} within {START_TIMEOUT:?}",
                    bin.display(),
                    origin.addr
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        fastbox_s3::create_bucket(&origin.config()).context("create the origin's bucket")?;
        Ok(origin)
    }

    /// The endpoint URL.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The S3 store configuration of the origin.
    pub fn config(&self) -> fastbox_s3::S3Config {
        let mut cfg = fastbox_s3::S3Config::new(&self.bucket);
        cfg.endpoint = Some(self.endpoint());
        cfg.access_key_id = Some(self.access_key.clone());
        cfg.secret_access_key = Some(self.secret_key.clone());
        cfg.allow_http = true;
        cfg
    }

    /// The origin as a `--origin` URL for a node (credentials travel in the environment).
    pub fn url(&self) -> String {
        format!(
            "s3://{}?endpoint={}&allow_http=true",
            self.bucket,
            self.endpoint()
        )
    }
}

impl Drop for Origin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `s3s-fs` binary: the flag or `FASTBOX_S3S_FS_BIN`, then the repository's `.deps`.
pub fn s3s_fs_bin(flag: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(p) = flag {
        return Ok(p);
    }
    let exe = std::env::current_exe()?;
    exe.ancestors()
        .map(|a| a.join(".deps/s3s-fs/bin/s3s-fs"))
        .find(|p| p.is_file())
        .context("no s3s-fs found: run scripts/setup.sh (it installs .deps/s3s-fs) or pass --s3s-fs / FASTBOX_S3S_FS_BIN")
}
