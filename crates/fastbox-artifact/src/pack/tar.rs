//! Canonical tar archives: the same tree always gives the same bytes (see the parent module).

use std::collections::HashMap;
use std::fs::{File, Metadata};
use std::io::{self, Read, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use tar::{Builder, EntryType, Header};

use super::PackError;
use crate::entry::MODE_MASK;
use crate::tree::{self, TreeEntry};

/// The PAX record prefix for extended attributes (GNU tar, bsdtar and the tar crate read it).
const XATTR_PAX_PREFIX: &str = "SCHILY.xattr.";

/// Write a canonical tar of `rootfs` to `out`.
pub fn write(rootfs: &Path, out: &mut File) -> Result<(), PackError> {
    let mut builder = Builder::new(io::BufWriter::new(out));
    builder.follow_symlinks(false);
    // The first path of each multiply-linked file, by (device, inode).
    let mut first_links: HashMap<(u64, u64), PathBuf> = HashMap::new();
    for entry in tree::walk(rootfs)? {
        let io_error = |op| {
            let path = entry.path.clone();
            move |source| PackError::Io { op, path, source }
        };
        let md = &entry.metadata;
        if md.file_type().is_socket() {
            tracing::debug!(path = %entry.path.display(), "socket skipped");
            continue;
        }
        append_xattrs(&mut builder, &entry)?;
        let mut header = base_header(md);
        if md.is_file() && md.nlink() > 1 {
            let inode = (md.dev(), md.ino());
            if let Some(first) = first_links.get(&inode) {
                header.set_entry_type(EntryType::Link);
                builder
                    .append_link(&mut header, &entry.relative, first)
                    .map_err(io_error("archive"))?;
                continue;
            }
            first_links.insert(inode, entry.relative.clone());
        }
        let file_type = md.file_type();
        if file_type.is_file() {
            header.set_entry_type(EntryType::Regular);
            header.set_size(md.len());
            let file = File::open(&entry.path).map_err(io_error("open"))?;
            let mut counted = Counted {
                inner: file,
                read: 0,
            };
            builder
                .append_data(&mut header, &entry.relative, &mut counted)
                .map_err(io_error("archive"))?;
            if counted.read != md.len() {
                return Err(PackError::Changed {
                    path: entry.path.clone(),
                    expected: md.len(),
                    read: counted.read,
                });
            }
        } else if file_type.is_symlink() {
            header.set_entry_type(EntryType::Symlink);
            let target = std::fs::read_link(&entry.path).map_err(io_error("read link"))?;
            builder
                .append_link(&mut header, &entry.relative, target)
                .map_err(io_error("archive"))?;
        } else {
            let entry_type = if file_type.is_dir() {
                EntryType::Directory
            } else if file_type.is_char_device() {
                EntryType::Char
            } else if file_type.is_block_device() {
                EntryType::Block
            } else {
                EntryType::Fifo
            };
            header.set_entry_type(entry_type);
            if matches!(entry_type, EntryType::Char | EntryType::Block) {
                let rdev = md.rdev();
                header
                    .set_device_major(nix::sys::stat::major(rdev) as u32)
                    .and_then(|()| header.set_device_minor(nix::sys::stat::minor(rdev) as u32))
                    .map_err(io_error("archive"))?;
            }
            builder
                .append_data(&mut header, &entry.relative, io::empty())
                .map_err(io_error("archive"))?;
        }
    }
    let writer = builder.into_inner().map_err(|source| PackError::Io {
        op: "finish",
        path: rootfs.to_path_buf(),
        source,
    })?;
    writer
        .into_inner()
        .map_err(|e| e.into_error())
        .and_then(|file| file.flush())
        .map_err(|source| PackError::Io {
            op: "write",
            path: rootfs.to_path_buf(),
            source,
        })
}

/// A header with everything but the type and size: permission bits, numeric owner, mtime 0,
/// no user or group names.
fn base_header(md: &Metadata) -> Header {
    let mut header = Header::new_gnu();
    header.set_mode(md.mode() & MODE_MASK);
    header.set_uid(md.uid().into());
    header.set_gid(md.gid().into());
    header.set_mtime(0);
    header.set_size(0);
    header
}

/// A PAX record of the entry's extended attributes, sorted by name, if it has any.
fn append_xattrs<W: Write>(builder: &mut Builder<W>, entry: &TreeEntry) -> Result<(), PackError> {
    let io_error = |source| PackError::Io {
        op: "read xattrs of",
        path: entry.path.clone(),
        source,
    };
    let names = match xattr::list(&entry.path) {
        Ok(names) => names,
        // Filesystems without xattrs have none to keep.
        Err(e) if e.raw_os_error() == Some(nix::libc::ENOTSUP) => return Ok(()),
        Err(e) => return Err(io_error(e)),
    };
    let mut records = Vec::new();
    for name in names {
        let Some(name) = name.to_str().map(str::to_string) else {
            continue;
        };
        if let Some(value) = xattr::get(&entry.path, &name).map_err(io_error)? {
            records.push((format!("{XATTR_PAX_PREFIX}{name}"), value));
        }
    }
    records.sort();
    builder
        .append_pax_extensions(records.iter().map(|(k, v)| (k.as_str(), v.as_slice())))
        .map_err(io_error)
}

/// A reader that counts the bytes it yields, to notice files that shrink while archived.
struct Counted<R> {
    inner: R,
    read: u64,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        Ok(n)
    }
}
