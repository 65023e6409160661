//! Configuration and the state every handler shares.

use std::collections::HashMap;
use std::ops::Deref;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use crate::auth::AccessToken;
use crate::code::CodeStore;
use crate::command::store::CommandStore;
use crate::entrypoint::Entrypoint;
use crate::env::{self, EnvError, EnvList};
use crate::identity::{Accounts, Credentials};
use crate::isolated::IsolatedStore;
use crate::metrics::MetricsSource;
use crate::pty::PtyStore;
use crate::reaper::{ReapScope, Reaper};
use crate::session::SessionStore;
use crate::tenancy::{Tenancy, TenancyCell};

/// Everything execd is told at start-up. Built by `main` from flags and the environment;
/// the library itself never reads the environment. The token, environment and env file are
/// only the initial [`Tenancy`]: a claim replaces them (`AppState::tenancy`).
#[derive(Debug, Clone)]
pub struct Config {
    /// Required in `X-EXECD-ACCESS-TOKEN` on every request when set.
    pub access_token: Option<AccessToken>,
    /// The environment children inherit (execd's own, without the access token).
    pub daemon_env: EnvList,
    /// The `EXECD_ENVS` file, re-read at every spawn.
    pub envs_file: Option<PathBuf>,
    /// `--log-dir`: where the entrypoint's output is also written.
    pub log_dir: Option<PathBuf>,
    pub reap_scope: ReapScope,
    /// `--isolation`: `/v1/isolated` builds sessions ([`crate::isolated`]).
    pub isolation: bool,
    /// The sandbox's root as execd writes system files under it (a claim's trusted CA): `/`;
    /// tests point it elsewhere.
    pub system_root: PathBuf,
}

impl Config {
    /// A configuration for tests and embedding: the given environment, no token.
    pub fn with_env(daemon_env: EnvList) -> Self {
        let envs_file = env::get(&daemon_env, "EXECD_ENVS").map(PathBuf::from);
        Config {
            access_token: None,
            daemon_env,
            envs_file,
            log_dir: None,
            reap_scope: ReapScope::Registered,
            isolation: false,
            system_root: PathBuf::from("/"),
        }
    }

    fn initial_tenancy(&self) -> Tenancy {
        Tenancy {
            access_token: self.access_token,
            env: self.daemon_env.clone(),
            envs_file: self.envs_file.clone(),
            claimed: false,
        }
    }
}

/// The environment, working directory and identity of a child about to be spawned.
pub struct ChildContext {
    pub env: EnvList,
    pub cwd: Option<String>,
    pub user: Option<Credentials>,
}

#[derive(Clone)]
pub struct AppState(Arc<Shared>);

pub struct Shared {
    pub config: Config,
    /// The current token, environment and env file: the config's until a claim.
    pub tenancy: TenancyCell,
    pub reaper: Reaper,
    pub commands: CommandStore,
    pub entrypoint: OnceLock<Arc<Entrypoint>>,
    pub sessions: SessionStore,
    pub metrics: MetricsSource,
    pub code: CodeStore,
    pub ptys: PtyStore,
    pub isolated: IsolatedStore,
}

impl Deref for AppState {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.0
    }
}

impl AppState {
    /// Starts the reaper; must be called inside a tokio runtime.
    pub fn new(config: Config) -> std::io::Result<Self> {
        let reaper = Reaper::start(config.reap_scope)?;
        Ok(AppState(Arc::new(Shared {
            tenancy: TenancyCell::new(config.initial_tenancy()),
            config,
            reaper,
            commands: CommandStore::default(),
            entrypoint: OnceLock::new(),
            sessions: SessionStore::default(),
            metrics: MetricsSource::default(),
            code: CodeStore::default(),
            ptys: PtyStore::default(),
            isolated: IsolatedStore::default(),
        })))
    }

    /// The home directory `~` expands to: the current base environment's `HOME`, else `/`.
    pub fn home(&self) -> String {
        home_in(&self.tenancy.current().env)
    }

    /// Builds a child's context: daemon env < claim envs < `EXECD_ENVS` file < `overrides`;
    /// the user's `HOME`/`USER`/`LOGNAME` when switching identity; `cwd` expanded against the
    /// result.
    pub fn child_context(
        &self,
        overrides: &HashMap<String, String>,
        cwd: Option<&str>,
        uid: Option<u32>,
        gid: Option<u32>,
    ) -> Result<ChildContext, EnvError> {
        let tenancy = self.tenancy.current();
        let mut env = tenancy.env.clone();
        if let Some(file) = &tenancy.envs_file {
            let from_file = env::load_env_file(file, &env);
            env::overlay(&mut env, from_file.iter().map(|(k, v)| (k, v)));
        }
        let user = uid.map(|uid| {
            let accounts = Accounts::system();
            if let Some(u) = accounts.user_by_uid(uid) {
                env::set(&mut env, "HOME", &u.home);
                env::set(&mut env, "USER", &u.name);
                env::set(&mut env, "LOGNAME", &u.name);
            }
            accounts.credentials(uid, gid)
        });
        env::overlay(&mut env, overrides);
        if env::get(&env, "PATH").is_none() {
            env::set(&mut env, "PATH", crate::process::DEFAULT_PATH);
        }
        let cwd = match cwd.filter(|c| !c.is_empty()) {
            None => None,
            Some(raw) => Some(env::expand_path(raw, &env, &home_in(&tenancy.env))?),
        };
        Ok(ChildContext { env, cwd, user })
    }
}

fn home_in(base: &EnvList) -> String {
    env::get(base, "HOME").unwrap_or("/").to_string()
}
