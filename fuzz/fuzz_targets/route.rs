//! Signed routes (`fastbox_proxy::route`) on arbitrary paths: the input is what follows the
//! proxy's prefix, `{id}/{port}/{expires_b36}/{sig}/rest` or `{id}/{port}/rest`. The path is
//! split as the proxies split it, any credential is verified with a fixed keyring, and a
//! route signed for the same id and port must verify and split back into its credential.
#![no_main]

use std::sync::LazyLock;

use fastbox_fuzz::{ROUTE_NOW as NOW, route_signer};
use fastbox_proxy::route::{RouteError, RouteSigner, from_b36, split_route, to_b36};
use libfuzzer_sys::fuzz_target;

/// The longest lifetime `verify_bounded` accepts here.
const MAX_LIFETIME: u64 = 7 * 24 * 3600;

/// Two keys: `a` (retired, still verifies) and `b` (signs).
static SIGNER: LazyLock<RouteSigner> = LazyLock::new(route_signer);

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let signer = &*SIGNER;
    let (id, after_id) = text.split_once('/').unwrap_or((&text, ""));
    let port_text = after_id.split('/').next().unwrap_or("");
    let path = &after_id[port_text.len()..]; // "" or "/..."
    let port: u16 = port_text.parse().unwrap_or(8080);

    // The split: the forwarded path holds nothing of the credential and loses nothing else.
    let route = split_route(path, |c| signer.holds(c));
    assert!(route.rest.starts_with('/'), "rest {:?}", route.rest);
    let relative = path.strip_prefix('/').unwrap_or(path);
    match &route.signed {
        None => assert_eq!(route.rest, format!("/{relative}")),
        Some((expires, sig)) => {
            let joined = format!("/{expires}/{sig}{}", route.rest);
            assert!(
                joined == format!("/{relative}") || joined == format!("/{relative}/"),
                "{path:?} split into {route:?}"
            );
            assert!(sig.chars().last().is_some_and(|c| signer.holds(c)));
            check_verify(signer, id, port, expires, sig);
        }
    }

    // Any two segments as a credential, whatever their shape.
    let mut segments = relative.splitn(3, '/');
    let (expires, sig) = (segments.next().unwrap_or(""), segments.next().unwrap_or(""));
    check_verify(signer, id, port, expires, sig);

    // Round trip: sign for this id and port, verify, split the signed path back.
    let expires = from_b36(expires).unwrap_or(NOW + data.len() as u64);
    let expires_b36 = to_b36(expires);
    let sig = signer.sign(id, port, expires);
    assert_eq!(sig.len(), 9);
    assert!(sig.ends_with('b'), "the newest key signs");
    match signer.verify(id, port, &expires_b36, &sig, NOW) {
        Ok(at) => {
            assert!(expires >= NOW);
            assert_eq!(at, expires);
        }
        Err(RouteError::Expired { expires: at }) => {
            assert!(expires < NOW);
            assert_eq!(at, expires);
        }
        Err(e) => panic!("a route this signer signed does not verify: {e}"),
    }
    let rest = if path.is_empty() { "/" } else { path };
    let signed_path = format!("/{expires_b36}/{sig}{rest}");
    let split = split_route(&signed_path, |c| signer.holds(c));
    assert_eq!(split.signed, Some((expires_b36, sig)), "{signed_path:?}");
    assert_eq!(split.rest, rest);
});

/// Verifying never panics, and what it accepts is a current, canonical credential.
fn check_verify(signer: &RouteSigner, id: &str, port: u16, expires: &str, sig: &str) {
    if let Ok(at) = signer.verify(id, port, expires, sig, NOW) {
        assert!(at >= NOW, "accepted an expired route");
        assert_eq!(to_b36(at), expires, "accepted a non-canonical expiry");
        assert_eq!(sig.len(), 9);
    }
    match signer.verify_bounded(id, port, expires, sig, NOW, MAX_LIFETIME) {
        Ok(at) => assert!((NOW..=NOW + MAX_LIFETIME).contains(&at)),
        Err(RouteError::TooFarAhead { expires, .. }) => assert!(expires > NOW + MAX_LIFETIME),
        Err(_) => {}
    }
}
