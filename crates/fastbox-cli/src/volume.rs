//! `fastbox volume list|rm`: a node's named volumes (a create's `pvc` volumes), on the host
//! that keeps them. They live in the node's data directory; this reads and changes it
//! directly, running node or not.

use std::path::PathBuf;

use clap::{Args, Subcommand};
use fastbox_fastlet::named_volumes::NamedVolumes;

#[derive(Subcommand)]
pub enum VolumeCommand {
    /// The named volumes of this host's node: name, quota, bytes used, the sandboxes that
    /// mount them.
    #[command(alias = "ls")]
    List(VolumeArgs),
    /// Delete a named volume and its contents (refused while a sandbox mounts it).
    Rm {
        /// The volume's name (the `claimName` creates give).
        name: String,
        #[command(flatten)]
        args: VolumeArgs,
    },
}

#[derive(Args)]
pub struct VolumeArgs {
    /// The node's data directory [default: /var/lib/fastbox].
    #[arg(long, env = "FASTBOX_DATA_DIR", default_value = "/var/lib/fastbox")]
    pub data_dir: PathBuf,
}

pub fn run(command: VolumeCommand) -> anyhow::Result<i32> {
    crate::paths::require_root()?;
    match command {
        VolumeCommand::List(args) => {
            let volumes = NamedVolumes::new(&args.data_dir).list();
            println!("{:<32} {:>10} {:>10}  SANDBOXES", "NAME", "SIZE", "USED");
            for v in volumes {
                println!(
                    "{:<32} {:>10} {:>10}  {}",
                    v.name,
                    mib(v.size_bytes),
                    v.used_bytes.map_or_else(|| "-".to_string(), mib),
                    if v.users.is_empty() {
                        "-".to_string()
                    } else {
                        v.users.join(",")
                    }
                );
            }
            Ok(0)
        }
        VolumeCommand::Rm { name, args } => {
            NamedVolumes::new(&args.data_dir).delete(&name)?;
            println!("deleted named volume {name}");
            Ok(0)
        }
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1}Mi", bytes as f64 / (1 << 20) as f64)
}
