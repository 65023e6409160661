"""The templates API through the official SDK: create a template (a golden checkpoint with its
own entrypoint, environment and limits), wait for its build, create sandboxes from it with
`SandboxSync.create_from_template`, list, and delete it."""

from __future__ import annotations

import time
from datetime import timedelta

import fastbox_server as fb
import pytest
from opensandbox.exceptions import SandboxApiException
from opensandbox.models.templates import CreateTemplateRequest, TemplateFilter
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

    sandbox = SandboxSync.create_from_template(
        created.template_id,
        timeout=timedelta(minutes=5),
        ready_timeout=timedelta(seconds=60),
        metadata={"fbt-run": fastbox.prefix},
        connection_config=fastbox.connection_config(),
    )
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

    manager.delete_template(created.template_id)
    with pytest.raises(SandboxApiException) as e:
        manager.get_template(created.template_id)
    assert e.value.status_code == 404


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
