//! A validated vault: creation, atomic mutations (each a new revision; a failed one
//! changes nothing), sanitized views, and the binding an outgoing request falls under.

use std::collections::{BTreeMap, BTreeSet};

use crate::Secret;
use crate::matching::{Matcher, RequestTarget};
use crate::wire::{
    AuthMetadata, AuthSpec, BindingList, BindingMetadata, BindingSpec, CreateRequest,
    CredentialList, CredentialMetadata, CredentialSource, CredentialSpec, MutationRequest,
    MutationSet, VaultState,
};

/// The longest credential or binding name.
const MAX_NAME_LEN: usize = 128;
/// The longest credential value.
const MAX_VALUE_LEN: usize = 16 * 1024;

/// Headers a binding may not set: they frame the request or its connection, and setting
/// them would let a binding smuggle another request.
const FORBIDDEN_HEADERS: &[&str] = &[
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "upgrade",
    "te",
    "trailer",
    "proxy-authorization",
    "proxy-connection",
];

/// Why a vault request was refused; each maps to one HTTP status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VaultError {
    /// 400: the request is malformed or names something invalid.
    #[error("{0}")]
    Invalid(String),
    /// 404: a credential or binding it names is not in the vault.
    #[error("{0}")]
    NotFound(String),
    /// 409: the vault is not at the expected revision, or a name is taken.
    #[error("{0}")]
    Conflict(String),
}

#[derive(Debug, Clone)]
struct Credential {
    value: Secret,
    revision: u64,
}

/// A binding, its match compiled.
#[derive(Debug, Clone)]
pub struct Binding {
    pub spec: BindingSpec,
    matcher: Matcher,
    revision: u64,
}

impl Binding {
    fn compile(spec: BindingSpec, revision: u64) -> Result<Self, VaultError> {
        check_name("binding", &spec.name)?;
        let at = |e: String| VaultError::Invalid(format!("binding {:?}: {e}", spec.name));
        let matcher = Matcher::compile(&spec.matcher).map_err(at)?;
        check_auth(&spec.auth).map_err(at)?;
        Ok(Self {
            spec,
            matcher,
            revision,
        })
    }

    fn metadata(&self) -> BindingMetadata {
        BindingMetadata {
            name: self.spec.name.clone(),
            revision: self.revision,
            matcher: self.spec.matcher.clone(),
            auth: AuthMetadata {
                kind: self.spec.auth.kind(),
                name: match &self.spec.auth {
                    AuthSpec::ApiKey { name, .. } => Some(name.clone()),
                    _ => None,
                },
            },
        }
    }
}

/// One sandbox's vault.
#[derive(Debug, Clone)]
pub struct Vault {
    revision: u64,
    credentials: BTreeMap<String, Credential>,
    bindings: BTreeMap<String, Binding>,
}

impl Vault {
    /// `POST /credential-vault`: the vault at revision 1.
    pub fn create(request: CreateRequest) -> Result<Self, VaultError> {
        let mut vault = Vault {
            revision: 1,
            credentials: BTreeMap::new(),
            bindings: BTreeMap::new(),
        };
        for credential in request.credentials {
            vault.add_credential(credential)?;
        }
        for binding in request.bindings {
            vault.add_binding(binding)?;
        }
        vault.check_references()?;
        Ok(vault)
    }

    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// `PATCH /credential-vault`: the vault with every change made, at the next revision;
    /// this one is untouched whatever the outcome.
    pub fn mutate(&self, request: MutationRequest) -> Result<Self, VaultError> {
        if let Some(expected) = request.expected_revision
            && expected != self.revision
        {
            return Err(VaultError::Conflict(format!(
                "the vault is at revision {}, not {expected}",
                self.revision
            )));
        }
        let credentials = request.credentials.unwrap_or_default();
        let bindings = request.bindings.unwrap_or_default();
        if is_empty(&credentials) && is_empty(&bindings) {
            return Err(VaultError::Invalid("the mutation changes nothing".into()));
        }
        once_each("credentials", &credentials, |c| &c.name)?;
        once_each("bindings", &bindings, |b| &b.name)?;
        let mut next = self.clone();
        next.revision += 1;
        for name in &credentials.delete {
            next.credentials
                .remove(name)
                .ok_or_else(|| VaultError::NotFound(format!("no credential {name:?}")))?;
        }
        for credential in credentials.replace {
            if !next.credentials.contains_key(&credential.name) {
                return Err(VaultError::NotFound(format!(
                    "no credential {:?} to replace",
                    credential.name
                )));
            }
            next.credentials.remove(&credential.name);
            next.add_credential(credential)?;
        }
        for credential in credentials.add {
            next.add_credential(credential)?;
        }
        for name in &bindings.delete {
            next.bindings
                .remove(name)
                .ok_or_else(|| VaultError::NotFound(format!("no binding {name:?}")))?;
        }
        for binding in bindings.replace {
            if !next.bindings.contains_key(&binding.name) {
                return Err(VaultError::NotFound(format!(
                    "no binding {:?} to replace",
                    binding.name
                )));
            }
            next.bindings.remove(&binding.name);
            next.add_binding(binding)?;
        }
        for binding in bindings.add {
            next.add_binding(binding)?;
        }
        next.check_references()?;
        Ok(next)
    }

    fn add_credential(&mut self, spec: CredentialSpec) -> Result<(), VaultError> {
        check_name("credential", &spec.name)?;
        let CredentialSource::Inline { value } = spec.source;
        let text = value.expose();
        if text.is_empty() || text.len() > MAX_VALUE_LEN {
            return Err(VaultError::Invalid(format!(
                "credential {:?}: the value must be 1 to {MAX_VALUE_LEN} bytes",
                spec.name
            )));
        }
        if text.bytes().any(|b| b.is_ascii_control()) {
            return Err(VaultError::Invalid(format!(
                "credential {:?}: the value holds a control character (it goes into headers)",
                spec.name
            )));
        }
        if self.credentials.contains_key(&spec.name) {
            return Err(VaultError::Conflict(format!(
                "credential {:?} exists",
                spec.name
            )));
        }
        self.credentials.insert(
            spec.name,
            Credential {
                value,
                revision: self.revision,
            },
        );
        Ok(())
    }

    fn add_binding(&mut self, spec: BindingSpec) -> Result<(), VaultError> {
        if self.bindings.contains_key(&spec.name) {
            return Err(VaultError::Conflict(format!(
                "binding {:?} exists",
                spec.name
            )));
        }
        let binding = Binding::compile(spec, self.revision)?;
        self.bindings.insert(binding.spec.name.clone(), binding);
        Ok(())
    }

    /// Every credential a binding names is in the vault.
    fn check_references(&self) -> Result<(), VaultError> {
        for binding in self.bindings.values() {
            for name in binding.spec.auth.credentials() {
                if !self.credentials.contains_key(name) {
                    return Err(VaultError::Invalid(format!(
                        "binding {:?} names credential {name:?}, which the vault does not hold",
                        binding.spec.name
                    )));
                }
            }
        }
        Ok(())
    }

    /// The vault as the API shows it.
    pub fn state(&self) -> VaultState {
        VaultState {
            revision: self.revision,
            credentials: self.credentials().credentials,
            bindings: self.bindings().bindings,
        }
    }

    pub fn credentials(&self) -> CredentialList {
        CredentialList {
            revision: self.revision,
            credentials: self
                .credentials
                .iter()
                .map(|(name, c)| credential_metadata(name, c))
                .collect(),
        }
    }

    pub fn bindings(&self) -> BindingList {
        BindingList {
            revision: self.revision,
            bindings: self.bindings.values().map(Binding::metadata).collect(),
        }
    }

    pub fn credential(&self, name: &str) -> Result<CredentialMetadata, VaultError> {
        self.credentials
            .get(name)
            .map(|c| credential_metadata(name, c))
            .ok_or_else(|| VaultError::NotFound(format!("no credential {name:?}")))
    }

    pub fn binding(&self, name: &str) -> Result<BindingMetadata, VaultError> {
        self.bindings
            .get(name)
            .map(Binding::metadata)
            .ok_or_else(|| VaultError::NotFound(format!("no binding {name:?}")))
    }

    /// The value of credential `name`.
    pub fn value(&self, name: &str) -> Option<&Secret> {
        self.credentials.get(name).map(|c| &c.value)
    }

    /// Whether some binding takes requests to `host` over `scheme`: only such connections
    /// are opened by the proxy; the others pass untouched.
    pub fn binds_host(&self, scheme: &str, host: &str) -> bool {
        self.bindings
            .values()
            .any(|b| b.matcher.binds_host(scheme, host))
    }

    /// The binding `target` falls under: the most specific (an exact host before a
    /// wildcard, then the longest path pattern), the first by name among equals.
    pub fn binding_for(&self, target: &RequestTarget<'_>) -> Option<&Binding> {
        let mut best: Option<(&Binding, (bool, usize))> = None;
        for binding in self.bindings.values() {
            if let Some(rank) = binding.matcher.specificity(target)
                && best.is_none_or(|(_, r)| rank > r)
            {
                best = Some((binding, rank));
            }
        }
        best.map(|(b, _)| b)
    }

    /// What responses must never show: every value, and every placeholder.
    pub fn redaction_set(&self) -> Vec<String> {
        let mut set: BTreeSet<String> = self
            .credentials
            .values()
            .map(|c| c.value.expose().to_string())
            .collect();
        for binding in self.bindings.values() {
            set.extend(
                binding
                    .spec
                    .auth
                    .substitutions()
                    .iter()
                    .map(|s| s.placeholder.clone()),
            );
        }
        set.into_iter().collect()
    }
}

fn credential_metadata(name: &str, c: &Credential) -> CredentialMetadata {
    CredentialMetadata {
        name: name.to_string(),
        source_type: "inline",
        revision: c.revision,
    }
}

fn is_empty<T>(set: &MutationSet<T>) -> bool {
    set.add.is_empty() && set.replace.is_empty() && set.delete.is_empty()
}

/// A name appears at most once across a set's add, replace and delete lists.
fn once_each<T>(
    what: &str,
    set: &MutationSet<T>,
    name: impl Fn(&T) -> &String,
) -> Result<(), VaultError> {
    let mut seen = BTreeSet::new();
    for n in set
        .add
        .iter()
        .map(&name)
        .chain(set.replace.iter().map(&name))
        .chain(set.delete.iter())
    {
        if !seen.insert(n) {
            return Err(VaultError::Invalid(format!(
                "{what}: {n:?} appears more than once in one mutation"
            )));
        }
    }
    Ok(())
}

fn check_name(what: &str, name: &str) -> Result<(), VaultError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    match ok {
        true => Ok(()),
        false => Err(VaultError::Invalid(format!(
            "{what} name {name:?}: 1 to {MAX_NAME_LEN} letters, digits, '.', '_' or '-'"
        ))),
    }
}

fn check_header_name(name: &str) -> Result<(), String> {
    let token = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
    if !token {
        return Err(format!("{name:?} is not a header name"));
    }
    if FORBIDDEN_HEADERS.contains(&name.to_ascii_lowercase().as_str()) {
        return Err(format!("header {name:?} may not be set by a binding"));
    }
    Ok(())
}

fn check_auth(auth: &AuthSpec) -> Result<(), String> {
    match auth {
        AuthSpec::ApiKey { name, .. } => check_header_name(name)?,
        AuthSpec::CustomHeaders { headers, .. } => {
            if headers.is_empty() {
                return Err("auth.headers is empty".into());
            }
            for h in headers {
                check_header_name(&h.name)?;
            }
        }
        _ => {}
    }
    for (i, s) in auth.substitutions().iter().enumerate() {
        if s.placeholder.is_empty() || s.placeholder.bytes().any(|b| b.is_ascii_control()) {
            return Err(format!(
                "auth.substitutions[{i}]: the placeholder must be non-empty, without control characters"
            ));
        }
        if s.surfaces.is_empty() {
            return Err(format!("auth.substitutions[{i}].in is empty"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
