//! Who may reach a sandbox's ports through the proxies: the credential rules of
//! `secureAccess` sandboxes and of signed routes, shared by the node proxy and the server
//! proxy (which routes through the node proxy).
//!
//! - A **secure** sandbox's ports need the sandbox's access token in
//!   `OpenSandbox-Secure-Access` (its endpoints carry it in their `headers`) or a valid,
//!   unexpired signed route for that sandbox and port. Anything else is a 401; the plain path
//!   of a signed route (its credential segments removed) is just a plain path and needs the
//!   header.
//! - Any other sandbox's ports are open by URL, as in OpenSandbox; a signed route that fails
//!   its check is a 403 there (it is never silently read as a plain path).
//! - A signed route is refused when its expiry lies further ahead than routes are issued
//!   ([`AccessGuard::max_route_lifetime`]).
//! - Failed checks are counted per source address under a global ceiling
//!   ([`FailureLimiter`]): a source (or everyone) over the limit gets 429 for a route
//!   signature without it being checked, and for a wrong token. A valid token is never
//!   limited: it is 256 bits, nothing to guess.
//!
//! The server knows which sandboxes are secure and their tokens; it hands the node proxy an
//! [`AccessApi`] at start, as it does the egress operations. The header is removed before a
//! request is forwarded: the sandbox never sees its own access token in a request.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use axum::http::HeaderMap;
pub use fastbox_proxy::access::{
    AccessToken, FailureLimiter, FailureLimits, Limited, LimitedBy, SECURE_ACCESS_HEADER,
};
// How a sandbox's ports may be reached, and what the node proxy asks the server about it:
// types of the node boundary.
pub use fastbox_node_api::control::{AccessApi, SandboxAccess};
use fastbox_proxy::{RoutePath, RouteSigner};

use super::{NodeProxyError, Unsigned};

/// The longest a signed route may be valid by default: 24 hours.
pub const DEFAULT_MAX_ROUTE_LIFETIME: Duration = Duration::from_secs(24 * 3600);

/// The rules every check applies, and the failure counters of this process.
#[derive(Debug)]
pub struct AccessGuard {
    pub limiter: FailureLimiter,
    /// Signed routes expiring further ahead than this are refused (they are never issued).
    pub max_route_lifetime: Duration,
}

impl AccessGuard {
    pub fn new(limits: FailureLimits, max_route_lifetime: Duration) -> Self {
        Self {
            limiter: FailureLimiter::new(limits),
            max_route_lifetime,
        }
    }
}

impl Default for AccessGuard {
    fn default() -> Self {
        Self::new(FailureLimits::default(), DEFAULT_MAX_ROUTE_LIFETIME)
    }
}

/// What one request presents.
pub struct Presented<'a> {
    pub route: &'a RoutePath,
    pub headers: &'a HeaderMap,
    /// Where it comes from (the unspecified address when unknown).
    pub source: IpAddr,
    /// Whether a request without a route signature may pass (the server proxy refuses one
    /// that lacks the API key too).
    pub unsigned: Unsigned,
}

impl Presented<'_> {
    /// The source of a request whose peer address is unknown.
    pub const UNKNOWN_SOURCE: IpAddr = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
}

impl AccessGuard {
    /// Decides whether `presented` may reach `port` of sandbox `id`, whose access rule is
    /// `access`, at `now_unix`. See the module docs.
    pub fn authorize(
        &self,
        id: &str,
        port: u16,
        access: &SandboxAccess,
        signer: &RouteSigner,
        presented: &Presented<'_>,
        now_unix: u64,
    ) -> Result<(), NodeProxyError> {
        let token = match access {
            SandboxAccess::Secure(token) => Some(token),
            SandboxAccess::Open => None,
        };
        let source = presented.source;
        if let Some((expires, sig)) = &presented.route.signed {
            // 32 bits: never checked for a source (or a world) over its allowance.
            self.limiter
                .check(source)
                .map_err(NodeProxyError::TooManyFailures)?;
            let max = self.max_route_lifetime.as_secs();
            return match signer.verify_bounded(id, port, expires, sig, now_unix, max) {
                Ok(_) => Ok(()),
                Err(e) => {
                    let counted = self.limiter.fail(source);
                    tracing::debug!(sandbox = %id, port, %source, error = %e, "route credential refused");
                    match (counted, token) {
                        (Err(limited), _) => Err(NodeProxyError::TooManyFailures(limited)),
                        (Ok(()), Some(_)) => Err(NodeProxyError::Unauthorized(
                            "the signed route is not valid for this sandbox and port (tampered, expired, or expiring too far ahead)",
                        )),
                        (Ok(()), None) => Err(NodeProxyError::Forbidden(e)),
                    }
                }
            };
        }
        if presented.unsigned == Unsigned::Refused {
            return Err(NodeProxyError::Unsigned);
        }
        let Some(token) = token else {
            return Ok(());
        };
        let Some(value) = presented.headers.get(SECURE_ACCESS_HEADER) else {
            return Err(NodeProxyError::Unauthorized(
                "this sandbox has secure access: send the OpenSandbox-Secure-Access header of its endpoint, or use a signed route",
            ));
        };
        if token.matches(value.as_bytes()) {
            return Ok(());
        }
        tracing::debug!(sandbox = %id, port, %source, "wrong secure access token");
        match self.limiter.fail(source) {
            Err(limited) => Err(NodeProxyError::TooManyFailures(limited)),
            Ok(()) => Err(NodeProxyError::Unauthorized(
                "wrong OpenSandbox-Secure-Access token for this sandbox",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;
    use fastbox_proxy::{split_route, to_b36};

    use super::*;

    const ID: &str = "sbx";
    const PORT: u16 = 44772;
    const NOW: u64 = 1_800_000_000;

    fn signer() -> RouteSigner {
        RouteSigner::try_new('a', vec![9; 32]).unwrap()
    }

    fn guard(per_source: u32) -> AccessGuard {
        AccessGuard::new(
            FailureLimits {
                per_source,
                global: 1000,
                max_sources: 16,
            },
            Duration::from_secs(3600),
        )
    }

    struct Req {
        route: RoutePath,
        headers: HeaderMap,
    }

    fn req(path: &str, token: Option<&str>) -> Req {
        let mut headers = HeaderMap::new();
        if let Some(t) = token {
            headers.insert(SECURE_ACCESS_HEADER, HeaderValue::from_str(t).unwrap());
        }
        Req {
            route: split_route(path, |c| c == 'a'),
            headers,
        }
    }

    fn check(
        guard: &AccessGuard,
        access: &SandboxAccess,
        r: &Req,
        unsigned: Unsigned,
    ) -> Result<(), NodeProxyError> {
        let presented = Presented {
            route: &r.route,
            headers: &r.headers,
            source: "192.0.2.1".parse().unwrap(),
            unsigned,
        };
        guard.authorize(ID, PORT, access, &signer(), &presented, NOW)
    }

    fn signed_path(expires: u64, rest: &str) -> String {
        format!(
            "/{}/{}{rest}",
            to_b36(expires),
            signer().sign(ID, PORT, expires)
        )
    }

    fn status(result: Result<(), NodeProxyError>) -> u16 {
        match result {
            Ok(()) => 200,
            Err(e) => e.status().as_u16(),
        }
    }

    #[test]
    fn secure_sandboxes_need_the_token_or_a_signed_route() {
        let g = guard(1000);
        let token = AccessToken::generate().unwrap();
        let secure = SandboxAccess::Secure(token.clone());
        let ok = Unsigned::Allowed;
        assert_eq!(status(check(&g, &secure, &req("/ping", None), ok)), 401);
        assert_eq!(
            status(check(&g, &secure, &req("/ping", Some("wrong")), ok)),
            401
        );
        assert_eq!(
            status(check(&g, &secure, &req("/ping", Some(token.expose())), ok)),
            200
        );
        // A valid signed route is a credential by itself.
        let signed = signed_path(NOW + 60, "/ping");
        assert_eq!(status(check(&g, &secure, &req(&signed, None), ok)), 200);
        // Expired, tampered, or expiring beyond the bound: 401 for a secure sandbox.
        let expired = signed_path(NOW - 1, "/ping");
        assert_eq!(status(check(&g, &secure, &req(&expired, None), ok)), 401);
        let too_far = signed_path(NOW + 3601, "/ping");
        assert_eq!(status(check(&g, &secure, &req(&too_far, None), ok)), 401);
        let tampered = signed.replacen(&to_b36(NOW + 60), &to_b36(NOW + 61), 1);
        assert_eq!(status(check(&g, &secure, &req(&tampered, None), ok)), 401);
        // Another port's or sandbox's route does not open this one.
        let other_port = format!(
            "/{}/{}/ping",
            to_b36(NOW + 60),
            signer().sign(ID, 8080, NOW + 60)
        );
        assert_eq!(status(check(&g, &secure, &req(&other_port, None), ok)), 401);
        // The signature segments stripped: a plain path, which needs the header.
        assert_eq!(status(check(&g, &secure, &req("/ping", None), ok)), 401);
        // The server proxy without the API key: a signed route still passes, a token alone
        // does not replace the API key.
        let refused = Unsigned::Refused;
        assert_eq!(
            status(check(&g, &secure, &req(&signed, None), refused)),
            200
        );
        assert_eq!(
            status(check(
                &g,
                &secure,
                &req("/ping", Some(token.expose())),
                refused
            )),
            403
        );
    }

    #[test]
    fn open_sandboxes_stay_open_and_bad_signatures_are_forbidden() {
        let g = guard(1000);
        let ok = Unsigned::Allowed;
        let open = SandboxAccess::Open;
        assert_eq!(status(check(&g, &open, &req("/ping", None), ok)), 200);
        assert_eq!(
            status(check(&g, &open, &req("/ping", Some("anything")), ok)),
            200
        );
        let signed = signed_path(NOW + 60, "/ping");
        assert_eq!(status(check(&g, &open, &req(&signed, None), ok)), 200);
        let expired = signed_path(NOW - 1, "/ping");
        assert_eq!(status(check(&g, &open, &req(&expired, None), ok)), 403);
    }

    #[test]
    fn failures_are_limited_but_a_valid_token_never_is() {
        let g = guard(3);
        let token = AccessToken::generate().unwrap();
        let secure = SandboxAccess::Secure(token.clone());
        let ok = Unsigned::Allowed;
        for _ in 0..3 {
            assert_eq!(
                status(check(&g, &secure, &req("/ping", Some("wrong")), ok)),
                401
            );
        }
        assert_eq!(
            status(check(&g, &secure, &req("/ping", Some("wrong")), ok)),
            429
        );
        // Missing credentials are not guesses: still 401.
        assert_eq!(status(check(&g, &secure, &req("/ping", None), ok)), 401);
        // The right token passes even now.
        assert_eq!(
            status(check(&g, &secure, &req("/ping", Some(token.expose())), ok)),
            200
        );
        // A signed route, even a valid one, is not checked while the source is over.
        let signed = signed_path(NOW + 60, "/ping");
        assert_eq!(status(check(&g, &secure, &req(&signed, None), ok)), 429);
        assert_eq!(
            status(check(&g, &SandboxAccess::Open, &req(&signed, None), ok)),
            429
        );
    }
}
