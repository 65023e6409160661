"""Isolated sessions (`/v1/isolated` of execd) through the official SDK's `sandbox.isolation`.

A sandbox created with the extension `bootstrap.execd.isolation=enable` offers sessions:
namespaces inside it, each with its own view of the sandbox's files (the workspace `rw`,
`ro` or `overlay`, the rest read-only), its own processes and, unless `share_net`, its own
network. These tests check each workspace mode, that two sessions cannot see each other's
processes, files or sockets, what the sandbox's own root sees of them, that a session's
workload is as confined as the sandbox's (no mounts, no namespaces, the sandbox's
capabilities), runs in the foreground and background, the file API inside a session,
idle collection, and that pause answers 409 while sessions live and works once they are gone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import fastbox_server as fb
import httpx
import pytest
from opensandbox.exceptions import SandboxException
from opensandbox.models.isolated import (
    BindMount,
    CreateIsolatedSessionRequest,
    IsolatedRunOpts,
    IsolatedWorkspaceSpec,
)
from opensandbox.sync.sandbox import SandboxSync

lines = fb.lines

ISOLATION = {"bootstrap.execd.isolation": "enable"}


@pytest.fixture(scope="module")
def sandbox(fastbox: fb.FastboxServer) -> Iterator[SandboxSync]:
    """One sandbox offering sessions, with a workspace to show them."""
    t0 = time.monotonic()
    sb = fastbox.create_sandbox(extensions=ISOLATION)
    print(f"[isolated] sandbox with isolation ready in {time.monotonic() - t0:.3f}s")
    try:
        run_ok(sb, "mkdir -p /workspace && echo from the sandbox > /workspace/in.txt")
        yield sb
    finally:
        sb.kill()
        sb.close()


def run_ok(sb: SandboxSync, command: str) -> str:
    ex = sb.commands.run(command)
    out = "\n".join(lines(ex.logs.stdout))
    assert ex.exit_code == 0, (command, out, lines(ex.logs.stderr), ex.error)
    return out


def session(sb: SandboxSync, mode: str = "rw", **kw):  # noqa: ANN201 (SDK handle type)
    return sb.isolation.create(
        CreateIsolatedSessionRequest(
            workspace=IsolatedWorkspaceSpec(path="/workspace", mode=mode), **kw
        )
    )


def srun(s, code: str, **opts) -> tuple[int | None, str, str]:  # noqa: ANN001
    ex = s.run(code, opts=IsolatedRunOpts(**opts) if opts else None)
    return ex.exit_code, "\n".join(lines(ex.logs.stdout)), "\n".join(lines(ex.logs.stderr))


def test_capabilities_are_offered_only_with_the_extension(
    fastbox: fb.FastboxServer, sandbox: SandboxSync, api: httpx.Client
) -> None:
    caps = sandbox.isolation.capabilities()
    assert caps.available and caps.isolator == "fastbox", caps
    assert not caps.diff_supported and not caps.commit_supported
    # A bad value of the extension is the create's 400, naming it.
    r = api.post(
        "/v1/sandboxes",
        json={
            "image": {"uri": fb.TEST_IMAGE},
            "timeout": 60,
            "resourceLimits": {"cpu": "1", "memory": "512Mi"},
            "entrypoint": ["tail", "-f", "/dev/null"],
            "extensions": {"bootstrap.execd.isolation": "yes"},
        },
    )
    assert r.status_code == 400 and "bootstrap.execd.isolation" in r.text, r.text


def test_each_workspace_mode(sandbox: SandboxSync) -> None:
    t0 = time.monotonic()
    rw = session(sandbox, "rw")
    print(f"[isolated] session created in {time.monotonic() - t0:.3f}s")
    try:
        code, out, err = srun(rw, "cat /workspace/in.txt && echo from rw > /workspace/rw.txt")
        assert code == 0 and out == "from the sandbox", (out, err)
        assert run_ok(sandbox, "cat /workspace/rw.txt") == "from rw"
        # Outside the workspace the sandbox's files are read-only.
        code, _, err = srun(rw, "touch /etc/from-session")
        assert code != 0 and "Read-only file system" in err, err
        assert run_ok(sandbox, "test ! -e /etc/from-session && echo absent") == "absent"
    finally:
        rw.delete()

    ro = session(sandbox, "ro")
    try:
        code, out, err = srun(ro, "cat /workspace/in.txt; echo x > /workspace/ro.txt")
        assert code != 0 and out == "from the sandbox" and "Read-only" in err, (out, err)
        assert run_ok(sandbox, "test ! -e /workspace/ro.txt && echo absent") == "absent"
    finally:
        ro.delete()

    overlay = session(sandbox, "overlay")
    try:
        code, out, err = srun(
            overlay,
            "echo changed > /workspace/in.txt && echo new > /workspace/ov.txt && cat /workspace/in.txt",
        )
        assert code == 0 and out == "changed", (out, err)
        # The session sees its changes; the sandbox's files are untouched.
        assert srun(overlay, "cat /workspace/ov.txt")[1] == "new"
        assert run_ok(sandbox, "cat /workspace/in.txt") == "from the sandbox"
        assert run_ok(sandbox, "test ! -e /workspace/ov.txt && echo absent") == "absent"
    finally:
        overlay.delete()
    assert sandbox.isolation.list() == []


def test_two_sessions_cannot_see_each_other(sandbox: SandboxSync) -> None:
    a = session(sandbox, "overlay")
    b = session(sandbox, "overlay")
    try:
        # a: a process with a marker, a file in its /tmp and its workspace, a listening socket.
        run = a.run_background(
            "echo a-secret > /tmp/a.txt; echo a-work > /workspace/a.txt; "
            "exec python3 -c \"import socket,time; s=socket.socket(); "
            "s.bind(('127.0.0.1', 47001)); s.listen(); time.sleep(300)\" marker-of-a"
        )
        # 47001 is 0xB799 in /proc/net/tcp.
        fb.wait_until(
            lambda: srun(a, "grep -qi ':B799 ' /proc/net/tcp && echo up")[1] == "up",
            timeout=10,
            what="a's listener",
        )
        a_ps = srun(a, "ps -eo pid,args")[1]
        assert "marker-of-a" in a_ps, a_ps
        # b sees none of it.
        b_ps = srun(b, "ps -eo pid,args")[1]
        assert "marker-of-a" not in b_ps, b_ps
        assert srun(b, "ls /proc | grep -c '^[0-9]'")[1].strip() in {"2", "3", "4"}, b_ps
        assert srun(b, "cat /tmp/a.txt")[0] != 0
        assert srun(b, "cat /workspace/a.txt")[0] != 0
        code, out, err = srun(
            b,
            "python3 -c \"import socket; s=socket.socket(); s.settimeout(2); "
            "print(s.connect_ex(('127.0.0.1', 47001)))\"",
        )
        assert code == 0 and out != "0", (out, err)
        # Each session has only its own loopback.
        assert srun(b, "grep -c ':' /proc/net/dev")[1] == "1", srun(b, "cat /proc/net/dev")
        # The sandbox's own root sees the sessions' processes (it owns their namespaces),
        # but not their files: a's /tmp and overlay are in a's mount namespace only.
        assert "marker-of-a" in run_ok(sandbox, "ps -eo pid,args")
        assert run_ok(sandbox, "test ! -e /tmp/a.txt && test ! -e /workspace/a.txt && echo no") == "no"
        status = a.run_status(run.run_id)
        assert status.running, status
    finally:
        a.delete()
        b.delete()
    # Deleting a session ends its processes.
    deadline = time.monotonic() + 5
    while "marker-of-a" in run_ok(sandbox, "ps -eo pid,args"):
        assert time.monotonic() < deadline, "a's process outlived its session"
        time.sleep(0.1)


def test_a_session_workload_is_confined_like_the_sandbox(sandbox: SandboxSync) -> None:
    s = session(sandbox, "overlay", uid=0)
    try:
        # No mounts and no new namespaces: the default seccomp filter is stacked on it.
        code, _, err = srun(s, "mount -t tmpfs x /mnt")
        assert code != 0 and ("permission denied" in err.lower() or "not permitted" in err), err
        code, _, err = srun(s, "unshare -U true")
        assert code != 0 and "not permitted" in err, err
        caps = srun(s, "grep -E 'CapEff|CapBnd' /proc/self/status")[1]
        sandbox_caps = run_ok(sandbox, "grep -E 'CapEff|CapBnd' /proc/self/status")
        assert caps == sandbox_caps, (caps, sandbox_caps)
        # Its devices work (the root is nosuid, not nodev: /dev is the sandbox's).
        assert srun(s, "echo x > /dev/null && head -c 4 /dev/urandom | wc -c")[1] == "4"
        # Its /proc is its own, read-only.
        code, _, err = srun(s, "echo 1 > /proc/sys/kernel/hostname")
        assert code != 0, err
        # ... with the sandbox's masks.
        assert srun(s, "wc -c < /proc/keys; wc -c < /proc/timer_list")[1].split() == ["0", "0"]
        # Its execd's token is not readable in its environment.
        assert srun(s, "tr '\\0' '\\n' < /proc/1/environ | grep -c 'TOKEN=[0-9a-f]' || true")[1] == "0"
        # The balanced profile shares the sandbox's network.
        shared = session(sandbox, "ro", profile="balanced")
        try:
            assert srun(shared, "grep -c ':' /proc/net/dev")[1] != "1"
        finally:
            shared.delete()
    finally:
        s.delete()
    # The sandbox's own commands have the default filter stacked too: the variant is execd's.
    for command in ("unshare -U true", "mount -t tmpfs x /mnt"):
        ex = sandbox.commands.run(command)
        assert ex.exit_code != 0, (command, lines(ex.logs.stdout))
    # The sandbox's execd (which holds the filter that builds sessions) cannot be traced or
    # read, even after the restore the sandbox came from.
    ex = sandbox.commands.run("cat /proc/1/environ > /dev/null")
    assert ex.exit_code != 0 and "Permission denied" in "".join(lines(ex.logs.stderr)), ex


def test_uid_binds_and_the_file_api(sandbox: SandboxSync) -> None:
    run_ok(sandbox, "mkdir -p /data && echo bound > /data/b.txt && chmod 755 /data")
    s = session(
        sandbox,
        "overlay",
        uid=1000,
        binds=[
            BindMount(source="/data", dest="/workspace/data", readonly=True),
            BindMount(source="/data/b.txt", dest="/tmp/b.txt", readonly=True),
        ],
        env_passthrough={"mode": "allow", "keys": ["HOME"]},
    )
    try:
        assert srun(s, "id -u")[1] == "1000"
        assert srun(s, "cat /workspace/data/b.txt")[1] == "bound"
        # A file bound read-only.
        assert srun(s, "cat /tmp/b.txt")[1] == "bound"
        assert srun(s, "echo x > /tmp/b.txt")[0] != 0
        code, _, err = srun(s, "echo x > /workspace/data/x")
        assert code != 0, err
        # Files through the session's file API are the session's view.
        s.files.write_file("/tmp/via-api.txt", "hello from the api")
        assert srun(s, "cat /tmp/via-api.txt")[1] == "hello from the api"
        assert s.files.read_file("/workspace/in.txt") == "from the sandbox\n"
        assert run_ok(sandbox, "test ! -e /tmp/via-api.txt && echo absent") == "absent"
        # A symlink the session plants cannot send a file write out of its view.
        srun(s, "ln -s /etc/passwd /tmp/evil")
        with pytest.raises(SandboxException):
            s.files.write_file("/tmp/evil", "overwritten")
        assert "overwritten" not in run_ok(sandbox, "cat /etc/passwd")
        # A bind source is never reached through a symlink (a session that could write the
        # directory may have planted it): a link to the sandbox's /proc is refused.
        run_ok(sandbox, "ln -sfn /proc /workspace/tools")
        with pytest.raises(SandboxException) as refused:
            session(sandbox, "ro", binds=[BindMount(source="/workspace/tools", dest="/tools")])
        assert "symlink" in str(refused.value), refused.value
        run_ok(sandbox, "rm /workspace/tools")
        # The state echoes the creation parameters.
        state = s.get()
        assert state.status == "active" and state.uid == 1000, state
    finally:
        s.delete()


def test_background_runs_and_idle_collection(sandbox: SandboxSync) -> None:
    s = session(sandbox, "overlay", idle_timeout_seconds=3)
    run = s.run_background("echo started; sleep 4; echo finished")
    deadline = time.monotonic() + 20
    while s.run_status(run.run_id).running:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    status = s.run_status(run.run_id)
    assert status.exit_code == 0, status
    logs = s.run_logs(run.run_id)
    assert "started" in logs.text and "finished" in logs.text, logs
    # The session outlived its idle timeout while the run was running; now idle, it goes.
    deadline = time.monotonic() + 15
    while any(x.session_id == s.session_id for x in sandbox.isolation.list()):
        assert time.monotonic() < deadline, "an idle session was not collected"
        time.sleep(0.5)
    with pytest.raises(SandboxException):
        s.get()
    # A foreground run with a timeout is cut.
    t = session(sandbox, "overlay")
    try:
        t0 = time.monotonic()
        code, _, _ = srun(t, "sleep 30", timeout_seconds=1)
        assert code != 0 and time.monotonic() - t0 < 10
    finally:
        t.delete()


def test_pause_snapshot_and_fork_are_refused_while_sessions_live(
    fastbox: fb.FastboxServer, api: httpx.Client
) -> None:
    sb = fastbox.create_sandbox(extensions=ISOLATION)
    try:
        s = session_root(sb)
        r = api.post(f"/v1/sandboxes/{sb.id}/pause")
        assert r.status_code == 409 and "isolated session" in r.text, r.text
        r = api.post(f"/v1/sandboxes/{sb.id}/snapshots", json={})
        assert r.status_code == 409 and "isolated session" in r.text, r.text
        r = api.post(f"/v1/sandboxes/{sb.id}/fork", json={"count": 1})
        assert r.status_code == 409 and "isolated session" in r.text, r.text
        s.delete()
        sb.pause()
        fb.wait_until(
            lambda: api.get(f"/v1/sandboxes/{sb.id}").json()["status"]["state"] == "Paused",
            timeout=60,
            what="Paused",
        )
        resumed = SandboxSync.resume(sb.id, connection_config=fastbox.connection_config())
        try:
            # Resumed from its checkpoint, it still offers sessions.
            again = session_root(resumed)
            try:
                assert srun(again, "echo ok")[1] == "ok"
            finally:
                again.delete()
        finally:
            resumed.close()
    finally:
        sb.kill()
        sb.close()


def session_root(sb: SandboxSync):  # noqa: ANN201
    return sb.isolation.create(
        CreateIsolatedSessionRequest(workspace=IsolatedWorkspaceSpec(path="/root", mode="overlay"))
    )


def test_a_session_whose_processes_died_is_dead(sandbox: SandboxSync, api: httpx.Client) -> None:
    s = session(sandbox, "overlay")
    assert srun(s, "echo up")[1] == "up"
    # The sandbox's root may kill a session's processes (it owns them): here its execd.
    run_ok(sandbox, "pkill -KILL -f '[f]astbox-execd --listen-fd'")
    fb.wait_until(lambda: s.get().status == "dead", timeout=10, what="the session to be dead")
    with pytest.raises(SandboxException) as ended:
        s.run("echo hi")
    assert "SESSION_ENDED" in str(ended.value) or "409" in str(ended.value), ended.value
    s.delete()
    assert all(x.session_id != s.session_id for x in sandbox.isolation.list())
