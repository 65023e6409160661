//! `fastbox route-key list|rotate|retire`: the keys that sign routes (OSEP-0011), in
//! `DATA_DIR/route-signing.key`.
//!
//! Rotation with an overlap: `rotate` adds a fresh key (32 bytes from getrandom) that signs
//! every route issued from then on, while the older keys keep verifying the routes they
//! signed; once those have expired (at most `route_max_lifetime` later, 24 h by default),
//! `retire` removes an old key and its routes stop working. A running `fastbox up` follows the
//! file within a second (`fastbox_proxy::RouteKeys`); no restart is needed. Secrets are never
//! printed.

use std::path::PathBuf;

use crate::up::ROUTE_KEY_FILE;
use anyhow::Context;
use fastbox_proxy::{RouteSigner, retire_key, rotate_key};
use fastbox_server::config::DEFAULT_DATA_DIR;

/// Where the keys are.
#[derive(clap::Args, Debug)]
pub struct KeyFileArgs {
    /// The instance's data directory (its keys are DATA_DIR/route-signing.key)
    /// [default: /var/lib/fastbox].
    #[arg(long, env = "FASTBOX_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// The key file itself (wins over --data-dir).
    #[arg(long)]
    pub key_file: Option<PathBuf>,
}

impl KeyFileArgs {
    fn path(&self) -> PathBuf {
        self.key_file.clone().unwrap_or_else(|| {
            self.data_dir
                .clone()
                .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR))
                .join(ROUTE_KEY_FILE)
        })
    }
}

#[derive(clap::Subcommand, Debug)]
pub enum RouteKeyCommand {
    /// List the key ids, oldest first, and which one signs.
    List(KeyFileArgs),
    /// Add a new key that signs new routes from now on; the others keep verifying.
    Rotate(KeyFileArgs),
    /// Remove an old key: the routes it signed stop working (never the signing key).
    Retire {
        /// The key id (one of 0-9a-z).
        key_id: char,
        #[command(flatten)]
        file: KeyFileArgs,
    },
}

pub fn run(command: RouteKeyCommand) -> anyhow::Result<i32> {
    match command {
        RouteKeyCommand::List(file) => {
            let path = file.path();
            let keys = RouteSigner::load(&path)
                .with_context(|| format!("route keys in {}", path.display()))?;
            print!("{}", describe(&keys));
        }
        RouteKeyCommand::Rotate(file) => {
            let path = file.path();
            let before = RouteSigner::load(&path).ok().map(|k| k.key_ids());
            let keys = rotate_key(&path).with_context(|| format!("rotate {}", path.display()))?;
            print!("{}", describe(&keys));
            let old: Vec<String> = before
                .unwrap_or_default()
                .iter()
                .map(char::to_string)
                .collect();
            println!(
                "key {} signs new routes (a running server takes it within a second)",
                keys.key_id()
            );
            if !old.is_empty() {
                println!(
                    "routes signed by {} keep working until retired: once they expired (at most route_max_lifetime after now), run `fastbox route-key retire ID`",
                    old.join(", ")
                );
            }
        }
        RouteKeyCommand::Retire { key_id, file } => {
            let path = file.path();
            let keys = retire_key(&path, key_id)
                .with_context(|| format!("retire key {key_id:?} of {}", path.display()))?;
            print!("{}", describe(&keys));
            println!("key {key_id} retired: the routes it signed are refused from now on");
        }
    }
    Ok(0)
}

/// One line per key, oldest first.
fn describe(keys: &RouteSigner) -> String {
    keys.key_ids()
        .iter()
        .map(|&id| {
            let role = if id == keys.key_id() {
                "signs and verifies"
            } else {
                "verifies"
            };
            format!("{id}\t{role}\n")
        })
        .collect()
}
