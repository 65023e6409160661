"""`secureAccess: true` through the unmodified OpenSandbox SDK: `SandboxSync.create(...,
secure_access=True)` gets endpoints whose `headers` carry the sandbox's
`OpenSandbox-Secure-Access` token, the SDK sends them with every request (node proxy and
server proxy alike), and a raw request without the header is refused with 401."""

from __future__ import annotations

import time
from collections.abc import Iterator

import fastbox_server as fb
import httpx
import pytest

SECURE_HEADER = "OpenSandbox-Secure-Access"
DENIED = "SANDBOX::SECURE_ACCESS_DENIED"


@pytest.fixture
def raw() -> Iterator[httpx.Client]:
    """Plain client for node-proxy and server-proxy URLs (no default headers)."""
    with httpx.Client(timeout=30, trust_env=False) as c:
        yield c


def header(headers: dict[str, str], name: str) -> str | None:
    return next((v for k, v in headers.items() if k.lower() == name.lower()), None)


def assert_denied(r: httpx.Response) -> None:
    assert r.status_code == 401, f"{r.request.url} -> {r.status_code} {r.text[:300]}"
    doc = r.json()
    assert doc.get("code") == DENIED and doc.get("message"), doc


@pytest.mark.parametrize("use_server_proxy", [False, True], ids=["node-proxy", "server-proxy"])
def test_sdk_runs_commands_in_a_secure_sandbox(
    fastbox: fb.FastboxServer, raw: httpx.Client, use_server_proxy: bool
) -> None:
    sb = fastbox.create_sandbox(
        secure_access=True,
        use_server_proxy=use_server_proxy,
        metadata={"fbt-suite": "secure-access"},
    )
    try:
        ep = sb.get_endpoint(fb.EXECD_PORT)
        token = header(ep.headers, SECURE_HEADER)
        assert token and len(token) == 43, ep.headers

        # The SDK works unmodified: it sends the endpoint's headers with every request.
        assert sb.is_healthy()
        ex = sb.commands.run("echo secure-$((6*7))")
        assert ex.error is None, ex.error
        assert fb.lines(ex.logs.stdout) == ["secure-42"]
        sb.files.write_file("/tmp/fbt-secure.txt", "kept")
        assert sb.files.read_file("/tmp/fbt-secure.txt") == "kept"

        # A raw request with everything but the access token is refused; with it, it passes.
        url = f"http://{ep.endpoint}/ping"
        base = {fb.EXECD_TOKEN_HEADER: ep.headers[fb.EXECD_TOKEN_HEADER]}
        if use_server_proxy:
            base[fb.API_KEY_HEADER] = fastbox.api_key
        assert_denied(raw.get(url, headers=base))
        assert_denied(raw.get(url, headers={**base, SECURE_HEADER: "x" * 43}))
        assert raw.get(url, headers={**base, SECURE_HEADER: token}).status_code == 200
    finally:
        sb.kill()
        sb.close()


def test_signed_endpoint_of_a_secure_sandbox(
    fastbox: fb.FastboxServer, raw: httpx.Client
) -> None:
    sb = fastbox.create_sandbox(secure_access=True, metadata={"fbt-suite": "secure-access"})
    try:
        plain = sb.get_endpoint(fb.EXECD_PORT)
        expires = int(time.time()) + 300
        signed = sb.get_signed_endpoint(fb.EXECD_PORT, expires)
        # The signed route is the credential: its endpoint does not hand out the token.
        assert header(signed.headers, SECURE_HEADER) is None, signed.headers
        execd = {fb.EXECD_TOKEN_HEADER: signed.headers[fb.EXECD_TOKEN_HEADER]}
        assert raw.get(f"http://{signed.endpoint}/ping", headers=execd).status_code == 200
        # Its signature segments stripped, it is the plain route, which needs the header.
        stripped = signed.endpoint.rsplit("/", 2)[0]
        assert stripped == plain.endpoint, (stripped, plain.endpoint)
        assert_denied(raw.get(f"http://{stripped}/ping", headers=execd))
        # A route signed for the sandbox's other port does not open this one.
        other = sb.get_signed_endpoint(8080, expires).endpoint
        exp_sig = "/".join(other.rsplit("/", 2)[1:])
        assert_denied(raw.get(f"http://{plain.endpoint}/{exp_sig}/ping", headers=execd))
    finally:
        sb.kill()
        sb.close()


def test_sandboxes_without_secure_access_stay_open(
    fastbox: fb.FastboxServer, raw: httpx.Client
) -> None:
    sb = fastbox.create_sandbox(metadata={"fbt-suite": "secure-access"})
    try:
        ep = sb.get_endpoint(fb.EXECD_PORT)
        assert header(ep.headers, SECURE_HEADER) is None, ep.headers
        execd = {fb.EXECD_TOKEN_HEADER: ep.headers[fb.EXECD_TOKEN_HEADER]}
        assert raw.get(f"http://{ep.endpoint}/ping", headers=execd).status_code == 200
    finally:
        sb.kill()
        sb.close()
