//! The route signing keys on disk: created once, reused by every later start, rotated by hand.
//!
//! The file holds one line per key, oldest first, each `{key_id}:{hex secret}`; the last key
//! signs new routes and every key verifies the routes that name it. On first use a 32-byte
//! secret comes from getrandom(2) with key id `a`. The file is written to a temporary sibling
//! (mode 0600, fsynced) and then hard-linked into place: the link is atomic, so no reader ever
//! sees a partial key, and unlike a rename it never replaces a key another process created at
//! the same moment (that process's key wins and is loaded). A file that exists but is unusable
//! (bad content, readable by group or others) is an error and is never replaced: replacing it
//! would silently invalidate every route handed out so far.
//!
//! Rotation ([`rotate_key`], [`retire_key`]; `fastbox route-key` on the command line) rewrites
//! the file through a temporary sibling renamed into place. A running server notices the new
//! file within [`RELOAD_EVERY`] ([`RouteKeys`]): a key added signs from then on while the older
//! ones keep verifying until they are retired.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use super::RouteError;
use super::signer::{RouteSigner, is_key_id};

/// Key id of a generated key.
const DEFAULT_KEY_ID: char = 'a';

/// Length of a generated secret.
const GENERATED_SECRET_LEN: usize = 32;

/// Longest key file read (36 keys of 4096-byte secrets in hex, with ids and newlines).
const MAX_FILE_LEN: u64 = 36 * 8200;

/// How often a running server looks at the key file for a rotation.
pub const RELOAD_EVERY: Duration = Duration::from_secs(1);

impl RouteSigner {
    /// Loads the signing keys at `path`, creating the file with one key on first use.
    ///
    /// The parent directory must exist. See the module docs for the file format and why an
    /// unusable file is an error rather than replaced.
    pub fn load_or_create(path: &Path) -> Result<Self, RouteError> {
        if let Some(signer) = load(path)? {
            return Ok(signer);
        }
        create(path)
    }

    /// Loads the signing keys at `path`, which must exist.
    pub fn load(path: &Path) -> Result<Self, RouteError> {
        load(path)?.ok_or_else(|| RouteError::KeyFileIo {
            path: path.to_owned(),
            source: io::ErrorKind::NotFound.into(),
        })
    }
}

/// Adds a new key (32 bytes from getrandom(2)) to the key file at `path` (created first if
/// there is none) and makes it the signing key; the keys already there keep verifying. The
/// new key's id is the first one after the signing key's, in `0-9a-z` order (wrapping), that
/// the file does not use. Returns the keys now in the file.
pub fn rotate_key(path: &Path) -> Result<RouteSigner, RouteError> {
    let current = RouteSigner::load_or_create(path)?;
    let held = current.key_ids();
    let ids: Vec<char> = ('0'..='9').chain('a'..='z').collect();
    let at = ids.iter().position(|&c| c == current.key_id()).unwrap_or(0);
    let new_id = (1..ids.len())
        .map(|step| ids[(at + step) % ids.len()])
        .find(|c| !held.contains(c))
        .ok_or_else(|| {
            RouteError::Rotation(format!(
                "all {} key ids are in use: retire one first",
                ids.len()
            ))
        })?;
    let mut secret = vec![0u8; GENERATED_SECRET_LEN];
    getrandom::fill(&mut secret).map_err(RouteError::Random)?;
    let mut keys: Vec<(char, Vec<u8>)> = current
        .keys()
        .iter()
        .map(|k| (k.id, k.secret.clone()))
        .collect();
    keys.push((new_id, secret));
    let next = RouteSigner::with_keys(keys)?;
    replace(path, &next)?;
    tracing::info!(key_file = %path.display(), key_id = %new_id, "added a route signing key");
    Ok(next)
}

/// Makes the key file at `path` hold the keys `text` names (the form
/// [`RouteKeys::file_text`] writes), atomically; whether it changed. Text that is no key file
/// is refused and the file left as it was. A node given its server's keys keeps them so.
pub fn install_keys(path: &Path, text: &str) -> Result<bool, RouteError> {
    let signer = parse(text).map_err(|reason| invalid(path, reason))?;
    let wanted = render(&signer);
    match fs::read_to_string(path) {
        Ok(held) if held == wanted => return Ok(false),
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(RouteError::KeyFileIo {
                path: path.to_owned(),
                source,
            });
        }
    }
    replace(path, &signer)?;
    Ok(true)
}

/// Removes the key `key_id` from the key file at `path`: the routes signed with it stop
/// verifying. The signing key (the newest) is never removed: rotate first. Returns the keys
/// now in the file.
pub fn retire_key(path: &Path, key_id: char) -> Result<RouteSigner, RouteError> {
    let current = RouteSigner::load(path)?;
    if !current.holds(key_id) {
        return Err(RouteError::Rotation(format!(
            "no key {key_id:?} in {} (it holds {:?})",
            path.display(),
            current.key_ids()
        )));
    }
    if current.key_id() == key_id {
        return Err(RouteError::Rotation(format!(
            "key {key_id:?} signs new routes: add its successor first (rotate), then retire it"
        )));
    }
    let keys = current
        .keys()
        .iter()
        .filter(|k| k.id != key_id)
        .map(|k| (k.id, k.secret.clone()))
        .collect();
    let next = RouteSigner::with_keys(keys)?;
    replace(path, &next)?;
    tracing::info!(key_file = %path.display(), key_id = %key_id, "retired a route signing key");
    Ok(next)
}

/// The route keys of a running server: the key file as last read, read again when it
/// changes (checked at most every [`RELOAD_EVERY`]). A file that became unusable keeps the
/// keys last read in force (and is reported in the log), so a botched edit never takes every
/// route down. Cloning shares the keys.
#[derive(Clone)]
pub struct RouteKeys {
    inner: Arc<KeysInner>,
}

struct KeysInner {
    /// None: fixed keys, never reloaded.
    path: Option<PathBuf>,
    state: RwLock<KeysState>,
}

struct KeysState {
    signer: Arc<RouteSigner>,
    stamp: Option<FileStamp>,
    checked: Instant,
}

/// What tells one version of the key file from another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_ns: i128,
}

impl FileStamp {
    fn of(path: &Path) -> Option<Self> {
        let meta = fs::metadata(path).ok()?;
        Some(Self {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
        })
    }
}

impl RouteKeys {
    /// The keys at `path` (created on first use, as [`RouteSigner::load_or_create`]),
    /// followed as the file changes.
    pub fn load_or_create(path: &Path) -> Result<Self, RouteError> {
        let stamp = FileStamp::of(path);
        let signer = RouteSigner::load_or_create(path)?;
        // Created just now: stamp the file as it is.
        let stamp = stamp.or_else(|| FileStamp::of(path));
        Ok(Self::with_state(Some(path.to_owned()), signer, stamp))
    }

    /// Keys that never change (tests, one-off tools).
    pub fn fixed(signer: RouteSigner) -> Self {
        Self::with_state(None, signer, None)
    }

    fn with_state(path: Option<PathBuf>, signer: RouteSigner, stamp: Option<FileStamp>) -> Self {
        Self {
            inner: Arc::new(KeysInner {
                path,
                state: RwLock::new(KeysState {
                    signer: Arc::new(signer),
                    stamp,
                    checked: Instant::now(),
                }),
            }),
        }
    }

    /// The keys in force as their file holds them (secret: for a node of this server only).
    pub fn file_text(&self) -> String {
        render(&self.current())
    }

    /// The keys in force, after reading the file again if it changed.
    pub fn current(&self) -> Arc<RouteSigner> {
        {
            let state = self.inner.state.read().unwrap_or_else(|e| e.into_inner());
            if self.inner.path.is_none() || state.checked.elapsed() < RELOAD_EVERY {
                return state.signer.clone();
            }
        }
        self.reload_if_changed();
        let state = self.inner.state.read().unwrap_or_else(|e| e.into_inner());
        state.signer.clone()
    }

    fn reload_if_changed(&self) {
        let Some(path) = &self.inner.path else { return };
        let mut state = self.inner.state.write().unwrap_or_else(|e| e.into_inner());
        if state.checked.elapsed() < RELOAD_EVERY {
            return; // another thread just looked
        }
        state.checked = Instant::now();
        let stamp = FileStamp::of(path);
        if stamp == state.stamp {
            return;
        }
        state.stamp = stamp;
        match RouteSigner::load(path) {
            Ok(signer) => {
                tracing::info!(
                    key_file = %path.display(),
                    key_ids = ?signer.key_ids(),
                    signing = %signer.key_id(),
                    "route signing keys reloaded"
                );
                state.signer = Arc::new(signer);
            }
            Err(e) => tracing::warn!(
                key_file = %path.display(),
                error = %e,
                "route key file changed but cannot be used; the keys read before stay in force"
            ),
        }
    }
}

impl std::fmt::Debug for RouteKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouteKeys")
            .field("path", &self.inner.path)
            .field("keys", &self.current())
            .finish()
    }
}

/// Loads the keys at `path`; `None` if there is no file.
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
    let signer = RouteSigner::try_new(DEFAULT_KEY_ID, secret)?;
    let contents = render(&signer);

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

/// Replaces the key file at `path` with `signer`'s keys, atomically (rename).
fn replace(path: &Path, signer: &RouteSigner) -> Result<(), RouteError> {
    let tmp = temp_sibling(path)?;
    let written = write_private(&tmp, render(signer).as_bytes());
    let renamed = written.and_then(|()| fs::rename(&tmp, path));
    if let Err(source) = renamed {
        let _ = fs::remove_file(&tmp);
        return Err(RouteError::KeyFileIo { path: tmp, source });
    }
    sync_dir(path).map_err(|source| RouteError::KeyFileIo {
        path: path.to_owned(),
        source,
    })
}

/// The file's text: one `{key_id}:{hex secret}` line per key, oldest first.
pub(crate) fn render(signer: &RouteSigner) -> String {
    signer
        .keys()
        .iter()
        .map(|k| format!("{}:{}\n", k.id, hex::encode(&k.secret)))
        .collect()
}

/// Parses `{key_id}:{hex secret}` lines (oldest first) with an optional final newline.
fn parse(text: &str) -> Result<RouteSigner, &'static str> {
    let body = text.strip_suffix('\n').unwrap_or(text);
    if body.is_empty() {
        return Err("want lines `{key_id}:{hex secret}`");
    }
    let mut keys = Vec::new();
    for line in body.split('\n') {
        let (key_id, secret_hex) = line
            .split_once(':')
            .ok_or("want lines `{key_id}:{hex secret}`")?;
        let mut chars = key_id.chars();
        let (Some(key_id), None) = (chars.next(), chars.next()) else {
            return Err("key id is not one character");
        };
        if !is_key_id(key_id) {
            return Err("key id is not one of 0-9a-z");
        }
        let secret = hex::decode(secret_hex).map_err(|_| "secret is not hex")?;
        keys.push((key_id, secret));
    }
    RouteSigner::with_keys(keys).map_err(|e| match e {
        RouteError::InvalidKeyId(_) => "key id is not one of 0-9a-z",
        RouteError::DuplicateKeyId(_) => "a key id is used twice",
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

    #[test]
    fn installed_keys_are_the_servers_and_bad_text_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let server = RouteKeys::load_or_create(&dir.path().join("server.key")).unwrap();
        let node_path = dir.path().join("node.key");
        assert!(install_keys(&node_path, &server.file_text()).unwrap());
        assert!(
            !install_keys(&node_path, &server.file_text()).unwrap(),
            "unchanged"
        );
        let node = RouteKeys::load_or_create(&node_path).unwrap();
        assert_eq!(node.file_text(), server.file_text());
        let mode = fs::metadata(&node_path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let before = fs::read_to_string(&node_path).unwrap();
        assert!(install_keys(&node_path, "not a key file").is_err());
        assert_eq!(fs::read_to_string(&node_path).unwrap(), before);
    }

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
            "a:00112233445566778899aabbccddeeff\na:00112233445566778899aabbccddeeff",
            "a:00112233445566778899aabbccddeeff\n\nb:00112233445566778899aabbccddeeff",
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
    fn several_keys_load_oldest_first_and_the_last_signs() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("route.key");
        write_private(
            &path,
            b"k:666173746578742d746573742d736563726574\nm:00112233445566778899aabbccddeeff\n",
        )
        .unwrap();
        let signer = RouteSigner::load_or_create(&path).unwrap();
        assert_eq!(signer.key_ids(), vec!['k', 'm']);
        assert_eq!(signer.key_id(), 'm');
        let old = RouteSigner::try_new('k', b"fastext-test-secret".to_vec()).unwrap();
        let sig = old.sign("s", 80, 100);
        assert_eq!(signer.verify("s", 80, "2s", &sig, 1).unwrap(), 100);
    }

    #[test]
    fn rotate_adds_a_signing_key_and_retire_removes_an_old_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("route.key");
        let first = RouteSigner::load_or_create(&path).unwrap();
        let old_route = first.sign("s", 80, 100);

        let rotated = rotate_key(&path).unwrap();
        assert_eq!(rotated.key_ids(), vec!['a', 'b']);
        assert_eq!(rotated.key_id(), 'b');
        let reloaded = RouteSigner::load(&path).unwrap();
        assert_eq!(reloaded.key_ids(), vec!['a', 'b']);
        // The overlap: the old key's routes still verify, new ones are signed with `b`.
        assert!(reloaded.verify("s", 80, "2s", &old_route, 1).is_ok());
        assert!(reloaded.sign("s", 80, 100).ends_with('b'));
        let mode = fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);

        // The signing key is never retired; unknown ids are an error.
        assert!(matches!(
            retire_key(&path, 'b'),
            Err(RouteError::Rotation(_))
        ));
        assert!(matches!(
            retire_key(&path, 'x'),
            Err(RouteError::Rotation(_))
        ));
        let retired = retire_key(&path, 'a').unwrap();
        assert_eq!(retired.key_ids(), vec!['b']);
        assert!(matches!(
            RouteSigner::load(&path)
                .unwrap()
                .verify("s", 80, "2s", &old_route, 1),
            Err(RouteError::UnknownKey('a'))
        ));
        // The next id after `b` is `c`; ids wrap around after `z`.
        assert_eq!(rotate_key(&path).unwrap().key_id(), 'c');
        // Nothing but the key file is left in the directory.
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn rotation_ids_wrap_around() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("route.key");
        write_private(&path, b"z:00112233445566778899aabbccddeeff\n").unwrap();
        assert_eq!(rotate_key(&path).unwrap().key_id(), '0');
    }

    #[test]
    fn running_keys_follow_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("route.key");
        let keys = RouteKeys::load_or_create(&path).unwrap();
        assert_eq!(keys.current().key_ids(), vec!['a']);
        rotate_key(&path).unwrap();
        std::thread::sleep(RELOAD_EVERY + Duration::from_millis(50));
        assert_eq!(keys.current().key_ids(), vec!['a', 'b']);
        assert_eq!(keys.current().key_id(), 'b');
        // A broken file keeps the keys last read in force.
        fs::remove_file(&path).unwrap();
        write_private(&path, b"garbage").unwrap();
        std::thread::sleep(RELOAD_EVERY + Duration::from_millis(50));
        assert_eq!(keys.current().key_ids(), vec!['a', 'b']);
        // Fixed keys never look at a file.
        let fixed = RouteKeys::fixed(RouteSigner::try_new('q', vec![7; 16]).unwrap());
        assert_eq!(fixed.current().key_id(), 'q');
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
