//! The layer unpacker (`fastbox-image`'s `unpack`, tar with OCI whiteouts, gzip or zstd) on
//! arbitrary layers, applied in order to a fresh root per input, which must contain every
//! write. An input is either
//! - up to three layer blobs separated by [`LAYER_SEPARATOR`] (the header checksums of an
//!   uncompressed layer are recomputed first, so that mutated headers reach the unpacker
//!   instead of failing the tar reader's checksum), or
//! - layers written as text, entry by entry ([`fastbox_fuzz::text_layers`]): mutations of a
//!   name, a type or a link target stay one-byte changes, where in a tar they hide among
//!   kilobytes of headers and padding.
//!
//! Each input gets `BASE/input.XXXXXX/{root,canary}` (BASE: a directory of this process,
//! holding nothing else); after each layer, BASE must hold only the input's directory, that
//! directory only `root` and an untouched `canary`, and neither may have changed mode.
//!
//! **Never as root**: an escape the target exists to find would then write to the host. It
//! refuses to start as root; `scripts/fuzz.sh` runs it as `nobody` (so layers are applied as
//! an unprivileged pull applies them: no ownership, no device nodes, and an escape to a path
//! that is not this process's own fails instead of doing harm).
#![no_main]

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use fastbox_fuzz::{LAYER_SEPARATOR, text_layers};
use fastbox_image::fuzzing::apply_layer;
use libfuzzer_sys::fuzz_target;

/// At most this many layers per input.
const MAX_LAYERS: usize = 3;
/// Largest file the unpacker may write (RLIMIT_FSIZE): a small layer can declare huge files.
const MAX_FILE_BYTES: u64 = 16 << 20;
const CANARY: &[u8] = b"outside the root\n";

/// The directory holding each input's directory, made at start.
static BASE: OnceLock<PathBuf> = OnceLock::new();

fn base() -> &'static Path {
    BASE.get_or_init(|| {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            eprintln!(
                "image_unpack refuses to run as root (an escape would write to the host): \
                 run it through scripts/fuzz.sh, which runs it as nobody"
            );
            std::process::exit(2);
        }
        // SAFETY: plain libc calls on a valid, initialized struct; ignoring SIGXFSZ makes an
        // oversized write fail with EFBIG instead of killing the process.
        unsafe {
            let limit = libc::rlimit {
                rlim_cur: MAX_FILE_BYTES,
                rlim_max: MAX_FILE_BYTES,
            };
            assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &limit), 0);
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        }
        tempfile::Builder::new()
            .prefix("fastbox-fuzz-unpack.")
            .tempdir()
            .expect("a base directory in TMPDIR")
            .keep()
    })
}

fuzz_target!(|data: &[u8]| {
    let base = base();
    let input_dir = tempfile::Builder::new()
        .prefix("input.")
        .tempdir_in(base)
        .expect("an input directory");
    let dir = input_dir.path();
    let root = dir.join("root");
    fs::create_dir(&root).expect("root");
    let canary = dir.join("canary");
    fs::write(&canary, CANARY).expect("canary");
    let modes = Modes {
        base: mode(base),
        dir: mode(dir),
        canary: mode(&canary),
    };

    for layer in split_layers(data) {
        let result = apply_layer(&root, &layer, false);
        check_contained(base, dir, &modes);
        if result.is_err() || !root.is_dir() {
            break;
        }
    }

    make_removable(dir).expect("chmod the input's tree");
    input_dir.close().expect("remove the input's directory");
});

/// The layers of one input, uncompressed tar headers given valid checksums.
fn split_layers(data: &[u8]) -> Vec<Vec<u8>> {
    if let Some(mut layers) = text_layers(data) {
        layers.truncate(MAX_LAYERS);
        return layers;
    }
    let mut layers = Vec::new();
    let mut rest = data;
    while layers.len() + 1 < MAX_LAYERS
        && let Some(at) = find(rest, LAYER_SEPARATOR)
    {
        layers.push(rest[..at].to_vec());
        rest = &rest[at + LAYER_SEPARATOR.len()..];
    }
    layers.push(rest.to_vec());
    for layer in &mut layers {
        let compressed =
            layer.starts_with(&[0x1f, 0x8b]) || layer.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]);
        if !compressed {
            fix_checksums(layer);
        }
    }
    layers
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Recomputes the checksum of every header, walking the archive as a reader would.
fn fix_checksums(tar: &mut [u8]) {
    let mut at = 0usize;
    while let Some(header) = tar.get_mut(at..at + 512) {
        if header.iter().all(|&b| b == 0) {
            return; // end of the archive
        }
        header[148..156].fill(b' ');
        let sum: u32 = header.iter().map(|&b| u32::from(b)).sum();
        header[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
        let size = header_size(&header[124..136]);
        let blocks = size.div_ceil(512).min(tar.len() as u64 / 512 + 1) as usize;
        at = at + 512 + blocks * 512;
    }
}

/// The size field: octal, or base-256 when its first byte has the high bit set.
fn header_size(field: &[u8]) -> u64 {
    if field[0] & 0x80 != 0 {
        return field[1..].iter().fold(0u64, |n, &b| {
            n.saturating_mul(256).saturating_add(u64::from(b))
        });
    }
    let text = String::from_utf8_lossy(field);
    let digits = text.trim_matches(|c: char| c == ' ' || c == '\0');
    u64::from_str_radix(digits, 8).unwrap_or(0)
}

fn mode(path: &Path) -> u32 {
    fs::symlink_metadata(path)
        .expect("stat")
        .permissions()
        .mode()
}

/// Modes of what lies outside the root, taken before the first layer.
struct Modes {
    base: u32,
    dir: u32,
    canary: u32,
}

/// Every write stayed in the root: nothing else appeared, vanished or changed mode.
fn check_contained(base: &Path, dir: &Path, modes: &Modes) {
    let names = |p: &Path| -> BTreeSet<OsString> {
        fs::read_dir(p)
            .unwrap_or_else(|e| panic!("{} is unreadable after a layer: {e}", p.display()))
            .map(|e| e.expect("entry").file_name())
            .collect()
    };
    let own: BTreeSet<OsString> = [dir.file_name().expect("name").to_owned()].into();
    assert_eq!(names(base), own, "the unpacker changed the base directory");
    let expected: BTreeSet<OsString> = ["canary".into(), "root".into()].into();
    assert_eq!(
        names(dir),
        expected,
        "the unpacker changed its root's parent"
    );
    assert_eq!(
        mode(base),
        modes.base,
        "the unpacker changed the base's mode"
    );
    assert_eq!(
        mode(dir),
        modes.dir,
        "the unpacker changed the root's parent's mode"
    );
    let canary = dir.join("canary");
    let meta = fs::symlink_metadata(&canary).expect("canary");
    assert!(meta.is_file(), "the canary is no longer a file");
    assert_eq!(
        meta.permissions().mode(),
        modes.canary,
        "the canary's mode changed"
    );
    assert_eq!(
        fs::read(&canary).expect("canary"),
        CANARY,
        "the canary was written"
    );
    if let Ok(meta) = fs::symlink_metadata(dir.join("root")) {
        assert!(!meta.file_type().is_symlink(), "the root became a symlink");
    }
}

/// Owner permissions on every directory below `dir` (never through a symlink), so that the
/// tree can be removed whatever modes the layers gave it.
fn make_removable(dir: &Path) -> io::Result<()> {
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))?;
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            make_removable(&entry.path())?;
        }
    }
    Ok(())
}
