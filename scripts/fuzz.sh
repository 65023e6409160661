#!/usr/bin/env bash
# Builds fastbox's fuzz targets (fuzz/, cargo-fuzz + libFuzzer) and runs each for a while
# (docs/fuzzing.md):
#
#   scripts/fuzz.sh [SECONDS]          # every target for SECONDS each (default 30)
#   scripts/fuzz.sh --keep-corpus 300  # and keep new interesting inputs in fuzz/corpus
#
# Each target starts from a temporary copy of its committed corpus (fuzz/corpus/<target>), so
# a run leaves the repository as it was, unless --keep-corpus: then the inputs that add
# coverage are merged into fuzz/corpus/<target> if it stays within the caps (200 files,
# 1 MiB per target; otherwise nothing is kept and a warning says so).
#
# Build: `cargo fuzz build -O -a -s none` (optimized, debug assertions and overflow checks, no
# sanitizer: the fuzzed code is safe Rust, where a panic or an overflow is the bug to find,
# and without ASan the build takes half the time) into fuzz/target. The stable toolchain
# works through RUSTC_BOOTSTRAP=1 (cargo-fuzz passes a few -Z flags).
# Run: -max_total_time=SECONDS -rss_limit_mb=2048 -timeout=10, FASTBOX_FUZZ_JOBS targets at
# once (default: the number of cores, at most 2). As root, targets run as `nobody` (the
# unpacker target refuses root: an escape it finds must not reach the host).
# Output: one line per target (executions, crashes, corpus size); a crashing input stays in
# fuzz/artifacts/<target>/ and its log in fuzz/target/fuzz-logs/. Exits non-zero if any
# target crashed or failed to build or run.
#
# Knobs: FASTBOX_FUZZ_TARGETS="route quantity" (a subset), FASTBOX_FUZZ_JOBS=N,
# FASTBOX_FUZZ_SKIP_BUILD=1 (reuse the binaries of a previous build).
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
FB_LOG_TAG=fuzz

SECONDS_PER_TARGET=30
KEEP_CORPUS=0
for a in "$@"; do
    case $a in
    --keep-corpus) KEEP_CORPUS=1 ;;
    -h | --help)
        fb_usage "$0"
        exit 0
        ;;
    *[!0-9]* | '') fb_die "unknown argument $a (want SECONDS or --keep-corpus)" ;;
    *) SECONDS_PER_TARGET=$a ;;
    esac
done

# The caps of a committed corpus, per target.
MAX_CORPUS_FILES=200
MAX_CORPUS_BYTES=$((1024 * 1024))

FUZZ_DIR=$FASTBOX_ROOT/fuzz
ALL_TARGETS=(dns_message route quantity artifact_manifest image_unpack oci_document)
read -r -a TARGETS <<<"${FASTBOX_FUZZ_TARGETS:-${ALL_TARGETS[*]}}"
JOBS=${FASTBOX_FUZZ_JOBS:-$(($(nproc) < 2 ? 1 : 2))}
LOGS=$FUZZ_DIR/target/fuzz-logs

if [[ -x "$FASTBOX_DEPS/cargo-fuzz/bin/cargo-fuzz" ]]; then
    PATH=$FASTBOX_DEPS/cargo-fuzz/bin:$PATH
fi
command -v cargo-fuzz >/dev/null || fb_die "cargo-fuzz not found (scripts/setup.sh installs it into .deps/cargo-fuzz)"

# ---------------------------------------------------------------- build
HOST=$(rustc -vV | sed -n 's/^host: //p')
BIN_DIR=$FUZZ_DIR/target/$HOST/release
if [[ "${FASTBOX_FUZZ_SKIP_BUILD:-0}" != 1 ]]; then
    build_start=$(fb_now)
    # The fuzz crate's own target directory, whatever the caller's CARGO_TARGET_DIR says.
    (cd "$FASTBOX_ROOT" && env -u CARGO_TARGET_DIR RUSTC_BOOTSTRAP=1 \
        cargo fuzz build -O -a -s none --codegen-units 16) ||
        fb_die "building the fuzz targets failed"
    fb_log "built ${#ALL_TARGETS[@]} targets in $(fb_elapsed "$build_start")s"
fi

# ---------------------------------------------------------------- run
mkdir -p "$LOGS"
# Working copies of the corpora and the targets' TMPDIR (image_unpack writes a tree per input):
# on /dev/shm when it has a GiB to spare (tmpfs runs that target about four times as fast as a
# disk), unless TMPDIR says where.
work_parent=${TMPDIR:-/tmp}
shm_free_kib=$(df --output=avail -k /dev/shm 2>/dev/null | tail -n 1 | tr -d ' ' || true)
if [[ -z "${TMPDIR:-}" && -w /dev/shm && "${shm_free_kib:-0}" =~ ^[0-9]+$ ]] &&
    ((shm_free_kib > 1024 * 1024)); then
    work_parent=/dev/shm
fi
WORK=$(mktemp -d "$work_parent/fastbox-fuzz.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
chmod 0711 "$WORK"
RUN_AS=()
if [[ $(id -u) == 0 ]]; then
    nobody_uid=$(id -u nobody 2>/dev/null || echo 65534)
    nobody_gid=$(id -g nobody 2>/dev/null || echo 65534)
    RUN_AS=(setpriv "--reuid=$nobody_uid" "--regid=$nobody_gid" --clear-groups)
fi

# as_fuzzer PATH... : hands PATHs to the user the targets run as.
as_fuzzer() {
    if ((${#RUN_AS[@]})); then chown -R "$nobody_uid:$nobody_gid" "$@"; fi
}

# corpus_stats DIR -> "FILES BYTES"
corpus_stats() {
    find "$1" -maxdepth 1 -type f -printf '%s\n' | awk '{ n++; b += $1 } END { printf "%d %d\n", n, b }'
}

# run_target NAME : fuzzes one target; writes $WORK/NAME/result ("EXECS CRASHES STATUS"). The
# target runs from copies in $WORK/NAME (binary, dictionary, corpus, artifacts): the checkout
# may be out of nobody's reach (under /root). Its findings are copied to fuzz/artifacts/NAME.
run_target() {
    local t=$1 dir=$WORK/$1 rc=0 execs crashes f dict=()
    mkdir -p "$dir/corpus" "$dir/tmp" "$dir/artifacts"
    cp "$BIN_DIR/$t" "$dir/$t"
    if [[ -d "$FUZZ_DIR/corpus/$t" ]]; then cp -a "$FUZZ_DIR/corpus/$t/." "$dir/corpus/"; fi
    if [[ -f "$FUZZ_DIR/dict/$t.dict" ]]; then
        cp "$FUZZ_DIR/dict/$t.dict" "$dir/dict"
        dict=(-dict="$dir/dict")
    fi
    as_fuzzer "$dir"
    (cd "$dir" && TMPDIR=$dir/tmp "${RUN_AS[@]}" "$dir/$t" "$dir/corpus" "${dict[@]}" \
        -max_total_time="$SECONDS_PER_TARGET" -rss_limit_mb=2048 -timeout=10 \
        -print_final_stats=1 -artifact_prefix="$dir/artifacts/") >"$LOGS/$t.log" 2>&1 || rc=$?
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$LOGS/$t.log" | tail -n 1)
    crashes=0
    for f in "$dir/artifacts"/*; do
        [[ -f "$f" ]] || continue
        mkdir -p "$FUZZ_DIR/artifacts/$t"
        cp "$f" "$FUZZ_DIR/artifacts/$t/"
        case ${f##*/} in crash-* | timeout-* | oom-* | leak-*) crashes=$((crashes + 1)) ;; esac
    done
    echo "${execs:-?} $crashes $rc" >"$dir/result"
}

# keep_corpus NAME : merges the inputs that add coverage into fuzz/corpus/NAME, within caps.
keep_corpus() {
    local t=$1 dir=$WORK/$1 merged=$WORK/$1/merged files bytes
    mkdir -p "$merged"
    cp -a "$FUZZ_DIR/corpus/$t/." "$merged/" 2>/dev/null || true
    as_fuzzer "$merged"
    (cd "$dir" && TMPDIR=$dir/tmp "${RUN_AS[@]}" "$dir/$t" -merge=1 -rss_limit_mb=2048 \
        -timeout=10 "$merged" "$dir/corpus") >"$LOGS/$t.merge.log" 2>&1 || {
        fb_warn "$t: merging the corpus failed (see $LOGS/$t.merge.log); nothing kept"
        return 0
    }
    read -r files bytes < <(corpus_stats "$merged")
    if ((files > MAX_CORPUS_FILES || bytes > MAX_CORPUS_BYTES)); then
        fb_warn "$t: a merged corpus of $files files, $bytes bytes exceeds the caps ($MAX_CORPUS_FILES files, $MAX_CORPUS_BYTES bytes); nothing kept"
        return 0
    fi
    mkdir -p "$FUZZ_DIR/corpus/$t"
    find "$FUZZ_DIR/corpus/$t" -maxdepth 1 -type f ! -name 'seed-*' -delete
    cp -a "$merged/." "$FUZZ_DIR/corpus/$t/"
    chown -R --reference="$FUZZ_DIR" "$FUZZ_DIR/corpus/$t"
    fb_log "$t: corpus kept: $files files, $bytes bytes"
}

fb_log "running ${#TARGETS[@]} targets for ${SECONDS_PER_TARGET}s each, $JOBS at a time${RUN_AS[*]:+, as nobody}"
run_start=$(fb_now)
for t in "${TARGETS[@]}"; do
    [[ -x "$BIN_DIR/$t" ]] || fb_die "no fuzz target $t at $BIN_DIR/$t"
    while (($(jobs -rp | wc -l) >= JOBS)); do wait -n || true; done
    run_target "$t" &
done
wait
fb_log "ran in $(fb_elapsed "$run_start")s"

failed=()
for t in "${TARGETS[@]}"; do
    read -r execs crashes rc <"$WORK/$t/result"
    read -r files bytes < <(corpus_stats "$WORK/$t/corpus")
    status=ok
    if ((crashes > 0)); then
        status=CRASHED
    elif ((rc != 0)); then
        status="FAILED($rc)"
    fi
    printf '[fuzz] %-18s %4ss  executions %12s  crashes %d  corpus %4d files %8d bytes  %s\n' \
        "$t" "$SECONDS_PER_TARGET" "$execs" "$crashes" "$files" "$bytes" "$status"
    if [[ $status != ok ]]; then
        failed+=("$t")
        # The panic, and where the input that caused it is kept.
        grep -E -A12 'panicked at|ERROR: libFuzzer|SUMMARY' "$LOGS/$t.log" | tail -n 40 | sed 's/^/    /' || true
        find "$WORK/$t/artifacts" -maxdepth 1 -type f -printf "    kept: fuzz/artifacts/$t/%f\n"
    elif ((KEEP_CORPUS)); then
        keep_corpus "$t"
    fi
done
if ((${#failed[@]})); then
    fb_log "FAILED targets: ${failed[*]} (inputs in fuzz/artifacts/<target>/, logs in $LOGS/)"
    exit 1
fi
fb_log "no crashes"
