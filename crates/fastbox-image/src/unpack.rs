//! Applying layer tarballs to a rootfs, in order, the way overlayfs would stack them.
//!
//! Safety rules (the rootfs being written is a private staging directory, so no other process
//! races these checks):
//! - entry names with a `..` component are rejected; a leading `/` is dropped;
//! - parent directories are resolved component by component *inside* the rootfs: a symlink in
//!   the middle of a path is followed as if the rootfs were `/` (absolute targets restart at the
//!   rootfs, `..` stops at it), so no write ever lands outside it;
//! - the final component is never followed: an existing entry is removed and the new one
//!   created with `O_EXCL`;
//! - hard-link targets obey the same rules.
//!
//! Whiteouts (`.wh.<name>` removes `<name>` of lower layers, `.wh..wh..opq` empties a
//! directory of lower-layer content) follow the OCI image spec; entries written by the same
//! layer are kept. Ownership, modes (setuid included), xattrs (`SCHILY.xattr.*`), devices and
//! fifos are restored as root; without root, ownership and device nodes are skipped.

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::fs::{self, OpenOptions};
use std::io::{self, BufRead, BufReader, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use nix::sys::stat::{Mode, SFlag, UtimensatFlags};
use nix::sys::time::TimeSpec;

use crate::error::ImageError;

const WHITEOUT_PREFIX: &str = ".wh.";
const OPAQUE_MARKER: &str = ".wh..wh..opq";
const MAX_SYMLINK_HOPS: usize = 40;

/// How a layer blob is compressed, read from its first bytes (media types lie too often).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    pub(crate) fn sniff(head: &[u8]) -> Compression {
        match head {
            [0x1f, 0x8b, ..] => Compression::Gzip,
            [0x28, 0xb5, 0x2f, 0xfd, ..] => Compression::Zstd,
            _ => Compression::None,
        }
    }
}

/// Wraps `reader` in the decompressor its first bytes call for.
pub(crate) fn decompress<'a, R: BufRead + 'a>(mut reader: R) -> io::Result<Box<dyn Read + 'a>> {
    let compression = Compression::sniff(reader.fill_buf()?);
    Ok(match compression {
        Compression::None => Box::new(reader),
        Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(reader)),
        Compression::Zstd => Box::new(ZstdFrames::new(reader)),
    })
}

/// A zstd decoder for streams of several frames (zstd:chunked layers have many), skipping
/// skippable frames.
struct ZstdFrames<R> {
    source: R,
    decoder: ruzstd::decoding::FrameDecoder,
    in_frame: bool,
}

impl<R: BufRead> ZstdFrames<R> {
    fn new(source: R) -> Self {
        ZstdFrames {
            source,
            decoder: ruzstd::decoding::FrameDecoder::new(),
            in_frame: false,
        }
    }
}

impl<R: BufRead> Read for ZstdFrames<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        use ruzstd::decoding::BlockDecodingStrategy;
        use ruzstd::decoding::errors::{FrameDecoderError, ReadFrameHeaderError};
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            if self.in_frame {
                let dec = &mut self.decoder;
                while dec.can_collect() < buf.len() && !dec.is_finished() {
                    let wanted = buf.len() - dec.can_collect();
                    dec.decode_blocks(&mut self.source, BlockDecodingStrategy::UptoBytes(wanted))
                        .map_err(io::Error::other)?;
                }
                let n = dec.read(buf)?;
                if n > 0 {
                    return Ok(n);
                }
                self.in_frame = false;
            }
            if self.source.fill_buf()?.is_empty() {
                return Ok(0);
            }
            match self.decoder.reset(&mut self.source) {
                Ok(()) => self.in_frame = true,
                Err(FrameDecoderError::ReadFrameHeaderError(ReadFrameHeaderError::SkipFrame {
                    length,
                    ..
                })) => {
                    io::copy(
                        &mut (&mut self.source).take(u64::from(length)),
                        &mut io::sink(),
                    )?;
                }
                Err(e) => return Err(io::Error::other(e)),
            }
        }
    }
}

/// Counts of one applied layer, for progress and tests.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct LayerStats {
    pub entries: u64,
    pub whiteouts: u64,
    pub skipped: u64,
}

/// Applies one (already decompressed) layer tarball on top of `root`.
pub(crate) fn apply_layer<R: Read>(
    root: &Path,
    layer: R,
    layer_name: &str,
    as_root: bool,
) -> Result<LayerStats, ImageError> {
    let mut applier = Applier {
        root,
        layer: layer_name,
        as_root,
        written: HashSet::new(),
        dirs: Vec::new(),
        stats: LayerStats::default(),
    };
    let mut archive = tar::Archive::new(layer);
    let entries = archive.entries().map_err(|e| applier.err("<archive>", e))?;
    for entry in entries {
        let entry = entry.map_err(|e| applier.err("<archive>", e))?;
        applier.apply(entry)?;
    }
    applier.finish_dirs()?;
    Ok(applier.stats)
}

struct Applier<'a> {
    root: &'a Path,
    layer: &'a str,
    as_root: bool,
    /// Host paths this layer created, with their ancestors: kept by opaque whiteouts.
    written: HashSet<PathBuf>,
    /// Directories whose final mode and mtime are set once the layer is complete, so that a
    /// read-only directory can still receive its entries.
    dirs: Vec<(PathBuf, u32, u64)>,
    stats: LayerStats,
}

/// Owner, mode, times and xattrs of an entry.
struct Meta {
    uid: u64,
    gid: u64,
    mode: u32,
    mtime: u64,
    xattrs: Vec<(OsString, Vec<u8>)>,
}

impl Applier<'_> {
    fn err(&self, entry: impl Into<String>, source: io::Error) -> ImageError {
        ImageError::Unpack {
            layer: self.layer.to_owned(),
            entry: entry.into(),
            error: source,
        }
    }

    fn unsafe_path(&self, entry: &str, reason: &str) -> ImageError {
        ImageError::UnsafePath {
            layer: self.layer.to_owned(),
            entry: entry.to_owned(),
            reason: reason.to_owned(),
        }
    }

    fn apply<R: Read>(&mut self, mut entry: tar::Entry<'_, R>) -> Result<(), ImageError> {
        let raw_path = entry
            .path()
            .map_err(|e| self.err("<name>", e))?
            .into_owned();
        let shown = raw_path.to_string_lossy().into_owned();
        let kind = entry.header().entry_type();
        if matches!(
            kind,
            tar::EntryType::XGlobalHeader | tar::EntryType::XHeader
        ) {
            return Ok(());
        }
        let components = entry_components(&raw_path).map_err(|r| self.unsafe_path(&shown, r))?;
        let Some((name, parents)) = components.split_last() else {
            return Ok(()); // the rootfs itself ("./"): its attributes stay ours
        };
        let name_bytes = name.as_bytes();

        if name_bytes.starts_with(WHITEOUT_PREFIX.as_bytes()) {
            self.stats.whiteouts += 1;
            let Some(dir) = self
                .resolve_dir(parents, false)
                .map_err(|e| self.err(&shown, e))?
            else {
                return Ok(()); // nothing below to hide
            };
            if name_bytes == OPAQUE_MARKER.as_bytes() {
                self.clear_opaque(&dir).map_err(|e| self.err(&shown, e))?;
            } else if !name_bytes.starts_with(b".wh..wh.") {
                let hidden = &name_bytes[WHITEOUT_PREFIX.len()..];
                // `.wh.`, `.wh..` and `.wh...` name no entry: joined to the directory they would
                // be the directory itself or its parent (at the top, the rootfs's own parent).
                if matches!(hidden, b"" | b"." | b"..") {
                    return Err(self.unsafe_path(&shown, "whiteout names no entry"));
                }
                let hidden = dir.join(OsStr::from_bytes(hidden));
                if !self.written.contains(&hidden) {
                    remove_any(&hidden).map_err(|e| self.err(&shown, e))?;
                }
            }
            return Ok(());
        }

        let meta = self.meta(&mut entry).map_err(|e| self.err(&shown, e))?;
        let dir = self
            .resolve_dir(parents, true)
            .map_err(|e| self.err(&shown, e))?
            .expect("created when missing");
        let target = dir.join(name);
        let result = match kind {
            tar::EntryType::Directory => self.make_dir(&target, &meta),
            tar::EntryType::Regular | tar::EntryType::Continuous | tar::EntryType::GNUSparse => {
                self.make_file(&target, &mut entry, &meta)
            }
            tar::EntryType::Symlink => {
                let link = entry
                    .link_name()
                    .map_err(|e| self.err(&shown, e))?
                    .ok_or_else(|| self.unsafe_path(&shown, "symlink without a target"))?;
                self.make_symlink(&target, &link, &meta)
            }
            tar::EntryType::Link => {
                let link = entry
                    .link_name()
                    .map_err(|e| self.err(&shown, e))?
                    .ok_or_else(|| self.unsafe_path(&shown, "hard link without a target"))?;
                let link_components = entry_components(&link)
                    .map_err(|r| self.unsafe_path(&shown, &format!("hard link target: {r}")))?;
                let source = self
                    .resolve_leaf(&link_components)
                    .map_err(|e| self.err(&shown, e))?
                    .ok_or_else(|| {
                        self.unsafe_path(
                            &shown,
                            &format!("hard link target {} does not exist", link.display()),
                        )
                    })?;
                self.make_hardlink(&target, &source)
            }
            tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo => {
                let major = entry.header().device_major().ok().flatten().unwrap_or(0);
                let minor = entry.header().device_minor().ok().flatten().unwrap_or(0);
                self.make_node(&target, kind, major, minor, &meta)
            }
            other => {
                tracing::debug!(layer = self.layer, entry = %shown, kind = ?other, "skipping tar entry of unsupported type");
                self.stats.skipped += 1;
                return Ok(());
            }
        };
        result.map_err(|e| self.err(&shown, e))?;
        self.mark_written(target);
        self.stats.entries += 1;
        Ok(())
    }

    fn meta<R: Read>(&self, entry: &mut tar::Entry<'_, R>) -> io::Result<Meta> {
        let header = entry.header();
        let mut meta = Meta {
            uid: header.uid().unwrap_or(0),
            gid: header.gid().unwrap_or(0),
            mode: header.mode().unwrap_or(0o644),
            mtime: header.mtime().unwrap_or(0),
            xattrs: Vec::new(),
        };
        if let Some(pax) = entry.pax_extensions()? {
            for ext in pax {
                let ext = ext?;
                let key = ext.key_bytes();
                let number = || {
                    std::str::from_utf8(ext.value_bytes())
                        .ok()?
                        .parse::<u64>()
                        .ok()
                };
                match key {
                    b"uid" => meta.uid = number().unwrap_or(meta.uid),
                    b"gid" => meta.gid = number().unwrap_or(meta.gid),
                    _ => {
                        if let Some(name) = key.strip_prefix(b"SCHILY.xattr.") {
                            meta.xattrs.push((
                                OsStr::from_bytes(name).to_owned(),
                                ext.value_bytes().to_vec(),
                            ));
                        }
                    }
                }
            }
        }
        Ok(meta)
    }

    /// The host directory for `components` (all directories), resolved inside the rootfs.
    /// Missing directories are created when `create`, else `None` is returned.
    fn resolve_dir(&self, components: &[OsString], create: bool) -> io::Result<Option<PathBuf>> {
        resolve_in_root(self.root, components, create)
    }

    /// The host path of an existing entry, the last component not followed.
    fn resolve_leaf(&self, components: &[OsString]) -> io::Result<Option<PathBuf>> {
        let Some((name, parents)) = components.split_last() else {
            return Ok(Some(self.root.to_owned()));
        };
        let Some(dir) = self.resolve_dir(parents, false)? else {
            return Ok(None);
        };
        let path = dir.join(name);
        Ok(path.symlink_metadata().is_ok().then_some(path))
    }

    fn mark_written(&mut self, path: PathBuf) {
        let mut current = Some(path.as_path());
        while let Some(p) = current {
            if p == self.root || !self.written.insert(p.to_owned()) {
                break;
            }
            current = p.parent();
        }
    }

    /// Removes everything in `dir` that this layer did not write.
    fn clear_opaque(&self, dir: &Path) -> io::Result<()> {
        for child in fs::read_dir(dir)? {
            let path = child?.path();
            if self.written.contains(&path) {
                if path.symlink_metadata()?.is_dir() {
                    self.clear_opaque(&path)?;
                }
            } else {
                remove_any(&path)?;
            }
        }
        Ok(())
    }

    fn make_dir(&mut self, target: &Path, meta: &Meta) -> io::Result<()> {
        match target.symlink_metadata() {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                fs::remove_file(target)?;
                fs::create_dir(target)?;
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => fs::create_dir(target)?,
            Err(e) => return Err(e),
        }
        self.chown(target, meta)?;
        // Writable by us until the layer is done; the real mode comes in `finish_dirs`.
        fs::set_permissions(
            target,
            fs::Permissions::from_mode((meta.mode & 0o7777) | 0o700),
        )?;
        self.set_xattrs(target, meta);
        self.dirs
            .push((target.to_owned(), meta.mode & 0o7777, meta.mtime));
        Ok(())
    }

    fn make_file<R: Read>(&mut self, target: &Path, data: &mut R, meta: &Meta) -> io::Result<()> {
        remove_any(target)?;
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(target)?;
        io::copy(data, &mut file)?;
        drop(file);
        self.chown(target, meta)?;
        fs::set_permissions(target, fs::Permissions::from_mode(meta.mode & 0o7777))?;
        self.set_xattrs(target, meta);
        set_mtime(target, meta.mtime);
        Ok(())
    }

    fn make_symlink(&mut self, target: &Path, link: &Path, meta: &Meta) -> io::Result<()> {
        remove_any(target)?;
        std::os::unix::fs::symlink(link, target)?;
        self.chown(target, meta)?;
        self.set_xattrs(target, meta);
        set_mtime(target, meta.mtime);
        Ok(())
    }

    fn make_hardlink(&mut self, target: &Path, source: &Path) -> io::Result<()> {
        if target == source {
            return Ok(());
        }
        remove_any(target)?;
        // linkat(2) without AT_SYMLINK_FOLLOW: a link to a symlink links the symlink itself.
        fs::hard_link(source, target)
    }

    fn make_node(
        &mut self,
        target: &Path,
        kind: tar::EntryType,
        major: u32,
        minor: u32,
        meta: &Meta,
    ) -> io::Result<()> {
        remove_any(target)?;
        let perm = Mode::from_bits_truncate((meta.mode & 0o7777) as nix::libc::mode_t);
        let made = match kind {
            tar::EntryType::Fifo => nix::unistd::mkfifo(target, perm),
            _ => {
                let sflag = if kind == tar::EntryType::Char {
                    SFlag::S_IFCHR
                } else {
                    SFlag::S_IFBLK
                };
                let dev = nix::sys::stat::makedev(u64::from(major), u64::from(minor));
                nix::sys::stat::mknod(target, sflag, perm, dev)
            }
        };
        match made {
            Ok(()) => {}
            Err(nix::errno::Errno::EPERM) if kind != tar::EntryType::Fifo => {
                tracing::debug!(layer = self.layer, path = %target.display(), "no permission to create device node, skipped");
                self.stats.skipped += 1;
                return Ok(());
            }
            Err(e) => return Err(e.into()),
        }
        self.chown(target, meta)?;
        fs::set_permissions(target, fs::Permissions::from_mode(meta.mode & 0o7777))?;
        self.set_xattrs(target, meta);
        set_mtime(target, meta.mtime);
        Ok(())
    }

    fn chown(&self, target: &Path, meta: &Meta) -> io::Result<()> {
        if !self.as_root {
            return Ok(());
        }
        let (Ok(uid), Ok(gid)) = (u32::try_from(meta.uid), u32::try_from(meta.gid)) else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "uid or gid above 2^32",
            ));
        };
        std::os::unix::fs::lchown(target, Some(uid), Some(gid))
    }

    /// Best effort: file systems without xattr support (or `user.*` on symlinks) refuse some.
    fn set_xattrs(&self, target: &Path, meta: &Meta) {
        for (name, value) in &meta.xattrs {
            if let Err(e) = xattr::set(target, name, value) {
                tracing::debug!(layer = self.layer, path = %target.display(), xattr = ?name, error = %e, "xattr not restored");
            }
        }
    }

    fn finish_dirs(&mut self) -> Result<(), ImageError> {
        for (path, mode, mtime) in self.dirs.drain(..).rev() {
            // A later entry may have replaced the directory, or one of its parents, with a
            // symlink, which chmod would follow out of the rootfs.
            if !is_real_dir_below(self.root, &path) {
                continue;
            }
            match fs::set_permissions(&path, fs::Permissions::from_mode(mode)) {
                Ok(()) => set_mtime(&path, mtime),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(error) => {
                    return Err(ImageError::Unpack {
                        layer: self.layer.to_owned(),
                        entry: path.display().to_string(),
                        error,
                    });
                }
            }
        }
        Ok(())
    }
}

/// The normal components of an entry name; `..` is refused, `/` and `.` are dropped.
pub(crate) fn entry_components(path: &Path) -> Result<Vec<OsString>, &'static str> {
    let mut out = Vec::new();
    for c in path.components() {
        match c {
            Component::Normal(n) => out.push(n.to_owned()),
            Component::RootDir | Component::CurDir => {}
            Component::ParentDir => return Err("path contains a '..' component"),
            Component::Prefix(_) => return Err("path has a prefix"),
        }
    }
    Ok(out)
}

/// Resolves directory `components` under `root` as a chroot would: symlinks are followed with
/// `root` as `/`, `..` never climbs above `root`. Returns a host path whose components below
/// `root` are all real directories. Missing directories are created (mode 0755) when `create`.
pub(crate) fn resolve_in_root(
    root: &Path,
    components: &[OsString],
    create: bool,
) -> io::Result<Option<PathBuf>> {
    let mut resolved: Vec<OsString> = Vec::new();
    let mut pending: std::collections::VecDeque<OsString> = components.iter().cloned().collect();
    let mut hops = 0;
    while let Some(c) = pending.pop_front() {
        if c.is_empty() || c == "." {
            continue;
        }
        if c == ".." {
            resolved.pop();
            continue;
        }
        let mut candidate = root.to_path_buf();
        candidate.extend(&resolved);
        candidate.push(&c);
        match candidate.symlink_metadata() {
            Ok(m) if m.file_type().is_symlink() => {
                hops += 1;
                if hops > MAX_SYMLINK_HOPS {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "too many levels of symbolic links",
                    ));
                }
                let target = fs::read_link(&candidate)?;
                if target.is_absolute() {
                    resolved.clear();
                }
                let mut expanded: Vec<OsString> = target
                    .components()
                    .filter_map(|tc| match tc {
                        Component::Normal(n) => Some(n.to_owned()),
                        Component::ParentDir => Some(OsString::from("..")),
                        _ => None,
                    })
                    .collect();
                expanded.extend(pending.drain(..));
                pending = expanded.into();
            }
            Ok(m) if m.is_dir() => resolved.push(c),
            Ok(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::NotADirectory,
                    format!("{} is not a directory", candidate.display()),
                ));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                if !create {
                    return Ok(None);
                }
                fs::create_dir(&candidate)?;
                fs::set_permissions(&candidate, fs::Permissions::from_mode(0o755))?;
                resolved.push(c);
            }
            Err(e) => return Err(e),
        }
    }
    let mut out = root.to_path_buf();
    out.extend(&resolved);
    Ok(Some(out))
}

/// Whether `path` is a directory below `root` reached through directories only: no component
/// after `root` is a symlink or anything else but a directory.
fn is_real_dir_below(root: &Path, path: &Path) -> bool {
    let Ok(relative) = path.strip_prefix(root) else {
        return false;
    };
    let mut current = root.to_path_buf();
    relative.components().all(|c| {
        current.push(c);
        current.symlink_metadata().is_ok_and(|m| m.is_dir())
    })
}

/// Removes a file, symlink or whole directory tree (never following symlinks); absent is fine.
pub(crate) fn remove_any(path: &Path) -> io::Result<()> {
    match path.symlink_metadata() {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

fn set_mtime(path: &Path, mtime: u64) {
    let t = TimeSpec::new(i64::try_from(mtime).unwrap_or(0), 0);
    let _ = nix::sys::stat::utimensat(None, path, &t, &t, UtimensatFlags::NoFollowSymlink);
}

/// Decompresses and applies a layer blob, verifying the compressed digest and the
/// uncompressed `diff_id` when given.
pub(crate) fn apply_layer_blob<R: Read>(
    root: &Path,
    blob: R,
    layer_name: &str,
    expected_digest: Option<&str>,
    expected_diff_id: Option<&str>,
    as_root: bool,
) -> Result<LayerStats, ImageError> {
    let io_err = |error| ImageError::Unpack {
        layer: layer_name.to_owned(),
        entry: "<stream>".into(),
        error,
    };
    let mut compressed =
        BufReader::with_capacity(256 * 1024, crate::digest::HashingReader::new(blob));
    let stats;
    let diff_id;
    {
        let decompressed = decompress(&mut compressed).map_err(io_err)?;
        let mut uncompressed = crate::digest::HashingReader::new(decompressed);
        stats = apply_layer(root, &mut uncompressed, layer_name, as_root)?;
        diff_id = uncompressed.finish().map_err(io_err)?.0;
    }
    io::copy(&mut compressed, &mut io::sink()).map_err(io_err)?;
    let (digest, _) = compressed.into_inner().finish().map_err(io_err)?;
    for (expected, actual, what) in [
        (expected_digest, &digest, "blob"),
        (expected_diff_id, &diff_id, "uncompressed content (diff_id)"),
    ] {
        if let Some(expected) = expected
            && expected != actual
        {
            return Err(ImageError::DigestMismatch {
                what: format!("layer {layer_name} {what}"),
                expected: expected.to_owned(),
                actual: actual.clone(),
            });
        }
    }
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// A layer built entry by entry with raw names (tar::Builder refuses `..`).
    struct Layer(tar::Builder<Vec<u8>>);

    impl Layer {
        fn new() -> Self {
            Layer(tar::Builder::new(Vec::new()))
        }
        fn header(kind: tar::EntryType, name: &str, size: u64, mode: u32) -> tar::Header {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(kind);
            h.set_size(size);
            h.set_mode(mode);
            h.set_mtime(1_700_000_000);
            let raw = &mut h.as_old_mut().name;
            raw[..name.len()].copy_from_slice(name.as_bytes());
            h.set_cksum();
            h
        }
        fn file(mut self, name: &str, data: &[u8]) -> Self {
            let h = Self::header(tar::EntryType::Regular, name, data.len() as u64, 0o644);
            self.0.append(&h, data).unwrap();
            self
        }
        fn dir(mut self, name: &str, mode: u32) -> Self {
            let h = Self::header(tar::EntryType::Directory, name, 0, mode);
            self.0.append(&h, &[][..]).unwrap();
            self
        }
        fn link(mut self, kind: tar::EntryType, name: &str, target: &str) -> Self {
            let mut h = Self::header(kind, name, 0, 0o777);
            h.set_link_name(target).unwrap();
            h.set_cksum();
            self.0.append(&h, &[][..]).unwrap();
            self
        }
        fn bytes(self) -> Vec<u8> {
            self.0.into_inner().unwrap()
        }
    }

    fn apply(root: &Path, layer: Layer) -> Result<LayerStats, ImageError> {
        apply_layer(
            root,
            &layer.bytes()[..],
            "test",
            nix::unistd::geteuid().is_root(),
        )
    }

    fn read(root: &Path, p: &str) -> Option<String> {
        fs::read_to_string(root.join(p)).ok()
    }

    #[test]
    fn whiteout_removes_lower_entries_only() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        apply(
            r,
            Layer::new()
                .file("etc/a", b"a")
                .file("etc/b", b"b")
                .dir("var/cache/", 0o755)
                .file("var/cache/x", b"x"),
        )
        .unwrap();
        let stats = apply(
            r,
            Layer::new()
                .file("etc/.wh.a", b"")
                .file("etc/c", b"c")
                .file(".wh.var", b""),
        )
        .unwrap();
        assert_eq!(stats.whiteouts, 2);
        assert_eq!(read(r, "etc/a"), None);
        assert_eq!(read(r, "etc/b").as_deref(), Some("b"));
        assert_eq!(read(r, "etc/c").as_deref(), Some("c"));
        assert!(!r.join("var").exists());
        assert!(
            !r.join("etc/.wh.a").exists(),
            "whiteout markers are never materialized"
        );
    }

    #[test]
    fn whiteouts_naming_no_entry_are_refused() {
        // Found by the image_unpack fuzz target: `.wh...` removed everything in the rootfs's
        // parent, `.wh.` the rootfs itself.
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("rootfs");
        fs::create_dir(&root).unwrap();
        fs::write(dir.path().join("sibling"), b"outside").unwrap();
        apply(&root, Layer::new().file("etc/x", b"x")).unwrap();
        for name in [".wh.", ".wh..", ".wh...", "etc/.wh...", "etc/.wh."] {
            let err = apply(&root, Layer::new().file(name, b"")).unwrap_err();
            assert!(
                matches!(err, ImageError::UnsafePath { .. }),
                "{name}: {err}"
            );
        }
        assert_eq!(read(dir.path(), "sibling").as_deref(), Some("outside"));
        assert_eq!(read(&root, "etc/x").as_deref(), Some("x"));
    }

    #[test]
    fn directories_replaced_by_symlinks_are_not_finished_through_them() {
        // Found by the image_unpack fuzz target: a directory entry followed by a symlink of the
        // same name (or of a parent's name) had its mode set on the symlink's target.
        let outside = tempfile::tempdir().unwrap();
        let victim = outside.path().join("victim");
        fs::write(&victim, b"x").unwrap();
        fs::set_permissions(&victim, fs::Permissions::from_mode(0o600)).unwrap();
        let victim_dir = outside.path().join("q");
        fs::create_dir(&victim_dir).unwrap();
        fs::set_permissions(&victim_dir, fs::Permissions::from_mode(0o700)).unwrap();
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        apply(
            r,
            Layer::new()
                .dir("d/", 0o4777)
                .link(tar::EntryType::Symlink, "d", victim.to_str().unwrap())
                .dir("p/", 0o755)
                .dir("p/q/", 0o777)
                .link(
                    tar::EntryType::Symlink,
                    "p",
                    outside.path().to_str().unwrap(),
                ),
        )
        .unwrap();
        let mode = |p: &Path| p.metadata().unwrap().mode() & 0o7777;
        assert_eq!(mode(&victim), 0o600);
        assert_eq!(mode(&victim_dir), 0o700);
        assert!(
            r.join("d")
                .symlink_metadata()
                .unwrap()
                .file_type()
                .is_symlink()
        );
    }

    #[test]
    fn opaque_whiteout_hides_lower_content_but_keeps_same_layer_entries() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        apply(
            r,
            Layer::new()
                .file("d/old", b"1")
                .file("d/sub/old", b"2")
                .file("keep/x", b"3"),
        )
        .unwrap();
        // New entries come before and after the marker, as tar writers may order them.
        apply(
            r,
            Layer::new()
                .file("d/sub/new", b"n")
                .file("d/.wh..wh..opq", b"")
                .file("d/after", b"a"),
        )
        .unwrap();
        assert_eq!(read(r, "d/old"), None);
        assert_eq!(read(r, "d/sub/old"), None);
        assert_eq!(read(r, "d/sub/new").as_deref(), Some("n"));
        assert_eq!(read(r, "d/after").as_deref(), Some("a"));
        assert_eq!(read(r, "keep/x").as_deref(), Some("3"));
    }

    #[test]
    fn parent_dir_components_are_rejected() {
        let root = tempfile::tempdir().unwrap();
        let inner = root.path().join("rootfs");
        fs::create_dir(&inner).unwrap();
        let err = apply(&inner, Layer::new().file("a/../../escape", b"x")).unwrap_err();
        assert!(matches!(err, ImageError::UnsafePath { .. }), "{err}");
        assert!(err.to_string().contains("'..'"), "{err}");
        assert!(!root.path().join("escape").exists());
        let err = apply(
            &inner,
            Layer::new()
                .file("f", b"x")
                .link(tar::EntryType::Link, "h", "../../etc/passwd"),
        )
        .unwrap_err();
        assert!(matches!(err, ImageError::UnsafePath { .. }), "{err}");
    }

    #[test]
    fn writes_through_symlinks_stay_inside_the_rootfs() {
        let outside = tempfile::tempdir().unwrap();
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        let out = outside.path().to_str().unwrap();
        apply(
            r,
            Layer::new()
                .link(tar::EntryType::Symlink, "abs", out)
                .link(tar::EntryType::Symlink, "rel", "../../../../../../..")
                .file("abs/pwned", b"x")
                .file("rel/tmp/pwned2", b"y"),
        )
        .unwrap();
        assert!(
            fs::read_dir(outside.path()).unwrap().next().is_none(),
            "nothing written outside"
        );
        // The absolute symlink resolved against the rootfs, the relative one stopped at its root.
        assert_eq!(
            read(r, &format!("{}/pwned", out.trim_start_matches('/'))).as_deref(),
            Some("x")
        );
        assert_eq!(read(r, "tmp/pwned2").as_deref(), Some("y"));
        assert_eq!(
            fs::read_link(r.join("abs")).unwrap(),
            Path::new(out),
            "symlinks themselves are kept as written"
        );
    }

    #[test]
    fn files_replace_symlinks_instead_of_writing_through_them() {
        let outside = tempfile::tempdir().unwrap();
        let victim = outside.path().join("victim");
        fs::write(&victim, b"original").unwrap();
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        apply(
            r,
            Layer::new().link(tar::EntryType::Symlink, "f", victim.to_str().unwrap()),
        )
        .unwrap();
        apply(r, Layer::new().file("f", b"new")).unwrap();
        assert_eq!(fs::read_to_string(&victim).unwrap(), "original");
        assert_eq!(read(r, "f").as_deref(), Some("new"));
        assert!(
            !r.join("f")
                .symlink_metadata()
                .unwrap()
                .file_type()
                .is_symlink()
        );
    }

    #[test]
    fn hard_links_and_modes_are_restored() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        apply(
            r,
            Layer::new().dir("ro/", 0o555).file("ro/f", b"data").link(
                tar::EntryType::Link,
                "ro/g",
                "ro/f",
            ),
        )
        .unwrap();
        let f = r.join("ro/f").metadata().unwrap();
        let g = r.join("ro/g").metadata().unwrap();
        assert_eq!(f.ino(), g.ino());
        assert_eq!(r.join("ro").metadata().unwrap().mode() & 0o7777, 0o555);
        assert_eq!(f.mtime(), 1_700_000_000);
    }

    #[test]
    fn directory_replaces_file_and_file_replaces_directory() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        apply(r, Layer::new().file("x", b"file").file("y/inner", b"i")).unwrap();
        apply(r, Layer::new().dir("x/", 0o755).file("y", b"now a file")).unwrap();
        assert!(r.join("x").is_dir());
        assert_eq!(read(r, "y").as_deref(), Some("now a file"));
    }

    #[test]
    fn gzip_and_zstd_layers_are_detected_and_verified() {
        let tar = Layer::new().file("hello", b"world").bytes();
        let diff_id = crate::digest::sha256_digest(&tar);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        io::Write::write_all(&mut gz, &tar).unwrap();
        let gz = gz.finish().unwrap();
        let zst = ruzstd::encoding::compress_to_vec(
            &tar[..],
            ruzstd::encoding::CompressionLevel::Fastest,
        );
        for blob in [tar.clone(), gz, zst] {
            let root = tempfile::tempdir().unwrap();
            let digest = crate::digest::sha256_digest(&blob);
            apply_layer_blob(
                root.path(),
                &blob[..],
                "l",
                Some(&digest),
                Some(&diff_id),
                false,
            )
            .unwrap();
            assert_eq!(read(root.path(), "hello").as_deref(), Some("world"));
            let wrong = crate::digest::sha256_digest(b"other");
            let err = apply_layer_blob(root.path(), &blob[..], "l", Some(&wrong), None, false)
                .unwrap_err();
            assert!(matches!(err, ImageError::DigestMismatch { .. }), "{err}");
        }
    }

    #[test]
    fn zstd_streams_of_several_frames_decode_fully() {
        let a = ruzstd::encoding::compress_to_vec(
            &b"first-"[..],
            ruzstd::encoding::CompressionLevel::Fastest,
        );
        let b = ruzstd::encoding::compress_to_vec(
            &b"second"[..],
            ruzstd::encoding::CompressionLevel::Fastest,
        );
        // A skippable frame between them: magic 0x184D2A50, length 3.
        let skippable = [0x50, 0x2a, 0x4d, 0x18, 3, 0, 0, 0, 9, 9, 9];
        let stream = [a, skippable.to_vec(), b].concat();
        let mut out = String::new();
        decompress(&stream[..])
            .unwrap()
            .read_to_string(&mut out)
            .unwrap();
        assert_eq!(out, "first-second");
    }

    #[test]
    fn ownership_is_restored_as_root() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: ownership needs root");
            return;
        }
        let root = tempfile::tempdir().unwrap();
        let mut h = Layer::header(tar::EntryType::Regular, "owned", 1, 0o4755);
        h.set_uid(1234);
        h.set_gid(5678);
        h.set_cksum();
        let mut b = tar::Builder::new(Vec::new());
        b.append(&h, &b"x"[..]).unwrap();
        apply_layer(root.path(), &b.into_inner().unwrap()[..], "t", true).unwrap();
        let m = root.path().join("owned").metadata().unwrap();
        assert_eq!((m.uid(), m.gid(), m.mode() & 0o7777), (1234, 5678, 0o4755));
    }
}
