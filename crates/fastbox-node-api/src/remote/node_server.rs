//! [`node_router`]: a [`NodeAgent`] served over HTTP, on the node (wire format: the module
//! docs of [`super`]).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{ConnectInfo, DefaultBodyLimit, Path, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, post};
use http::{HeaderValue, StatusCode, header};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::credential::{Credential, require};
use super::http_util::{decode_segment, envelope};
use super::verbs::*;
use super::{CLIENT_HEADER, CREDENTIAL_HEADER, MAX_BODY, REFUSAL_HEADER, UNSIGNED_HEADER};
use crate::NodeAgent;
use crate::error::NodeResult;
use crate::wire::{ProxyRefusal, Unsigned};

/// The proxy route's prefix; `{id}/{port}[/{path}]` follows.
pub(super) const PROXY_PREFIX: &str = "/node/v1/proxy/";

/// The node API of `agent`, every route behind `auth` (the credential the server presents
/// to this node).
pub fn node_router(agent: Arc<dyn NodeAgent>, auth: Credential) -> Router {
    let verbs = Router::new()
        .route("/node/v1/{verb}", post(call))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(agent.clone());
    let proxy = Router::new()
        .route("/node/v1/proxy/{*route}", any(proxy))
        .with_state(agent);
    verbs
        .merge(proxy)
        .fallback(unknown_route)
        .layer(axum::middleware::from_fn_with_state(
            Arc::new(auth),
            require,
        ))
}

async fn unknown_route() -> Response {
    let mut response = envelope(
        StatusCode::NOT_FOUND,
        "NODE::UNKNOWN_VERB",
        "no such route of the node API",
    );
    response
        .headers_mut()
        .insert(REFUSAL_HEADER, HeaderValue::from_static("1"));
    response
}

/// `POST /node/v1/{verb}`.
async fn call(
    State(agent): State<Arc<dyn NodeAgent>>,
    Path(name): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let Some(verb) = Verb::from_name(&name) else {
        return envelope(
            StatusCode::NOT_FOUND,
            "NODE::UNKNOWN_VERB",
            format!("the node API has no verb {name:?}"),
        );
    };
    let body = match body {
        Ok(body) => body,
        Err(e) => return envelope(e.status(), "NODE::BAD_REQUEST", e.body_text()),
    };
    match serve(agent.as_ref(), verb, &body).await {
        Ok(json) => (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            json,
        )
            .into_response(),
        Err(Fault::Arguments(e)) => envelope(
            StatusCode::BAD_REQUEST,
            "NODE::BAD_REQUEST",
            format!("the arguments of {}: {e}", verb.name()),
        ),
        Err(Fault::Answer(e)) => envelope(
            StatusCode::INTERNAL_SERVER_ERROR,
            "GENERAL::UNKNOWN_ERROR",
            format!("the answer of {} could not be written: {e}", verb.name()),
        ),
    }
}

enum Fault {
    Arguments(serde_json::Error),
    Answer(serde_json::Error),
}

fn args<T: DeserializeOwned>(body: &[u8]) -> Result<T, Fault> {
    serde_json::from_slice(body).map_err(Fault::Arguments)
}

fn answer<T: Serialize>(result: NodeResult<T>) -> Result<Vec<u8>, Fault> {
    serde_json::to_vec(&result).map_err(Fault::Answer)
}

/// Calls `verb` of `agent` with the arguments in `body`; its answer as JSON.
async fn serve(agent: &dyn NodeAgent, verb: Verb, body: &[u8]) -> Result<Vec<u8>, Fault> {
    match verb {
        Verb::Admit => {
            let NoArgs {} = args(body)?;
            answer(agent.admit().await)
        }
        Verb::ReleaseSlot => {
            let a: SlotArgs = args(body)?;
            agent.release_slot(a.slot).await;
            answer(Ok(()))
        }
        Verb::ClaimSlot => {
            let a: SlotArgs = args(body)?;
            agent.claim_slot(a.slot).await;
            answer(Ok(()))
        }
        Verb::ReleaseUnusedAdmission => {
            let a: UnusedAdmissionArgs = args(body)?;
            answer(Ok(agent
                .release_unused_admission(a.slot, a.min_age_ms)
                .await))
        }
        Verb::ResolveImage => {
            let a: ResolveImageArgs = args(body)?;
            answer(agent.resolve_image(&a.reference, a.auth).await)
        }
        Verb::Place => {
            let a: PlaceArgs = args(body)?;
            answer(agent.place(a.spec, a.slot).await)
        }
        Verb::CloneSnapshot => {
            let a: RestoreArgs = args(body)?;
            answer(agent.clone_snapshot(&a.key, a.spec, a.slot).await)
        }
        Verb::Resume => {
            let a: RestoreArgs = args(body)?;
            answer(agent.resume(&a.key, a.spec, a.slot).await)
        }
        Verb::IsAlive => {
            let a: IsAliveArgs = args(body)?;
            answer(Ok(agent.is_alive(&a.placement).await))
        }
        Verb::Adopt => {
            let a: AdoptArgs = args(body)?;
            answer(Ok(agent
                .adopt(
                    &a.id,
                    &a.placement,
                    &a.tokens,
                    &a.policy,
                    a.credential_proxy,
                )
                .await))
        }
        Verb::Remove => {
            let a: RemoveArgs = args(body)?;
            answer(agent.remove(&a.id, a.placement.as_ref(), a.slot).await)
        }
        Verb::ReleaseKeepingAddress => {
            let a: ReleaseKeepingAddressArgs = args(body)?;
            answer(
                agent
                    .release_keeping_address(&a.id, a.placement.as_ref(), a.slot)
                    .await,
            )
        }
        Verb::Pause => {
            let a: PauseArgs = args(body)?;
            answer(agent.pause(&a.id, &a.source).await)
        }
        Verb::FinishInterruptedPause => {
            let a: SourceArgs = args(body)?;
            answer(Ok(agent.finish_interrupted_pause(&a.source).await))
        }
        Verb::StageSnapshot => {
            let a: StageArgs = args(body)?;
            answer(agent.stage_snapshot(&a.source, a.short_freeze).await)
        }
        Verb::CommitSnapshot => {
            let a: CommitArgs = args(body)?;
            answer(agent.commit_snapshot(&a.key, &a.placement).await)
        }
        Verb::HasSnapshot => {
            let a: KeyArgs = args(body)?;
            answer(Ok(agent.has_snapshot(&a.key).await))
        }
        Verb::RemoveSnapshot => {
            let a: KeyArgs = args(body)?;
            answer(agent.remove_snapshot(&a.key).await)
        }
        Verb::FetchCheckpoint => {
            let a: FetchArgs = args(body)?;
            answer(
                agent
                    .fetch_checkpoint(&a.key, &a.manifest, &a.execd_token, a.fetch)
                    .await,
            )
        }
        Verb::DiscardInterruptedSnapshot => {
            let a: KeyArgs = args(body)?;
            agent.discard_interrupted_snapshot(&a.key).await;
            answer(Ok(()))
        }
        Verb::SnapshotKeys => {
            let NoArgs {} = args(body)?;
            answer(Ok(agent.snapshot_keys().await))
        }
        Verb::BuildTemplate => {
            let a: BuildArgs = args(body)?;
            answer(agent.build_template(&a.key, &a.image, &a.recipe).await)
        }
        Verb::RemoveTemplate => {
            let a: KeyArgs = args(body)?;
            answer(agent.remove_template(&a.key).await)
        }
        Verb::SetEgressPolicy => {
            let a: PolicyArgs = args(body)?;
            answer(agent.set_egress_policy(&a.id, &a.policy).await)
        }
        Verb::Status => {
            let NoArgs {} = args(body)?;
            answer(Ok(agent.status().await))
        }
    }
}

/// `ANY /node/v1/proxy/{id}/{port}[/{path}]`.
async fn proxy(State(agent): State<Arc<dyn NodeAgent>>, mut req: Request) -> Response {
    let Some((id, port, path)) = proxy_route(req.uri().path()) else {
        return refused_by_router(
            StatusCode::BAD_REQUEST,
            "expected /node/v1/proxy/{id}/{port}[/{path}], id and path percent-encoded",
        );
    };
    let unsigned = match req.headers().get(UNSIGNED_HEADER).map(|v| v.as_bytes()) {
        Some(b"allowed") => Unsigned::Allowed,
        Some(b"refused") => Unsigned::Refused,
        _ => {
            return refused_by_router(
                StatusCode::BAD_REQUEST,
                "X-Fastbox-Unsigned must be allowed or refused",
            );
        }
    };
    let client = req
        .headers()
        .get(CLIENT_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<SocketAddr>().ok());
    for ours in [
        CREDENTIAL_HEADER,
        UNSIGNED_HEADER,
        CLIENT_HEADER,
        REFUSAL_HEADER,
    ] {
        req.headers_mut().remove(ours);
    }
    // The node proxy counts failed credential checks per client: the server's caller, not
    // the server.
    match client {
        Some(addr) => {
            req.extensions_mut().insert(ConnectInfo(addr));
        }
        None => {
            req.extensions_mut().remove::<ConnectInfo<SocketAddr>>();
        }
    }
    match agent.proxy(&id, port, &path, unsigned, &[], req).await {
        Ok(mut response) => {
            // Only this router marks refusals: a sandbox cannot forge one.
            response.headers_mut().remove(REFUSAL_HEADER);
            response
        }
        Err(refusal) => refused_by_agent(&refusal),
    }
}

/// `{id}/{port}[/{path}]` after [`PROXY_PREFIX`], decoded.
fn proxy_route(raw: &str) -> Option<(String, u16, String)> {
    let rest = raw.strip_prefix(PROXY_PREFIX)?;
    let mut segments = rest.split('/');
    let id = decode_segment(segments.next()?)?;
    let port: u16 = segments.next()?.parse().ok()?;
    let path = match segments.next() {
        Some(segment) => decode_segment(segment)?,
        None => String::new(),
    };
    (segments.next().is_none() && !id.is_empty()).then_some((id, port, path))
}

/// The router's own refusal of a proxied request: the envelope, marked.
fn refused_by_router(status: StatusCode, message: &str) -> Response {
    let mut response = envelope(status, "NODE::BAD_REQUEST", message);
    response
        .headers_mut()
        .insert(REFUSAL_HEADER, HeaderValue::from_static("1"));
    response
}

/// The agent's refusal: itself as JSON, with a status to match, marked.
fn refused_by_agent(refusal: &ProxyRefusal) -> Response {
    let status = match refusal {
        ProxyRefusal::BadRoute(_) => StatusCode::BAD_REQUEST,
        ProxyRefusal::NotRunning(_) => StatusCode::NOT_FOUND,
        ProxyRefusal::Forbidden(_) => StatusCode::FORBIDDEN,
        ProxyRefusal::Unsigned => StatusCode::UNAUTHORIZED,
        ProxyRefusal::Answered { status, .. } => {
            StatusCode::from_u16(*status).unwrap_or(StatusCode::BAD_GATEWAY)
        }
        ProxyRefusal::Upstream(_) => StatusCode::BAD_GATEWAY,
    };
    let mut response = (status, axum::Json(refusal)).into_response();
    response
        .headers_mut()
        .insert(REFUSAL_HEADER, HeaderValue::from_static("1"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxy_routes_parse_and_decode_once() {
        let route = |raw: &str| proxy_route(raw);
        assert_eq!(
            route("/node/v1/proxy/sbx/8080"),
            Some(("sbx".into(), 8080, String::new()))
        );
        assert_eq!(
            route("/node/v1/proxy/sbx/8080/%2Fa%2F..%2Fb%2520"),
            Some(("sbx".into(), 8080, "/a/../b%20".into()))
        );
        assert_eq!(
            route("/node/v1/proxy/a%2Fb/1/%2F"),
            Some(("a/b".into(), 1, "/".into()))
        );
        for bad in [
            "/node/v1/proxy/",
            "/node/v1/proxy/sbx",
            "/node/v1/proxy/sbx/x/%2F",
            "/node/v1/proxy/sbx/70000",
            "/node/v1/proxy//80",
            "/node/v1/proxy/sbx/80/a/b",
            "/node/v1/proxy/sbx/80/%zz",
        ] {
            assert_eq!(route(bad), None, "{bad}");
        }
    }
}
