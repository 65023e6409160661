//! Warm interpreters: a spare python and javascript driver, handed to the next context of
//! their language, which then starts in milliseconds instead of an interpreter's start-up.
//!
//! The languages kept warm are named by [`WARM_ENV`] in execd's environment (the
//! code-interpreter template sets it). What a clone may share decides when a spare starts:
//!
//! - **python** starts with execd, so a template's golden checkpoint holds it running. Its
//!   random state is drawn again when a context takes it (`random`, `numpy.random`,
//!   `tempfile`'s names); its `hash()` seed stays the checkpoint's (documented in
//!   `docs/clones.md`).
//! - **javascript** starts on the first sign the code interpreter is wanted (the SDK's probe
//!   of the code-interpreter port, or any new context), never before a checkpoint of execd's
//!   making: Node seeds OpenSSL's random generator and `Math.random` at start-up, and neither
//!   can be re-seeded from inside, so a checkpointed one would hand every clone the same keys
//!   and nonces. A claim or a rekey kills one a snapshot carried. A context taken while it
//!   still starts waits for it (less than a cold start).
//!
//! A spare adopts the context's environment and directory when it is taken; one started with
//! other values of what its interpreter reads only at start-up (`NODE_EXTRA_CA_CERTS` after a
//! claim that brought the credential proxy's CA, for instance) is not used, and the context
//! starts cold. A new spare is started in its place.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use super::driver::{self, Driver};
use crate::env::{self, EnvList};
use crate::repl::Repl;
use crate::state::AppState;

/// The variable naming the languages kept warm: `python,javascript`.
pub const WARM_ENV: &str = "FASTBOX_WARM_CODE";

/// What an interpreter reads only when it starts.
fn startup_vars(driver: Driver) -> &'static [&'static str] {
    const LOCALE: [&str; 4] = ["LANG", "LC_ALL", "LC_CTYPE", "TZ"];
    match driver {
        Driver::JavaScript | Driver::TypeScript => &[
            "NODE_EXTRA_CA_CERTS",
            "NODE_OPTIONS",
            "NODE_PATH",
            "NODE_USE_ENV_PROXY",
            "NODE_DEBUG",
            LOCALE[0],
            LOCALE[1],
            LOCALE[2],
            LOCALE[3],
        ],
        _ => &[
            "PYTHONPATH",
            "PYTHONHOME",
            "PYTHONSTARTUP",
            "PYTHONIOENCODING",
            "PYTHONUTF8",
            "PYTHONSAFEPATH",
            "PYTHONHASHSEED",
            "PYTHONNOUSERSITE",
            "PYTHONUSERBASE",
            "PYTHONWARNINGS",
            "PYTHONDONTWRITEBYTECODE",
            "HOME",
            LOCALE[0],
            LOCALE[1],
            LOCALE[2],
            LOCALE[3],
        ],
    }
}

/// Whether `a` and `b` agree on what `driver`'s interpreter reads at start-up.
fn same_startup(driver: Driver, a: &EnvList, b: &EnvList) -> bool {
    startup_vars(driver)
        .iter()
        .all(|k| env::get(a, k) == env::get(b, k))
}

/// The drivers `value` (of [`WARM_ENV`]) names; unknown names are ignored.
fn parse_warm(value: &str) -> Vec<Driver> {
    value
        .split(',')
        .filter_map(|name| match name.trim() {
            "python" => Some(Driver::Python),
            "javascript" | "js" | "node" => Some(Driver::JavaScript),
            _ => None,
        })
        .collect()
}

struct Spare {
    repl: Repl,
    /// The environment it started with.
    env: EnvList,
}

/// Whether `driver`'s random state can be drawn again in a running interpreter (so a spare of
/// it may be in a checkpoint).
fn reseedable(driver: Driver) -> bool {
    driver == Driver::Python
}

#[derive(Default)]
pub struct Spares {
    warm: OnceLock<Vec<Driver>>,
    slots: Mutex<HashMap<Driver, Spare>>,
}

impl Spares {
    /// At execd's start: the spares a checkpoint may hold, each waited for until it answers.
    pub async fn start(&self, state: &AppState) {
        let named = env::get(&state.tenancy.current().env, WARM_ENV)
            .map(parse_warm)
            .unwrap_or_default();
        let warm = self.warm.get_or_init(|| named);
        for &driver in warm.iter().filter(|d| reseedable(**d)) {
            self.refill(state, driver).await;
        }
    }

    /// After a claim or a rekey (a new owner): the spares a snapshot may have carried whose
    /// random state cannot be drawn again are killed ([`Spares::wanted`] starts new ones).
    pub fn renew(&self) {
        let Some(warm) = self.warm.get() else {
            return;
        };
        for driver in warm.iter().filter(|d| !reseedable(**d)) {
            if let Some(old) = self.lock().remove(driver) {
                old.repl.kill();
            }
        }
    }

    /// The code interpreter is wanted: starts the spares that start late and are not there.
    pub fn wanted(&self, state: &AppState) {
        let Some(warm) = self.warm.get() else {
            return;
        };
        for &driver in warm.iter().filter(|d| !reseedable(**d)) {
            self.start_late(state, driver);
        }
    }

    /// Starts a spare of late-starting `driver` unless one is there (checked and kept under
    /// one lock: concurrent callers start one); whoever takes it waits for it to answer.
    fn start_late(&self, state: &AppState, driver: Driver) {
        let Ok(ctx) = driver::context(state, None) else {
            return;
        };
        let mut slots = self.lock();
        if slots.contains_key(&driver) {
            return;
        }
        let env = ctx.env.clone();
        match driver::spawn(state, driver, ctx) {
            Ok(repl) => {
                slots.insert(driver, Spare { repl, env });
            }
            Err(e) => tracing::warn!(driver = driver.name(), error = %e, "no warm interpreter"),
        }
    }

    /// Starts a spare of `driver` with the current environment, kept once it answers.
    async fn refill(&self, state: &AppState, driver: Driver) {
        let Ok(ctx) = driver::context(state, None) else {
            return;
        };
        let env = ctx.env.clone();
        let repl = match driver::spawn(state, driver, ctx) {
            Ok(repl) => repl,
            Err(e) => {
                tracing::warn!(driver = driver.name(), error = %e, "no warm interpreter");
                return;
            }
        };
        if !driver::adopt(&repl, &env, None).await {
            repl.kill();
            return;
        }
        let old = self.lock().insert(driver, Spare { repl, env });
        if let Some(old) = old {
            old.repl.kill();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Driver, Spare>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A warm interpreter for a new context of `driver` with environment `env` in `cwd`,
    /// when there is a fit one; a new spare is started in its place either way.
    pub async fn take(
        &self,
        state: &AppState,
        driver: Driver,
        env: &EnvList,
        cwd: Option<&str>,
    ) -> Option<Repl> {
        if !self.warm.get().is_some_and(|w| w.contains(&driver)) {
            return None;
        }
        let spare = self.lock().remove(&driver)?;
        match reseedable(driver) {
            true => {
                let again = state.clone();
                tokio::spawn(async move { again.code.spares.refill(&again, driver).await });
            }
            false => self.start_late(state, driver),
        }
        if !spare.repl.is_alive() {
            // Already reaped: its process group may be someone else's now.
            return None;
        }
        if !same_startup(driver, &spare.env, env) {
            spare.repl.kill();
            return None;
        }
        if !driver::adopt(&spare.repl, env, cwd).await {
            spare.repl.kill();
            return None;
        }
        Some(spare.repl)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warm_languages_and_startup_variables() {
        assert_eq!(
            parse_warm("python, javascript,ruby"),
            vec![Driver::Python, Driver::JavaScript]
        );
        let a: EnvList = vec![("NODE_EXTRA_CA_CERTS".into(), "/a".into())];
        let b: EnvList = vec![("NODE_EXTRA_CA_CERTS".into(), "/b".into())];
        assert!(!same_startup(Driver::JavaScript, &a, &b));
        assert!(same_startup(Driver::Python, &a, &b));
        let mut c = a.clone();
        c.push(("FOO".into(), "x".into()));
        assert!(same_startup(Driver::JavaScript, &a, &c));
    }
}
