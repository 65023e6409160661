"""Object-storage (`ossfs`) volumes through the official SDK: a bucket prefix of an S3 test
server (moto) in a test internet of this module's own (`lab_internet.py`), mounted by the
node's FUSE client in the sandbox's network namespace.

Checked: what the sandbox writes lands in the bucket under the prefix, and what the bucket
gets appears in the sandbox; the keys are never echoed nor kept (not in the sandbox's
record, the instance's files or the server's log); pause and snapshot answer 409; an
endpoint in a private range, an option naming a host path and a missing key are refused
with a 400 that does not quote the secret; the mount goes with the sandbox.
"""

from __future__ import annotations

import secrets
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import fastbox_server as fb
import httpx
import pytest
from lab_internet import LabInternet
from opensandbox.exceptions import SandboxException
from opensandbox.models.sandboxes import OSSFS, Volume
from opensandbox.sync.sandbox import SandboxSync

S3_NAME = "s3.test"
BUCKET = "fbt-bucket"
PREFIX = "team/a"
MOTO = fb.REPO / ".deps" / "venv" / "bin" / "moto_server"


@pytest.fixture(scope="module")
def lab() -> Iterator[LabInternet]:
    reason = fb.skip_reason()
    if reason:
        pytest.skip(reason)
    if not MOTO.exists():
        pytest.skip(f"{MOTO} is missing (scripts/setup.sh installs it)")
    lab = LabInternet(fb.session_prefix(), Path(tempfile.mkdtemp(prefix="fastbox-sdk-lab-")))
    lab.start(zone={S3_NAME: lab.host(20)}, tls_hosts={}, http_hosts={})
    # Path-style requests whatever the host name (`s3.test` is no bucket's subdomain).
    moto = ["env", "S3_IGNORE_SUBDOMAIN_BUCKETNAME=1", str(MOTO), "-H", lab.host(20), "-p", "80"]
    lab.run_inside("moto", moto)
    fb.wait_until(lambda: _answers(f"http://{lab.host(20)}"), timeout=30, what="the S3 test server")
    s3(lab).create_bucket(Bucket=BUCKET)
    yield lab
    lab.stop()


def s3(lab: LabInternet):  # type: ignore[no-untyped-def]
    """A client of the lab's S3 server, from the host (boto3 comes with moto)."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=f"http://{lab.host(20)}",
        region_name="us-east-1",
        aws_access_key_id="AKIDFASTBOXTEST",
        aws_secret_access_key="test-only",
    )


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code < 500
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def fastbox(request: pytest.FixtureRequest, lab: LabInternet) -> fb.FastboxServer:
    """This module's own `fastbox up`, its names resolved by the lab."""
    return fb.module_server(request, "test_object_volumes", ["--dns-upstream", lab.dns])


def bucket_volume(secret: str, **kw: object) -> Volume:
    return Volume(
        name="data",
        ossfs=OSSFS(
            bucket=BUCKET,
            endpoint=f"http://{S3_NAME}",
            access_key_id="AKIDFASTBOXTEST",
            access_key_secret=secret,
            options=["use_path_request_style"],
            **kw,
        ),
        mount_path="/data",
        sub_path=PREFIX,
    )


def run_ok(sb: SandboxSync, command: str) -> str:
    ex = sb.commands.run(command)
    out = "\n".join(fb.lines(ex.logs.stdout))
    assert ex.exit_code == 0, (command, out, fb.lines(ex.logs.stderr))
    return out


def fuse_mounts_under(directory: Path) -> list[str]:
    return [
        line
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if str(directory) in line and " - fuse" in line
    ]


def test_a_bucket_prefix_is_the_sandboxs_volume_and_its_keys_are_kept_nowhere(
    fastbox: fb.FastboxServer, lab: LabInternet, api: httpx.Client
) -> None:
    secret = "fbt-s3-" + secrets.token_hex(12)
    bucket = s3(lab)
    t0 = time.monotonic()
    sb = fastbox.create_sandbox(volumes=[bucket_volume(secret)])
    print(f"[object volumes] create with a bucket ready in {time.monotonic() - t0:.3f}s")
    try:
        # The sandbox writes: the object is in the bucket, under the prefix.
        run_ok(sb, "echo written in the sandbox > /data/hello.txt && sync")
        got = bucket.get_object(Bucket=BUCKET, Key=f"{PREFIX}/hello.txt")["Body"].read()
        assert got == b"written in the sandbox\n", got
        # The bucket gets an object: the sandbox reads it.
        bucket.put_object(Bucket=BUCKET, Key=f"{PREFIX}/from-s3.txt", Body=b"from the bucket\n")
        assert sb.files.read_file("/data/from-s3.txt") == "from the bucket\n"
        # Outside the prefix stays outside.
        bucket.put_object(Bucket=BUCKET, Key="elsewhere.txt", Body=b"not yours\n")
        assert "elsewhere.txt" not in run_ok(sb, "ls -a /data /data/..")

        # The keys: never in the sandbox's record, the instance's files or the server's log.
        record = api.get(f"/v1/sandboxes/{sb.id}")
        assert record.status_code == 200 and secret not in record.text
        assert fastbox.data_dir is not None and fastbox.log_path is not None
        assert fb.files_holding(fastbox.data_dir, secret.encode()) == []
        assert secret not in fastbox.log_path.read_text()

        # A checkpoint cannot hold the mount: pause and snapshot are refused, clearly.
        for path in (f"/v1/sandboxes/{sb.id}/pause", f"/v1/sandboxes/{sb.id}/snapshots"):
            r = api.post(path, json={})
            assert r.status_code == 409 and "object storage" in r.text, (path, r.text)
        assert fuse_mounts_under(fastbox.data_dir), "mounted while the sandbox runs"
    finally:
        sb.kill()
        sb.close()
    fb.wait_until(
        lambda: not fuse_mounts_under(fastbox.data_dir),  # type: ignore[arg-type]
        timeout=30,
        what="the bucket unmounted with its sandbox",
    )


def test_bad_buckets_are_refused_without_quoting_the_secret(
    fastbox: fb.FastboxServer, api: httpx.Client
) -> None:
    secret = "fbt-s3-" + secrets.token_hex(12)
    base = {
        "bucket": BUCKET,
        "endpoint": f"http://{S3_NAME}",
        "accessKeyId": "AKIDFASTBOXTEST",
        "accessKeySecret": secret,
    }
    cases = [
        ({"endpoint": "http://10.1.2.3:9000"}, "private"),
        ({"endpoint": "http://169.254.169.254"}, "link-local"),
        ({"endpoint": "ftp://s3.test"}, "scheme"),
        ({"options": ["passwd_file=/etc/shadow"]}, "not allowed"),
        ({"bucket": "Bad_Bucket"}, "bucket"),
        ({"accessKeyId": ""}, "accessKeyId"),
    ]
    for change, expected in cases:
        r = api.post(
            "/v1/sandboxes",
            json={
                "image": {"uri": fb.TEST_IMAGE},
                "entrypoint": ["tail", "-f", "/dev/null"],
                "metadata": {"fbt-run": fastbox.prefix},
                "volumes": [{"name": "data", "mountPath": "/data", "ossfs": {**base, **change}}],
            },
        )
        assert r.status_code == 400 and expected in r.text, (change, r.text)
        assert secret not in r.text, r.text
    # A bucket the server cannot reach fails the create with the client's reason.
    with pytest.raises(SandboxException):
        fastbox.create_sandbox(
            volumes=[
                Volume(
                    name="data",
                    ossfs=OSSFS(
                        bucket="fbt-no-such-bucket",
                        endpoint=f"http://{S3_NAME}",
                        access_key_id="AKIDFASTBOXTEST",
                        access_key_secret=secret,
                        options=["use_path_request_style"],
                    ),
                    mount_path="/data",
                )
            ],
            ready_timeout=timedelta(seconds=60),
        )
