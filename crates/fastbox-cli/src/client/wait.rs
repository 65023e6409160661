//! Waiting on a sandbox the way the OpenSandbox SDK does: ready means its execd endpoint
//! resolves (the API answers 404 `KUBERNETES::POD_IP_NOT_AVAILABLE` until then) and execd
//! answers `/ping`; gone means a final state, or no record at all.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use fastbox_api::lifecycle::SandboxState;
use fastbox_runtime::spec::EXECD_PORT;
use reqwest::StatusCode;

use super::api::ApiClient;
use super::execd::ExecdClient;
use super::http::HttpError;

/// The code of "no endpoint yet, keep polling".
pub const NOT_READY_CODE: &str = "KUBERNETES::POD_IP_NOT_AVAILABLE";

/// The SDK's polling interval.
const POLL: Duration = Duration::from_millis(200);

/// Returns once the sandbox's execd answers `/ping`; fails at once on any other error of the
/// endpoint lookup or on a rejected execd token.
pub fn until_ready(api: &ApiClient, id: &str, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    let endpoint = loop {
        match api.endpoint(id, EXECD_PORT) {
            Ok(endpoint) => break endpoint,
            Err(e) if is_not_ready(&e) && Instant::now() < deadline => std::thread::sleep(POLL),
            Err(e) => return Err(e.into()),
        }
    };
    let execd = ExecdClient::try_new(api.scheme(), &endpoint)?;
    loop {
        match execd.ping() {
            Ok(()) => return Ok(()),
            Err(e) if is_auth_failure(&e) => {
                return Err(e).context("execd refused the endpoint's token");
            }
            Err(e) if Instant::now() >= deadline => {
                return Err(e).context("execd does not answer /ping");
            }
            Err(_) => std::thread::sleep(POLL),
        }
    }
}

/// Returns the final state once the sandbox has one (None: its record is gone).
pub fn until_final(
    api: &ApiClient,
    id: &str,
    timeout: Duration,
) -> anyhow::Result<Option<SandboxState>> {
    let deadline = Instant::now() + timeout;
    loop {
        match api.get(id) {
            Ok(s) if s.status.state.is_final() => return Ok(Some(s.status.state)),
            Ok(s) if Instant::now() >= deadline => {
                bail!(
                    "sandbox {id} is still {} after {}s",
                    s.status.state,
                    timeout.as_secs()
                );
            }
            Ok(_) => std::thread::sleep(POLL),
            Err(e) if e.reply().is_some_and(|r| r.status == StatusCode::NOT_FOUND) => {
                return Ok(None);
            }
            Err(e) => return Err(e.into()),
        }
    }
}

fn is_not_ready(e: &HttpError) -> bool {
    e.reply()
        .is_some_and(|r| r.is(StatusCode::NOT_FOUND, NOT_READY_CODE))
}

fn is_auth_failure(e: &HttpError) -> bool {
    e.reply()
        .is_some_and(|r| matches!(r.status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN))
}
