"""Benchmark: create -> ready through the official Python SDK, against a running server.

Shaped like OpenSandbox's published create benchmark: untimed warm-ups (2 by default), then
batches of CONCURRENCY threads with BATCH_PAUSE seconds between them. Each thread times
`SandboxSync.create(image)` (or `SandboxSync.create_from_template(id)` with --template) until the
SDK's own readiness check passes (execd endpoint resolved, `/ping` answered), then kills its
sandbox outside the timed region.

    .deps/venv/bin/python tests/sdk/bench_sdk_create.py --url http://127.0.0.1:8080 \
        --api-key KEY --image fastbox/busybox --n 50 --concurrency 10 --batch-pause 1 --json

Prints the same JSON keys as `fastbox bench create --json` (docs/bench.md). Not a test: pytest
does not collect it. Needs no root: it is only a client.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import fastbox_server as fb
from opensandbox.config import ConnectionConfigSync
from opensandbox.exceptions import (
    SandboxApiException,
    SandboxConnectionException,
    SandboxReadyTimeoutException,
    SandboxTimeoutException,
)
from opensandbox.sync.sandbox import SandboxSync

DEFAULT_DOMAIN = "127.0.0.1:8080"
DEFAULT_KEY_FILE = Path("/var/lib/fastbox/api-key")
# The lifetime of each sandbox (the SDK's default): a run that dies half-way leaves nothing
# running for long.
SANDBOX_TIMEOUT = timedelta(seconds=600)
POOL_EXTENSION = "fastbox.io/pool"


@dataclass
class Outcome:
    """One timed create: its latency, or why it failed; and whether its kill failed."""

    latency_ms: float | None = None
    failure: str | None = None
    kill_failed: bool = False


def nearest_rank(sorted_ms: list[float], percent: int) -> float | None:
    """The value at rank ceil(percent / 100 * n), 1-based, of an ascending list."""
    if not sorted_ms:
        return None
    rank = min(len(sorted_ms), max(1, math.ceil(percent * len(sorted_ms) / 100)))
    return sorted_ms[rank - 1]


def failure_reason(e: Exception) -> str:
    """The key a failure is counted under: the status and envelope code when the API answered,
    otherwise what kind of failure it was. The SDK does not say which request failed."""
    if isinstance(e, SandboxReadyTimeoutException):
        return "not ready within the timeout"
    if isinstance(e, SandboxApiException) and e.status_code:
        code = None
        try:
            code = json.loads(e.response_body or b"").get("code")
        except (ValueError, AttributeError):
            pass
        return " ".join(str(p) for p in ("HTTP", e.status_code, code) if p)
    if isinstance(e, SandboxConnectionException):
        return "cannot connect"
    if isinstance(e, SandboxTimeoutException):
        return "timed out"
    return type(e).__name__


def timed_create(create: Callable[[], SandboxSync]) -> Outcome:
    t0 = time.perf_counter()
    try:
        sb = create()
    except Exception as e:  # noqa: BLE001 - every failure is counted, none stops the run
        return Outcome(failure=failure_reason(e))
    out = Outcome(latency_ms=round((time.perf_counter() - t0) * 1000, 3))
    try:
        sb.kill()
    except Exception:  # noqa: BLE001
        out.kill_failed = True
    finally:
        sb.close()
    return out


def connection(url: str | None, api_key: str | None) -> ConnectionConfigSync:
    """The SDK's connection: `--url` (`http://host:port` or `host:port`), else
    $OPEN_SANDBOX_DOMAIN, else the local default; the key from the flag, $FASTBOX_API_KEY,
    $OPEN_SANDBOX_API_KEY or the local server's key file."""
    raw = url or os.environ.get("OPEN_SANDBOX_DOMAIN") or DEFAULT_DOMAIN
    protocol, _, domain = raw.rpartition("://")
    key = api_key or os.environ.get("FASTBOX_API_KEY") or os.environ.get("OPEN_SANDBOX_API_KEY")
    if not key and DEFAULT_KEY_FILE.is_file():
        key = DEFAULT_KEY_FILE.read_text().strip()
    return ConnectionConfigSync(
        domain=domain.rstrip("/"),
        protocol=protocol or "http",
        api_key=key,
        request_timeout=timedelta(seconds=60),
    )


def creator(args: argparse.Namespace, cfg: ConnectionConfigSync) -> Callable[[], SandboxSync]:
    common = {
        "timeout": SANDBOX_TIMEOUT,
        "ready_timeout": timedelta(seconds=args.ready_timeout),
        "connection_config": cfg,
        "extensions": {POOL_EXTENSION: "off"} if args.pool == "off" else None,
    }
    if args.template:
        return lambda: SandboxSync.create_from_template(args.template, **common)
    return lambda: SandboxSync.create(args.image, **common)


def run(args: argparse.Namespace) -> dict:
    create = creator(args, connection(args.url, args.api_key))
    warmup_failures = sum(timed_create(create).failure is not None for _ in range(args.warmup))
    outcomes: list[Outcome] = []
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.concurrency) as workers:
        while len(outcomes) < args.n:
            size = min(args.concurrency, args.n - len(outcomes))
            outcomes += workers.map(lambda _: timed_create(create), range(size))
            failed = sum(o.failure is not None for o in outcomes)
            print(f"bench sdk create: {len(outcomes)}/{args.n} done, {failed} failed",
                  file=sys.stderr, flush=True)  # fmt: skip
            if len(outcomes) < args.n:
                time.sleep(args.batch_pause)
    wall_s = time.perf_counter() - t0
    ms = sorted(o.latency_ms for o in outcomes if o.latency_ms is not None)
    reasons = Counter(o.failure for o in outcomes if o.failure is not None)
    return {
        "n": len(outcomes),
        "concurrency": args.concurrency,
        **({"template": args.template} if args.template else {"image": args.image}),
        "pool": args.pool,
        "batch_pause_s": args.batch_pause,
        "warmup": args.warmup,
        "warmup_failures": warmup_failures,
        "ready_timeout_s": args.ready_timeout,
        "ok": len(ms),
        **{f"p{p}_ms": nearest_rank(ms, p) for p in (50, 90, 99)},
        "min_ms": ms[0] if ms else None,
        "max_ms": ms[-1] if ms else None,
        "mean_ms": round(sum(ms) / len(ms), 3) if ms else None,
        "failures": sum(reasons.values()),
        "failure_reasons": dict(sorted(reasons.items())),
        "delete_failures": sum(o.kill_failed for o in outcomes),
        "wall_s": round(wall_s, 3),
        "throughput_per_s": round(len(ms) / wall_s, 2) if wall_s > 0 else 0.0,
    }


def human(r: dict) -> str:
    def ms(key: str) -> str:
        return "-" if r[key] is None else f"{r[key]:.1f} ms"

    source = f"template {r['template']}" if "template" in r else f"image {r['image']}"
    lines = [
        f"SDK create -> ready: {source}, n={r['n']}, concurrency {r['concurrency']}, batches "
        f"with {r['batch_pause_s']} s pauses, pool {r['pool']}, {r['warmup']} warm-up(s)",
        f"  p50 {ms('p50_ms')}  p90 {ms('p90_ms')}  p99 {ms('p99_ms')}  "
        f"(min {ms('min_ms')}, max {ms('max_ms')}, mean {ms('mean_ms')})",
        f"  {r['ok']} ok, {r['failures']} failed; wall {r['wall_s']:.2f} s, "
        f"{r['throughput_per_s']:.1f} creates/s",
    ]
    lines += [f"  failed: {n} x {reason}" for reason, n in r["failure_reasons"].items()]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", "--domain", dest="url", help="lifecycle API: URL or host:port")
    ap.add_argument("--api-key")
    ap.add_argument("--n", type=int, default=50, help="timed creates")
    ap.add_argument("--concurrency", type=int, default=1, help="creates per batch (threads)")
    ap.add_argument("--batch-pause", type=float, default=1.0, help="seconds between batches")
    ap.add_argument("--warmup", type=int, default=2, help="untimed creates first")
    ap.add_argument("--image", default=fb.TEST_IMAGE)
    ap.add_argument("--template", help="create_from_template with this id instead of an image")
    ap.add_argument("--pool", choices=("on", "off"), default="on",
                    help="off: ask for no pre-restored sandbox (extension fastbox.io/pool)")  # fmt: skip
    ap.add_argument("--ready-timeout", type=float, default=60.0, help="seconds")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args()
    if args.n < 1 or args.concurrency < 1 or args.warmup < 0 or args.batch_pause < 0:
        ap.error("--n and --concurrency must be >= 1, --warmup and --batch-pause >= 0")
    report = run(args)
    print(json.dumps(report) if args.json else human(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
