//! In-crate tests against the real test servers, for paths the public API cannot reach on
//! purpose (the conditional completion of a multipart upload over an existing object).

use bytes::Bytes;
use fastbox_testkit::s3::{S3Server, S3ServerKind};

use crate::config::{MIN_PART_SIZE, S3Config};
use crate::put::Written;
use crate::store::{S3Store, create_bucket};

/// A server of `kind` with a bucket and a store whose multipart threshold is the minimum
/// part size; None (printing why) when the server is not installed.
fn store(kind: S3ServerKind) -> Option<(S3Server, S3Store)> {
    if let Some(reason) = kind.unavailable() {
        eprintln!("skipped: {reason}");
        return None;
    }
    let server = S3Server::start(kind).expect("start the S3 test server");
    let mut config = S3Config::new(server.bucket());
    config.endpoint = Some(server.endpoint());
    config.allow_http = true;
    config.access_key_id = Some(server.access_key().to_string());
    config.secret_access_key = Some(server.secret_key().to_string());
    config.multipart.threshold = MIN_PART_SIZE;
    config.multipart.part_size = MIN_PART_SIZE;
    create_bucket(&config).expect("create the bucket");
    let store = S3Store::open(config).expect("open the store");
    Some((server, store))
}

fn conditional_multipart_completion_refuses_an_existing_object(kind: S3ServerKind) {
    let Some((_server, store)) = store(kind) else {
        return;
    };
    let client = store.client();
    let big = Bytes::from(vec![7u8; 2 * MIN_PART_SIZE + 10]);
    let other = Bytes::from(vec![8u8; 2 * MIN_PART_SIZE + 10]);
    let key = client.layout.tmp("multipart");
    let run = |bytes: Bytes, if_absent: bool| {
        let (client, key) = (client.clone(), key.clone());
        store
            .bridge()
            .run(async move { client.write(&key, bytes, if_absent).await })
            .unwrap()
            .unwrap()
    };
    assert_eq!(run(big.clone(), true), Written::Created);
    assert_eq!(
        run(other.clone(), true),
        Written::Exists,
        "If-None-Match on completion"
    );
    let read = {
        let (client, key) = (client.clone(), key.clone());
        store
            .bridge()
            .run(async move { client.get(&key).await })
            .unwrap()
            .unwrap()
    };
    assert!(read == Some(big), "the refused upload changed nothing");
    assert_eq!(
        run(other.clone(), false),
        Written::Created,
        "a plain completion overwrites"
    );
}

#[test]
fn conditional_multipart_completion_on_s3s_fs() {
    conditional_multipart_completion_refuses_an_existing_object(S3ServerKind::S3sFs);
}

#[test]
fn conditional_multipart_completion_on_moto() {
    conditional_multipart_completion_refuses_an_existing_object(S3ServerKind::Moto);
}
