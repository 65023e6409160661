//! The static pairing (`fastbox up --remote-node` with `fastbox node --control-url`) is plain
//! HTTP: the node's credentials and every sandbox's tokens cross the link readable. It is
//! accepted on loopback; anywhere else only when the operator says the link is private
//! (`--allow-plaintext-pairing`). A node that joins (`--accept-nodes`, `--join`) uses TLS.

use std::net::IpAddr;

/// The flag that accepts a plain-HTTP pairing beyond loopback.
pub const FLAG: &str = "--allow-plaintext-pairing";

/// Refuses `url` (given to `flag`) when it is plain HTTP to anything but loopback, unless
/// `allowed`.
pub fn check(url: &str, flag: &str, allowed: bool) -> anyhow::Result<()> {
    let parsed = reqwest::Url::parse(url).map_err(|e| anyhow::anyhow!("{flag} {url:?}: {e}"))?;
    if parsed.scheme() != "http" || allowed {
        return Ok(());
    }
    let host = parsed.host_str().unwrap_or_default();
    let loopback = host == "localhost"
        || host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    anyhow::ensure!(
        loopback,
        "{flag} {url}: the static pairing is plain HTTP, so the node's credentials and every \
         sandbox's tokens would cross the network readable. Join nodes over TLS instead \
         (`fastbox up --accept-nodes`, `fastbox node --join`), keep the pairing on loopback, \
         or pass {FLAG} to both sides for a link only they can reach"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_http_beyond_loopback_needs_the_flag() {
        for ok in [
            "http://127.0.0.1:8090",
            "http://127.9.9.9:1",
            "http://[::1]:8090",
            "http://localhost:8090",
            "https://10.0.0.2:8090",
        ] {
            check(ok, "--remote-node", false).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for refused in [
            "http://10.0.0.2:8090",
            "http://node.example:8090",
            "http://[fd00::1]:1",
        ] {
            let e = check(refused, "--remote-node", false).expect_err(refused);
            assert!(e.to_string().contains(FLAG), "{e}");
            check(refused, "--remote-node", true).unwrap();
        }
        assert!(check("not a url", "--remote-node", true).is_err());
    }
}
