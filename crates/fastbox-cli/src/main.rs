//! The `fastbox` binary: client commands today, the server roles as they land. It is also the
//! sandbox starter: re-executed with the helper argument, it becomes the single-threaded
//! process that builds a sandbox's namespaces (see `fastbox_runtime::init`).

use clap::{Parser, Subcommand};
use fastbox_cli::{
    artifacts, bench, bench_create, bench_memory, bench_snapshot, client, node, paths, route_key,
    sandbox_run, up,
};

mod bench_restore;

#[derive(Parser)]
#[command(name = "fastbox", version, about = "Restore-only Linux sandboxes")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the whole service on this machine: lifecycle API, node agent, proxies.
    Up(Box<up::UpArgs>),
    /// Run a node agent alone (sandboxes, node API, node proxy) for a `fastbox up
    /// --remote-node` server elsewhere.
    Node(Box<node::NodeArgs>),
    /// The self-fencing guard of `fastbox node` (started by it, driven over stdin).
    #[command(hide = true)]
    NodeFenceGuard(node::fence_guard::FenceGuardArgs),
    /// Remove everything a stopped instance left on the host (sandboxes, network, cgroups).
    Purge(up::PurgeArgs),
    /// List host-wide state carrying a prefix (exit status 1 if any): a leak check.
    Leftovers(up::LeftoversArgs),
    /// Sandboxes: through a fastbox server (create, ls, exec, ...) or, with `run`, directly
    /// on this machine.
    Sandbox {
        #[command(subcommand)]
        command: SandboxCommand,
    },
    /// Benchmarks, reported as percentiles from one run.
    Bench {
        #[command(subcommand)]
        command: BenchCommand,
    },
    /// Check that this machine can run fastbox (root, CRIU >= 4.2, cgroups, execd).
    Check(paths::HostArgs),
    /// End-to-end scenarios that prove a property by themselves.
    Verify {
        #[command(subcommand)]
        command: VerifyCommand,
    },
    /// The artifact store: templates, snapshots and checkpoints as blocks and manifests.
    Artifacts {
        #[command(subcommand)]
        command: ArtifactsCommand,
    },
    /// The keys that sign routes (OSEP-0011): list, rotate, retire.
    RouteKey {
        #[command(subcommand)]
        command: route_key::RouteKeyCommand,
    },
    /// The server's state store: migrate a one-machine state into etcd, back up, restore.
    State {
        #[command(subcommand)]
        command: fastbox_cli::state::StateCommand,
    },
    /// Named volumes (creates' `pvc` volumes) kept by this host's node: list, rm.
    Volume {
        #[command(subcommand)]
        command: fastbox_cli::volume::VolumeCommand,
    },
}

#[derive(Subcommand)]
enum ArtifactsCommand {
    /// Delete the blocks and manifests no index entry reaches, older than the grace period;
    /// prints what was kept, spared and deleted.
    Gc(artifacts::GcArgs),
}

#[derive(Subcommand)]
enum VerifyCommand {
    /// DART on one machine: several fastlets, each in its own network namespace, restore one
    /// template cold through peers and an S3 origin; prints blocks, origin and peer fetches,
    /// cache hits, seconds and bytes verified.
    P2p(fastbox_cli::verify_p2p::P2pArgs),
    /// Several nodes behind one server on one machine: creates on one node and on the
    /// cluster (p50/p99, each node's share), a node killed (lease, fencing, NODE_LOST) and
    /// back; prints a report (`--json` too) and leaves nothing behind.
    Cluster(fastbox_cli::verify_cluster::ClusterArgs),
    /// One node of `verify p2p` (started by it, driven over stdin/stdout).
    #[command(hide = true)]
    P2pNode(fastbox_cli::verify_p2p::NodeArgs),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Cold start (no checkpoint) -> execd /ping, next to `runc run` of the same rootfs.
    ColdStart(bench::ColdStartArgs),
    /// Create -> execd /ping 200 through the lifecycle API of a running server, N creates at
    /// a concurrency, with each sandbox deleted outside the timed region.
    Create(bench_create::CreateBenchArgs),
    /// Node-side restore of an image's golden checkpoint, next to `runc restore` of clones
    /// of a checkpoint of the same workload, with CRIU's own restore statistics.
    Restore(bench_restore::RestoreBenchArgs),
    /// Memory of the idle pooled sandboxes of a running instance (private, PSS, RSS).
    PoolMemory(bench_memory::PoolMemoryArgs),
    /// Live snapshots, pause/resume, creates from a snapshot and forks of a sandbox holding
    /// M MiB, through a running server, next to runc checkpoint/restore of the same workload.
    Snapshot(bench_snapshot::SnapshotBenchArgs),
    /// Restores of a checkpoint of a sandbox holding M MiB from artifact blocks with a
    /// simulated per-block latency: pulled whole first, next to lazy restores whose memory
    /// arrives while the sandbox runs.
    Lazy(fastbox_cli::bench_lazy::LazyBenchArgs),
    /// The memory holder of `bench lazy` (run inside its sandbox).
    #[command(hide = true)]
    LazyHolder(fastbox_cli::bench_lazy::HolderArgs),
}

#[derive(Subcommand)]
enum SandboxCommand {
    /// Start a sandbox from an image, run a command in it through execd, remove it.
    Run(sandbox_run::RunArgs),
    /// Create a sandbox on the server and wait until it is ready; prints its id.
    Create(client::CreateArgs),
    /// List the server's sandboxes, newest first.
    Ls(client::LsArgs),
    /// Show one sandbox.
    Get(client::GetArgs),
    /// Run a command in a sandbox, streaming its output; exits with its exit code.
    Exec(client::ExecArgs),
    /// Copy a file into or out of a sandbox (`ID:/absolute/path`; `-` is stdin/stdout).
    Cp(client::CpArgs),
    /// Print a file of a sandbox.
    Cat(client::CatArgs),
    /// Print a sandbox's entrypoint output (or, with --events, its lifecycle events).
    Logs(client::LogsArgs),
    /// Delete sandboxes; prints the ids deleted.
    Kill(client::KillArgs),
}

fn sandbox(command: SandboxCommand) -> anyhow::Result<i32> {
    match command {
        SandboxCommand::Run(args) => sandbox_run::run(args),
        SandboxCommand::Create(args) => client::create(args),
        SandboxCommand::Ls(args) => client::ls(args),
        SandboxCommand::Get(args) => client::get(args),
        SandboxCommand::Exec(args) => client::exec(args),
        SandboxCommand::Cp(args) => client::cp(args),
        SandboxCommand::Cat(args) => client::cat(args),
        SandboxCommand::Logs(args) => client::logs(args),
        SandboxCommand::Kill(args) => client::kill(args),
    }
}

fn main() {
    if std::env::args().nth(1).as_deref() == Some(fastbox_runtime::init::HELPER_ARG) {
        fastbox_runtime::init::helper_main();
    }
    if std::env::args().nth(1).as_deref() == Some(fastbox_runtime::criu::LAUNCHER_ARG) {
        fastbox_runtime::criu::launcher_main();
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FASTBOX_LOG")
                .unwrap_or_else(|_| "warn,fastbox_server=info,fastbox_fastlet=info".into()),
        )
        .with_writer(std::io::stderr)
        // A line that cannot be written is dropped, not a panic: the node's fence guard
        // outlives the terminal or pipe its stderr was.
        .log_internal_errors(false)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Sandbox { command } => sandbox(command),
        Command::Bench {
            command: BenchCommand::ColdStart(args),
        } => bench::cold_start(args),
        Command::Bench {
            command: BenchCommand::Create(args),
        } => bench_create::create(args),
        Command::Bench {
            command: BenchCommand::Restore(args),
        } => bench_restore::restore(args),
        Command::Bench {
            command: BenchCommand::PoolMemory(args),
        } => bench_memory::pool_memory(args),
        Command::Bench {
            command: BenchCommand::Snapshot(args),
        } => bench_snapshot::snapshot(args),
        Command::Bench {
            command: BenchCommand::Lazy(args),
        } => fastbox_cli::bench_lazy::lazy(args),
        Command::Bench {
            command: BenchCommand::LazyHolder(args),
        } => fastbox_cli::bench_lazy::holder_main(args),
        Command::Check(args) => paths::check(&args),
        Command::Verify {
            command: VerifyCommand::P2p(args),
        } => fastbox_cli::verify_p2p::run(args),
        Command::Verify {
            command: VerifyCommand::P2pNode(args),
        } => fastbox_cli::verify_p2p::run_node(args),
        Command::Verify {
            command: VerifyCommand::Cluster(args),
        } => fastbox_cli::verify_cluster::run(args),
        Command::Artifacts {
            command: ArtifactsCommand::Gc(args),
        } => artifacts::gc(args),
        Command::RouteKey { command } => route_key::run(command),
        Command::State { command } => fastbox_cli::state::run(command),
        Command::Up(args) => up::up(*args),
        Command::Node(args) => node::node(*args),
        Command::NodeFenceGuard(args) => node::fence_guard::run(args).map_err(Into::into),
        Command::Purge(args) => up::purge(args),
        Command::Volume { command } => fastbox_cli::volume::run(command),
        Command::Leftovers(args) => up::leftovers(args),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("fastbox: {e:#}");
            std::process::exit(1);
        }
    }
}
