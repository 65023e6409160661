use serde_json::json;

use super::*;
use crate::wire::{CreateRequest, MutationRequest};

fn create(body: serde_json::Value) -> Result<Vault, VaultError> {
    Vault::create(serde_json::from_value::<CreateRequest>(body).expect("a create request"))
}

fn patch(vault: &Vault, body: serde_json::Value) -> Result<Vault, VaultError> {
    vault.mutate(serde_json::from_value::<MutationRequest>(body).expect("a mutation"))
}

fn github() -> Vault {
    create(json!({
        "credentials": [
            {"name": "gh", "source": {"type": "inline", "value": "ghp_secret1"}},
            {"name": "other", "source": {"type": "inline", "value": "s3cr3t-2"}}
        ],
        "bindings": [
            {"name": "github", "match": {"hosts": ["api.github.example"]},
             "auth": {"type": "bearer", "credential": "gh"}}
        ]
    }))
    .expect("a valid vault")
}

#[test]
fn its_state_names_everything_and_shows_no_value() {
    let vault = github();
    let shown = serde_json::to_string(&vault.state()).unwrap();
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&shown).unwrap(),
        json!({
            "revision": 1,
            "credentials": [
                {"name": "gh", "sourceType": "inline", "revision": 1},
                {"name": "other", "sourceType": "inline", "revision": 1}
            ],
            "bindings": [
                {"name": "github", "revision": 1, "match": {"hosts": ["api.github.example"]},
                 "auth": {"type": "bearer"}}
            ]
        })
    );
    assert!(!shown.contains("ghp_secret1") && !format!("{vault:?}").contains("ghp_secret1"));
    assert_eq!(vault.value("gh").unwrap().expose(), "ghp_secret1");
}

#[test]
fn a_mutation_is_a_new_revision_and_applies_whole_or_not_at_all() {
    let vault = github();
    let next = patch(
        &vault,
        json!({
            "expectedRevision": 1,
            "credentials": {"replace": [{"name": "gh", "source": {"type": "inline", "value": "ghp_new"}}]},
            "bindings": {"add": [{"name": "api-key", "match": {"hosts": ["*.example.net"]},
                                  "auth": {"type": "apiKey", "name": "X-Api-Key", "credential": "other"}}]}
        }),
    )
    .expect("applied");
    assert_eq!(next.revision(), 2);
    assert_eq!(next.value("gh").unwrap().expose(), "ghp_new");
    assert_eq!(next.credential("gh").unwrap().revision, 2);
    assert_eq!(next.credential("other").unwrap().revision, 1);
    assert_eq!(
        next.binding("api-key").unwrap().auth.name.as_deref(),
        Some("X-Api-Key")
    );
    // Stale, or partly wrong: nothing changes.
    assert!(matches!(
        patch(
            &next,
            json!({"expectedRevision": 1, "credentials": {"delete": ["other"]}})
        ),
        Err(VaultError::Conflict(_))
    ));
    let half_wrong = patch(
        &next,
        json!({"credentials": {"delete": ["other"]}, "bindings": {"delete": ["nope"]}}),
    );
    assert!(matches!(half_wrong, Err(VaultError::NotFound(_))));
    assert!(next.value("other").is_some());
    // A credential a binding still names cannot go.
    let dangling = patch(&next, json!({"credentials": {"delete": ["other"]}}));
    assert!(
        matches!(&dangling, Err(VaultError::Invalid(m)) if m.contains("api-key")),
        "{dangling:?}"
    );
}

#[test]
fn names_taken_twice_or_missing_are_told_apart() {
    let vault = github();
    let taken = patch(
        &vault,
        json!({"credentials": {"add": [{"name": "gh", "source": {"type": "inline", "value": "x"}}]}}),
    );
    assert!(matches!(taken, Err(VaultError::Conflict(_))));
    let replace_missing = patch(
        &vault,
        json!({"credentials": {"replace": [{"name": "zz", "source": {"type": "inline", "value": "x"}}]}}),
    );
    assert!(matches!(replace_missing, Err(VaultError::NotFound(_))));
    let twice = patch(
        &vault,
        json!({"credentials": {"delete": ["other"], "replace": [{"name": "other", "source": {"type": "inline", "value": "x"}}]}}),
    );
    assert!(matches!(twice, Err(VaultError::Invalid(_))));
    assert!(matches!(
        patch(&vault, json!({})),
        Err(VaultError::Invalid(_))
    ));
}

#[test]
fn bad_vaults_are_refused_with_the_reason() {
    let refused = |body| create(body).unwrap_err().to_string();
    let cred = |name: &str, value: &str| json!({"name": name, "source": {"type": "inline", "value": value}});
    assert!(refused(json!({"credentials": [cred("a b", "x")], "bindings": []})).contains("name"));
    assert!(refused(json!({"credentials": [cred("a", "")], "bindings": []})).contains("1 to"));
    assert!(
        refused(json!({"credentials": [cred("a", "x\r\nHost: evil")], "bindings": []}))
            .contains("control")
    );
    assert!(
        refused(json!({"credentials": [cred("a", "x"), cred("a", "y")], "bindings": []}))
            .contains("exists")
    );
    let binding = |auth: serde_json::Value| {
        json!({"credentials": [cred("a", "x")],
        "bindings": [{"name": "b", "match": {"hosts": ["h.example"]}, "auth": auth}]})
    };
    assert!(
        refused(binding(json!({"type": "bearer", "credential": "missing"}))).contains("missing")
    );
    assert!(
        refused(binding(
            json!({"type": "apiKey", "name": "Host", "credential": "a"})
        ))
        .contains("may not be set")
    );
    assert!(
        refused(binding(
            json!({"type": "apiKey", "name": "X Key", "credential": "a"})
        ))
        .contains("header name")
    );
    assert!(refused(binding(json!({"type": "customHeaders", "headers": [], }))).contains("empty"));
    assert!(
        refused(binding(json!({"type": "passthrough", "substitutions": [
        {"credential": "a", "placeholder": "", "in": ["header"]}]})))
        .contains("placeholder")
    );
    // Unknown fields and types are the wire's to refuse.
    assert!(
        serde_json::from_value::<CreateRequest>(
            json!({"credentials": [], "bindings": [], "extra": 1})
        )
        .is_err()
    );
    assert!(
        serde_json::from_value::<CreateRequest>(json!({"credentials": [
        {"name": "a", "source": {"type": "file", "value": "x"}}], "bindings": []}))
        .is_err()
    );
}

#[test]
fn a_request_falls_under_the_most_specific_binding() {
    let vault = create(json!({
        "credentials": [{"name": "a", "source": {"type": "inline", "value": "va"}},
                        {"name": "b", "source": {"type": "inline", "value": "vb"}}],
        "bindings": [
            {"name": "wide", "match": {"hosts": ["*.example.org"]}, "auth": {"type": "bearer", "credential": "a"}},
            {"name": "exact", "match": {"hosts": ["api.example.org"], "paths": ["/v1/*"]},
             "auth": {"type": "bearer", "credential": "b"}}
        ]
    }))
    .unwrap();
    let under = |host: &'static str, path: &'static str| {
        vault
            .binding_for(&RequestTarget {
                scheme: "https",
                host,
                method: "GET",
                path,
            })
            .map(|b| b.spec.name.clone())
    };
    assert_eq!(under("api.example.org", "/v1/x").as_deref(), Some("exact"));
    assert_eq!(under("api.example.org", "/v2").as_deref(), Some("wide"));
    assert_eq!(under("x.example.org", "/v1/x").as_deref(), Some("wide"));
    assert_eq!(under("example.org", "/"), None);
    assert!(vault.binds_host("https", "Api.Example.org"));
    assert!(!vault.binds_host("http", "api.example.org"));
    assert_eq!(vault.redaction_set(), ["va", "vb"]);
}
