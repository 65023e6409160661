"""The official OpenSandbox SDK 1.1.1 (sync API) and code-interpreter SDK against `fastbox up`.

One sandbox per mode: `direct` (execd through the node proxy endpoints) and `server-proxy`
(`use_server_proxy=True`: execd through `/v1/sandboxes/{id}/proxy/44772`). The tests of one
mode run in file order on that sandbox; the last one kills it.
"""

from __future__ import annotations

import contextlib
import queue
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import fastbox_server as fb
import pytest
from code_interpreter.models.code_sync import SupportedLanguageSync
from code_interpreter.sync.code_interpreter import CodeInterpreterSync
from opensandbox.exceptions import SandboxApiException, SandboxException
from opensandbox.models.execd import CommandStatus, RunCommandOpts
from opensandbox.models.execd_sync import ExecutionHandlersSync
from opensandbox.models.filesystem import (
    ContentReplaceEntry,
    DirectoryListEntry,
    MoveEntry,
    SearchEntry,
    SetPermissionEntry,
    WriteEntry,
)
from opensandbox.models.sandboxes import SandboxFilter
from opensandbox.sync.manager import SandboxManagerSync
from opensandbox.sync.sandbox import SandboxSync

lines = fb.lines


@dataclass
class Flow:
    server: fb.FastboxServer
    sb: SandboxSync
    use_server_proxy: bool
    mode: str

    @property
    def dir(self) -> str:
        return f"/tmp/fbt-files-{self.mode}"


@pytest.fixture(scope="module", params=[False, True], ids=["direct", "server-proxy"])
def flow(request: pytest.FixtureRequest, fastbox: fb.FastboxServer) -> Iterator[Flow]:
    use_proxy: bool = request.param
    mode = "proxy" if use_proxy else "direct"
    sb = fastbox.create_sandbox(
        use_server_proxy=use_proxy,
        env={"FB_TEST_ENV": "hello-env"},
        metadata={"fbt-suite": "flow", "fbt-mode": mode, "fbt-gone": "soon"},
        timeout=timedelta(minutes=20),
        resource={"cpu": "1", "memory": "1Gi"},
    )
    yield Flow(fastbox, sb, use_proxy, mode)
    with contextlib.suppress(SandboxException):
        sb.kill()
    sb.close()


def wait_finished(sb: SandboxSync, command_id: str, timeout: float = 30) -> CommandStatus:
    def finished() -> CommandStatus | None:
        st = sb.commands.get_command_status(command_id)
        return None if st.running else st

    return fb.wait_until(finished, timeout=timeout, what=f"command {command_id} to finish")


# --------------------------------------------------------------------------- sandbox basics
def test_create_info_and_endpoint(flow: Flow) -> None:
    sb = flow.sb
    info = sb.get_info()
    assert info.id == sb.id
    assert info.status.state == "Running"
    assert info.image is not None and info.image.image == fb.TEST_IMAGE
    assert info.entrypoint == ["tail", "-f", "/dev/null"]  # the SDK's default entrypoint
    assert info.metadata is not None
    assert info.metadata["fbt-mode"] == flow.mode
    assert info.metadata["fbt-run"] == flow.server.prefix
    assert info.expires_at is not None, "timeout=20m must give an expiresAt"
    remaining = info.expires_at - datetime.now(timezone.utc)
    assert timedelta(minutes=18) < remaining <= timedelta(minutes=20, seconds=30), remaining

    ep = sb.get_endpoint(fb.EXECD_PORT)
    assert "://" not in ep.endpoint, ep.endpoint
    if flow.use_server_proxy:
        assert ep.endpoint == f"{flow.server.domain}/v1/sandboxes/{sb.id}/proxy/{fb.EXECD_PORT}"
    else:
        assert ep.endpoint.startswith(f"127.0.0.1:{flow.server.node_proxy_port}/"), ep.endpoint
        assert ep.headers.get(fb.EXECD_TOKEN_HEADER), ep.headers
    assert sb.is_healthy()


def test_metrics(flow: Flow) -> None:
    m = flow.sb.get_metrics()
    assert m.cpu_count > 0
    assert 0 <= m.cpu_used_percentage <= 100
    assert 0 < m.memory_total_in_mib
    assert 0 <= m.memory_used_in_mib <= m.memory_total_in_mib
    # resource={"memory": "1Gi"} is the sandbox's cgroup limit, which metrics report.
    assert m.memory_total_in_mib <= 1024 + 1, f"memory limit 1Gi not applied: {m}"
    assert abs(m.timestamp / 1000 - time.time()) < 120


# --------------------------------------------------------------------------- commands
def test_command_success_and_failure(flow: Flow) -> None:
    run = flow.sb.commands.run

    ex = run("echo hello-fastbox")
    assert ex.error is None, ex.error
    assert ex.exit_code == 0
    assert ex.complete is not None
    assert ex.id
    assert lines(ex.logs.stdout) == ["hello-fastbox"]
    assert ex.logs.stderr == []

    ex = run("echo out-before-fail; echo err-before-fail >&2; exit 3")
    assert ex.exit_code == 3
    assert ex.error is not None
    assert ex.error.name == "CommandExecError"
    assert ex.error.value == "3"
    assert ex.complete is None, "a failed command has no execution_complete"
    assert lines(ex.logs.stdout) == ["out-before-fail"]
    assert lines(ex.logs.stderr) == ["err-before-fail"]
    assert all(m.is_error for m in ex.logs.stderr)

    ex = run("no-such-command-fbt")
    assert ex.exit_code == 127
    assert "not found" in "\n".join(lines(ex.logs.stderr))

    ex = run("printf 'a\\n\\nb\\n'")
    assert lines(ex.logs.stdout) == ["a", "", "b"]

    ex = run('echo "$FB_TEST_ENV"')  # env= of the create call
    assert lines(ex.logs.stdout) == ["hello-env"]


def test_the_python_image_has_what_its_users_expect(flow: Flow) -> None:
    """python:3.12 carries the tools of the real image on the path, and pip installs into
    the system's Python (no externally-managed-environment refusal)."""
    run = flow.sb.commands.run
    for tool in ["curl --version", "wget --version", "git --version", "ps -e", "pip --version"]:
        ex = run(tool)
        assert ex.exit_code == 0, (tool, lines(ex.logs.stdout), lines(ex.logs.stderr))
    ex = run("pip install --no-index fastbox-no-such-package")
    said = "\n".join(lines(ex.logs.stderr) + lines(ex.logs.stdout))
    assert "externally-managed" not in said, said
    assert "No matching distribution" in said, said


def test_command_envs_cwd_argv_timeout(flow: Flow) -> None:
    run = flow.sb.commands.run

    ex = run('echo "$FB_A-$FB_B"', opts=RunCommandOpts(envs={"FB_A": "1", "FB_B": "two"}))
    assert lines(ex.logs.stdout) == ["1-two"]

    ex = run("pwd", opts=RunCommandOpts(working_directory="/usr/lib"))
    assert ex.exit_code == 0
    assert lines(ex.logs.stdout) == ["/usr/lib"]

    # A list is sent as `argv` (native exec, no shell).
    ex = run(["python3", "-c", "import sys; print(sys.argv[1:])", "a b", "$HOME"])
    assert ex.exit_code == 0, ex.error
    assert lines(ex.logs.stdout) == ["['a b', '$HOME']"]

    t0 = time.monotonic()
    ex = run("sleep 30", opts=RunCommandOpts(timeout=timedelta(seconds=1)))
    assert time.monotonic() - t0 < 15, "the command timeout did not stop sleep 30"
    assert ex.exit_code != 0


def test_background_command_status_and_logs(flow: Flow) -> None:
    cmds = flow.sb.commands
    ex = cmds.run(
        "for i in 1 2 3; do echo bg-line-$i; sleep 0.5; done; echo bg-err >&2",
        opts=RunCommandOpts(background=True),
    )
    assert ex.id
    assert ex.error is None
    assert ex.exit_code is None  # background: no exit code in the stream
    first = cmds.get_command_status(ex.id)
    assert first.running is True, first

    st = wait_finished(flow.sb, ex.id)
    assert st.exit_code == 0, st
    assert st.finished_at is not None
    assert st.content is not None and "bg-line" in st.content

    logs = cmds.get_background_command_logs(ex.id)
    assert logs.content.splitlines() == ["bg-line-1", "bg-line-2", "bg-line-3", "bg-err"]
    assert logs.cursor is not None
    rest = cmds.get_background_command_logs(ex.id, cursor=logs.cursor)
    assert "bg-line" not in rest.content
    from_second = cmds.get_background_command_logs(ex.id, cursor=1)
    assert from_second.content.splitlines()[0] == "bg-line-2"

    with pytest.raises(SandboxApiException) as ei:
        cmds.get_command_status("no-such-command-id")
    assert ei.value.status_code == 404


def test_interrupt_long_running_command(flow: Flow) -> None:
    cmds = flow.sb.commands

    # Foreground: run() blocks on the SSE stream; interrupt it from another thread.
    ids: queue.Queue[str] = queue.Queue()
    result: dict[str, object] = {}

    def target() -> None:
        try:
            result["ex"] = cmds.run(
                "echo started; sleep 300",
                handlers=ExecutionHandlersSync(on_init=lambda init: ids.put(init.id)),
            )
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            result["err"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    cmd_id = ids.get(timeout=30)
    assert cmds.get_command_status(cmd_id).running is True
    time.sleep(0.5)
    cmds.interrupt(cmd_id)
    t.join(timeout=20)
    assert not t.is_alive(), "run() still blocked 20 s after interrupt"
    assert "err" not in result, result.get("err")
    ex = result["ex"]
    assert ex.id == cmd_id
    assert ex.exit_code != 0
    assert ex.error is not None
    assert wait_finished(flow.sb, cmd_id, timeout=10).running is False

    # Background.
    bg = cmds.run("sleep 300", opts=RunCommandOpts(background=True))
    assert bg.id
    assert cmds.get_command_status(bg.id).running is True
    cmds.interrupt(bg.id)
    st = wait_finished(flow.sb, bg.id, timeout=10)
    assert st.exit_code != 0


def test_bash_session(flow: Flow) -> None:
    cmds = flow.sb.commands
    sid = cmds.create_session(working_directory="/tmp")
    assert sid
    try:
        ex = cmds.run_in_session(sid, "pwd")
        assert ex.exit_code == 0, ex.error
        assert lines(ex.logs.stdout) == ["/tmp"]

        ex = cmds.run_in_session(
            sid, "cd /usr/share && export FB_SESSION_VAR=sess-42 && fb_local=only-here"
        )
        assert ex.exit_code == 0, ex.error

        ex = cmds.run_in_session(sid, 'pwd; echo "$FB_SESSION_VAR"; echo "$fb_local"')
        assert ex.exit_code == 0, ex.error
        assert lines(ex.logs.stdout) == ["/usr/share", "sess-42", "only-here"]

        ex = cmds.run_in_session(sid, "(exit 4)")
        assert ex.exit_code == 4

        ex = cmds.run_in_session(sid, "pwd", working_directory="/etc")
        assert lines(ex.logs.stdout) == ["/etc"]
    finally:
        cmds.delete_session(sid)
    with pytest.raises(SandboxException):
        cmds.run_in_session(sid, "true")


def test_set_env(flow: Flow) -> None:
    # CommandsSync.set_env exists in 1.1.1: it appends KEY='value' to the file named by the
    # sandbox's EXECD_ENVS variable, which execd reads at every spawn.
    cmds = flow.sb.commands
    cmds.set_env("FB_PERSISTED", "persisted value")
    ex = cmds.run('echo "$FB_PERSISTED"')
    assert lines(ex.logs.stdout) == ["persisted value"]
    sid = cmds.create_session()
    try:
        ex = cmds.run_in_session(sid, 'echo "$FB_PERSISTED"')
        assert lines(ex.logs.stdout) == ["persisted value"]
    finally:
        cmds.delete_session(sid)


# --------------------------------------------------------------------------- files
def test_files_write_and_read(flow: Flow) -> None:
    files = flow.sb.files
    path = f"{flow.dir}/a.txt"
    content = "line1\nline2\nline3\nline4\n"
    files.write_file(path, content, mode=644)
    assert files.read_file(path) == content
    assert files.read_file(path, range_header="bytes=0-4") == "line1"
    assert files.read_file(path, range_header="bytes=6-10") == "line2"
    # As execd answers upstream: the lines joined, no line end after the last one.
    assert files.read_file(path, offset=2, limit=2) == "line2\nline3"
    assert files.read_file(path, offset=4, limit=5) == "line4"

    blob = bytes(range(256)) * 64
    files.write_file(f"{flow.dir}/blob.bin", blob)
    assert files.read_bytes(f"{flow.dir}/blob.bin") == blob
    assert b"".join(files.read_bytes_stream(f"{flow.dir}/blob.bin", chunk_size=1000)) == blob

    files.write_files(
        [
            WriteEntry(path=f"{flow.dir}/multi/x.txt", data="x"),
            WriteEntry(path=f"{flow.dir}/multi/deep/y.txt", data=b"y", mode=600),
        ]
    )
    ex = flow.sb.commands.run(
        f"cd {flow.dir}/multi && cat x.txt; echo; cat deep/y.txt; echo; stat -c %a deep/y.txt"
    )
    assert lines(ex.logs.stdout) == ["x", "y", "600"]

    with pytest.raises(SandboxApiException) as ei:
        files.read_file(f"{flow.dir}/missing.txt")
    assert ei.value.status_code == 404


def test_files_info_list_search(flow: Flow) -> None:
    files = flow.sb.files
    d = f"{flow.dir}/tree"
    files.write_files(
        [
            WriteEntry(path=f"{d}/a.txt", data="hello\n", mode=644),
            WriteEntry(path=f"{d}/b.py", data="print(1)\n"),
            WriteEntry(path=f"{d}/sub/c.py", data="print(2)\n"),
        ]
    )
    info = files.get_file_info([f"{d}/a.txt", f"{d}/sub"])
    a = info[f"{d}/a.txt"]
    assert a.entry_type == "file"
    assert a.size == 6
    assert a.mode == 644
    assert (a.owner, a.group) == ("root", "root")
    assert info[f"{d}/sub"].entry_type == "directory"

    listing = files.list_directory(DirectoryListEntry(path=d, depth=1))
    assert sorted(e.path for e in listing) == [f"{d}/a.txt", f"{d}/b.py", f"{d}/sub"]
    deep = files.list_directory(DirectoryListEntry(path=d, depth=2))
    assert f"{d}/sub/c.py" in {e.path for e in deep}

    found = files.search(SearchEntry(path=d, pattern="*.py"))
    assert sorted(e.path for e in found) == [f"{d}/b.py", f"{d}/sub/c.py"]


def test_files_replace_move_permissions_delete(flow: Flow) -> None:
    files = flow.sb.files
    d = f"{flow.dir}/edit"
    p = f"{d}/r.txt"
    files.write_file(p, "alpha beta alpha\ngamma\n")

    files.replace_contents([ContentReplaceEntry(path=p, old_content="gamma", new_content="GAMMA")])
    assert files.read_file(p) == "alpha beta alpha\nGAMMA\n"
    res = files.replace_contents_detailed(
        [ContentReplaceEntry(path=p, old_content="alpha", new_content="omega")]
    )
    assert [(r.path, r.replaced_count) for r in res] == [(p, 2)]
    assert files.read_file(p) == "omega beta omega\nGAMMA\n"

    moved = f"{d}/r2.txt"
    files.move_files([MoveEntry(src=p, dest=moved)])
    assert files.read_file(moved) == "omega beta omega\nGAMMA\n"
    with pytest.raises(SandboxApiException) as ei:
        files.get_file_info([p])
    assert ei.value.status_code == 404

    files.set_permissions([SetPermissionEntry(path=moved, mode=600, owner="nobody", group="nogroup")])
    i = files.get_file_info([moved])[moved]
    assert (i.mode, i.owner, i.group) == (600, "nobody", "nogroup")
    ex = flow.sb.commands.run(f"stat -c '%a %U %G' {moved}")
    assert lines(ex.logs.stdout) == ["600 nobody nogroup"]

    files.create_directories([WriteEntry(path=f"{d}/newdir/inner", mode=700)])
    inner = files.get_file_info([f"{d}/newdir/inner"])[f"{d}/newdir/inner"]
    assert (inner.entry_type, inner.mode) == ("directory", 700)

    files.delete_directories([f"{d}/newdir"])
    files.delete_files([moved])
    ex = flow.sb.commands.run(
        f"test -e {moved} || echo gone-file; test -e {d}/newdir || echo gone-dir"
    )
    assert lines(ex.logs.stdout) == ["gone-file", "gone-dir"]


# --------------------------------------------------------------------------- code interpreter
def test_code_interpreter(flow: Flow) -> None:
    # Its strict health check also probes 44771 inside the sandbox through a command.
    ci = CodeInterpreterSync.create(flow.sb, ready_timeout=timedelta(seconds=60))
    try:
        codes = ci.codes
        ctx = codes.create_context(SupportedLanguageSync.PYTHON)
        assert ctx.id
        assert ctx.language == "python"

        r1 = codes.run("fbt_x = 20 + 1\nprint('x is set')", context=ctx)
        assert r1.error is None, r1.error
        assert lines(r1.logs.stdout) == ["x is set"]
        r2 = codes.run("fbt_x * 2", context=ctx)
        assert r2.error is None, r2.error
        assert [r.text for r in r2.result] == ["42"]
        r3 = codes.run("print(fbt_x)", context=ctx)
        assert lines(r3.logs.stdout) == ["21"]

        r4 = codes.run("1/0", context=ctx)
        assert r4.error is not None and r4.error.name == "ZeroDivisionError"

        other = codes.create_context(SupportedLanguageSync.PYTHON)
        r5 = codes.run("print('fbt_x' in globals())", context=other)
        assert lines(r5.logs.stdout) == ["False"]

        bash = codes.create_context(SupportedLanguageSync.BASH)
        b1 = codes.run("export FBT_CI=from-bash", context=bash)
        assert b1.error is None, b1.error
        b2 = codes.run('echo "$FBT_CI"', context=bash)
        assert lines(b2.logs.stdout) == ["from-bash"]

        assert codes.get_context(ctx.id).id == ctx.id
        listed = {c.id for c in codes.list_contexts(SupportedLanguageSync.PYTHON)}
        assert {ctx.id, other.id} <= listed
        codes.delete_context(other.id)
        assert other.id not in {c.id for c in codes.list_contexts(SupportedLanguageSync.PYTHON)}
        codes.delete_contexts(SupportedLanguageSync.BASH)
        assert codes.list_contexts(SupportedLanguageSync.BASH) == []
    finally:
        ci.close()


# --------------------------------------------------------------------------- lifecycle
def test_renew(flow: Flow) -> None:
    resp = flow.sb.renew(timedelta(minutes=45))
    expected = datetime.now(timezone.utc) + timedelta(minutes=45)
    assert abs((resp.expires_at - expected).total_seconds()) < 60, resp
    info = flow.sb.get_info()
    assert info.expires_at is not None
    assert abs((info.expires_at - resp.expires_at).total_seconds()) < 1


def test_patch_metadata_and_list(flow: Flow, manager: SandboxManagerSync) -> None:
    sb = flow.sb
    info = sb.patch_metadata({"fbt-patched": "yes", "fbt-gone": None})
    assert info.metadata is not None
    assert info.metadata["fbt-patched"] == "yes"
    assert "fbt-gone" not in info.metadata
    assert info.metadata["fbt-mode"] == flow.mode
    assert sb.get_info().metadata == info.metadata

    decoy = flow.server.create_sandbox(
        use_server_proxy=flow.use_server_proxy,
        metadata={"fbt-suite": "flow", "fbt-mode": flow.mode, "fbt-decoy": "yes"},
    )
    try:
        base = {"fbt-run": flow.server.prefix, "fbt-mode": flow.mode}

        def ids(f: SandboxFilter) -> set[str]:
            page = manager.list_sandbox_infos(f)
            for item in page.sandbox_infos:
                if f.states:
                    assert item.status.state in f.states, item
                assert (item.metadata or {}).items() >= (f.metadata or {}).items(), item
            return {item.id for item in page.sandbox_infos}

        got = ids(SandboxFilter(states=["Running"], metadata={**base, "fbt-patched": "yes"}))
        assert sb.id in got and decoy.id not in got
        got = ids(SandboxFilter(states=["Running"], metadata={**base, "fbt-decoy": "yes"}))
        assert decoy.id in got and sb.id not in got
        assert {sb.id, decoy.id} <= ids(SandboxFilter(metadata=base))
        assert {sb.id, decoy.id} <= ids(SandboxFilter(states=["Running", "Paused"], metadata=base))
        got = ids(SandboxFilter(states=["Paused"], metadata=base))
        assert sb.id not in got and decoy.id not in got
        # A state this server has no name for matches nothing, and is no error.
        page = manager.list_sandbox_infos(SandboxFilter(states=["Hibernating"], metadata=base))
        assert page.sandbox_infos == []
        got = ids(SandboxFilter(states=["Hibernating", "Running"], metadata=base))
        assert {sb.id, decoy.id} <= got

        page = manager.list_sandbox_infos(SandboxFilter(metadata=base, page=1, page_size=1))
        assert len(page.sandbox_infos) == 1
        assert page.pagination.page == 1
        assert page.pagination.page_size == 1
        assert page.pagination.total_items == 2
        assert page.pagination.total_pages == 2
        assert page.pagination.has_next_page is True
    finally:
        decoy.kill()
        decoy.close()


def test_diagnostics(flow: Flow, manager: SandboxManagerSync) -> None:
    sb = flow.sb
    logs = sb.get_diagnostic_logs("container")
    assert logs.sandbox_id == sb.id
    assert (logs.kind, logs.scope) == ("logs", "container")
    assert logs.delivery in ("inline", "url")
    assert logs.content_type
    assert isinstance(logs.truncated, bool)

    events = sb.get_diagnostic_events("runtime")
    assert (events.kind, events.scope) == ("events", "runtime")
    text = fb.diagnostic_text(flow.server, events)
    assert re.search(r"creat", text, re.IGNORECASE), f"runtime events do not mention the creation:\n{text}"
    assert manager.get_diagnostic_events(sb.id, "runtime").sandbox_id == sb.id

    # The raw DiagnosticContentResponse shape.
    required = {"sandboxId", "kind", "scope", "delivery", "contentType", "truncated"}
    with flow.server.http() as client:
        for kind, scope in (("logs", "container"), ("events", "runtime")):
            r = client.get(f"/v1/sandboxes/{sb.id}/diagnostics/{kind}", params={"scope": scope})
            assert r.status_code == 200, r.text
            body = r.json()
            assert required <= body.keys(), body
            assert fb.find_nulls(body) == []
            assert body["delivery"] != "inline" or isinstance(body.get("content"), str)


def test_kill_reaches_terminated(flow: Flow) -> None:
    """Last test of each mode: kills the flow sandbox."""
    sb = flow.sb
    sb.kill()
    seen: list[str] = []

    def terminated() -> bool:
        seen.append(sb.get_info().status.state)
        return seen[-1] == "Terminated"

    fb.wait_until(terminated, timeout=30, interval=0.2, what="state Terminated after kill")
    assert set(seen) <= {"Stopping", "Terminated"}, seen
    with pytest.raises(SandboxException):
        sb.commands.run("true")


# --------------------------------------------------------------------------- entrypoint
def test_entrypoint_output_in_diagnostics(fastbox: fb.FastboxServer) -> None:
    entry = ["/bin/sh", "-c", "echo entry-marker-123; exec tail -f /dev/null"]
    sb = fastbox.create_sandbox(entrypoint=entry, metadata={"fbt-suite": "entrypoint"})
    try:
        assert sb.get_info().entrypoint == entry

        def marker_logged() -> bool:
            logs = sb.get_diagnostic_logs("container")
            return "entry-marker-123" in fb.diagnostic_text(fastbox, logs)

        fb.wait_until(
            marker_logged, timeout=20, interval=0.5, what="the entrypoint's output in diagnostics"
        )
        ex = sb.commands.run("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '")
        assert "tail -f /dev/null" in "\n".join(lines(ex.logs.stdout))
    finally:
        sb.kill()
        sb.close()
