"""The official OpenSandbox JavaScript SDK (`@alibaba-group/opensandbox`, pinned in
tests/js/package.json) against `fastbox up`: tests/js/flow.mjs runs one user's flow with it
(create, commands, files, list filters, pause and an immediate resume, renew, endpoint,
kill), tests/js/isolation.mjs its isolated sessions, and each prints what each step saw;
the checks are here.

Needs Node.js >= 20 and `npm ci` in tests/js (scripts/setup.sh does both when Node.js is
there); without them the test is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import fastbox_server as fb
import pytest

JS_DIR = Path(__file__).resolve().parent.parent / "js"


def node_missing() -> str | None:
    """Why the JavaScript SDK cannot run here, or None."""
    node = shutil.which("node")
    if node is None:
        return "node is not installed (the JavaScript SDK needs Node.js >= 20)"
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip()
    major = re.match(r"v(\d+)\.", version)
    if major is None or int(major.group(1)) < 20:
        return f"node {version} is too old (the JavaScript SDK needs Node.js >= 20)"
    if not (JS_DIR / "node_modules" / "@alibaba-group" / "opensandbox").is_dir():
        return f"the JavaScript SDK is not installed in {JS_DIR} (npm ci there; scripts/setup.sh does it)"
    return None


def run_flow(fastbox: fb.FastboxServer, script: str = "flow.mjs") -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPEN_SANDBOX_", "OPENSANDBOX_"))}
    env.update(
        OPEN_SANDBOX_DOMAIN=fastbox.domain,
        OPEN_SANDBOX_API_KEY=fastbox.api_key,
        FASTBOX_JS_IMAGE=fb.TEST_IMAGE,
        FASTBOX_JS_RUN=fastbox.prefix,
    )
    r = subprocess.run(
        ["node", script], cwd=JS_DIR, env=env, capture_output=True, text=True, timeout=600
    )
    print(r.stdout, r.stderr, sep="\n", flush=True)
    assert r.returncode == 0, f"the JavaScript {script} failed ({r.returncode}):\n{r.stderr}"
    steps: dict[str, Any] = {}
    for line in r.stdout.splitlines():
        if line.startswith("STEP "):
            _, name, seen = line.split(" ", 2)
            steps[name] = json.loads(seen)
    return steps


def test_the_javascript_sdk_runs_a_user_flow(fastbox: fb.FastboxServer) -> None:
    missing = node_missing()
    if missing:
        pytest.skip(missing)
    steps = run_flow(fastbox)

    created = steps["created"]
    assert created["state"] == "Running", created
    assert created["metadata"]["fbt-suite"] == "js", created

    assert steps["command"]["stdout"].strip() == "js:from-js", steps["command"]
    assert steps["command"]["error"] is None, steps["command"]
    failed = steps["failed-command"]
    assert "oops" in failed["stderr"], failed
    assert failed["error"] == "CommandExecError", failed

    assert steps["files"]["whole"] == "one\ntwo\nthree\n", steps["files"]
    assert steps["files"]["lines"] == "two\nthree", steps["files"]

    assert created["id"] in steps["list"]["running"], steps["list"]
    assert steps["list"]["unknown"] == [], steps["list"]

    moved = steps["pause-resume"]
    assert moved["paused"] in {"Pausing", "Paused"}, moved
    assert moved["state"] == "Running", moved
    assert moved["after"] == moved["before"] != "", (
        f"the process did not survive pause and resume: {moved}"
    )

    assert steps["renew"]["expiresAt"], steps["renew"]
    assert steps["endpoint"]["endpoint"], steps["endpoint"]
    assert steps["killed"]["id"] == created["id"]


def test_the_javascript_sdk_runs_isolated_sessions(fastbox: fb.FastboxServer) -> None:
    missing = node_missing()
    if missing:
        pytest.skip(missing)
    steps = run_flow(fastbox, "isolation.mjs")
    assert steps["capabilities"] == {"available": True, "isolator": "fastbox"}, steps
    session = steps["session"]
    lines = session["stdout"].split("\n")
    assert lines[:2] == ["from-sandbox", "from-session"], session
    # Its own pid namespace: ps's header, the session's execd, the shell, ps and wc.
    assert int(lines[2]) <= 6, session
    assert session["exitCode"] == 0 and session["status"] == "active", session
    assert session["listed"] == [session["id"]], session
    # The overlay's change stayed in the session.
    assert session["sandboxSees"] == "from-sandbox", session
    once = steps["run-once"]
    assert once["stdout"].split("\n")[:2] == ["0", "0"], once
    assert once["left"] == 0, once
