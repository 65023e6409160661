//! Entry point: flags, environment, process-level setup (OOM score, subreaper, signals), then
//! the HTTP listeners. Everything else lives in the library so tests can drive it.

use std::net::{Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::time::Duration;

use fastbox_execd::cli::{self, CliError};
use fastbox_execd::reaper::ReapScope;
use fastbox_execd::{AppState, Config, app, code_port, entrypoint, shutdown};
use tokio::signal::unix::{SignalKind, signal};

/// How long a SIGTERM waits for children and streams before execd exits anyway.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

fn main() -> ExitCode {
    let cli = match cli::parse(std::env::args_os().skip(1)) {
        Ok(c) => c,
        Err(CliError::Help) => {
            println!("{}", cli::USAGE);
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("fastbox-execd: {e}\n{}", cli::USAGE);
            return ExitCode::from(2);
        }
    };
    if cli.isolation {
        // This process holds the seccomp variant that can build namespaces: nothing in the
        // sandbox may trace it or read its memory (ptrace of a non-dumpable process needs
        // CAP_SYS_PTRACE, which sandboxes lack), and everything it starts gets the default
        // filter stacked.
        // SAFETY: prctl with integer arguments only.
        unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
        if let Err(e) = fastbox_execd::process::stack_default_filter() {
            eprintln!("fastbox-execd: --isolation: {e}");
            return ExitCode::FAILURE;
        }
    }
    let access_token = std::env::var("EXECD_ACCESS_TOKEN")
        .ok()
        .filter(|t| !t.is_empty());
    // The process's original environment block is what /proc/1/environ shows to anything in
    // the sandbox: blank the token there too (a clone of a checkpoint would otherwise carry
    // its template's token in readable memory).
    scrub_initial_env("EXECD_ACCESS_TOKEN");
    // SAFETY: no other thread exists yet (the tokio runtime is built below), so nothing can
    // read the environment concurrently. Children never see the token.
    unsafe { std::env::remove_var("EXECD_ACCESS_TOKEN") };
    let daemon_env: Vec<(String, String)> = std::env::vars().collect();

    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("EXECD_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();

    // The last process the OOM killer should pick. Lowering the score needs
    // CAP_SYS_RESOURCE; without it execd simply runs at the default.
    if let Err(e) = std::fs::write("/proc/self/oom_score_adj", "-1000") {
        tracing::debug!(error = %e, "cannot lower oom_score_adj");
    }
    let pid1 = std::process::id() == 1;
    if !pid1 {
        // Orphans of the commands we start come to us instead of an init that may not reap.
        // SAFETY: prctl with integer arguments only.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    }

    let mut config = Config::with_env(daemon_env);
    config.access_token = access_token.map(fastbox_execd::auth::AccessToken::from_secret);
    config.log_dir = cli.log_dir.clone();
    config.reap_scope = ReapScope::AnyChild;
    config.isolation = cli.isolation;

    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("fastbox-execd: cannot start runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(cli, config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "execd failed");
            ExitCode::FAILURE
        }
    }
}

async fn serve(cli: cli::Cli, config: Config) -> std::io::Result<()> {
    let state = AppState::new(config)?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let stopped = async {
        let _ = stop_rx.await;
    };
    let server = match cli.listen_fd {
        Some(fd) => {
            // SAFETY: the session's builder passed this listening socket as descriptor `fd`
            // and nothing else in this process owns it.
            let std_listener = unsafe {
                <std::os::unix::net::UnixListener as std::os::fd::FromRawFd>::from_raw_fd(fd)
            };
            std_listener.set_nonblocking(true)?;
            let listener = tokio::net::UnixListener::from_std(std_listener)?;
            tracing::info!(
                fd,
                pid = std::process::id(),
                "execd listening (isolated session)"
            );
            let server = axum::serve(listener, app(state.clone())).with_graceful_shutdown(stopped);
            tokio::spawn(async move { server.await })
        }
        None => {
            // Warm interpreters first: execd answers once they are up, so a template's
            // golden checkpoint, taken when it answers, holds them warm.
            state.code.spares.start(&state).await;
            let listener =
                tokio::net::TcpListener::bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, cli.port)))
                    .await?;
            tracing::info!(port = cli.port, pid = std::process::id(), "execd listening");
            if cli.code_port != 0 {
                let probed = state.clone();
                code_port::spawn(cli.code_port, move || probed.code.spares.wanted(&probed)).await;
            }
            if !cli.entrypoint.is_empty() {
                entrypoint::start(&state, cli.entrypoint.clone());
            }
            let server = axum::serve(listener, app(state.clone())).with_graceful_shutdown(stopped);
            tokio::spawn(async move { server.await })
        }
    };
    tokio::select! {
        _ = sigterm.recv() => tracing::info!("SIGTERM, shutting down"),
        _ = sigint.recv() => tracing::info!("SIGINT, shutting down"),
    }
    let _ = stop_tx.send(());
    shutdown::terminate_children(&state, SHUTDOWN_GRACE).await;
    let _ = tokio::time::timeout(Duration::from_secs(1), server).await;
    Ok(())
}

/// Overwrites the value of `key` in the environment block the kernel gave this process (the
/// strings `/proc/self/environ` reads), with `*`s of the same length.
fn scrub_initial_env(key: &str) {
    let prefix = format!("{key}=");
    // SAFETY: `environ` is the C library's NULL-terminated array of pointers to NUL-terminated
    // strings; no other thread exists yet, so nothing reads or changes it concurrently. Only
    // bytes before each string's NUL are written, and only in strings that start with the
    // prefix, so every string keeps its length and terminator.
    unsafe {
        let mut entry = libc_environ();
        while !entry.is_null() && !(*entry).is_null() {
            let bytes = std::ffi::CStr::from_ptr(*entry).to_bytes();
            if bytes.starts_with(prefix.as_bytes()) {
                let value = (*entry).add(prefix.len()).cast::<u8>();
                std::ptr::write_bytes(value, b'*', bytes.len() - prefix.len());
            }
            entry = entry.add(1);
        }
    }
}

/// The C library's `environ`.
fn libc_environ() -> *mut *mut std::ffi::c_char {
    unsafe extern "C" {
        static mut environ: *mut *mut std::ffi::c_char;
    }
    // SAFETY: reading the pointer value of a C global that always exists.
    unsafe { environ }
}
