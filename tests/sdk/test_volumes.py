"""Volumes through the official SDK (`Volume` of the lifecycle spec): host volumes under the
directory the operator allows (`--allow-host-volume`), read-write and read-only, a `subPath`,
pause and resume with volumes, a snapshot's clone on the same volumes, named (`pvc`) volumes with their quota, sharing and
`deleteOnSandboxTermination` (and `fastbox volume list|rm`), and the answers for what is
refused.

The server of this module allows one directory of its own; every path outside it is
refused with a 400 that names the volume.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import fastbox_server as fb
import httpx
import pytest
from opensandbox.exceptions import SandboxException
from opensandbox.models.sandboxes import PVC, Host, Volume
from opensandbox.sync.manager import SandboxManagerSync
from opensandbox.sync.sandbox import SandboxSync

lines = fb.lines


@pytest.fixture(scope="module")
def allowed() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="fastbox-sdk-volumes-"))
    yield d.resolve()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def fastbox(request: pytest.FixtureRequest, allowed: Path) -> fb.FastboxServer:
    """This module's own `fastbox up`, allowing host volumes under `allowed` only."""
    return fb.module_server(request, "test_volumes", ["--allow-host-volume", str(allowed)])


def run_ok(sb: SandboxSync, command: str) -> str:
    ex = sb.commands.run(command)
    out = "\n".join(lines(ex.logs.stdout))
    assert ex.exit_code == 0, (command, out, lines(ex.logs.stderr), ex.error)
    return out


def test_a_host_volume_is_shared_with_the_host_read_write(
    fastbox: fb.FastboxServer, allowed: Path
) -> None:
    work = allowed / "work"
    work.mkdir()
    (work / "from-host.txt").write_text("written on the host\n")
    t0 = time.monotonic()
    sb = fastbox.create_sandbox(
        volumes=[Volume(name="work", host=Host(path=str(work)), mount_path="/workspace")]
    )
    print(f"[volumes] create with a volume ready in {time.monotonic() - t0:.3f}s")
    try:
        assert sb.files.read_file("/workspace/from-host.txt") == "written on the host\n"
        run_ok(sb, "echo written in the sandbox > /workspace/from-sandbox.txt")
        assert (work / "from-sandbox.txt").read_text() == "written in the sandbox\n"
        mounts = run_ok(sb, "grep ' /workspace ' /proc/self/mountinfo")
        assert "nosuid" in mounts and "nodev" in mounts, mounts
        # The tenant's root cannot take the volume off, nor remount it.
        ex = sb.commands.run("umount /workspace || mount -o remount,suid /workspace")
        assert ex.exit_code != 0, lines(ex.logs.stdout)
        assert mounts == run_ok(sb, "grep ' /workspace ' /proc/self/mountinfo")
        assert sb.files.read_file("/workspace/from-host.txt") == "written on the host\n"
    finally:
        sb.kill()
        sb.close()


def test_a_read_only_volume_and_a_sub_path(fastbox: fb.FastboxServer, allowed: Path) -> None:
    data = allowed / "data"
    (data / "models" / "v1").mkdir(parents=True)
    (data / "models" / "v1" / "weights.bin").write_bytes(b"\x00\x01weights")
    (data / "secret-of-another-path.txt").write_text("not for this sandbox\n")
    sb = fastbox.create_sandbox(
        volumes=[
            Volume(
                name="models",
                host=Host(path=str(data)),
                mount_path="/mnt/models",
                read_only=True,
                sub_path="models/v1",
            ),
            Volume(
                name="scratch",
                host=Host(path=str(data)),
                mount_path="/mnt/scratch",
                sub_path="scratch/new",
            ),
        ]
    )
    try:
        assert run_ok(sb, "ls /mnt/models") == "weights.bin"
        ex = sb.commands.run("touch /mnt/models/new")
        assert ex.exit_code != 0
        assert "Read-only file system" in "\n".join(lines(ex.logs.stderr)), lines(
            ex.logs.stderr
        )
        assert not (data / "models" / "v1" / "new").exists()
        # A subPath that did not exist is made inside the volume.
        run_ok(sb, "echo kept > /mnt/scratch/out")
        assert (data / "scratch" / "new" / "out").read_text() == "kept\n"
        # Neither mount shows what lies beside its subPath.
        assert "secret-of-another-path" not in run_ok(sb, "ls -a /mnt/models /mnt/scratch")
    finally:
        sb.kill()
        sb.close()


def test_volumes_survive_pause_and_resume_with_a_process_inside_them(
    fastbox: fb.FastboxServer, allowed: Path
) -> None:
    work = allowed / "paused"
    work.mkdir()
    sb = fastbox.create_sandbox(
        volumes=[
            Volume(name="work", host=Host(path=str(work)), mount_path="/workspace"),
            Volume(
                name="ro", host=Host(path=str(work)), mount_path="/mnt/ro", read_only=True
            ),
        ]
    )
    resumed: SandboxSync | None = None
    try:
        # A process whose working directory and open file are in the volume: the checkpoint
        # must take them as they are.
        run_ok(
            sb,
            "cd /workspace && nohup sh -c 'exec 3>>log; while :; do echo tick >&3; "
            "sleep 0.2; done' >/dev/null 2>&1 &",
        )
        fb.wait_until(lambda: (work / "log").exists(), timeout=10, what="the writer started")
        sb.pause()
        fb.wait_until(
            lambda: fastbox_state(fastbox, sb.id) == "Paused", timeout=120, what="paused"
        )
        ticks = (work / "log").read_text().count("tick")
        (work / "written-while-paused").write_text("from the host\n")
        resumed = SandboxSync.resume(sb.id, connection_config=fastbox.connection_config())
        assert resumed.files.read_file("/workspace/written-while-paused") == "from the host\n"
        fb.wait_until(
            lambda: (work / "log").read_text().count("tick") > ticks + 2,
            timeout=10,
            what="the writer goes on after the resume",
        )
        mounts = run_ok(resumed, "grep -E ' /(workspace|mnt/ro) ' /proc/self/mountinfo")
        for line in mounts.splitlines():
            assert "nosuid" in line and "nodev" in line, line
        ex = resumed.commands.run("touch /mnt/ro/new")
        assert ex.exit_code != 0 and not (work / "new").exists(), "read-only lost on resume"
        # Nothing of the resume's staging is left mounted on the host.
        with open("/proc/self/mountinfo") as f:
            assert "volume-mounts" not in f.read()
    finally:
        if resumed is not None:
            resumed.close()
        sb.kill()
        sb.close()


def fastbox_state(fastbox: fb.FastboxServer, sid: str) -> str:
    with fastbox.http() as api:
        r = api.get(f"/v1/sandboxes/{sid}")
        r.raise_for_status()
        return r.json()["status"]["state"]


def test_refused_volumes_say_why(fastbox: fb.FastboxServer, allowed: Path) -> None:
    def create(volume: dict[str, object]) -> httpx.Response:
        body = {
            "image": {"uri": fb.TEST_IMAGE},
            "entrypoint": ["sleep", "600"],
            "timeout": 600,
            "resourceLimits": {"cpu": "1", "memory": "256Mi"},
            "metadata": {"fbt-run": fastbox.prefix},
            "volumes": [volume],
        }
        with fastbox.http() as api:
            return api.post("/v1/sandboxes", json=body)

    with fastbox.http() as api:
        before = len(fastbox.list_all(api))
    outside = create({"name": "etc", "host": {"path": "/etc"}, "mountPath": "/x"})
    assert outside.status_code == 400, outside.text
    assert "etc" in outside.text and "not under a directory" in outside.text, outside.text
    dotdot = create(
        {"name": "up", "host": {"path": f"{allowed}/../.."}, "mountPath": "/x"}
    )
    assert dotdot.status_code == 400 and "'..'" in dotdot.text, dotdot.text
    proc = create({"name": "p", "host": {"path": str(allowed)}, "mountPath": "/proc/x"})
    assert proc.status_code == 400 and "/proc" in proc.text, proc.text
    # An object-storage volume whose endpoint is a private address (test_object_volumes.py
    # has buckets at work).
    ossfs = create(
        {
            "name": "o",
            "ossfs": {
                "bucket": "bucket",
                "endpoint": "http://10.0.0.1:9000",
                "accessKeyId": "key-id",
                "accessKeySecret": "ossfs-secret-value-1234",
            },
            "mountPath": "/x",
        }
    )
    assert ossfs.status_code == 400, ossfs.text
    assert "private" in ossfs.text, ossfs.text
    assert "ossfs-secret-value-1234" not in ossfs.text, "a refused volume echoed its secret"
    # Through the SDK, the same refusal.
    with pytest.raises(SandboxException) as e:
        fastbox.create_sandbox(
            volumes=[Volume(name="named", pvc=PVC(claim_name="Not_A_Label"), mount_path="/data")]
        )
    assert "claimName" in str(e.value), e.value
    # Nothing was recorded for any of them.
    with fastbox.http() as api:
        assert len(fastbox.list_all(api)) == before


def fastbox_cli(fastbox: fb.FastboxServer, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(fastbox.binary), *args, "--data-dir", str(fastbox.data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_named_volumes_are_shared_limited_and_go_with_their_sandbox(
    fastbox: fb.FastboxServer,
) -> None:
    shared = PVC(claim_name="shared", storage="64Mi", delete_on_sandbox_termination=True)
    first = fastbox.create_sandbox(
        volumes=[Volume(name="shared", pvc=shared, mount_path="/data")]
    )
    second: SandboxSync | None = None
    try:
        run_ok(first, "echo made by the first > /data/note")
        second = fastbox.create_sandbox(
            volumes=[
                Volume(
                    name="shared",
                    pvc=PVC(claim_name="shared", create_if_not_exists=False),
                    mount_path="/mnt/shared",
                    read_only=True,
                )
            ]
        )
        assert second.files.read_file("/mnt/shared/note") == "made by the first\n"
        # The quota is the volume's size: 64 MiB do not take 100.
        ex = first.commands.run("dd if=/dev/zero of=/data/big bs=1M count=100")
        assert ex.exit_code != 0
        assert "No space left" in "\n".join(lines(ex.logs.stderr)), lines(ex.logs.stderr)
        run_ok(first, "rm -f /data/big")
        listed = fastbox_cli(fastbox, "volume", "list")
        assert listed.returncode == 0, listed.stderr
        row = next(l for l in listed.stdout.splitlines() if l.startswith("shared "))
        assert first.id in row and second.id in row and "64.0Mi" in row, listed.stdout
        refused = fastbox_cli(fastbox, "volume", "rm", "shared")
        assert refused.returncode != 0 and "mounted by" in refused.stderr, refused
        # Its maker's end leaves it to the sandbox still using it...
        first.kill()
        fb.wait_until(
            lambda: fastbox_state(fastbox, first.id) == "Terminated", timeout=60, what="deleted"
        )
        assert second.files.read_file("/mnt/shared/note") == "made by the first\n"
        # ...and it goes with the last one (deleteOnSandboxTermination).
        second.kill()
        fb.wait_until(
            lambda: fastbox_state(fastbox, second.id) == "Terminated", timeout=60, what="deleted"
        )
        listed = fastbox_cli(fastbox, "volume", "list")
        assert "shared " not in listed.stdout, listed.stdout
    finally:
        for sb in (first, second):
            if sb is not None:
                sb.kill()
                sb.close()


def refused_named_create(fastbox: fb.FastboxServer, pvc: PVC, *expected: str) -> None:
    """A create with named volume `pvc` fails, saying each of `expected`, and leaves no
    volume behind."""
    with pytest.raises(SandboxException) as e:
        fastbox.create_sandbox(
            volumes=[Volume(name="refused", pvc=pvc, mount_path="/data")],
            ready_timeout=timedelta(seconds=30),
        )
    for text in expected:
        assert text in str(e.value), e.value
    listed = fastbox_cli(fastbox, "volume", "list")
    assert f"{pvc.claim_name} " not in listed.stdout, listed.stdout


def test_a_named_volume_that_must_exist_and_does_not_fails_the_create(
    fastbox: fb.FastboxServer,
) -> None:
    refused_named_create(
        fastbox,
        PVC(claim_name="never-made", create_if_not_exists=False),
        "never-made",
        "does not exist",
    )


def test_a_snapshot_s_clones_mount_the_same_volumes_never_a_copy(
    fastbox: fb.FastboxServer, allowed: Path
) -> None:
    work = allowed / "cloned"
    work.mkdir()
    source = fastbox.create_sandbox(
        volumes=[
            Volume(name="work", host=Host(path=str(work)), mount_path="/workspace"),
            Volume(
                name="named",
                pvc=PVC(claim_name="clones", storage="16Mi"),
                mount_path="/data",
            ),
        ]
    )
    clone: SandboxSync | None = None
    manager = SandboxManagerSync.create(fastbox.connection_config())
    try:
        run_ok(source, "echo before > /workspace/f && echo before > /data/f")
        info = source.create_snapshot()
        deadline = time.monotonic() + 120
        while manager.get_snapshot(info.id).status.state != "Ready":
            assert time.monotonic() < deadline, manager.get_snapshot(info.id)
            time.sleep(0.25)
        clone = SandboxSync.create(
            snapshot_id=info.id,
            connection_config=fastbox.connection_config(),
            timeout=timedelta(minutes=10),
            ready_timeout=timedelta(seconds=120),
            resource={"cpu": "1", "memory": "1Gi"},
        )
        # The clone writes where the source and the host see it: the same directories.
        run_ok(clone, "echo from the clone > /workspace/g && echo from the clone > /data/g")
        assert (work / "g").read_text() == "from the clone\n"
        assert source.files.read_file("/data/g") == "from the clone\n"
        assert clone.files.read_file("/workspace/f") == "before\n"
    finally:
        manager.close()
        for sb in (clone, source):
            if sb is not None:
                sb.kill()
                sb.close()


def test_a_named_volume_larger_than_the_node_s_free_disk_is_refused(
    fastbox: fb.FastboxServer,
) -> None:
    assert fastbox.data_dir is not None
    st = os.statvfs(fastbox.data_dir)
    if st.f_bavail * st.f_frsize >= 256 << 30:
        pytest.skip("this disk has 256 GiB free: the largest named volume fits")
    refused_named_create(fastbox, PVC(claim_name="huge", storage="256Gi"), "huge", "free")
