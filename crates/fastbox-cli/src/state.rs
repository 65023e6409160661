//! `fastbox state migrate|backup|restore`: the server's state store.
//!
//! - `migrate` copies a one-machine state (the redb file) into etcd, record by record, each
//!   written as a create: it refuses a target that already holds records, and a redb file a
//!   running server has open.
//! - `backup` writes a snapshot: of the whole etcd keyspace for an etcd state (what
//!   `etcdctl snapshot save` writes), or a copy of the redb file (refused while a server
//!   has it open).
//! - `restore` makes an etcd member's data directory of such a snapshot, through
//!   `etcdctl snapshot restore`; start etcd on it (each member of a cluster from the same
//!   snapshot, with its own `--name`).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use fastbox_server::config::{DEFAULT_DATA_DIR, Settings, StateConfig};
use fastbox_server::store::TABLES;
use fastbox_state::{EtcdBackend, RedbBackend, StateBackend, StateUrl};

use crate::up::StateArgs;

#[derive(clap::Subcommand, Debug)]
pub enum StateCommand {
    /// Copy a one-machine state (DATA_DIR/state.redb) into etcd; the target must hold no
    /// records yet, and no server may have the file open.
    Migrate(MigrateArgs),
    /// Write a snapshot of the state: etcd's whole keyspace, or a copy of the redb file.
    Backup(BackupArgs),
    /// Make an etcd member's data directory of a snapshot (runs `etcdctl snapshot restore`).
    Restore(RestoreArgs),
}

#[derive(clap::Args, Debug)]
pub struct MigrateArgs {
    /// The redb file [default: DATA_DIR/state.redb].
    #[arg(long, value_name = "FILE")]
    pub from: Option<PathBuf>,
    /// The data directory whose state.redb is copied [default: /var/lib/fastbox].
    #[arg(long, env = "FASTBOX_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// The etcd state to fill: `--state etcd://...`, its TLS options, and the id of the
    /// server that will run this state's node (`--server-id`, default the host name): the
    /// one-machine server's node, `local`, goes by it among servers sharing etcd.
    #[command(flatten)]
    pub to: StateArgs,
}

#[derive(clap::Args, Debug)]
pub struct BackupArgs {
    /// Where the snapshot goes (not overwritten if it exists).
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// The data directory (for the default redb state) [default: /var/lib/fastbox].
    #[arg(long, env = "FASTBOX_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    #[command(flatten)]
    pub state: StateArgs,
}

#[derive(clap::Args, Debug)]
pub struct RestoreArgs {
    /// A snapshot `fastbox state backup` (or `etcdctl snapshot save`) wrote.
    pub snapshot: PathBuf,
    /// The new member's data directory (must not exist).
    #[arg(long, value_name = "DIR")]
    pub etcd_data_dir: PathBuf,
    /// The member's name [default: default, as etcd's].
    #[arg(long)]
    pub name: Option<String>,
    /// The new cluster's members, `NAME=PEER_URL,...` [default: etcd's single member].
    #[arg(long)]
    pub initial_cluster: Option<String>,
    /// This member's peer URL.
    #[arg(long)]
    pub initial_advertise_peer_urls: Option<String>,
    /// A token for the new cluster.
    #[arg(long)]
    pub initial_cluster_token: Option<String>,
    /// The etcdctl binary [default: FASTBOX_ETCDCTL_BIN, else etcdctl on PATH].
    #[arg(long, env = "FASTBOX_ETCDCTL_BIN", value_name = "PATH")]
    pub etcdctl: Option<PathBuf>,
}

pub fn run(command: StateCommand) -> anyhow::Result<i32> {
    match command {
        StateCommand::Migrate(args) => migrate(args),
        StateCommand::Backup(args) => backup(args),
        StateCommand::Restore(args) => restore(args),
    }
}

fn data_dir(dir: &Option<PathBuf>) -> PathBuf {
    dir.clone()
        .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR))
}

/// The state `args` name.
fn state_config(args: &StateArgs, data_dir: &Path) -> anyhow::Result<StateConfig> {
    let settings = args.apply(Settings::default());
    Ok(StateConfig::resolve(&settings, data_dir)?)
}

/// Opens a redb state for reading, with a clear word when a server holds it.
fn open_redb(path: &Path) -> anyhow::Result<RedbBackend> {
    if !path.exists() {
        bail!("{}: no such state file", path.display());
    }
    RedbBackend::open(path).with_context(|| {
        format!(
            "{}: cannot open it (is a fastbox server running on it? stop it first)",
            path.display()
        )
    })
}

fn migrate(args: MigrateArgs) -> anyhow::Result<i32> {
    let from = args
        .from
        .clone()
        .unwrap_or_else(|| data_dir(&args.data_dir).join("state.redb"));
    if args.to.state.is_none() {
        bail!("--state etcd://HOST:PORT,... names the etcd to fill");
    }
    let target = state_config(&args.to, &data_dir(&args.data_dir))?;
    let StateUrl::Etcd(etcd) = &target.url else {
        bail!("--state must name etcd (etcd:// or etcds://)");
    };
    let source = open_redb(&from)?;
    let described = etcd.to_string();
    // Sealed as the servers will read it.
    let sink = target
        .open()
        .with_context(|| format!("connecting to {described}"))?;
    for table in TABLES {
        let there = sink.list(table)?.len();
        if there > 0 {
            bail!(
                "{described} already holds {there} {table} record(s): migrate into an empty \
                 prefix (etcd://.../PREFIX) or remove them first"
            );
        }
    }
    let mut total = 0;
    for table in TABLES {
        let entries = source.list(table)?;
        for entry in &entries {
            let value = renamed_node(&entry.value, &target.server_id);
            sink.put(table, &entry.key, &value, 0, None)
                .with_context(|| format!("writing {table}/{}", entry.key))?;
        }
        eprintln!("{table}: {} record(s) copied", entries.len());
        total += entries.len();
    }
    println!(
        "migrated {total} record(s) from {} to {described}",
        from.display()
    );
    Ok(0)
}

/// `value` (a record) with the one-machine server's node, `local`, renamed `server_id`
/// wherever a record names its node; anything else as it is.
fn renamed_node(value: &[u8], server_id: &str) -> Vec<u8> {
    let Ok(serde_json::Value::Object(mut record)) = serde_json::from_slice(value) else {
        return value.to_vec();
    };
    let local = serde_json::Value::String(LOCAL_NODE.into());
    let mut renamed = false;
    let mut rename = |slot: &mut serde_json::Value| {
        if *slot == local {
            *slot = serde_json::Value::String(server_id.into());
            renamed = true;
        }
    };
    if let Some(node) = record.get_mut("node") {
        rename(node);
    }
    if let Some(serde_json::Value::Array(moves)) = record.get_mut("moved_from") {
        for moved in moves {
            if let Some(node) = moved.get_mut("node") {
                rename(node);
            }
        }
    }
    if !renamed {
        return value.to_vec();
    }
    serde_json::to_vec(&record).expect("JSON")
}

/// The node of a one-machine server.
const LOCAL_NODE: &str = "local";

fn backup(args: BackupArgs) -> anyhow::Result<i32> {
    let state = state_config(&args.state, &data_dir(&args.data_dir))?;
    // Written next to the target and renamed into place: never a half snapshot under its
    // name.
    let partial = args.out.with_extension("partial");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&partial)
        .with_context(|| format!("creating {}", partial.display()))?;
    let written = (|| -> anyhow::Result<u64> {
        match &state.url {
            StateUrl::Etcd(etcd) => {
                let described = etcd.to_string();
                let backend = EtcdBackend::connect(etcd.clone(), state.options.clone())
                    .with_context(|| format!("connecting to {described}"))?;
                eprintln!("streaming a snapshot of {described} ...");
                Ok(backend.snapshot(&mut file)?)
            }
            StateUrl::Redb(path) => {
                // Held open while copied: no server can write it meanwhile.
                let _held = open_redb(path)?;
                let mut source = std::fs::File::open(path)?;
                Ok(std::io::copy(&mut source, &mut file)?)
            }
        }
    })()
    .and_then(|n| {
        file.sync_all()?;
        Ok(n)
    });
    let written = match written {
        Ok(n) => n,
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            return Err(e);
        }
    };
    if args.out.exists() {
        let _ = std::fs::remove_file(&partial);
        bail!("{} exists: not overwritten", args.out.display());
    }
    std::fs::rename(&partial, &args.out)?;
    println!("wrote {} ({written} bytes)", args.out.display());
    Ok(0)
}

fn restore(args: RestoreArgs) -> anyhow::Result<i32> {
    if args.etcd_data_dir.exists() {
        bail!(
            "{} exists: restore into a new directory",
            args.etcd_data_dir.display()
        );
    }
    if !args.snapshot.is_file() {
        bail!("{}: no such snapshot", args.snapshot.display());
    }
    let etcdctl = args.etcdctl.clone().unwrap_or_else(|| "etcdctl".into());
    let mut command = Command::new(&etcdctl);
    command
        .env("ETCDCTL_API", "3")
        .arg("snapshot")
        .arg("restore")
        .arg(&args.snapshot)
        .arg("--data-dir")
        .arg(&args.etcd_data_dir);
    for (flag, value) in [
        ("--name", &args.name),
        ("--initial-cluster", &args.initial_cluster),
        (
            "--initial-advertise-peer-urls",
            &args.initial_advertise_peer_urls,
        ),
        ("--initial-cluster-token", &args.initial_cluster_token),
    ] {
        if let Some(value) = value {
            command.arg(flag).arg(value);
        }
    }
    let output = command
        .output()
        .with_context(|| format!("running {} (set --etcdctl)", etcdctl.display()))?;
    if !output.status.success() {
        bail!(
            "etcdctl snapshot restore failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    println!(
        "restored {} into {}: start etcd with --data-dir {}",
        args.snapshot.display(),
        args.etcd_data_dir.display(),
        args.etcd_data_dir.display()
    );
    Ok(0)
}
