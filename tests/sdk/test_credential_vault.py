"""The Credential Vault through the official SDK (`credentialProxy` at create, then
`sandbox.credential_vault`), against TLS hosts of a test internet (`lab_internet.py`) that
record what they receive out of band.

This module's server asks the lab's DNS server for names (`--dns-upstream`) and trusts the
lab's CA for bound hosts (`--credential-proxy-roots`). The lab has:
- `vault.test`: the real host, its certificate from that CA;
- an impostor, with a certificate for the same names from a CA nobody trusts, at the
  address DNS gives `spoofed.test`;
- `plain.test`, a plain HTTP host.
Sandboxes make their requests with Python's `ssl` defaults (the system trust store), as any
client in them would.
"""

from __future__ import annotations

import secrets
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import fastbox_server as fb
import httpx
import pytest
from lab_internet import LabInternet, LabCa
from opensandbox.exceptions import SandboxException
from opensandbox.models.sandboxes import CredentialProxyConfig, NetworkPolicy, NetworkRule
from opensandbox.sync.sandbox import SandboxSync

VAULT = "vault.test"
SPOOFED = "spoofed.test"
PLAIN = "plain.test"
REDACTED = "200 Bearer [REDACTED] | echo: Bearer [REDACTED]"

# The request the sandboxes make (shared with the Rust end-to-end test).
HTTPS = (Path(__file__).parent / "https_probe.py").read_text()


@pytest.fixture(scope="module")
def lab() -> Iterator[LabInternet]:
    reason = fb.skip_reason()
    if reason:
        pytest.skip(reason)
    workdir = Path(tempfile.mkdtemp(prefix="fastbox-sdk-lab-"))
    lab = LabInternet(fb.session_prefix(), workdir)
    trusted, untrusted = LabCa("fastbox sdk lab CA"), LabCa("an impostor's CA")
    (workdir / "roots.pem").write_bytes(trusted.pem())
    lab.start(
        zone={VAULT: lab.host(10), SPOOFED: lab.host(11), PLAIN: lab.host(12)},
        tls_hosts={
            "real": (lab.host(10), *trusted.issue([VAULT, SPOOFED])),
            "impostor": (lab.host(11), *untrusted.issue([VAULT, SPOOFED])),
        },
        http_hosts={"plain": lab.host(12)},
    )
    yield lab
    lab.stop()


@pytest.fixture(scope="module")
def fastbox(request: pytest.FixtureRequest, lab: LabInternet) -> fb.FastboxServer:
    """This module's own `fastbox up`, its names resolved and its bound hosts trusted by the lab."""
    return fb.module_server(
        request,
        "test_credential_vault",
        ["--dns-upstream", lab.dns, "--credential-proxy-roots", str(lab.dir / "roots.pem")],
    )


def create(fastbox: fb.FastboxServer, **kw: object) -> SandboxSync:
    return fastbox.create_sandbox(
        network_policy=NetworkPolicy(
            default_action="deny",
            egress=[NetworkRule(action="allow", target=VAULT),
                    NetworkRule(action="allow", target=SPOOFED),
                    NetworkRule(action="allow", target=PLAIN)],
        ),  # fmt: skip
        credential_proxy=CredentialProxyConfig(enabled=True),
        **kw,
    )


def https(sb: SandboxSync, args: str, env: str = "") -> str:
    ex = sb.commands.run(f"{env} python3 /tmp/https.py {args}")
    assert ex.exit_code == 0, (fb.lines(ex.logs.stdout), fb.lines(ex.logs.stderr))
    return "\n".join(fb.lines(ex.logs.stdout)).strip()


def test_bound_hosts_get_the_credential_and_the_sandbox_never_holds_it(
    fastbox: fb.FastboxServer, lab: LabInternet, api: httpx.Client
) -> None:
    secret = "fbv-" + secrets.token_hex(12)
    # Joined at run time: the sandbox's memory holds the marker, no file or record does.
    marker = "fbv-sdk-marker-7654321"
    t0 = time.monotonic()
    sb = create(
        fastbox,
        entrypoint=["python3", "-c",
                    "import time\nm = 'fbv-sdk-' + 'marker-' + str(7654321)\ntime.sleep(10**7)"],
    )  # fmt: skip
    print(f"[vault] a credentialProxy sandbox ready in {time.monotonic() - t0:.3f}s")
    try:
        sb.files.write_file("/tmp/https.py", HTTPS)
        state = sb.credential_vault.create(
            credentials=[{"name": "token", "source": {"type": "inline", "value": secret}}],
            bindings=[{"name": "api", "match": {"hosts": [VAULT, SPOOFED]},
                       "auth": {"type": "bearer", "credential": "token"}}],
        )  # fmt: skip
        assert [c.name for c in state.credentials] == ["token"]
        assert secret not in state.model_dump_json()
        assert secret not in sb.credential_vault.get().model_dump_json()

        # Injected on the way out (the host records it), redacted on the way back.
        assert https(sb, VAULT) == REDACTED
        injected = f"GET /user/repos?per_page=1 authorization=Bearer {secret}"
        assert lab.received("real") == [injected]
        # Aimed at the impostor's address: the proxy goes to the name's own address.
        assert https(sb, f"{VAULT} {lab.host(11)}") == REDACTED
        assert lab.received("real") == [injected, injected]
        # DNS answers a bound name with the impostor: its certificate fails, nothing is sent.
        spoofed = https(sb, SPOOFED)
        assert spoofed.startswith("502 "), spoofed
        assert lab.received("impostor") == []

        # A pause dumps every process's memory; with its writable layer, the instance's
        # state and logs, no file holds the secret.
        sb.pause()
        fb.wait_until(
            lambda: api.get(f"/v1/sandboxes/{sb.id}").json()["status"]["state"] == "Paused",
            timeout=120,
            what="paused",
        )
        assert fastbox.data_dir is not None
        assert fb.files_holding(fastbox.data_dir, marker.encode()), (
            "the pause's dump holds the sandbox's memory marker (else the search proves nothing)"
        )
        assert fb.files_holding(fastbox.data_dir, secret.encode()) == []
        assert fastbox.log_path is not None and secret not in fastbox.log_path.read_text()

        # Resumed on its node: the vault is still there, and still injects.
        sb = SandboxSync.resume(sb.id, connection_config=fastbox.connection_config())
        assert [b.name for b in sb.credential_vault.list_bindings()] == ["api"]
        assert https(sb, VAULT) == REDACTED
        assert lab.received("real")[-1] == injected
    finally:
        sb.kill()
        sb.close()


def test_the_vault_is_the_sandboxs_own_and_answers_clearly(
    fastbox: fb.FastboxServer, lab: LabInternet, api: httpx.Client
) -> None:
    # credentialProxy needs a network policy.
    r = api.post(
        "/v1/sandboxes",
        json={
            "image": {"uri": fb.TEST_IMAGE},
            "entrypoint": ["tail", "-f", "/dev/null"],
            "credentialProxy": {"enabled": True},
            "metadata": {"fbt-run": fastbox.prefix},
        },
    )
    assert r.status_code == 400 and "networkPolicy" in r.text, r.text
    a, b = create(fastbox), create(fastbox)
    try:
        a.credential_vault.create(
            credentials=[{"name": "t", "source": {"type": "inline", "value": "a-only"}}],
            bindings=[{"name": "api", "match": {"hosts": [VAULT]},
                       "auth": {"type": "bearer", "credential": "t"}}],
        )  # fmt: skip
        # Each sandbox its own vault: b has none, and its HTTPS passes untouched, to the real
        # host and its own certificate (which b trusts only when told to: the lab's CA).
        with pytest.raises(SandboxException) as none:
            b.credential_vault.get()
        assert "404" in str(none.value) or "no Credential Vault" in str(none.value), none.value
        b.files.write_file("/tmp/https.py", HTTPS)
        b.files.write_file("/tmp/lab-ca.pem", (lab.dir / "roots.pem").read_text())
        before = len(lab.received("real"))
        assert "CERTIFICATE_VERIFY_FAILED" in https(b, VAULT)
        assert https(b, VAULT, env="LAB_CA=/tmp/lab-ca.pem") == (
            "200 Bearer sandbox-placeholder | echo: Bearer sandbox-placeholder"
        )
        assert lab.received("real")[before:] == [
            "GET /user/repos?per_page=1 authorization=Bearer sandbox-placeholder"
        ]
        # A binding naming a missing credential is refused and changes nothing.
        with pytest.raises(SandboxException):
            a.credential_vault.patch(
                bindings={"add": [{"name": "bad", "match": {"hosts": [SPOOFED]},
                                      "auth": {"type": "bearer", "credential": "missing"}}]},
            )  # fmt: skip
        assert [x.name for x in a.credential_vault.list_bindings()] == ["api"]
    finally:
        for sb in (a, b):
            sb.kill()
            sb.close()


def test_plain_http_is_injected_only_for_a_binding_that_asks_for_it(
    fastbox: fb.FastboxServer, lab: LabInternet
) -> None:
    secret = "fbv-" + secrets.token_hex(12)
    sb = create(fastbox)
    try:
        sb.credential_vault.create(
            credentials=[{"name": "t", "source": {"type": "inline", "value": secret}}],
            bindings=[{"name": "api", "match": {"hosts": [PLAIN]},
                       "auth": {"type": "bearer", "credential": "t"}}],
        )  # fmt: skip
        get = (
            "python3 -c \"import urllib.request as u; r = u.urlopen(u.Request("
            f"'http://{PLAIN}/v1', headers={{'Authorization': 'Bearer sandbox-placeholder'}}),"
            " timeout=15); print(r.read().decode())\""
        )

        def fetch() -> str:
            ex = sb.commands.run(get)
            assert ex.exit_code == 0, (fb.lines(ex.logs.stdout), fb.lines(ex.logs.stderr))
            return "\n".join(fb.lines(ex.logs.stdout))

        # A binding takes HTTPS only unless it names `http`: plain HTTP passes untouched.
        assert fetch() == "echo: Bearer sandbox-placeholder"
        assert lab.received("plain") == ["GET /v1 authorization=Bearer sandbox-placeholder"]
        sb.credential_vault.patch(
            bindings={"replace": [{"name": "api",
                                   "match": {"hosts": [PLAIN], "schemes": ["http"]},
                                   "auth": {"type": "bearer", "credential": "t"}}]},
        )  # fmt: skip
        assert fetch() == "echo: Bearer [REDACTED]"
        assert lab.received("plain")[-1] == f"GET /v1 authorization=Bearer {secret}"
    finally:
        sb.kill()
        sb.close()


def test_a_fork_keeps_the_proxy_and_gets_a_vault_of_its_own(
    fastbox: fb.FastboxServer, lab: LabInternet, api: httpx.Client
) -> None:
    secret = "fbv-" + secrets.token_hex(12)
    source = create(fastbox)
    forks: list[str] = []
    try:
        source.files.write_file("/tmp/https.py", HTTPS)
        source.credential_vault.create(
            credentials=[{"name": "t", "source": {"type": "inline", "value": secret}}],
            bindings=[{"name": "api", "match": {"hosts": [VAULT]},
                       "auth": {"type": "bearer", "credential": "t"}}],
        )  # fmt: skip
        r = api.post(f"/v1/sandboxes/{source.id}/fork", json={"count": 1})
        assert r.status_code == 202, r.text
        forks = [item["id"] for item in r.json()["items"]]
        fb.wait_until(
            lambda: api.get(f"/v1/sandboxes/{forks[0]}").json()["status"]["state"] == "Running",
            timeout=120,
            what="the fork running",
        )
        fork = SandboxSync.connect(forks[0], connection_config=fastbox.connection_config())
        # Its own vault, empty: the source's values are not copied.
        with pytest.raises(SandboxException):
            fork.credential_vault.get()
        # Its HTTPS still goes through the proxy (the source's CA is trusted in its memory and
        # files): unbound, the real host's certificate is not trusted, as in any proxied
        # sandbox; bound, its own vault injects.
        before = len(lab.received("real"))
        assert "CERTIFICATE_VERIFY_FAILED" in https(fork, VAULT)
        fork.credential_vault.create(
            credentials=[{"name": "t", "source": {"type": "inline", "value": "fork-own"}}],
            bindings=[{"name": "api", "match": {"hosts": [VAULT]},
                       "auth": {"type": "bearer", "credential": "t"}}],
        )  # fmt: skip
        assert https(fork, VAULT) == REDACTED
        assert lab.received("real")[before:] == [
            "GET /user/repos?per_page=1 authorization=Bearer fork-own"
        ]
        # The source's vault is untouched.
        assert https(source, VAULT) == REDACTED
        assert lab.received("real")[-1].endswith(f"Bearer {secret}")
    finally:
        for fid in forks:
            api.delete(f"/v1/sandboxes/{fid}")
        source.kill()
        source.close()
