"""Pause/resume, snapshots, restores from a snapshot and forks, through the official SDK (and raw
HTTP for fork, which the SDK does not have).

Every test starts a small Python server inside the sandbox (`STATE_SERVER`, a background
command). It keeps a random secret only in its memory and serves it on 127.0.0.1. With a
counter path, it also runs a write-then-increment loop on that file every ~10 ms and records
every "tear": an iteration where the file does not hold the value the process last wrote.
A restore whose files and memory come from different moments therefore shows up as a tear
in the restored process. The tests read the server through `python3 -c urllib` run by execd,
so they never reach into the sandbox any other way.

Contract (fastbox):
- pause -> 202, `Pausing` -> `Paused`; resume -> 202, `Resuming` -> `Running`. Pausing a
  sandbox that is not Running and resuming one that is not Paused give 409. Unknown ids
  give 404.
- A snapshot is `Creating` (or already `Ready`) on 202 and becomes `Ready`; the source keeps
  running. `SandboxSync.create(snapshot_id=...)` restores the processes as they were. The
  SDK's default entrypoint is ignored, and any other entrypoint is a 400. The source's
  metadata is re-applied unless the create gives metadata.
- `POST /v1/sandboxes/{id}/fork {"count": N}` -> 202 `{"items": [CreateSandboxResponse...]}`.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import shlex
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import fastbox_server as fb
import httpx
import pytest
from opensandbox.exceptions import SandboxApiException, SandboxException
from opensandbox.models.execd import RunCommandOpts
from opensandbox.models.sandboxes import SnapshotFilter, SnapshotInfo
from opensandbox.sync.manager import SandboxManagerSync
from opensandbox.sync.sandbox import SandboxSync

UNKNOWN_ID = "no-such-sandbox-fbt"
UNKNOWN_SNAPSHOT_ID = "no-such-snapshot-fbt"
STATE_PORT = 7777
COUNTER = "/tmp/counter"
PAUSE_TIMEOUT_S = 30.0
RESUME_TIMEOUT_S = 60.0
SNAPSHOT_TIMEOUT_S = 60.0
FORK_TIMEOUT_S = 120.0
SOURCE_RESOURCE = {"cpu": "1", "memory": "1Gi"}

# The in-sandbox server. argv: PORT [COUNTER_PATH [BALLAST_MIB]]. One thread, so a request is
# always served between two loop iterations: `disk` in an answer is what the file held at that
# moment. A ballast is memory it holds besides (enough makes fastbox stream its live dumps).
STATE_SERVER = r"""
import json, os, secrets, socket, sys

port = int(sys.argv[1])
counter = sys.argv[2] if len(sys.argv) > 2 else None
ballast = bytes(range(256)) * (int(sys.argv[3]) * 4096) if len(sys.argv) > 3 else b""
secret = secrets.token_hex(16)  # only ever in this process's memory
n = 0          # the next value to write
last = None    # the value this process last wrote to `counter`
tears = []     # iterations that found the file holding something else
iterations = 0

srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", port))
srv.listen(16)
srv.settimeout(0.01)


def disk():
    try:
        with open(counter) as f:
            return f.read()
    except FileNotFoundError:
        return None


while True:
    iterations += 1
    if counter:
        seen = disk()
        if last is not None and seen != str(last) and len(tears) < 50:
            tears.append({"expected": last, "seen": seen, "iteration": iterations})
        with open(counter + ".tmp", "w") as f:
            f.write(str(n))
        os.replace(counter + ".tmp", counter)  # readers see whole numbers only
        last = n
        n += 1
    try:
        conn, _ = srv.accept()
    except socket.timeout:
        continue
    with conn:
        conn.settimeout(2)
        request = b""
        try:
            while b"\r\n\r\n" not in request and len(request) < 65536:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                request += chunk
        except OSError:
            pass
        body = json.dumps({
            "secret": secret,
            "pid": os.getpid(),
            "n": n,
            "last": last,
            "disk": disk() if counter else None,
            "tears": tears,
            "iterations": iterations,
        }).encode()
        try:
            conn.sendall(
                b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n"
                + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
                + body
            )
        except OSError:
            pass
"""

PROBE = (
    "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen("
    "'http://127.0.0.1:{port}/', timeout=5).read().decode())"
)


# --------------------------------------------------------------------------- helpers
def sh(sb: SandboxSync, command: str, what: str) -> str:
    """Run a shell command in the sandbox; its stdout, or an AssertionError with everything."""
    ex = sb.commands.run(command)
    out = "\n".join(fb.lines(ex.logs.stdout))
    assert ex.exit_code == 0 and ex.error is None, (
        f"{what} in {sb.id}: `{command[:200]}` exited {ex.exit_code}, error {ex.error!r}, "
        f"stdout {out[:500]!r}, stderr {fb.lines(ex.logs.stderr)[:20]!r}"
    )
    return out


def try_probe(sb: SandboxSync, port: int = STATE_PORT) -> dict[str, Any] | None:
    """The state server's answer, or None when it does not answer (yet)."""
    ex = sb.commands.run(f"python3 -c {shlex.quote(PROBE.format(port=port))}")
    if ex.exit_code != 0 or ex.error is not None:
        return None
    try:
        doc = json.loads("".join(fb.lines(ex.logs.stdout)))
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def probe(sb: SandboxSync, what: str, port: int = STATE_PORT) -> dict[str, Any]:
    ex = sb.commands.run(f"python3 -c {shlex.quote(PROBE.format(port=port))}")
    out = "".join(fb.lines(ex.logs.stdout))
    assert ex.exit_code == 0 and ex.error is None, (
        f"{what}: the state server in {sb.id} did not answer on 127.0.0.1:{port} "
        f"(exit {ex.exit_code}, error {ex.error!r}, stderr {fb.lines(ex.logs.stderr)[-10:]!r})"
    )
    try:
        doc = json.loads(out)
    except ValueError as e:
        raise AssertionError(f"{what}: the state server in {sb.id} answered {out[:300]!r}") from e
    assert isinstance(doc, dict), doc
    return doc


def start_state_server(
    sb: SandboxSync,
    *,
    counter: str | None = None,
    min_iterations: int = 0,
    ballast_mib: int | None = None,
) -> dict[str, Any]:
    """Start STATE_SERVER as a background command; its first answer once it has looped
    min_iterations times."""
    assert ballast_mib is None or counter, "a ballast needs a counter path before it"
    args = f"{STATE_PORT}" + (f" {shlex.quote(counter)}" if counter else "")
    args += f" {ballast_mib}" if ballast_mib else ""
    ex = sb.commands.run(
        f"python3 -c {shlex.quote(STATE_SERVER)} {args}",
        opts=RunCommandOpts(background=True),
    )
    assert ex.id, f"background start of the state server in {sb.id} gave no command id"
    assert ex.error is None, ex.error

    def up() -> dict[str, Any] | None:
        doc = try_probe(sb)
        if doc is None or doc.get("iterations", 0) < min_iterations:
            st = sb.commands.get_command_status(ex.id)
            if not st.running:
                logs = sb.commands.get_background_command_logs(ex.id).content
                raise AssertionError(
                    f"the state server in {sb.id} exited ({st.exit_code}): {logs[-2000:]}"
                )
            return None
        return doc

    doc = fb.wait_until(up, timeout=30, interval=0.2, what=f"the state server in {sb.id}")
    assert re.fullmatch(r"[0-9a-f]{32}", doc["secret"]), doc
    return doc


def hostname(sb: SandboxSync) -> str:
    name = sh(sb, "cat /proc/sys/kernel/hostname", "reading the hostname").strip()
    assert name, f"{sb.id} has an empty hostname"
    return name


def uptime(sb: SandboxSync) -> float:
    return float(sh(sb, "cat /proc/uptime", "reading /proc/uptime").split()[0])


def wait_state(
    manager: SandboxManagerSync,
    sandbox_id: str,
    target: str,
    *,
    passing: Iterable[str],
    timeout: float,
) -> list[str]:
    """Poll GET /v1/sandboxes/{id} until `target`; every state on the way must be in
    `passing`. Returns the distinct states seen, in order."""
    allowed = set(passing)
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        status = manager.get_sandbox_info(sandbox_id).status
        if not seen or seen[-1] != status.state:
            seen.append(status.state)
        if status.state == target:
            return seen
        trail = " -> ".join(seen)
        assert status.state in allowed, (
            f"sandbox {sandbox_id} went {trail} while waiting for {target} "
            f"(reason {status.reason!r}, message {status.message!r})"
        )
        assert time.monotonic() < deadline, (
            f"sandbox {sandbox_id} still {status.state} after {timeout:.0f}s waiting for "
            f"{target} (states seen: {trail}; reason {status.reason!r}, message {status.message!r})"
        )
        time.sleep(0.2)


def wait_snapshot_ready(
    manager: SandboxManagerSync, snapshot_id: str, timeout: float = SNAPSHOT_TIMEOUT_S
) -> SnapshotInfo:
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        info = manager.get_snapshot(snapshot_id)
        st = info.status
        if not seen or seen[-1] != st.state:
            seen.append(st.state)
        if st.state == "Ready":
            return info
        assert st.state == "Creating", (
            f"snapshot {snapshot_id} went {' -> '.join(seen)} "
            f"(reason {st.reason!r}, message {st.message!r})"
        )
        assert time.monotonic() < deadline, (
            f"snapshot {snapshot_id} still {st.state} after {timeout:.0f}s "
            f"(reason {st.reason!r}, message {st.message!r})"
        )
        time.sleep(0.25)


def check_new_snapshot(info: SnapshotInfo, sandbox_id: str, name: str | None) -> None:
    assert info.id, info
    assert info.sandbox_id == sandbox_id, info
    assert info.name == name, info
    assert info.status.state in ("Creating", "Ready"), info
    assert info.created_at is not None, info


def create_from_snapshot(
    fastbox: fb.FastboxServer, snapshot_id: str, **kw: Any
) -> SandboxSync:
    """SandboxSync.create(snapshot_id=...) with the suite's budgets and the source's limits.
    The SDK sends its default entrypoint ["tail","-f","/dev/null"] unless kw has one."""
    kw.setdefault("timeout", timedelta(minutes=15))
    kw.setdefault("ready_timeout", timedelta(seconds=120))
    kw.setdefault("resource", dict(SOURCE_RESOURCE))
    t0 = time.monotonic()
    sb = SandboxSync.create(
        snapshot_id=snapshot_id, connection_config=fastbox.connection_config(), **kw
    )
    print(
        f"[fastbox] sandbox {sb.id} restored from {snapshot_id} in "
        f"{time.monotonic() - t0:.2f}s",
        flush=True,
    )
    return sb


def discard(*sandboxes: SandboxSync | None) -> None:
    """Kill and close, never raising (used in finally blocks)."""
    for sb in sandboxes:
        if sb is None:
            continue
        with contextlib.suppress(SandboxException):
            sb.kill()
        sb.close()


def discard_snapshot(manager: SandboxManagerSync, snapshot_id: str | None) -> None:
    if snapshot_id:
        with contextlib.suppress(SandboxException):
            manager.delete_snapshot(snapshot_id)


def api_status(call: Any) -> int | None:
    """The HTTP status of a failing SDK call (None if it did not fail)."""
    try:
        call()
    except SandboxApiException as e:
        return e.status_code
    return None


def ping_refused(url: str, headers: dict[str, str]) -> str | None:
    """None when `GET url` does NOT answer 2xx within 3 s (what a paused sandbox must do);
    otherwise a description of the answer."""
    try:
        with httpx.Client(timeout=3, trust_env=False) as c:
            r = c.get(url, headers=headers)
    except httpx.HTTPError:
        return None
    return None if r.status_code >= 300 else f"{r.status_code} {r.text[:200]}"


def run_sandbox_ids(server: fb.FastboxServer, api: httpx.Client) -> set[str]:
    """Every listed sandbox (any state) that carries this run's metadata."""
    return {
        item["id"]
        for item in server.list_all(api)
        if (item.get("metadata") or {}).get("fbt-run") == server.prefix
    }


# --------------------------------------------------------------------------- 1. pause/resume
def test_pause_resume_keeps_memory_uptime_and_hostname(
    fastbox: fb.FastboxServer, manager: SandboxManagerSync, api: httpx.Client
) -> None:
    sb = fastbox.create_sandbox(
        metadata={"fbt-suite": "snapshots", "fbt-test": "pause"}, resource=dict(SOURCE_RESOURCE)
    )
    resumed: SandboxSync | None = None
    try:
        before = start_state_server(sb)
        name = hostname(sb)
        up_before = uptime(sb)
        r = api.get(f"/v1/sandboxes/{sb.id}/endpoints/{fb.EXECD_PORT}")
        assert r.status_code == 200, r.text
        running_ep = r.json()

        sb.pause()
        states = wait_state(
            manager, sb.id, "Paused", passing={"Running", "Pausing"}, timeout=PAUSE_TIMEOUT_S
        )
        print(f"[fastbox] {sb.id}: {' -> '.join(states)}", flush=True)

        # Nothing answers for a paused sandbox: the endpoint it had while running is dead,
        # and a fresh lookup either fails or hands out an endpoint that does not answer.
        stale = ping_refused(
            f"http://{running_ep['endpoint']}/ping", running_ep.get("headers", {})
        )
        assert stale is None, f"execd of paused {sb.id} answered on its old endpoint: {stale}"
        r = api.get(f"/v1/sandboxes/{sb.id}/endpoints/{fb.EXECD_PORT}")
        if r.status_code == 200:
            ep = r.json()
            fresh = ping_refused(f"http://{ep['endpoint']}/ping", ep.get("headers", {}))
            assert fresh is None, f"execd of paused {sb.id} answered: {fresh}"
        else:
            assert 400 <= r.status_code < 500, (
                f"endpoint of a paused sandbox: {r.status_code} {r.text}"
            )
        assert manager.get_sandbox_info(sb.id).status.state == "Paused"
        assert api_status(lambda: manager.pause_sandbox(sb.id)) == 409, (
            "pausing a Paused sandbox must be a 409"
        )

        resumed = SandboxSync.resume(
            sb.id,
            connection_config=fastbox.connection_config(),
            resume_timeout=timedelta(seconds=RESUME_TIMEOUT_S),
        )
        wait_state(
            manager, sb.id, "Running", passing={"Paused", "Resuming"}, timeout=RESUME_TIMEOUT_S
        )

        after = probe(resumed, "after resume")
        assert after["secret"] == before["secret"], (
            "the in-memory secret changed across pause/resume: the process was restarted, "
            f"not restored (before {before}, after {after})"
        )
        assert after["pid"] == before["pid"], (before, after)
        assert after["iterations"] >= before["iterations"], (before, after)
        up_after = uptime(resumed)
        assert up_after >= up_before, (
            f"/proc/uptime went backwards across pause/resume: {up_before} -> {up_after}"
        )
        assert hostname(resumed) == name, "the hostname changed across pause/resume"
        assert api_status(lambda: manager.resume_sandbox(sb.id)) == 409, (
            "resuming a Running sandbox must be a 409"
        )
    finally:
        if resumed is not None:
            resumed.close()
        discard(sb)


def test_resume_asked_during_the_pause_runs_after_it(
    fastbox: fb.FastboxServer, manager: SandboxManagerSync
) -> None:
    """A resume sent while the pause still runs is accepted and happens after the pause; the
    SDK's endpoint lookup right after it waits for the sandbox to run (no 409 to retry)."""
    sb = fastbox.create_sandbox(
        metadata={"fbt-suite": "snapshots", "fbt-test": "resume-in-pause"},
        resource=dict(SOURCE_RESOURCE),
    )
    resumed: SandboxSync | None = None
    try:
        before = start_state_server(sb)
        sb.pause()
        assert manager.get_sandbox_info(sb.id).status.state in {"Pausing", "Paused"}
        resumed = SandboxSync.resume(
            sb.id,
            connection_config=fastbox.connection_config(),
            resume_timeout=timedelta(seconds=RESUME_TIMEOUT_S),
        )
        assert manager.get_sandbox_info(sb.id).status.state == "Running"
        after = probe(resumed, "after a resume asked during the pause")
        assert after["secret"] == before["secret"], (before, after)
        assert after["pid"] == before["pid"], (before, after)
    finally:
        if resumed is not None:
            resumed.close()
        discard(sb)


# --------------------------------------------------------------------------- 2. snapshot + clones
def test_snapshot_clones_restore_memory_and_files_together(
    fastbox: fb.FastboxServer, manager: SandboxManagerSync
) -> None:
    source_meta = {"fbt-suite": "snapshots", "fbt-test": "clones", "fbt-role": "source"}
    source = fastbox.create_sandbox(metadata=source_meta, resource=dict(SOURCE_RESOURCE))
    clone_a: SandboxSync | None = None
    clone_b: SandboxSync | None = None
    snapshot_id: str | None = None
    try:
        # 80 MiB held besides: the live snapshot is streamed into memory while the loop
        # writes its file (fastbox streams a tree of 64 MiB and more), and the clones copy
        # their memory in lazily.
        first = start_state_server(source, counter=COUNTER, min_iterations=20, ballast_mib=80)
        source_name = hostname(source)
        before_snap = probe(source, "source before the snapshot")
        assert before_snap["tears"] == [], before_snap

        name = f"fbt-clones-{secrets.token_hex(3)}"
        created = source.create_snapshot(name)
        snapshot_id = created.id
        check_new_snapshot(created, source.id, name)
        during = probe(source, "source right after the snapshot request")
        assert during["secret"] == first["secret"] and during["tears"] == [], during
        ready = wait_snapshot_ready(manager, snapshot_id)
        assert ready.sandbox_id == source.id and ready.name == name, ready
        assert "streamed" in (ready.status.message or ""), (
            f"the live snapshot was not streamed: {ready.status.message!r}"
        )

        # The source keeps running, and its loop never saw its file change under it.
        s1 = probe(source, "source after Ready")
        time.sleep(0.3)
        s2 = probe(source, "source after Ready, 0.3 s later")
        assert before_snap["last"] < s1["last"] < s2["last"], (
            f"the source's counter stopped around the snapshot: {before_snap['last']}, "
            f"{s1['last']}, {s2['last']}"
        )
        assert s2["tears"] == [], f"the snapshot disturbed the source's files: {s2['tears']}"
        assert manager.get_sandbox_info(source.id).status.state == "Running"

        clone_a = create_from_snapshot(fastbox, snapshot_id)
        clone_b = create_from_snapshot(
            fastbox, snapshot_id, metadata={"fbt-run": fastbox.prefix, "fbt-role": "clone-b"}
        )
        for label, clone in (("clone A", clone_a), ("clone B", clone_b)):
            assert clone.id != source.id
            got = probe(clone, f"{label} right after start")
            # The restored process is the source's (same in-memory secret), resumed from the
            # snapshot point, not restarted.
            assert got["secret"] == first["secret"], (label, got)
            assert got["last"] is not None and got["last"] >= before_snap["last"], (
                f"{label} counter {got['last']} is behind the source's "
                f"{before_snap['last']} taken before the snapshot: restarted, not restored"
            )
            # Files and memory come from the same freeze: the first loop iteration after the
            # restore found the file holding what the process had last written.
            assert got["tears"] == [], (
                f"{label}: the restored /tmp/counter does not match the restored memory "
                f"(write-then-increment loop; in-memory value must equal the file's): "
                f"{got['tears']}"
            )
            assert got["disk"] == str(got["last"]) and got["n"] == got["last"] + 1, got
            on_disk = int(sh(clone, f"cat {COUNTER}", f"{label}: reading {COUNTER}"))
            time.sleep(0.2)
            later = probe(clone, f"{label} 0.2 s later")
            assert got["last"] <= on_disk <= later["last"] and later["last"] > got["last"], (
                f"{label}: counter not increasing: memory {got['last']}, then file "
                f"{on_disk}, then memory {later['last']}"
            )

        info_a = manager.get_sandbox_info(clone_a.id)
        assert info_a.status.state == "Running", info_a.status
        recorded = manager.get_sandbox_info(source.id).metadata
        assert recorded == {"fbt-run": fastbox.prefix, **source_meta}, recorded
        assert info_a.metadata == recorded, (
            f"clone A (no metadata at create) must carry the source's metadata {recorded}, "
            f"has {info_a.metadata}"
        )
        info_b = manager.get_sandbox_info(clone_b.id)
        assert (info_b.metadata or {}).get("fbt-role") == "clone-b", info_b.metadata
        assert (info_b.metadata or {}).get("fbt-run") == fastbox.prefix, info_b.metadata

        names = {"source": source_name, "clone A": hostname(clone_a), "clone B": hostname(clone_b)}
        assert len(set(names.values())) == 3, f"clones must get their own hostnames: {names}"

        # The three diverge: a marker written into clone A's counter file is seen by clone A's
        # loop (as a tear) and by nobody else. Retried: the loop may overwrite it between its
        # read and its write.
        marker = f"fbt-marker-{secrets.token_hex(4)}"
        seen_by_a: dict[str, Any] = {}
        for _ in range(5):
            sh(
                clone_a,
                f"printf %s {marker} > {COUNTER}.m && mv -f {COUNTER}.m {COUNTER}",
                "writing the marker",
            )
            time.sleep(0.2)
            seen_by_a = probe(clone_a, "clone A after the marker")
            if any(t.get("seen") == marker for t in seen_by_a["tears"]):
                break
        else:
            raise AssertionError(f"clone A's loop never saw the marker: {seen_by_a}")
        for label, sb in (("clone B", clone_b), ("source", source)):
            doc = probe(sb, f"{label} after the marker in clone A")
            assert doc["tears"] == [], f"{label} saw clone A's write: {doc['tears']}"
            content = sh(sb, f"cat {COUNTER}", f"{label}: reading {COUNTER}").strip()
            assert content.isdigit(), f"{label}'s {COUNTER} holds {content!r}"
    finally:
        discard(clone_a, clone_b, source)
        discard_snapshot(manager, snapshot_id)


# --------------------------------------------------------------------------- 3. foreign entrypoint
def test_restore_with_a_foreign_entrypoint_is_refused(
    fastbox: fb.FastboxServer, manager: SandboxManagerSync, api: httpx.Client
) -> None:
    source = fastbox.create_sandbox(
        metadata={"fbt-suite": "snapshots", "fbt-test": "entrypoint"},
        resource=dict(SOURCE_RESOURCE),
    )
    snapshot_id: str | None = None
    try:
        first = start_state_server(source)
        created = manager.create_snapshot(source.id)
        snapshot_id = created.id
        check_new_snapshot(created, source.id, None)
        wait_snapshot_ready(manager, snapshot_id)

        ids_before = run_sandbox_ids(fastbox, api)
        try:
            stray = create_from_snapshot(
                fastbox,
                snapshot_id,
                entrypoint=["/bin/sh", "-c", "echo foreign; exec sleep infinity"],
                ready_timeout=timedelta(seconds=30),
            )
        except SandboxApiException as e:
            refused = e
        else:
            discard(stray)
            pytest.fail(f"a restore with a foreign entrypoint was accepted ({stray.id})")
        assert refused.status_code == 400, (
            f"a restore with an entrypoint other than the snapshot's must be a 400, got "
            f"{refused.status_code}: {refused}"
        )
        new = run_sandbox_ids(fastbox, api) - ids_before
        assert not new, f"a refused restore created sandboxes: {sorted(new)}"

        # The refusal changed nothing: the snapshot is still usable, the source still serves.
        assert manager.get_snapshot(snapshot_id).status.state == "Ready"
        assert probe(source, "source after the refused restore")["secret"] == first["secret"]
    finally:
        discard(source)
        discard_snapshot(manager, snapshot_id)


# --------------------------------------------------------------------------- 4. snapshot API
def test_snapshot_list_filter_get_delete_and_errors(
    fastbox: fb.FastboxServer, manager: SandboxManagerSync
) -> None:
    sb = fastbox.create_sandbox(
        metadata={"fbt-suite": "snapshots", "fbt-test": "api"}, resource=dict(SOURCE_RESOURCE)
    )
    ids: list[str] = []
    try:
        tag = secrets.token_hex(3)
        name_a, name_b = f"fbt-a-{tag}", f"fbt-b-{tag}"
        a = sb.create_snapshot(name_a)  # POST /v1/sandboxes/{id}/snapshots via the sandbox
        ids.append(a.id)
        check_new_snapshot(a, sb.id, name_a)
        wait_snapshot_ready(manager, a.id)
        b = manager.create_snapshot(sb.id, name_b)  # the same route via the manager
        ids.append(b.id)
        check_new_snapshot(b, sb.id, name_b)
        wait_snapshot_ready(manager, b.id)
        assert a.id != b.id

        got = manager.get_snapshot(a.id)
        assert (got.id, got.sandbox_id, got.name, got.status.state) == (
            a.id, sb.id, name_a, "Ready",
        ), got

        def listed(**kw: Any) -> list[str]:
            return [s.id for s in manager.list_snapshots(SnapshotFilter(**kw)).snapshot_infos]

        assert sorted(listed(sandbox_id=sb.id)) == sorted([a.id, b.id])
        assert listed(name=name_a) == [a.id]
        assert listed(sandbox_id=sb.id, name=name_b) == [b.id]
        assert sorted(listed(sandbox_id=sb.id, states=["Ready"])) == sorted([a.id, b.id])
        assert listed(sandbox_id=sb.id, states=["Creating", "Failed"]) == []
        assert listed(sandbox_id=UNKNOWN_ID) == []
        assert listed(sandbox_id=sb.id, name="fbt-no-such-name") == []
        page = manager.list_snapshots(SnapshotFilter(sandbox_id=sb.id, page=1, page_size=1))
        assert len(page.snapshot_infos) == 1, page
        assert page.pagination.total_items == 2 and page.pagination.has_next_page, page.pagination
        page2 = manager.list_snapshots(SnapshotFilter(sandbox_id=sb.id, page=2, page_size=1))
        assert len(page2.snapshot_infos) == 1 and not page2.pagination.has_next_page, page2
        assert {page.snapshot_infos[0].id, page2.snapshot_infos[0].id} == {a.id, b.id}

        manager.delete_snapshot(a.id)

        def gone() -> bool:
            status = api_status(lambda: manager.get_snapshot(a.id))
            return status == 404

        fb.wait_until(gone, timeout=30, what=f"GET /v1/snapshots/{a.id} to answer 404")
        fb.wait_until(
            lambda: listed(sandbox_id=sb.id) == [b.id],
            timeout=30,
            what=f"the deleted snapshot {a.id} to leave the list",
        )
        assert manager.get_snapshot(b.id).status.state == "Ready"
        assert manager.get_sandbox_info(sb.id).status.state == "Running"

        assert api_status(lambda: manager.get_snapshot(UNKNOWN_SNAPSHOT_ID)) == 404
        assert api_status(lambda: manager.create_snapshot(UNKNOWN_ID, "fbt-x")) == 404, (
            "snapshot of an unknown sandbox must be a 404"
        )
        assert api_status(lambda: manager.pause_sandbox(UNKNOWN_ID)) == 404
        assert api_status(lambda: manager.resume_sandbox(UNKNOWN_ID)) == 404
        assert api_status(lambda: manager.resume_sandbox(sb.id)) == 409, (
            "resuming a Running sandbox must be a 409"
        )
        assert (
            api_status(
                lambda: SandboxSync.resume(sb.id, connection_config=fastbox.connection_config())
            )
            == 409
        )
        assert manager.get_sandbox_info(sb.id).status.state == "Running"
    finally:
        discard(sb)
        for sid in ids:
            discard_snapshot(manager, sid)


# --------------------------------------------------------------------------- 5. fork
def test_fork_three_share_the_source_memory(
    fastbox: fb.FastboxServer, api: httpx.Client
) -> None:
    source = fastbox.create_sandbox(
        metadata={"fbt-suite": "snapshots", "fbt-test": "fork"}, resource=dict(SOURCE_RESOURCE)
    )
    fork_ids: list[str] = []
    forks: list[SandboxSync] = []
    try:
        first = start_state_server(source)
        source_name = hostname(source)

        r = api.post(f"/v1/sandboxes/{source.id}/fork", json={"count": 3})
        assert r.status_code == 202, f"POST /fork -> {r.status_code} {r.text[:500]}"
        doc = r.json()
        assert fb.find_nulls(doc) == [], doc
        items = doc.get("items")
        assert isinstance(items, list) and len(items) == 3, doc
        for item in items:
            assert isinstance(item.get("id"), str) and item["id"], item
            fork_ids.append(item["id"])
            assert isinstance(item.get("status", {}).get("state"), str), item
        assert len(set(fork_ids)) == 3 and source.id not in fork_ids, fork_ids

        for fid in fork_ids:
            seen: list[str] = []

            def running(fid: str = fid, seen: list[str] = seen) -> bool:
                rr = api.get(f"/v1/sandboxes/{fid}")
                assert rr.status_code == 200, (
                    f"GET /v1/sandboxes/{fid} -> {rr.status_code} {rr.text}"
                )
                status = rr.json()["status"]
                if not seen or seen[-1] != status["state"]:
                    seen.append(status["state"])
                assert status["state"] not in fb.FINAL_STATES, (
                    f"fork {fid} went {' -> '.join(seen)}: {status}"
                )
                return status["state"] == "Running"

            fb.wait_until(running, timeout=FORK_TIMEOUT_S, what=f"fork {fid} to be Running")

        names = {"source": source_name}
        for fid in fork_ids:
            fork = SandboxSync.connect(
                fid,
                connection_config=fastbox.connection_config(),
                connect_timeout=timedelta(seconds=60),
            )
            forks.append(fork)
            got = probe(fork, f"fork {fid}")
            assert got["secret"] == first["secret"], (
                f"fork {fid} does not run the source's in-memory server: {got} vs {first}"
            )
            names[fid] = hostname(fork)
        assert len(set(names.values())) == len(names), (
            f"forks must get their own hostnames: {names}"
        )

        assert probe(source, "source after the fork")["secret"] == first["secret"]
        assert api.get(f"/v1/sandboxes/{source.id}").json()["status"]["state"] == "Running"
    finally:
        for fork in forks:
            fork.close()
        for fid in fork_ids:
            with contextlib.suppress(httpx.HTTPError):
                api.delete(f"/v1/sandboxes/{fid}")
        discard(source)
