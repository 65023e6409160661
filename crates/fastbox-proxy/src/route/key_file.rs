//! The route signing key on disk: created once, reused by every later start.
//!
//! The file holds one line, `{key_id}:{hex secret}`. On first use a 32-byte secret comes from
//! getrandom(2) with key id `a`. The file is written to a temporary sibling (mode 0600,
//! fsynced) and then hard-linked into place: the link is atomic, so no reader ever sees a
//! partial key, and unlike a rename it never replaces a key another process created at the
//! same moment (that process's key wins and is loaded). A file that exists but is unusable
//! (bad content, readable by group or others) is an error and is never replaced: replacing it
//! would silently invalidate every route handed out so far.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::RouteError;
use super::signer::RouteSigner;

/// Key id of a generated key.
const DEFAULT_KEY_ID: char = 'a';

/// Length of a generated secret.
const GENERATED_SECRET_LEN: usize = 32;

/// Longest key file read (a 4096-byte secret in hex plus key id, colon and newline).
const MAX_FILE_LEN: u64 = 8200;

impl RouteSigner {
    /// Loads the signing key at `path`, creating it on first use.
    ///
    /// The parent directory must exist. See the module docs for the file format and why an
    /// unusable file is an error rather than replaced.
    pub fn load_or_create(path: &Path) -> Result<Self, RouteError> {
        if let Some(signer) = load(path)? {
            return Ok(signer);
        }
        create(path)
    }
}

/// Loads the key at `path`; `None` if there is no file.
fn load(path: &Path) -> Result<Option<RouteSigner>, RouteError> {
    let io_err = |source| RouteError::KeyFileIo {
        path: path.to_owned(),
        source,
    };
    let file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(e)),
    };
    let mode = file.metadata().map_err(io_err)?.permissions().mode();
    if mode & 0o077 != 0 {
        return Err(invalid(
            path,
            "readable by group or others (want mode 0600)",
        ));
    }
    let mut text = String::new();
    file.take(MAX_FILE_LEN + 1)
        .read_to_string(&mut text)
        .map_err(|e| match e.kind() {
            io::ErrorKind::InvalidData => invalid(path, "not UTF-8 text"),
            _ => io_err(e),
        })?;
    parse(&text)
        .map(Some)
        .map_err(|reason| invalid(path, reason))
}

/// Generates a key and publishes it at `path`, or loads the one a concurrent start published.
fn create(path: &Path) -> Result<RouteSigner, RouteError> {
    let mut secret = vec![0u8; GENERATED_SECRET_LEN];
    getrandom::fill(&mut secret).map_err(RouteError::Random)?;
    let contents = format!("{DEFAULT_KEY_ID}:{}\n", hex::encode(&secret));
    let signer = RouteSigner::try_new(DEFAULT_KEY_ID, secret)?;

    let tmp = temp_sibling(path)?;
    let written = write_private(&tmp, contents.as_bytes());
    let linked = written.and_then(|()| fs::hard_link(&tmp, path));
    // The temporary name is only a staging area; the key lives on under `path`.
    let _ = fs::remove_file(&tmp);
    match linked {
        Ok(()) => {
            sync_dir(path).map_err(|source| RouteError::KeyFileIo {
                path: path.to_owned(),
                source,
            })?;
            tracing::info!(key_file = %path.display(), "created route signing key");
            Ok(signer)
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            load(path)?.ok_or_else(|| invalid(path, "vanished while being created"))
        }
        Err(source) => Err(RouteError::KeyFileIo { path: tmp, source }),
    }
}

/// Parses `{key_id}:{hex secret}` with an optional final newline.
fn parse(text: &str) -> Result<RouteSigner, &'static str> {
    let line = text.strip_suffix('\n').unwrap_or(text);
    let (key_id, secret_hex) = line
        .split_once(':')
        .ok_or("want one line `{key_id}:{hex secret}`")?;
    let mut chars = key_id.chars();
    let (Some(key_id), None) = (chars.next(), chars.next()) else {
        return Err("key id is not one character");
    };
    let secret = hex::decode(secret_hex).map_err(|_| "secret is not hex")?;
    RouteSigner::try_new(key_id, secret).map_err(|e| match e {
        RouteError::InvalidKeyId(_) => "key id is not one of 0-9a-z",
        _ => "secret is not 16 to 4096 bytes",
    })
}

/// A fresh, unused name next to `path` for staging the key.
fn temp_sibling(path: &Path) -> Result<PathBuf, RouteError> {
    let name = path
        .file_name()
        .ok_or_else(|| invalid(path, "not a file path"))?;
    let nonce = getrandom::u64().map_err(RouteError::Random)?;
    let mut tmp_name = name.to_owned();
    tmp_name.push(format!(".{}.{nonce:016x}.tmp", std::process::id()));
    Ok(path.with_file_name(tmp_name))
}

/// Creates `path` (which must not exist) with mode 0600 and durably writes `contents`.
fn write_private(path: &Path, contents: &[u8]) -> io::Result<()> {
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(contents)?;
    file.sync_all()
}

/// Makes the new directory entry for `path` durable.
fn sync_dir(path: &Path) -> io::Result<()> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => File::open(dir)?.sync_all(),
        _ => File::open(".")?.sync_all(),
    }
}

fn invalid(path: &Path, reason: &'static str) -> RouteError {
    RouteError::KeyFileInvalid {
        path: path.to_owned(),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creates_a_private_key_once_and_reloads_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("route.key");
        let first = RouteSigner::load_or_create(&path).unwrap();
        assert_eq!(first.key_id(), 'a');
        let mode = fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let text = fs::read_to_string(&path).unwrap();
        assert_eq!(text.len(), 2 + 2 * GENERATED_SECRET_LEN + 1, "{text:?}");

        let second = RouteSigner::load_or_create(&path).unwrap();
        assert_eq!(second.sign("s", 80, 1), first.sign("s", 80, 1));
        // Nothing but the key is left in the directory.
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn loads_a_provisioned_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("route.key");
        write_private(&path, b"k:666173746578742d746573742d736563726574").unwrap();
        let signer = RouteSigner::load_or_create(&path).unwrap();
        let expected = RouteSigner::try_new('k', b"fastext-test-secret".to_vec()).unwrap();
        assert_eq!(signer.key_id(), 'k');
        assert_eq!(signer.sign("s", 80, 1), expected.sign("s", 80, 1));
    }

    #[test]
    fn bad_content_is_an_error_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("route.key");
        for bad in [
            "",
            "garbage",
            "a:not-hex",
            "A:00112233445566778899aabbccddeeff",
            "ab:00112233445566778899aabbccddeeff",
            "a:0011",
            "a:00112233445566778899aabbccddeeff\nb:00",
        ] {
            fs::remove_file(&path).ok();
            write_private(&path, bad.as_bytes()).unwrap();
            let result = RouteSigner::load_or_create(&path);
            assert!(
                matches!(result, Err(RouteError::KeyFileInvalid { .. })),
                "{bad:?}: {result:?}"
            );
            assert_eq!(fs::read_to_string(&path).unwrap(), bad);
        }
    }

    #[test]
    fn group_readable_key_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("route.key");
        RouteSigner::load_or_create(&path).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o640)).unwrap();
        let result = RouteSigner::load_or_create(&path);
        assert!(
            matches!(result, Err(RouteError::KeyFileInvalid { .. })),
            "{result:?}"
        );
    }

    #[test]
    fn missing_directory_is_an_io_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("absent").join("route.key");
        let result = RouteSigner::load_or_create(&path);
        assert!(
            matches!(result, Err(RouteError::KeyFileIo { .. })),
            "{result:?}"
        );
    }
}
