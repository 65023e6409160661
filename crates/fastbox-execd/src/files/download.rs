//! `GET /files/download`: whole files, one byte range (206, or 416 when unsatisfiable), or a
//! window of lines (`offset` is 1-based, `limit` a count) as text.

use std::io::{BufRead, BufReader, SeekFrom};
use std::path::PathBuf;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio_util::io::ReaderStream;

use super::FilesError;
use super::fsid::{self, FsIdentity};
use super::ops::io_error;

/// Line window requested with `offset` and `limit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LineWindow {
    pub offset: u64,
    pub limit: u64,
}

pub async fn download(
    path: PathBuf,
    lines: Option<LineWindow>,
    headers: &HeaderMap,
    who: Option<FsIdentity>,
) -> Result<Response, FilesError> {
    let open_path = path.clone();
    let (file, size) = fsid::run(who, move || {
        let file = std::fs::File::open(&open_path).map_err(io_error(&open_path))?;
        let meta = file.metadata().map_err(io_error(&open_path))?;
        if meta.is_dir() {
            return Err(FilesError::Invalid(format!(
                "path is a directory: {}",
                open_path.display()
            )));
        }
        Ok((file, meta.len()))
    })
    .await?;

    if let Some(window) = lines {
        let text = tokio::task::spawn_blocking(move || read_lines(file, window))
            .await
            .map_err(|e| FilesError::Internal(e.to_string()))?
            .map_err(io_error(&path))?;
        return Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response());
    }

    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut file = tokio::fs::File::from_std(file);
    let range = headers.get(header::RANGE).and_then(|v| v.to_str().ok());
    let (status, start, len) = match range {
        None => (StatusCode::OK, 0, size),
        Some(spec) => match parse_range(spec, size) {
            Some((start, len)) => (StatusCode::PARTIAL_CONTENT, start, len),
            None => return Err(FilesError::RangeNotSatisfiable { size }),
        },
    };
    file.seek(SeekFrom::Start(start))
        .await
        .map_err(io_error(&path))?;
    let body = Body::from_stream(ReaderStream::new(file.take(len)));
    let mut resp = (status, body).into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    if let Ok(v) = HeaderValue::from_str(&content_disposition(&name)) {
        h.insert(header::CONTENT_DISPOSITION, v);
    }
    if status == StatusCode::PARTIAL_CONTENT
        && let Ok(v) =
            HeaderValue::from_str(&format!("bytes {}-{}/{}", start, start + len - 1, size))
    {
        h.insert(header::CONTENT_RANGE, v);
    }
    Ok(resp)
}

/// The most bytes a line window answers: a larger one is refused (read the file by byte
/// ranges instead), so no file makes execd hold more than this.
pub const MAX_LINE_WINDOW_BYTES: u64 = 64 << 20;

/// Lines `offset..offset + limit` (1-based) joined by `\n`, as the reference execd answers:
/// each line without its end (`\n`, or `\r\n`), so the last one has none. Lines before the
/// window are skipped without being held; more than [`MAX_LINE_WINDOW_BYTES`] is an error.
fn read_lines(file: std::fs::File, w: LineWindow) -> std::io::Result<String> {
    let mut out = Vec::new();
    let mut reader = BufReader::new(file);
    let mut line = Vec::new();
    let mut number = 0u64;
    let mut taken = 0u64;
    while taken < w.limit {
        line.clear();
        if number + 1 < w.offset {
            if reader.skip_until(b'\n')? == 0 {
                break;
            }
            number += 1;
            continue;
        }
        // A line's end (`\r\n`) and one byte more: a line past the cap is seen as one.
        let room = MAX_LINE_WINDOW_BYTES.saturating_sub(out.len() as u64) + 3;
        if std::io::Read::take(&mut reader, room).read_until(b'\n', &mut line)? == 0 {
            break;
        }
        let text_len =
            line.len() - usize::from(line.ends_with(b"\n")) - usize::from(line.ends_with(b"\r\n"));
        if out.len() as u64 + text_len as u64 > MAX_LINE_WINDOW_BYTES {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "the lines asked for hold more than {} MiB: read the file by byte ranges",
                    MAX_LINE_WINDOW_BYTES >> 20
                ),
            ));
        }
        number += 1;
        if number >= w.offset {
            let text = line.strip_suffix(b"\n").unwrap_or(&line);
            let text = text.strip_suffix(b"\r").unwrap_or(text);
            if taken > 0 {
                out.push(b'\n');
            }
            out.extend_from_slice(text);
            taken += 1;
        }
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// The first range of a `Range: bytes=...` header as `(start, length)`; `None` when it is
/// malformed or cannot be satisfied (both answered with 416, as the reference execd does).
pub fn parse_range(spec: &str, size: u64) -> Option<(u64, u64)> {
    let first = spec.strip_prefix("bytes=")?.split(',').next()?.trim();
    let (a, b) = first.split_once('-')?;
    let (a, b) = (a.trim(), b.trim());
    let (start, end) = if a.is_empty() {
        let n: u64 = b.parse().ok()?;
        if n == 0 {
            return None;
        }
        (size.saturating_sub(n), size.checked_sub(1)?)
    } else {
        let start: u64 = a.parse().ok()?;
        let end = if b.is_empty() {
            size.checked_sub(1)?
        } else {
            b.parse::<u64>().ok()?.min(size.checked_sub(1)?)
        };
        (start, end)
    };
    (start < size && start <= end).then(|| (start, end - start + 1))
}

/// RFC 6266 attachment header, with an RFC 5987 form for non-ASCII names.
fn content_disposition(name: &str) -> String {
    if name.is_ascii() && !name.contains(['"', '\\']) {
        format!("attachment; filename=\"{name}\"")
    } else {
        let encoded: String = name
            .bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                    (b as char).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect();
        format!("attachment; filename=\"{encoded}\"; filename*=UTF-8''{encoded}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_windows_join_their_lines_without_a_last_line_end() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, "one\r\ntwo\nthree\n\nfive").unwrap();
        let window = |offset, limit| {
            read_lines(
                std::fs::File::open(&path).unwrap(),
                LineWindow { offset, limit },
            )
            .unwrap()
        };
        assert_eq!(window(1, 2), "one\ntwo");
        assert_eq!(window(3, 2), "three\n");
        assert_eq!(window(4, 9), "\nfive");
        assert_eq!(window(9, 9), "");
        assert_eq!(window(2, 0), "");
    }

    #[test]
    fn a_line_window_holds_at_most_its_cap() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        // A first line larger than the cap, then a short one: skipping it holds nothing.
        let mut big = vec![b'x'; (MAX_LINE_WINDOW_BYTES + 10) as usize];
        big.extend_from_slice(b"\nshort\n");
        std::fs::write(&path, &big).unwrap();
        let window = |offset, limit| {
            read_lines(
                std::fs::File::open(&path).unwrap(),
                LineWindow { offset, limit },
            )
        };
        assert_eq!(window(2, 1).unwrap(), "short");
        let refused = window(1, 1).expect_err("a window above the cap");
        assert!(refused.to_string().contains("byte ranges"), "{refused}");
    }

    #[test]
    fn ranges() {
        assert_eq!(parse_range("bytes=0-3", 10), Some((0, 4)));
        assert_eq!(parse_range("bytes=5-", 10), Some((5, 5)));
        assert_eq!(parse_range("bytes=-3", 10), Some((7, 3)));
        assert_eq!(parse_range("bytes=8-100", 10), Some((8, 2)));
        assert_eq!(parse_range("bytes=10-12", 10), None);
        assert_eq!(parse_range("bytes=4-2", 10), None);
        assert_eq!(parse_range("items=0-1", 10), None);
        assert_eq!(parse_range("bytes=0-0", 0), None);
        assert_eq!(parse_range("bytes=0-1,4-5", 10), Some((0, 2)));
    }

    #[test]
    fn disposition_encodes_non_ascii() {
        assert_eq!(
            content_disposition("a.txt"),
            "attachment; filename=\"a.txt\""
        );
        assert!(content_disposition("é.txt").contains("filename*=UTF-8''%C3%A9.txt"));
    }
}
