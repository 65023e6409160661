//! Rootfs directories, OCI layouts and archives, docker-save archives, and the cache's
//! convergence and atomicity, through the public API.

mod common;

use std::fs;
use std::sync::{Arc, Barrier};

use common::{TestImage, cache, sha256};
use fastbox_image::{ImageCache, ImageConfig, ImageError, NoProgress};

#[test]
fn rootfs_directory_is_used_in_place() {
    let (_tmp, cache) = cache();
    let rootfs = tempfile::tempdir().unwrap();
    fs::write(rootfs.path().join("marker"), "x").unwrap();
    let path = rootfs.path().to_str().unwrap();
    let a = cache
        .resolve(&format!("dir:{path}"), None, &NoProgress)
        .unwrap();
    let b = cache.resolve(path, None, &NoProgress).unwrap();
    assert_eq!(a.rootfs, fs::canonicalize(rootfs.path()).unwrap());
    assert_eq!(a.digest, b.digest);
    assert!(a.digest.starts_with("sha256:"));
    assert_eq!(a.canonical_reference, format!("dir:{}", a.rootfs.display()));
    assert_eq!(a.served_by, None);
    // A change of the directory's entries changes its digest.
    std::thread::sleep(std::time::Duration::from_millis(20));
    fs::write(rootfs.path().join("new"), "y").unwrap();
    let c = cache.resolve(path, None, &NoProgress).unwrap();
    assert_ne!(a.digest, c.digest);
}

#[test]
fn rootfs_directory_errors_name_the_problem() {
    let (_tmp, cache) = cache();
    let err = cache
        .resolve("dir:/nonexistent/rootfs", None, &NoProgress)
        .unwrap_err();
    assert!(matches!(err, ImageError::NotFound { .. }), "{err}");
    let file = tempfile::NamedTempFile::new().unwrap();
    let err = cache
        .resolve(file.path().to_str().unwrap(), None, &NoProgress)
        .unwrap_err();
    assert!(err.to_string().contains("is not a directory"), "{err}");
}

#[test]
fn oci_layout_is_unpacked_with_whiteouts_and_config() {
    let (_tmp, cache) = cache();
    let layout = tempfile::tempdir().unwrap();
    let image = TestImage::sample();
    image.write_oci_layout(layout.path(), "v1");
    let reference = format!("oci:{}", layout.path().display());
    let resolved = cache.resolve(&reference, None, &NoProgress).unwrap();
    TestImage::check_sample_rootfs(&resolved.rootfs);
    assert_eq!(resolved.digest, image.config_digest());
    assert_eq!(
        resolved.manifest_digest.as_deref(),
        Some(image.manifest_digest().as_str())
    );
    assert_eq!(resolved.config.entrypoint, ["/bin/tool"]);
    assert_eq!(resolved.config.cmd, ["--flag"]);
    assert_eq!(resolved.config.env, ["PATH=/usr/bin:/bin", "GREETING=hi"]);
    assert_eq!(resolved.config.working_dir.as_deref(), Some("/opt/app"));
    assert!(!resolved.cached);
    assert!(resolved.rootfs.starts_with(cache.cache_dir()));

    // By tag, and a second time from the cache.
    let again = cache
        .resolve(&format!("{reference}:v1"), None, &NoProgress)
        .unwrap();
    assert!(again.cached);
    assert_eq!(again.rootfs, resolved.rootfs);
    let err = cache
        .resolve(&format!("{reference}:v2"), None, &NoProgress)
        .unwrap_err();
    assert!(matches!(err, ImageError::NotFound { .. }), "{err}");
    assert!(err.to_string().contains("available: v1"), "{err}");
}

#[test]
fn oci_archive_is_read_without_extraction() {
    let (_tmp, cache) = cache();
    let dir = tempfile::tempdir().unwrap();
    let archive = dir.path().join("image.tar");
    let image = TestImage::sample();
    image.write_oci_archive(&archive, "latest");
    let resolved = cache
        .resolve(
            &format!("oci-archive:{}:latest", archive.display()),
            None,
            &NoProgress,
        )
        .unwrap();
    TestImage::check_sample_rootfs(&resolved.rootfs);
    assert_eq!(resolved.digest, image.config_digest());
    // Gzipped archives work too.
    let gz = dir.path().join("image.tar.gz");
    fs::write(&gz, common::gzip(&fs::read(&archive).unwrap())).unwrap();
    let again = cache
        .resolve(&format!("oci-archive:{}", gz.display()), None, &NoProgress)
        .unwrap();
    assert_eq!(again.digest, resolved.digest);
    assert!(again.cached);
    assert!(
        fs::read_dir(cache.cache_dir().join("tmp"))
            .unwrap()
            .next()
            .is_none(),
        "scratch removed"
    );
}

#[test]
fn docker_save_archive_is_unpacked() {
    let (_tmp, cache) = cache();
    let dir = tempfile::tempdir().unwrap();
    let archive = dir.path().join("saved.tar");
    let image = TestImage::sample();
    image.write_docker_archive(&archive, "example/app:1.0");
    for reference in [
        format!("docker-archive:{}", archive.display()),
        format!("docker-archive:{}:example/app:1.0", archive.display()),
        format!(
            "docker-archive:{}:docker.io/example/app:1.0",
            archive.display()
        ),
    ] {
        let resolved = cache
            .resolve(&reference, None, &NoProgress)
            .unwrap_or_else(|e| panic!("{reference}: {e}"));
        TestImage::check_sample_rootfs(&resolved.rootfs);
        assert_eq!(
            resolved.digest,
            image.config_digest(),
            "same content address as the OCI forms"
        );
        assert_eq!(resolved.config.working_dir.as_deref(), Some("/opt/app"));
    }
    let err = cache
        .resolve(
            &format!("docker-archive:{}:other:1", archive.display()),
            None,
            &NoProgress,
        )
        .unwrap_err();
    assert!(
        err.to_string().contains("available: example/app:1.0"),
        "{err}"
    );
}

#[test]
fn docker_archive_layers_are_checked_against_diff_ids() {
    let (_tmp, cache) = cache();
    let dir = tempfile::tempdir().unwrap();
    let archive = dir.path().join("saved.tar");
    let mut image = TestImage::sample();
    // The config promises other content than the archive holds.
    image.layers_tar[1] = common::LayerBuilder::new().file("evil", "x").tar();
    let config_diff_ids_from = TestImage::sample();
    image.config = config_diff_ids_from.config.clone();
    image.write_docker_archive(&archive, "x:1");
    let err = cache
        .resolve(
            &format!("docker-archive:{}", archive.display()),
            None,
            &NoProgress,
        )
        .unwrap_err();
    assert!(matches!(err, ImageError::DigestMismatch { .. }), "{err}");
}

#[test]
fn a_failed_unpack_leaves_nothing_visible() {
    let (_tmp, cache) = cache();
    let layout = tempfile::tempdir().unwrap();
    let image = TestImage::sample();
    image.write_oci_layout(layout.path(), "v1");
    // Corrupt the upper layer blob in place: its digest no longer matches.
    let blob = layout
        .path()
        .join("blobs/sha256")
        .join(&sha256(&image.layers[1])[7..]);
    let mut bytes = fs::read(&blob).unwrap();
    let n = bytes.len();
    bytes[n - 9] ^= 0xff; // inside the gzip trailer's crc: decompression or digest fails
    fs::write(&blob, bytes).unwrap();
    let err = cache
        .resolve(
            &format!("oci:{}", layout.path().display()),
            None,
            &NoProgress,
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            ImageError::DigestMismatch { .. } | ImageError::Unpack { .. }
        ),
        "{err}"
    );
    let images = cache.cache_dir().join("images/sha256");
    assert!(
        fs::read_dir(&images).unwrap().next().is_none(),
        "no entry published"
    );
    assert!(
        fs::read_dir(cache.cache_dir().join("tmp"))
            .unwrap()
            .next()
            .is_none(),
        "staging removed"
    );
}

#[test]
fn concurrent_resolutions_converge_on_one_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let layout = tempfile::tempdir().unwrap();
    TestImage::sample().write_oci_layout(layout.path(), "v1");
    let reference = format!("oci:{}", layout.path().display());
    let cfg = ImageConfig {
        cache_dir: tmp.path().join("cache"),
        ..ImageConfig::default()
    };
    let barrier = Arc::new(Barrier::new(4));
    let handles: Vec<_> = (0..4)
        .map(|_| {
            // Separate instances, separate lock file descriptions: as separate processes would.
            let cache = ImageCache::try_new(cfg.clone()).unwrap();
            let (barrier, reference) = (barrier.clone(), reference.clone());
            std::thread::spawn(move || {
                barrier.wait();
                cache.resolve(&reference, None, &NoProgress).unwrap()
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(results.iter().all(|r| r.rootfs == results[0].rootfs));
    assert_eq!(
        results.iter().filter(|r| !r.cached).count(),
        1,
        "exactly one resolution built the rootfs"
    );
    TestImage::check_sample_rootfs(&results[0].rootfs);
    assert_eq!(
        fs::read_dir(tmp.path().join("cache/images/sha256"))
            .unwrap()
            .count(),
        1
    );
    assert!(
        fs::read_dir(tmp.path().join("cache/tmp"))
            .unwrap()
            .next()
            .is_none()
    );
}

#[test]
fn stale_staging_of_a_crashed_builder_is_cleaned() {
    let (_tmp, cache) = cache();
    let layout = tempfile::tempdir().unwrap();
    let image = TestImage::sample();
    image.write_oci_layout(layout.path(), "v1");
    let stale = cache
        .cache_dir()
        .join("tmp")
        .join(format!("{}.999-dead-0", &image.config_digest()[7..]));
    fs::create_dir_all(stale.join("rootfs/etc")).unwrap();
    cache
        .resolve(
            &format!("oci:{}", layout.path().display()),
            None,
            &NoProgress,
        )
        .unwrap();
    assert!(!stale.exists());
}

#[test]
fn layouts_with_several_images_need_a_name() {
    let (_tmp, cache) = cache();
    let layout = tempfile::tempdir().unwrap();
    let image = TestImage::sample();
    image.write_oci_layout(layout.path(), "v1");
    let index_path = layout.path().join("index.json");
    let mut index: serde_json::Value =
        serde_json::from_slice(&fs::read(&index_path).unwrap()).unwrap();
    let mut second = index["manifests"][0].clone();
    second["annotations"]["org.opencontainers.image.ref.name"] = "v2".into();
    index["manifests"].as_array_mut().unwrap().push(second);
    fs::write(&index_path, serde_json::to_vec(&index).unwrap()).unwrap();
    let err = cache
        .resolve(
            &format!("oci:{}", layout.path().display()),
            None,
            &NoProgress,
        )
        .unwrap_err();
    assert!(err.to_string().contains("several images"), "{err}");
    cache
        .resolve(
            &format!("oci:{}:v2", layout.path().display()),
            None,
            &NoProgress,
        )
        .unwrap();
}
