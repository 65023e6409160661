//! `fastbox sandbox exec ID -- CMD ARGS...`: resolves the sandbox's execd endpoint, runs the
//! command there, streams its stdout and stderr as the events arrive and exits with its exit
//! code. Ctrl-C interrupts the command in the sandbox (a second Ctrl-C leaves at once).

use std::io::Write;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use fastbox_runtime::spec::EXECD_PORT;

use super::args::parse_key_value;
use super::connection::ServerArgs;
use super::execd::{CommandOutcome, CommandRequest, Event, ExecdClient};
use super::quote::shell_join;

/// The exit status when the command could not be started at all (as `docker exec`).
pub const NOT_STARTED_EXIT: i32 = 126;

/// The exit status after a second Ctrl-C.
const INTERRUPTED_EXIT: i32 = 130;

#[derive(clap::Args, Debug)]
pub struct ExecArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    /// The sandbox id.
    pub id: String,
    /// Working directory of the command.
    #[arg(long, value_name = "DIR")]
    pub cwd: Option<String>,
    /// Environment variable of the command, `KEY=VALUE` (repeatable).
    #[arg(long = "env", short = 'e', value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub env: Vec<(String, String)>,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

pub fn exec(args: ExecArgs) -> anyhow::Result<i32> {
    let api = args.server.client()?;
    let endpoint = api.endpoint(&args.id, EXECD_PORT)?;
    let execd = ExecdClient::try_new(api.scheme(), &endpoint)?;
    let request = CommandRequest {
        command: shell_join(&args.command),
        cwd: args.cwd,
        envs: args.env.into_iter().collect(),
    };
    let running = Arc::new(Mutex::new(None::<String>));
    interrupt_on_ctrl_c(execd.clone(), running.clone())?;
    let outcome = execd.run(&request, |event| {
        if event.kind == "init" {
            *running.lock().expect("command id lock") = event.text.clone();
        }
        print_output(event);
    })?;
    match outcome {
        CommandOutcome::Exited(code) => Ok(code),
        CommandOutcome::NotStarted(reason) => {
            eprintln!("fastbox: the command did not start: {reason}");
            Ok(NOT_STARTED_EXIT)
        }
    }
}

/// Writes a `stdout`/`stderr` event where it belongs. Events carry one line each without its
/// terminator (a blank line is `"\n"`), so the newline is put back.
fn print_output(event: &Event) {
    let text = event.text.as_deref().unwrap_or_default();
    let line = if text == "\n" { "" } else { text };
    // A closed stdout or stderr (`| head`) must not stop the command's stream.
    let _ = match event.kind.as_str() {
        "stdout" => write_line(&mut std::io::stdout().lock(), line),
        "stderr" => write_line(&mut std::io::stderr().lock(), line),
        _ => Ok(()),
    };
}

fn write_line(out: &mut impl Write, line: &str) -> std::io::Result<()> {
    out.write_all(line.as_bytes())?;
    out.write_all(b"\n")?;
    out.flush()
}

/// The first Ctrl-C asks execd to stop the running command (its outcome then arrives on the
/// stream as usual); another one, or one before the command started, leaves at once.
fn interrupt_on_ctrl_c(
    execd: ExecdClient,
    running: Arc<Mutex<Option<String>>>,
) -> anyhow::Result<()> {
    let mut interrupted = false;
    ctrlc::set_handler(move || {
        let id = running.lock().map(|id| id.clone()).unwrap_or_default();
        match id {
            Some(id) if !interrupted => {
                interrupted = true;
                if let Err(e) = execd.interrupt(&id) {
                    eprintln!("fastbox: {:#}", anyhow::Error::from(e));
                    std::process::exit(INTERRUPTED_EXIT);
                }
            }
            _ => std::process::exit(INTERRUPTED_EXIT),
        }
    })
    .context("install the Ctrl-C handler")
}
