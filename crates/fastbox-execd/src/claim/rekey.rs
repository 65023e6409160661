//! `POST /fastbox/rekey`: a new access token, and nothing else (a fastbox extension).
//!
//! A snapshot of a claimed sandbox restores into clones that wake up with its owner's token,
//! environment and running entrypoint. Each clone needs its own token, but a claim would start
//! the entrypoint again and is refused once claimed. The rekey swaps only the token: the
//! environment, the env file and the claimed flag stay as they are, claimed or not. The old
//! token stops working at once. Authenticated like every route, with the current token.

use std::convert::Infallible;

use axum::Json;
use axum::extract::State;
use serde::{Deserialize, Serialize};

use super::request::validate_token;
use crate::auth::AccessToken;
use crate::error::ApiError;
use crate::extract::JsonBody;
use crate::state::AppState;
use crate::tenancy::Tenancy;

/// The body of `POST /fastbox/rekey`. No `Debug`: it carries the new token.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RekeyRequest {
    pub access_token: String,
}

#[derive(Serialize)]
pub(super) struct RekeyResponse {
    rekeyed: bool,
    /// Whether the sandbox is claimed (unchanged by the rekey).
    claimed: bool,
}

pub(super) async fn rekey(
    State(state): State<AppState>,
    JsonBody(req): JsonBody<RekeyRequest>,
) -> Result<Json<RekeyResponse>, ApiError> {
    let token = validate_token(req.access_token)?;
    apply(&state, token);
    state.code.spares.renew();
    Ok(Json(RekeyResponse {
        rekeyed: true,
        claimed: state.tenancy.current().claimed,
    }))
}

/// Replaces the access token, and only it, in one step.
fn apply(state: &AppState, token: AccessToken) {
    let Ok(()) = state
        .tenancy
        .replace(|current| Ok::<_, Infallible>(tenancy_after(current, token)));
    tracing::info!("access token rotated");
}

/// `current` with `token` as its access token.
fn tenancy_after(current: &Tenancy, token: AccessToken) -> Tenancy {
    Tenancy {
        access_token: Some(token),
        ..current.clone()
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::claim::ClaimError;

    const OLD: &str = "old-token-0123456789";
    const NEW: &str = "new-token-0123456789";

    fn token(body: serde_json::Value) -> Result<AccessToken, ClaimError> {
        validate_token(
            serde_json::from_value::<RekeyRequest>(body)
                .expect("well-formed")
                .access_token,
        )
    }

    #[test]
    fn the_token_is_checked_like_a_claims() {
        assert!(token(serde_json::json!({"access_token": NEW})).is_ok());
        assert!(token(serde_json::json!({"access_token": "x".repeat(512)})).is_ok());
        for bad in [
            "short",
            "0123456789abcde ",
            "0123456789abcdé",
            &"x".repeat(513),
        ] {
            match token(serde_json::json!({"access_token": bad})) {
                Err(ClaimError::Invalid(msg)) => assert!(msg.contains("access_token"), "{bad:?}"),
                _ => panic!("{bad:?} accepted"),
            }
        }
    }

    #[test]
    fn only_the_token_and_no_other_field() {
        for body in [
            serde_json::json!({}),
            serde_json::json!({"access_token": NEW, "envs": {}}),
            serde_json::json!({"access_token": NEW, "entrypoint": ["sh"]}),
        ] {
            assert!(serde_json::from_value::<RekeyRequest>(body).is_err());
        }
    }

    #[test]
    fn a_rekey_changes_the_token_only() {
        for claimed in [false, true] {
            let current = Tenancy {
                access_token: Some(AccessToken::from_secret(OLD.into())),
                env: vec![("A".into(), "1".into())],
                envs_file: Some(PathBuf::from("/envs")),
                claimed,
            };
            let after = tenancy_after(&current, AccessToken::from_secret(NEW.into()));
            let token = after.access_token.expect("a token");
            assert!(token.matches(NEW.as_bytes()) && !token.matches(OLD.as_bytes()));
            assert_eq!(after.env, current.env);
            assert_eq!(after.envs_file, current.envs_file);
            assert_eq!(after.claimed, claimed);
        }
    }
}
