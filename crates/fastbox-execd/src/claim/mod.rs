//! `POST /fastbox/claim`: hands a restored clone to its owner (a fastbox extension).
//!
//! A template is started once cold, with no entrypoint and no owner's token, and checkpointed;
//! every create restores that checkpoint, so every clone wakes up with the template's token and
//! environment. The claim gives the clone its own: a new access token (the old one stops
//! working at once), `envs` for every process started afterwards, the env file, and the
//! create's entrypoint, which only starts now. One claim per process life: a second one is
//! `409 ALREADY_CLAIMED`. `GET /fastbox/claim` says whether the claim happened.
//!
//! The claim is authenticated like every route, with the token execd holds at that moment
//! (none on a template started without one).
//!
//! `POST /fastbox/rekey` (`rekey.rs`) replaces the token only, claimed or not: for clones of
//! a snapshot of a claimed sandbox, which must not start their entrypoint again.

mod java_trust;
mod rekey;
mod request;
pub mod trust;

use std::sync::Arc;

use axum::extract::State;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;

pub use rekey::RekeyRequest;
pub use request::{Claim, ClaimRequest, TOKEN_LEN};

use crate::entrypoint::{self, Entrypoint};
use crate::error::ApiError;
use crate::extract::JsonBody;
use crate::state::AppState;

#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error("invalid claim: {0}")]
    Invalid(String),
    #[error("this sandbox has already been claimed")]
    AlreadyClaimed,
    #[error("an entrypoint was already started in this sandbox")]
    EntrypointStarted,
    #[error("installing the credential proxy's CA: {0}")]
    Trust(std::io::Error),
}

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/fastbox/claim", get(claim_status).post(claim))
        .route("/fastbox/rekey", post(rekey::rekey))
}

#[derive(Serialize)]
struct ClaimStatus {
    claimed: bool,
}

#[derive(Serialize)]
struct ClaimResponse {
    claimed: bool,
    /// The entrypoint's pid, `null` when the claim had none or it failed to start.
    entrypoint_pid: Option<i32>,
    /// Why the entrypoint failed to start, when it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    entrypoint_error: Option<String>,
}

async fn claim_status(State(state): State<AppState>) -> Json<ClaimStatus> {
    Json(ClaimStatus {
        claimed: state.tenancy.current().claimed,
    })
}

async fn claim(
    State(state): State<AppState>,
    JsonBody(req): JsonBody<ClaimRequest>,
) -> Result<Json<ClaimResponse>, ApiError> {
    let entrypoint = apply(&state, req.validate()?)?;
    state.code.spares.renew();
    let (entrypoint_pid, entrypoint_error) = match entrypoint.map(|e| e.status()) {
        None => (None, None),
        Some(s) if s.pid.is_some() => (s.pid, None),
        Some(s) => (None, s.error),
    };
    Ok(Json(ClaimResponse {
        claimed: true,
        entrypoint_pid,
        entrypoint_error,
    }))
}

/// Applies a validated claim: checks that this process was not claimed and, when the claim has
/// an entrypoint, that none was started; swaps in the new tenancy (token, environment, env
/// file) in one step; then starts the entrypoint with the new environment. A refused claim
/// changes nothing.
pub fn apply(state: &AppState, mut claim: Claim) -> Result<Option<Arc<Entrypoint>>, ClaimError> {
    if state.tenancy.current().claimed {
        return Err(ClaimError::AlreadyClaimed);
    }
    // The CA first: its variables join the claim's (which win), and a CA that cannot be
    // installed fails the claim before anything changes.
    if let Some(pem) = &claim.trust_ca_pem {
        let env = trust::install(&state.config.system_root, pem).map_err(ClaimError::Trust)?;
        for (name, value) in env {
            claim.envs.entry(name).or_insert(value);
        }
    }
    state.tenancy.replace(|current| {
        if current.claimed {
            return Err(ClaimError::AlreadyClaimed);
        }
        if claim.entrypoint.is_some() && state.entrypoint.get().is_some() {
            return Err(ClaimError::EntrypointStarted);
        }
        Ok(claim.tenancy_after(current))
    })?;
    // Names only: values may be secrets.
    tracing::info!(
        envs = ?claim.envs.keys().collect::<Vec<_>>(),
        envs_file = ?claim.envs_file,
        entrypoint = claim.entrypoint.is_some(),
        "sandbox claimed"
    );
    // The entrypoint check above and this start cannot race with another claim (this one is
    // now recorded) nor with `main` (which starts its entrypoint before serving).
    Ok(claim.entrypoint.map(|argv| entrypoint::start(state, argv)))
}
