//! etcd clusters for tests: one or three members on random loopback ports.
//!
//! `scripts/setup.sh` unpacks Debian's etcd 3.4 into `.deps/etcd` (never a service; the
//! 3.5.0-3.5.2 builds are avoided for their data-inconsistency bug after crashes).
//! [`EtcdCluster::start`] runs `members` of them, each with its data on a tmpfs
//! (`/dev/shm`), a fresh cluster token, and election timeouts sized for a loaded 2-core
//! machine; it waits until every member reports healthy, and kills them all when dropped.
//! Members can be killed and started again to test faults ([`EtcdCluster::kill`],
//! [`EtcdCluster::restart`]).
//!
//! Like [`crate::s3`], this crate holds no HTTP client: [`EtcdCluster::put`] and
//! [`EtcdCluster::get`] speak to etcd's JSON gateway over a plain TCP connection, enough for
//! tests of the cluster itself.
//!
//! ```no_run
//! use fastbox_testkit::etcd::{EtcdCluster, etcd_unavailable};
//! # fn t() {
//! fastbox_testkit::skip_unless!(etcd_unavailable());
//! let etcd = EtcdCluster::start(3).expect("start etcd");
//! println!("{}", etcd.endpoints().join(","));
//! # }
//! ```

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::repo_root;

/// How long members may take to report healthy.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// Heartbeat and election timeout, milliseconds: ten times etcd's defaults, so a loaded
/// 2-core machine does not make members call elections all the time.
const HEARTBEAT_MS: &str = "250";
const ELECTION_MS: &str = "2500";

/// The etcd executable: `FASTBOX_ETCD_BIN`, else where `scripts/setup.sh` puts it; None when
/// it is not there.
pub fn etcd_binary() -> Option<PathBuf> {
    std::env::var_os("FASTBOX_ETCD_BIN")
        .map(PathBuf::from)
        .or_else(|| Some(repo_root().join(".deps/etcd/bin/etcd")))
        .filter(|path| path.exists())
}

/// Why etcd cannot run here (for `skip_unless!`), or None.
pub fn etcd_unavailable() -> Option<String> {
    match etcd_binary() {
        Some(_) => None,
        None => Some("etcd is not installed (run scripts/setup.sh)".into()),
    }
}

/// One member: its ports and process.
#[derive(Debug)]
struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    /// Plain HTTP `/health`, whatever the client port speaks.
    metrics_port: u16,
    child: Option<Child>,
}

/// The certificates of a cluster whose client ports speak TLS: a CA of the test's own and
/// a server certificate it signed for 127.0.0.1.
#[derive(Debug)]
struct Tls {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

/// Running etcd members. See the module docs.
#[derive(Debug)]
pub struct EtcdCluster {
    binary: PathBuf,
    token: String,
    members: Vec<Member>,
    /// On `/dev/shm` (a tmpfs) when there is one: each member's data and log.
    dir: tempfile::TempDir,
    tls: Option<Tls>,
    /// More arguments for every member.
    extra: Vec<String>,
    /// The address every member listens on (loopback unless started with
    /// [`EtcdCluster::start_on`]).
    host: Ipv4Addr,
}

impl EtcdCluster {
    /// Starts `members` members (1 or 3, usually) as one new cluster and waits until each
    /// reports healthy.
    pub fn start(members: usize) -> io::Result<EtcdCluster> {
        let shm = PathBuf::from("/dev/shm");
        Self::start_in(
            members,
            &if shm.is_dir() {
                shm
            } else {
                std::env::temp_dir()
            },
        )
    }

    /// [`EtcdCluster::start`] with the members' data under `parent` (a disk, for
    /// benchmarks that count etcd's fsyncs).
    pub fn start_in(members: usize, parent: &std::path::Path) -> io::Result<EtcdCluster> {
        Self::start_with(members, parent, false)
    }

    /// [`EtcdCluster::start`] with client ports that speak TLS only, with a certificate
    /// signed by a CA of the test's own ([`EtcdCluster::ca_file`]). [`EtcdCluster::put`],
    /// [`EtcdCluster::get`] and [`EtcdCluster::post`] speak plain HTTP: not for this one.
    pub fn start_tls(members: usize) -> io::Result<EtcdCluster> {
        Self::start_with(members, &std::env::temp_dir(), true)
    }

    /// [`EtcdCluster::start`] with every member listening on `host` (an address of a test
    /// bridge, which the test's network namespaces reach) instead of loopback.
    pub fn start_on(members: usize, host: Ipv4Addr) -> io::Result<EtcdCluster> {
        let shm = PathBuf::from("/dev/shm");
        let parent = if shm.is_dir() {
            shm
        } else {
            std::env::temp_dir()
        };
        let mut cluster = Self::prepare(members, &parent, false)?;
        cluster.host = host;
        cluster.run()
    }

    /// [`EtcdCluster::start`] of one member given `args` besides (e.g. a space quota).
    pub fn start_one_with(args: &[&str]) -> io::Result<EtcdCluster> {
        let mut cluster = Self::prepare(1, &std::env::temp_dir(), false)?;
        cluster.extra = args.iter().map(|a| a.to_string()).collect();
        cluster.run()
    }

    /// The CA file of a cluster started with [`EtcdCluster::start_tls`].
    pub fn ca_file(&self) -> Option<&std::path::Path> {
        self.tls.as_ref().map(|t| t.ca.as_path())
    }

    fn start_with(members: usize, parent: &std::path::Path, tls: bool) -> io::Result<EtcdCluster> {
        Self::prepare(members, parent, tls)?.run()
    }

    /// Starts every member and waits until each is healthy.
    fn run(mut self) -> io::Result<EtcdCluster> {
        for i in 0..self.members.len() {
            self.spawn(i)?;
        }
        for i in 0..self.members.len() {
            self.wait_healthy(i)?;
        }
        Ok(self)
    }

    /// A cluster of `members`, not started.
    fn prepare(members: usize, parent: &std::path::Path, tls: bool) -> io::Result<EtcdCluster> {
        let binary = etcd_binary().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                etcd_unavailable().unwrap_or_default(),
            )
        })?;
        let dir = tempfile::Builder::new()
            .prefix("fastbox-etcd-")
            .tempdir_in(parent)?;
        let mut taken = Vec::new();
        let mut port = || loop {
            let p = crate::server_port();
            if !taken.contains(&p) {
                taken.push(p);
                return p;
            }
        };
        let members = (0..members.max(1))
            .map(|i| Member {
                name: format!("m{i}"),
                client_port: port(),
                peer_port: port(),
                metrics_port: port(),
                child: None,
            })
            .collect();
        let tls = match tls {
            true => Some(make_tls(dir.path())?),
            false => None,
        };
        Ok(EtcdCluster {
            binary,
            token: format!("fbt-{:016x}", rand::random::<u64>()),
            members,
            dir,
            tls,
            extra: Vec::new(),
            host: Ipv4Addr::LOCALHOST,
        })
    }

    /// Every member's client URL (`http://HOST:PORT`, `https://` with TLS), in member
    /// order.
    pub fn endpoints(&self) -> Vec<String> {
        (0..self.members.len()).map(|i| self.endpoint(i)).collect()
    }

    /// Member `i`'s client URL.
    pub fn endpoint(&self, i: usize) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}:{}", self.host, self.members[i].client_port)
    }

    /// The members as `--state` takes them: `etcd://HOST:P1,HOST:P2,...`.
    pub fn state_url(&self) -> String {
        let members: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("{}:{}", self.host, m.client_port))
            .collect();
        let scheme = if self.tls.is_some() { "etcds" } else { "etcd" };
        format!("{scheme}://{}", members.join(","))
    }

    /// The member that leads now, as the running members report it (None during an
    /// election).
    pub fn leader(&self) -> Option<usize> {
        let field = |body: &str, name: &str| {
            let at = body.find(&format!("\"{name}\":\""))? + name.len() + 4;
            Some(body[at..].split('"').next()?.to_string())
        };
        (0..self.members.len()).find(|&i| {
            self.members[i].child.is_some()
                && self
                    .post(i, "/v3/maintenance/status", "{}")
                    .ok()
                    .and_then(|body| Some(field(&body, "member_id")? == field(&body, "leader")?))
                    .unwrap_or(false)
        })
    }

    /// Kills member `i` (SIGKILL); its data stays for [`EtcdCluster::restart`].
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts member `i` again on its ports and data, and waits until it is healthy.
    pub fn restart(&mut self, i: usize) -> io::Result<()> {
        self.kill(i);
        self.spawn(i)?;
        self.wait_healthy(i)
    }

    /// What member `i` logged so far.
    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.log_path(i)).unwrap_or_default()
    }

    /// Puts `value` at `key` through member `i` (keys and values in base64, as the JSON
    /// gateway takes them); the answer's body.
    pub fn put(&self, i: usize, key_b64: &str, value_b64: &str) -> io::Result<String> {
        self.post(
            i,
            "/v3/kv/put",
            &format!(r#"{{"key":"{key_b64}","value":"{value_b64}"}}"#),
        )
    }

    /// The range answer for `key` from member `i` (a linearizable read: it needs a quorum).
    pub fn get(&self, i: usize, key_b64: &str) -> io::Result<String> {
        self.post(i, "/v3/kv/range", &format!(r#"{{"key":"{key_b64}"}}"#))
    }

    fn log_path(&self, i: usize) -> PathBuf {
        self.dir
            .path()
            .join(format!("{}.log", self.members[i].name))
    }

    fn spawn(&mut self, i: usize) -> io::Result<()> {
        let host = self.host;
        let url = |port: u16| format!("http://{host}:{port}");
        let client_url = |port: u16| match self.tls {
            Some(_) => format!("https://{host}:{port}"),
            None => url(port),
        };
        let initial: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("{}={}", m.name, url(m.peer_port)))
            .collect();
        let member = &self.members[i];
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log_path(i))?;
        let data = self.dir.path().join(&member.name);
        let mut command = Command::new(&self.binary);
        if let Some(tls) = &self.tls {
            command.arg("--cert-file").arg(&tls.cert);
            command.arg("--key-file").arg(&tls.key);
        }
        let child = command
            .args(["--name", &member.name])
            .arg("--data-dir")
            .arg(&data)
            .args(["--listen-client-urls", &client_url(member.client_port)])
            .args(["--advertise-client-urls", &client_url(member.client_port)])
            .args(["--listen-metrics-urls", &url(member.metrics_port)])
            .args(["--listen-peer-urls", &url(member.peer_port)])
            .args(["--initial-advertise-peer-urls", &url(member.peer_port)])
            .args(["--initial-cluster", &initial.join(",")])
            .args(["--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", &self.token])
            .args(["--heartbeat-interval", HEARTBEAT_MS])
            .args(["--election-timeout", ELECTION_MS])
            .args(["--logger", "zap", "--log-level", "warn"])
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.members[i].child = Some(child);
        Ok(())
    }

    /// Waits until member `i` answers `/health` with `"health":"true"`, or exits.
    fn wait_healthy(&mut self, i: usize) -> io::Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(child) = self.members[i].child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                return Err(io::Error::other(format!(
                    "etcd member {} exited early with {status}; its log:\n{}",
                    self.members[i].name,
                    self.log(i)
                )));
            }
            if self
                .request_to(self.members[i].metrics_port, "GET", "/health", "")
                .is_ok_and(|body| body.contains(r#""health":"true""#))
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "etcd member {} not healthy within {READY_TIMEOUT:?}; its log:\n{}",
                        self.members[i].name,
                        self.log(i)
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Posts `body` (JSON) to `path` of member `i`'s gateway; the answer's body.
    pub fn post(&self, i: usize, path: &str, body: &str) -> io::Result<String> {
        self.request(i, "POST", path, body)
    }

    /// One HTTP/1.1 request to member `i`'s client port; the answer's body (an error for a
    /// status other than 200).
    fn request(&self, i: usize, method: &str, path: &str, body: &str) -> io::Result<String> {
        self.request_to(self.members[i].client_port, method, path, body)
    }

    /// One HTTP/1.1 request to `port` on the members' address; the answer's body (an error
    /// for a status other than 200).
    fn request_to(&self, port: u16, method: &str, path: &str, body: &str) -> io::Result<String> {
        let address = SocketAddr::from((self.host, port));
        let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(2))?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer)?;
        let (head, body) = answer
            .split_once("\r\n\r\n")
            .ok_or_else(|| io::Error::other(format!("not an HTTP answer: {answer:?}")))?;
        if !head.starts_with("HTTP/1.1 200") {
            return Err(io::Error::other(format!("{method} {path}: {head}\n{body}")));
        }
        Ok(body.to_string())
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}

/// A CA and a server certificate it signed for 127.0.0.1, written into `dir`.
fn make_tls(dir: &std::path::Path) -> io::Result<Tls> {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    let fail = |e: rcgen::Error| io::Error::other(e.to_string());
    let ca_key = KeyPair::generate().map_err(fail)?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).map_err(fail)?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).map_err(fail)?;
    let key = KeyPair::generate().map_err(fail)?;
    let cert = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
        .map_err(fail)?
        .signed_by(&key, &ca, &ca_key)
        .map_err(fail)?;
    let tls = Tls {
        ca: dir.join("ca.pem"),
        cert: dir.join("server.pem"),
        key: dir.join("server-key.pem"),
    };
    std::fs::write(&tls.ca, ca.pem())?;
    std::fs::write(&tls.cert, cert.pem())?;
    std::fs::write(&tls.key, key.serialize_pem())?;
    Ok(tls)
}
