//! Multipart uploads of objects above the threshold (in practice: large manifests; blocks are
//! at most 4 MiB).
//!
//! The upload is started and its parts sent through object_store (`part_size` bytes each,
//! the last one shorter; S3 wants at least 5 MiB for every part but the last). The
//! completing request is ours ([`RawClient`](crate::raw::RawClient)), because object_store
//! cannot make it conditional: with `If-None-Match: *` the object appears only if the key is
//! free, so a multipart put is create-if-absent like a single one (`412`: another writer
//! was first). An upload that does not complete is aborted, best effort; S3 keeps the parts
//! of an upload that a crash interrupted until a lifecycle rule removes them.

use bytes::Bytes;
use object_store::MultipartId;
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path;

use crate::client::{Client, ClientError, path};
use crate::put::Written;
use crate::raw::{Method, RawRequest, StatusCode, xml_escape};

impl Client {
    /// Write `bytes` under `key` in parts. See the module docs.
    pub async fn write_multipart(
        &self,
        key: &str,
        bytes: Bytes,
        if_absent: bool,
    ) -> Result<Written, ClientError> {
        let location = path(key)?;
        let id = self.s3.create_multipart(&location).await?;
        let result = self
            .send_parts_and_complete(key, &location, &id, bytes, if_absent)
            .await;
        if !matches!(result, Ok(Written::Created))
            && let Err(error) = self.s3.abort_multipart(&location, &id).await
        {
            tracing::debug!(key, %error, "could not abort a multipart upload");
        }
        result
    }

    async fn send_parts_and_complete(
        &self,
        key: &str,
        location: &Path,
        id: &MultipartId,
        bytes: Bytes,
        if_absent: bool,
    ) -> Result<Written, ClientError> {
        let mut parts = Vec::new();
        for (index, range) in part_ranges(bytes.len(), self.multipart.part_size).enumerate() {
            let part = bytes.slice(range);
            parts.push(self.s3.put_part(location, id, index, part.into()).await?);
        }
        let mut request = RawRequest::new(Method::POST, Some(key))
            .query("uploadId", id)
            .body(completion_body(&parts));
        if if_absent {
            request = request.header("if-none-match", "*");
        }
        let response = self.raw.send(&request).await?;
        // S3 may answer 200 and report a failure in the body.
        if response.status.is_success() && response.error_code().is_none() {
            Ok(Written::Created)
        } else if response.status == StatusCode::PRECONDITION_FAILED {
            Ok(Written::Exists)
        } else {
            Err(ClientError::Answer {
                operation: "complete a multipart upload",
                answer: response.describe(),
            })
        }
    }
}

/// The byte ranges of the parts of an object of `len` bytes.
fn part_ranges(len: usize, part_size: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..len)
        .step_by(part_size.max(1))
        .map(move |start| start..(start + part_size).min(len))
}

/// `CompleteMultipartUpload`'s body: the parts in order (part numbers start at 1).
fn completion_body(parts: &[PartId]) -> String {
    let mut body = String::from("<CompleteMultipartUpload>");
    for (index, part) in parts.iter().enumerate() {
        body.push_str(&format!(
            "<Part><PartNumber>{}</PartNumber><ETag>{}</ETag></Part>",
            index + 1,
            xml_escape(&part.content_id)
        ));
    }
    body.push_str("</CompleteMultipartUpload>");
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_the_object_in_order() {
        let ranges: Vec<_> = part_ranges(12, 5).collect();
        assert_eq!(ranges, vec![0..5, 5..10, 10..12]);
        assert_eq!(part_ranges(10, 5).count(), 2);
        assert_eq!(part_ranges(0, 5).count(), 0);
    }

    #[test]
    fn the_completion_lists_parts_from_one() {
        let parts = [
            PartId {
                content_id: "\"a\"".into(),
            },
            PartId {
                content_id: "\"b\"".into(),
            },
        ];
        assert_eq!(
            completion_body(&parts),
            "<CompleteMultipartUpload><Part><PartNumber>1</PartNumber><ETag>&quot;a&quot;</ETag></Part>\
             <Part><PartNumber>2</PartNumber><ETag>&quot;b&quot;</ETag></Part></CompleteMultipartUpload>"
        );
    }
}
