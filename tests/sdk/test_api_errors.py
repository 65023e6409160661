"""Raw-HTTP checks of `fastbox up`'s lifecycle API, node proxy and server proxy: every bad input
gets a clear 4xx with the `{"code","message"}` envelope and changes nothing; auth, request ids,
signed routes, access tokens and the files API's path handling."""

from __future__ import annotations

import copy
import re
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fastbox_server as fb
import httpx
import pytest
from opensandbox.exceptions import SandboxApiException, SandboxException
from opensandbox.models.sandboxes import NetworkPolicy, NetworkRule, SandboxFilter
from opensandbox.sync.manager import SandboxManagerSync
from opensandbox.sync.sandbox import SandboxSync

INVALID_PARAMETER = "SANDBOX::INVALID_PARAMETER"
API_NOT_SUPPORTED = "SANDBOX::API_NOT_SUPPORTED"
METADATA_CODES = {INVALID_PARAMETER, "SANDBOX::INVALID_METADATA_LABEL"}
UNKNOWN_ID = "no-such-sandbox-fbt"
UNKNOWN_UUID = "00000000-0000-4000-8000-000000000000"
DROP = object()

VALID_BODY: dict[str, Any] = {
    "image": {"uri": fb.TEST_IMAGE},
    "entrypoint": ["tail", "-f", "/dev/null"],
    "timeout": 600,
    "resourceLimits": {"cpu": "1", "memory": "512Mi"},
    "secureAccess": False,
}


def body(**changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(VALID_BODY)
    for k, v in changes.items():
        if v is DROP:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def assert_error(
    r: httpx.Response,
    status: int,
    codes: set[str] | None = None,
    *,
    request_id: bool = True,
) -> dict[str, Any]:
    """r is a `status` answer with the `{"code","message"}` envelope (code in codes if given)."""
    where = f"{r.request.method} {r.request.url}"
    assert r.status_code == status, f"{where} -> {r.status_code} {r.text[:500]}"
    assert r.headers.get("content-type", "").startswith("application/json"), (
        f"{where}: content-type {r.headers.get('content-type')!r}, body {r.text[:300]}"
    )
    doc = r.json()
    assert isinstance(doc, dict), doc
    assert isinstance(doc.get("code"), str) and doc["code"], doc
    assert isinstance(doc.get("message"), str) and doc["message"], doc
    assert fb.find_nulls(doc) == [], doc
    if codes is not None:
        assert doc["code"] in codes, f"{where}: code {doc['code']!r}, expected one of {codes}"
    if request_id:
        assert r.headers.get("x-request-id"), f"{where}: no X-Request-ID"
    return doc


def sandbox_ids(server: fb.FastboxServer, api: httpx.Client) -> set[str]:
    return {item["id"] for item in server.list_all(api)}


@pytest.fixture(scope="module")
def sandbox(fastbox: fb.FastboxServer) -> Iterator[SandboxSync]:
    sb = fastbox.create_sandbox(metadata={"fbt-suite": "api-errors"})
    yield sb
    sb.kill()
    sb.close()


@pytest.fixture
def node() -> Iterator[httpx.Client]:
    """Plain client for node-proxy and server-proxy URLs (no default headers)."""
    with httpx.Client(timeout=30, trust_env=False) as c:
        yield c


def endpoint(api: httpx.Client, sid: str, port: int, **params: str) -> dict[str, Any]:
    r = api.get(f"/v1/sandboxes/{sid}/endpoints/{port}", params=params)
    assert r.status_code == 200, f"endpoint {port} {params}: {r.status_code} {r.text}"
    doc = r.json()
    assert isinstance(doc.get("endpoint"), str) and "://" not in doc["endpoint"], doc
    return doc


# --------------------------------------------------------------------------- unauthenticated
def test_health_version_openapi_without_key(fastbox: fb.FastboxServer) -> None:
    with fastbox.http(api_key=None) as c:
        r = c.get("/health")
        assert r.status_code == 200 and r.json() == {"status": "healthy"}, r.text
        assert r.headers.get("x-request-id")

        r = c.get("/version")
        assert r.status_code == 200, r.text
        assert isinstance(r.json().get("version"), str) and r.json()["version"]

        r = c.get("/openapi.json")
        assert r.status_code == 200, r.text
        doc = r.json()
        assert "/v1/sandboxes" in doc["paths"], sorted(doc["paths"])


# --------------------------------------------------------------------------- auth and request ids
def test_missing_and_wrong_api_key(fastbox: fb.FastboxServer, api: httpx.Client) -> None:
    before = sandbox_ids(fastbox, api)
    rid = "fbt-" + secrets.token_hex(8)
    with fastbox.http(api_key=None) as c:
        r = c.get("/v1/sandboxes", headers={"X-Request-ID": rid})
        assert_error(r, 401, {"MISSING_API_KEY"})
        assert r.headers["x-request-id"] == rid
        assert_error(c.post("/v1/sandboxes", json=body()), 401, {"MISSING_API_KEY"})
    with fastbox.http(api_key="wrong-" + secrets.token_hex(8)) as c:
        r = c.get("/v1/sandboxes", headers={"X-Request-ID": rid})
        assert_error(r, 401, {"INVALID_API_KEY"})
        assert r.headers["x-request-id"] == rid
        assert_error(c.post("/v1/sandboxes", json=body()), 401, {"INVALID_API_KEY"})
        assert_error(c.delete(f"/v1/sandboxes/{UNKNOWN_UUID}"), 401, {"INVALID_API_KEY"})
    assert sandbox_ids(fastbox, api) == before


def test_request_id_echoed_and_generated(api: httpx.Client) -> None:
    rid = "fbt-" + secrets.token_hex(8)
    r = api.get("/v1/sandboxes", headers={"X-Request-ID": rid})
    assert r.status_code == 200
    assert r.headers.get("x-request-id") == rid

    rid404 = "fbt-" + secrets.token_hex(8)
    r = api.get(f"/v1/sandboxes/{UNKNOWN_ID}", headers={"X-Request-ID": rid404})
    assert_error(r, 404)
    assert r.headers["x-request-id"] == rid404

    first = api.get("/v1/sandboxes").headers.get("x-request-id")
    second = api.get("/v1/sandboxes").headers.get("x-request-id")
    assert first and second and first != second, (first, second)


def test_unknown_sandbox_is_404(fastbox: fb.FastboxServer, api: httpx.Client) -> None:
    before = sandbox_ids(fastbox, api)
    for sid in (UNKNOWN_ID, UNKNOWN_UUID):
        assert_error(api.get(f"/v1/sandboxes/{sid}"), 404)
        assert_error(api.delete(f"/v1/sandboxes/{sid}"), 404)
    assert sandbox_ids(fastbox, api) == before


def test_sdk_surfaces_api_errors(fastbox: fb.FastboxServer, manager: SandboxManagerSync) -> None:
    with pytest.raises(SandboxApiException) as ei:
        manager.get_sandbox_info(UNKNOWN_ID)
    assert ei.value.status_code == 404
    assert ei.value.request_id

    bad = SandboxManagerSync.create(fastbox.connection_config(api_key="wrong-key"))
    try:
        with pytest.raises(SandboxApiException) as ei:
            bad.list_sandbox_infos(SandboxFilter())
        assert ei.value.status_code == 401
        assert ei.value.error.code == "INVALID_API_KEY"
    finally:
        bad.close()

    with pytest.raises(SandboxApiException) as ei:
        SandboxSync.create(
            fb.TEST_IMAGE,
            network_policy=NetworkPolicy(
                default_action="deny", egress=[NetworkRule(action="allow", target="bad target!")]
            ),
            connection_config=fastbox.connection_config(),
        )
    assert ei.value.status_code == 400
    assert ei.value.error.code == INVALID_PARAMETER
    assert "egress[0]" in str(ei.value.error.message)


# --------------------------------------------------------------------------- invalid creates
@pytest.mark.parametrize(
    ("payload", "codes"),
    [
        pytest.param(body(image={"uri": "fbt-no-such-image:0"}), None, id="unknown-image"),
        pytest.param(body(timeout=10), {INVALID_PARAMETER}, id="timeout-10"),
        pytest.param(body(resourceLimits={"cpu": "lots"}), {INVALID_PARAMETER}, id="cpu-lots"),
        pytest.param(
            body(resourceLimits={"cpu": "1", "memory": "plenty"}),
            {INVALID_PARAMETER},
            id="memory-plenty",
        ),
        pytest.param(body(metadata={"bad key!": "v"}), METADATA_CODES, id="metadata-bad-key"),
        pytest.param(body(metadata={"k": "v" * 64}), METADATA_CODES, id="metadata-value-64"),
        pytest.param(
            body(metadata={"opensandbox.io/owner": "me"}),
            METADATA_CODES,
            id="metadata-reserved-prefix",
        ),
        pytest.param(body(entrypoint=DROP), {INVALID_PARAMETER}, id="missing-entrypoint"),
        pytest.param(body(entrypoint=[]), {INVALID_PARAMETER}, id="empty-entrypoint"),
        pytest.param(body(image=DROP), {INVALID_PARAMETER}, id="missing-image"),
        pytest.param(body(image=fb.TEST_IMAGE), {INVALID_PARAMETER}, id="image-not-an-object"),
        pytest.param(
            b'{"image": {"uri": "python:3.12"}, "entrypoint": [',
            {INVALID_PARAMETER},
            id="malformed-json",
        ),
        pytest.param(
            body(
                networkPolicy={
                    "defaultAction": "deny",
                    "egress": [{"action": "allow", "target": "10.0.0.1/24"}],
                }
            ),
            {INVALID_PARAMETER},
            id="network-policy-host-bits",
        ),
    ],
)
def test_create_rejects_invalid_body(
    fastbox: fb.FastboxServer,
    api: httpx.Client,
    payload: dict[str, Any] | bytes,
    codes: set[str] | None,
) -> None:
    before = sandbox_ids(fastbox, api)
    if isinstance(payload, bytes):
        r = api.post(
            "/v1/sandboxes", content=payload, headers={"Content-Type": "application/json"}
        )
    else:
        r = api.post("/v1/sandboxes", json=payload)
    assert_error(r, 400, codes)
    assert sandbox_ids(fastbox, api) == before, "a rejected create left a sandbox behind"


# --------------------------------------------------------------------------- response shape
def test_responses_have_no_nulls(api: httpx.Client, sandbox: SandboxSync) -> None:
    r = api.get(f"/v1/sandboxes/{sandbox.id}")
    assert r.status_code == 200, r.text
    doc = r.json()
    assert fb.find_nulls(doc) == [], doc
    assert {"id", "status", "entrypoint", "createdAt"} <= doc.keys(), doc
    assert doc["status"]["state"] == "Running"
    for path, params in (
        ("/v1/sandboxes", {}),
        (f"/v1/sandboxes/{sandbox.id}/endpoints/{fb.EXECD_PORT}", {"use_server_proxy": "false"}),
        (f"/v1/sandboxes/{sandbox.id}/endpoints/{fb.EXECD_PORT}", {"use_server_proxy": "true"}),
    ):
        r = api.get(path, params=params)
        assert r.status_code == 200, f"{path}: {r.status_code} {r.text}"
        assert fb.find_nulls(r.json()) == [], f"{path}: {r.json()}"


# --------------------------------------------------------------------------- files API paths
def test_files_path_escape_stays_inside_sandbox(sandbox: SandboxSync) -> None:
    marker = f"escape-{secrets.token_hex(6)}"
    host_path = Path("/tmp") / marker
    assert not host_path.exists()
    try:
        sandbox.files.write_file(f"/../../../tmp/{marker}", "inside-the-sandbox\n")
        assert not host_path.exists(), f"the files API wrote to the host's {host_path}"
        assert sandbox.files.read_file(f"/tmp/{marker}") == "inside-the-sandbox\n"
        ex = sandbox.commands.run(f"cat /tmp/{marker}")
        assert fb.lines(ex.logs.stdout) == ["inside-the-sandbox"]
    finally:
        if host_path.exists():
            host_path.unlink()


def test_files_etc_hostname_is_the_sandboxes(sandbox: SandboxSync) -> None:
    via_files = sandbox.files.read_file("/etc/hostname").strip()
    ex = sandbox.commands.run("cat /etc/hostname")
    assert fb.lines(ex.logs.stdout) == [via_files]
    host_file = Path("/etc/hostname")
    host_names = {socket.gethostname()}
    if host_file.exists():
        host_names.add(host_file.read_text().strip())
    assert via_files and via_files not in host_names, (via_files, host_names)


def test_files_relative_paths_stay_inside_the_sandbox(sandbox: SandboxSync) -> None:
    """Relative paths resolve against the sandbox's working directory (the SDK documents them
    as "relative to the sandbox working directory"), never against anything on the host."""
    name = f"fbt-relative-{secrets.token_hex(4)}.txt"
    sandbox.files.write_file(name, "inside")
    (cwd,) = fb.lines(sandbox.commands.run("pwd").logs.stdout)
    assert sandbox.files.read_file(f"{cwd.rstrip('/')}/{name}") == "inside"
    assert not (Path.cwd() / name).exists() and not (Path("/") / name).exists()
    hostname = sandbox.files.read_file("../../../../etc/hostname").strip()
    assert fb.lines(sandbox.commands.run("cat /etc/hostname").logs.stdout) == [hostname]


# --------------------------------------------------------------------------- endpoints
def test_signed_endpoint(
    fastbox: fb.FastboxServer, api: httpx.Client, node: httpx.Client, sandbox: SandboxSync
) -> None:
    sid = sandbox.id
    expires = int(time.time()) + 300
    ep = endpoint(api, sid, fb.EXECD_PORT, expires=str(expires))
    signed = ep["endpoint"]
    headers = ep.get("headers", {})
    m = re.fullmatch(
        rf"127\.0\.0\.1:{fastbox.node_proxy_port}/{re.escape(sid)}/{fb.EXECD_PORT}/"
        rf"{fb.b36(expires)}/([^/]{{9}})",
        signed,
    )
    assert m, f"signed endpoint {signed!r} is not 127.0.0.1:P2/id/port/expires_b36/sig9"
    sig = m.group(1)
    assert sandbox.get_signed_endpoint(fb.EXECD_PORT, expires).endpoint == signed

    assert node.get(f"http://{signed}/ping", headers=headers).status_code == 200

    tampered = signed[: -len(sig)] + ("1" if sig[0] != "1" else "2") + sig[1:]
    assert node.get(f"http://{tampered}/ping", headers=headers).status_code == 403
    other_expiry = signed.replace(f"/{fb.b36(expires)}/", f"/{fb.b36(expires + 1)}/")
    assert node.get(f"http://{other_expiry}/ping", headers=headers).status_code == 403


def test_signed_endpoint_expired_or_with_server_proxy(
    api: httpx.Client, node: httpx.Client, sandbox: SandboxSync
) -> None:
    sid = sandbox.id
    url = f"/v1/sandboxes/{sid}/endpoints/{fb.EXECD_PORT}"
    r = api.get(url, params={"expires": str(int(time.time()) - 60)})
    if r.status_code == 200:  # issued, but the node proxy must refuse it
        ep = r.json()
        got = node.get(f"http://{ep['endpoint']}/ping", headers=ep.get("headers", {}))
        assert got.status_code == 403, got.text
    else:
        assert_error(r, 400)

    r = api.get(
        url, params={"use_server_proxy": "true", "expires": str(int(time.time()) + 300)}
    )
    assert_error(r, 400, {INVALID_PARAMETER})


def test_server_proxy_requires_api_key(
    fastbox: fb.FastboxServer, api: httpx.Client, node: httpx.Client, sandbox: SandboxSync
) -> None:
    sid = sandbox.id
    ep = endpoint(api, sid, fb.EXECD_PORT, use_server_proxy="true")
    assert ep["endpoint"] == f"{fastbox.domain}/v1/sandboxes/{sid}/proxy/{fb.EXECD_PORT}"
    headers = ep.get("headers", {})
    path = f"/v1/sandboxes/{sid}/proxy/{fb.EXECD_PORT}/ping"
    with fastbox.http(api_key=None) as c:
        assert_error(c.get(path, headers=headers), 401, {"MISSING_API_KEY"})
    assert api.get(path, headers=headers).status_code == 200
    r = node.get(
        f"http://{ep['endpoint']}/ping", headers={**headers, fb.API_KEY_HEADER: fastbox.api_key}
    )
    assert r.status_code == 200


def test_egress_endpoint_needs_its_token(
    api: httpx.Client, node: httpx.Client, sandbox: SandboxSync
) -> None:
    ep = endpoint(api, sandbox.id, fb.EGRESS_PORT, use_server_proxy="false")
    url = f"http://{ep['endpoint']}/policy"
    assert_error(node.get(url), 401, {"EGRESS::UNAUTHORIZED"}, request_id=False)
    r = node.get(url, headers=ep.get("headers", {}))
    assert r.status_code == 200, r.text
    assert r.json()["mode"] == "allow_all"
    assert sandbox.get_egress_policy().default_action == "allow"


def test_execd_requires_access_token(api: httpx.Client, node: httpx.Client, sandbox: SandboxSync) -> None:
    ep = endpoint(api, sandbox.id, fb.EXECD_PORT, use_server_proxy="false")
    headers = ep.get("headers", {})
    assert headers.get(fb.EXECD_TOKEN_HEADER), f"endpoint headers carry no execd token: {headers}"
    url = f"http://{ep['endpoint']}/ping"
    assert node.get(url).status_code == 401
    assert node.get(url, headers={fb.EXECD_TOKEN_HEADER: "wrong-token"}).status_code == 401
    assert node.get(url, headers=headers).status_code == 200


def test_isolated_sessions_are_reported_unavailable(fastbox: fb.FastboxServer) -> None:
    """Isolated sessions are not offered yet: the SDK's capabilities call says so (as the
    spec has it when isolation is unavailable), and a session call is a 503 NOT_SUPPORTED."""
    sb = fastbox.create_sandbox()
    try:
        caps = sb.isolation.capabilities()
        assert caps.available is False and caps.message, caps
        with pytest.raises(SandboxException) as refused:
            sb.isolation.list()
        assert "503" in str(refused.value) or "NOT_SUPPORTED" in str(refused.value), refused.value
    finally:
        sb.kill()
        sb.close()
