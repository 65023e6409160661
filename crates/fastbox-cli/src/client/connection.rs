//! Which server the client commands talk to and with which API key: flags first, then
//! fastbox's environment, then the OpenSandbox SDK's, then the defaults of a local `fastbox up`.

use std::path::Path;

use anyhow::Context;
use reqwest::Url;

use super::api::ApiClient;

/// The lifecycle API of a `fastbox up` with default settings.
pub const DEFAULT_SERVER: &str = "http://127.0.0.1:8080";

/// Where a `fastbox up` with the default data directory keeps its API key.
pub const DEFAULT_KEY_FILE: &str = "/var/lib/fastbox/api-key";

/// The OpenSandbox SDK's variables, used when fastbox's own are not set.
const SDK_DOMAIN_ENV: &str = "OPEN_SANDBOX_DOMAIN";
const SDK_API_KEY_ENV: &str = "OPEN_SANDBOX_API_KEY";

#[derive(clap::Args, Debug, Clone)]
pub struct ServerArgs {
    /// Lifecycle API URL; else $OPEN_SANDBOX_DOMAIN (`host:port` means http), else
    /// http://127.0.0.1:8080.
    #[arg(
        long,
        visible_alias = "url",
        env = "FASTBOX_SERVER",
        value_name = "URL"
    )]
    pub server: Option<String>,
    /// API key (sent as OPEN-SANDBOX-API-KEY); else $OPEN_SANDBOX_API_KEY, else the contents
    /// of /var/lib/fastbox/api-key when readable.
    #[arg(
        long,
        env = "FASTBOX_API_KEY",
        hide_env_values = true,
        value_name = "KEY"
    )]
    pub api_key: Option<String>,
}

impl ServerArgs {
    /// A client of the server these arguments and the environment name.
    pub fn client(&self) -> anyhow::Result<ApiClient> {
        let (server, key) = self.resolve()?;
        Ok(ApiClient::try_new(server, key)?)
    }

    /// The server URL and API key, each from its flag, the environment or the default.
    pub fn resolve(&self) -> anyhow::Result<(Url, Option<String>)> {
        let env = |name: &str| std::env::var(name).ok();
        let server = server_url(self.server.as_deref(), &env)?;
        let key = api_key(self.api_key.as_deref(), &env, Path::new(DEFAULT_KEY_FILE));
        Ok((server, key))
    }
}

/// The server URL: the flag (or `FASTBOX_SERVER`, which clap reads into it), else
/// `OPEN_SANDBOX_DOMAIN`, else the default. A value without a scheme means `http://`.
pub fn server_url(flag: Option<&str>, env: &dyn Fn(&str) -> Option<String>) -> anyhow::Result<Url> {
    let raw = non_empty(flag.map(str::to_string))
        .or_else(|| non_empty(env(SDK_DOMAIN_ENV)))
        .unwrap_or_else(|| DEFAULT_SERVER.to_string());
    let with_scheme = if raw.contains("://") {
        raw
    } else {
        format!("http://{raw}")
    };
    let url = Url::parse(&with_scheme)
        .with_context(|| format!("server URL {with_scheme:?} is not a URL"))?;
    if !matches!(url.scheme(), "http" | "https") {
        anyhow::bail!("server URL {with_scheme:?}: only http and https are supported");
    }
    Ok(url)
}

/// The API key: the flag (or `FASTBOX_API_KEY`), else `OPEN_SANDBOX_API_KEY`, else the trimmed
/// contents of `key_file` when it is readable; None sends no key.
pub fn api_key(
    flag: Option<&str>,
    env: &dyn Fn(&str) -> Option<String>,
    key_file: &Path,
) -> Option<String> {
    non_empty(flag.map(str::to_string))
        .or_else(|| non_empty(env(SDK_API_KEY_ENV)))
        .or_else(|| non_empty(std::fs::read_to_string(key_file).ok()))
}

/// The trimmed value; an empty one counts as unset (`FASTBOX_API_KEY=` falls through).
fn non_empty(value: Option<String>) -> Option<String> {
    value
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn sdk_env(name: &str) -> Option<String> {
        match name {
            SDK_DOMAIN_ENV => Some("sandbox.example:9000".into()),
            SDK_API_KEY_ENV => Some("sdk-key".into()),
            _ => None,
        }
    }

    #[test]
    fn the_server_comes_from_the_flag_then_the_sdk_domain_then_the_default() {
        let url = |flag| server_url(flag, &sdk_env).unwrap().to_string();
        assert_eq!(url(Some("https://h:1")), "https://h:1/");
        assert_eq!(url(None), "http://sandbox.example:9000/");
        assert_eq!(
            server_url(None, &no_env).unwrap().as_str(),
            "http://127.0.0.1:8080/"
        );
        assert_eq!(
            server_url(Some("127.0.0.1:18280"), &no_env)
                .unwrap()
                .as_str(),
            "http://127.0.0.1:18280/"
        );
        assert_eq!(url(Some(" ")), "http://sandbox.example:9000/");
        assert!(server_url(Some("ftp://h"), &no_env).is_err());
    }

    #[test]
    fn the_key_comes_from_the_flag_then_the_sdk_variable_then_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("api-key");
        std::fs::write(&file, "file-key\n").unwrap();
        assert_eq!(
            api_key(Some("flag-key"), &sdk_env, &file).as_deref(),
            Some("flag-key")
        );
        assert_eq!(api_key(None, &sdk_env, &file).as_deref(), Some("sdk-key"));
        assert_eq!(api_key(None, &no_env, &file).as_deref(), Some("file-key"));
        assert_eq!(api_key(None, &no_env, &dir.path().join("missing")), None);
        assert_eq!(
            api_key(Some(""), &sdk_env, &file).as_deref(),
            Some("sdk-key")
        );
    }
}
