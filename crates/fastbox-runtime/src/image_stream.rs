//! The capture side of `criu dump --stream` (`docs/snapshots.md`, "How a capture is taken").
//!
//! A plain dump splices every memory page into an image file on the staging tmpfs while the
//! tree is frozen, and the file system allocates a page for each one: about 2 GB/s here. In
//! stream mode CRIU hands each image to a streamer instead, as a pipe
//! (`<images>/streamer-capture.sock`: a `u32` length and a protobuf `img_streamer_request_entry`
//! naming the file, then the pipe's read end over `SCM_RIGHTS`), and splices the pages into
//! that pipe, which moves page references without copying. [`Capture`] reads every pipe on a
//! reader thread (as many as CRIU has images open at once) into memory mapped and touched
//! before the dump, so the copy runs on the other core while CRIU goes on, and writes the
//! files out once the tree runs again. The copy is bound by memory bandwidth: 256 MiB from a
//! pipe into touched memory cost a C reader 70-77 ms here, the pages not in cache (into
//! fresh memory it is slower still: every page is allocated as it is written).
//!
//! The pipes hold references to the sandbox's own pages until they are read: the dump's
//! post-dump action waits on [`Capture::drain`] until every pages image has been read to its
//! end, and only then may CRIU let the tree run.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::thread::JoinHandle;

/// The socket CRIU connects to, in its images directory.
pub const SOCKET_NAME: &str = "streamer-capture.sock";
/// The socket's path through `dir`, a descriptor of the images directory: CRIU, given the
/// directory as `/proc/self/fd/N` too ([`crate::criu::Criu::dump`]), connects to the same
/// short path.
pub fn socket_path(dir: &impl std::os::fd::AsRawFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}/{SOCKET_NAME}", dir.as_raw_fd()))
}

/// How much of each image is read at once, and the unit the memory is handed out in.
const CHUNK: usize = 4 << 20;
/// The first buffer of every image (most are a few KiB; pages images grow into the arena).
const FIRST_CHUNK: usize = 64 << 10;
/// The longest file name a request may carry (a longer request is refused).
const MAX_NAME: usize = 4096;
/// The size CRIU's pipes are given (the usual `fs.pipe-max-size`); fewer round trips.
const PIPE_SIZE: i32 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("image streamer: {what}: {source}")]
    Io {
        what: &'static str,
        source: io::Error,
    },
    #[error("image streamer: CRIU sent a malformed request: {0}")]
    Protocol(&'static str),
    #[error("image streamer: a reader thread panicked")]
    Panicked,
    #[error("image streamer: the pages were not read within {0:?}")]
    DrainTimeout(std::time::Duration),
    #[error("image streamer: reading a pages image failed")]
    DrainFailed,
}

fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> StreamError {
    move |source| StreamError::Io { what, source }
}

/// Whether this host has room to touch `bytes` ahead: at most half of its available memory.
pub fn fits(bytes: u64) -> bool {
    available_memory().is_some_and(|available| bytes <= available / 2)
}

/// The host's available memory in bytes (`MemAvailable` of `/proc/meminfo`).
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib = line.split_whitespace().nth(1)?.parse::<u64>().ok()?;
    Some(kib * 1024)
}

/// Memory mapped and touched ahead, handed out in [`CHUNK`]s; chunks beyond it come from the
/// heap (slower to fill, never refused).
struct Arena {
    base: usize,
    len: usize,
    next: Mutex<usize>,
}

impl Arena {
    fn new(bytes: usize) -> Self {
        let len = bytes.div_ceil(CHUNK) * CHUNK;
        // SAFETY: a private anonymous mapping, owned by this arena and unmapped on drop.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED || len == 0 {
            return Self {
                base: 0,
                len: 0,
                next: Mutex::new(0),
            };
        }
        // Not handed to children: a fork (this process starts CRIU) would otherwise leave
        // every page write-protected, and the first write to each would fault (it made the
        // streamed dump no faster than a plain one).
        // SAFETY: advice on the mapping just made.
        unsafe { libc::madvise(base, len, libc::MADV_DONTFORK) };
        Self {
            base: base as usize,
            len,
            next: Mutex::new(0),
        }
    }

    fn chunk(self: &Arc<Self>) -> Chunk {
        let mut next = self.next.lock().expect("arena lock");
        if *next + CHUNK <= self.len {
            let offset = *next;
            *next += CHUNK;
            return Chunk::Arena {
                _arena: Arc::clone(self),
                start: self.base + offset,
                used: 0,
            };
        }
        Chunk::Heap(Vec::with_capacity(CHUNK))
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: the mapping made in `new`; no chunk outlives the arena (they hold it).
            unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
        }
    }
}

/// Part of one image's bytes.
enum Chunk {
    /// `CHUNK` bytes of the arena from address `start`, of which `used` are written; the
    /// arena is held so that its mapping outlives the chunk.
    Arena {
        _arena: Arc<Arena>,
        start: usize,
        used: usize,
    },
    Heap(Vec<u8>),
}

impl Chunk {
    fn spare(&mut self) -> &mut [u8] {
        match self {
            Self::Arena { start, used, .. } => {
                // SAFETY: `start..start + CHUNK` is this chunk's own range of the mapping,
                // which lives as long as the arena this chunk holds.
                unsafe {
                    std::slice::from_raw_parts_mut((*start + *used) as *mut u8, CHUNK - *used)
                }
            }
            Self::Heap(v) => spare_bytes(v),
        }
    }

    fn advance(&mut self, n: usize) {
        match self {
            Self::Arena { used, .. } => *used += n,
            // SAFETY: `n` bytes were just written into the spare capacity.
            Self::Heap(v) => unsafe { v.set_len(v.len() + n) },
        }
    }

    fn is_full(&self) -> bool {
        match self {
            Self::Arena { used, .. } => *used == CHUNK,
            Self::Heap(v) => v.len() == v.capacity(),
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            // SAFETY: the first `used` bytes of this chunk's own range were written.
            Self::Arena { start, used, .. } => unsafe {
                std::slice::from_raw_parts(*start as *const u8, *used)
            },
            Self::Heap(v) => v,
        }
    }
}

/// The spare capacity of `v` as bytes to read into.
fn spare_bytes(v: &mut Vec<u8>) -> &mut [u8] {
    let spare = v.spare_capacity_mut();
    // SAFETY: u8 has no invalid bit patterns; the bytes are only counted once written
    // (`Chunk::advance`).
    unsafe { std::slice::from_raw_parts_mut(spare.as_mut_ptr().cast::<u8>(), spare.len()) }
}

/// One streamed image.
struct Image {
    name: String,
    chunks: Vec<Chunk>,
}

/// Pages images not yet read to their end (the drain waits for none), and whether reading
/// one failed.
#[derive(Default)]
struct Pending {
    pages: Mutex<(usize, bool)>,
    drained: Condvar,
}

/// How long the drain waits for the pages to be read before it fails the dump.
const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

/// A running capture of one dump's images (see the module docs).
pub struct Capture {
    images: PathBuf,
    /// The images directory, held open: the socket is reached through its `/proc/self/fd`
    /// path, short whatever the directory's own path (a socket path has at most 107 bytes).
    dir: File,
    accept: Option<JoinHandle<Result<Vec<Image>, StreamError>>>,
    pending: Arc<Pending>,
}

/// Waits for the pages of a [`Capture`] to be read ([`Capture::drain`]).
#[derive(Clone)]
pub struct Drain(Arc<Pending>);

impl Drain {
    /// Blocks until every pages image CRIU sent so far has been read to its end (at most
    /// [`DRAIN_TIMEOUT`]). Called at post-dump, when CRIU has sent them all.
    pub fn wait(&self) -> Result<(), StreamError> {
        let left = self.0.pages.lock().expect("drain lock");
        let (left, timeout) = self
            .0
            .drained
            .wait_timeout_while(left, DRAIN_TIMEOUT, |(open, _)| *open > 0)
            .expect("drain lock");
        if timeout.timed_out() {
            Err(StreamError::DrainTimeout(DRAIN_TIMEOUT))
        } else if left.1 {
            Err(StreamError::DrainFailed)
        } else {
            Ok(())
        }
    }
}

impl std::fmt::Debug for Capture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Capture")
            .field("images", &self.images)
            .finish_non_exhaustive()
    }
}

impl Capture {
    /// Listens in `images` (CRIU's images directory) for a dump of about `bytes` of images,
    /// with that much memory touched ahead.
    pub fn start(images: &Path, bytes: u64) -> Result<Self, StreamError> {
        std::fs::create_dir_all(images).map_err(io_err("create the images directory"))?;
        let _ = std::fs::remove_file(images.join(SOCKET_NAME));
        let dir = File::open(images).map_err(io_err("open the images directory"))?;
        let listener = UnixListener::bind(socket_path(&dir)).map_err(io_err("listen"))?;
        let arena = Arc::new(Arena::new(usize::try_from(bytes).unwrap_or(usize::MAX)));
        let pending = Arc::new(Pending::default());
        let accept = {
            let pending = Arc::clone(&pending);
            std::thread::Builder::new()
                .name("fastbox-stream".into())
                .spawn(move || serve(&listener, &arena, &pending))
                .map_err(io_err("start"))?
        };
        Ok(Self {
            images: images.to_path_buf(),
            dir,
            accept: Some(accept),
            pending,
        })
    }

    /// What the post-dump action waits on: every pages image read to its end.
    pub fn drain(&self) -> Drain {
        Drain(Arc::clone(&self.pending))
    }

    /// After the dump: every image written into the images directory as a file (the socket
    /// removed). Returns the bytes written.
    pub fn finish(mut self) -> Result<u64, StreamError> {
        let images = self.collect()?;
        let mut total = 0;
        for image in images {
            let path = self.images.join(&image.name);
            let mut file = File::create(&path).map_err(io_err("create an image file"))?;
            for chunk in &image.chunks {
                file.write_all(chunk.bytes())
                    .map_err(io_err("write an image file"))?;
                total += chunk.bytes().len() as u64;
            }
        }
        Ok(total)
    }

    /// Ends the capture (a dump that never connected is let go) and returns what it read.
    fn collect(&mut self) -> Result<Vec<Image>, StreamError> {
        let socket = socket_path(&self.dir);
        let Some(accept) = self.accept.take() else {
            return Ok(Vec::new());
        };
        if !accept.is_finished() {
            // Nobody connected (the dump failed first): a connection that closes at once
            // ends the waiting accept.
            let _ = UnixStream::connect(&socket);
        }
        let read = accept.join().map_err(|_| StreamError::Panicked)?;
        let _ = std::fs::remove_file(self.images.join(SOCKET_NAME));
        read
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        let _ = self.collect();
    }
}

/// Accepts CRIU's connection and reads every image it sends ([`Readers`]).
fn serve(
    listener: &UnixListener,
    arena: &Arc<Arena>,
    pending: &Arc<Pending>,
) -> Result<Vec<Image>, StreamError> {
    let (mut conn, _) = listener.accept().map_err(io_err("accept"))?;
    let mut readers = Readers::new(Arc::clone(arena), Arc::clone(pending));
    let result = loop {
        match next_request(&mut conn) {
            Ok(Some((name, pipe))) => {
                if let Err(e) = readers.read(name, pipe) {
                    break Err(e);
                }
            }
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        }
    };
    let images = readers.finish();
    result.and(images)
}

/// The images whose end the drain waits for.
const PAGES_PREFIX: &str = "pages-";

/// The threads that read the images. CRIU keeps few images open at a time (a task's pagemap
/// and pages together), so a reader that finished its image takes the next one, and a new
/// thread starts only when every reader is busy: a tree of many processes does not start a
/// thread per image while it is frozen.
struct Readers {
    jobs: Option<mpsc::Sender<(String, File)>>,
    queue: Arc<Mutex<mpsc::Receiver<(String, File)>>>,
    /// Readers waiting for an image.
    idle: Arc<Mutex<usize>>,
    threads: Vec<JoinHandle<Vec<Result<Image, StreamError>>>>,
    arena: Arc<Arena>,
    pending: Arc<Pending>,
}

impl Readers {
    fn new(arena: Arc<Arena>, pending: Arc<Pending>) -> Self {
        let (jobs, queue) = mpsc::channel();
        Self {
            jobs: Some(jobs),
            queue: Arc::new(Mutex::new(queue)),
            idle: Arc::new(Mutex::new(0)),
            threads: Vec::new(),
            arena,
            pending,
        }
    }

    /// Hands image `name`, arriving through `pipe`, to an idle reader or a new one; a pages
    /// image is pending for the drain until read to its end.
    fn read(&mut self, name: String, pipe: File) -> Result<(), StreamError> {
        if name.starts_with(PAGES_PREFIX) {
            self.pending.pages.lock().expect("drain lock").0 += 1;
        }
        {
            let mut idle = self.idle.lock().expect("readers lock");
            if *idle > 0 {
                *idle -= 1;
            } else {
                let (queue, idle) = (Arc::clone(&self.queue), Arc::clone(&self.idle));
                let (arena, pending) = (Arc::clone(&self.arena), Arc::clone(&self.pending));
                let thread = std::thread::Builder::new()
                    .name("fastbox-stream-read".into())
                    .spawn(move || read_images(&queue, &idle, &arena, &pending))
                    .map_err(io_err("start a reader"))?;
                self.threads.push(thread);
            }
        }
        let jobs = self.jobs.as_ref().expect("readers running");
        jobs.send((name, pipe)).map_err(|_| StreamError::Panicked)
    }

    /// Waits for every reader; what they read.
    fn finish(mut self) -> Result<Vec<Image>, StreamError> {
        drop(self.jobs.take());
        let mut images = Vec::new();
        for thread in self.threads.drain(..) {
            for read in thread.join().map_err(|_| StreamError::Panicked)? {
                images.push(read?);
            }
        }
        Ok(images)
    }
}

/// A reader: reads the images it is handed until there are no more.
fn read_images(
    queue: &Mutex<mpsc::Receiver<(String, File)>>,
    idle: &Mutex<usize>,
    arena: &Arc<Arena>,
    pending: &Pending,
) -> Vec<Result<Image, StreamError>> {
    let mut done = Vec::new();
    loop {
        let next = queue.lock().expect("readers lock").recv();
        let Ok((name, pipe)) = next else {
            return done;
        };
        let is_pages = name.starts_with(PAGES_PREFIX);
        let read = read_image(name, pipe, arena);
        if is_pages {
            let mut left = pending.pages.lock().expect("drain lock");
            left.0 -= 1;
            left.1 |= read.is_err();
            pending.drained.notify_all();
        }
        done.push(read);
        *idle.lock().expect("readers lock") += 1;
    }
}

/// The next file CRIU streams: its name and the pipe it comes through; `None` at the end.
fn next_request(conn: &mut UnixStream) -> Result<Option<(String, File)>, StreamError> {
    let mut head = [0u8; 4];
    match conn.read_exact(&mut head) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(io_err("read a request")(e)),
    }
    let len = u32::from_le_bytes(head) as usize;
    if len > MAX_NAME + 16 {
        return Err(StreamError::Protocol("a request longer than any file name"));
    }
    let mut message = vec![0u8; len];
    conn.read_exact(&mut message)
        .map_err(io_err("read a request"))?;
    let name = request_name(&message)?;
    let fd = receive_fd(conn)?;
    // Best effort: a bigger pipe only saves round trips.
    // SAFETY: fcntl on the descriptor just received.
    unsafe {
        libc::fcntl(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            libc::F_SETPIPE_SZ,
            PIPE_SIZE,
        )
    };
    Ok(Some((name, File::from(fd))))
}

/// Field 1 (`filename`) of an `img_streamer_request_entry`; only a plain file name.
fn request_name(message: &[u8]) -> Result<String, StreamError> {
    let Some((&0x0a, rest)) = message.split_first() else {
        return Err(StreamError::Protocol("no file name"));
    };
    let (mut len, mut shift, mut used) = (0usize, 0u32, 0usize);
    for &b in rest.iter().take(5) {
        len |= usize::from(b & 0x7f) << shift;
        shift += 7;
        used += 1;
        if b < 0x80 {
            break;
        }
    }
    let name = rest
        .get(used..used + len)
        .ok_or(StreamError::Protocol("a file name past the message"))?;
    let name =
        std::str::from_utf8(name).map_err(|_| StreamError::Protocol("a file name not UTF-8"))?;
    if name.is_empty() || name.contains('/') || name == "." || name == ".." {
        return Err(StreamError::Protocol(
            "a file name that is not a plain name",
        ));
    }
    Ok(name.to_string())
}

/// The descriptor CRIU sends after a request (one byte of data with it).
fn receive_fd(conn: &UnixStream) -> Result<OwnedFd, StreamError> {
    use std::os::fd::AsRawFd as _;
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut control = [0u8; 64];
    // SAFETY: a zeroed msghdr pointing at buffers that outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len();
    // SAFETY: recvmsg into the buffers above.
    let n = unsafe { libc::recvmsg(conn.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io_err("receive a pipe")(io::Error::last_os_error()));
    }
    // SAFETY: walking the control messages recvmsg filled in.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if cmsg.is_null()
            || (*cmsg).cmsg_level != libc::SOL_SOCKET
            || (*cmsg).cmsg_type != libc::SCM_RIGHTS
        {
            return Err(StreamError::Protocol("a request without its pipe"));
        }
        let fd = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<i32>());
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

/// Reads one image from its pipe until CRIU closes it.
fn read_image(name: String, mut pipe: File, arena: &Arc<Arena>) -> Result<Image, StreamError> {
    // Most images are small: only what outgrows a first small buffer takes arena chunks.
    let mut chunks = vec![Chunk::Heap(Vec::with_capacity(FIRST_CHUNK))];
    loop {
        let chunk = chunks.last_mut().expect("one chunk");
        if chunk.is_full() {
            chunks.push(arena.chunk());
            continue;
        }
        match pipe.read(chunk.spare()) {
            Ok(0) => return Ok(Image { name, chunks }),
            Ok(n) => chunk.advance(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err("read an image")(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_names_are_plain_file_names() {
        assert_eq!(request_name(b"\x0a\x0bpages-1.img").unwrap(), "pages-1.img");
        for bad in [
            &b"\x0a\x05../x"[..],
            b"\x0a\x00",
            b"\x12\x01a",
            b"\x0a\x09short",
            b"",
        ] {
            assert!(request_name(bad).is_err(), "{bad:?}");
        }
    }

    fn readers() -> (Readers, Arc<Pending>) {
        let pending = Arc::new(Pending::default());
        let arena = Arc::new(Arena::new(CHUNK * 2));
        (Readers::new(arena, Arc::clone(&pending)), pending)
    }

    /// The contents of `images` by name.
    fn contents(images: Vec<Image>) -> std::collections::BTreeMap<String, Vec<u8>> {
        images
            .into_iter()
            .map(|image| {
                let bytes = image
                    .chunks
                    .iter()
                    .flat_map(|c| c.bytes().to_vec())
                    .collect();
                (image.name, bytes)
            })
            .collect()
    }

    #[test]
    fn images_one_after_another_share_one_reader() {
        let (mut readers, pending) = readers();
        for i in 0..20 {
            let (from, mut to) = std::io::pipe().unwrap();
            to.write_all(format!("image {i}").as_bytes()).unwrap();
            drop(to);
            readers
                .read(format!("pages-{i}.img"), File::from(OwnedFd::from(from)))
                .unwrap();
            // The reader is idle again before the next image comes.
            while *readers.idle.lock().unwrap() == 0 {
                std::thread::yield_now();
            }
        }
        assert_eq!(readers.threads.len(), 1);
        let images = contents(readers.finish().unwrap());
        assert_eq!(images.len(), 20);
        assert_eq!(images["pages-7.img"], b"image 7");
        assert_eq!(*pending.pages.lock().unwrap(), (0, false));
    }

    #[test]
    fn images_open_at_once_get_a_reader_each() {
        // CRIU writes a task's pagemap and pages images in turns: neither may wait for the
        // other's end.
        let (mut readers, _) = readers();
        let (pagemap, mut pagemap_in) = std::io::pipe().unwrap();
        let (pages, mut pages_in) = std::io::pipe().unwrap();
        readers
            .read("pagemap-1.img".into(), File::from(OwnedFd::from(pagemap)))
            .unwrap();
        readers
            .read("pages-1.img".into(), File::from(OwnedFd::from(pages)))
            .unwrap();
        pages_in.write_all(&[7u8; 100_000]).unwrap();
        pagemap_in.write_all(b"entries").unwrap();
        pages_in.write_all(&[8u8; 100_000]).unwrap();
        drop((pagemap_in, pages_in));
        assert_eq!(readers.threads.len(), 2);
        let images = contents(readers.finish().unwrap());
        assert_eq!(images["pagemap-1.img"], b"entries");
        let pages = &images["pages-1.img"];
        assert_eq!(pages.len(), 200_000);
        assert!(
            pages[..100_000].iter().all(|&b| b == 7) && pages[100_000..].iter().all(|&b| b == 8)
        );
    }
}
