//! CRIU's `pagemap-<id>.img`: which virtual pages of one task (or one shared-memory segment)
//! the checkpoint holds, and where each lies in the raw `pages-<pages_id>.img` beside it.
//!
//! The image is CRIU's usual framing: two little-endian `u32` magics (the common image magic,
//! then the pagemap magic), then protobuf messages each preceded by its `u32` length. The first
//! message is `pagemap_head { pages_id }`, every other one a `pagemap_entry { vaddr,
//! compat_nr_pages, in_parent, flags, nr_pages }` (CRIU's `images/pagemap.proto`). The pages
//! image has no header: the pages of the entries flagged [`PE_PRESENT`] follow each other in
//! entry order, so an entry's offset is the sum of the sizes of the present entries before it.
//!
//! Only the five fields above are decoded (a tiny protobuf reader; unknown fields are skipped),
//! so no protobuf dependency is needed.

use std::ops::Range;
use std::path::{Path, PathBuf};

/// The page size of the checkpoints fastbox takes (x86_64).
pub const PAGE_SIZE: u64 = 4096;
/// The entry's pages are in the parent checkpoint (incremental dumps; fastbox takes none).
pub const PE_PARENT: u32 = 1 << 0;
/// The entry's pages may be restored lazily (private anonymous memory, not a stack).
pub const PE_LAZY: u32 = 1 << 1;
/// The entry's pages are in this checkpoint's pages image.
pub const PE_PRESENT: u32 = 1 << 2;

/// CRIU's `IMG_COMMON_MAGIC`, the first word of every non-raw image.
const IMG_COMMON_MAGIC: u32 = 0x5456_4319;
/// CRIU's `PAGEMAP_MAGIC` (also that of shared-memory pagemaps).
const PAGEMAP_MAGIC: u32 = 0x5608_4025;

/// Why a pagemap image cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PagemapError {
    #[error("read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("not a CRIU pagemap image (magic {0:#010x} {1:#010x})")]
    Magic(u32, u32),
    #[error("pagemap image truncated at byte {0}")]
    Truncated(usize),
    #[error("malformed protobuf at byte {0}")]
    Protobuf(usize),
    #[error("pagemap image has no head")]
    NoHead,
    #[error("pagemap entry at {vaddr:#x} overlaps or precedes the one before it")]
    Unordered { vaddr: u64 },
    #[error("pagemap entry at {vaddr:#x} is in a parent checkpoint, which fastbox never takes")]
    InParent { vaddr: u64 },
}

/// One run of pages of a pagemap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagemapEntry {
    /// The virtual address of the first page.
    pub vaddr: u64,
    /// How many pages follow from `vaddr`.
    pub nr_pages: u64,
    /// `PE_*` bits.
    pub flags: u32,
    /// Byte offset of the first page in the pages image (meaningful when present).
    pub offset: u64,
}

impl PagemapEntry {
    /// The end of the entry's address range.
    pub fn end(&self) -> u64 {
        self.vaddr + self.nr_pages * PAGE_SIZE
    }

    /// Whether the entry's pages are in the pages image.
    pub fn is_present(&self) -> bool {
        self.flags & PE_PRESENT != 0
    }

    /// Whether a lazy restore leaves these pages to the lazy-pages daemon.
    pub fn is_lazy(&self) -> bool {
        self.flags & PE_LAZY != 0
    }

    /// The entry's bytes in the pages image.
    pub fn file_range(&self) -> Range<u64> {
        self.offset..self.offset + self.nr_pages * PAGE_SIZE
    }
}

/// A parsed pagemap image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pagemap {
    /// The `N` of the `pages-N.img` holding the pages.
    pub pages_id: u32,
    /// The entries in image order (ascending, non-overlapping addresses).
    pub entries: Vec<PagemapEntry>,
}

impl Pagemap {
    /// Reads and parses `path`.
    pub fn read(path: &Path) -> Result<Self, PagemapError> {
        let bytes = std::fs::read(path).map_err(|source| PagemapError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&bytes)
    }

    /// Parses the bytes of a pagemap image.
    pub fn parse(bytes: &[u8]) -> Result<Self, PagemapError> {
        let mut at = 0;
        let magic = read_u32(bytes, &mut at)?;
        let kind = read_u32(bytes, &mut at)?;
        if magic != IMG_COMMON_MAGIC || kind != PAGEMAP_MAGIC {
            return Err(PagemapError::Magic(magic, kind));
        }
        let mut pages_id = None;
        let mut entries: Vec<PagemapEntry> = Vec::new();
        let mut offset = 0;
        while at < bytes.len() {
            let len = read_u32(bytes, &mut at)? as usize;
            let msg = bytes.get(at..at + len).ok_or(PagemapError::Truncated(at))?;
            let fields = Fields::parse(msg, at)?;
            at += len;
            if pages_id.is_none() {
                pages_id = Some(fields.get(1).unwrap_or(0) as u32);
                continue;
            }
            let entry = entry_from(&fields, offset)?;
            if entries.last().is_some_and(|prev| prev.end() > entry.vaddr) {
                return Err(PagemapError::Unordered { vaddr: entry.vaddr });
            }
            if entry.is_present() {
                offset += entry.nr_pages * PAGE_SIZE;
            }
            entries.push(entry);
        }
        Ok(Self {
            pages_id: pages_id.ok_or(PagemapError::NoHead)?,
            entries,
        })
    }

    /// The file name of the pages image.
    pub fn pages_file_name(&self) -> String {
        format!("pages-{}.img", self.pages_id)
    }

    /// The size the pages image must have.
    pub fn pages_file_len(&self) -> u64 {
        self.entries
            .iter()
            .filter(|e| e.is_present())
            .map(|e| e.nr_pages * PAGE_SIZE)
            .sum()
    }

    /// Where `nr_pages` pages from `vaddr` are in the pages image: the byte range, clamped to
    /// the present entry that holds `vaddr` (CRIU never asks across entries). `None` when no
    /// present entry holds `vaddr` or `vaddr` is not page-aligned.
    pub fn locate(&self, vaddr: u64, nr_pages: u64) -> Option<Range<u64>> {
        if !vaddr.is_multiple_of(PAGE_SIZE) || nr_pages == 0 {
            return None;
        }
        let i = self.entries.partition_point(|e| e.end() <= vaddr);
        let entry = self.entries.get(i).filter(|e| e.vaddr <= vaddr)?;
        if !entry.is_present() {
            return None;
        }
        let skip = vaddr - entry.vaddr;
        let len = (nr_pages * PAGE_SIZE).min(entry.end() - vaddr);
        Some(entry.offset + skip..entry.offset + skip + len)
    }

    /// The byte ranges of the pages image that `criu restore --lazy-pages` reads itself (the
    /// present pages not flagged lazy: stacks, locked and special mappings), merged.
    pub fn eager_ranges(&self) -> Vec<Range<u64>> {
        let mut out: Vec<Range<u64>> = Vec::new();
        for entry in self
            .entries
            .iter()
            .filter(|e| e.is_present() && !e.is_lazy())
        {
            let range = entry.file_range();
            match out.last_mut() {
                Some(last) if last.end == range.start => last.end = range.end,
                _ => out.push(range),
            }
        }
        out
    }

    /// Pages a lazy restore leaves to the lazy-pages daemon.
    pub fn lazy_pages(&self) -> u64 {
        self.entries
            .iter()
            .filter(|e| e.is_present() && e.is_lazy())
            .map(|e| e.nr_pages)
            .sum()
    }
}

/// The task pagemaps (`pagemap-<pid>.img`, not the `pagemap-shmem-*` ones) of a CRIU images
/// directory, by pid in the checkpoint's pid namespace: the pages a lazy restore can leave to
/// the page server. Every other `pages-*.img` (shared memory) is read by the restore itself.
pub fn task_pagemaps(images: &Path) -> Result<Vec<(u64, Pagemap)>, PagemapError> {
    let read_err = |source| PagemapError::Read {
        path: images.to_path_buf(),
        source,
    };
    let mut out = Vec::new();
    for entry in std::fs::read_dir(images).map_err(read_err)? {
        let entry = entry.map_err(read_err)?;
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("pagemap-"))
            .and_then(|n| n.strip_suffix(".img"))
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        out.push((pid, Pagemap::read(&entry.path())?));
    }
    out.sort_by_key(|(pid, _)| *pid);
    Ok(out)
}

/// An entry from its decoded fields, CRIU's `init_compat_pagemap_entry` applied: an old image
/// without `flags` means present, without `nr_pages` the 32-bit count.
fn entry_from(fields: &Fields, offset: u64) -> Result<PagemapEntry, PagemapError> {
    let vaddr = fields.get(1).unwrap_or(0);
    let in_parent = fields.get(3).is_some_and(|v| v != 0);
    let flags = match fields.get(4) {
        _ if in_parent => PE_PARENT,
        Some(flags) => flags as u32,
        None => PE_PRESENT,
    };
    if flags & PE_PARENT != 0 {
        return Err(PagemapError::InParent { vaddr });
    }
    let nr_pages = fields.get(5).or_else(|| fields.get(2)).unwrap_or(0);
    Ok(PagemapEntry {
        vaddr,
        nr_pages,
        flags,
        offset,
    })
}

fn read_u32(bytes: &[u8], at: &mut usize) -> Result<u32, PagemapError> {
    let word = bytes
        .get(*at..*at + 4)
        .ok_or(PagemapError::Truncated(*at))?;
    *at += 4;
    Ok(u32::from_le_bytes([word[0], word[1], word[2], word[3]]))
}

/// The varint fields 1 to 5 of one protobuf message (the last occurrence wins, as in
/// protobuf); fields of other wire types are skipped.
struct Fields([Option<u64>; 6]);

impl Fields {
    fn parse(msg: &[u8], base: usize) -> Result<Self, PagemapError> {
        let mut fields = [None; 6];
        let mut at = 0;
        let bad = |at: usize| PagemapError::Protobuf(base + at);
        while at < msg.len() {
            let key = varint(msg, &mut at).ok_or_else(|| bad(at))?;
            let (number, wire) = (key >> 3, key & 7);
            match wire {
                0 => {
                    let value = varint(msg, &mut at).ok_or_else(|| bad(at))?;
                    if let Some(slot) = fields.get_mut(number as usize) {
                        *slot = Some(value);
                    }
                }
                1 => at += 8,
                2 => {
                    let len = varint(msg, &mut at).ok_or_else(|| bad(at))?;
                    at += usize::try_from(len).map_err(|_| bad(at))?;
                }
                5 => at += 4,
                _ => return Err(bad(at)),
            }
            if at > msg.len() {
                return Err(bad(at));
            }
        }
        Ok(Self(fields))
    }

    fn get(&self, number: usize) -> Option<u64> {
        self.0.get(number).copied().flatten()
    }
}

/// A protobuf base-128 varint at `*at`.
fn varint(bytes: &[u8], at: &mut usize) -> Option<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *bytes.get(*at)?;
        *at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn put_varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    /// The bytes of a pagemap image with `pages_id` and `(vaddr, nr_pages, flags)` entries,
    /// written the way CRIU 4.2 writes them (`compat_nr_pages` 0, `nr_pages` set).
    pub(crate) fn image(pages_id: u32, entries: &[(u64, u64, u32)]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&IMG_COMMON_MAGIC.to_le_bytes());
        out.extend_from_slice(&PAGEMAP_MAGIC.to_le_bytes());
        let mut head = vec![0x08];
        put_varint(&mut head, u64::from(pages_id));
        out.extend_from_slice(&(head.len() as u32).to_le_bytes());
        out.extend_from_slice(&head);
        for &(vaddr, nr, flags) in entries {
            let mut msg = vec![0x08];
            put_varint(&mut msg, vaddr);
            msg.extend_from_slice(&[0x10, 0x00, 0x20]);
            put_varint(&mut msg, u64::from(flags));
            msg.push(0x28);
            put_varint(&mut msg, nr);
            out.extend_from_slice(&(msg.len() as u32).to_le_bytes());
            out.extend_from_slice(&msg);
        }
        out
    }

    #[test]
    fn offsets_follow_the_present_entries() {
        let lazy = PE_PRESENT | PE_LAZY;
        let bytes = image(
            7,
            &[
                (0x1000, 2, lazy),
                (0x10000, 3, 0), // a hole: not in the pages image
                (0x20000, 1, PE_PRESENT),
                (0x7fff_0000, 4, lazy),
            ],
        );
        let map = Pagemap::parse(&bytes).unwrap();
        assert_eq!(map.pages_id, 7);
        assert_eq!(map.pages_file_name(), "pages-7.img");
        let offsets: Vec<u64> = map.entries.iter().map(|e| e.offset).collect();
        assert_eq!(offsets, [0, 8192, 8192, 12288]);
        assert_eq!(map.pages_file_len(), 7 * PAGE_SIZE);
        assert_eq!(map.lazy_pages(), 6);
        assert_eq!(
            map.eager_ranges(),
            vec![Range {
                start: 8192,
                end: 12288
            }]
        );
        // A request is clamped to its entry; addresses outside present entries have no pages.
        assert_eq!(map.locate(0x2000, 16), Some(4096..8192));
        assert_eq!(map.locate(0x7fff_1000, 2), Some(16384..24576));
        assert_eq!(map.locate(0x10000, 1), None);
        assert_eq!(map.locate(0x5000, 1), None);
        assert_eq!(map.locate(0x1001, 1), None);
    }

    #[test]
    fn old_entries_without_flags_are_present_and_parents_are_refused() {
        let mut bytes = image(1, &[]);
        let msg = [0x08, 0x80, 0x20, 0x10, 0x03]; // vaddr 0x1000, compat_nr_pages 3
        bytes.extend_from_slice(&(msg.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&msg);
        let map = Pagemap::parse(&bytes).unwrap();
        assert_eq!(map.entries[0].nr_pages, 3);
        assert!(map.entries[0].is_present() && !map.entries[0].is_lazy());

        let parent = image(1, &[(0x1000, 1, PE_PARENT)]);
        assert!(matches!(
            Pagemap::parse(&parent),
            Err(PagemapError::InParent { vaddr: 0x1000 })
        ));
    }

    #[test]
    fn task_pagemaps_are_found_by_name() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("pagemap-12.img"), image(3, &[])).unwrap();
        std::fs::write(dir.path().join("pagemap-1.img"), image(2, &[])).unwrap();
        std::fs::write(dir.path().join("pagemap-shmem-77.img"), image(4, &[])).unwrap();
        std::fs::write(dir.path().join("pages-2.img"), b"").unwrap();
        let found: Vec<(u64, u32)> = task_pagemaps(dir.path())
            .unwrap()
            .into_iter()
            .map(|(pid, map)| (pid, map.pages_id))
            .collect();
        assert_eq!(found, [(1, 2), (12, 3)]);
    }

    #[test]
    fn damaged_images_are_refused() {
        assert!(matches!(
            Pagemap::parse(b"not an image"),
            Err(PagemapError::Magic(..))
        ));
        let bytes = image(1, &[(0x1000, 1, PE_PRESENT)]);
        assert!(matches!(
            Pagemap::parse(&bytes[..bytes.len() - 2]),
            Err(PagemapError::Truncated(_))
        ));
        let unordered = image(1, &[(0x3000, 2, PE_PRESENT), (0x4000, 1, PE_PRESENT)]);
        assert!(matches!(
            Pagemap::parse(&unordered),
            Err(PagemapError::Unordered { vaddr: 0x4000 })
        ));
    }
}
