//! What a claim changes, held as one value: the access token, the environment children start
//! from and the `EXECD_ENVS` file.
//!
//! A restored clone begins with its template's tenancy (the golden start's token, usually
//! none, and execd's own environment); `POST /fastbox/claim` replaces it once (see
//! [`crate::claim`]); `POST /fastbox/rekey` replaces the token alone, any number of times. The
//! three parts are swapped together behind one lock, so a request sees either everything from
//! before the claim or everything from after it, never a mix.

use std::path::PathBuf;
use std::sync::{Arc, PoisonError, RwLock};

use crate::auth::AccessToken;
use crate::env::EnvList;

#[derive(Debug, Clone)]
pub struct Tenancy {
    /// Required in `X-EXECD-ACCESS-TOKEN` on every request when set.
    pub access_token: Option<AccessToken>,
    /// The environment every child starts from: execd's own (without the access token), then
    /// the claim's `envs`.
    pub env: EnvList,
    /// The `EXECD_ENVS` file, re-read at every spawn.
    pub envs_file: Option<PathBuf>,
    /// Whether this process has been claimed; a claim happens at most once.
    pub claimed: bool,
}

/// The current [`Tenancy`], readable by every request and replaced as a whole.
pub struct TenancyCell(RwLock<Arc<Tenancy>>);

impl TenancyCell {
    pub fn new(initial: Tenancy) -> Self {
        TenancyCell(RwLock::new(Arc::new(initial)))
    }

    /// A snapshot: later replacements do not change it.
    pub fn current(&self) -> Arc<Tenancy> {
        Arc::clone(&self.0.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// Replaces the tenancy with what `next` makes of the current one, or leaves it when
    /// `next` fails. The write lock is held while `next` runs, so two replacements never both
    /// start from the same tenancy. `next` must not read the cell.
    pub fn replace<E>(&self, next: impl FnOnce(&Tenancy) -> Result<Tenancy, E>) -> Result<(), E> {
        let mut slot = self.0.write().unwrap_or_else(PoisonError::into_inner);
        *slot = Arc::new(next(&slot)?);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unclaimed() -> Tenancy {
        Tenancy {
            access_token: None,
            env: vec![("A".into(), "1".into())],
            envs_file: None,
            claimed: false,
        }
    }

    #[test]
    fn snapshots_survive_a_replacement() {
        let cell = TenancyCell::new(unclaimed());
        let before = cell.current();
        cell.replace(|t| {
            Ok::<_, ()>(Tenancy {
                access_token: Some(AccessToken::from_secret("new".into())),
                claimed: true,
                ..t.clone()
            })
        })
        .unwrap();
        assert!(!before.claimed && before.access_token.is_none());
        let after = cell.current();
        assert!(after.claimed);
        assert!(after.access_token.unwrap().matches(b"new"));
        assert_eq!(after.env, before.env);
    }

    #[test]
    fn a_failed_replacement_changes_nothing() {
        let cell = TenancyCell::new(unclaimed());
        assert_eq!(cell.replace(|_| Err("no")), Err("no"));
        assert!(!cell.current().claimed);
    }
}
