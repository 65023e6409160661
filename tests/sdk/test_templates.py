"""The templates API through the official SDK: create a template (a golden checkpoint with its
own entrypoint, environment and limits), wait for its build, create sandboxes from it with
`SandboxSync.create_from_template`, list, and delete it."""

from __future__ import annotations

import time
from datetime import timedelta

import fastbox_server as fb
import pytest
from opensandbox.exceptions import SandboxApiException
from opensandbox.models.templates import CreateTemplateRequest, TemplateFilter, TemplateReadiness
from opensandbox.sync.manager import SandboxManagerSync
from opensandbox.sync.sandbox import SandboxSync


def wait_for_phase(manager: SandboxManagerSync, template_id: str, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while True:
        info = manager.get_template(template_id)
        if info.status.phase in ("Succeeded", "Failed"):
            return info
        assert time.monotonic() < deadline, f"template {template_id} stuck in {info.status.phase}"
        time.sleep(0.2)


def sandbox_of(fastbox: fb.FastboxServer, template_id: str) -> SandboxSync:
    """A sandbox of template `template_id`, ready, tagged with the run's prefix."""
    return SandboxSync.create_from_template(
        template_id,
        timeout=timedelta(minutes=5),
        ready_timeout=timedelta(seconds=60),
        metadata={"fbt-run": fastbox.prefix},
        connection_config=fastbox.connection_config(),
    )


def test_templates_build_and_serve_creates(
    fastbox: fb.FastboxServer, manager: SandboxManagerSync
) -> None:
    request = CreateTemplateRequest(
        image=fb.TEST_IMAGE,
        publish="local",
        entrypoint=["/bin/sh", "-c", "echo from-template-entrypoint; exec tail -f /dev/null"],
        env={"FB_TEMPLATE": "baked"},
        resource_limits={"cpu": "1", "memory": "512Mi"},
        metadata={"fbt-run": fastbox.prefix, "suite": "templates"},
    )
    created = manager.create_template(request)
    assert created.template_id.startswith("tpl_")
    assert created.status.phase in ("Pending", "Building", "Succeeded")
    info = wait_for_phase(manager, created.template_id)
    assert info.status.phase == "Succeeded", info.status.message
    # Published as an artifact: content-addressed blocks under a manifest.
    assert (info.status.manifest_ref or "").startswith("blake3:"), info.status

    listed = manager.list_templates(TemplateFilter(metadata={"suite": "templates"}))
    assert [t.template_id for t in listed.template_infos] == [created.template_id]

    sandbox = sandbox_of(fastbox, created.template_id)
    try:
        run = sandbox.commands.run("echo $FB_TEMPLATE")
        assert fb.lines(run.logs.stdout) == ["baked"]
        logs = fb.wait_until(
            lambda: "from-template-entrypoint" in (sandbox.get_diagnostic_logs("container").content or ""),
            timeout=10,
            what="the template's entrypoint output",
        )
        assert logs
        metrics = sandbox.get_metrics()
        assert metrics.memory_total_in_mib <= 513, metrics
    finally:
        sandbox.kill()
        sandbox.close()

    # The template's isolation variant: the same checkpointed environment, and sessions.
    isolated = SandboxSync.create_from_template(
        created.template_id,
        timeout=timedelta(minutes=5),
        ready_timeout=timedelta(seconds=60),
        metadata={"fbt-run": fastbox.prefix},
        extensions={"bootstrap.execd.isolation": "enable"},
        connection_config=fastbox.connection_config(),
    )
    try:
        assert fb.lines(isolated.commands.run("echo $FB_TEMPLATE").logs.stdout) == ["baked"]
        assert isolated.isolation.capabilities().available
    finally:
        isolated.kill()
        isolated.close()

    manager.delete_template(created.template_id)
    with pytest.raises(SandboxApiException) as e:
        manager.get_template(created.template_id)
    assert e.value.status_code == 404
    # Its golden checkpoints are gone from the node, the isolation variant's included.
    assert fastbox.data_dir is not None
    left = [p.name for p in (fastbox.data_dir / "templates").iterdir() if created.template_id in p.name]
    assert left == [], left


def test_template_creates_refuse_what_the_template_decides(
    fastbox: fb.FastboxServer, api
) -> None:
    r = api.post(
        "/v1/sandboxes",
        json={"templateId": "tpl_does-not-exist", "timeout": 600},
    )
    assert r.status_code == 404, r.text
    r = api.post(
        "/v1/templates",
        json={"image": fb.TEST_IMAGE, "publish": "s3://bucket/x"},
    )
    assert r.status_code == 400 and r.json()["code"] == "SANDBOX::API_NOT_SUPPORTED", r.text
    r = api.post("/v1/templates", json={"publish": "local"})
    assert r.status_code == 400 and r.json()["code"] == "SANDBOX::INVALID_PARAMETER", r.text
    for readiness, why in [
        ({"probe": "http://127.0.0.1:8000"}, "tcp://HOST:PORT or cmd://COMMAND"),
        ({"probe": "tcp://example.com:80"}, "IPv4 address or localhost"),
        ({"probe": "tcp://127.0.0.1:8000", "warmupSeconds": 86400}, "out of range"),
    ]:
        r = api.post(
            "/v1/templates",
            json={"image": fb.TEST_IMAGE, "publish": "local", "readiness": readiness},
        )
        assert r.status_code == 400 and r.json()["code"] == "SANDBOX::INVALID_PARAMETER", r.text
        assert why in r.json()["message"], r.text


# The warm-up server: draws a random token once, at start, keeps it only in memory (and in a
# file, to compare), and serves it with its pid on port 8000 after a second of "warming up".
WARM_SERVER = r"""
import http.server, os, time
token = os.urandom(16).hex()
open('/tmp/warm-token', 'w').write(token)
time.sleep(1)
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f'{token} {os.getpid()}'.encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(('127.0.0.1', 8000), Handler).serve_forever()
"""

ASK_WARM_SERVER = (
    "python3 -c \"import urllib.request; "
    "print(urllib.request.urlopen('http://127.0.0.1:8000').read().decode())\""
)

# Python processes running the warm-up server (execd's own command line names it too, as the
# entrypoint it started cold; the needle is split so that this command's does not match).
COUNT_WARM_SERVERS = (
    "python3 -c \"import os\n"
    "def cmdline(p):\n"
    "    try: return open(f'/proc/{p}/cmdline', 'rb').read()\n"
    "    except OSError: return b''\n"
    "print(sum(cmdline(p).startswith(b'python3\\0') and b'serve_' + b'forever' in cmdline(p) for p in os.listdir('/proc') if p.isdigit()))\""
)


def test_templates_warm_up_before_the_checkpoint(
    fastbox: fb.FastboxServer, manager: SandboxManagerSync
) -> None:
    """The template's entrypoint is its warm-up command: it starts at build, the readiness
    probe waits for it, and every sandbox of the template is a restore of it running, not a
    new start (the same in-memory token in each, one server process, nothing started at
    claim)."""
    created = manager.create_template(
        CreateTemplateRequest(
            image=fb.TEST_IMAGE,
            publish="local",
            entrypoint=["python3", "-c", WARM_SERVER],
            readiness=TemplateReadiness(probe="tcp://127.0.0.1:8000", warmup_seconds=60),
            metadata={"fbt-run": fastbox.prefix, "suite": "warm-up"},
        )
    )
    info = wait_for_phase(manager, created.template_id)
    assert info.status.phase == "Succeeded", info.status.message

    answers = []
    for _ in range(2):
        sandbox = sandbox_of(fastbox, created.template_id)
        try:
            # Serving at once: no warm-up happens after the create.
            served = fb.lines(sandbox.commands.run(ASK_WARM_SERVER).logs.stdout)
            assert len(served) == 1, served
            written = fb.lines(sandbox.commands.run("cat /tmp/warm-token").logs.stdout)
            count = fb.lines(sandbox.commands.run(COUNT_WARM_SERVERS).logs.stdout)
            answers.append((served[0].split()[0], written, count))
        finally:
            sandbox.kill()
            sandbox.close()
    (token_a, written_a, count_a), (token_b, written_b, count_b) = answers
    assert token_a == token_b, "each sandbox must be a restore of the one warmed-up server"
    assert written_a == written_b == [token_a], (written_a, written_b, token_a)
    assert count_a == count_b == ["1"], "the claim must not start the entrypoint again"
    manager.delete_template(created.template_id)


def test_template_readiness_gates_the_build(
    fastbox: fb.FastboxServer, manager: SandboxManagerSync
) -> None:
    """A cmd:// probe passes once the warm-up made it true; a probe that never passes fails
    the build within warmupSeconds, and the message says which probe and what it answered."""
    passing = manager.create_template(
        CreateTemplateRequest(
            image=fb.TEST_IMAGE,
            publish="local",
            entrypoint=["/bin/sh", "-c", "sleep 0.5; touch /tmp/ready; exec tail -f /dev/null"],
            readiness=TemplateReadiness(probe="cmd://test -f /tmp/ready", warmup_seconds=30),
            metadata={"fbt-run": fastbox.prefix, "suite": "readiness"},
        )
    )
    never = manager.create_template(
        CreateTemplateRequest(
            image=fb.TEST_IMAGE,
            publish="local",
            entrypoint=["tail", "-f", "/dev/null"],
            readiness=TemplateReadiness(probe="tcp://127.0.0.1:9", warmup_seconds=2),
            metadata={"fbt-run": fastbox.prefix, "suite": "readiness"},
        )
    )
    info = wait_for_phase(manager, passing.template_id)
    assert info.status.phase == "Succeeded", info.status.message
    info = wait_for_phase(manager, never.template_id)
    assert info.status.phase == "Failed", info.status
    message = info.status.message or ""
    assert "tcp://127.0.0.1:9 did not pass within 2s" in message, message
    assert "refused" in message, message
    for template in (passing, never):
        manager.delete_template(template.template_id)
