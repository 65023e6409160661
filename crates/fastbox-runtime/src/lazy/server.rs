//! A page server for `criu lazy-pages --page-server`: it answers the daemon's `PS_IOV_GET`
//! requests ([`super::protocol`]) with pages read from the tasks' pages images, which are
//! [`LazyFile`]s filled from DART blocks while they are read.
//!
//! Requests are answered one at a time, in order (the daemon matches answers to requests by
//! order). An answer carries the pages from the requested address up to the end of the first
//! block that is not here yet, and at least the first page (for which it waits): a page fault
//! then never waits behind a large background request whose later blocks are still on the
//! way; the daemon asks again for the rest.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::blocks::{BlockError, LazyFile};
use super::pagemap::{PAGE_SIZE, Pagemap};
use super::protocol::{Iov, PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE, PS_IOV_GET, write_close_status};

/// The largest request the daemon makes (CRIU's `MAX_XFER_LEN`, 4 MiB), in pages.
const MAX_REQUEST_PAGES: u64 = (4 << 20) / PAGE_SIZE;

/// Why a session ended badly. The daemon then fails, and so must the restore.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("page server connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("the lazy-pages daemon asked for unknown task {0}")]
    UnknownTask(u64),
    #[error("task {pid} has no pages at {vaddr:#x} (+{nr_pages} pages)")]
    NoPages { pid: u64, vaddr: u64, nr_pages: u64 },
    #[error("unsupported page server command {0:#x}")]
    Unsupported(u32),
    #[error(transparent)]
    Block(#[from] BlockError),
}

/// What one session served.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServeStats {
    /// `PS_IOV_GET` requests answered.
    pub requests: u64,
    /// Pages sent.
    pub pages: u64,
    /// Answers shorter than their request (the rest was not here yet).
    pub short_answers: u64,
    /// Time spent waiting for blocks before answering.
    pub waiting: Duration,
    /// Whether the daemon closed the session with `PS_IOV_CLOSE`/`PS_IOV_FORCE_CLOSE`
    /// (it does so after every page was transferred).
    pub closed: bool,
}

/// One task's pages: its pagemap and its pages image.
#[derive(Debug, Clone)]
struct Task {
    pagemap: Arc<Pagemap>,
    pages: Arc<LazyFile>,
}

/// The pages of the tasks of one checkpoint, by pid (the `N` of `pagemap-N.img`).
#[derive(Debug, Default)]
pub struct PageServer {
    tasks: HashMap<u64, Task>,
}

impl PageServer {
    /// A server without tasks.
    pub fn new() -> Self {
        Self::default()
    }

    /// Serves task `pid` from `pagemap` and its pages image `pages`.
    pub fn add_task(&mut self, pid: u64, pagemap: Arc<Pagemap>, pages: Arc<LazyFile>) {
        self.tasks.insert(pid, Task { pagemap, pages });
    }

    /// Serves one session on `conn` until the daemon closes it (or the connection ends).
    pub fn serve(&self, conn: &mut (impl Read + Write)) -> Result<ServeStats, ServeError> {
        let mut stats = ServeStats::default();
        let mut buf = Vec::new();
        while let Some(request) = Iov::read_from(conn)? {
            match request.command() {
                PS_IOV_GET => {
                    let clock = Instant::now();
                    let sent = self.answer(&request, &mut buf)?;
                    stats.waiting += clock.elapsed();
                    conn.write_all(&buf)?;
                    stats.requests += 1;
                    stats.pages += sent;
                    if sent < request.nr_pages {
                        stats.short_answers += 1;
                    }
                }
                PS_IOV_CLOSE | PS_IOV_FORCE_CLOSE => {
                    write_close_status(conn, 0)?;
                    conn.flush()?;
                    stats.closed = true;
                    return Ok(stats);
                }
                _ => return Err(ServeError::Unsupported(request.cmd)),
            }
        }
        Ok(stats)
    }

    /// Fills `out` with the answer to `request` (header and pages); returns the pages sent.
    fn answer(&self, request: &Iov, out: &mut Vec<u8>) -> Result<u64, ServeError> {
        let task = self
            .tasks
            .get(&request.dst_id)
            .ok_or(ServeError::UnknownTask(request.dst_id))?;
        let no_pages = || ServeError::NoPages {
            pid: request.dst_id,
            vaddr: request.vaddr,
            nr_pages: request.nr_pages,
        };
        let asked = request.nr_pages.min(MAX_REQUEST_PAGES);
        let range = task
            .pagemap
            .locate(request.vaddr, asked)
            .ok_or_else(no_pages)?;
        // The first page is waited for; the rest goes as far as the blocks already here. CRIU
        // asks one page for a fault and whole ranges when it copies the rest in the
        // background: only a fault holds the node's background fetches back.
        let first = range.start..range.start + PAGE_SIZE;
        if request.nr_pages == 1 {
            task.pages.ensure(first)?;
        } else {
            task.pages.ensure_in_background(first)?;
        }
        let ready = task.pages.ready_len(range.start, range.end - range.start);
        let len = (ready / PAGE_SIZE).max(1) * PAGE_SIZE;
        let nr_pages = len / PAGE_SIZE;
        out.clear();
        out.extend_from_slice(&Iov::pages_answer(request, nr_pages).to_bytes());
        let header = out.len();
        out.resize(header + len as usize, 0);
        task.pages.read_at(range.start, &mut out[header..])?;
        Ok(nr_pages)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lazy::blocks::tests::{MemorySource, pattern};
    use crate::lazy::pagemap::tests::image;
    use crate::lazy::pagemap::{PE_LAZY, PE_PRESENT};
    use crate::lazy::protocol::{IOV_LEN, PS_IOV_ADD_F};
    use std::os::unix::net::UnixStream;

    /// Asks `conn` for pages like the daemon does; returns the answer header and pages.
    fn get(conn: &mut UnixStream, pid: u64, vaddr: u64, nr_pages: u64) -> (Iov, Vec<u8>) {
        let request = Iov {
            cmd: PS_IOV_GET,
            nr_pages,
            vaddr,
            dst_id: pid,
        };
        request.write_to(conn).unwrap();
        let answer = Iov::read_from(conn).unwrap().unwrap();
        let mut pages = vec![0u8; (answer.nr_pages * PAGE_SIZE) as usize];
        conn.read_exact(&mut pages).unwrap();
        (answer, pages)
    }

    #[test]
    fn pages_come_from_their_blocks_and_answers_stop_at_missing_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let lazy = PE_PRESENT | PE_LAZY;
        // 16 lazy pages at 0x10000, a hole, 4 eager pages at 0x7ff0000: 20 pages in the file,
        // blocks of 4 pages.
        let pagemap = Arc::new(
            Pagemap::parse(&image(
                1,
                &[(0x10000, 16, lazy), (0x7ff0000, 4, PE_PRESENT)],
            ))
            .unwrap(),
        );
        let data = pattern(20 * PAGE_SIZE as usize);
        let (source, digests) =
            MemorySource::of(&data, 4 * PAGE_SIZE as usize, Duration::from_millis(5));
        let source = Arc::new(source);
        let pages = Arc::new(
            LazyFile::create(
                &dir.path().join("pages-1.img"),
                data.len() as u64,
                4 * PAGE_SIZE,
                digests,
                source.clone(),
            )
            .unwrap(),
        );
        let mut server = PageServer::new();
        server.add_task(1, pagemap, pages.clone());
        let (mut daemon, mut conn) = UnixStream::pair().unwrap();
        let serving = std::thread::spawn(move || server.serve(&mut conn));

        // A fault on page 5: one page, from block 1.
        let (answer, got) = get(&mut daemon, 1, 0x10000 + 5 * PAGE_SIZE, 1);
        assert_eq!(answer.command(), PS_IOV_ADD_F);
        assert_eq!(
            (answer.vaddr, answer.nr_pages),
            (0x10000 + 5 * PAGE_SIZE, 1)
        );
        assert_eq!(got, data[5 * 4096..6 * 4096]);
        assert_eq!(source.fetch_count(), 1);
        // A background request for pages 4..16: only block 1 (pages 4..8) is here.
        let (answer, got) = get(&mut daemon, 1, 0x10000 + 4 * PAGE_SIZE, 12);
        assert_eq!(answer.nr_pages, 4);
        assert_eq!(got, data[4 * 4096..8 * 4096]);
        // Once everything is here, a request gets all it asks, clamped to its entry.
        pages.prefetch(2).wait().unwrap();
        let (answer, got) = get(&mut daemon, 1, 0x10000 + 8 * PAGE_SIZE, 100);
        assert_eq!(answer.nr_pages, 8);
        assert_eq!(got, data[8 * 4096..16 * 4096]);
        let (_, got) = get(&mut daemon, 1, 0x7ff0000, 4);
        assert_eq!(got, data[16 * 4096..20 * 4096]);
        assert_eq!(source.fetch_count(), 5);

        Iov {
            cmd: PS_IOV_CLOSE,
            ..Default::default()
        }
        .write_to(&mut daemon)
        .unwrap();
        let mut status = [0u8; 4];
        daemon.read_exact(&mut status).unwrap();
        assert_eq!(i32::from_ne_bytes(status), 0);
        let stats = serving.join().unwrap().unwrap();
        assert_eq!(stats.requests, 4);
        assert_eq!(stats.pages, 1 + 4 + 8 + 4);
        assert_eq!(stats.short_answers, 2);
        assert!(stats.closed);
    }

    #[test]
    fn requests_outside_the_checkpoint_end_the_session() {
        let dir = tempfile::tempdir().unwrap();
        let pagemap =
            Arc::new(Pagemap::parse(&image(1, &[(0x10000, 1, PE_PRESENT | PE_LAZY)])).unwrap());
        let (source, digests) = MemorySource::of(&[1u8; 4096], 4096, Duration::ZERO);
        let pages = Arc::new(
            LazyFile::create(
                &dir.path().join("pages-1.img"),
                4096,
                4096,
                digests,
                Arc::new(source),
            )
            .unwrap(),
        );
        let mut server = PageServer::new();
        server.add_task(1, pagemap, pages);
        for (pid, vaddr) in [(2, 0x10000), (1, 0x20000)] {
            let (mut daemon, mut conn) = UnixStream::pair().unwrap();
            Iov {
                cmd: PS_IOV_GET,
                nr_pages: 1,
                vaddr,
                dst_id: pid,
            }
            .write_to(&mut daemon)
            .unwrap();
            let err = server.serve(&mut conn).unwrap_err();
            assert!(
                matches!(
                    (pid, &err),
                    (2, ServeError::UnknownTask(2)) | (1, ServeError::NoPages { .. })
                ),
                "{err}"
            );
        }
        // A request of the dump-side protocol (PS_IOV_ADD) is not served.
        let (mut daemon, mut conn) = UnixStream::pair().unwrap();
        daemon.write_all(&[1u8; IOV_LEN]).unwrap();
        assert!(matches!(
            server.serve(&mut conn),
            Err(ServeError::Unsupported(_))
        ));
    }
}
