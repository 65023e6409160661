//! Single flight: one fetch per block per node, shared while it runs.
//!
//! A [`Flight`] is one fetch of one block: the bytes received so far and, at the end, the
//! outcome. A [`FlightTable`] holds the flights in progress on a node; [`FlightTable::join`]
//! returns the flight of a block or registers a new one, which the caller drives. A node
//! has two tables:
//!
//! - **origin flights** ([`OriginFlights`]), shared by the node's readers and its peer
//!   server: the driver streams the block from the origin's `stream_block` (unless it has
//!   become local since the caller looked); the node's readers wait for the whole block
//!   ([`Flight::wait`]); the peer server streams the bytes received so far and then each
//!   new piece as it arrives ([`Flight::next_chunk`]), so a requester receives the block
//!   while the owner is still receiving it;
//! - **read flights** (in [`crate::Delivery`]): concurrent reads of one missing block on
//!   one node share one trip through peers and origin.
//!
//! The origin driver hashes every byte on the way (independently of the origin's own
//! check) and caps the block at [`BLOCK_SIZE`]. When the source succeeds the flight is
//! marked done, then the block is kept locally ([`NodeBlocks::insert_local`]), and only
//! then does the flight leave the table: a request arriving in between joins the finished
//! flight and gets the whole block at once, so no second fetch can start for a block that
//! was just fetched. A failed flight leaves the table at once, so the next read starts a
//! new one. A driver that panics leaves its flight failed, never hanging.
//!
//! A streamed body whose flight fails ends with an error, which aborts the HTTP response;
//! the requester then sees an incomplete body and moves on.

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use bytes::Bytes;
use fastbox_artifact::{ArtifactStore, BLOCK_SIZE, Digest, ObjectKind, StoreError};

use crate::counters::Counters;
use crate::node_blocks::NodeBlocks;

/// Largest piece handed to a streaming reader at once.
const MAX_CHUNK: usize = 256 * 1024;

/// Why an origin fetch failed, in a form every joiner can be given a copy of.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum FlightFailure {
    /// The origin has no such block.
    #[error("the origin has no such block")]
    NotFound,
    /// The origin's bytes hash to something else.
    #[error("the origin's bytes hash to {0}")]
    Corrupt(Digest),
    /// Anything else, as text.
    #[error("{0}")]
    Failed(String),
}

impl FlightFailure {
    pub(crate) fn from_store(error: &StoreError) -> Self {
        match error {
            StoreError::NotFound { .. } => FlightFailure::NotFound,
            StoreError::Corrupt { actual, .. } => FlightFailure::Corrupt(*actual),
            other => FlightFailure::Failed(other.to_string()),
        }
    }

    /// The store error a reader of block `digest` is given.
    pub(crate) fn to_store_error(&self, digest: &Digest) -> StoreError {
        match self {
            FlightFailure::NotFound => StoreError::NotFound {
                kind: ObjectKind::Block,
                digest: *digest,
            },
            FlightFailure::Corrupt(actual) => StoreError::Corrupt {
                kind: ObjectKind::Block,
                digest: *digest,
                actual: *actual,
            },
            FlightFailure::Failed(message) => StoreError::Io {
                op: "fetch from the origin",
                location: format!("block {digest}"),
                source: io::Error::other(message.clone()),
            },
        }
    }
}

/// What a streaming reader gets next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Progress {
    /// Bytes from the offset asked for.
    Bytes(Bytes),
    /// Every byte has been read and verified.
    Done,
    /// The fetch failed.
    Failed(FlightFailure),
}

#[derive(Debug, Default)]
struct FlightState {
    bytes: Vec<u8>,
    outcome: Option<Result<(), FlightFailure>>,
}

/// One origin fetch of one block, joined by every reader of that block on this node.
#[derive(Debug)]
pub(crate) struct Flight {
    digest: Digest,
    state: Mutex<FlightState>,
    sync_waiters: Condvar,
    async_waiters: tokio::sync::Notify,
}

impl Flight {
    fn new(digest: Digest) -> Self {
        Flight {
            digest,
            state: Mutex::new(FlightState::default()),
            sync_waiters: Condvar::new(),
            async_waiters: tokio::sync::Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, FlightState> {
        // Every update leaves the state consistent, so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn changed(&self) {
        self.sync_waiters.notify_all();
        self.async_waiters.notify_waiters();
    }

    pub(crate) fn append(&self, piece: &[u8]) {
        self.lock().bytes.extend_from_slice(piece);
        self.changed();
    }

    fn finish(&self, outcome: Result<(), FlightFailure>) {
        {
            let mut state = self.lock();
            if state.outcome.is_none() {
                state.outcome = Some(outcome);
            }
        }
        self.changed();
    }

    /// Block until the fetch ends; the whole block, or why it failed.
    pub(crate) fn wait(&self) -> Result<Vec<u8>, FlightFailure> {
        let mut state = self.lock();
        loop {
            match &state.outcome {
                Some(Ok(())) => return Ok(state.bytes.clone()),
                Some(Err(failure)) => return Err(failure.clone()),
                None => {
                    state = self
                        .sync_waiters
                        .wait(state)
                        .unwrap_or_else(|p| p.into_inner());
                }
            }
        }
    }

    /// What is available from `offset` now, without waiting (None: nothing yet).
    fn poll_from(&self, offset: usize) -> Option<Progress> {
        let state = self.lock();
        if state.bytes.len() > offset {
            let end = state.bytes.len().min(offset + MAX_CHUNK);
            return Some(Progress::Bytes(Bytes::copy_from_slice(
                &state.bytes[offset..end],
            )));
        }
        match &state.outcome {
            Some(Ok(())) => Some(Progress::Done),
            Some(Err(failure)) => Some(Progress::Failed(failure.clone())),
            None => None,
        }
    }

    /// The bytes from `offset` on, waiting until some arrive or the fetch ends.
    pub(crate) async fn next_chunk(&self, offset: usize) -> Progress {
        loop {
            // Register for wake-ups before looking, so a change in between is not missed.
            let notified = self.async_waiters.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(progress) = self.poll_from(offset) {
                return progress;
            }
            notified.await;
        }
    }

    /// Wait until the first byte has arrived or the fetch has ended: `Ok` when there is
    /// something to stream, the failure otherwise.
    pub(crate) async fn first_byte(&self) -> Result<(), FlightFailure> {
        match self.next_chunk(0).await {
            Progress::Bytes(_) | Progress::Done => Ok(()),
            Progress::Failed(failure) => Err(failure),
        }
    }

    /// The block this flight fetches.
    pub(crate) fn digest(&self) -> &Digest {
        &self.digest
    }
}

/// Whether [`FlightTable::join`] found a flight or registered one the caller must drive.
pub(crate) enum Joined {
    /// A fetch already in progress (or just finished).
    Existing(Arc<Flight>),
    /// A new fetch: the caller must drive it.
    Started(Arc<Flight>),
}

/// What a flight's source did when it succeeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sourced {
    /// Fetched new bytes, to be kept locally.
    Fetched,
    /// Found the block already kept (nothing to keep).
    AlreadyKept,
}

/// The flights in progress on one node, by block.
#[derive(Debug, Default)]
pub(crate) struct FlightTable {
    flights: Mutex<HashMap<Digest, Arc<Flight>>>,
}

impl FlightTable {
    fn table(&self) -> MutexGuard<'_, HashMap<Digest, Arc<Flight>>> {
        self.flights.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Join the flight of `digest`, or register a new one.
    pub(crate) fn join(&self, digest: &Digest) -> Joined {
        let mut table = self.table();
        if let Some(flight) = table.get(digest) {
            return Joined::Existing(flight.clone());
        }
        let flight = Arc::new(Flight::new(*digest));
        table.insert(*digest, flight.clone());
        Joined::Started(flight)
    }

    /// Drive a flight registered by [`join`](Self::join): `source` appends the block's bytes
    /// to it (verifying them); the flight ends with its outcome, then `keep` gets the bytes
    /// of a fetched block, then the flight leaves the table. Blocking.
    pub(crate) fn drive(
        &self,
        flight: &Flight,
        source: impl FnOnce(&Flight) -> Result<Sourced, FlightFailure>,
        keep: impl FnOnce(&[u8]),
    ) {
        // Ends the flight and takes it off the table whatever happens below, panics included.
        let _guard = FlightGuard {
            table: self,
            flight,
        };
        match source(flight) {
            Ok(sourced) => {
                flight.finish(Ok(()));
                if sourced == Sourced::Fetched {
                    let bytes = flight.lock().bytes.clone();
                    keep(&bytes);
                }
            }
            Err(failure) => {
                tracing::warn!(block = %flight.digest(), error = %failure, "block fetch failed");
                flight.finish(Err(failure));
            }
        }
    }

    /// Join the flight of `digest` or drive a new one with `source` and `keep`, then wait
    /// for the whole block. Blocking.
    pub(crate) fn fetch(
        &self,
        digest: &Digest,
        source: impl FnOnce(&Flight) -> Result<Sourced, FlightFailure>,
        keep: impl FnOnce(&[u8]),
    ) -> Result<Vec<u8>, StoreError> {
        let flight = match self.join(digest) {
            Joined::Existing(flight) => flight,
            Joined::Started(flight) => {
                self.drive(&flight, source, keep);
                flight
            }
        };
        flight.wait().map_err(|f| f.to_store_error(digest))
    }
}

/// Fails an unfinished flight and removes it from the table when dropped.
struct FlightGuard<'a> {
    table: &'a FlightTable,
    flight: &'a Flight,
}

impl Drop for FlightGuard<'_> {
    fn drop(&mut self) {
        self.flight
            .finish(Err(FlightFailure::Failed("the fetch was abandoned".into())));
        let mut table = self.table.table();
        if table
            .get(self.flight.digest())
            .is_some_and(|f| std::ptr::eq(Arc::as_ptr(f), self.flight))
        {
            table.remove(self.flight.digest());
        }
    }
}

/// The origin fetches in progress on one node: the flights its readers and its peer
/// server share.
pub(crate) struct OriginFlights {
    origin: Arc<dyn ArtifactStore>,
    blocks: Arc<dyn NodeBlocks>,
    counters: Arc<Counters>,
    table: FlightTable,
}

impl OriginFlights {
    pub(crate) fn new(
        origin: Arc<dyn ArtifactStore>,
        blocks: Arc<dyn NodeBlocks>,
        counters: Arc<Counters>,
    ) -> Self {
        OriginFlights {
            origin,
            blocks,
            counters,
            table: FlightTable::default(),
        }
    }

    /// Join the origin flight of `digest`, or register one the caller must [`drive`](Self::drive).
    pub(crate) fn join(&self, digest: &Digest) -> Joined {
        self.table.join(digest)
    }

    /// Fetch the block from the origin through its flight and wait for it (blocking).
    pub(crate) fn fetch(&self, digest: &Digest) -> Result<Vec<u8>, StoreError> {
        self.table.fetch(
            digest,
            |flight| self.stream_from_origin(flight),
            |bytes| self.keep(digest, bytes),
        )
    }

    /// Run a flight registered by [`join`](Self::join): stream the block from the origin,
    /// verify it, keep it locally. Blocking; call it on a thread that may block.
    pub(crate) fn drive(&self, flight: &Flight) {
        let digest = *flight.digest();
        self.table.drive(
            flight,
            |flight| self.stream_from_origin(flight),
            |bytes| self.keep(&digest, bytes),
        );
    }

    fn keep(&self, digest: &Digest, bytes: &[u8]) {
        self.blocks.insert_local(digest, bytes);
    }

    fn stream_from_origin(&self, flight: &Flight) -> Result<Sourced, FlightFailure> {
        let digest = *flight.digest();
        // A reader that missed the block locally may start a flight just after the previous
        // one kept the block and left the table: serve that from the local copy.
        if let Some(bytes) = self.blocks.get_local(&digest) {
            flight.append(&bytes);
            return Ok(Sourced::AlreadyKept);
        }
        Counters::bump(&self.counters.origin_fetches);
        let mut hasher = blake3::Hasher::new();
        let mut received = 0usize;
        let streamed = self.origin.stream_block(&digest, &mut |piece: &[u8]| {
            received += piece.len();
            if received > BLOCK_SIZE {
                return Err(io::Error::other(format!(
                    "the origin sent more than the block size ({BLOCK_SIZE} bytes)"
                )));
            }
            hasher.update(piece);
            flight.append(piece);
            Ok(())
        });
        if let Err(e) = streamed {
            return Err(FlightFailure::from_store(&e));
        }
        let actual = Digest::from(hasher.finalize());
        if actual != digest {
            return Err(FlightFailure::Corrupt(actual));
        }
        Counters::add(&self.counters.bytes_verified, received as u64);
        Ok(Sourced::Fetched)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::CountingOrigin;
    use fastbox_artifact::LocalStore;
    use std::time::Duration;

    struct Setup {
        _dir: tempfile::TempDir,
        origin: Arc<CountingOrigin>,
        local: Arc<LocalStore>,
        flights: Arc<OriginFlights>,
    }

    fn setup(pause: Duration) -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let origin = CountingOrigin::new(LocalStore::open(dir.path().join("origin")).unwrap())
            .slow(1024, pause);
        let origin = Arc::new(origin);
        let local = Arc::new(LocalStore::open(dir.path().join("local")).unwrap());
        let flights = Arc::new(OriginFlights::new(
            origin.clone(),
            local.clone(),
            Arc::new(Counters::default()),
        ));
        Setup {
            _dir: dir,
            origin,
            local,
            flights,
        }
    }

    fn seed(origin: &CountingOrigin, bytes: &[u8]) -> Digest {
        let digest = Digest::of(bytes);
        origin.inner().put_block(&digest, bytes).unwrap();
        digest
    }

    #[test]
    fn concurrent_readers_share_one_origin_fetch_and_the_block_is_kept() {
        let s = setup(Duration::from_millis(1));
        let bytes: Vec<u8> = (0..64 * 1024).map(|i| (i % 251) as u8).collect();
        let digest = seed(&s.origin, &bytes);
        let results: Vec<Vec<u8>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..6)
                .map(|_| scope.spawn(|| s.flights.fetch(&digest).unwrap()))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(results.iter().all(|r| r == &bytes));
        assert_eq!(s.origin.block_reads(), 1);
        assert_eq!(s.local.get_local(&digest), Some(bytes));
        assert!(s.flights.table.table().is_empty());
        let counters = s.flights.counters.snapshot();
        assert_eq!(counters.origin_fetches, 1);
        assert_eq!(counters.bytes_verified, 64 * 1024);
    }

    #[test]
    fn a_missing_block_fails_every_joiner_and_is_retried_by_the_next_read() {
        let s = setup(Duration::ZERO);
        let digest = Digest::of(b"absent");
        for _ in 0..2 {
            assert!(matches!(
                s.flights.fetch(&digest),
                Err(StoreError::NotFound { .. })
            ));
        }
        assert_eq!(s.origin.block_reads(), 2);
        assert!(s.flights.table.table().is_empty());
    }

    #[test]
    fn an_origin_sending_other_bytes_is_caught_and_nothing_is_kept() {
        let s = setup(Duration::ZERO);
        let stored = seed(&s.origin, b"what the origin has");
        // Move the stored file under another name: the origin now answers with wrong bytes.
        let wanted = Digest::of(b"what was asked for");
        let to = s.origin.inner().block_path(&wanted);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::rename(s.origin.inner().block_path(&stored), to).unwrap();
        assert!(matches!(
            s.flights.fetch(&wanted),
            Err(StoreError::Corrupt { .. })
        ));
        assert!(!s.local.has_local(&wanted));
    }

    #[tokio::test]
    async fn a_streaming_reader_gets_bytes_before_the_fetch_ends() {
        let s = setup(Duration::from_millis(5));
        let bytes = vec![7u8; 32 * 1024];
        let digest = seed(&s.origin, &bytes);
        let Joined::Started(flight) = s.flights.join(&digest) else {
            panic!("the first join starts the flight");
        };
        let driver = {
            let (flights, flight) = (s.flights.clone(), flight.clone());
            tokio::task::spawn_blocking(move || flights.drive(&flight))
        };
        flight.first_byte().await.unwrap();
        let mut received = Vec::new();
        let mut saw_partial = false;
        loop {
            match flight.next_chunk(received.len()).await {
                Progress::Bytes(piece) => {
                    received.extend_from_slice(&piece);
                    saw_partial |= flight.lock().outcome.is_none();
                }
                Progress::Done => break,
                Progress::Failed(f) => panic!("{f:?}"),
            }
        }
        driver.await.unwrap();
        assert_eq!(received, bytes);
        assert!(
            saw_partial,
            "bytes arrived while the origin was still sending"
        );
    }
}
