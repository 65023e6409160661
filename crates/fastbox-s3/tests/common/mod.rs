//! Helpers of the S3 store tests: a running server with a bucket, store configurations,
//! direct object access (to damage objects behind the store's back), trees to publish.
//!
//! Every test that needs a server takes the server kind and starts with
//! `let Some(env) = common::env(kind) else { return };`, which prints `skipped: <reason>`
//! when the server is not installed. `for_each_server!` turns such functions into one test
//! per server.

#![allow(dead_code)]

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use fastbox_artifact::{ArtifactKind, Digest, HostFacts, ManifestMeta};
use fastbox_s3::{ConditionalWrites, Retries, S3Config, S3Store};
use fastbox_testkit::s3::{S3Server, S3ServerKind};
use object_store::ObjectStoreExt;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjectPath;

/// One test function per server kind: `for_each_server!(a, b)` makes `s3s_fs::a`,
/// `moto::a`, ... calling `a(kind)`.
#[macro_export]
macro_rules! for_each_server {
    ($($name:ident),* $(,)?) => {
        mod s3s_fs {
            $( #[test] fn $name() { super::$name(fastbox_testkit::s3::S3ServerKind::S3sFs) } )*
        }
        mod moto {
            $( #[test] fn $name() { super::$name(fastbox_testkit::s3::S3ServerKind::Moto) } )*
        }
    };
}

/// Whether the server checks `If-None-Match: *` atomically with a single PUT, so that exactly
/// one of several concurrent conditional creators succeeds. Neither test server promises it
/// (AWS S3 does): s3s-fs 0.14.1 checks that the object's file exists, then writes a temporary
/// file and renames it over the object (`put_object` in its `s3.rs`), and concurrent
/// conditional PUTs all succeed; moto 5.2.5 looks the key up and then stores it
/// (`responses.py`), but with no I/O in between its single PUTs behave atomically under the
/// GIL (its multipart completions do not). Race tests assert "exactly one" where this is true,
/// and otherwise the guarantees the store keeps without an atomic condition.
pub fn atomic_conditional_put(kind: S3ServerKind) -> bool {
    kind == S3ServerKind::Moto
}

/// A running server with a created bucket, and a store configuration for it.
pub struct Env {
    pub server: S3Server,
    pub config: S3Config,
}

impl Env {
    /// Open a store on the bucket (the probe decides conditional writes).
    pub fn store(&self) -> S3Store {
        S3Store::open(self.config.clone()).expect("open the S3 store")
    }

    /// Open a store with `conditional_writes` forced.
    pub fn store_with(&self, conditional: ConditionalWrites) -> S3Store {
        let mut config = self.config.clone();
        config.conditional_writes = conditional;
        S3Store::open(config).expect("open the S3 store")
    }

    /// Direct access to the bucket, past the store.
    pub fn objects(&self) -> Objects {
        Objects::new(&self.config)
    }
}

/// Start a server of `kind`, create a bucket, and configure a store under a random prefix;
/// None (after printing `skipped: ...`) when the server is not installed.
pub fn env(kind: S3ServerKind) -> Option<Env> {
    if let Some(reason) = kind.unavailable() {
        eprintln!("skipped: {reason}");
        return None;
    }
    let server = S3Server::start(kind).expect("start the S3 test server");
    let config = config(&server);
    fastbox_s3::create_bucket(&config).expect("create the bucket");
    Some(Env { server, config })
}

/// A configuration for `server`'s bucket under a fresh prefix, with short retries.
pub fn config(server: &S3Server) -> S3Config {
    let mut config = S3Config::new(server.bucket());
    config.endpoint = Some(server.endpoint());
    config.allow_http = true;
    config.prefix = format!("fastbox/{:08x}", rand::random::<u32>());
    config.access_key_id = Some(server.access_key().to_string());
    config.secret_access_key = Some(server.secret_key().to_string());
    config.region = Some(server.region().to_string());
    config.retries = Retries {
        max_retries: 2,
        initial_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(200),
        retry_timeout: Duration::from_secs(10),
    };
    config
}

/// Raw object access with object_store, on a runtime of its own.
pub struct Objects {
    s3: AmazonS3,
    runtime: tokio::runtime::Runtime,
}

impl Objects {
    fn new(config: &S3Config) -> Self {
        let s3 = AmazonS3Builder::new()
            .with_endpoint(config.endpoint.clone().unwrap())
            .with_bucket_name(&config.bucket)
            .with_region(config.region())
            .with_access_key_id(config.access_key_id.clone().unwrap())
            .with_secret_access_key(config.secret_access_key.clone().unwrap())
            .with_allow_http(true)
            .build()
            .unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        Objects { s3, runtime }
    }

    /// Write `bytes` under `key`, unconditionally.
    pub fn put(&self, key: &str, bytes: &[u8]) {
        let path = ObjectPath::parse(key).unwrap();
        self.runtime
            .block_on(self.s3.put(&path, bytes.to_vec().into()))
            .unwrap();
    }

    /// An object's ETag and modification time.
    pub fn head(&self, key: &str) -> object_store::ObjectMeta {
        let path = ObjectPath::parse(key).unwrap();
        self.runtime.block_on(self.s3.head(&path)).unwrap()
    }
}

/// `len` pseudo-random bytes determined by `seed`.
pub fn bytes(seed: &str, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    blake3::Hasher::new()
        .update(seed.as_bytes())
        .finalize_xof()
        .fill(&mut out);
    out
}

/// A block and its digest.
pub fn block(seed: &str, len: usize) -> (Digest, Vec<u8>) {
    let bytes = bytes(seed, len);
    (Digest::of(&bytes), bytes)
}

/// Fixed manifest metadata (identical trees give identical manifests).
pub fn meta() -> ManifestMeta {
    let mut meta = ManifestMeta::new(
        ArtifactKind::Template,
        Digest::of(b"execd"),
        HostFacts {
            kernel: "6.1.0-test".into(),
            criu_version: Some("4.2.1".into()),
            arch: "x86_64".into(),
            cpu_features: vec!["sse2".into()],
        },
    );
    meta.created_at = chrono::DateTime::from_timestamp(1_700_000_000, 0).unwrap();
    meta
}

/// A small tree: a directory, a file of two and a half blocks (`seed` decides its bytes), a
/// small file, an empty file and a symlink.
pub fn tree(root: &Path, seed: &str) {
    fs::create_dir_all(root.join("checkpoint")).unwrap();
    let big = bytes(seed, 2 * fastbox_artifact::BLOCK_SIZE + 1234);
    fs::write(root.join("checkpoint/pages-1.img"), big).unwrap();
    fs::write(
        root.join("checkpoint/small.img"),
        bytes(&format!("{seed}-small"), 100),
    )
    .unwrap();
    fs::write(root.join("empty"), b"").unwrap();
    fs::set_permissions(root.join("empty"), fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::symlink("checkpoint", root.join("current")).unwrap();
}

/// Every file of a tree with its bytes (or link target), sorted, for comparison.
pub fn contents(root: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    collect(root, root, &mut out);
    out.sort();
    out
}

fn collect(root: &Path, dir: &Path, out: &mut Vec<(String, Vec<u8>)>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let meta = fs::symlink_metadata(&path).unwrap();
        if meta.file_type().is_symlink() {
            out.push((
                name,
                fs::read_link(&path)
                    .unwrap()
                    .into_os_string()
                    .into_encoded_bytes(),
            ));
        } else if meta.is_dir() {
            out.push((name, b"<dir>".to_vec()));
            collect(root, &path, out);
        } else {
            out.push((name, fs::read(&path).unwrap()));
        }
    }
}
