"""Egress policies through the official SDK: a policy at create, then `get_egress_policy`,
`patch_egress_rules` and `delete_egress_rules` (compat §5).

`SandboxSync.create` sandboxes reach the policy through port 18080 (the node proxy, with the
`OPENSANDBOX-EGRESS-AUTH` header the endpoint hands out); `create_from_template` sandboxes
through the lifecycle `networkpolicy` routes. There is no test internet here, so only the
policy contents and the mode are checked; crates/fastbox-cli/tests/egress_e2e.rs checks what
the policies let through with real connections.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import fastbox_server as fb
import httpx
import pytest
from opensandbox.exceptions import SandboxException
from opensandbox.models.sandboxes import NetworkPolicy, NetworkRule
from opensandbox.models.templates import CreateTemplateRequest
from opensandbox.sync.manager import SandboxManagerSync
from opensandbox.sync.sandbox import SandboxSync

EGRESS_AUTH_HEADER = "OPENSANDBOX-EGRESS-AUTH"


def rules(policy: NetworkPolicy) -> list[tuple[str, str]]:
    return [(r.action, r.target) for r in policy.egress or []]


def recorded(api: httpx.Client, sid: str) -> dict[str, Any]:
    """The server's view: GET /v1/sandboxes/{id}/networkpolicy."""
    r = api.get(f"/v1/sandboxes/{sid}/networkpolicy")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "ok" and body["enforcementMode"] == "dns+nft", body
    return body


def events(api: httpx.Client, sid: str) -> str:
    r = api.get(f"/v1/sandboxes/{sid}/diagnostics/events", params={"scope": "runtime"})
    assert r.status_code == 200, r.text
    return r.json().get("content", "")


def allow(target: str) -> NetworkRule:
    return NetworkRule(action="allow", target=target)


def deny(target: str) -> NetworkRule:
    return NetworkRule(action="deny", target=target)


def test_policy_round_trips_through_port_18080(
    fastbox: fb.FastboxServer, api: httpx.Client
) -> None:
    sb = fastbox.create_sandbox(
        network_policy=NetworkPolicy(
            default_action="deny", egress=[allow("files.example.org"), allow("*.Example.com")]
        )
    )
    try:
        assert sb.origin != "template"
        policy = sb.get_egress_policy()
        assert policy.default_action == "deny"
        assert rules(policy) == [("allow", "files.example.org"), ("allow", "*.example.com")]
        assert recorded(api, sb.id)["mode"] == "enforcing"

        # PATCH: new rules first, the first rule of a target wins, the default stays.
        sb.patch_egress_rules([deny("files.example.org"), allow("10.1.2.0/24"), allow("files.example.org")])
        policy = sb.get_egress_policy()
        assert policy.default_action == "deny"
        assert rules(policy) == [
            ("deny", "files.example.org"),
            ("allow", "10.1.2.0/24"),
            ("allow", "*.example.com"),
        ]
        # DELETE: by target, unknown targets ignored.
        sb.delete_egress_rules(["FILES.example.org.", "*.example.com", "unknown.test"])
        assert rules(sb.get_egress_policy()) == [("allow", "10.1.2.0/24")]
        sb.delete_egress_rules(["10.1.2.0/24"])
        policy = sb.get_egress_policy()
        assert (policy.default_action, rules(policy)) == ("deny", [])
        assert recorded(api, sb.id)["mode"] == "deny_all"

        # A bad rule changes nothing.
        with pytest.raises(SandboxException):
            sb.patch_egress_rules([allow("bad target!")])
        assert recorded(api, sb.id)["policy"] == {"defaultAction": "deny"}
        log = events(api, sb.id)
        assert log.count("EgressPolicyChanged") == 3, log  # PATCH, DELETE, DELETE
        assert "through port 18080" in log, log
    finally:
        sb.kill()
        sb.close()


def test_port_18080_needs_the_egress_token(
    fastbox: fb.FastboxServer, api: httpx.Client
) -> None:
    sb = fastbox.create_sandbox()
    try:
        policy = sb.get_egress_policy()
        assert (policy.default_action, rules(policy)) == ("allow", [])
        r = api.get(f"/v1/sandboxes/{sb.id}/endpoints/{fb.EGRESS_PORT}")
        assert r.status_code == 200, r.text
        ep = r.json()
        token = ep["headers"][EGRESS_AUTH_HEADER]
        assert token and token != ep["headers"].get(fb.EXECD_TOKEN_HEADER)
        url = f"http://{ep['endpoint']}/policy"
        with httpx.Client(timeout=30, trust_env=False) as node:
            assert node.get(url).status_code == 401
            assert node.get(url, headers={EGRESS_AUTH_HEADER: "wrong"}).status_code == 401
            r = node.patch(url, json=[deny("x.test").model_dump()])
            assert r.status_code == 401
            r = node.get(url, headers={EGRESS_AUTH_HEADER: token})
            assert r.status_code == 200, r.text
            assert r.json() == {
                "status": "ok",
                "mode": "allow_all",
                "enforcementMode": "dns+nft",
                "policy": {"defaultAction": "allow"},
            }
        assert recorded(api, sb.id)["mode"] == "allow_all"
    finally:
        sb.kill()
        sb.close()


def test_the_credential_vault_needs_the_credential_proxy(
    fastbox: fb.FastboxServer, api: httpx.Client
) -> None:
    """The vault's routes answer on port 18080 behind the egress token; a sandbox created
    without `credentialProxy.enabled` gets 412, and `credentialProxy` without a
    `networkPolicy` is refused at create (test_credential_vault.py has the vault at work)."""
    r = api.post(
        "/v1/sandboxes",
        json={
            "image": {"uri": fb.TEST_IMAGE},
            "entrypoint": ["tail", "-f", "/dev/null"],
            "resourceLimits": {"cpu": "1", "memory": "1Gi"},
            "credentialProxy": {"enabled": True},
            "metadata": {"fbt-run": fastbox.prefix},
        },
    )
    assert r.status_code == 400 and "networkPolicy" in r.text, r.text
    sb = fastbox.create_sandbox()
    try:
        with pytest.raises(SandboxException) as refused:
            sb.credential_vault.get()
        assert "412" in str(refused.value) or "credentialProxy" in str(refused.value), refused.value
        r = api.get(f"/v1/sandboxes/{sb.id}/endpoints/{fb.EGRESS_PORT}")
        ep = r.json()
        url = f"http://{ep['endpoint']}/credential-vault"
        with httpx.Client(timeout=30, trust_env=False) as node:
            assert node.get(url).status_code == 401, "the egress token first"
            r = node.get(url, headers={EGRESS_AUTH_HEADER: ep["headers"][EGRESS_AUTH_HEADER]})
            assert r.status_code == 412, r.text
            assert "credentialProxy.enabled" in r.text, r.text
    finally:
        sb.kill()
        sb.close()


def wait_for_template(manager: SandboxManagerSync, template_id: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        phase = manager.get_template(template_id).status.phase
        if phase in ("Succeeded", "Failed"):
            assert phase == "Succeeded"
            return
        assert time.monotonic() < deadline, f"template {template_id} stuck in {phase}"
        time.sleep(0.2)


def test_policy_round_trips_through_the_lifecycle_api(
    fastbox: fb.FastboxServer, api: httpx.Client, manager: SandboxManagerSync
) -> None:
    template = manager.create_template(
        CreateTemplateRequest(
            image=fb.TEST_IMAGE,
            publish="local",
            entrypoint=["tail", "-f", "/dev/null"],
            metadata={"fbt-run": fastbox.prefix, "suite": "egress"},
        )
    )
    wait_for_template(manager, template.template_id)
    sb = SandboxSync.create_from_template(
        template.template_id,
        timeout=timedelta(minutes=5),
        ready_timeout=timedelta(seconds=60),
        network_policy=NetworkPolicy(default_action="deny"),
        metadata={"fbt-run": fastbox.prefix},
        connection_config=fastbox.connection_config(),
    )
    try:
        # Template sandboxes use the lifecycle networkpolicy routes, not port 18080.
        assert sb.origin == "template"
        policy = sb.get_egress_policy()
        assert (policy.default_action, rules(policy)) == ("deny", [])
        assert recorded(api, sb.id)["mode"] == "deny_all"
        sb.patch_egress_rules([allow("files.example.org"), allow("*.cdn.example.org")])
        assert rules(sb.get_egress_policy()) == [
            ("allow", "files.example.org"),
            ("allow", "*.cdn.example.org"),
        ]
        assert recorded(api, sb.id)["mode"] == "enforcing"
        sb.delete_egress_rules(["*.cdn.example.org"])
        assert rules(sb.get_egress_policy()) == [("allow", "files.example.org")]
        # PUT replaces the whole policy; {} is allow-all.
        r = api.put(f"/v1/sandboxes/{sb.id}/networkpolicy", json={})
        assert r.status_code == 200, r.text
        assert r.json()["mode"] == "allow_all"
        policy = sb.get_egress_policy()
        assert (policy.default_action, rules(policy)) == ("allow", [])
        assert "PATCH through the lifecycle API" in events(api, sb.id)
    finally:
        sb.kill()
        sb.close()
        manager.delete_template(template.template_id)
