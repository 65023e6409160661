"""Benchmark: serial create -> ready through the official SDK, and execd /ping latency through
the node proxy, the server proxy and direct to execd, all against one `fastbox up`.

    sudo FASTBOX_BIN=target/release/fastbox .deps/venv/bin/python tests/sdk/bench_create_ready.py --n 50

With --volumes, creates without a volume, with a host volume and with a named volume take
turns (the same noise for each), and each is reported.

Prints medians and percentiles from this one run (and JSON with --json). Not a test: pytest
does not collect it.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import fastbox_server as fb
import httpx
from opensandbox.models.sandboxes import PVC, Host, Volume
from opensandbox.sync.sandbox import SandboxSync


def percentiles(samples_ms: list[float]) -> dict[str, float]:
    s = sorted(samples_ms)

    def pct(p: float) -> float:
        return s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))]

    return {
        "n": len(s),
        "p50": round(statistics.median(s), 2),
        "p90": round(pct(90), 2),
        "p99": round(pct(99), 2),
        "min": round(s[0], 2),
        "max": round(s[-1], 2),
    }


def time_creates(
    server: fb.FastboxServer, n: int, volumes: list[Volume] | None = None, label: str = ""
) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        sb = SandboxSync.create(
            fb.TEST_IMAGE,
            timeout=timedelta(minutes=10),
            ready_timeout=timedelta(seconds=60),
            connection_config=server.connection_config(),
            volumes=volumes,
        )
        out.append((time.perf_counter() - t0) * 1000)
        sb.kill()
        sb.close()
        print(f"create{label} {i + 1}/{n}: {out[-1]:.1f} ms", file=sys.stderr, flush=True)
    return out


def time_volume_creates(server: fb.FastboxServer, n: int, host_dir: str) -> dict[str, list[float]]:
    """Creates without a volume, with a host volume and with a named volume, in turns."""
    kinds: dict[str, list[Volume] | None] = {
        "no volume": None,
        "host volume": [Volume(name="work", host=Host(path=host_dir), mount_path="/workspace")],
        "named volume": [
            Volume(name="data", pvc=PVC(claim_name="bench", storage="64Mi"), mount_path="/data")
        ],
    }
    out: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(n):
        for kind, volumes in kinds.items():
            out[kind] += time_creates(server, 1, volumes, f" ({kind})")
    return out


def time_pings(url: str, headers: dict[str, str], n: int) -> list[float]:
    with httpx.Client(headers=headers, trust_env=False, timeout=10) as c:
        c.get(url).raise_for_status()  # warm the connection
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            c.get(url).raise_for_status()
            out.append((time.perf_counter() - t0) * 1000)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50, help="serial creates")
    ap.add_argument("--pings", type=int, default=200, help="pings per path")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--volumes", action="store_true", help="time creates with volumes too")
    args = ap.parse_args()
    if reason := fb.skip_reason():
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    host_dir = tempfile.mkdtemp(prefix="fastbox-bench-volume-")
    server = fb.FastboxServer(
        "bench", extra_args=["--allow-host-volume", host_dir] if args.volumes else []
    )
    server.start()
    with_volumes: dict[str, list[float]] = {}
    try:
        if args.volumes:
            with_volumes = time_volume_creates(server, args.n, host_dir)
            creates = with_volumes["no volume"]
        else:
            creates = time_creates(server, args.n)
        sb = server.create_sandbox()
        with server.http() as api:
            direct_ep = api.get(f"/v1/sandboxes/{sb.id}/endpoints/44772").json()
            proxy_ep = api.get(
                f"/v1/sandboxes/{sb.id}/endpoints/44772", params={"use_server_proxy": "true"}
            ).json()
            events = api.get(f"/v1/sandboxes/{sb.id}/diagnostics/events").json()["content"]
        # The sandbox's own address is never handed out; the benchmark reads it from the
        # lifecycle event, to compare with a direct connection from the host.
        address = re.search(r"started at (\S+)", events).group(1)
        token = direct_ep["headers"]
        pings = {
            "node_proxy": time_pings(f"http://{direct_ep['endpoint']}/ping", token, args.pings),
            "server_proxy": time_pings(
                f"http://{proxy_ep['endpoint']}/ping",
                {**token, fb.API_KEY_HEADER: server.api_key},
                args.pings,
            ),
            "direct": time_pings(f"http://{address}:44772/ping", token, args.pings),
        }
        sb.kill()
        sb.close()
    finally:
        server.cleanup()
        shutil.rmtree(host_dir, ignore_errors=True)
    report = {
        "create_to_ready_ms": percentiles(creates),
        "ping_ms": {k: percentiles(v) for k, v in pings.items()},
        "create_to_ready_by_volume_ms": {k: percentiles(v) for k, v in with_volumes.items()},
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        c = report["create_to_ready_ms"]
        print(f"SDK create -> ready (serial, n={c['n']}): p50 {c['p50']} ms, p90 {c['p90']}, "
              f"p99 {c['p99']}, min {c['min']}, max {c['max']}")
        for k, v in report["create_to_ready_by_volume_ms"].items():
            print(f"SDK create -> ready, {k:12} (n={v['n']}): p50 {v['p50']} ms, "
                  f"p90 {v['p90']}, p99 {v['p99']}, max {v['max']}")
        for k, v in report["ping_ms"].items():
            print(f"/ping via {k:12} (n={v['n']}): p50 {v['p50']} ms, p90 {v['p90']}, "
                  f"p99 {v['p99']}, max {v['max']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
