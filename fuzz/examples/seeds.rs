//! Writes the seed inputs of every fuzz target into `fuzz/corpus/<target>/seed-*`, made with
//! the crates' own code where they have it (signed routes, artifact manifests, tar layers):
//!
//!   cargo run --manifest-path fuzz/Cargo.toml --example seeds
//!
//! Seeds are committed; run this again only when a format changes.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use fastbox_artifact::{
    ArtifactKind, Digest, EntryKind, FileEntry, HostFacts, Manifest, ManifestMeta, PackFormat,
    RootfsImage, SourceImage,
};
use fastbox_fuzz::{
    LAYER_SEPARATOR, ROUTE_NOW, TEXT_LAYERS_MAGIC, retired_route_signer, route_signer,
};
use fastbox_image::fuzzing::FUZZ_CONFIG_DIGEST;
use fastbox_proxy::route::to_b36;

fn main() {
    let corpus = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("corpus");
    dns(&corpus.join("dns_message"));
    route(&corpus.join("route"));
    quantity(&corpus.join("quantity"));
    artifact_manifest(&corpus.join("artifact_manifest"));
    image_unpack(&corpus.join("image_unpack"));
    oci_document(&corpus.join("oci_document"));
}

fn write(dir: &Path, name: &str, bytes: &[u8]) {
    fs::create_dir_all(dir).expect("corpus directory");
    fs::write(dir.join(format!("seed-{name}")), bytes).expect("seed");
}

// ---------------------------------------------------------------- dns_message

/// A query for `name` of type `qtype`, RD set, optionally with an EDNS OPT record.
fn dns_query(id: u16, name: &str, qtype: u16, opt: bool) -> Vec<u8> {
    let mut q = id.to_be_bytes().to_vec();
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, u8::from(opt)]);
    for label in name.split('.').filter(|l| !l.is_empty()) {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.push(0);
    q.extend_from_slice(&qtype.to_be_bytes());
    q.extend_from_slice(&[0, 1]);
    if opt {
        q.extend_from_slice(&[0, 0, 41, 4, 0xd0, 0, 0, 0, 0, 0, 0]);
    }
    q
}

/// The answer to `query` (no OPT): a CNAME of the question's name, then A records under the
/// alias, names compressed.
fn dns_answer(query: &[u8], addresses: &[([u8; 4], u32)]) -> Vec<u8> {
    let mut r = query.to_vec();
    r[2] |= 0x80;
    r[3] = 0x80;
    r[7] = 1 + addresses.len() as u8;
    let alias = r.len() + 12;
    r.extend_from_slice(&[0xc0, 12, 0, 5, 0, 1, 0, 0, 0, 30, 0, 6, 3, b'c', b'd', b'n']);
    r.extend_from_slice(&[0xc0, 12]);
    for (ip, ttl) in addresses {
        r.extend_from_slice(&[0xc0 | (alias >> 8) as u8, alias as u8, 0, 1, 0, 1]);
        r.extend_from_slice(&ttl.to_be_bytes());
        r.extend_from_slice(&[0, 4]);
        r.extend_from_slice(ip);
    }
    r
}

fn dns(dir: &Path) {
    write(
        dir,
        "query-a-opt",
        &dns_query(0xbeef, "www.example.com", 1, true),
    );
    write(
        dir,
        "query-aaaa",
        &dns_query(0x1234, "API.Example.com", 28, false),
    );
    write(dir, "query-root", &dns_query(7, "", 2, false));
    let q = dns_query(0x4242, "www.example.com", 1, false);
    write(
        dir,
        "answer-cname-a",
        &dns_answer(&q, &[([192, 0, 2, 1], 300), ([10, 0, 0, 1], 5)]),
    );
    write(dir, "answer-empty", &dns_answer(&q, &[]));
    // NXDOMAIN with an SOA in the authority section.
    let mut nx = dns_query(0x5151, "missing.example", 1, false);
    nx[2] |= 0x80;
    nx[3] = 0x83;
    nx[9] = 1;
    nx.extend_from_slice(&[0xc0, 20, 0, 6, 0, 1, 0, 0, 0, 60, 0, 2, 0xc0, 20]);
    write(dir, "answer-nxdomain-soa", &nx);
}

// ---------------------------------------------------------------- route

fn route(dir: &Path) {
    let signer = route_signer();
    let expires = ROUTE_NOW + 3600;
    let b36 = to_b36(expires);
    let sig = signer.sign("sbx-7f3a", 8080, expires);
    write(
        dir,
        "signed",
        format!("sbx-7f3a/8080/{b36}/{sig}/files/upload?x").as_bytes(),
    );
    write(
        dir,
        "signed-bare",
        format!(
            "sbx-7f3a/44772/{b36}/{}",
            signer.sign("sbx-7f3a", 44772, expires)
        )
        .as_bytes(),
    );
    let old = retired_route_signer().sign("sbx-7f3a", 3000, expires);
    write(
        dir,
        "signed-retired-key",
        format!("sbx-7f3a/3000/{b36}/{old}/").as_bytes(),
    );
    let past = ROUTE_NOW - 60;
    let expired = signer.sign("sbx-7f3a", 8080, past);
    write(
        dir,
        "expired",
        format!("sbx-7f3a/8080/{}/{expired}/ws", to_b36(past)).as_bytes(),
    );
    write(dir, "wrong-signature", b"sbx-7f3a/8080/s44we8/0123abcdb/x");
    write(dir, "unsigned", b"sbx-7f3a/44772/ping");
    write(dir, "unsigned-files", b"sbx-7f3a/44772/files/download/");
}

// ---------------------------------------------------------------- quantity

fn quantity(dir: &Path) {
    for (name, q) in [
        ("milli", "500m"),
        ("gibi", "1Gi"),
        ("exp", "1e3"),
        ("neg-exp", "250e-3"),
        ("fraction", "1.5Gi"),
        ("dot", ".5"),
        ("plus", "+1"),
        ("kilo", "1K"),
        ("exa", "18E"),
        ("max", "18446744073709551615"),
        ("tiny", "1e-60"),
        ("big-milli", "128974848000m"),
        ("bad-suffix", "2Gx"),
        ("negative", "-512Mi"),
    ] {
        write(dir, name, q.as_bytes());
    }
}

// ---------------------------------------------------------------- artifact_manifest

fn meta(kind: ArtifactKind) -> ManifestMeta {
    let mut meta = ManifestMeta::new(
        kind,
        Digest::of(b"execd"),
        HostFacts {
            kernel: "6.1.0-18-amd64".into(),
            criu_version: Some("4.2".into()),
            arch: "x86_64".into(),
            cpu_features: vec!["avx2".into(), "sse4_2".into()],
        },
    );
    meta.created_at = chrono::DateTime::from_timestamp(1_700_000_000, 123_000_000).expect("time");
    meta
}

fn file(path: &str, size: u64) -> FileEntry {
    let blocks = (0..size.div_ceil(4 << 20))
        .map(|i| Digest::of(format!("{path}#{i}").as_bytes()))
        .collect();
    FileEntry {
        path: path.into(),
        mode: 0o644,
        kind: EntryKind::File { size, blocks },
    }
}

fn dir_entry(path: &str) -> FileEntry {
    FileEntry {
        path: path.into(),
        mode: 0o755,
        kind: EntryKind::Dir,
    }
}

fn artifact_manifest(dir: &Path) {
    let mut template = meta(ArtifactKind::Template);
    template.lineage.source = Some(SourceImage {
        reference: "python:3.12".into(),
        digest: Some(format!("sha256:{}", "ab".repeat(32))),
    });
    template.policy = Some(
        serde_json::json!({"egress": {"default": "deny", "allow": ["files.example.org"]}, "ttl": 3600.5}),
    );
    template.labels.insert("team".into(), "ml".into());
    template.rootfs = Some(RootfsImage {
        path: "rootfs.erofs".into(),
        format: PackFormat::Erofs,
    });
    let files = vec![
        dir_entry("images"),
        file("images/core-1.img", 10),
        file("images/pages-1.img", (9 << 20) + 1),
        file("rootfs.erofs", 4 << 20),
        dir_entry("upper"),
        dir_entry("upper/etc"),
        file("upper/etc/hostname", 0),
        FileEntry {
            path: "upper/lib".into(),
            mode: 0o777,
            kind: EntryKind::Symlink {
                target: "usr/lib".into(),
            },
        },
    ];
    let manifest = Manifest::try_new(template, files).expect("template manifest");
    write(dir, "template", &manifest.to_bytes().expect("bytes"));

    let mut snapshot = meta(ArtifactKind::Snapshot);
    snapshot.lineage.parent = Some(manifest.digest().expect("digest"));
    snapshot.rootfs = Some(RootfsImage {
        path: "rootfs.tar".into(),
        format: PackFormat::Tar,
    });
    let snapshot =
        Manifest::try_new(snapshot, vec![file("rootfs.tar", 3)]).expect("snapshot manifest");
    write(dir, "snapshot", &snapshot.to_bytes().expect("bytes"));

    // A float that serde_json's default parsing read back as its neighbour (fixed).
    let mut float = meta(ArtifactKind::Checkpoint);
    float.policy = Some(serde_json::json!({"ttl": f64::from_bits(0x4c1c_5256_9aaf_68f4)}));
    let float = Manifest::try_new(float, vec![]).expect("float manifest");
    write(dir, "regression-float", &float.to_bytes().expect("bytes"));

    let checkpoint = Manifest::try_new(meta(ArtifactKind::Checkpoint), vec![]).expect("empty");
    let mut pretty = serde_json::to_vec_pretty(&checkpoint).expect("json");
    pretty.push(b'\n');
    write(dir, "checkpoint-pretty", &pretty);
}

// ---------------------------------------------------------------- image_unpack

/// A tar layer of `entries`, each (path, kind), written by the tar crate.
enum Tar<'a> {
    Dir(&'a str, u32),
    File(&'a str, &'a [u8], u32),
    Symlink(&'a str, &'a str),
    Hardlink(&'a str, &'a str),
    Fifo(&'a str),
    /// A file preceded by a PAX header with an xattr and an owner.
    PaxFile(&'a str, &'a [u8]),
}

fn tar_layer(entries: &[Tar<'_>]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for entry in entries {
        let mut h = tar::Header::new_ustar();
        h.set_mtime(1_700_000_000);
        h.set_uid(0);
        h.set_gid(0);
        match entry {
            Tar::Dir(path, mode) => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(*mode);
                h.set_size(0);
                b.append_data(&mut h, path, &[][..]).expect("dir");
            }
            Tar::File(path, data, mode) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(*mode);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, path, *data).expect("file");
            }
            Tar::Symlink(path, target) => {
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_mode(0o777);
                h.set_size(0);
                b.append_link(&mut h, path, target).expect("symlink");
            }
            Tar::Hardlink(path, target) => {
                h.set_entry_type(tar::EntryType::Link);
                h.set_mode(0o644);
                h.set_size(0);
                b.append_link(&mut h, path, target).expect("hard link");
            }
            Tar::Fifo(path) => {
                h.set_entry_type(tar::EntryType::Fifo);
                h.set_mode(0o600);
                h.set_size(0);
                b.append_data(&mut h, path, &[][..]).expect("fifo");
            }
            Tar::PaxFile(path, data) => {
                b.append_pax_extensions([
                    ("SCHILY.xattr.user.fastbox", &b"seed"[..]),
                    ("uid", &b"1000"[..]),
                    ("gid", &b"1000"[..]),
                ])
                .expect("pax");
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(0o4755);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, path, *data).expect("pax file");
            }
        }
    }
    b.into_inner().expect("tar")
}

fn layers(layers: &[Vec<u8>]) -> Vec<u8> {
    layers.join(LAYER_SEPARATOR)
}

fn image_unpack(dir: &Path) {
    let base = tar_layer(&[
        Tar::Dir("./", 0o755),
        Tar::Dir("etc", 0o755),
        Tar::File("etc/hostname", b"sandbox\n", 0o644),
        Tar::File("etc/shadow", b"root:*:19000::::::\n", 0o640),
        Tar::Dir("usr", 0o755),
        Tar::Dir("usr/bin", 0o755),
        Tar::File("usr/bin/tool", b"#!/bin/sh\necho hi\n", 0o755),
        Tar::Hardlink("usr/bin/tool2", "usr/bin/tool"),
        Tar::Symlink("bin", "usr/bin"),
        Tar::Symlink("lib", "/usr/lib"),
        Tar::Dir("tmp", 0o1777),
        Tar::Fifo("tmp/fifo"),
        Tar::Dir("var/cache", 0o555),
        Tar::File("old", b"lower\n", 0o600),
    ]);
    write(dir, "one-layer", &base);
    let upper = tar_layer(&[
        Tar::File(".wh.old", b"", 0o644),
        Tar::File("etc/.wh..wh..opq", b"", 0o644),
        Tar::File("etc/resolv.conf", b"nameserver 192.0.2.53\n", 0o644),
        Tar::File("bin/.wh.tool2", b"", 0o644),
        Tar::File("bin/new", b"through a symlinked parent\n", 0o755),
        Tar::Symlink("up", "../canary"),
        Tar::Symlink("abs", "/etc/shadow"),
        Tar::Hardlink("usr/bin/link-to-up", "up"),
        Tar::PaxFile("usr/bin/suid", b"\x7fELF"),
    ]);
    write(dir, "two-layers-whiteouts", &layers(&[base.clone(), upper]));
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&base).expect("gzip");
    write(dir, "gzip", &gz.finish().expect("gzip"));
    // The same kinds of layers as text (fastbox_fuzz::text_layers).
    let text = [
        "d 0755 etc",
        "f 0644 etc/hostname sandbox",
        "d 0755 usr",
        "d 0755 usr/bin",
        "f 0755 usr/bin/tool #!/bin/sh",
        "h 0644 usr/bin/tool2 usr/bin/tool",
        "l 0777 bin usr/bin",
        "l 0777 lib /usr/lib",
        "p 0600 run/fifo",
        "c 0666 dev/null 1,3",
        "x SCHILY.xattr.user.fastbox seed",
        "x uid 1000",
        "f 04755 usr/bin/suid ELF",
        "f 0600 old lower",
        "---",
        "f 0644 .wh.old",
        "f 0644 etc/.wh..wh..opq",
        "f 0644 etc/resolv.conf nameserver 192.0.2.53",
        "f 0644 bin/.wh.tool2",
        "f 0755 bin/new through a symlinked parent",
        "l 0777 up ../canary",
        "h 0644 up2 up",
        "d 0555 ro",
        "f 0444 ro/file read only",
        "---",
        "d 0700 etc/hostname",
        "f 0644 usr a file where a directory was",
        "f 0644 lib/libc.so through an absolute symlink",
        "f 0644 ro/.wh.file",
    ];
    write(dir, "text-three-layers", text_input(&text).as_bytes());
    let types = [
        "7 0644 contiguous data",
        "g 0644 global path=x",
        "L 0644 ././@LongLink a-long-name",
        "f 0644 short",
        "K 0644 ././@LongLink a-long-target",
        "l 0777 link short",
        "S 0644 sparse abc",
        "V 0644 volume",
        "d 0755 ./",
        "f 0644 /absolute/file leading slash",
    ];
    write(dir, "text-types", text_input(&types).as_bytes());
    // Escapes the target found (fixed): whiteouts of `..`, `.` and of nothing; directories
    // replaced by symlinks before the layer's end set their modes.
    for (name, whiteout) in [("dotdot", ".wh..."), ("dot", ".wh.."), ("empty", ".wh.")] {
        let layers = ["f 0644 x", "---", &format!("f 0644 {whiteout}")];
        let seed = format!("regression-whiteout-{name}");
        write(dir, &seed, text_input(&layers).as_bytes());
    }
    let dir_then_symlink = [
        "d 04777 d",
        "l 0777 d ../canary",
        "d 0700 a",
        "d 0777 a/canary",
        "l 0777 a ..",
    ];
    write(
        dir,
        "regression-dir-then-symlink",
        text_input(&dir_then_symlink).as_bytes(),
    );
}

fn text_input(lines: &[&str]) -> String {
    let magic = std::str::from_utf8(TEXT_LAYERS_MAGIC).expect("ascii");
    format!("{magic}{}\n", lines.join("\n"))
}

// ---------------------------------------------------------------- oci_document

fn oci_document(dir: &Path) {
    let d = |c: char| format!("sha256:{}", c.to_string().repeat(64));
    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": d('1'), "size": 1234,
             "platform": {"architecture": "amd64", "os": "linux"}},
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": d('2'), "size": 1234,
             "platform": {"architecture": "arm64", "os": "linux", "variant": "v8"}},
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": d('3'), "size": 566,
             "platform": {"architecture": "unknown", "os": "unknown"},
             "annotations": {"vnd.docker.reference.type": "attestation-manifest"}}
        ]
    });
    write(
        dir,
        "oci-index",
        &serde_json::to_vec_pretty(&index).expect("json"),
    );
    let list = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.list.v2+json",
        "manifests": [{"mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                       "digest": d('4'), "size": 528, "platform": {"architecture": "amd64", "os": "linux"}}]
    });
    write(
        dir,
        "docker-list",
        &serde_json::to_vec(&list).expect("json"),
    );
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": FUZZ_CONFIG_DIGEST, "size": 2},
        "layers": [
            {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": d('a'), "size": 3_000_000},
            {"mediaType": "application/vnd.oci.image.layer.v1.tar+zstd", "digest": d('b'), "size": 42}
        ],
        "annotations": {"org.opencontainers.image.created": "2024-01-01T00:00:00Z"}
    });
    write(
        dir,
        "oci-manifest",
        &serde_json::to_vec_pretty(&manifest).expect("json"),
    );
    let docker = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": FUZZ_CONFIG_DIGEST, "size": 2},
        "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip", "digest": d('c'), "size": 100}]
    });
    write(
        dir,
        "docker-manifest",
        &serde_json::to_vec(&docker).expect("json"),
    );
    let config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": ["/docker-entrypoint.sh"], "Cmd": ["python3"],
                   "Env": ["PATH=/usr/local/bin:/usr/bin", "LANG=C.UTF-8"],
                   "WorkingDir": "/app", "User": "1000:1000"},
        "rootfs": {"type": "layers", "diff_ids": [d('e'), d('f')]},
        "history": [{"created_by": "/bin/sh -c #(nop) CMD [\"python3\"]", "empty_layer": true}]
    });
    write(
        dir,
        "config",
        &serde_json::to_vec_pretty(&config).expect("json"),
    );
    // An index naming a digest that is not one, shown before it is checked (fixed).
    write(
        dir,
        "regression-index-digest-utf8",
        br#"{"manifests":[{"digest":"sha256:01234567890\u00e9abc"}]}"#,
    );
    write(
        dir,
        "schema1",
        br#"{"schemaVersion":1,"name":"library/x","tag":"1","fsLayers":[{"blobSum":"sha256:00"}]}"#,
    );
}
