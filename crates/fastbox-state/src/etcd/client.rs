//! A small client of etcd's JSON gateway (`/v3/...`, etcd 3.4 and later): calls go to one
//! member and move to the next when it cannot be reached or has no leader, until the
//! operation's deadline; a user/password login is renewed when etcd drops its token.

use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use serde_json::{Value, json};

use crate::StateError;
use crate::url::EtcdTarget;

/// How long one request to one member may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// The pause before trying the members again once each has failed.
const ROUND_PAUSE: Duration = Duration::from_millis(200);

/// How the etcd client connects.
#[derive(Debug, Clone)]
pub struct EtcdOptions {
    /// The CA that signed the members' certificates (PEM), for `etcds://`; without it the
    /// system's roots are used.
    pub ca: Option<PathBuf>,
    /// A client certificate and its key (PEM), when etcd asks for one.
    pub client_cert: Option<(PathBuf, PathBuf)>,
    /// How long an operation may go on trying the members (an etcd election takes a few
    /// seconds) before it fails as unavailable.
    pub timeout: Duration,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        Self {
            ca: None,
            client_cert: None,
            timeout: Duration::from_secs(10),
        }
    }
}

/// What became of one call.
pub(super) struct Answer {
    pub body: Value,
    /// An earlier attempt of this call failed in a way that may have applied it.
    pub retried: bool,
}

/// Runs `wait`, a blocking wait; on a worker of a multi-threaded tokio runtime, after handing
/// the worker's other tasks to another thread.
pub fn off_worker<T>(wait: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(wait)
        }
        _ => wait(),
    }
}

pub(super) struct GatewayClient {
    agent: ureq::Agent,
    bases: Vec<String>,
    /// The member calls go to first (the last one that answered).
    current: AtomicUsize,
    target: EtcdTarget,
    token: Mutex<Option<String>>,
    timeout: Duration,
}

/// Why one attempt failed.
enum Attempt {
    /// Try another member (or this one again): the cluster may be electing, or the member
    /// is down. `maybe_applied`: the request may have reached it.
    Retry {
        reason: String,
        maybe_applied: bool,
    },
    /// The login token expired or was never taken.
    Reauthenticate,
    /// etcd is out of space: no retry cures it.
    Full(String),
    Fatal(String),
}

impl GatewayClient {
    pub fn new(target: EtcdTarget, options: &EtcdOptions) -> Result<Self, StateError> {
        let scheme = if target.tls { "https" } else { "http" };
        let bases = target
            .members
            .iter()
            .map(|m| format!("{scheme}://{m}"))
            .collect();
        let mut config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(CALL_TIMEOUT))
            .timeout_connect(Some(Duration::from_secs(2)));
        if target.tls {
            config = config.tls_config(tls_config(options)?);
        }
        Ok(Self {
            agent: config.build().new_agent(),
            bases,
            current: AtomicUsize::new(0),
            target,
            token: Mutex::new(None),
            timeout: options.timeout,
        })
    }

    pub fn target(&self) -> &EtcdTarget {
        &self.target
    }

    /// Posts `body` to `path`, moving across the members until one answers or the deadline
    /// passes. On a worker of a multi-threaded tokio runtime the wait hands the worker's
    /// other tasks to another thread first, so the server's proxies go on meanwhile.
    pub fn call(&self, path: &str, body: &Value) -> Result<Answer, StateError> {
        off_worker(|| self.call_blocking(path, body))
    }

    /// [`GatewayClient::call`] on the calling thread as it is.
    pub fn call_blocking(&self, path: &str, body: &Value) -> Result<Answer, StateError> {
        let deadline = Instant::now() + self.timeout;
        let mut retried = false;
        let mut failures = 0usize;
        loop {
            let member = self.current.load(Ordering::Relaxed) % self.bases.len();
            let last = match self.attempt(member, path, body) {
                Ok(body) => return Ok(Answer { body, retried }),
                Err(Attempt::Fatal(message)) => return Err(StateError::Failed(message)),
                Err(Attempt::Full(message)) => return Err(StateError::Full(message)),
                Err(Attempt::Reauthenticate) => {
                    *self.token.lock().expect("token lock") = None;
                    "the login token was refused".to_string()
                }
                Err(Attempt::Retry {
                    reason,
                    maybe_applied,
                }) => {
                    retried |= maybe_applied;
                    failures += 1;
                    self.current.store(member + 1, Ordering::Relaxed);
                    if failures.is_multiple_of(self.bases.len()) {
                        std::thread::sleep(ROUND_PAUSE);
                    }
                    format!("{}: {reason}", self.target.members[member])
                }
            };
            if Instant::now() >= deadline {
                return Err(StateError::Unavailable(format!(
                    "etcd {} did not answer within {:?} ({last})",
                    self.target, self.timeout
                )));
            }
        }
    }

    /// Posts `body` to the streaming `path` of one member and hands each JSON message of the
    /// answer to `each`, with no deadline (a snapshot of a large keyspace takes a while);
    /// with `idle`, a read waiting longer than that fails the stream.
    pub fn stream(
        &self,
        path: &str,
        body: &Value,
        idle: Option<Duration>,
        mut each: impl FnMut(&Value) -> Result<(), StateError>,
    ) -> Result<(), StateError> {
        let unavailable = |e: String| StateError::Unavailable(format!("etcd {}: {e}", self.target));
        let member = self.current.load(Ordering::Relaxed) % self.bases.len();
        // The next stream goes to the next member (a failed one is not asked again at once).
        let rotate = || {
            self.current.store(member + 1, Ordering::Relaxed);
        };
        let token = match self.token(member) {
            Ok(token) => token,
            Err(Attempt::Fatal(message)) => return Err(StateError::Failed(message)),
            Err(Attempt::Full(message)) => return Err(StateError::Full(message)),
            Err(Attempt::Retry { reason, .. }) => return Err(unavailable(reason)),
            Err(Attempt::Reauthenticate) => return Err(unavailable("login refused".into())),
        };
        let mut request = self
            .agent
            .post(format!("{}{path}", self.bases[member]))
            .config()
            .timeout_global(None)
            .timeout_per_read(idle)
            .build();
        if let Some(token) = &token {
            request = request.header("Authorization", token);
        }
        let response = request.send_json(body).map_err(|e| {
            rotate();
            unavailable(e.to_string())
        })?;
        let status = response.status().as_u16();
        let reader = response.into_body().into_reader();
        for message in serde_json::Deserializer::from_reader(reader).into_iter::<Value>() {
            let message = message.map_err(|e| {
                rotate();
                unavailable(format!("reading the stream: {e}"))
            })?;
            if let Some(error) = message.get("error") {
                let text = error
                    .get("message")
                    .or(Some(error))
                    .and_then(Value::as_str)
                    .unwrap_or("an error");
                return Err(StateError::Failed(format!("etcd: {text}")));
            }
            if status != 200 {
                return Err(StateError::Failed(format!(
                    "etcd: HTTP {status}: {message}"
                )));
            }
            each(&message)?;
        }
        Ok(())
    }

    fn attempt(&self, member: usize, path: &str, body: &Value) -> Result<Value, Attempt> {
        let token = self.token(member)?;
        let mut request = self.agent.post(format!("{}{path}", self.bases[member]));
        if let Some(token) = &token {
            request = request.header("Authorization", token);
        }
        self.send(request, body)
    }

    /// Sends one request and sorts its answer.
    fn send(
        &self,
        request: ureq::RequestBuilder<ureq::typestate::WithBody>,
        body: &Value,
    ) -> Result<Value, Attempt> {
        let mut response = match request.send_json(body) {
            Ok(response) => response,
            Err(e) => {
                // Refused connections cannot have applied anything; a timeout or a
                // connection cut after sending might have.
                let refused = matches!(&e, ureq::Error::Io(io)
                    if io.kind() == std::io::ErrorKind::ConnectionRefused)
                    || matches!(e, ureq::Error::ConnectionFailed | ureq::Error::HostNotFound);
                return Err(Attempt::Retry {
                    reason: e.to_string(),
                    maybe_applied: !refused,
                });
            }
        };
        let status = response.status().as_u16();
        let text = response
            .body_mut()
            .read_to_string()
            .map_err(|e| Attempt::Retry {
                reason: format!("reading the answer: {e}"),
                maybe_applied: true,
            })?;
        let value: Value = serde_json::from_str(&text).map_err(|_| Attempt::Retry {
            reason: format!("HTTP {status}: {}", truncate(&text)),
            maybe_applied: status >= 500,
        })?;
        let error = value
            .get("error")
            .or_else(|| value.get("message"))
            .and_then(Value::as_str)
            .filter(|_| status != 200 || value.get("code").is_some());
        match error {
            None if status == 200 => Ok(value),
            None => Err(Attempt::Fatal(format!(
                "HTTP {status}: {}",
                truncate(&text)
            ))),
            Some(message) => Err(classify(value.get("code").and_then(Value::as_u64), message)),
        }
    }

    /// The login token to send (None without auth), logging in through `member` first when
    /// there is none.
    fn token(&self, member: usize) -> Result<Option<String>, Attempt> {
        let Some(user) = &self.target.user else {
            return Ok(None);
        };
        if let Some(token) = self.token.lock().expect("token lock").clone() {
            return Ok(Some(token));
        }
        let request = self
            .agent
            .post(format!("{}/v3/auth/authenticate", self.bases[member]));
        let answer = self.send(
            request,
            &json!({"name": user, "password": self.target.password.clone().unwrap_or_default()}),
        )?;
        let token = answer
            .get("token")
            .and_then(Value::as_str)
            .ok_or_else(|| Attempt::Fatal("etcd login: no token in the answer".into()))?
            .to_string();
        *self.token.lock().expect("token lock") = Some(token.clone());
        Ok(Some(token))
    }
}

/// Sorts an etcd error (gRPC code and message) into retry, login again, or give up.
fn classify(code: Option<u64>, message: &str) -> Attempt {
    const UNAVAILABLE: u64 = 14;
    const DEADLINE_EXCEEDED: u64 = 4;
    const UNAUTHENTICATED: u64 = 16;
    let transient = [
        "no leader",
        "leader changed",
        "timed out",
        "too many requests",
        "not capable",
        "unhealthy cluster",
    ];
    if message.contains("database space exceeded") {
        return Attempt::Full(message.to_string());
    }
    if message.contains("invalid auth token") || message.contains("user name is empty") {
        return Attempt::Reauthenticate;
    }
    if message.contains("authentication failed") || code == Some(UNAUTHENTICATED) {
        return Attempt::Fatal(format!("etcd login refused: {message}"));
    }
    if code == Some(UNAVAILABLE)
        || code == Some(DEADLINE_EXCEEDED)
        || transient.iter().any(|t| message.contains(t))
    {
        return Attempt::Retry {
            reason: message.to_string(),
            maybe_applied: true,
        };
    }
    if message.contains("permission denied") {
        return Attempt::Fatal(format!("etcd refused the operation: {message}"));
    }
    Attempt::Fatal(format!("etcd: {message}"))
}

fn truncate(text: &str) -> String {
    text.chars().take(200).collect()
}

fn tls_config(options: &EtcdOptions) -> Result<ureq::tls::TlsConfig, StateError> {
    use ureq::tls::{Certificate, ClientCert, PemItem, PrivateKey, RootCerts, TlsConfig};
    let read = |path: &PathBuf| {
        std::fs::read(path).map_err(|e| StateError::Failed(format!("{}: {e}", path.display())))
    };
    let bad = |path: &PathBuf, e: ureq::Error| {
        StateError::Failed(format!("{}: not usable PEM: {e}", path.display()))
    };
    let mut builder = TlsConfig::builder();
    if let Some(ca) = &options.ca {
        let pem = read(ca)?;
        let mut roots = Vec::new();
        for item in ureq::tls::parse_pem(&pem) {
            if let PemItem::Certificate(cert) = item.map_err(|e| bad(ca, e))? {
                roots.push(cert);
            }
        }
        if roots.is_empty() {
            return Err(StateError::Failed(format!(
                "{}: no certificate in it",
                ca.display()
            )));
        }
        builder = builder.root_certs(RootCerts::new_with_certs(&roots));
    }
    if let Some((cert, key)) = &options.client_cert {
        let pem = read(cert)?;
        let chain = ureq::tls::parse_pem(&pem)
            .filter_map(|item| match item {
                Ok(PemItem::Certificate(c)) => Some(Ok(c)),
                Ok(_) => None,
                Err(e) => Some(Err(e)),
            })
            .collect::<Result<Vec<Certificate<'static>>, _>>()
            .map_err(|e| bad(cert, e))?;
        let key_pem = read(key)?;
        let key_der = PrivateKey::from_pem(&key_pem).map_err(|e| bad(key, e))?;
        builder = builder.client_cert(Some(ClientCert::new_with_certs(&chain, key_der)));
    }
    Ok(builder.build())
}

/// base64 of `bytes`, as the gateway carries keys and values.
pub(super) fn b64(bytes: &[u8]) -> String {
    B64.encode(bytes)
}

pub(super) fn unb64(value: &Value) -> Result<Vec<u8>, StateError> {
    B64.decode(value.as_str().unwrap_or_default())
        .map_err(|e| StateError::Failed(format!("etcd sent bad base64: {e}")))
}

/// An int64 of the gateway's JSON (a string, a number, or absent for 0).
pub(super) fn int(value: Option<&Value>) -> u64 {
    match value {
        Some(Value::String(s)) => s.parse().unwrap_or(0),
        Some(Value::Number(n)) => n.as_u64().unwrap_or(0),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_sort_into_retries_logins_and_failures() {
        assert!(matches!(
            classify(Some(14), "etcdserver: no leader"),
            Attempt::Retry { .. }
        ));
        assert!(matches!(
            classify(Some(2), "etcdserver: request timed out"),
            Attempt::Retry { .. }
        ));
        assert!(matches!(
            classify(Some(3), "etcdserver: invalid auth token"),
            Attempt::Reauthenticate
        ));
        assert!(matches!(
            classify(
                Some(3),
                "etcdserver: authentication failed, invalid user ID or password"
            ),
            Attempt::Fatal(_)
        ));
        assert!(matches!(
            classify(Some(7), "etcdserver: permission denied"),
            Attempt::Fatal(_)
        ));
        assert!(matches!(
            classify(Some(8), "etcdserver: mvcc: database space exceeded"),
            Attempt::Full(_)
        ));
    }

    #[test]
    fn ints_come_as_strings_numbers_or_not_at_all() {
        assert_eq!(int(Some(&json!("42"))), 42);
        assert_eq!(int(Some(&json!(7))), 7);
        assert_eq!(int(None), 0);
    }
}
