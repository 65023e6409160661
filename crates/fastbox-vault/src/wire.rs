//! The `/credential-vault` API's shapes, as the egress API sends them: requests (unknown
//! fields refused, as the spec's `additionalProperties: false` says) and sanitized answers,
//! which name credentials but never carry a value.

use serde::{Deserialize, Serialize};

use crate::Secret;

/// `POST /credential-vault`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateRequest {
    pub credentials: Vec<CredentialSpec>,
    pub bindings: Vec<BindingSpec>,
}

/// `PATCH /credential-vault`: every change applies, or none.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MutationRequest {
    /// Refused as a conflict unless the vault is at this revision.
    #[serde(default)]
    pub expected_revision: Option<u64>,
    #[serde(default)]
    pub credentials: Option<MutationSet<CredentialSpec>>,
    #[serde(default)]
    pub bindings: Option<MutationSet<BindingSpec>>,
}

/// Adds (new names), replacements (existing names) and deletions (by name).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MutationSet<T> {
    #[serde(default = "Vec::new")]
    pub add: Vec<T>,
    #[serde(default = "Vec::new")]
    pub replace: Vec<T>,
    #[serde(default)]
    pub delete: Vec<String>,
}

impl<T> Default for MutationSet<T> {
    fn default() -> Self {
        Self {
            add: Vec::new(),
            replace: Vec::new(),
            delete: Vec::new(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CredentialSpec {
    pub name: String,
    pub source: CredentialSource,
}

/// Where a credential's value comes from: inline only.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "camelCase", deny_unknown_fields)]
pub enum CredentialSource {
    Inline { value: Secret },
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BindingSpec {
    pub name: String,
    #[serde(rename = "match")]
    pub matcher: MatchSpec,
    pub auth: AuthSpec,
}

/// Which requests a binding takes. Absent lists take the spec's defaults.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MatchSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schemes: Option<Vec<String>>,
    /// Deprecated: only 80 and 443 are accepted, and they are ignored (the port follows
    /// the scheme).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports: Option<Vec<u16>>,
    pub hosts: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub methods: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paths: Option<Vec<String>>,
}

/// How a bound request gets its credential.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(tag = "type", rename_all = "camelCase", deny_unknown_fields)]
pub enum AuthSpec {
    /// `Authorization: Bearer VALUE`.
    Bearer {
        credential: String,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        substitutions: Vec<Substitution>,
    },
    /// `Authorization: Basic VALUE`; the value is `base64(user:password)` already.
    Basic {
        credential: String,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        substitutions: Vec<Substitution>,
    },
    /// Header `name: VALUE`.
    #[serde(rename = "apiKey")]
    ApiKey {
        name: String,
        credential: String,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        substitutions: Vec<Substitution>,
    },
    /// Headers of the caller's choice, each with a credential's value.
    #[serde(rename = "customHeaders")]
    CustomHeaders {
        headers: Vec<HeaderEntry>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        substitutions: Vec<Substitution>,
    },
    /// No header: only the substitutions.
    Passthrough {
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        substitutions: Vec<Substitution>,
    },
}

impl AuthSpec {
    pub fn kind(&self) -> &'static str {
        match self {
            AuthSpec::Bearer { .. } => "bearer",
            AuthSpec::Basic { .. } => "basic",
            AuthSpec::ApiKey { .. } => "apiKey",
            AuthSpec::CustomHeaders { .. } => "customHeaders",
            AuthSpec::Passthrough { .. } => "passthrough",
        }
    }

    pub fn substitutions(&self) -> &[Substitution] {
        match self {
            AuthSpec::Bearer { substitutions, .. }
            | AuthSpec::Basic { substitutions, .. }
            | AuthSpec::ApiKey { substitutions, .. }
            | AuthSpec::CustomHeaders { substitutions, .. }
            | AuthSpec::Passthrough { substitutions } => substitutions,
        }
    }

    /// The credentials it names, headers' and substitutions' alike.
    pub fn credentials(&self) -> Vec<&str> {
        let mut names: Vec<&str> = match self {
            AuthSpec::Bearer { credential, .. }
            | AuthSpec::Basic { credential, .. }
            | AuthSpec::ApiKey { credential, .. } => vec![credential.as_str()],
            AuthSpec::CustomHeaders { headers, .. } => {
                headers.iter().map(|h| h.credential.as_str()).collect()
            }
            AuthSpec::Passthrough { .. } => Vec::new(),
        };
        names.extend(self.substitutions().iter().map(|s| s.credential.as_str()));
        names
    }
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HeaderEntry {
    pub name: String,
    pub credential: String,
}

/// A literal placeholder in the request replaced by a credential's value.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Substitution {
    pub credential: String,
    pub placeholder: String,
    #[serde(rename = "in")]
    pub surfaces: Vec<Surface>,
}

/// Where a placeholder is replaced.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum Surface {
    Path,
    Query,
    Header,
    Body,
}

/// The vault as the API shows it: names and revisions, never a value.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct VaultState {
    pub revision: u64,
    pub credentials: Vec<CredentialMetadata>,
    pub bindings: Vec<BindingMetadata>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CredentialMetadata {
    pub name: String,
    pub source_type: &'static str,
    pub revision: u64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct BindingMetadata {
    pub name: String,
    pub revision: u64,
    #[serde(rename = "match")]
    pub matcher: MatchSpec,
    pub auth: AuthMetadata,
}

/// A binding's auth as shown: its type, and the header it sets for `apiKey`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct AuthMetadata {
    #[serde(rename = "type")]
    pub kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// `GET /credential-vault/credentials`.
#[derive(Debug, Clone, Serialize)]
pub struct CredentialList {
    pub revision: u64,
    pub credentials: Vec<CredentialMetadata>,
}

/// `GET /credential-vault/bindings`.
#[derive(Debug, Clone, Serialize)]
pub struct BindingList {
    pub revision: u64,
    pub bindings: Vec<BindingMetadata>,
}
