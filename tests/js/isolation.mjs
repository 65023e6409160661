// Isolated sessions with the official OpenSandbox JavaScript SDK, run by
// tests/sdk/test_js_sdk.py (same environment as flow.mjs): a sandbox created with
// `bootstrap.execd.isolation=enable`, its capabilities, a session's runs in an overlay
// workspace, `runOnce`, and the session list. Each step prints `STEP <name> <json>`.

import { ConnectionConfig, Sandbox } from "@alibaba-group/opensandbox";

const env = (name) => {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set`);
  return value;
};

const step = (name, seen) => console.log(`STEP ${name} ${JSON.stringify(seen)}`);
const stdout = (execution) => execution.logs.stdout.map((m) => m.text.replace(/\n$/, "")).join("\n");

const connectionConfig = new ConnectionConfig({
  domain: env("OPEN_SANDBOX_DOMAIN"),
  apiKey: env("OPEN_SANDBOX_API_KEY"),
  protocol: "http",
  requestTimeoutSeconds: 120,
});

const sandbox = await Sandbox.create({
  connectionConfig,
  image: env("FASTBOX_JS_IMAGE"),
  metadata: { "fbt-run": env("FASTBOX_JS_RUN"), "fbt-suite": "js-isolation" },
  extensions: { "bootstrap.execd.isolation": "enable" },
  resource: { cpu: "1", memory: "1Gi" },
  timeoutSeconds: 600,
  readyTimeoutSeconds: 120,
});
try {
  await sandbox.commands.run("mkdir -p /workspace && echo from-sandbox > /workspace/in.txt");
  const caps = await sandbox.isolation.capabilities();
  step("capabilities", { available: caps.available, isolator: caps.isolator ?? null });

  const session = await sandbox.isolation.create({ workspace: { path: "/workspace", mode: "overlay" } });
  const wrote = await session.run("cat /workspace/in.txt; echo from-session > /workspace/in.txt; cat /workspace/in.txt; ps -e | wc -l");
  const listed = await sandbox.isolation.list();
  const state = await session.get();
  await session.delete();
  const after = await sandbox.commands.run("cat /workspace/in.txt");
  step("session", {
    stdout: stdout(wrote),
    exitCode: wrote.exitCode ?? null,
    listed: listed.map((s) => s.session_id),
    id: session.sessionId,
    status: state.status,
    sandboxSees: stdout(after).trim(),
  });

  const once = await sandbox.isolation.runOnce("id -u; ls /tmp | wc -l", "/workspace", { workspaceMode: "ro" });
  step("run-once", { stdout: stdout(once), left: (await sandbox.isolation.list()).length });
} finally {
  await sandbox.kill();
  await sandbox.close();
}
