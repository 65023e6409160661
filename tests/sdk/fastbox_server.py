"""Start, stop and clean up one `fastbox up` instance for the SDK suite, plus small helpers.

The server contract (what `fastbox up` must do) is in tests/sdk/README.md. Everything here is
plain Python so that conftest.py and the test modules share one implementation.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from opensandbox.config import ConnectionConfigSync
from opensandbox.models.diagnostics import DiagnosticContent
from opensandbox.models.execd import OutputMessage
from opensandbox.sync.sandbox import SandboxSync

REPO = Path(os.environ.get("FASTBOX_REPO") or Path(__file__).resolve().parents[2])
TEST_IMAGE = "python:3.12"
EXECD_PORT = 44772
EGRESS_PORT = 18080
API_KEY_HEADER = "OPEN-SANDBOX-API-KEY"
EXECD_TOKEN_HEADER = "X-EXECD-ACCESS-TOKEN"
HEALTH_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
DELETE_SETTLE_S = 30.0
# The suite's tag letter: appended to FASTBOX_TEST_PREFIX so host-wide names never collide with
# the cargo tests of the same run.
PREFIX_TAG = "s"
FINAL_STATES = {"Terminated", "Failed"}

T = TypeVar("T")


class ServerError(Exception):
    """`fastbox up` could not be started (the message carries the server's output)."""


def fastbox_bin() -> Path:
    return Path(os.environ.get("FASTBOX_BIN") or REPO / "target" / "debug" / "fastbox")


def skip_reason() -> str | None:
    """Why the suite cannot run on this machine, or None."""
    if os.geteuid() != 0:
        return "the SDK suite starts `fastbox up`, which needs root (run it with sudo)"
    b = fastbox_bin()
    if not b.is_file() or not os.access(b, os.X_OK):
        return (
            f"no fastbox binary at {b} (build it with `cargo build -p fastbox-cli`, "
            "or point FASTBOX_BIN at one)"
        )
    return None


@functools.cache
def session_prefix() -> str:
    """`$FASTBOX_TEST_PREFIX` (default `fbt` + 4 hex digits) + the tag letter; one per session."""
    base = os.environ.get("FASTBOX_TEST_PREFIX") or "fbt" + secrets.token_hex(2)
    prefix = base + PREFIX_TAG
    if not re.fullmatch(r"[a-z0-9]{2,8}", prefix):
        raise ServerError(
            f"FASTBOX_TEST_PREFIX={base!r} gives prefix {prefix!r}; it must be at most 7 "
            "characters of [a-z0-9] so that prefix + tag letter fits in 8"
        )
    return prefix


def pool_for(prefix: str) -> str:
    """A /24 in 10.214.0.0/16 derived from the prefix, so parallel runs get different pools."""
    n = int(hashlib.sha256(prefix.encode()).hexdigest(), 16) % 254 + 1
    return f"10.214.{n}.0/24"


def free_port(exclude: set[int] | frozenset[int] = frozenset()) -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in exclude:
            return port


def b36(n: int) -> str:
    """Lowercase base 36 without leading zeros (the signed-route expiry encoding)."""
    if n < 0:
        raise ValueError(n)
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def find_nulls(value: Any, path: str = "$") -> list[str]:
    """JSON paths of every `null` in a decoded JSON document."""
    if value is None:
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in find_nulls(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in find_nulls(v, f"{path}[{i}]")]
    return []


def wait_until(
    fn: Callable[[], T | None],
    *,
    timeout: float,
    interval: float = 0.25,
    what: str = "condition",
) -> T:
    """Call fn until it returns something truthy; raise AssertionError after timeout seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = fn()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def lines(messages: list[OutputMessage]) -> list[str]:
    """Output events as lines, whether the server strips line terminators (fastbox, Go execd)
    or keeps them."""
    text = "".join(
        m.text if m.text.endswith(("\n", "\r")) else m.text + "\n" for m in messages
    )
    return text.replace("\r\n", "\n").replace("\r", "\n").splitlines()


def tail(path: Path | None, max_bytes: int = 16000) -> str:
    if path is None or not path.exists():
        return "(no output captured)"
    data = path.read_bytes()
    prefix = "...\n" if len(data) > max_bytes else ""
    return prefix + data[-max_bytes:].decode("utf-8", "replace")


def mounts_under(directory: Path) -> list[str]:
    root = str(directory.resolve())
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4:
                point = fields[4].replace("\\040", " ")
                if point == root or point.startswith(root + "/"):
                    found.append(point)
    return found


def check_leftovers(binary: Path, prefix: str) -> str | None:
    """Run `fastbox leftovers --prefix P`; None when clean, otherwise what it reported."""
    try:
        r = subprocess.run(
            [str(binary), "leftovers", "--prefix", prefix],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`fastbox leftovers --prefix {prefix}` could not run: {e}"
    out = (r.stdout + r.stderr).strip()
    if r.returncode == 0 and not r.stdout.strip():
        return None
    if r.returncode == 0:
        return f"`fastbox leftovers --prefix {prefix}` exited 0 but printed:\n{out}"
    if r.returncode == 1:
        return f"leaked host resources of prefix {prefix}:\n{out}"
    return f"`fastbox leftovers --prefix {prefix}` exited {r.returncode}:\n{out}"


# Prefixes of every server started in this session, for the session-end leftovers check, and
# those whose leftovers a module's cleanup already reported.
STARTED: dict[str, Path] = {}
REPORTED: set[str] = set()


class FastboxServer:
    """One `fastbox up` process with its own data dir, ports, API key and prefix."""

    def __init__(self, label: str, extra_args: list[str] | None = None) -> None:
        self.label = re.sub(r"[^A-Za-z0-9_.-]", "_", label)
        self.extra_args = list(extra_args or [])
        self.binary = fastbox_bin()
        self.prefix = session_prefix()
        self.pool = pool_for(self.prefix)
        self.api_key = "fbt-" + secrets.token_hex(16)
        self.port = free_port()
        self.node_proxy_port = free_port({self.port})
        self.cache_dir = Path(
            os.environ.get("FASTBOX_TEST_CACHE_DIR") or "/tmp/fastbox-test-cache"
        )
        self.data_dir: Path | None = None
        self.log_path: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None
        self._start_failed = False

    # ------------------------------------------------------------------ addresses and clients
    @property
    def domain(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"http://{self.domain}"

    def connection_config(
        self, *, use_server_proxy: bool = False, api_key: str | None = None
    ) -> ConnectionConfigSync:
        return ConnectionConfigSync(
            domain=self.domain,
            protocol="http",
            api_key=api_key if api_key is not None else self.api_key,
            use_server_proxy=use_server_proxy,
            request_timeout=timedelta(seconds=60),
        )

    def http(self, *, api_key: str | None | bool = True, **kw: Any) -> httpx.Client:
        """An httpx client for the lifecycle API; api_key=True uses the server's key, None or
        False sends no key, a string sends that key."""
        headers = dict(kw.pop("headers", {}))
        if api_key is True:
            headers[API_KEY_HEADER] = self.api_key
        elif isinstance(api_key, str):
            headers[API_KEY_HEADER] = api_key
        return httpx.Client(
            base_url=self.base_url, headers=headers, timeout=60, trust_env=False, **kw
        )

    def create_sandbox(
        self,
        *,
        use_server_proxy: bool = False,
        metadata: dict[str, str] | None = None,
        image: str = TEST_IMAGE,
        **kw: Any,
    ) -> SandboxSync:
        """SandboxSync.create with the suite's defaults; metadata always carries fbt-run."""
        kw.setdefault("timeout", timedelta(minutes=15))
        kw.setdefault("ready_timeout", timedelta(seconds=120))
        kw.setdefault("resource", {"cpu": "1", "memory": "1Gi"})
        t0 = time.monotonic()
        sb = SandboxSync.create(
            image,
            metadata={"fbt-run": self.prefix, **(metadata or {})},
            connection_config=self.connection_config(use_server_proxy=use_server_proxy),
            **kw,
        )
        print(
            f"[fastbox] sandbox {sb.id} ready in {time.monotonic() - t0:.2f}s "
            f"(use_server_proxy={use_server_proxy})",
            flush=True,
        )
        return sb

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        self.data_dir = Path(tempfile.mkdtemp(prefix=f"fastbox-sdk-{self.prefix}-"))
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        log_dir = REPO / "target" / "fastbox-test" / "sdk"
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            log_dir = self.data_dir.parent
        self.log_path = log_dir / f"{self.prefix}-{self.label}-{int(time.time())}.log"
        cmd = [
            str(self.binary),
            "up",
            "--listen", self.domain,
            "--node-proxy-listen", f"127.0.0.1:{self.node_proxy_port}",
            "--api-key", self.api_key,
            "--data-dir", str(self.data_dir),
            "--cache-dir", str(self.cache_dir),
            "--prefix", self.prefix,
            "--pool", self.pool,
            "--default-image", TEST_IMAGE,
            *self.extra_args,
        ]  # fmt: skip
        shown = " ".join("<api-key>" if a == self.api_key else a for a in cmd)
        print(f"\n[fastbox] {self.label}: starting {shown}", flush=True)
        print(f"[fastbox] server output: {self.log_path}", flush=True)
        self._log_file = open(self.log_path, "wb")  # noqa: SIM115 - closed in cleanup()
        STARTED[self.prefix] = self.binary
        t0 = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                env=os.environ.copy(),  # FASTBOX_CRIU, FASTBOX_EXECD_BIN, ... as given
                start_new_session=True,
            )
        except OSError as e:
            self._start_failed = True
            raise ServerError(f"cannot execute {self.binary}: {e}") from e
        try:
            self._wait_healthy(t0)
        except ServerError:
            self._start_failed = True
            raise

    def _wait_healthy(self, t0: float) -> None:
        assert self.proc is not None
        deadline = t0 + HEALTH_TIMEOUT_S
        next_report = t0 + 10
        last = "no answer yet"
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise ServerError(
                    f"`fastbox up` exited with status {rc} after {time.monotonic() - t0:.1f}s, "
                    f"before /health answered 200.\n--- server output ({self.log_path}) ---\n"
                    f"{tail(self.log_path)}"
                )
            try:
                r = httpx.get(f"{self.base_url}/health", timeout=2, trust_env=False)
                if r.status_code == 200:
                    try:
                        body = r.json()
                    except ValueError:
                        body = None
                    if not isinstance(body, dict) or body.get("status") != "healthy":
                        raise ServerError(
                            f"/health answered 200 with {r.text[:300]!r}, expected "
                            f'{{"status":"healthy"}}\n--- server output ---\n{tail(self.log_path)}'
                        )
                    print(
                        f"[fastbox] {self.label}: healthy after {time.monotonic() - t0:.1f}s "
                        f"(api {self.domain}, node proxy 127.0.0.1:{self.node_proxy_port}, "
                        f"prefix {self.prefix}, pool {self.pool})",
                        flush=True,
                    )
                    return
                last = f"{r.status_code} {r.text[:200]}"
            except httpx.TransportError as e:
                last = type(e).__name__
            now = time.monotonic()
            if now >= deadline:
                raise ServerError(
                    f"/health did not answer 200 within {HEALTH_TIMEOUT_S:.0f}s (last: {last})"
                    f"\n--- server output ({self.log_path}) ---\n{tail(self.log_path)}"
                )
            if now >= next_report:
                print(
                    f"[fastbox] {self.label}: waiting for /health ({now - t0:.0f}s, last: "
                    f"{last}); preparing {TEST_IMAGE} takes 60-90 s when it is not cached "
                    f"in {self.cache_dir}",
                    flush=True,
                )
                next_report = now + 10
            time.sleep(0.25)

    # ------------------------------------------------------------------ cleanup
    def cleanup(self) -> None:
        """Delete every sandbox through the API, SIGTERM the server, purge, check leftovers.

        Fails (pytest.fail) listing every problem, so a leak fails the suite."""
        errors: list[str] = []
        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    self._delete_all_sandboxes(errors)
                except Exception as e:  # noqa: BLE001 - report, then still purge
                    errors.append(f"deleting sandboxes through the API failed: {e!r}")
                self._stop(errors)
            elif not self._start_failed:
                errors.append(
                    f"`fastbox up` died during the tests (status {self.proc.returncode});"
                    f"\n--- server output ---\n{tail(self.log_path)}"
                )
        if self.data_dir is not None:
            self._purge(errors)
            leak = check_leftovers(self.binary, self.prefix)
            if leak:
                errors.append(leak)
            elif mounts := mounts_under(self.data_dir):
                errors.append(f"mounts left under {self.data_dir}: {mounts}")
            else:
                shutil.rmtree(self.data_dir, ignore_errors=True)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if errors:
            REPORTED.add(self.prefix)
            pytest.fail(
                f"fastbox cleanup ({self.label}, prefix {self.prefix}) failed:\n"
                + "\n".join(f"- {e}" for e in errors)
                + f"\nserver output: {self.log_path}",
                pytrace=False,
            )
        print(f"[fastbox] {self.label}: cleaned up, no leftovers", flush=True)

    def list_all(self, client: httpx.Client) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        page = 1
        while True:
            r = client.get("/v1/sandboxes", params={"page": page, "pageSize": 200})
            r.raise_for_status()
            body = r.json()
            items.extend(body.get("items", []))
            if not body.get("pagination", {}).get("hasNextPage") or page >= 100:
                return items
            page += 1

    def _delete_all_sandboxes(self, errors: list[str]) -> None:
        with self.http() as client:
            items = self.list_all(client)
            live = [i for i in items if i.get("status", {}).get("state") not in FINAL_STATES]
            for item in live:
                r = client.delete(f"/v1/sandboxes/{item['id']}")
                if r.status_code not in (200, 202, 204, 404):
                    errors.append(
                        f"DELETE /v1/sandboxes/{item['id']} answered {r.status_code} {r.text[:300]}"
                    )
            if live:
                print(f"[fastbox] {self.label}: deleted {len(live)} sandbox(es)", flush=True)
            deadline = time.monotonic() + DELETE_SETTLE_S
            while True:
                pending = [
                    i["id"]
                    for i in self.list_all(client)
                    if i.get("status", {}).get("state") not in FINAL_STATES
                ]
                if not pending:
                    return
                if time.monotonic() >= deadline:
                    print(
                        f"[fastbox] warning: still not terminated {DELETE_SETTLE_S:.0f}s "
                        f"after DELETE: {pending} (purge removes them)",
                        flush=True,
                    )
                    return
                time.sleep(0.5)

    def _stop(self, errors: list[str]) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            errors.append(f"`fastbox up` did not exit within {STOP_TIMEOUT_S:.0f}s of SIGTERM")
            self.proc.kill()
            self.proc.wait()
            return
        if rc != 0:
            errors.append(f"`fastbox up` exited with status {rc} after SIGTERM")

    def _purge(self, errors: list[str]) -> None:
        assert self.data_dir is not None
        cmd = [
            str(self.binary), "purge", "--prefix", self.prefix, "--data-dir", str(self.data_dir),
        ]  # fmt: skip
        t0 = time.monotonic()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            errors.append(f"{' '.join(cmd)} failed: {e}")
            return
        if r.returncode != 0:
            errors.append(
                f"{' '.join(cmd)} exited {r.returncode}:\n{(r.stdout + r.stderr).strip()}"
            )
        else:
            print(f"[fastbox] {self.label}: purge took {time.monotonic() - t0:.1f}s", flush=True)


def files_holding(directory: Path, needle: bytes) -> list[Path]:
    """Files under `directory` holding `needle`, read where they hold data (sparse disk
    images are mostly holes); overlay mounts (sandbox roots) are not entered: their upper
    directories are searched where they live."""
    found: list[Path] = []
    overlays = {
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if " - overlay " in line
    }
    for root, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if os.path.join(root, d) not in overlays]
        for name in files:
            path = Path(root, name)
            if path.is_symlink() or not path.is_file():
                continue
            if holds(path, needle):
                found.append(path)
    return found


def holds(path: Path, needle: bytes) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        at = 0
        while True:
            try:
                start = os.lseek(fd, at, os.SEEK_DATA)
            except OSError:
                return False
            end = os.lseek(fd, start, os.SEEK_HOLE)
            pos = start
            while pos < end:
                chunk = os.pread(fd, min(1 << 20, end - pos), pos)
                if not chunk:
                    break
                if needle in chunk:
                    return True
                if len(chunk) < len(needle):
                    break
                pos += len(chunk) - len(needle) + 1
            at = end
    finally:
        os.close(fd)


def module_server(
    request: pytest.FixtureRequest, label: str, extra_args: list[str] | None = None
) -> FastboxServer:
    """A running `fastbox up` for a test module (its `fastbox` fixture). Skips the module when
    this machine cannot run it; fails it when the server does not come up. Its finalizer
    deletes every sandbox, stops the server, purges the prefix and fails on leftovers."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    server = FastboxServer(label=label, extra_args=extra_args)
    request.addfinalizer(server.cleanup)
    try:
        server.start()
    except ServerError as e:
        pytest.fail(str(e), pytrace=False)
    return server


def diagnostic_text(server: FastboxServer, content: DiagnosticContent) -> str:
    """The text of a diagnostics descriptor, inline or fetched from its URL."""
    if content.delivery == "inline":
        return content.content or ""
    assert content.content_url, f"delivery=url without contentUrl: {content!r}"
    url = content.content_url
    if url.startswith("/"):
        url = server.base_url + url
    with server.http() as client:
        r = client.get(url)
        r.raise_for_status()
        return r.text
