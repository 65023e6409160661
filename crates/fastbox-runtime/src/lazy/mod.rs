//! Lazy restores: a restore that starts before the checkpoint's memory is local.
//!
//! A checkpoint's size is almost all `pages-N.img`: the private anonymous memory of its
//! tasks. CRIU can restore a tree without that memory (`criu restore --lazy-pages`): each
//! restored task gets a userfaultfd, a `criu lazy-pages` daemon ([`daemon`]) resolves its page
//! faults on demand and copies every other lazy page in the background, and the tree runs as
//! soon as the rest of the checkpoint is restored. Every page CRIU flags lazy in a normal dump
//! (`PE_LAZY`: private anonymous memory that is not a stack, not locked, not a special
//! mapping) qualifies; nothing changes at dump time.
//!
//! The daemon reads pages from a page server. Here that is [`server::PageServer`], which reads
//! each task's pages image through a [`blocks::LazyFile`]: the local `pages-N.img`, created
//! sparse and filled block by block from DART ([`blocks::BlockSource`]) both on demand (a
//! fault waits for the one block it lies in) and in the background (every block, in order,
//! each fetch started only when no fault waits: [`demand`]).
//! Pages are located through the task's pagemap ([`pagemap`]); the wire format is CRIU's own
//! ([`protocol`]).
//!
//! The order of a lazy restore from an artifact ([`crate::checkpoint::restore_lazy`] does
//! steps 2 to 4; [`restore`] documents them in detail):
//! 1. the caller materializes every file of the checkpoint except its pages images
//!    (`pages-*.img`): pagemaps, core images, the writable layer (small);
//! 2. for each task pagemap ([`pagemap::task_pagemaps`]) its pages image is created as a
//!    [`blocks::LazyFile`] and the blocks of [`pagemap::Pagemap::eager_ranges`] are fetched
//!    (the restore reads those itself), shared-memory pages images are fetched whole, then
//!    the background fetch starts ([`restore::LazySession::start`]);
//! 3. the daemon starts in the restore's work directory, then `criu restore --lazy-pages`
//!    runs with that work directory, killed at a deadline;
//! 4. the sandbox is ready when execd answers; [`restore::LazyTransfer::wait`] returns when
//!    every page is in place. If the transfer fails, its watcher kills the sandbox: a page the
//!    daemon never copied reads as zeros. A pause, snapshot or fork must wait for the
//!    transfer: a dump before then would not see the pages not copied yet.
//!
//! Contract: the page server answers only what the checkpoint holds and never a page whose
//! block is not verified and written; a fetch error ends the session, which fails the daemon,
//! which kills the sandbox.

pub mod blocks;
pub mod daemon;
mod demand;
pub mod pagemap;
pub(crate) mod pidfd;
pub mod protocol;
pub mod restore;
pub mod server;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;
