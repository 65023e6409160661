//! Records sealed at rest: a [`StateBackend`] over another that encrypts every value with
//! AES-256-GCM under a key only the servers hold.
//!
//! Records carry execd and egress tokens and registry credentials; in a shared etcd they
//! would otherwise be readable by whoever can read etcd (its operators, its backups). A
//! sealed value is `fbs1 | key id (8) | nonce (12) | ciphertext and tag`, the key id being
//! the first 8 bytes of the key's SHA-256 (so a server with another key says so instead of
//! failing obscurely). The table and key are the associated data: a sealed value moved to
//! another record does not open. Revisions and keys stay readable (etcd compares them).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::rand::{SecureRandom, SystemRandom};

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::{
    CLUSTER_TABLE, Coordinator, Entry, Fence, Guard, Revision, StateBackend, StateError, Watch,
    WatchEvent,
};

const MAGIC: &[u8; 4] = b"fbs1";
const ID_LEN: usize = 8;
const HEADER: usize = MAGIC.len() + ID_LEN + NONCE_LEN;

/// The servers' sealing key (32 bytes).
#[derive(Clone)]
pub struct SealKey {
    key: LessSafeKey,
    id: [u8; ID_LEN],
}

impl std::fmt::Debug for SealKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SealKey({})", self.id_hex())
    }
}

impl SealKey {
    /// A key of these 32 bytes.
    pub fn from_bytes(bytes: &[u8; 32]) -> Self {
        let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
        let mut id = [0; ID_LEN];
        id.copy_from_slice(&digest.as_ref()[..ID_LEN]);
        Self {
            key: LessSafeKey::new(UnboundKey::new(&AES_256_GCM, bytes).expect("32 bytes")),
            id,
        }
    }

    /// Reads the key in `path` (64 hex digits), or makes one there (mode 0600) when there is
    /// no file. Returns it and whether it was made.
    pub fn load_or_create(path: &Path) -> Result<(Self, bool), StateError> {
        let fail = |e: String| StateError::Failed(format!("seal key {}: {e}", path.display()));
        match std::fs::read_to_string(path) {
            Ok(text) => {
                let bytes =
                    hex_decode(text.trim()).ok_or_else(|| fail("not 64 hex digits".into()))?;
                Ok((Self::from_bytes(&bytes), false))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut bytes = [0u8; 32];
                SystemRandom::new()
                    .fill(&mut bytes)
                    .map_err(|_| fail("no randomness".into()))?;
                let mut file = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(path)
                    .map_err(|e| fail(e.to_string()))?;
                let text: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
                writeln!(file, "{text}")
                    .and_then(|()| file.sync_all())
                    .map_err(|e| fail(e.to_string()))?;
                Ok((Self::from_bytes(&bytes), true))
            }
            Err(e) => Err(fail(e.to_string())),
        }
    }

    /// The key's id, for messages (never the key).
    pub fn id_hex(&self) -> String {
        self.id.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn seal(&self, table: &str, key: &str, value: &[u8]) -> Result<Vec<u8>, StateError> {
        let mut nonce = [0u8; NONCE_LEN];
        SystemRandom::new()
            .fill(&mut nonce)
            .map_err(|_| StateError::Failed("no randomness to seal a record".into()))?;
        let mut out = Vec::with_capacity(HEADER + value.len() + AES_256_GCM.tag_len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.id);
        out.extend_from_slice(&nonce);
        let mut body = value.to_vec();
        self.key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad(table, key)),
                &mut body,
            )
            .map_err(|_| StateError::Failed("sealing a record failed".into()))?;
        out.extend_from_slice(&body);
        Ok(out)
    }

    fn open(&self, table: &str, key: &str, sealed: &[u8]) -> Result<Vec<u8>, StateError> {
        let bad = |why: String| StateError::Failed(format!("record {table}/{key}: {why}"));
        if sealed.len() < HEADER || &sealed[..MAGIC.len()] != MAGIC {
            return Err(bad(
                "not sealed (written without a seal key); refusing it".into()
            ));
        }
        let id = &sealed[MAGIC.len()..MAGIC.len() + ID_LEN];
        if id != self.id {
            let theirs: String = id.iter().map(|b| format!("{b:02x}")).collect();
            return Err(bad(format!(
                "sealed with key {theirs}, this server holds key {}: give every server the \
                 same seal key file",
                self.id_hex()
            )));
        }
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&sealed[MAGIC.len() + ID_LEN..HEADER]);
        let mut body = sealed[HEADER..].to_vec();
        let plain = self
            .key
            .open_in_place(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad(table, key)),
                &mut body,
            )
            .map_err(|_| bad("does not open (altered, or moved from another record)".into()))?;
        Ok(plain.to_vec())
    }
}

fn aad(table: &str, key: &str) -> Vec<u8> {
    [table.as_bytes(), b"\0", key.as_bytes()].concat()
}

fn hex_decode(text: &str) -> Option<[u8; 32]> {
    if text.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// `inner` with every value sealed under `key`.
pub struct SealedBackend<B> {
    inner: B,
    key: SealKey,
}

impl<B: StateBackend> SealedBackend<B> {
    pub fn new(inner: B, key: SealKey) -> Self {
        Self { inner, key }
    }

    fn open_entry(&self, table: &str, entry: Entry) -> Result<Entry, StateError> {
        Ok(Entry {
            value: self.key.open(table, &entry.key, &entry.value)?,
            ..entry
        })
    }
}

impl<B: StateBackend> StateBackend for SealedBackend<B> {
    fn list(&self, table: &str) -> Result<Vec<Entry>, StateError> {
        self.inner
            .list(table)?
            .into_iter()
            .map(|e| self.open_entry(table, e))
            .collect()
    }

    fn get(&self, table: &str, key: &str) -> Result<Option<Entry>, StateError> {
        self.inner
            .get(table, key)?
            .map(|e| self.open_entry(table, e))
            .transpose()
    }

    fn put(
        &self,
        table: &str,
        key: &str,
        value: &[u8],
        expected: Revision,
        fence: Option<&Fence>,
    ) -> Result<Revision, StateError> {
        let sealed = self.key.seal(table, key, value)?;
        self.inner.put(table, key, &sealed, expected, fence)
    }

    fn create_under(
        &self,
        table: &str,
        key: &str,
        value: &[u8],
        guard: &Guard,
    ) -> Result<Revision, StateError> {
        let sealed = self.key.seal(table, key, value)?;
        self.inner.create_under(table, key, &sealed, guard)
    }

    fn delete(
        &self,
        table: &str,
        key: &str,
        expected: Revision,
        fence: Option<&Fence>,
    ) -> Result<(), StateError> {
        self.inner.delete(table, key, expected, fence)
    }

    fn delete_under(
        &self,
        table: &str,
        key: &str,
        expected: Revision,
        guard: &Guard,
    ) -> Result<(), StateError> {
        self.inner.delete_under(table, key, expected, guard)
    }

    fn describe(&self) -> String {
        format!(
            "{} (sealed, key {})",
            self.inner.describe(),
            self.key.id_hex()
        )
    }

    /// The inner watch's changes, records opened (coordination keys are not sealed). A
    /// record that does not open is logged and read again as a [`WatchEvent::Reset`].
    fn watch(&self, from: Revision) -> Result<Option<Watch>, StateError> {
        let Some(inner) = self.inner.watch(from)? else {
            return Ok(None);
        };
        let key = self.key.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        std::thread::Builder::new()
            .name("state-watch-open".into())
            .spawn(move || {
                while !stopped.load(Ordering::Relaxed) && !inner.stopped() {
                    let Some(event) = inner.next(Duration::from_millis(200)) else {
                        continue;
                    };
                    let event = match event {
                        WatchEvent::Put { table, entry } if table != CLUSTER_TABLE => {
                            match key.open(&table, &entry.key, &entry.value) {
                                Ok(value) => WatchEvent::Put {
                                    table,
                                    entry: Entry { value, ..entry },
                                },
                                Err(e) => {
                                    tracing::warn!(error = %e, "a changed record does not open");
                                    WatchEvent::Reset
                                }
                            }
                        }
                        other => other,
                    };
                    if tx.send(event).is_err() {
                        break;
                    }
                }
                stopped.store(true, Ordering::Relaxed);
            })
            .map_err(|e| StateError::Failed(format!("cannot start a watch thread: {e}")))?;
        Ok(Some(Watch::new(rx, stop)))
    }

    fn coordinator(&self) -> Option<&dyn Coordinator> {
        self.inner.coordinator()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RedbBackend;

    #[test]
    fn values_are_sealed_and_open_only_with_their_key_and_place() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.redb");
        let key = SealKey::from_bytes(&[7; 32]);
        let sealed = SealedBackend::new(RedbBackend::open(&path).unwrap(), key);
        let r = sealed
            .put("sandboxes", "a", b"token=hunter2", 0, None)
            .unwrap();
        assert_eq!(
            sealed.get("sandboxes", "a").unwrap().unwrap().value,
            b"token=hunter2"
        );
        let raw = sealed.inner.get("sandboxes", "a").unwrap().unwrap().value;
        assert!(!raw.windows(7).any(|w| w == b"hunter2"), "stored in clear");
        assert_eq!(&raw[..4], MAGIC);

        // Another key says which key it was sealed with.
        let other = SealKey::from_bytes(&[8; 32]);
        let e = other.open("sandboxes", "a", &raw).unwrap_err().to_string();
        assert!(e.contains(&SealKey::from_bytes(&[7; 32]).id_hex()), "{e}");
        assert!(e.contains("same seal key"), "{e}");
        // Moved to another record, or altered, it does not open.
        let key = SealKey::from_bytes(&[7; 32]);
        assert!(key.open("sandboxes", "b", &raw).is_err());
        let mut altered = raw.clone();
        *altered.last_mut().unwrap() ^= 1;
        assert!(key.open("sandboxes", "a", &altered).is_err());
        // A record written in clear is refused.
        sealed
            .inner
            .put("sandboxes", "a", b"clear", r, None)
            .unwrap();
        assert!(sealed.get("sandboxes", "a").is_err());
    }

    #[test]
    fn a_key_file_is_made_once_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("seal.key");
        let (made, created) = SealKey::load_or_create(&path).unwrap();
        assert!(created);
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let (read, created) = SealKey::load_or_create(&path).unwrap();
        assert!(!created);
        assert_eq!(made.id_hex(), read.id_hex());
        std::fs::write(&path, "nothex").unwrap();
        assert!(SealKey::load_or_create(&path).is_err());
    }
}
