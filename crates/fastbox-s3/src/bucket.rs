//! The bucket: checking it at open, with an error that says what is wrong, and creating it.
//!
//! [`check`] lists at most one key under the prefix (`ListObjectsV2`, `max-keys=1`): the
//! cheapest request that needs the bucket to exist, the credentials to be valid and the
//! permission to list, which the store needs anyway. Its failure is told apart by S3's error
//! code, so an operator reads *which* of these is wrong, with the endpoint and bucket named:
//!
//! | answer | error |
//! |---|---|
//! | no connection after the retries | [`BucketError::Unreachable`] |
//! | 403 `InvalidAccessKeyId`, `SignatureDoesNotMatch`, `NotSignedUp`, token errors, 401 | [`BucketError::BadCredentials`] |
//! | 403 anything else (`AccessDenied`) | [`BucketError::AccessDenied`] |
//! | 404 `NoSuchBucket` (or any 404) | [`BucketError::NoSuchBucket`] |
//! | 301 / `PermanentRedirect` / `AuthorizationHeaderMalformed` | [`BucketError::WrongRegion`] |
//! | anything else | [`BucketError::Unexpected`] |

use bytes::Bytes;

use crate::raw::{Method, RawClient, RawError, RawRequest, RawResponse, StatusCode};

/// S3 error codes that mean the credentials themselves are wrong (not their permissions).
const CREDENTIAL_CODES: &[&str] = &[
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "NotSignedUp",
    "InvalidToken",
    "ExpiredToken",
    "TokenRefreshRequired",
    "InvalidClientTokenId",
];

/// Why the bucket cannot be used, or created.
#[derive(Debug, thiserror::Error)]
pub enum BucketError {
    /// Nothing answered at the endpoint.
    #[error(
        "S3 endpoint {endpoint} is unreachable (bucket {bucket}): {source}; is the server running and the endpoint right?"
    )]
    Unreachable {
        endpoint: String,
        bucket: String,
        #[source]
        source: Box<RawError>,
    },
    /// The server rejected the credentials.
    #[error(
        "S3 endpoint {endpoint} rejected the credentials (access key id {access_key_id:?}) for bucket {bucket}: {answer}; check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
    )]
    BadCredentials {
        endpoint: String,
        bucket: String,
        access_key_id: String,
        answer: String,
    },
    /// The credentials are valid but may not list the bucket.
    #[error(
        "S3 endpoint {endpoint}: the credentials (access key id {access_key_id:?}) may not list bucket {bucket}: {answer}"
    )]
    AccessDenied {
        endpoint: String,
        bucket: String,
        access_key_id: String,
        answer: String,
    },
    /// The bucket does not exist.
    #[error("S3 bucket {bucket} does not exist at {endpoint}: {answer}; create it first")]
    NoSuchBucket {
        endpoint: String,
        bucket: String,
        answer: String,
    },
    /// The bucket lives in another region than the one configured.
    #[error("S3 bucket {bucket} at {endpoint} is not in region {region}: {answer}")]
    WrongRegion {
        endpoint: String,
        bucket: String,
        region: String,
        answer: String,
    },
    /// Some other answer.
    #[error("S3 endpoint {endpoint}, bucket {bucket}: {operation} failed: {answer}")]
    Unexpected {
        endpoint: String,
        bucket: String,
        operation: &'static str,
        answer: String,
    },
}

/// Who is asking, for messages.
#[derive(Debug, Clone)]
pub struct Target {
    /// The endpoint URL.
    pub endpoint: String,
    /// The bucket.
    pub bucket: String,
    /// The region.
    pub region: String,
    /// The access key id (not secret; helps to tell which credentials were used).
    pub access_key_id: String,
}

/// Check that the bucket exists and the credentials may list `prefix` in it. See the module
/// docs for the errors.
pub async fn check(raw: &RawClient, target: &Target, prefix: &str) -> Result<(), BucketError> {
    let list_prefix = if prefix.is_empty() {
        String::new()
    } else {
        format!("{prefix}/")
    };
    let request = RawRequest::new(Method::GET, None)
        .query("list-type", "2")
        .query("max-keys", "1")
        .query("prefix", &list_prefix);
    let response = send(raw, target, &request).await?;
    if response.status.is_success() {
        return Ok(());
    }
    Err(classify(target, "list", &response))
}

/// Create the bucket; an existing bucket that these credentials can list is fine (S3 says
/// `BucketAlreadyOwnedByYou`; single-user servers such as s3s-fs say `BucketAlreadyExists`).
pub async fn create(raw: &RawClient, target: &Target) -> Result<(), BucketError> {
    let mut request = RawRequest::new(Method::PUT, None);
    if target.region != crate::config::DEFAULT_REGION {
        request = request.body(Bytes::from(format!(
            "<CreateBucketConfiguration><LocationConstraint>{}</LocationConstraint></CreateBucketConfiguration>",
            crate::raw::xml_escape(&target.region)
        )));
    }
    let response = send(raw, target, &request).await?;
    match response.error_code().as_deref() {
        _ if response.status.is_success() => Ok(()),
        Some("BucketAlreadyOwnedByYou") => Ok(()),
        Some("BucketAlreadyExists") => check(raw, target, "").await,
        _ => Err(classify(target, "create bucket", &response)),
    }
}

async fn send(
    raw: &RawClient,
    target: &Target,
    request: &RawRequest,
) -> Result<RawResponse, BucketError> {
    raw.send(request)
        .await
        .map_err(|source| BucketError::Unreachable {
            endpoint: target.endpoint.clone(),
            bucket: target.bucket.clone(),
            source: Box::new(source),
        })
}

/// The error an unsuccessful bucket answer means.
fn classify(target: &Target, operation: &'static str, response: &RawResponse) -> BucketError {
    let endpoint = target.endpoint.clone();
    let bucket = target.bucket.clone();
    let access_key_id = target.access_key_id.clone();
    let answer = response.describe();
    let code = response.error_code().unwrap_or_default();
    match response.status {
        StatusCode::UNAUTHORIZED => BucketError::BadCredentials {
            endpoint,
            bucket,
            access_key_id,
            answer,
        },
        StatusCode::FORBIDDEN if CREDENTIAL_CODES.contains(&code.as_str()) => {
            BucketError::BadCredentials {
                endpoint,
                bucket,
                access_key_id,
                answer,
            }
        }
        StatusCode::FORBIDDEN => BucketError::AccessDenied {
            endpoint,
            bucket,
            access_key_id,
            answer,
        },
        StatusCode::NOT_FOUND => BucketError::NoSuchBucket {
            endpoint,
            bucket,
            answer,
        },
        _ if response.status == StatusCode::MOVED_PERMANENTLY
            || code == "PermanentRedirect"
            || code == "AuthorizationHeaderMalformed" =>
        {
            BucketError::WrongRegion {
                endpoint,
                bucket,
                region: target.region.clone(),
                answer,
            }
        }
        _ => BucketError::Unexpected {
            endpoint,
            bucket,
            operation,
            answer,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: StatusCode, code: &str) -> RawResponse {
        RawResponse {
            status,
            body: Bytes::from(format!("<Error><Code>{code}</Code></Error>")),
        }
    }

    #[test]
    fn error_codes_pick_the_error() {
        let target = Target {
            endpoint: "http://127.0.0.1:9".into(),
            bucket: "bkt".into(),
            region: "us-east-1".into(),
            access_key_id: "AK".into(),
        };
        let kind = |status, code| match classify(&target, "list", &answer(status, code)) {
            BucketError::BadCredentials { .. } => "credentials",
            BucketError::AccessDenied { .. } => "denied",
            BucketError::NoSuchBucket { .. } => "bucket",
            BucketError::WrongRegion { .. } => "region",
            BucketError::Unexpected { .. } => "unexpected",
            BucketError::Unreachable { .. } => "unreachable",
        };
        assert_eq!(
            kind(StatusCode::FORBIDDEN, "SignatureDoesNotMatch"),
            "credentials"
        );
        assert_eq!(
            kind(StatusCode::FORBIDDEN, "InvalidAccessKeyId"),
            "credentials"
        );
        assert_eq!(kind(StatusCode::FORBIDDEN, "AccessDenied"), "denied");
        assert_eq!(kind(StatusCode::NOT_FOUND, "NoSuchBucket"), "bucket");
        assert_eq!(
            kind(StatusCode::MOVED_PERMANENTLY, "PermanentRedirect"),
            "region"
        );
        assert_eq!(
            kind(StatusCode::BAD_REQUEST, "AuthorizationHeaderMalformed"),
            "region"
        );
        assert_eq!(
            kind(StatusCode::BAD_REQUEST, "InvalidArgument"),
            "unexpected"
        );

        let message = classify(
            &target,
            "list",
            &answer(StatusCode::NOT_FOUND, "NoSuchBucket"),
        )
        .to_string();
        assert!(
            message.contains("bkt") && message.contains("http://127.0.0.1:9"),
            "{message}"
        );
    }
}
