// One user's flow with the official OpenSandbox JavaScript SDK against fastbox up, run by
// tests/sdk/test_js_sdk.py, which starts the server and gives its address in
// OPEN_SANDBOX_DOMAIN and OPEN_SANDBOX_API_KEY, the image in FASTBOX_JS_IMAGE and this run's
// label in FASTBOX_JS_RUN (every sandbox made here carries it as metadata `fbt-run`).
//
// Each step prints one line `STEP <name> <json>` with what it saw; the Python side checks the
// values. Any exception ends the run with a nonzero status and the error on stderr.

import { ConnectionConfig, Sandbox, SandboxManager } from "@alibaba-group/opensandbox";

const env = (name) => {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set`);
  return value;
};

const step = (name, seen) => console.log(`STEP ${name} ${JSON.stringify(seen)}`);
const stdout = (execution) => execution.logs.stdout.map((m) => m.text).join("");

const connectionConfig = new ConnectionConfig({
  domain: env("OPEN_SANDBOX_DOMAIN"),
  apiKey: env("OPEN_SANDBOX_API_KEY"),
  protocol: "http",
  requestTimeoutSeconds: 120,
});
const metadata = { "fbt-run": env("FASTBOX_JS_RUN"), "fbt-suite": "js" };

const sandbox = await Sandbox.create({
  connectionConfig,
  image: env("FASTBOX_JS_IMAGE"),
  metadata,
  env: { FB_JS: "from-js" },
  resource: { cpu: "1", memory: "1Gi" },
  timeoutSeconds: 600,
  readyTimeoutSeconds: 120,
});
let resumed;
try {
  const info = await sandbox.getInfo();
  step("created", { id: sandbox.id, state: info.status.state, metadata: info.metadata });

  const echo = await sandbox.commands.run('echo "js:$FB_JS"; exit 0');
  step("command", { stdout: stdout(echo), exitCode: echo.exitCode ?? null, error: echo.error ?? null });
  const failed = await sandbox.commands.run("echo oops >&2; exit 3");
  step("failed-command", {
    exitCode: failed.exitCode ?? null,
    stderr: failed.logs.stderr.map((m) => m.text).join(""),
    error: failed.error ? failed.error.name : null,
  });

  await sandbox.files.writeFiles([{ path: "/tmp/js.txt", data: "one\ntwo\nthree\n", mode: 644 }]);
  step("files", {
    whole: await sandbox.files.readFile("/tmp/js.txt"),
    lines: await sandbox.files.readFile("/tmp/js.txt", { offset: 2, limit: 2 }),
  });

  // A process that must survive the pause (restored, not restarted): its pid.
  await sandbox.commands.run(
    "nohup sh -c 'echo $$ > /tmp/holder; while :; do sleep 1; done' >/dev/null 2>&1 &",
  );
  await new Promise((r) => setTimeout(r, 300));
  const holder = (await sandbox.files.readFile("/tmp/holder")).trim();

  const manager = SandboxManager.create({ connectionConfig });
  try {
    const running = await manager.listSandboxInfos({ states: ["Running"], metadata });
    const unknown = await manager.listSandboxInfos({ states: ["Hibernating"], metadata });
    step("list", {
      running: running.items.map((s) => s.id),
      unknown: unknown.items.map((s) => s.id),
    });

    // Pause, then resume at once: the SDK asks for the new endpoint right after its
    // resume call, without polling.
    await sandbox.pause();
    const paused = (await manager.getSandboxInfo(sandbox.id)).status.state;
    resumed = await sandbox.resume({ readyTimeoutSeconds: 120 });
    const state = (await resumed.getInfo()).status.state;
    const alive = await resumed.commands.run('pid=$(cat /tmp/holder); kill -0 "$pid" && echo "$pid"');
    step("pause-resume", {
      paused,
      state,
      before: holder,
      after: stdout(alive).trim(),
    });
  } finally {
    await manager.close();
  }

  const renewed = await resumed.renew(1200);
  step("renew", { expiresAt: renewed.expiresAt ?? null });
  const endpoint = await resumed.getEndpoint(8080);
  step("endpoint", { endpoint: endpoint.endpoint });
} finally {
  await (resumed ?? sandbox).kill();
  step("killed", { id: sandbox.id });
  await sandbox.close();
  if (resumed) await resumed.close();
}
