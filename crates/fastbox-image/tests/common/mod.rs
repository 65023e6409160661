//! Test images built in the test (no network), and a real distribution registry on loopback.
#![allow(dead_code)]

pub mod fake_http;

use std::fs;
use std::io::Write;
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fastbox_image::{ImageCache, ImageConfig};
use sha2::{Digest, Sha256};

pub fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// A fresh cache in a temp dir (kept alive by the returned guard). The test registries live on
/// loopback, which pulls refuse by default: the allowance is explicit.
pub fn cache() -> (tempfile::TempDir, ImageCache) {
    cache_with(ImageConfig {
        registry_allow_private: vec!["127.0.0.0/8".parse().unwrap()],
        ..ImageConfig::default()
    })
}

/// A fresh cache in a temp dir with `cfg` (its `cache_dir` replaced).
pub fn cache_with(cfg: ImageConfig) -> (tempfile::TempDir, ImageCache) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = ImageConfig {
        cache_dir: dir.path().join("cache"),
        ..cfg
    };
    (dir, ImageCache::try_new(cfg).unwrap())
}

fn tar_header(kind: tar::EntryType, path: &str, size: u64, mode: u32) -> tar::Header {
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(kind);
    h.set_path(path).unwrap();
    h.set_size(size);
    h.set_mode(mode);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(1_700_000_000);
    h.set_cksum();
    h
}

/// Builds a layer tarball entry by entry.
pub struct LayerBuilder(tar::Builder<Vec<u8>>);

impl LayerBuilder {
    pub fn new() -> Self {
        LayerBuilder(tar::Builder::new(Vec::new()))
    }
    pub fn dir(mut self, path: &str) -> Self {
        self.0
            .append(
                &tar_header(tar::EntryType::Directory, path, 0, 0o755),
                &[][..],
            )
            .unwrap();
        self
    }
    pub fn file(self, path: &str, data: &str) -> Self {
        self.file_mode(path, data, 0o644)
    }
    pub fn file_mode(mut self, path: &str, data: &str, mode: u32) -> Self {
        self.0
            .append(
                &tar_header(tar::EntryType::Regular, path, data.len() as u64, mode),
                data.as_bytes(),
            )
            .unwrap();
        self
    }
    pub fn owned_file(mut self, path: &str, data: &str, uid: u64, gid: u64) -> Self {
        let mut h = tar_header(tar::EntryType::Regular, path, data.len() as u64, 0o640);
        h.set_uid(uid);
        h.set_gid(gid);
        h.set_cksum();
        self.0.append(&h, data.as_bytes()).unwrap();
        self
    }
    pub fn symlink(mut self, path: &str, target: &str) -> Self {
        let mut h = tar_header(tar::EntryType::Symlink, path, 0, 0o777);
        h.set_link_name(target).unwrap();
        h.set_cksum();
        self.0.append(&h, &[][..]).unwrap();
        self
    }
    pub fn tar(self) -> Vec<u8> {
        self.0.into_inner().unwrap()
    }
}

pub fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(bytes).unwrap();
    gz.finish().unwrap()
}

pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

/// A two-layer image: the upper layer whites out a file and makes a directory opaque.
pub struct TestImage {
    /// Uncompressed layer tarballs.
    pub layers_tar: Vec<Vec<u8>>,
    /// gzip blobs as pushed.
    pub layers: Vec<Vec<u8>>,
    pub config: Vec<u8>,
    pub manifest: Vec<u8>,
}

impl TestImage {
    pub fn sample() -> Self {
        let lower = LayerBuilder::new()
            .dir("etc/")
            .file("etc/hello", "hello from the lower layer\n")
            .file("etc/removed", "whited out by the upper layer\n")
            .dir("opt/")
            .dir("opt/app/")
            .file("opt/app/old", "hidden by the opaque marker\n")
            .dir("bin/")
            .file_mode("bin/tool", "#!/bin/sh\necho tool\n", 0o755)
            .symlink("etc/link", "hello")
            .owned_file("etc/owned", "owned by 1234:5678\n", 1234, 5678)
            .tar();
        let upper = LayerBuilder::new()
            .file("etc/.wh.removed", "")
            .file("opt/app/.wh..wh..opq", "")
            .file("opt/app/new", "new in the upper layer\n")
            .file("etc/hello", "hello from the upper layer\n")
            .tar();
        Self::from_layers(vec![lower, upper])
    }

    pub fn from_layers(layers_tar: Vec<Vec<u8>>) -> Self {
        let layers: Vec<Vec<u8>> = layers_tar.iter().map(|l| gzip(l)).collect();
        let diff_ids: Vec<String> = layers_tar.iter().map(|l| sha256(l)).collect();
        let config = serde_json::to_vec(&serde_json::json!({
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "Entrypoint": ["/bin/tool"],
                "Cmd": ["--flag"],
                "Env": ["PATH=/usr/bin:/bin", "GREETING=hi"],
                "WorkingDir": "/opt/app",
            },
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }))
        .unwrap();
        let mut image = TestImage {
            layers_tar,
            layers,
            config,
            manifest: Vec::new(),
        };
        image.manifest = image.manifest_with(OCI_CONFIG, OCI_LAYER_GZIP);
        image
    }

    pub fn manifest_with(&self, config_type: &str, layer_type: &str) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": config_type, "digest": sha256(&self.config), "size": self.config.len()},
            "layers": self.layers.iter().map(|l| serde_json::json!({
                "mediaType": layer_type, "digest": sha256(l), "size": l.len()
            })).collect::<Vec<_>>(),
        }))
        .unwrap()
    }

    pub fn config_digest(&self) -> String {
        sha256(&self.config)
    }

    pub fn manifest_digest(&self) -> String {
        sha256(&self.manifest)
    }

    /// Every blob: config and layers.
    pub fn blobs(&self) -> Vec<&[u8]> {
        let mut v: Vec<&[u8]> = vec![&self.config];
        v.extend(self.layers.iter().map(|l| l.as_slice()));
        v
    }

    /// Writes an OCI image layout with the manifest tagged `tag`.
    pub fn write_oci_layout(&self, dir: &Path, tag: &str) {
        let blobs = dir.join("blobs/sha256");
        fs::create_dir_all(&blobs).unwrap();
        for b in self.blobs().into_iter().chain([self.manifest.as_slice()]) {
            fs::write(blobs.join(&sha256(b)[7..]), b).unwrap();
        }
        fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
        let index = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": OCI_INDEX,
            "manifests": [{
                "mediaType": OCI_MANIFEST,
                "digest": self.manifest_digest(),
                "size": self.manifest.len(),
                "annotations": {"org.opencontainers.image.ref.name": tag},
            }],
        });
        fs::write(dir.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
    }

    /// An OCI layout packed in a tar file.
    pub fn write_oci_archive(&self, path: &Path, tag: &str) {
        let layout = tempfile::tempdir().unwrap();
        self.write_oci_layout(layout.path(), tag);
        let mut b = tar::Builder::new(fs::File::create(path).unwrap());
        b.append_dir_all(".", layout.path()).unwrap();
        b.finish().unwrap();
    }

    /// The classic `docker save` format: manifest.json, <id>.json, <layer>/layer.tar.
    pub fn write_docker_archive(&self, path: &Path, repo_tag: &str) {
        let mut b = tar::Builder::new(fs::File::create(path).unwrap());
        let mut add = |name: &str, data: &[u8]| {
            let h = tar_header(tar::EntryType::Regular, name, data.len() as u64, 0o644);
            b.append(&h, data).unwrap();
        };
        let config_name = format!("{}.json", &self.config_digest()[7..]);
        add(&config_name, &self.config);
        let mut layer_names = Vec::new();
        for (i, layer) in self.layers_tar.iter().enumerate() {
            let name = format!("{:064x}/layer.tar", i + 1);
            add(&name, layer);
            layer_names.push(name);
        }
        let manifest = serde_json::json!([{"Config": config_name, "RepoTags": [repo_tag], "Layers": layer_names}]);
        add("manifest.json", &serde_json::to_vec(&manifest).unwrap());
        b.into_inner().unwrap().sync_all().unwrap();
    }

    /// Asserts the unpacked result of `sample()`.
    pub fn check_sample_rootfs(rootfs: &Path) {
        let read = |p: &str| fs::read_to_string(rootfs.join(p)).ok();
        assert_eq!(
            read("etc/hello").as_deref(),
            Some("hello from the upper layer\n")
        );
        assert_eq!(read("etc/removed"), None, "whiteout applied");
        assert_eq!(read("opt/app/old"), None, "opaque directory applied");
        assert_eq!(
            read("opt/app/new").as_deref(),
            Some("new in the upper layer\n")
        );
        assert_eq!(
            read("etc/link").as_deref(),
            Some("hello from the upper layer\n")
        );
        assert_eq!(
            fs::read_link(rootfs.join("etc/link")).unwrap(),
            Path::new("hello")
        );
        assert!(!rootfs.join("etc/.wh.removed").exists());
        assert!(!rootfs.join("opt/app/.wh..wh..opq").exists());
        let mode = fs::metadata(rootfs.join("bin/tool"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o755);
        if is_root() {
            use std::os::unix::fs::MetadataExt;
            let m = fs::metadata(rootfs.join("etc/owned")).unwrap();
            assert_eq!(
                (m.uid(), m.gid()),
                (1234, 5678),
                "ownership restored as root"
            );
        }
    }
}

/// Where the `docker-registry` binary is, or why the test is skipped.
pub fn registry_binary() -> Result<PathBuf, String> {
    let mut candidates = Vec::new();
    if let Ok(p) = std::env::var("FASTBOX_REGISTRY_BIN") {
        candidates.push(PathBuf::from(p));
    }
    if let Ok(repo) = std::env::var("FASTBOX_REPO") {
        candidates.push(Path::new(&repo).join(".deps/registry/usr/bin/docker-registry"));
        candidates.push(Path::new(&repo).join(".deps/registry/bin/docker-registry"));
    }
    candidates.push(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.deps/registry/usr/bin/docker-registry"),
    );
    candidates.push(PathBuf::from("/usr/bin/docker-registry"));
    candidates.iter().find(|p| p.is_file()).cloned().ok_or_else(|| {
        format!(
            "no docker-registry binary (looked at {}); run scripts/setup.sh or set FASTBOX_REGISTRY_BIN",
            candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        )
    })
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A `docker-registry serve` process on a random loopback port, killed on drop.
pub struct Registry {
    child: Child,
    pub addr: String,
    dir: tempfile::TempDir,
    pub auth: Option<(String, String)>,
}

impl Registry {
    /// Starts a registry (with htpasswd basic auth when `auth` is given); `None` means skip.
    pub fn start(auth: Option<(&str, &str)>) -> Option<Registry> {
        let binary = match registry_binary() {
            Ok(b) => b,
            Err(reason) => {
                eprintln!("SKIPPED: {reason}");
                return None;
            }
        };
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let addr = format!("127.0.0.1:{port}");
        let mut config = format!(
            "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {addr}\n  secret: fastbox-test-secret\n",
            dir.path().join("storage").display()
        );
        if let Some((user, password)) = auth {
            let hash = bcrypt::hash(password, 4).unwrap();
            fs::write(dir.path().join("htpasswd"), format!("{user}:{hash}\n")).unwrap();
            config.push_str(&format!(
                "auth:\n  htpasswd:\n    realm: fastbox-test\n    path: {}\n",
                dir.path().join("htpasswd").display()
            ));
        }
        let config_path = dir.path().join("config.yml");
        fs::write(&config_path, config).unwrap();
        let log = fs::File::create(dir.path().join("registry.log")).unwrap();
        let child = Command::new(&binary)
            .arg("serve")
            .arg(&config_path)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", binary.display()));
        let registry = Registry {
            child,
            addr,
            dir,
            auth: auth.map(|(u, p)| (u.to_owned(), p.to_owned())),
        };
        registry.wait_ready();
        Some(registry)
    }

    fn wait_ready(&self) {
        let client = reqwest::blocking::Client::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(r) = client.get(format!("http://{}/v2/", self.addr)).send()
                && (r.status().as_u16() == 200 || r.status().as_u16() == 401)
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("registry did not start; log:\n{}", self.log());
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("registry.log")).unwrap_or_default()
    }

    fn request(&self, method: reqwest::Method, url: &str) -> reqwest::blocking::RequestBuilder {
        let r = reqwest::blocking::Client::new().request(method, url);
        match &self.auth {
            Some((u, p)) => r.basic_auth(u, Some(p)),
            None => r,
        }
    }

    /// Pushes blobs through the upload API (POST, then PUT ?digest=) and the manifest.
    pub fn push_blob(&self, repo: &str, blob: &[u8]) {
        let start = self
            .request(
                reqwest::Method::POST,
                &format!("http://{}/v2/{repo}/blobs/uploads/", self.addr),
            )
            .send()
            .unwrap();
        assert_eq!(
            start.status().as_u16(),
            202,
            "upload start: {}",
            start.text().unwrap_or_default()
        );
        let location = start.headers()["location"].to_str().unwrap().to_owned();
        let url = if location.starts_with('/') {
            format!("http://{}{location}", self.addr)
        } else {
            location
        };
        let sep = if url.contains('?') { '&' } else { '?' };
        let put = self
            .request(
                reqwest::Method::PUT,
                &format!("{url}{sep}digest={}", sha256(blob)),
            )
            .header("content-type", "application/octet-stream")
            .body(blob.to_vec())
            .send()
            .unwrap();
        assert_eq!(
            put.status().as_u16(),
            201,
            "upload finish: {}",
            put.text().unwrap_or_default()
        );
    }

    pub fn push_manifest(&self, repo: &str, reference: &str, media_type: &str, manifest: &[u8]) {
        let put = self
            .request(
                reqwest::Method::PUT,
                &format!("http://{}/v2/{repo}/manifests/{reference}", self.addr),
            )
            .header("content-type", media_type)
            .body(manifest.to_vec())
            .send()
            .unwrap();
        assert_eq!(
            put.status().as_u16(),
            201,
            "manifest push: {}",
            put.text().unwrap_or_default()
        );
    }

    pub fn push(&self, repo: &str, tag: &str, image: &TestImage) {
        for blob in image.blobs() {
            self.push_blob(repo, blob);
        }
        self.push_manifest(repo, tag, OCI_MANIFEST, &image.manifest);
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
