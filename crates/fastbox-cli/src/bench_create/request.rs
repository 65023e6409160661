//! The create request the benchmark sends: what the Python SDK sends for
//! `SandboxSync.create(image)` with its defaults, or for `create_from_template`.

use serde_json::{Value, json};

/// The extension key that asks the server not to use a pre-restored (pooled) sandbox.
pub const POOL_EXTENSION: &str = "fastbox.io/pool";

/// The SDK's defaults for an image create.
const SDK_ENTRYPOINT: [&str; 3] = ["tail", "-f", "/dev/null"];
const SDK_CPU: &str = "1";
const SDK_MEMORY: &str = "2Gi";

/// Seconds until a benchmark sandbox expires (the SDK's default `timeout`): a run that dies
/// half-way leaves nothing running for long.
pub const SANDBOX_TIMEOUT_S: u64 = 600;

/// What each sandbox is created from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Image(String),
    Template(String),
}

/// Whether creates may be served from the server's warm pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pool {
    /// The server decides (a pooled sandbox when it has one).
    On,
    /// No pre-restored sandbox: every create starts its processes after the request.
    Off,
}

impl std::fmt::Display for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::On => "on",
            Self::Off => "off",
        })
    }
}

/// The body of `POST /v1/sandboxes`, with `network_policy` as its `networkPolicy` if given.
pub fn create_body(source: &Source, pool: Pool, network_policy: Option<&Value>) -> Value {
    let mut body = match source {
        Source::Image(image) => json!({
            "image": {"uri": image},
            "entrypoint": SDK_ENTRYPOINT,
            "timeout": SANDBOX_TIMEOUT_S,
            "resourceLimits": {"cpu": SDK_CPU, "memory": SDK_MEMORY},
        }),
        Source::Template(id) => json!({"templateId": id, "timeout": SANDBOX_TIMEOUT_S}),
    };
    if pool == Pool::Off {
        body["extensions"] = json!({ POOL_EXTENSION: "off" });
    }
    if let Some(policy) = network_policy {
        body["networkPolicy"] = policy.clone();
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_creates_carry_the_sdk_defaults() {
        let body = create_body(&Source::Image("fastbox/busybox".into()), Pool::On, None);
        assert_eq!(
            body,
            json!({
                "image": {"uri": "fastbox/busybox"},
                "entrypoint": ["tail", "-f", "/dev/null"],
                "timeout": 600,
                "resourceLimits": {"cpu": "1", "memory": "2Gi"},
            })
        );
    }

    #[test]
    fn template_creates_name_only_the_template_and_a_timeout() {
        let body = create_body(&Source::Template("tpl-1".into()), Pool::On, None);
        assert_eq!(body, json!({"templateId": "tpl-1", "timeout": 600}));
    }

    #[test]
    fn pool_off_is_an_extension_on_either_kind() {
        for source in [Source::Image("i".into()), Source::Template("t".into())] {
            let body = create_body(&source, Pool::Off, None);
            assert_eq!(body["extensions"], json!({"fastbox.io/pool": "off"}));
        }
    }

    #[test]
    fn a_network_policy_is_sent_as_given() {
        let policy = json!({"defaultAction": "deny", "egress": [{"action": "allow", "target": "example.org"}]});
        let body = create_body(&Source::Image("i".into()), Pool::On, Some(&policy));
        assert_eq!(body["networkPolicy"], policy);
    }
}
