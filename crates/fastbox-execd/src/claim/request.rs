//! The body of `POST /fastbox/claim` and its validation into a [`Claim`].
//!
//! Everything is checked before anything changes, so a rejected claim leaves the sandbox
//! exactly as it was. Neither type implements `Debug`: they carry the new access token, which
//! must never reach a log.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Deserialize;

use super::ClaimError;
use crate::auth::AccessToken;
use crate::env;
use crate::tenancy::Tenancy;

/// Bounds on a new access token's length, in bytes (all visible ASCII).
pub const TOKEN_LEN: std::ops::RangeInclusive<usize> = 16..=512;

/// The variable naming the env file; in `envs` it means the same as `envs_file`.
const ENVS_FILE_VAR: &str = "EXECD_ENVS";
/// The variable execd's own token arrives in at a cold start; children never see it.
const TOKEN_VAR: &str = "EXECD_ACCESS_TOKEN";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClaimRequest {
    pub access_token: String,
    pub envs: Option<BTreeMap<String, String>>,
    pub entrypoint: Option<Vec<String>>,
    pub envs_file: Option<String>,
    /// The CA of the node's credential proxy, to trust (PEM; `super::trust`).
    #[serde(default)]
    pub trust_ca_pem: Option<String>,
}

/// A validated claim.
pub struct Claim {
    pub access_token: AccessToken,
    pub envs: BTreeMap<String, String>,
    pub envs_file: Option<String>,
    pub entrypoint: Option<Vec<String>>,
    pub trust_ca_pem: Option<String>,
}

/// Checks a new access token (of a claim or a rekey) and keeps its digest only. The message
/// never echoes the token.
pub(super) fn validate_token(token: String) -> Result<AccessToken, ClaimError> {
    if !TOKEN_LEN.contains(&token.len()) || !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ClaimError::Invalid(
            "access_token must be 16 to 512 visible ASCII characters".to_string(),
        ));
    }
    Ok(AccessToken::from_secret(token))
}

impl ClaimRequest {
    pub fn validate(self) -> Result<Claim, ClaimError> {
        let invalid = |msg: &str| Err(ClaimError::Invalid(msg.to_string()));
        let access_token = validate_token(self.access_token)?;
        let envs = self.envs.unwrap_or_default();
        for (key, value) in &envs {
            if key.is_empty() || key.contains(['=', '\0']) {
                return Err(ClaimError::Invalid(format!(
                    "env name {key:?} must be non-empty without '=' or NUL"
                )));
            }
            if value.contains('\0') {
                return Err(ClaimError::Invalid(format!(
                    "env {key} must not contain NUL"
                )));
            }
        }
        if envs.contains_key(TOKEN_VAR) {
            return invalid("envs must not set EXECD_ACCESS_TOKEN: pass access_token");
        }
        let envs_file = match (self.envs_file, envs.get(ENVS_FILE_VAR)) {
            (Some(file), Some(var)) if &file != var => {
                return invalid("envs_file and envs.EXECD_ENVS differ");
            }
            (file, var) => file.or_else(|| var.cloned()),
        };
        if let Some(file) = &envs_file
            && (!file.starts_with('/') || file.contains('\0'))
        {
            return invalid("envs_file must be an absolute path");
        }
        if let Some(argv) = &self.entrypoint {
            if argv.first().is_none_or(|a| a.is_empty()) {
                return invalid("entrypoint[0] must be non-empty");
            }
            if argv.iter().any(|a| a.contains('\0')) {
                return invalid("entrypoint must not contain NUL");
            }
        }
        if let Some(pem) = &self.trust_ca_pem {
            super::trust::validate(pem).map_err(ClaimError::Invalid)?;
        }
        Ok(Claim {
            access_token,
            envs,
            envs_file,
            entrypoint: self.entrypoint,
            trust_ca_pem: self.trust_ca_pem,
        })
    }
}

impl Claim {
    /// The tenancy once this claim is applied to `current`: the new token, `envs` layered on
    /// the current environment, and the env file (named in `EXECD_ENVS` too, where the SDK's
    /// `set_env` looks for it) when the claim gives one.
    pub fn tenancy_after(&self, current: &Tenancy) -> Tenancy {
        let mut env = current.env.clone();
        env::overlay(&mut env, &self.envs);
        if let Some(file) = &self.envs_file {
            env::set(&mut env, ENVS_FILE_VAR, file);
        }
        Tenancy {
            access_token: Some(self.access_token),
            env,
            envs_file: self
                .envs_file
                .as_ref()
                .map(PathBuf::from)
                .or_else(|| current.envs_file.clone()),
            claimed: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "0123456789abcdef";

    fn request(body: serde_json::Value) -> Result<Claim, ClaimError> {
        serde_json::from_value::<ClaimRequest>(body)
            .expect("well-formed")
            .validate()
    }

    fn rejection(body: serde_json::Value) -> String {
        match request(body) {
            Err(ClaimError::Invalid(msg)) => msg,
            Err(other) => panic!("unexpected error {other}"),
            Ok(_) => panic!("accepted"),
        }
    }

    fn unclaimed() -> Tenancy {
        Tenancy {
            access_token: None,
            env: vec![("HOME".into(), "/root".into()), ("A".into(), "old".into())],
            envs_file: Some(PathBuf::from("/old/envs")),
            claimed: false,
        }
    }

    #[test]
    fn token_must_be_16_to_512_visible_ascii() {
        assert!(request(serde_json::json!({"access_token": TOKEN})).is_ok());
        assert!(request(serde_json::json!({"access_token": "x".repeat(512)})).is_ok());
        for bad in [
            "short",
            "0123456789abcde ",
            "0123456789abcdé",
            &"x".repeat(513),
        ] {
            assert!(
                rejection(serde_json::json!({"access_token": bad})).contains("access_token"),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn env_names_values_and_argv_are_checked() {
        for (body, says) in [
            (serde_json::json!({"envs": {"A=B": "1"}}), "env name"),
            (serde_json::json!({"envs": {"": "1"}}), "env name"),
            (serde_json::json!({"envs": {"A": "a\u{0}b"}}), "NUL"),
            (
                serde_json::json!({"envs": {"EXECD_ACCESS_TOKEN": "x"}}),
                "EXECD_ACCESS_TOKEN",
            ),
            (serde_json::json!({"entrypoint": []}), "entrypoint[0]"),
            (serde_json::json!({"entrypoint": [""]}), "entrypoint[0]"),
            (serde_json::json!({"entrypoint": ["a", "b\u{0}"]}), "NUL"),
            (serde_json::json!({"envs_file": "rel/envs"}), "absolute"),
            (
                serde_json::json!({"envs_file": "/a", "envs": {"EXECD_ENVS": "/b"}}),
                "differ",
            ),
        ] {
            let mut body = body;
            body["access_token"] = TOKEN.into();
            let msg = rejection(body.clone());
            assert!(msg.contains(says), "{body}: {msg}");
        }
    }

    #[test]
    fn claim_layers_envs_and_replaces_token_and_file() {
        let claim = request(serde_json::json!({
            "access_token": TOKEN,
            "envs": {"A": "new", "B": "b"},
            "envs_file": "/new/envs",
        }))
        .unwrap_or_else(|_| panic!("rejected"));
        let after = claim.tenancy_after(&unclaimed());
        assert!(after.claimed);
        assert!(after.access_token.unwrap().matches(TOKEN.as_bytes()));
        assert_eq!(env::get(&after.env, "HOME"), Some("/root"));
        assert_eq!(env::get(&after.env, "A"), Some("new"));
        assert_eq!(env::get(&after.env, "B"), Some("b"));
        assert_eq!(env::get(&after.env, "EXECD_ENVS"), Some("/new/envs"));
        assert_eq!(after.envs_file, Some(PathBuf::from("/new/envs")));
    }

    #[test]
    fn execd_envs_in_envs_names_the_file_and_no_file_keeps_the_old_one() {
        let claim = |body| {
            request(body)
                .unwrap_or_else(|_| panic!("rejected"))
                .tenancy_after(&unclaimed())
        };
        let via_env = claim(serde_json::json!({
            "access_token": TOKEN, "envs": {"EXECD_ENVS": "/e"}
        }));
        assert_eq!(via_env.envs_file, Some(PathBuf::from("/e")));
        let kept = claim(serde_json::json!({"access_token": TOKEN}));
        assert_eq!(kept.envs_file, Some(PathBuf::from("/old/envs")));
        assert_eq!(kept.env, unclaimed().env);
    }
}
