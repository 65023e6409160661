//! `/files` and `/directories`, plain and under `/v1/filesystem/{uid}/{gid}`.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::*;
use serde_json::json;

async fn upload(app: &TestApp, prefix: &str, files: &[(serde_json::Value, &[u8])]) -> Reply {
    let (ct, body) = upload_body(files);
    app.send(
        Request::post(format!("{prefix}/files/upload"))
            .header("content-type", ct)
            .body(Body::from(body))
            .unwrap(),
    )
    .await
}

fn q(p: &std::path::Path) -> String {
    urlencode(p.to_str().unwrap())
}

#[tokio::test]
async fn upload_pairs_then_download_whole_range_and_lines() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("nested/deeper/a.txt");
    let b = dir.path().join("b.bin");
    let app = test_app();
    let r = upload(
        &app,
        "",
        &[
            (
                json!({"path": a, "owner": null, "group": null, "mode": 600}),
                b"line1\nline2\nline3\nline4",
            ),
            (
                json!({"path": b, "mode": 755}),
                &[0u8, 1, 2, 3, 4, 5, 6, 7, 8, 9],
            ),
        ],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(
        std::fs::metadata(&a).unwrap().permissions().mode() & 0o777,
        0o600
    );
    assert_eq!(
        std::fs::metadata(&b).unwrap().permissions().mode() & 0o777,
        0o755
    );

    let whole = app.get(&format!("/files/download?path={}", q(&a))).await;
    assert_eq!(whole.status, StatusCode::OK);
    assert_eq!(whole.text(), "line1\nline2\nline3\nline4");
    assert_eq!(whole.header("content-length").as_deref(), Some("23"));
    assert_eq!(
        whole.header("content-disposition").as_deref(),
        Some("attachment; filename=\"a.txt\"")
    );

    let part = app
        .send(
            Request::get(format!("/files/download?path={}", q(&b)))
                .header("Range", "bytes=2-4")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(part.status, StatusCode::PARTIAL_CONTENT);
    assert_eq!(&part.body[..], &[2, 3, 4]);
    assert_eq!(
        part.header("content-range").as_deref(),
        Some("bytes 2-4/10")
    );

    let bad = app
        .send(
            Request::get(format!("/files/download?path={}", q(&b)))
                .header("Range", "bytes=10-20")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(bad.status, StatusCode::RANGE_NOT_SATISFIABLE);
    assert_eq!(bad.header("content-range").as_deref(), Some("bytes */10"));

    let lines = app
        .get(&format!("/files/download?path={}&offset=2&limit=2", q(&a)))
        .await;
    assert_eq!(lines.status, StatusCode::OK);
    // As the reference execd answers: the lines joined, no line end after the last.
    assert_eq!(lines.text(), "line2\nline3");
    assert!(
        lines
            .header("content-type")
            .unwrap()
            .starts_with("text/plain")
    );
    let tail = app
        .get(&format!("/files/download?path={}&offset=4&limit=9", q(&a)))
        .await;
    assert_eq!(tail.text(), "line4");
    let half = app
        .get(&format!("/files/download?path={}&offset=2", q(&a)))
        .await;
    assert_eq!(half.status, StatusCode::BAD_REQUEST);

    let missing = app
        .get(&format!(
            "/files/download?path={}",
            q(&dir.path().join("nope"))
        ))
        .await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert_eq!(missing.json()["code"], "FILE_NOT_FOUND");
}

#[tokio::test]
async fn upload_rejects_unpaired_parts() {
    let dir = tempfile::tempdir().unwrap();
    let app = test_app();
    let boundary = "XyZ";
    let body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"metadata\"; filename=\"metadata\"\r\n\r\n{}\r\n--{boundary}--\r\n",
        json!({"path": dir.path().join("x")})
    );
    let r = app
        .send(
            Request::post("/files/upload")
                .header(
                    "content-type",
                    format!("multipart/form-data; boundary={boundary}"),
                )
                .body(Body::from(body))
                .unwrap(),
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.json()["code"], "INVALID_FILE_METADATA");
}

#[tokio::test]
async fn info_mv_permissions_delete() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("f.txt");
    std::fs::write(&f, "hello").unwrap();
    std::os::unix::fs::symlink(&f, dir.path().join("link")).unwrap();
    let app = test_app();

    let info = app
        .get(&format!(
            "/files/info?path={}&path={}",
            q(&f),
            q(&dir.path().join("link"))
        ))
        .await;
    assert_eq!(info.status, StatusCode::OK);
    let j = info.json();
    let fi = &j[f.to_str().unwrap()];
    assert_eq!(fi["type"], "file");
    assert_eq!(fi["size"], 5);
    assert!(fi["modified_at"].as_str().unwrap().ends_with('Z'));
    assert!(fi["owner"].is_string() && fi["group"].is_string());
    assert_eq!(
        j[dir.path().join("link").to_str().unwrap()]["type"],
        "symlink"
    );
    assert_eq!(
        app.get(&format!("/files/info?path={}", q(&dir.path().join("zz"))))
            .await
            .status,
        StatusCode::NOT_FOUND
    );

    let r = app
        .post_json(
            "/files/permissions",
            json!({f.to_str().unwrap(): {"mode": 640, "owner": null, "group": null}}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let j = app.get(&format!("/files/info?path={}", q(&f))).await.json();
    assert_eq!(j[f.to_str().unwrap()]["mode"], 640);
    let r = app
        .post_json(
            "/files/permissions",
            json!({f.to_str().unwrap(): {"mode": 689}}),
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);

    let dest = dir.path().join("moved/into/g.txt");
    let r = app
        .post_json("/files/mv", json!([{"src": f, "dest": dest}]))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(std::fs::read_to_string(&dest).unwrap(), "hello");
    let r = app
        .post_json("/files/mv", json!([{"src": f, "dest": dest}]))
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);

    let r = app
        .delete(&format!(
            "/files?path={}&path={}",
            q(&dest),
            q(&dir.path().join("never"))
        ))
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(!dest.exists());
}

#[tokio::test]
async fn search_replace_and_list() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    for p in ["b/x.py", "b/c/y.py", "a.py", "z.txt"] {
        let path = root.join(p);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, "host=localhost; localhost").unwrap();
    }
    std::os::unix::fs::symlink(root.join("b"), root.join("blink")).unwrap();
    let app = test_app();

    let found = app
        .get(&format!("/files/search?path={}&pattern=*.py", q(root)))
        .await
        .json();
    let names: Vec<_> = found
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            f["path"]
                .as_str()
                .unwrap()
                .strip_prefix(root.to_str().unwrap())
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(names, ["/a.py", "/b/c/y.py", "/b/x.py"]);
    let all = app
        .get(&format!("/files/search?path={}", q(root)))
        .await
        .json();
    assert_eq!(
        all.as_array().unwrap().len(),
        5,
        "files and the symlink, no dirs"
    );
    assert_eq!(
        app.get(&format!("/files/search?path={}", q(&root.join("nope"))))
            .await
            .status,
        StatusCode::NOT_FOUND
    );

    let r = app
        .post_json(
            "/files/replace?verbose=true",
            json!({root.join("a.py").to_str().unwrap(): {"old": "localhost", "new": "0.0.0.0"}}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(
        r.json()[root.join("a.py").to_str().unwrap()]["replacedCount"],
        2
    );
    assert_eq!(
        std::fs::read_to_string(root.join("a.py")).unwrap(),
        "host=0.0.0.0; 0.0.0.0"
    );
    let quiet = app
        .post_json(
            "/files/replace",
            json!({root.join("z.txt").to_str().unwrap(): {"old": "host", "new": "h"}}),
        )
        .await;
    assert_eq!(quiet.status, StatusCode::OK);
    assert!(quiet.body.is_empty());
    let empty_old = app
        .post_json(
            "/files/replace",
            json!({root.join("z.txt").to_str().unwrap(): {"old": "", "new": "h"}}),
        )
        .await;
    assert_eq!(empty_old.status, StatusCode::BAD_REQUEST);

    let listed = app
        .get(&format!("/directories/list?path={}&depth=2", q(root)))
        .await
        .json();
    let names: Vec<_> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["path"]
                    .as_str()
                    .unwrap()
                    .strip_prefix(root.to_str().unwrap())
                    .unwrap()
                    .to_string(),
                f["type"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let expect = [
        ("/a.py", "file"),
        ("/b", "directory"),
        ("/b/c", "directory"),
        ("/b/x.py", "file"),
        ("/blink", "symlink"),
        ("/z.txt", "file"),
    ];
    assert_eq!(names, expect.map(|(a, b)| (a.to_string(), b.to_string())));
    let one = app
        .get(&format!("/directories/list?path={}", q(root)))
        .await
        .json();
    assert_eq!(one.as_array().unwrap().len(), 4);
    let via_link = app
        .get(&format!(
            "/directories/list?path={}",
            q(&root.join("blink"))
        ))
        .await;
    assert_eq!(via_link.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn search_with_a_pathological_pattern_completes_and_bad_patterns_are_400() {
    // A backtracking glob matcher tries every way of splitting the name's `a`s among the
    // stars (about 10^16 ways here) and never answers; the request must simply complete.
    let dir = tempfile::tempdir().unwrap();
    let long = "a".repeat(250);
    std::fs::write(dir.path().join(&long), "").unwrap();
    std::fs::write(dir.path().join(format!("{}b", &long[..200])), "").unwrap();
    let app = test_app();
    let pattern = "a*a*a*a*a*a*a*a*a*a*a*a*b";
    let found = app
        .get(&format!(
            "/files/search?path={}&pattern={}",
            q(dir.path()),
            pattern.replace('*', "%2A")
        ))
        .await
        .json();
    let names: Vec<_> = found
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            f["path"]
                .as_str()
                .unwrap()
                .rsplit('/')
                .next()
                .unwrap()
                .len()
        })
        .collect();
    assert_eq!(names, [201], "only the name ending in b");

    let r = app
        .get(&format!(
            "/files/search?path={}&pattern=%5Bz-a%5D",
            q(dir.path())
        ))
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.text());
}

#[tokio::test]
async fn directories_create_and_delete() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("p/q/r");
    let app = test_app();
    let r = app
        .post_json(
            "/directories",
            json!({d.to_str().unwrap(): {"mode": 700, "owner": null, "group": null}}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(
        std::fs::metadata(&d).unwrap().permissions().mode() & 0o777,
        0o700
    );
    let r = app
        .delete(&format!("/directories?path={}", q(&dir.path().join("p"))))
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(!dir.path().join("p").exists());
}

#[tokio::test]
async fn identity_routes_create_files_as_that_user() {
    if !is_root() {
        eprintln!("skipped: acting as another uid needs root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let app = test_app();
    let prefix = "/v1/filesystem/1234/2345";
    let f = dir.path().join("sub/owned.txt");
    let r = upload(&app, prefix, &[(json!({"path": f, "mode": 644}), b"x")]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let m = std::fs::metadata(&f).unwrap();
    assert_eq!((m.uid(), m.gid()), (1234, 2345));
    let parent = std::fs::metadata(dir.path().join("sub")).unwrap();
    assert_eq!((parent.uid(), parent.gid()), (1234, 2345));

    let d = dir.path().join("made");
    let r = app
        .post_json(
            &format!("{prefix}/directories"),
            json!({d.to_str().unwrap(): {"mode": 755}}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(std::fs::metadata(&d).unwrap().uid(), 1234);

    // Permission checks apply: a root-only directory is off limits.
    let locked = dir.path().join("locked");
    std::fs::create_dir(&locked).unwrap();
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o700)).unwrap();
    let r = upload(&app, prefix, &[(json!({"path": locked.join("x")}), b"x")]).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN, "{}", r.text());
    std::fs::write(locked.join("secret"), "s").unwrap();
    let r = app
        .get(&format!(
            "{prefix}/files/download?path={}",
            q(&locked.join("secret"))
        ))
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    // The same read as execd itself works.
    assert_eq!(
        app.get(&format!(
            "/files/download?path={}",
            q(&locked.join("secret"))
        ))
        .await
        .text(),
        "s"
    );
}
