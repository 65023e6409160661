//! Opening a store: configuration from a URL and the environment, and the three errors an
//! operator must be able to tell apart (unreachable endpoint, bad credentials, no bucket).

mod common;

use std::net::TcpListener;
use std::time::Duration;

use fastbox_artifact::{ArtifactStore, Digest, Stored};
use fastbox_s3::{BucketError, OpenError, Retries, S3Config, S3Store};
use fastbox_testkit::s3::{S3Server, S3ServerKind};

/// A loopback port nothing listens on.
fn dead_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn an_unreachable_endpoint_is_named() {
    let mut config = S3Config::new("some-bucket");
    let endpoint = format!("http://127.0.0.1:{}", dead_port());
    config.endpoint = Some(endpoint.clone());
    config.allow_http = true;
    config.access_key_id = Some("id".into());
    config.secret_access_key = Some("secret".into());
    config.retries = Retries {
        max_retries: 1,
        initial_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(10),
        retry_timeout: Duration::from_secs(5),
    };
    let error = S3Store::open(config).unwrap_err();
    assert!(
        matches!(error, OpenError::Bucket(BucketError::Unreachable { .. })),
        "{error:?}"
    );
    let message = error.to_string();
    eprintln!("{message}");
    assert!(
        message.contains(&endpoint)
            && message.contains("some-bucket")
            && message.contains("unreachable"),
        "{message}"
    );
}

#[test]
fn bad_credentials_are_named() {
    // moto accepts any credentials; s3s-fs checks SigV4 signatures.
    let Some(env) = common::env(S3ServerKind::S3sFs) else {
        return;
    };
    let mut config = env.config.clone();
    config.secret_access_key = Some("wrong-secret".into());
    let error = S3Store::open(config).unwrap_err();
    assert!(
        matches!(error, OpenError::Bucket(BucketError::BadCredentials { .. })),
        "{error:?}"
    );
    let message = error.to_string();
    eprintln!("{message}");
    assert!(
        message.contains(&env.server.endpoint())
            && message.contains(env.server.bucket())
            && message.contains("rejected the credentials")
            && message.contains(env.server.access_key())
            && !message.contains("wrong-secret"),
        "{message}"
    );

    let mut unknown = env.config.clone();
    unknown.access_key_id = Some("nobody".into());
    let error = S3Store::open(unknown).unwrap_err();
    assert!(
        matches!(error, OpenError::Bucket(BucketError::BadCredentials { .. })),
        "{error:?}"
    );
}

fn a_missing_bucket_is_named(kind: S3ServerKind) {
    if let Some(reason) = kind.unavailable() {
        eprintln!("skipped: {reason}");
        return;
    }
    let server = S3Server::start(kind).unwrap();
    let config = common::config(&server); // its bucket is never created
    let error = S3Store::open(config).unwrap_err();
    assert!(
        matches!(error, OpenError::Bucket(BucketError::NoSuchBucket { .. })),
        "{error:?}"
    );
    let message = error.to_string();
    eprintln!("{message}");
    assert!(
        message.contains(&server.endpoint())
            && message.contains(server.bucket())
            && message.contains("does not exist"),
        "{message}"
    );
}

#[test]
fn a_missing_bucket_is_named_by_s3s_fs() {
    a_missing_bucket_is_named(S3ServerKind::S3sFs);
}

#[test]
fn a_missing_bucket_is_named_by_moto() {
    a_missing_bucket_is_named(S3ServerKind::Moto);
}

#[test]
fn creating_an_existing_bucket_is_fine() {
    let Some(env) = common::env(S3ServerKind::S3sFs) else {
        return;
    };
    fastbox_s3::create_bucket(&env.config).unwrap();
    S3Store::open(env.config.clone()).unwrap();
}

#[test]
fn a_store_opens_from_a_url_and_the_environment() {
    let Some(env) = common::env(S3ServerKind::S3sFs) else {
        return;
    };
    let url = format!(
        "s3://{}/from/url?endpoint={}&region=us-east-1&conditional_writes=auto",
        env.server.bucket(),
        env.server.endpoint()
    );
    let (id, secret) = (
        env.server.access_key().to_string(),
        env.server.secret_key().to_string(),
    );
    let config = S3Config::from_url(&url)
        .unwrap()
        .with_env(|name| match name {
            "AWS_ACCESS_KEY_ID" => Some(id.clone()),
            "AWS_SECRET_ACCESS_KEY" => Some(secret.clone()),
            _ => None,
        });
    let store = S3Store::open(config).unwrap();
    let bytes = b"through the url";
    assert_eq!(
        store.put_block(&Digest::of(bytes), bytes).unwrap(),
        Stored::Added
    );
    assert!(
        store
            .layout()
            .block(&Digest::of(bytes))
            .starts_with("from/url/blocks/")
    );

    // Without credentials the configuration is refused before any request.
    let error = S3Store::open(S3Config::from_url(&url).unwrap().with_env(|_| None)).unwrap_err();
    assert!(matches!(error, OpenError::Config(_)), "{error:?}");
    assert!(error.to_string().contains("AWS_ACCESS_KEY_ID"), "{error}");
}
