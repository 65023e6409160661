//! What the fuzz targets and the seed generator (`examples/seeds.rs`) share: the route
//! keyring and clock, and how an `image_unpack` input separates its layers.

use fastbox_proxy::route::RouteSigner;

/// "Now" of every route check, Unix seconds.
pub const ROUTE_NOW: u64 = 1_700_000_000;

/// The keyring of the `route` target: `a` (retired, still verifies), then `b` (signs).
pub fn route_signer() -> RouteSigner {
    RouteSigner::with_keys(vec![('a', vec![0x5a; 32]), ('b', vec![0xa5; 32])])
        .expect("valid keyring")
}

/// The retired key of [`route_signer`] alone, to make routes it signed before rotation.
pub fn retired_route_signer() -> RouteSigner {
    RouteSigner::try_new('a', vec![0x5a; 32]).expect("valid key")
}

/// Separates the layers of one `image_unpack` input.
pub const LAYER_SEPARATOR: &[u8] = b"\n--fastbox-fuzz-layer--\n";

/// The first line of an `image_unpack` input written as text: layers described entry by
/// entry, turned into tar archives by [`text_layers`].
pub const TEXT_LAYERS_MAGIC: &[u8] = b"fastbox-layers\n";

/// Builds the tar layers described by a text input, or `None` when `input` does not start
/// with [`TEXT_LAYERS_MAGIC`]. One entry per line, fields separated by one space:
///
/// ```text
/// KIND MODE NAME [REST]
/// ```
///
/// KIND `d` directory, `f` file (REST is its content), `l` symlink and `h` hard link (REST is
/// the target), `p` fifo, `c`/`b` device (REST is `major,minor`), `x` a PAX record for the next
/// entry (MODE is the key, NAME the value), any other byte is written as the type flag itself;
/// MODE is octal. `---` starts the next layer. Names and targets are written into the headers
/// byte for byte (`..`, absolute paths and whiteouts included), so that the unpacker, not a tar
/// writer, decides what to refuse.
pub fn text_layers(input: &[u8]) -> Option<Vec<Vec<u8>>> {
    let body = input.strip_prefix(TEXT_LAYERS_MAGIC)?;
    let mut layers = vec![Vec::new()];
    let mut pax: Vec<u8> = Vec::new();
    for line in body.split(|&b| b == b'\n') {
        if line == b"---" {
            layers.push(Vec::new());
            continue;
        }
        let mut fields = line.splitn(4, |&b| b == b' ');
        let (Some(kind), Some(mode), Some(name)) = (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let rest = fields.next().unwrap_or(b"");
        let layer = layers.last_mut().expect("a layer");
        if kind == b"x" {
            pax.extend_from_slice(&pax_record(mode, name));
            continue;
        }
        if !pax.is_empty() {
            let mut header = tar::Header::new_ustar();
            header.set_entry_type(tar::EntryType::XHeader);
            write_entry(
                layer,
                header,
                b"PaxHeaders/x",
                b"",
                &std::mem::take(&mut pax),
            );
        }
        let mut header = tar::Header::new_ustar();
        let mode = std::str::from_utf8(mode)
            .ok()
            .and_then(|m| u32::from_str_radix(m, 8).ok())
            .unwrap_or(0o644);
        header.set_mode(mode);
        header.set_mtime(1_700_000_000);
        let (link, data): (&[u8], &[u8]) = match kind.first().copied().unwrap_or(b'f') {
            b'd' => {
                header.set_entry_type(tar::EntryType::Directory);
                (b"", b"")
            }
            b'f' => {
                header.set_entry_type(tar::EntryType::Regular);
                (b"", rest)
            }
            b'l' => {
                header.set_entry_type(tar::EntryType::Symlink);
                (rest, b"")
            }
            b'h' => {
                header.set_entry_type(tar::EntryType::Link);
                (rest, b"")
            }
            b'p' => {
                header.set_entry_type(tar::EntryType::Fifo);
                (b"", b"")
            }
            k @ (b'c' | b'b') => {
                header.set_entry_type(if k == b'c' {
                    tar::EntryType::Char
                } else {
                    tar::EntryType::Block
                });
                let text = String::from_utf8_lossy(rest);
                let (major, minor) = text.split_once(',').unwrap_or((&text, "0"));
                let _ = header.set_device_major(major.parse().unwrap_or(1));
                let _ = header.set_device_minor(minor.parse().unwrap_or(3));
                (b"", b"")
            }
            other => {
                header.set_entry_type(tar::EntryType::new(other));
                (b"", rest)
            }
        };
        write_entry(layer, header, name, link, data);
    }
    for layer in &mut layers {
        layer.extend_from_slice(&[0; 1024]);
    }
    Some(layers)
}

/// One PAX extended header record: `LEN KEY=VALUE\n`, LEN counting the whole record.
fn pax_record(key: &[u8], value: &[u8]) -> Vec<u8> {
    let body = key.len() + value.len() + 3; // space, '=', newline
    let mut len = body + 1;
    while len != body + len.to_string().len() {
        len = body + len.to_string().len();
    }
    let mut record = format!("{len} ").into_bytes();
    record.extend_from_slice(key);
    record.push(b'=');
    record.extend_from_slice(value);
    record.push(b'\n');
    record
}

/// Appends a header (name and link name written raw, at most 100 bytes each) and its data.
fn write_entry(out: &mut Vec<u8>, mut header: tar::Header, name: &[u8], link: &[u8], data: &[u8]) {
    let ustar = header.as_ustar_mut().expect("a ustar header");
    let n = name.len().min(ustar.name.len());
    ustar.name[..n].copy_from_slice(&name[..n]);
    let n = link.len().min(ustar.linkname.len());
    ustar.linkname[..n].copy_from_slice(&link[..n]);
    header.set_size(data.len() as u64);
    header.set_cksum();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out.resize(out.len().next_multiple_of(512), 0);
}
