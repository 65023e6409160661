//! A small gRPC client of etcd (etcd 3.4 and later): calls go to one member and move to the
//! next when it cannot be reached or has no leader, until the operation's deadline; a
//! user/password login is renewed when etcd drops its token.
//!
//! Requests and answers are etcd's messages in their JSON form ([`super::proto`] writes
//! them as protobuf). The calls run on a small runtime of the client's own, so a caller
//! blocks on them from any thread, inside a tokio runtime or not.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use bytes::{Buf, BufMut};
use http::uri::PathAndQuery;
use serde_json::Value;
use tokio::runtime::{Handle, Runtime};
use tokio_stream::StreamExt;
use tonic::client::Grpc;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder, Streaming};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Request, Status};

use super::proto::{self, Field};
use crate::StateError;
use crate::url::EtcdTarget;

/// How long one request to one member may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// The pause before trying the members again once each has failed.
const ROUND_PAUSE: Duration = Duration::from_millis(200);
/// How long a stream may take to open when it has no idle limit of its own.
const STREAM_OPEN_TIMEOUT: Duration = Duration::from_secs(30);
/// The largest answer taken (a range of every record of a large table).
const MAX_ANSWER: usize = 512 * 1024 * 1024;

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

/// The etcd calls the store makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Method {
    Range,
    Txn,
    Compact,
    LeaseGrant,
    LeaseRevoke,
    /// A stream; a call sends one keep-alive and reads one answer.
    LeaseKeepAlive,
    Authenticate,
    /// A stream of the whole keyspace.
    Snapshot,
    /// A stream of changes.
    Watch,
}

impl Method {
    fn path(self) -> &'static str {
        match self {
            Self::Range => "/etcdserverpb.KV/Range",
            Self::Txn => "/etcdserverpb.KV/Txn",
            Self::Compact => "/etcdserverpb.KV/Compact",
            Self::LeaseGrant => "/etcdserverpb.Lease/LeaseGrant",
            Self::LeaseRevoke => "/etcdserverpb.Lease/LeaseRevoke",
            Self::LeaseKeepAlive => "/etcdserverpb.Lease/LeaseKeepAlive",
            Self::Authenticate => "/etcdserverpb.Auth/Authenticate",
            Self::Snapshot => "/etcdserverpb.Maintenance/Snapshot",
            Self::Watch => "/etcdserverpb.Watch/Watch",
        }
    }

    /// The schemas of its request and of its answer.
    fn messages(self) -> (&'static [Field], &'static [Field]) {
        match self {
            Self::Range => (&proto::RANGE_REQUEST, &proto::RANGE_RESPONSE),
            Self::Txn => (&proto::TXN_REQUEST, &proto::TXN_RESPONSE),
            Self::Compact => (&proto::COMPACTION_REQUEST, &proto::HEADER_ONLY),
            Self::LeaseGrant => (&proto::LEASE_GRANT_REQUEST, &proto::LEASE_GRANT_RESPONSE),
            Self::LeaseRevoke => (&proto::LEASE_ID, &proto::HEADER_ONLY),
            Self::LeaseKeepAlive => (&proto::LEASE_ID, &proto::LEASE_KEEP_ALIVE_RESPONSE),
            Self::Authenticate => (&proto::AUTHENTICATE_REQUEST, &proto::AUTHENTICATE_RESPONSE),
            Self::Snapshot => (&proto::SNAPSHOT_REQUEST, &proto::SNAPSHOT_RESPONSE),
            Self::Watch => (&proto::WATCH_REQUEST, &proto::WATCH_RESPONSE),
        }
    }

    fn is_stream(self) -> bool {
        matches!(self, Self::LeaseKeepAlive | Self::Snapshot | Self::Watch)
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
    use tokio::runtime::RuntimeFlavor;
    match Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(wait)
        }
        _ => wait(),
    }
}

pub(super) struct EtcdClient {
    /// The client's own runtime (None once dropped).
    runtime: Option<Runtime>,
    handle: Handle,
    /// A connection to each member, made when first used.
    channels: Vec<Channel>,
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

impl Attempt {
    fn into_error(self, target: &EtcdTarget) -> StateError {
        match self {
            Self::Fatal(message) => StateError::Failed(message),
            Self::Full(message) => StateError::Full(message),
            Self::Retry { reason, .. } => {
                StateError::Unavailable(format!("etcd {target}: {reason}"))
            }
            Self::Reauthenticate => {
                StateError::Unavailable(format!("etcd {target}: login refused"))
            }
        }
    }
}

impl EtcdClient {
    pub fn new(target: EtcdTarget, options: &EtcdOptions) -> Result<Self, StateError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("etcd-client")
            .enable_all()
            .build()
            .map_err(|e| StateError::Failed(format!("cannot start the etcd client: {e}")))?;
        let scheme = if target.tls { "https" } else { "http" };
        let tls = if target.tls {
            Some(tls_config(options)?)
        } else {
            None
        };
        let _entered = runtime.enter();
        let channels = target
            .members
            .iter()
            .map(|member| {
                let mut endpoint = Endpoint::from_shared(format!("{scheme}://{member}"))
                    .map_err(|e| StateError::Failed(format!("etcd member {member}: {e}")))?
                    .connect_timeout(CALL_TIMEOUT)
                    .tcp_nodelay(true)
                    .http2_keep_alive_interval(Duration::from_secs(10))
                    .keep_alive_timeout(Duration::from_secs(5))
                    .keep_alive_while_idle(false);
                if let Some(tls) = &tls {
                    endpoint = endpoint
                        .tls_config(tls.clone())
                        .map_err(|e| StateError::Failed(format!("etcd TLS settings: {e}")))?;
                }
                Ok(endpoint.connect_lazy())
            })
            .collect::<Result<Vec<_>, StateError>>()?;
        drop(_entered);
        Ok(Self {
            handle: runtime.handle().clone(),
            runtime: Some(runtime),
            channels,
            current: AtomicUsize::new(0),
            target,
            token: Mutex::new(None),
            timeout: options.timeout,
        })
    }

    pub fn target(&self) -> &EtcdTarget {
        &self.target
    }

    /// Calls `method` with `body`, moving across the members until one answers or the
    /// deadline passes. On a worker of a multi-threaded tokio runtime the wait hands the
    /// worker's other tasks to another thread first, so the server's proxies go on
    /// meanwhile.
    pub fn call(&self, method: Method, body: &Value) -> Result<Answer, StateError> {
        off_worker(|| self.call_blocking(method, body))
    }

    /// [`EtcdClient::call`] on the calling thread as it is.
    pub fn call_blocking(&self, method: Method, body: &Value) -> Result<Answer, StateError> {
        let (request, answer) = method.messages();
        let request = proto::encode(request, body)?;
        let deadline = Instant::now() + self.timeout;
        let mut retried = false;
        let mut failures = 0usize;
        loop {
            let member = self.current.load(Ordering::Relaxed) % self.channels.len();
            let last = match self.attempt(member, method, &request) {
                Ok(bytes) => {
                    return Ok(Answer {
                        body: proto::decode(answer, &bytes)?,
                        retried,
                    });
                }
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
                    if failures.is_multiple_of(self.channels.len()) {
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

    /// Opens the stream `method` on one member with `body` and hands each message of the
    /// answer to `each`, with no deadline (a snapshot of a large keyspace takes a while);
    /// with `idle`, a read waiting longer than that fails the stream.
    pub fn stream(
        &self,
        method: Method,
        body: &Value,
        idle: Option<Duration>,
        mut each: impl FnMut(&Value) -> Result<(), StateError>,
    ) -> Result<(), StateError> {
        let (request, answer) = method.messages();
        let request = proto::encode(request, body)?;
        let member = self.current.load(Ordering::Relaxed) % self.channels.len();
        // The next stream goes to the next member (a failed one is not asked again at once).
        let rotate = || self.current.store(member + 1, Ordering::Relaxed);
        let fail = |attempt: Attempt| {
            match attempt {
                Attempt::Retry { .. } => rotate(),
                // The next stream (or call) logs in again.
                Attempt::Reauthenticate => *self.token.lock().expect("token lock") = None,
                _ => {}
            }
            attempt.into_error(&self.target)
        };
        let token = self.token(member).map_err(fail)?;
        // A watch's sending side stays open while it is followed, as etcd's own clients
        // keep it; a snapshot's ends after its one request. Either is cancelled when this
        // returns.
        let (sending, rest) = tokio::sync::mpsc::channel(1);
        let _sending = (method == Method::Watch).then_some(sending);
        let open = self.open(
            member,
            method,
            request,
            token,
            idle.unwrap_or(STREAM_OPEN_TIMEOUT),
            rest,
        );
        let mut stream = self.run(open).and_then(|opened| opened).map_err(fail)?;
        loop {
            let (back, next) = self
                .run(async move {
                    let next = match idle {
                        Some(idle) => tokio::time::timeout(idle, stream.message())
                            .await
                            .unwrap_or_else(|_| {
                                Err(Status::unavailable(format!("nothing came for {idle:?}")))
                            }),
                        None => stream.message().await,
                    };
                    (stream, next)
                })
                .map_err(fail)?;
            stream = back;
            match next {
                Ok(Some(bytes)) => each(&proto::decode(answer, &bytes)?)?,
                Ok(None) => return Ok(()),
                Err(status) => return Err(fail(sort(&status))),
            }
        }
    }

    /// One call of `method` to `member`: the answer's bytes.
    fn attempt(&self, member: usize, method: Method, request: &[u8]) -> Result<Vec<u8>, Attempt> {
        let token = self.token(member)?;
        if method.is_stream() {
            // One request, then the sending side ends: etcd answers it, then closes.
            let (_, rest) = tokio::sync::mpsc::channel(1);
            let open = self.open(member, method, request.to_vec(), token, CALL_TIMEOUT, rest);
            let mut stream = self.run(open)??;
            return self.run(within(CALL_TIMEOUT, async move {
                match stream.message().await {
                    Ok(Some(bytes)) => Ok(bytes),
                    Ok(None) => Err(Attempt::Retry {
                        reason: "the stream ended without an answer".into(),
                        maybe_applied: true,
                    }),
                    Err(status) => Err(sort(&status)),
                }
            }))?;
        }
        self.unary(member, method, self.request(request.to_vec(), token)?)
    }

    /// Calls `method`, not a stream, on `member`: the answer's bytes.
    fn unary(
        &self,
        member: usize,
        method: Method,
        request: Request<Vec<u8>>,
    ) -> Result<Vec<u8>, Attempt> {
        let mut grpc = self.grpc(member);
        self.run(within(CALL_TIMEOUT, async move {
            grpc.ready().await.map_err(not_connected)?;
            grpc.unary(request, PathAndQuery::from_static(method.path()), RawCodec)
                .await
                .map(tonic::Response::into_inner)
                .map_err(|status| sort(&status))
        }))?
    }

    /// Opens stream `method` on `member`, sending `request` and nothing after it. The
    /// sending side ends when the sender of `rest` is dropped: a stream is cancelled (etcd
    /// told, its watcher gone) once that side has ended and its answers are dropped.
    fn open(
        &self,
        member: usize,
        method: Method,
        request: Vec<u8>,
        token: Option<String>,
        limit: Duration,
        rest: tokio::sync::mpsc::Receiver<Vec<u8>>,
    ) -> impl Future<Output = Result<Streaming<Vec<u8>>, Attempt>> + Send + 'static {
        let mut grpc = self.grpc(member);
        let request = self.request(request, token).map(|request| {
            request.map(|first| {
                tokio_stream::once(first).chain(tokio_stream::wrappers::ReceiverStream::new(rest))
            })
        });
        async move {
            let request = request?;
            within(limit, async {
                grpc.ready().await.map_err(not_connected)?;
                grpc.streaming(request, PathAndQuery::from_static(method.path()), RawCodec)
                    .await
                    .map(tonic::Response::into_inner)
                    .map_err(|status| sort(&status))
            })
            .await
        }
    }

    fn grpc(&self, member: usize) -> Grpc<Channel> {
        Grpc::new(self.channels[member].clone()).max_decoding_message_size(MAX_ANSWER)
    }

    /// `body` as a request, with the login token when there is one.
    fn request(&self, body: Vec<u8>, token: Option<String>) -> Result<Request<Vec<u8>>, Attempt> {
        let mut request = Request::new(body);
        if let Some(token) = token {
            let value = token.parse().map_err(|_| {
                Attempt::Fatal("etcd login: the token is not a header value".into())
            })?;
            request.metadata_mut().insert("token", value);
        }
        Ok(request)
    }

    /// Runs `work` on the client's runtime and waits for it here.
    fn run<T: Send + 'static>(
        &self,
        work: impl Future<Output = T> + Send + 'static,
    ) -> Result<T, Attempt> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.handle.spawn(async move {
            let _ = tx.send(work.await);
        });
        rx.recv().map_err(|_| Attempt::Retry {
            reason: "the etcd client stopped".into(),
            maybe_applied: true,
        })
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
        let (request, answer) = Method::Authenticate.messages();
        let login = serde_json::json!({
            "name": user,
            "password": self.target.password.clone().unwrap_or_default(),
        });
        let login = proto::encode(request, &login).map_err(|e| Attempt::Fatal(e.to_string()))?;
        let bytes = self.unary(member, Method::Authenticate, Request::new(login))?;
        let answer = proto::decode(answer, &bytes).map_err(|e| Attempt::Fatal(e.to_string()))?;
        let token = answer
            .get("token")
            .and_then(Value::as_str)
            .ok_or_else(|| Attempt::Fatal("etcd login: no token in the answer".into()))?
            .to_string();
        *self.token.lock().expect("token lock") = Some(token.clone());
        Ok(Some(token))
    }
}

impl Drop for EtcdClient {
    fn drop(&mut self) {
        // Dropped on a runtime's thread too: its calls are abandoned, not waited for.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// Passes messages through as the bytes [`proto`] makes and reads.
#[derive(Clone, Copy)]
struct RawCodec;

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = Self;
    type Decoder = Self;

    fn encoder(&mut self) -> Self {
        Self
    }

    fn decoder(&mut self) -> Self {
        Self
    }
}

impl Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = Status;

    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        let mut bytes = vec![0; src.remaining()];
        src.copy_to_slice(&mut bytes);
        Ok(Some(bytes))
    }
}

/// `call`'s outcome, or a retry once `limit` has passed without one.
async fn within<T>(
    limit: Duration,
    call: impl Future<Output = Result<T, Attempt>>,
) -> Result<T, Attempt> {
    tokio::time::timeout(limit, call).await.unwrap_or_else(|_| {
        Err(Attempt::Retry {
            reason: format!("no answer within {limit:?}"),
            maybe_applied: true,
        })
    })
}

/// A connection that could not be made: nothing was sent.
fn not_connected(error: tonic::transport::Error) -> Attempt {
    Attempt::Retry {
        reason: error.to_string(),
        maybe_applied: false,
    }
}

/// Sorts a failed call. A status with a source came from the way to etcd (a connection
/// refused, reset or gone), not from etcd: a connection that could not be made sent
/// nothing, any other may have sent the request. A status etcd sent is sorted by its code
/// and message.
fn sort(status: &Status) -> Attempt {
    use std::error::Error;
    let Some(source) = status.source() else {
        return classify(status.code(), status.message());
    };
    let mut unconnected = false;
    let mut cause: Option<&(dyn Error + 'static)> = Some(source);
    while let Some(error) = cause {
        unconnected |= error.is::<tonic::ConnectError>();
        cause = error.source();
    }
    Attempt::Retry {
        reason: format!("{}: {source}", status.message()),
        maybe_applied: !unconnected,
    }
}

/// Sorts an etcd error (gRPC code and message) into retry, login again, or give up.
fn classify(code: tonic::Code, message: &str) -> Attempt {
    use tonic::Code;
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
    if message.contains("authentication failed") || code == Code::Unauthenticated {
        return Attempt::Fatal(format!("etcd login refused: {message}"));
    }
    if matches!(code, Code::Unavailable | Code::DeadlineExceeded)
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

fn tls_config(options: &EtcdOptions) -> Result<ClientTlsConfig, StateError> {
    let read = |path: &PathBuf| {
        std::fs::read(path).map_err(|e| StateError::Failed(format!("{}: {e}", path.display())))
    };
    let mut tls = ClientTlsConfig::new();
    match &options.ca {
        Some(ca) => {
            let pem = read(ca)?;
            if !String::from_utf8_lossy(&pem).contains("-----BEGIN CERTIFICATE-----") {
                return Err(StateError::Failed(format!(
                    "{}: no certificate in it",
                    ca.display()
                )));
            }
            tls = tls.ca_certificate(Certificate::from_pem(pem));
        }
        None => tls = tls.with_native_roots(),
    }
    if let Some((cert, key)) = &options.client_cert {
        tls = tls.identity(Identity::from_pem(read(cert)?, read(key)?));
    }
    Ok(tls)
}

/// base64 of `bytes`, as etcd's JSON form carries keys and values.
pub(super) fn b64(bytes: &[u8]) -> String {
    B64.encode(bytes)
}

pub(super) fn unb64(value: &Value) -> Result<Vec<u8>, StateError> {
    B64.decode(value.as_str().unwrap_or_default())
        .map_err(|e| StateError::Failed(format!("etcd sent bad base64: {e}")))
}

/// An int64 of etcd's JSON form (a string, a number, or absent for 0).
pub(super) fn int(value: Option<&Value>) -> u64 {
    match value {
        Some(Value::String(s)) => s.parse().unwrap_or(0),
        Some(Value::Number(n)) => n.as_u64().unwrap_or(0),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn errors_sort_into_retries_logins_and_failures() {
        assert!(matches!(
            classify(tonic::Code::Unavailable, "etcdserver: no leader"),
            Attempt::Retry { .. }
        ));
        assert!(matches!(
            classify(tonic::Code::Unknown, "etcdserver: request timed out"),
            Attempt::Retry { .. }
        ));
        assert!(matches!(
            classify(
                tonic::Code::InvalidArgument,
                "etcdserver: invalid auth token"
            ),
            Attempt::Reauthenticate
        ));
        assert!(matches!(
            classify(
                tonic::Code::InvalidArgument,
                "etcdserver: authentication failed, invalid user ID or password"
            ),
            Attempt::Fatal(_)
        ));
        assert!(matches!(
            classify(
                tonic::Code::PermissionDenied,
                "etcdserver: permission denied"
            ),
            Attempt::Fatal(_)
        ));
        assert!(matches!(
            classify(
                tonic::Code::ResourceExhausted,
                "etcdserver: mvcc: database space exceeded"
            ),
            Attempt::Full(_)
        ));
    }

    #[test]
    fn failures_on_the_way_are_retried_and_only_unmade_connections_count_as_unsent() {
        let io = |kind| Box::new(std::io::Error::new(kind, "on the way"));
        let refused = Status::from_error(Box::new(tonic::ConnectError(io(
            std::io::ErrorKind::ConnectionRefused,
        ))));
        assert!(matches!(
            sort(&refused),
            Attempt::Retry {
                maybe_applied: false,
                ..
            }
        ));
        let reset = Status::from_error(io(std::io::ErrorKind::ConnectionReset));
        assert!(matches!(
            sort(&reset),
            Attempt::Retry {
                maybe_applied: true,
                ..
            }
        ));
        // etcd's own answer, whatever its words: it may have committed.
        let lost =
            Status::unavailable("etcdserver: request timed out, possibly due to connection lost");
        assert!(matches!(
            sort(&lost),
            Attempt::Retry {
                maybe_applied: true,
                ..
            }
        ));
    }

    #[test]
    fn ints_come_as_strings_numbers_or_not_at_all() {
        assert_eq!(int(Some(&json!("42"))), 42);
        assert_eq!(int(Some(&json!(7))), 7);
        assert_eq!(int(None), 0);
    }
}
