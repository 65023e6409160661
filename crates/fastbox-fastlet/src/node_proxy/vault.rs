//! Port 18080's `/credential-vault` routes (the egress API's Credential Vault), served by
//! the node proxy behind the same `OPENSANDBOX-EGRESS-AUTH` check as `/policy`.
//!
//! A sandbox's vault lives in this node's memory only ([`Vaults`]): its values never reach
//! a record, a checkpoint, a log or an answer (`fastbox_vault` has no answer type that
//! could carry one). Only a sandbox created with `credentialProxy.enabled` has one; any
//! other gets 412 (the spec's "Credential Proxy prerequisites are not ready"). Errors are
//! `text/plain`, as the spec has them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use axum::body::{Body, to_bytes};
use axum::extract::Request;
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use fastbox_vault::wire::{CreateRequest, MutationRequest};
use fastbox_vault::{Vault, VaultError};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::Route;

/// The prefix of the vault's routes.
pub const VAULT_PATH: &str = "/credential-vault";

/// Largest request body.
const MAX_BODY: usize = 1 << 20;

/// A sandbox's vault as its proxy reads it: replaced whole at each change.
pub type VaultCell = Arc<RwLock<Option<Arc<Vault>>>>;

/// The vaults of this node's sandboxes, by sandbox id.
#[derive(Default)]
pub struct Vaults {
    by_sandbox: Mutex<HashMap<String, VaultCell>>,
}

impl Vaults {
    /// Sandbox `id`'s cell (made empty on first use).
    pub fn cell(&self, id: &str) -> VaultCell {
        self.by_sandbox
            .lock()
            .expect("vaults lock")
            .entry(id.to_string())
            .or_default()
            .clone()
    }

    /// Drops sandbox `id`'s vault (its values go with it).
    pub fn forget(&self, id: &str) {
        self.by_sandbox.lock().expect("vaults lock").remove(id);
    }
}

/// Why a vault request was refused.
#[derive(Debug, thiserror::Error)]
enum VaultRequestError {
    #[error(
        "the Credential Vault needs a sandbox created with credentialProxy.enabled; this one was not"
    )]
    NotEnabled,
    #[error("no Credential Vault route {0} {1}")]
    NoRoute(Method, String),
    #[error("this sandbox has no Credential Vault (POST /credential-vault makes one)")]
    NoVault,
    #[error("this sandbox has a Credential Vault already (PATCH changes it)")]
    Exists,
    #[error("request body: {0}")]
    Body(String),
    #[error(transparent)]
    Vault(#[from] VaultError),
}

impl VaultRequestError {
    fn status(&self) -> StatusCode {
        match self {
            Self::NotEnabled => StatusCode::PRECONDITION_FAILED,
            Self::NoRoute(..) | Self::NoVault => StatusCode::NOT_FOUND,
            Self::Exists => StatusCode::CONFLICT,
            Self::Body(_) => StatusCode::BAD_REQUEST,
            Self::Vault(VaultError::Invalid(_)) => StatusCode::BAD_REQUEST,
            Self::Vault(VaultError::NotFound(_)) => StatusCode::NOT_FOUND,
            Self::Vault(VaultError::Conflict(_)) => StatusCode::CONFLICT,
        }
    }
}

impl IntoResponse for VaultRequestError {
    fn into_response(self) -> Response {
        (self.status(), format!("{self}\n")).into_response()
    }
}

/// Answers `req` (its path `path`, under [`VAULT_PATH`]) for the sandbox of `route`, whose
/// vault is `cell`. The caller checked the egress token.
pub async fn serve(cell: VaultCell, route: &Route, path: &str, req: Request<Body>) -> Response {
    match answer(cell, route, path, req).await {
        Ok(response) => response,
        Err(e) => e.into_response(),
    }
}

async fn answer(
    cell: VaultCell,
    route: &Route,
    path: &str,
    req: Request<Body>,
) -> Result<Response, VaultRequestError> {
    let method = req.method().clone();
    let rest = path.strip_prefix(VAULT_PATH).unwrap_or(path);
    if !route.credential_proxy {
        let _ = to_bytes(req.into_body(), MAX_BODY).await;
        return Err(VaultRequestError::NotEnabled);
    }
    let current = || cell.read().expect("vault lock").clone();
    let existing = || current().ok_or(VaultRequestError::NoVault);
    match (method.clone(), rest) {
        (Method::POST, "" | "/") => {
            let request: CreateRequest = body(req).await?;
            let vault = Vault::create(request)?;
            let mut slot = cell.write().expect("vault lock");
            if slot.is_some() {
                return Err(VaultRequestError::Exists);
            }
            let state = vault.state();
            *slot = Some(Arc::new(vault));
            Ok((StatusCode::CREATED, axum::Json(state)).into_response())
        }
        (Method::GET, "" | "/") => Ok(json(existing()?.state())),
        (Method::PATCH, "" | "/") => {
            let request: MutationRequest = body(req).await?;
            let mut slot = cell.write().expect("vault lock");
            let next = slot
                .as_ref()
                .ok_or(VaultRequestError::NoVault)?
                .mutate(request)?;
            let state = next.state();
            *slot = Some(Arc::new(next));
            Ok(json(state))
        }
        (Method::DELETE, "" | "/") => {
            let mut slot = cell.write().expect("vault lock");
            match slot.take() {
                Some(_) => Ok(StatusCode::NO_CONTENT.into_response()),
                None => Err(VaultRequestError::NoVault),
            }
        }
        (Method::GET, "/credentials") => Ok(json(existing()?.credentials())),
        (Method::GET, "/bindings") => Ok(json(existing()?.bindings())),
        (Method::GET, other) => match (
            other.strip_prefix("/credentials/"),
            other.strip_prefix("/bindings/"),
        ) {
            (Some(name), _) if !name.contains('/') => Ok(json(existing()?.credential(name)?)),
            (_, Some(name)) if !name.contains('/') => Ok(json(existing()?.binding(name)?)),
            _ => Err(VaultRequestError::NoRoute(method, path.to_string())),
        },
        _ => {
            let _ = to_bytes(req.into_body(), MAX_BODY).await;
            Err(VaultRequestError::NoRoute(method, path.to_string()))
        }
    }
}

fn json<T: Serialize>(value: T) -> Response {
    axum::Json(value).into_response()
}

async fn body<T: DeserializeOwned>(req: Request<Body>) -> Result<T, VaultRequestError> {
    let bytes = to_bytes(req.into_body(), MAX_BODY)
        .await
        .map_err(|e| VaultRequestError::Body(e.to_string()))?;
    serde_json::from_slice(&bytes)
        .map_err(|e| VaultRequestError::Body(format!("invalid JSON: {e}")))
}

#[cfg(test)]
mod tests {
    use axum::body::to_bytes;
    use serde_json::{Value, json};

    use super::*;

    fn route(enabled: bool) -> Route {
        Route {
            address: std::net::Ipv4Addr::new(10, 0, 0, 2),
            slot: 0,
            execd_token: "e".into(),
            egress_token: "g".into(),
            credential_proxy: enabled,
        }
    }

    async fn call(
        cell: &VaultCell,
        route: &Route,
        method: Method,
        path: &str,
        body: Value,
    ) -> (u16, String) {
        let req = Request::builder()
            .method(method)
            .uri(path)
            .body(Body::from(body.to_string()))
            .unwrap();
        let response = serve(cell.clone(), route, path, req).await;
        let status = response.status().as_u16();
        let bytes = to_bytes(response.into_body(), MAX_BODY).await.unwrap();
        (status, String::from_utf8(bytes.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn a_sandbox_without_the_credential_proxy_gets_412() {
        let cell = VaultCell::default();
        let (status, body) = call(
            &cell,
            &route(false),
            Method::GET,
            "/credential-vault",
            Value::Null,
        )
        .await;
        assert_eq!(status, 412);
        assert!(body.contains("credentialProxy.enabled"), "{body}");
    }

    #[tokio::test]
    async fn the_vault_is_made_read_changed_and_deleted_and_never_shows_a_value() {
        let cell = VaultCell::default();
        let r = route(true);
        let (status, _) = call(&cell, &r, Method::GET, "/credential-vault", Value::Null).await;
        assert_eq!(status, 404);
        let create = json!({
            "credentials": [{"name": "gh", "source": {"type": "inline", "value": "ghp_value"}}],
            "bindings": [{"name": "api", "match": {"hosts": ["api.example.org"]},
                          "auth": {"type": "bearer", "credential": "gh"}}]
        });
        let (status, body) =
            call(&cell, &r, Method::POST, "/credential-vault", create.clone()).await;
        assert_eq!(status, 201, "{body}");
        assert!(!body.contains("ghp_value"));
        let (status, _) = call(&cell, &r, Method::POST, "/credential-vault", create).await;
        assert_eq!(status, 409);
        let (status, body) = call(
            &cell,
            &r,
            Method::PATCH,
            "/credential-vault",
            json!({"expectedRevision": 1, "credentials": {"replace": [
                {"name": "gh", "source": {"type": "inline", "value": "ghp_other"}}]}}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["revision"], 2);
        let (status, _) = call(
            &cell,
            &r,
            Method::PATCH,
            "/credential-vault",
            json!({"expectedRevision": 1, "credentials": {"delete": ["gh"]}}),
        )
        .await;
        assert_eq!(status, 409, "a stale revision");
        let (status, body) = call(
            &cell,
            &r,
            Method::GET,
            "/credential-vault/credentials/gh",
            Value::Null,
        )
        .await;
        assert_eq!(
            (status, serde_json::from_str::<Value>(&body).unwrap()),
            (
                200,
                json!({"name": "gh", "sourceType": "inline", "revision": 2})
            )
        );
        let (status, body) = call(
            &cell,
            &r,
            Method::GET,
            "/credential-vault/bindings",
            Value::Null,
        )
        .await;
        assert_eq!(status, 200);
        assert_eq!(
            serde_json::from_str::<Value>(&body).unwrap()["bindings"][0]["name"],
            "api"
        );
        let (status, _) = call(
            &cell,
            &r,
            Method::GET,
            "/credential-vault/bindings/nope",
            Value::Null,
        )
        .await;
        assert_eq!(status, 404);
        let (status, body) = call(
            &cell,
            &r,
            Method::POST,
            "/credential-vault",
            json!({"credentials": []}),
        )
        .await;
        assert_eq!(status, 400, "{body}");
        let (status, _) = call(&cell, &r, Method::DELETE, "/credential-vault", Value::Null).await;
        assert_eq!(status, 204);
        assert!(cell.read().unwrap().is_none(), "the values went with it");
        let (status, _) = call(&cell, &r, Method::DELETE, "/credential-vault", Value::Null).await;
        assert_eq!(status, 404);
    }
}
