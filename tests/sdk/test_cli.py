"""The official OpenSandbox CLI (`opensandbox-cli` 1.1.1, executables `osb` and `opensandbox`)
against `fastbox up`, configured only through its environment variables.

Commands used (global options go before the group; `-o json` is per command):
    osb --no-color sandbox create --image python:3.12 --timeout 10m --ready-timeout 120s \
        --metadata fbt-run=<prefix> --metadata fbt-suite=cli --env FB_CLI=from-cli \
        --resource cpu=1 --resource memory=1Gi -o json
    osb --no-color sandbox list --state Running --metadata fbt-suite=cli -o json
    osb --no-color sandbox get <id> -o json
    osb --no-color command run <id> -- sh -c 'echo "cli:$FB_CLI"'
    osb --no-color sandbox kill <id> -o json
`--no-color` makes `-o json` print plain `json.dumps` output (with colour the CLI pretty-prints
through rich).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fastbox_server as fb
import pytest


def cli_executable(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    if candidate.is_file():
        return str(candidate)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"`{name}` is not installed (pip install opensandbox-cli==1.1.1)")
    return found


@pytest.fixture(scope="module")
def cli_env(fastbox: fb.FastboxServer) -> Iterator[dict[str, str]]:
    home = tempfile.mkdtemp(prefix="fbt-cli-home-")  # no ~/.opensandbox/config.toml applies
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPEN_SANDBOX_", "OPENSANDBOX_"))}
    env.update(
        HOME=home,
        OPEN_SANDBOX_DOMAIN=fastbox.domain,
        OPEN_SANDBOX_API_KEY=fastbox.api_key,
        OPEN_SANDBOX_PROTOCOL="http",
        NO_COLOR="1",
    )
    yield env
    shutil.rmtree(home, ignore_errors=True)


def osb(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [cli_executable("osb"), "--no-color", *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    print(f"[cli] {' '.join(cmd[1:])} -> {r.returncode}", flush=True)
    if check and r.returncode != 0:
        pytest.fail(
            f"`osb {' '.join(args)}` exited {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
        )
    return r


def osb_json(env: dict[str, str], *args: str) -> Any:
    r = osb(env, *args, "-o", "json")
    try:
        return json.loads(r.stdout)
    except ValueError:
        pytest.fail(f"`osb {' '.join(args)} -o json` did not print JSON:\n{r.stdout}\n{r.stderr}")


def test_cli_executables_installed() -> None:
    for name in ("osb", "opensandbox"):
        r = subprocess.run(
            [cli_executable(name), "--version"], capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0, r.stderr
        assert "1.1.1" in r.stdout


def test_cli_create_list_run_kill(fastbox: fb.FastboxServer, cli_env: dict[str, str]) -> None:
    created = osb_json(
        cli_env,
        "sandbox", "create",
        "--image", fb.TEST_IMAGE,
        "--timeout", "10m",
        "--ready-timeout", "120s",
        "--metadata", f"fbt-run={fastbox.prefix}",
        "--metadata", "fbt-suite=cli",
        "--env", "FB_CLI=from-cli",
        "--resource", "cpu=1",
        "--resource", "memory=1Gi",
    )  # fmt: skip
    assert created["status"] == "created", created
    assert created["image"] == fb.TEST_IMAGE
    sid = created["id"]
    try:
        listed = osb_json(
            cli_env, "sandbox", "list", "--state", "Running", "--metadata", "fbt-suite=cli"
        )
        assert [item["id"] for item in listed["items"]] == [sid], listed
        item = listed["items"][0]
        assert item["status"]["state"] == "Running"
        assert item["metadata"]["fbt-run"] == fastbox.prefix
        assert listed["pagination"]["total_items"] == 1

        got = osb_json(cli_env, "sandbox", "get", sid)
        assert got["id"] == sid
        assert got["status"]["state"] == "Running"
        assert got["image"]["image"] == fb.TEST_IMAGE

        run = osb(cli_env, "command", "run", sid, "--", "sh", "-c", 'echo "cli:$FB_CLI"')
        assert run.stdout.strip() == "cli:from-cli", run

        failed = osb(cli_env, "command", "run", sid, "--", "sh", "-c", "exit 7", check=False)
        assert failed.returncode == 1
        assert "CommandExecError" in failed.stderr, failed.stderr
    finally:
        killed = osb_json(cli_env, "sandbox", "kill", sid)
    assert killed == [{"sandbox_id": sid, "status": "terminated"}]

    def terminated() -> bool:
        return osb_json(cli_env, "sandbox", "get", sid)["status"]["state"] == "Terminated"

    fb.wait_until(terminated, timeout=30, interval=0.5, what=f"{sid} Terminated")
    listed = osb_json(
        cli_env, "sandbox", "list", "--state", "Running", "--metadata", "fbt-suite=cli"
    )
    assert listed["items"] == []


def test_cli_errors_exit_nonzero(cli_env: dict[str, str]) -> None:
    r = osb(cli_env, "sandbox", "get", "no-such-sandbox-fbt", "-o", "json", check=False)
    assert r.returncode == 1
    assert re.search(r"404|not[ _]found", r.stderr, re.IGNORECASE), r.stderr

    bad_key = {**cli_env, "OPEN_SANDBOX_API_KEY": "wrong-key"}
    r = osb(bad_key, "sandbox", "list", "-o", "json", check=False)
    assert r.returncode == 1
    assert "401" in r.stderr or "INVALID_API_KEY" in r.stderr, r.stderr
