//! The `POST /files/upload` body for one file (compat §4.4): a `metadata` part (JSON path,
//! owner, group, mode) then the `file` part, streamed from a reader so large files and stdin
//! are never held in memory.

use std::io::{Chain, Cursor, Read};

/// The head (boundary, metadata part, file part headers), the content, the closing boundary.
pub type FormReader<R> = Chain<Chain<Cursor<Vec<u8>>, R>, Cursor<Vec<u8>>>;

/// A multipart body ready to send.
pub struct UploadForm<R> {
    /// `multipart/form-data; boundary=...`.
    pub content_type: String,
    pub reader: FormReader<R>,
    /// The whole body's length, when the content's is known.
    pub len: Option<u64>,
}

/// The form that writes `content` to `path` with permission bits `mode`.
pub fn single_file<R: Read>(path: &str, mode: u32, content: R, len: Option<u64>) -> UploadForm<R> {
    let boundary = format!("fastbox-{:032x}", rand::random::<u128>());
    let metadata = serde_json::json!({
        "path": path,
        "owner": null,
        "group": null,
        "mode": mode_digits(mode),
    });
    let head = format!(
        "--{boundary}\r\n\
         Content-Disposition: form-data; name=\"metadata\"; filename=\"metadata\"\r\n\
         Content-Type: application/json\r\n\r\n\
         {metadata}\r\n\
         --{boundary}\r\n\
         Content-Disposition: form-data; name=\"file\"; filename=\"file\"\r\n\
         Content-Type: application/octet-stream\r\n\r\n"
    )
    .into_bytes();
    let tail = format!("\r\n--{boundary}--\r\n").into_bytes();
    let len = len.map(|n| head.len() as u64 + n + tail.len() as u64);
    UploadForm {
        content_type: format!("multipart/form-data; boundary={boundary}"),
        reader: Cursor::new(head).chain(content).chain(Cursor::new(tail)),
        len,
    }
}

/// The API's `mode`: the decimal number whose digits are the octal permission bits
/// (`0o755` is `755`).
pub fn mode_digits(mode: u32) -> u32 {
    format!("{:o}", mode & 0o7777)
        .parse()
        .expect("octal digits are decimal digits")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_are_octal_digits() {
        assert_eq!(mode_digits(0o755), 755);
        assert_eq!(mode_digits(0o100644), 644);
        assert_eq!(mode_digits(0o4755), 4755);
    }

    #[test]
    fn the_body_is_a_metadata_part_then_the_file_part() {
        let form = single_file("/tmp/a b.txt", 0o600, &b"hello"[..], Some(5));
        let boundary = form
            .content_type
            .strip_prefix("multipart/form-data; boundary=")
            .unwrap()
            .to_string();
        let expected_len = form.len.unwrap();
        let mut body = String::new();
        let mut reader = form.reader;
        reader.read_to_string(&mut body).unwrap();
        assert_eq!(body.len() as u64, expected_len);
        let parts: Vec<&str> = body.split(&format!("--{boundary}")).collect();
        assert_eq!(parts.len(), 4, "{body}");
        assert!(parts[1].contains("name=\"metadata\"; filename=\"metadata\""));
        let json = parts[1].split("\r\n\r\n").nth(1).unwrap().trim_end();
        let metadata: serde_json::Value = serde_json::from_str(json).unwrap();
        assert_eq!(
            metadata,
            serde_json::json!({"path": "/tmp/a b.txt", "owner": null, "group": null, "mode": 600})
        );
        assert!(parts[2].contains("name=\"file\""));
        assert!(parts[2].ends_with("\r\n\r\nhello\r\n"));
        assert_eq!(parts[3], "--\r\n");
    }
}
