//! The `fastbox sandbox` client verbs against a real `fastbox up`, each run as the `fastbox`
//! binary the way a user types it: create -> ls -> get -> exec -> cp/cat -> logs -> kill, and
//! the errors a user sees (unknown sandbox, wrong API key, no server).

mod common;

use std::io::Write;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::server::UpServer;

/// The `fastbox` binary pointed at `server` through the environment, as a user's shell would.
struct Client<'a> {
    server: &'a UpServer,
}

impl Client<'_> {
    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_fastbox"));
        cmd.arg("sandbox")
            .args(args)
            .env("FASTBOX_SERVER", &self.server.api)
            .env("FASTBOX_API_KEY", &self.server.api_key)
            .env_remove("OPEN_SANDBOX_DOMAIN")
            .env_remove("OPEN_SANDBOX_API_KEY");
        cmd
    }

    fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run fastbox")
    }

    /// Runs with `input` on stdin.
    fn run_with_stdin(&self, args: &[&str], input: &[u8]) -> Output {
        let mut child = self
            .command(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn fastbox");
        child.stdin.take().unwrap().write_all(input).unwrap();
        child.wait_with_output().unwrap()
    }

    /// Runs and expects exit status 0; returns stdout.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(out.status.success(), "fastbox {args:?}: {}", describe(&out));
        String::from_utf8(out.stdout).unwrap()
    }
}

fn describe(out: &Output) -> String {
    format!(
        "{}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn client_verbs_drive_a_sandbox_from_create_to_kill() {
    let Some(server) = UpServer::start('k', &["--default-image", "fastbox/busybox"]) else {
        return;
    };
    let cli = Client { server: &server };

    // create: ready when it returns.
    let id = cli
        .ok(&[
            "create",
            "fastbox/busybox",
            "--env",
            "GREETING=hello world",
            "--metadata",
            "suite=client-cli",
            "--entrypoint",
            "sh",
            "--entrypoint",
            "-c",
            "--entrypoint",
            "echo entry-marker; exec sleep 1000",
            "--memory",
            "256Mi",
        ])
        .trim()
        .to_string();
    assert!(
        !id.is_empty() && !id.contains(char::is_whitespace),
        "{id:?}"
    );

    // ls, with and without a matching metadata filter.
    let table = cli.ok(&["ls"]);
    assert!(table.starts_with("ID "), "{table}");
    let row = table.lines().find(|l| l.starts_with(&id)).expect("listed");
    assert!(
        row.contains("Running") && row.contains("fastbox/busybox"),
        "{row}"
    );
    assert!(
        cli.ok(&["ls", "--metadata", "suite=client-cli"])
            .contains(&id)
    );
    assert!(!cli.ok(&["ls", "--metadata", "suite=other"]).contains(&id));
    assert!(!cli.ok(&["ls", "--state", "Terminated"]).contains(&id));

    // get --json is the API's sandbox object.
    let sandbox: serde_json::Value =
        serde_json::from_str(&cli.ok(&["get", &id, "--json"])).expect("get --json prints JSON");
    assert_eq!(sandbox["id"], id.as_str());
    assert_eq!(sandbox["status"]["state"], "Running");
    assert_eq!(sandbox["metadata"]["suite"], "client-cli");
    assert_eq!(
        sandbox["entrypoint"][2],
        "echo entry-marker; exec sleep 1000"
    );

    // exec: streams split by kind, the command's exit status, the create's env.
    let out = cli.run(&[
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "echo out; echo err >&2; exit 3",
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", describe(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "out\n");
    assert_eq!(stderr(&out), "err\n");
    let out = cli.ok(&[
        "exec",
        &id,
        "--cwd",
        "/tmp",
        "--env",
        "X=1",
        "--",
        "sh",
        "-c",
        "pwd; echo \"$GREETING $X\"",
    ]);
    assert_eq!(out, "/tmp\nhello world 1\n");

    // cp in, cat back, cp out; stdin as a source.
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("in.txt");
    let content = "line one\nline 'two' $HOME\n";
    std::fs::write(&local, content).unwrap();
    let remote = format!("{id}:/tmp/copied/in.txt");
    cli.ok(&["cp", local.to_str().unwrap(), &remote]);
    assert_eq!(cli.ok(&["cat", &id, "/tmp/copied/in.txt"]), content);
    let back = dir.path().join("out.txt");
    cli.ok(&["cp", &remote, back.to_str().unwrap()]);
    assert_eq!(std::fs::read_to_string(&back).unwrap(), content);
    let out = cli.run_with_stdin(
        &["cp", "-", &format!("{id}:/root/stdin.txt")],
        b"from stdin",
    );
    assert!(out.status.success(), "{}", describe(&out));
    assert_eq!(cli.ok(&["cat", &id, "/root/stdin.txt"]), "from stdin");
    let missing = cli.run(&["cat", &id, "/no/such/file"]);
    assert_eq!(missing.status.code(), Some(1), "{}", describe(&missing));
    assert!(
        stderr(&missing).contains("(HTTP 404"),
        "{}",
        stderr(&missing)
    );

    // logs: the entrypoint's output; --events: its lifecycle.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let logs = cli.ok(&["logs", &id]);
        if logs.contains("entry-marker") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no entry-marker in logs: {logs:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(cli.ok(&["logs", "--events", &id]).contains("Running"));

    // kill --wait: Terminated when it returns.
    assert_eq!(cli.ok(&["kill", "--wait", &id]), format!("{id}\n"));
    let summary = cli.ok(&["get", &id]);
    assert!(summary.contains("state       Terminated"), "{summary}");

    // Errors: the API's code and status on stderr, exit status 1.
    let unknown = cli.run(&["get", "no-such-sandbox"]);
    assert_eq!(unknown.status.code(), Some(1), "{}", describe(&unknown));
    let text = stderr(&unknown);
    assert!(text.starts_with("fastbox: SANDBOX::NOT_FOUND: "), "{text}");
    assert!(text.contains("(HTTP 404, request "), "{text}");
    let wrong_key = cli.run(&["ls", "--api-key", "wrong-key"]);
    assert_eq!(wrong_key.status.code(), Some(1), "{}", describe(&wrong_key));
    assert!(
        stderr(&wrong_key).contains("INVALID_API_KEY"),
        "{}",
        stderr(&wrong_key)
    );
    assert!(
        stderr(&wrong_key).contains("(HTTP 401"),
        "{}",
        stderr(&wrong_key)
    );
    let no_server = cli.run(&["ls", "--server", "http://127.0.0.1:1"]);
    assert_eq!(no_server.status.code(), Some(1), "{}", describe(&no_server));
    assert!(
        stderr(&no_server).contains("fastbox up"),
        "{}",
        stderr(&no_server)
    );

    server.finish();
}
