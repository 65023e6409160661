#!/usr/bin/env bash
# Create latency with each state store, in one run: `fastbox up` on the embedded redb file,
# then on a three-member etcd (its data on disk, as a cluster keeps it), taking turns, each
# measured with `fastbox bench create` (pool on, paced: the pool refills between batches),
# serially and at concurrency 10. After each bench it prints the server's own view of the
# creates (`fastbox_create_phase_seconds`: admit, intent, start), as means.
#
#   scripts/bench-state.sh [--rounds R] [--n N] [--n10 N] [--out DIR]
#
# --n creates per bench (60), --n10 those at concurrency 10 (as many: each burst of ten is
# one sample of the machine's load, so more of them steady the median). It ends with what
# etcd adds at the median in each round, and the median of those.
#
# Needs what scripts/setup.sh installs (etcd in .deps/etcd, CRIU, the static execd) and a
# release build (`cargo build --release -p fastbox-cli`). Everything it starts goes when it
# ends: the members, the server and, through `fastbox purge`, the sandboxes of its instance
# (prefix `fbbench`). It sends traffic to loopback only.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/lib.sh
[ -f .deps/env ] && source .deps/env

rounds=2 n=60 n10="" out=""
while [ $# -gt 0 ]; do
    case $1 in
        --rounds) rounds=$2; shift 2 ;;
        --n) n=$2; shift 2 ;;
        --n10) n10=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        *) echo "usage: $0 [--rounds R] [--n N] [--n10 N] [--out DIR]" >&2; exit 2 ;;
    esac
done
bin=target/release/fastbox
etcd_bin=${FASTBOX_ETCD_BIN:-.deps/etcd/bin/etcd}
[ -x "$bin" ] || { echo "build first: cargo build --release -p fastbox-cli" >&2; exit 1; }
[ -x "$etcd_bin" ] || { echo "no etcd at $etcd_bin: run scripts/setup.sh" >&2; exit 1; }
work=$(mktemp -d /var/tmp/fastbox-bench-state.XXXXXX)
keep_work=false
[ -z "$out" ] && { out=$work/results; keep_work=true; }
mkdir -p "$out"
prefix=fbbench key=bench-$RANDOM$RANDOM
pids=()

# A free loopback port.
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

stop_server() {
    local pid=$1
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -9 "$pid" 2>/dev/null || true
    "$bin" purge --prefix "$prefix" --data-dir "$work/data" >/dev/null 2>&1 || true
}
cleanup() {
    for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
    "$bin" purge --prefix "$prefix" --data-dir "$work/data" >/dev/null 2>&1 || true
    rm -rf "$work/data" "$work"/etcd*
    $keep_work || rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Three etcd members on disk; prints the state URL.
start_etcd() {
    local cluster="" urls="" i
    local client=() peer=()
    for i in 0 1 2; do client+=("$(port)"); peer+=("$(port)"); done
    for i in 0 1 2; do cluster+="m$i=http://127.0.0.1:${peer[$i]},"; done
    for i in 0 1 2; do
        rm -rf "$work/etcd$i"
        "$etcd_bin" --name "m$i" --data-dir "$work/etcd$i" \
            --listen-client-urls "http://127.0.0.1:${client[$i]}" \
            --advertise-client-urls "http://127.0.0.1:${client[$i]}" \
            --listen-peer-urls "http://127.0.0.1:${peer[$i]}" \
            --initial-advertise-peer-urls "http://127.0.0.1:${peer[$i]}" \
            --initial-cluster "${cluster%,}" --initial-cluster-token "$key" \
            --initial-cluster-state new --heartbeat-interval 250 --election-timeout 2500 \
            --logger zap --log-level warn >"$work/etcd$i.log" 2>&1 &
        pids+=($!)
        urls+="127.0.0.1:${client[$i]},"
    done
    echo "etcd://${urls%,}/fastbox-bench"
}

# Means of the server's create phases since the last call ($1: file of the earlier ones).
phases() {
    local api=$1 before=$2 now
    now=$(curl -s -H "OPEN-SANDBOX-API-KEY: $key" "http://$api/metrics" | grep -E '^fastbox_create_phase_seconds_(sum|count)' || true)
    NOW=$now python3 - "$before" <<'EOF'
import os, sys
def read(lines):
    d = {}
    for line in lines:
        if line.strip():
            k, v = line.rsplit(" ", 1)
            d[k] = float(v)
    return d
before = read(open(sys.argv[1]))
now = read(os.environ["NOW"].splitlines())
parts = []
for phase in ("admit", "intent", "start", "total"):
    s, c = (f'fastbox_create_phase_seconds_{x}{{phase="{phase}"}}' for x in ("sum", "count"))
    n = now.get(c, 0) - before.get(c, 0)
    if n:
        parts.append(f"{phase} {1000 * (now[s] - before.get(s, 0)) / n:.1f}")
print("    server, mean ms: " + ", ".join(parts))
EOF
    echo "$now" >"$before"
}

run_store() {
    local store=$1 round=$2 state_args=() api node control pid
    if [ "$store" = etcd ]; then
        state_args=(--state "$(start_etcd)" --server-id bench)
        sleep 3
    fi
    api=127.0.0.1:$(port) node=127.0.0.1:$(port) control=127.0.0.1:$(port)
    rm -rf "$work/data"
    FASTBOX_PREFIX=$prefix "$bin" up --data-dir "$work/data" --listen "$api" \
        --node-proxy-listen "$node" --control-listen "$control" --api-key "$key" \
        --default-image fastbox/busybox "${state_args[@]}" >"$work/up-$store-$round.log" 2>&1 &
    pid=$!
    pids+=("$pid")
    for _ in $(seq 1 240); do
        curl -sf -H "OPEN-SANDBOX-API-KEY: $key" "http://$api/v1/sandboxes" >/dev/null 2>&1 && break
        kill -0 "$pid" 2>/dev/null || { cat "$work/up-$store-$round.log" >&2; exit 1; }
        sleep 0.5
    done
    "$bin" bench create --url "http://$api" --api-key "$key" --image fastbox/busybox \
        --n 5 --warmup 5 >/dev/null 2>&1 || true
    : >"$work/phases"
    phases "$api" "$work/phases" >/dev/null
    for c in 1 10; do
        fb_log "round $round, $store, concurrency $c"
        "$bin" bench create --url "http://$api" --api-key "$key" --image fastbox/busybox \
            --n "$([ "$c" = 10 ] && echo "${n10:-$n}" || echo "$n")" --concurrency "$c" \
            --batch-pause 1 --json \
            >"$out/$store-r$round-c$c.json" 2>"$out/$store-r$round-c$c.err"
        python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("    bench: p50 %.1f ms, p90 %.1f, p99 %.1f, failures %s" % (d["p50_ms"], d["p90_ms"], d["p99_ms"], d["failures"]))' \
            "$out/$store-r$round-c$c.json"
        phases "$api" "$work/phases"
    done
    stop_server "$pid"
    if [ "$store" = etcd ]; then
        pkill -f -- "--initial-cluster-token $key" || true
        sleep 1
    fi
}

for round in $(seq 1 "$rounds"); do
    run_store redb "$round"
    run_store etcd "$round"
done
python3 - "$out" "$rounds" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
for c in (1, 10):
    p50 = lambda store, r: json.load(open(f"{out}/{store}-r{r}-c{c}.json"))["p50_ms"]
    added = [p50("etcd", r) - p50("redb", r) for r in range(1, rounds + 1)]
    print(f"    concurrency {c}: etcd adds at the median " +
          ", ".join(f"{a:+.1f}" for a in added) +
          f" ms by round; the median of those {statistics.median(added):+.1f} ms")
EOF
fb_log "results (bench create --json) in $out"
