#!/usr/bin/env bash
# The one command that runs fastbox's whole test suite on a fresh machine (as root):
#
#   scripts/test.sh [extra nextest args, e.g. a test filter]
#
# Stages: setup (scripts/setup.sh) -> fmt (cargo fmt --check) -> clippy (-D warnings) ->
# execd (static release build of fastbox-execd) -> fuzz (scripts/fuzz.sh: the fuzz targets
# built and run for FASTBOX_FUZZ_SECONDS each, default 30; fails on a crash) -> tests (cargo
# nextest run --workspace) -> sdk (the OpenSandbox SDK, code interpreter and CLI against
# `fastbox up`, tests/sdk).
# Every stage after setup runs even when an earlier one failed; the script exits non-zero if any
# failed. A failed setup stops the run.
#
# Environment for the tests: FASTBOX_REPO, FASTBOX_CRIU, FASTBOX_EXECD_BIN,
# FASTBOX_REGISTRY_BIN, FASTBOX_VENV, FASTBOX_PYTHON, FASTBOX_TEST_PREFIX (fbt + 4 random hex
# digits: a per-run prefix for host-wide names such as netns, veths, cgroups).
# Knobs: FASTBOX_SKIP_SETUP=1 (developer loops), FASTBOX_FUZZ_SECONDS (per fuzz target; 0 skips
# the stage, as does a test filter), FASTBOX_TEST_TIMEOUT (seconds for the test
# stage, default 4200), FASTBOX_DEADLINE (epoch seconds by which the test stage must end; .ci/run
# sets it from CI's budget), FASTBOX_RUN_START (epoch seconds of the enclosing CI run, for its
# total).
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
FB_LOG_TAG="test"
cd "$FASTBOX_ROOT"

run_start=${FASTBOX_RUN_START:-$(fb_now)}
LOGDIR=$FASTBOX_ROOT/target/fastbox-test
mkdir -p "$LOGDIR"
TEST_LOG=$LOGDIR/nextest.log
: >"$TEST_LOG"
failed=()

# ---------------------------------------------------------------- setup
if [[ "${FASTBOX_SKIP_SETUP:-0}" == 1 ]]; then
    fb_log "FASTBOX_SKIP_SETUP=1: not running scripts/setup.sh"
elif ! fb_step setup "$FASTBOX_ROOT/scripts/setup.sh"; then
    fb_print_step_times
    fb_die "setup failed; not running the tests"
fi
if [[ -f "$FASTBOX_DEPS/env" ]]; then
    # shellcheck disable=SC1091
    source "$FASTBOX_DEPS/env"
fi

export FASTBOX_REPO=$FASTBOX_ROOT
export FASTBOX_CRIU=${FASTBOX_CRIU:-$FASTBOX_DEPS/criu/bin/criu}
export FASTBOX_EXECD_BIN=$FASTBOX_ROOT/target/x86_64-unknown-linux-gnu/release/fastbox-execd
FASTBOX_TEST_PREFIX=fbt$(od -An -N2 -tx1 /dev/urandom | tr -d ' \n')
export FASTBOX_TEST_PREFIX
# The offline Debian recipe is built for real (about a minute; the debootstrap test).
export FASTBOX_TEST_DEBOOTSTRAP=${FASTBOX_TEST_DEBOOTSTRAP:-1}
fb_log "FASTBOX_REPO=$FASTBOX_REPO"
fb_log "FASTBOX_CRIU=$FASTBOX_CRIU ($("$FASTBOX_CRIU" --version 2>/dev/null | head -n1 || echo 'not runnable'))"
fb_log "FASTBOX_EXECD_BIN=$FASTBOX_EXECD_BIN"
fb_log "FASTBOX_TEST_PREFIX=$FASTBOX_TEST_PREFIX"
# Colours off in logs; keep the cargo output plain for CI.
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}

# ---------------------------------------------------------------- fmt, clippy
fb_step fmt cargo fmt --all -- --check || failed+=(fmt)
fb_step clippy cargo clippy --workspace --all-targets -- -D warnings || failed+=(clippy)

# ---------------------------------------------------------------- static execd
build_execd() {
    # RUSTFLAGS only for this command; with --target it does not reach build scripts or proc
    # macros, and the artifacts live apart from the host build's.
    RUSTFLAGS="-C target-feature=+crt-static" \
        cargo build --release -p fastbox-execd --target x86_64-unknown-linux-gnu || return
    [[ -x "$FASTBOX_EXECD_BIN" ]] || {
        fb_warn "no binary at $FASTBOX_EXECD_BIN"
        return 1
    }
    if file_out=$(LC_ALL=C ldd "$FASTBOX_EXECD_BIN" 2>&1) && ! grep -qiE 'not a dynamic|statically linked' <<<"$file_out"; then
        printf '%s\n' "$file_out"
        fb_warn "$FASTBOX_EXECD_BIN is dynamically linked"
        return 1
    fi
    fb_log "static execd: $FASTBOX_EXECD_BIN ($(stat -c %s "$FASTBOX_EXECD_BIN") bytes)"
}
fb_step execd build_execd || failed+=(execd)

# ---------------------------------------------------------------- fuzz
# Before the tests: their summary must stay the end of the output.
fuzz_seconds=${FASTBOX_FUZZ_SECONDS:-30}
if [[ -n "${1:-}" ]]; then
    fb_log "test filter given: not running the fuzz targets"
elif ((fuzz_seconds > 0)); then
    fb_step fuzz "$FASTBOX_ROOT/scripts/fuzz.sh" "$fuzz_seconds" || failed+=(fuzz)
else
    fb_log "FASTBOX_FUZZ_SECONDS=0: not running the fuzz targets"
fi

# ---------------------------------------------------------------- tests
run_tests() {
    local timeout_s=${FASTBOX_TEST_TIMEOUT:-4200} left
    if [[ -n "${FASTBOX_DEADLINE:-}" ]]; then
        left=$((FASTBOX_DEADLINE - ${EPOCHSECONDS:-$(date +%s)} - 60))
        if ((left < timeout_s)); then timeout_s=$((left > 60 ? left : 60)); fi
    fi
    fb_log "test stage timeout: ${timeout_s}s"
    if cargo nextest --version >/dev/null 2>&1; then
        # --no-tests=warn: a workspace without tests yet is not a failure of this script.
        timeout -k 60 "$timeout_s" cargo nextest run --workspace --no-fail-fast --no-tests=warn "$@" \
            2>&1 | tee "$TEST_LOG"
    else
        fb_warn "cargo-nextest not found: falling back to cargo test"
        timeout -k 60 "$timeout_s" cargo test --workspace --no-fail-fast "$@" 2>&1 | tee "$TEST_LOG"
    fi
}
fb_step tests run_tests "$@" || failed+=(tests)

# ---------------------------------------------------------------- sdk
# The official OpenSandbox clients (SDK, code interpreter, CLI) against a real `fastbox up`
# built by the test stage (tests/sdk/README.md).
SDK_LOG=$LOGDIR/sdk.log
run_sdk() {
    local timeout_s=900 left
    if [[ -n "${FASTBOX_DEADLINE:-}" ]]; then
        left=$((FASTBOX_DEADLINE - ${EPOCHSECONDS:-$(date +%s)} - 30))
        if ((left < timeout_s)); then timeout_s=$((left > 60 ? left : 60)); fi
    fi
    cargo build -p fastbox-cli --bin fastbox || return
    FASTBOX_BIN=$FASTBOX_ROOT/target/debug/fastbox timeout -k 30 "$timeout_s" \
        "$FASTBOX_DEPS/venv/bin/python" -m pytest tests/sdk -q -rs 2>&1 | tee "$SDK_LOG"
}
if [[ -z "${1:-}" ]]; then
    fb_step sdk run_sdk || failed+=(sdk)
else
    fb_log "test filter given: not running the SDK suite"
fi

# ---------------------------------------------------------------- summary
echo
fb_log "stage durations:"
fb_print_step_times
printf '%-24s %10s\n' "total" "$(fb_elapsed "$run_start")"
if ((${#failed[@]})); then
    fb_log "FAILED stages: ${failed[*]}"
else
    fb_log "all stages passed"
fi
# The test runners' own closing lines come last, because CI reads the end of the output.
if [[ -s "$SDK_LOG" ]]; then
    echo "------------ SDK suite (pytest) ------------"
    grep -E '^(SKIPPED|FAILED|ERROR)' "$SDK_LOG" | tail -n 40 || true
    tail -n 1 "$SDK_LOG"
fi
summary=$(awk '/^ *Summary \[/ { found = 1 } found' "$TEST_LOG" | tail -n 60)
if [[ -n "$summary" ]]; then
    echo "------------ nextest summary (repeated from above) ------------"
    printf '%s\n' "$summary"
else
    # cargo test prints one "test result:" line per test binary: add them up into the plain
    # closing line "tests: N passed, N failed, N skipped".
    awk '/^test result:/ {
            for (i = 1; i <= NF; i++) {
                if ($i ~ /^passed;?$/) p += $(i - 1)
                if ($i ~ /^failed;?$/) f += $(i - 1)
                if ($i ~ /^ignored;?$/) s += $(i - 1)
            }
            n++
        }
        END { if (n) printf "tests: %d passed, %d failed, %d skipped\n", p, f, s }' "$TEST_LOG"
fi
((${#failed[@]} == 0))
