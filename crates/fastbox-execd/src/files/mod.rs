//! `/files` and `/directories`, also mounted under `/v1/filesystem/{uid}/{gid}` where every
//! operation runs as that identity (see [`fsid`]).
//!
//! Handlers parse the request and hand a synchronous closure to [`fsid::run`]; the filesystem
//! work itself is plain `std::fs` code in the submodules.

pub mod download;
pub mod fsid;
pub mod info;
pub mod list;
pub mod mode;
pub mod ops;
pub mod replace;
pub mod search;
pub mod upload;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use axum::Router;
use axum::extract::{DefaultBodyLimit, FromRequestParts, Multipart, RawPathParams, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use serde::Deserialize;

use crate::error::ApiError;
use crate::extract::{JsonBody, RequestError};
use crate::identity::{Accounts, IdentityError};
use crate::query::QueryPairs;
use crate::state::AppState;

use fsid::FsIdentity;
use info::{FileInfo, file_info};
use ops::{Permission, io_error};

#[derive(Debug, thiserror::Error)]
pub enum FilesError {
    #[error("file not found: {0}")]
    NotFound(String),
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    #[error("{0}")]
    Invalid(String),
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("requested range not satisfiable (size {size})")]
    RangeNotSatisfiable { size: u64 },
    #[error(transparent)]
    Account(#[from] IdentityError),
    #[error("cannot act as identity: {0}")]
    Identity(String),
    #[error("invalid multipart upload: {0}")]
    Upload(String),
    #[error("invalid file metadata: {0}")]
    Metadata(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl FilesError {
    pub fn from_io(path: &Path, source: std::io::Error) -> Self {
        let p = path.display().to_string();
        match source.kind() {
            std::io::ErrorKind::NotFound => FilesError::NotFound(p),
            std::io::ErrorKind::PermissionDenied => FilesError::PermissionDenied(p),
            std::io::ErrorKind::InvalidInput => FilesError::Invalid(format!("{p}: {source}")),
            _ => FilesError::Io { path: p, source },
        }
    }
}

/// The identity of the request: `Some` under `/v1/filesystem/{uid}/{gid}`.
pub struct Fs(pub Option<FsIdentity>);

impl<S: Send + Sync> FromRequestParts<S> for Fs {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let params = RawPathParams::from_request_parts(parts, state)
            .await
            .map_err(|e| RequestError::Body(e.to_string()))?;
        let mut uid = None;
        let mut gid = None;
        for (k, v) in &params {
            let parsed = || {
                v.parse::<u32>()
                    .ok()
                    .filter(|&n| n != u32::MAX)
                    .ok_or_else(|| FilesError::Invalid(format!("invalid {k}: {v}")))
            };
            match k {
                "uid" => uid = Some(parsed()?),
                "gid" => gid = Some(parsed()?),
                _ => {}
            }
        }
        Ok(Fs(uid.zip(gid).map(|(uid, gid)| FsIdentity { uid, gid })))
    }
}

/// The files and directories routes, to be mounted at `/` and at the identity prefix.
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/files", delete(remove_files))
        .route("/files/info", get(files_info))
        .route("/files/mv", post(move_files))
        .route("/files/permissions", post(chmod_files))
        .route("/files/search", get(search_files))
        .route("/files/replace", post(replace_content))
        .route(
            "/files/upload",
            post(upload_files).layer(DefaultBodyLimit::disable()),
        )
        .route("/files/download", get(download_file))
        .route("/directories", post(make_dirs).delete(remove_dirs))
        .route("/directories/list", get(list_directory))
}

fn required<'a>(q: &'a QueryPairs, name: &'static str) -> Result<&'a str, RequestError> {
    q.get(name)
        .filter(|s| !s.is_empty())
        .ok_or(RequestError::MissingQuery(name))
}

async fn files_info(
    State(state): State<AppState>,
    Fs(who): Fs,
    uri: Uri,
) -> Result<Response, ApiError> {
    let paths = QueryPairs::from_uri(&uri).all("path");
    let home = state.home();
    let infos = fsid::run(who, move || {
        let accounts = Accounts::system();
        let mut out: BTreeMap<String, FileInfo> = BTreeMap::new();
        for raw in paths {
            let path = fsid::resolve(&raw, &home);
            let meta = std::fs::symlink_metadata(&path).map_err(io_error(&path))?;
            out.insert(raw, file_info(&path, &meta, &accounts));
        }
        Ok(out)
    })
    .await?;
    Ok(axum::Json(infos).into_response())
}

async fn remove_files(
    State(state): State<AppState>,
    Fs(who): Fs,
    uri: Uri,
) -> Result<(), ApiError> {
    let paths = QueryPairs::from_uri(&uri).all("path");
    let home = state.home();
    fsid::run(who, move || {
        paths
            .iter()
            .try_for_each(|p| ops::delete_file(&fsid::resolve(p, &home)))
    })
    .await?;
    Ok(())
}

async fn remove_dirs(State(state): State<AppState>, Fs(who): Fs, uri: Uri) -> Result<(), ApiError> {
    let paths = QueryPairs::from_uri(&uri).all("path");
    let home = state.home();
    fsid::run(who, move || {
        paths
            .iter()
            .try_for_each(|p| ops::delete_dir(&fsid::resolve(p, &home)))
    })
    .await?;
    Ok(())
}

#[derive(Debug, Deserialize)]
struct RenameItem {
    src: String,
    dest: String,
}

async fn move_files(
    State(state): State<AppState>,
    Fs(who): Fs,
    JsonBody(items): JsonBody<Vec<RenameItem>>,
) -> Result<(), ApiError> {
    let home = state.home();
    fsid::run(who, move || {
        items.iter().try_for_each(|i| {
            ops::rename(
                &fsid::resolve(&i.src, &home),
                &fsid::resolve(&i.dest, &home),
            )
        })
    })
    .await?;
    Ok(())
}

async fn chmod_files(
    State(state): State<AppState>,
    Fs(who): Fs,
    JsonBody(req): JsonBody<HashMap<String, Permission>>,
) -> Result<(), ApiError> {
    let home = state.home();
    fsid::run(who, move || {
        let accounts = Accounts::system();
        req.iter().try_for_each(|(p, perm)| {
            ops::set_permissions(&fsid::resolve(p, &home), perm, &accounts)
        })
    })
    .await?;
    Ok(())
}

async fn make_dirs(
    State(state): State<AppState>,
    Fs(who): Fs,
    JsonBody(req): JsonBody<HashMap<String, Permission>>,
) -> Result<(), ApiError> {
    let home = state.home();
    fsid::run(who, move || {
        let accounts = Accounts::system();
        req.iter()
            .try_for_each(|(p, perm)| ops::make_dir(&fsid::resolve(p, &home), perm, &accounts))
    })
    .await?;
    Ok(())
}

async fn search_files(
    State(state): State<AppState>,
    Fs(who): Fs,
    uri: Uri,
) -> Result<Response, ApiError> {
    let q = QueryPairs::from_uri(&uri);
    let root = fsid::resolve(required(&q, "path")?, &state.home());
    let pattern = q.get("pattern").unwrap_or("**").to_string();
    let found = fsid::run(who, move || {
        search::search(&root, &pattern, &Accounts::system())
    })
    .await?;
    Ok(axum::Json(found).into_response())
}

async fn list_directory(
    State(state): State<AppState>,
    Fs(who): Fs,
    uri: Uri,
) -> Result<Response, ApiError> {
    let q = QueryPairs::from_uri(&uri);
    let root = fsid::resolve(required(&q, "path")?, &state.home());
    let depth = match q.get("depth").filter(|s| !s.is_empty()) {
        None => 1,
        Some(d) => d.parse::<u32>().map_err(|_| RequestError::BadQuery {
            name: "depth",
            value: d.to_string(),
        })?,
    };
    let entries = fsid::run(who, move || list::list(&root, depth, &Accounts::system())).await?;
    Ok(axum::Json(entries).into_response())
}

async fn replace_content(
    State(state): State<AppState>,
    Fs(who): Fs,
    uri: Uri,
    JsonBody(req): JsonBody<HashMap<String, replace::ReplaceItem>>,
) -> Result<Response, ApiError> {
    let verbose = QueryPairs::from_uri(&uri).get("verbose") == Some("true");
    let home = state.home();
    let results = fsid::run(who, move || {
        let mut results = replace::ReplaceResults::new();
        for (raw, item) in &req {
            let count = replace::replace_in_file(&fsid::resolve(raw, &home), item)?;
            results.insert(
                raw.clone(),
                replace::ReplaceResult {
                    replaced_count: count,
                },
            );
        }
        Ok(results)
    })
    .await?;
    Ok(if verbose {
        axum::Json(results).into_response()
    } else {
        ().into_response()
    })
}

async fn upload_files(
    State(state): State<AppState>,
    Fs(who): Fs,
    form: Multipart,
) -> Result<(), ApiError> {
    upload::upload(form, who, state.home()).await?;
    Ok(())
}

async fn download_file(
    State(state): State<AppState>,
    Fs(who): Fs,
    uri: Uri,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let q = QueryPairs::from_uri(&uri);
    let path = fsid::resolve(required(&q, "path")?, &state.home());
    let number =
        |name: &'static str| -> Result<Option<u64>, RequestError> {
            match q.get(name).filter(|s| !s.is_empty()) {
                None => Ok(None),
                Some(v) => v.parse::<u64>().ok().filter(|&n| n >= 1).map(Some).ok_or(
                    RequestError::BadQuery {
                        name,
                        value: v.to_string(),
                    },
                ),
            }
        };
    let lines = match (number("offset")?, number("limit")?) {
        (None, None) => None,
        (Some(offset), Some(limit)) => Some(download::LineWindow { offset, limit }),
        _ => {
            return Err(FilesError::Invalid(
                "both offset and limit must be provided together for line-based reading".into(),
            )
            .into());
        }
    };
    if lines.is_some() && headers.contains_key(axum::http::header::RANGE) {
        return Err(
            FilesError::Invalid("offset/limit and Range are mutually exclusive".into()).into(),
        );
    }
    Ok(download::download(path, lines, &headers, who).await?)
}
