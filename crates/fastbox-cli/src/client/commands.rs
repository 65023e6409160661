//! The lifecycle verbs of `fastbox sandbox`: create, ls, get, logs, kill. Each builds a client
//! from its [`ServerArgs`], makes its calls and prints for a terminal (or JSON with `--json`).

use std::io::Write;
use std::time::Duration;

use anyhow::Context;
use fastbox_api::lifecycle::ImageSpec;

use super::api::{CreateRequest, Diagnostics, ListQuery};
use super::args::parse_key_value;
use super::connection::ServerArgs;
use super::render;
use super::wait;

/// The entrypoint of a sandbox created without one: keep it alive doing nothing.
const DEFAULT_ENTRYPOINT: [&str; 3] = ["tail", "-f", "/dev/null"];

/// `pageSize` of `ls --page` without `--page-size`, as the API's default.
const DEFAULT_PAGE_SIZE: u32 = 20;

#[derive(clap::Args, Debug)]
pub struct CreateArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    /// Image reference, e.g. `python:3.12` or `fastbox/busybox`.
    pub image: String,
    /// One argument of the entrypoint; repeat it for each [default: tail -f /dev/null].
    #[arg(long = "entrypoint", value_name = "ARG", allow_hyphen_values = true)]
    pub entrypoint: Vec<String>,
    /// Environment variable of the sandbox, `KEY=VALUE` (repeatable).
    #[arg(long = "env", short = 'e', value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub env: Vec<(String, String)>,
    /// Metadata label, `KEY=VALUE` (repeatable).
    #[arg(long = "metadata", short = 'm', value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub metadata: Vec<(String, String)>,
    /// Seconds until the sandbox expires and is removed; 0: never.
    #[arg(long, value_name = "SECS", default_value_t = 600)]
    pub timeout: u64,
    /// CPU limit, e.g. `500m` or `2`.
    #[arg(long, value_name = "Q")]
    pub cpu: Option<String>,
    /// Memory limit, e.g. `512Mi`.
    #[arg(long, value_name = "Q")]
    pub memory: Option<String>,
    /// Size of the writable layer, e.g. `1Gi`.
    #[arg(long, value_name = "Q")]
    pub disk: Option<String>,
    /// Print the create response as JSON instead of the id.
    #[arg(long)]
    pub json: bool,
    /// Wait up to SECS for the sandbox to be ready (its execd answers); 0: do not wait.
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    pub wait: u64,
}

impl CreateArgs {
    fn request(&self) -> CreateRequest {
        let entrypoint = if self.entrypoint.is_empty() {
            DEFAULT_ENTRYPOINT.map(str::to_string).to_vec()
        } else {
            self.entrypoint.clone()
        };
        let limits = [
            ("cpu", &self.cpu),
            ("memory", &self.memory),
            ("disk", &self.disk),
        ];
        CreateRequest {
            image: ImageSpec {
                uri: self.image.clone(),
                auth: None,
            },
            entrypoint,
            timeout: (self.timeout > 0).then_some(self.timeout),
            resource_limits: limits
                .into_iter()
                .filter_map(|(k, v)| Some((k.to_string(), v.clone()?)))
                .collect(),
            env: self.env.iter().cloned().collect(),
            metadata: self.metadata.iter().cloned().collect(),
        }
    }
}

/// `fastbox sandbox create`: prints the id once the sandbox is ready (unless `--wait 0`).
pub fn create(args: CreateArgs) -> anyhow::Result<i32> {
    let api = args.server.client()?;
    let created = api.create(&args.request())?;
    if args.wait > 0 {
        wait::until_ready(&api, &created.id, Duration::from_secs(args.wait)).with_context(
            || {
                format!(
                    "sandbox {id} is not ready after {secs}s; it is left for inspection \
                     (`fastbox sandbox logs {id}`, `fastbox sandbox kill {id}`)",
                    id = created.id,
                    secs = args.wait
                )
            },
        )?;
    }
    if args.json {
        print_json(&created)?;
    } else {
        println!("{}", created.id);
    }
    Ok(0)
}

#[derive(clap::Args, Debug)]
pub struct LsArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    /// Only sandboxes in this state (repeatable: any of them).
    #[arg(long = "state", value_name = "STATE")]
    pub states: Vec<String>,
    /// Only sandboxes with this metadata label (repeatable: all of them).
    #[arg(long = "metadata", short = 'm', value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub metadata: Vec<(String, String)>,
    /// Show only this page (1-based) instead of every sandbox.
    #[arg(long, value_name = "N")]
    pub page: Option<u32>,
    /// Sandboxes per page with --page [default: 20].
    #[arg(long, value_name = "N")]
    pub page_size: Option<u32>,
    /// Print the API's list response as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `fastbox sandbox ls`: newest first.
pub fn ls(args: LsArgs) -> anyhow::Result<i32> {
    let api = args.server.client()?;
    let query = ListQuery {
        states: args.states.clone(),
        metadata: args.metadata.clone(),
        page: args.page.unwrap_or(1),
        page_size: args.page_size.unwrap_or(DEFAULT_PAGE_SIZE),
    };
    let list = if args.page.is_some() || args.page_size.is_some() {
        api.list(&query)?
    } else {
        api.list_all(&query)?
    };
    if args.json {
        print_json(&list)?;
    } else {
        print!("{}", render::sandbox_table(&list.items));
    }
    Ok(0)
}

#[derive(clap::Args, Debug)]
pub struct GetArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    /// The sandbox id.
    pub id: String,
    /// Print the API's sandbox object as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `fastbox sandbox get`.
pub fn get(args: GetArgs) -> anyhow::Result<i32> {
    let sandbox = args.server.client()?.get(&args.id)?;
    if args.json {
        print_json(&sandbox)?;
    } else {
        print!("{}", render::sandbox_summary(&sandbox));
    }
    Ok(0)
}

#[derive(clap::Args, Debug)]
pub struct LogsArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    /// The sandbox id.
    pub id: String,
    /// The sandbox's lifecycle events instead of its entrypoint's output.
    #[arg(long)]
    pub events: bool,
}

/// `fastbox sandbox logs`: the diagnostics content as it is; warnings go to stderr.
pub fn logs(args: LogsArgs) -> anyhow::Result<i32> {
    let which = if args.events {
        Diagnostics::Events
    } else {
        Diagnostics::Logs
    };
    let diagnostics = args.server.client()?.diagnostics(&args.id, which)?;
    for warning in diagnostics.warnings.iter().flatten() {
        eprintln!("fastbox: warning: {warning}");
    }
    let content = diagnostics.content.unwrap_or_default();
    let mut out = std::io::stdout().lock();
    out.write_all(content.as_bytes())?;
    if !content.is_empty() && !content.ends_with('\n') {
        out.write_all(b"\n")?;
    }
    out.flush()?;
    Ok(0)
}

#[derive(clap::Args, Debug)]
pub struct KillArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    /// The sandbox ids.
    #[arg(required = true)]
    pub ids: Vec<String>,
    /// Return only once each sandbox is Terminated (or Failed, or gone).
    #[arg(long)]
    pub wait: bool,
    /// Longest wait per sandbox with --wait.
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    pub wait_timeout: u64,
}

/// `fastbox sandbox kill`: deletes every id it is given, printing those deleted; exit status
/// 1 when any failed (each failure is printed).
pub fn kill(args: KillArgs) -> anyhow::Result<i32> {
    let api = args.server.client()?;
    let timeout = Duration::from_secs(args.wait_timeout);
    let mut failed = false;
    for id in &args.ids {
        let result = api.delete(id).map_err(anyhow::Error::from).and_then(|()| {
            if args.wait {
                wait::until_final(&api, id, timeout)?;
            }
            Ok(())
        });
        match result {
            Ok(()) => println!("{id}"),
            Err(e) => {
                eprintln!("fastbox: {e:#}");
                failed = true;
            }
        }
    }
    Ok(i32::from(failed))
}

fn print_json(value: &impl serde::Serialize) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use fastbox_api::lifecycle::StringMap;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        create: CreateArgs,
    }

    fn create_request(args: &[&str]) -> CreateRequest {
        let argv = std::iter::once("create").chain(args.iter().copied());
        Cli::try_parse_from(argv).unwrap().create.request()
    }

    #[test]
    fn create_defaults_to_an_idle_entrypoint_and_ten_minutes() {
        let req = create_request(&["fastbox/busybox"]);
        assert_eq!(req.entrypoint, ["tail", "-f", "/dev/null"]);
        assert_eq!(req.timeout, Some(600));
        assert!(req.resource_limits.is_empty());
    }

    #[test]
    fn create_flags_fill_the_request() {
        let req = create_request(&[
            "--entrypoint",
            "sh",
            "--entrypoint",
            "-c",
            "--entrypoint",
            "echo hi; sleep 9",
            "--env",
            "A=1",
            "--metadata",
            "team=x",
            "--timeout",
            "0",
            "--memory",
            "256Mi",
            "img",
        ]);
        assert_eq!(req.entrypoint, ["sh", "-c", "echo hi; sleep 9"]);
        assert_eq!(req.env, StringMap::from([("A".into(), "1".into())]));
        assert_eq!(req.metadata, StringMap::from([("team".into(), "x".into())]));
        assert_eq!(req.timeout, None);
        assert_eq!(
            req.resource_limits,
            StringMap::from([("memory".into(), "256Mi".into())])
        );
    }
}
