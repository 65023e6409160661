//! Path-form routes: separating a signed route's credential from the path the sandbox sees.
//!
//! After the `{id}/{port}` prefix, a proxied path is either `/{expires_b36}/{sig}/rest...`
//! (signed) or `/rest...` (unsigned). The two forms are told apart by shape alone: the first
//! two segments are a credential when the first is a canonical base-36 number (1 to 13 of
//! `0-9a-z`, no leading zero) and the second is exactly 8 lowercase hex digits followed by the
//! id of a key the signer holds. Paths such as `/files/upload` or `/ping` are therefore never mistaken for
//! credentials. A sandbox path that itself starts with such a pair (`/abc/0123abcda/...`) is
//! read as signed; that ambiguity is inherent in the OSEP-0011 URI form.

use super::b36;
use super::signer::sig_key_id;

/// A proxied path split into its optional credential and the path to forward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutePath {
    /// `(expires_b36, sig)` when the path starts with a credential-shaped pair of segments.
    pub signed: Option<(String, String)>,
    /// The path to forward: always starts with `/` and holds nothing of the credential.
    pub rest: String,
}

/// Splits the part of a path after `{id}/{port}` into credential and forwarded path.
///
/// `path` carries no query string; `is_key_id` tells the ids of the keys held (with rotation,
/// more than one: [`super::RouteSigner::holds`]). See the module docs for when a path counts
/// as signed.
pub fn split_route(path: &str, is_key_id: impl Fn(char) -> bool) -> RoutePath {
    let relative = path.strip_prefix('/').unwrap_or(path);
    let mut segments = relative.splitn(3, '/');
    if let (Some(expires), Some(sig)) = (segments.next(), segments.next())
        && b36::has_shape(expires)
        && sig_key_id(sig).is_some_and(&is_key_id)
    {
        return RoutePath {
            signed: Some((expires.to_owned(), sig.to_owned())),
            rest: format!("/{}", segments.next().unwrap_or("")),
        };
    }
    RoutePath {
        signed: None,
        rest: format!("/{relative}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_a(c: char) -> bool {
        c == 'a'
    }

    fn unsigned(rest: &str) -> RoutePath {
        RoutePath {
            signed: None,
            rest: rest.to_owned(),
        }
    }

    fn signed(expires: &str, sig: &str, rest: &str) -> RoutePath {
        RoutePath {
            signed: Some((expires.to_owned(), sig.to_owned())),
            rest: rest.to_owned(),
        }
    }

    #[test]
    fn plain_paths_are_unsigned() {
        assert_eq!(split_route("", is_a), unsigned("/"));
        assert_eq!(split_route("/", is_a), unsigned("/"));
        assert_eq!(split_route("/ping", is_a), unsigned("/ping"));
        assert_eq!(
            split_route("/files/upload", is_a),
            unsigned("/files/upload")
        );
        assert_eq!(
            split_route("/files/download/", is_a),
            unsigned("/files/download/")
        );
        assert_eq!(split_route("ping", is_a), unsigned("/ping"));
        assert_eq!(split_route("//x", is_a), unsigned("//x"));
    }

    #[test]
    fn credential_shaped_prefix_is_split_off() {
        assert_eq!(
            split_route("/s44we8/0123abcda", is_a),
            signed("s44we8", "0123abcda", "/")
        );
        assert_eq!(
            split_route("/s44we8/0123abcda/", is_a),
            signed("s44we8", "0123abcda", "/")
        );
        assert_eq!(
            split_route("/s44we8/0123abcda/files/upload", is_a),
            signed("s44we8", "0123abcda", "/files/upload")
        );
        assert_eq!(
            split_route("/0/ffffffffa/x/", is_a),
            signed("0", "ffffffffa", "/x/")
        );
    }

    #[test]
    fn every_held_key_id_counts() {
        let held = |c| c == 'a' || c == 'b';
        assert_eq!(
            split_route("/s44we8/0123abcdb/x", held),
            signed("s44we8", "0123abcdb", "/x")
        );
        assert_eq!(
            split_route("/s44we8/0123abcda/x", held),
            signed("s44we8", "0123abcda", "/x")
        );
        assert_eq!(
            split_route("/s44we8/0123abcdc/x", held),
            unsigned("/s44we8/0123abcdc/x")
        );
    }

    #[test]
    fn near_misses_stay_unsigned() {
        // Wrong key id: the path belongs to the sandbox.
        assert_eq!(
            split_route("/s44we8/0123abcdb/x", is_a),
            unsigned("/s44we8/0123abcdb/x")
        );
        // Uppercase hex, short or long signature, non-hex digit.
        for path in [
            "/s44we8/0123ABCDa",
            "/s44we8/0123abca",
            "/s44we8/0123abcdea",
            "/s44we8/0123abcga",
        ] {
            assert_eq!(split_route(path, is_a), unsigned(path), "{path}");
        }
        // Expiry with a leading zero, uppercase or too long.
        for path in [
            "/0s44we8/0123abcda",
            "/S44WE8/0123abcda",
            "/10000000000000/0123abcda",
            "//0123abcda",
        ] {
            assert_eq!(split_route(path, is_a), unsigned(path), "{path}");
        }
    }
}
