#!/usr/bin/env bash
# shellcheck disable=SC2016 # single-quoted ${...} are dpkg formats and sh -c scripts
# Install CRIU >= 4.2 into the private prefix .deps/criu when the system's criu is missing or
# older (Debian bookworm's 3.17 fails on recent kernels). See docs/setup.md and DESIGN §7.
#
# Result: .deps/criu/bin/criu, always (a wrapper around the private build, or a symlink to a
# system criu that is new enough). Versions used are logged to stdout and .deps/criu/VERSIONS.
#
# Method: a private apt configuration (own state/cache/sources under .deps/apt) whose source is
# the machine's own configured Debian mirror with suite `unstable`; `apt-get download` of the
# newest criu >= 4.2 with the closure of its library dependencies (glibc included), unpacked
# with `dpkg-deb -x` into the prefix and run through the prefix's own dynamic loader. If no
# binary package works, build CRIU from the same mirror's source package (`apt-get source`;
# the upstream tarball alone when the mirror lacks the Debian packaging tarball).
#
# Options: --force (reinstall), --from-source (skip the binary packages), --no-smoke (skip the
# dump/restore smoke test). Environment: FASTBOX_CRIU_MIN (default 4.2), FASTBOX_CRIU_SUITES
# (default "unstable"), FASTBOX_DEBIAN_MIRROR (override the mirror URI).
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
FB_LOG_TAG=install-criu

MIN=${FASTBOX_CRIU_MIN:-4.2}
SUITES=${FASTBOX_CRIU_SUITES:-unstable}
PREFIX=$FASTBOX_DEPS/criu
APTDIR=$FASTBOX_DEPS/apt
WRAPPER=$PREFIX/bin/criu
MULTIARCH=x86_64-linux-gnu
LDSO_NAME=ld-linux-x86-64.so.2

FORCE=0 FROM_SOURCE=0 SMOKE=1
for a in "$@"; do
    case $a in
    --force) FORCE=1 ;;
    --from-source) FROM_SOURCE=1 FORCE=1 ;;
    --no-smoke) SMOKE=0 ;;
    -h | --help)
        fb_usage "$0"
        exit 0
        ;;
    *) fb_die "unknown option $a" ;;
    esac
done

# criu_version BIN -> "4.2.1" (empty when BIN does not run)
criu_version() {
    "$1" --version 2>/dev/null | sed -n 's/^Version: *//p' | head -n1
}

# usable BIN : BIN runs, is >= MIN and `criu check` passes.
usable() {
    local v
    v=$(criu_version "$1")
    [[ -n "$v" ]] && fb_vercmp "$v" ge "$MIN" && "$1" check >/dev/null 2>&1
}

# ------------------------------------------------------------------ fast path (idempotence)
if ((FORCE == 0)) && [[ -x "$WRAPPER" && -f "$PREFIX/VERSIONS" ]] && usable "$WRAPPER"; then
    fb_log "criu $(criu_version "$WRAPPER") already installed: $WRAPPER (criu check: ok)"
    exit 0
fi

fb_require_root
fb_lock criu
# Another run may have finished while we waited for the lock.
if ((FORCE == 0)) && [[ -x "$WRAPPER" && -f "$PREFIX/VERSIONS" ]] && usable "$WRAPPER"; then
    fb_log "criu $(criu_version "$WRAPPER") already installed: $WRAPPER"
    exit 0
fi

# ------------------------------------------------------------------ system criu new enough?
if ((FROM_SOURCE == 0)); then
    sys=$(PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin command -v criu || true)
    if [[ -n "$sys" ]]; then
        sysv=$(criu_version "$sys")
        if [[ -n "$sysv" ]] && fb_vercmp "$sysv" ge "$MIN" && "$sys" check >/dev/null 2>&1; then
            fb_log "system criu $sysv at $sys is >= $MIN and passes criu check: using it"
            rm -rf "$PREFIX"
            mkdir -p "$PREFIX/bin"
            ln -s "$sys" "$WRAPPER"
            {
                echo "source: system"
                echo "binary: $sys"
                echo "criu: $sysv"
                dpkg-query -S "$sys" 2>/dev/null | cut -d: -f1 | xargs -r dpkg-query -W -f='package: ${Package} ${Version}\n' 2>/dev/null || true
                echo "installed: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
            } >"$PREFIX/VERSIONS"
            cat "$PREFIX/VERSIONS"
            exit 0
        fi
        fb_log "system criu at $sys is ${sysv:-not runnable} (need >= $MIN with a passing criu check): installing a private one"
    else
        fb_log "no system criu: installing a private one"
    fi
fi

# ------------------------------------------------------------------ private apt
apt_update() { # $1 = types (deb | "deb deb-src")
    fb_private_apt_init "$APTDIR" "$SUITES" "$1"
    fb_log "apt-get update (private config, suites: $SUITES, source: $(grep -m1 '^URIs:' "$APTDIR/etc/sources.list.d/fastbox.sources"))"
    if ! apt-get -q "${FB_APT_OPTS[@]}" update >"$APTDIR/update.log" 2>&1 ||
        grep -qE '^(W|E): .*(NO_PUBKEY|not signed|signature)' "$APTDIR/update.log"; then
        # The configured keyring may only hold the keys of the machine's release. Retry with
        # Debian's full archive keyring, which also signs unstable.
        local kr=/usr/share/keyrings/debian-archive-keyring.gpg
        if [[ -r "$kr" ]] && ! grep -q "^Signed-By: $kr\$" "$APTDIR/etc/sources.list.d/fastbox.sources"; then
            fb_warn "private apt-get update failed; retrying with $kr"
            sed -i -e '/^Signed-By:/,/^[^ ]/{/^ /d}' -e "s|^Signed-By:.*|Signed-By: $kr|" \
                "$APTDIR/etc/sources.list.d/fastbox.sources"
            apt-get -q "${FB_APT_OPTS[@]}" update >"$APTDIR/update.log" 2>&1 || {
                cat "$APTDIR/update.log" >&2
                fb_die "private apt-get update failed"
            }
        else
            cat "$APTDIR/update.log" >&2
            fb_die "private apt-get update failed"
        fi
    fi
    tail -n 2 "$APTDIR/update.log"
}

# ------------------------------------------------------------------ checks of a staged prefix
# write_wrapper DIR : DIR/bin/criu runs DIR/usr/sbin/criu through DIR's own loader and libraries.
# --library-path (not LD_LIBRARY_PATH) so that the programs CRIU executes (ip, iptables-restore,
# action scripts) run with the system's own libraries.
write_wrapper() {
    local d=$1
    mkdir -p "$d/bin" "$d/lib64"
    ln -sfn "../usr/lib/$MULTIARCH/$LDSO_NAME" "$d/lib64/$LDSO_NAME"
    cat >"$d/bin/criu" <<'EOF'
#!/bin/sh
# Generated by fastbox scripts/install-criu.sh: run the private CRIU through the prefix's own
# dynamic loader and libraries (children that CRIU executes keep the system's libraries).
p=$0
[ -L "$p" ] && p=$(readlink -f "$p")
case $p in */*) d=${p%/*}/.. ;; *) d=.. ;; esac
exec "$d/lib64/ld-linux-x86-64.so.2" --inhibit-cache \
    --library-path "$d/usr/lib/x86_64-linux-gnu:$d/lib/x86_64-linux-gnu" \
    --argv0 criu "$d/usr/sbin/criu" "$@"
EOF
    chmod 0755 "$d/bin/criu"
}

# check_libs DIR : every library of DIR/usr/sbin/criu resolves inside DIR.
check_libs() {
    local d=$1 out
    out=$("$d/lib64/$LDSO_NAME" --inhibit-cache --library-path "$d/usr/lib/$MULTIARCH" \
        --list "$d/usr/sbin/criu" 2>&1) || {
        printf '%s\n' "$out" >&2
        return 1
    }
    if grep -q 'not found' <<<"$out"; then
        printf '%s\n' "$out" >&2
        fb_warn "missing libraries"
        return 1
    fi
    if grep '=>' <<<"$out" | grep -v "$d/" | grep -q '/'; then
        printf '%s\n' "$out" >&2
        fb_warn "some libraries resolve outside the prefix"
        return 1
    fi
}

# smoke_test CRIU : dump a detached process and restore it.
smoke_test() {
    local criu=$1 dir pid rpid
    dir=$(mktemp -d /tmp/fastbox-criu-smoke.XXXXXX)
    # A session leader whose parent is not this shell; its stdio on /dev/null; not holding our
    # lock's fd (CRIU refuses to dump tasks that hold file locks).
    local starter=(setsid -f sh -c 'echo $$ >"$1"; exec sleep 1000' sh "$dir/orig.pid")
    if [[ -n "$FB_LOCK_FD" ]]; then
        "${starter[@]}" </dev/null >/dev/null 2>&1 {FB_LOCK_FD}>&-
    else
        "${starter[@]}" </dev/null >/dev/null 2>&1
    fi
    sleep 0.2
    pid=$(cat "$dir/orig.pid" 2>/dev/null || true)
    if [[ -z "$pid" || "$(cat "/proc/$pid/comm" 2>/dev/null)" != sleep ]]; then
        fb_warn "smoke test: could not start the test process"
        [[ -n "$pid" ]] && kill "$pid" 2>/dev/null
        return 1
    fi
    if ! "$criu" dump -t "$pid" -D "$dir" -o dump.log; then
        fb_warn "smoke test: criu dump failed ($dir); log tail:"
        tail -n 20 "$dir/dump.log" >&2
        kill "$pid" 2>/dev/null || true
        return 1
    fi
    # The dumped (killed) task keeps its pid until its parent (init) reaps it; restore reuses it.
    local _
    for _ in $(seq 50); do
        [[ -e "/proc/$pid" ]] || break
        sleep 0.05
    done
    if ! "$criu" restore -D "$dir" -d -o restore.log --pidfile "$dir/restored.pid"; then
        fb_warn "smoke test: criu restore failed ($dir); log tail:"
        tail -n 20 "$dir/restore.log" >&2
        return 1
    fi
    rpid=$(cat "$dir/restored.pid")
    if [[ "$(cat "/proc/$rpid/comm" 2>/dev/null)" != sleep ]]; then
        fb_warn "smoke test: restored process $rpid is not running"
        return 1
    fi
    kill "$rpid"
    fb_log "smoke test: dump of pid $pid and restore as pid $rpid: ok"
    rm -rf "$dir"
}

# finish STAGE SOURCE_DESC : verify STAGE, then move it to PREFIX.
finish() {
    local stage=$1 v
    v=$(criu_version "$stage/bin/criu")
    if [[ -z "$v" ]]; then
        fb_warn "staged criu does not run"
        "$stage/bin/criu" --version || true
        return 1
    fi
    fb_vercmp "$v" ge "$MIN" || {
        fb_warn "staged criu $v < $MIN"
        return 1
    }
    fb_log "criu check:"
    if ! "$stage/bin/criu" check; then
        fb_warn "criu $v: criu check failed"
        return 1
    fi
    {
        echo "criu --version:"
        "$stage/bin/criu" --version | sed 's/^/  /'
        echo "installed: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "kernel: $(uname -r)"
    } >>"$stage/VERSIONS"
    rm -rf "$PREFIX.old"
    if [[ -e "$PREFIX" || -L "$PREFIX" ]]; then mv "$PREFIX" "$PREFIX.old"; fi
    mv "$stage" "$PREFIX"
    # The wrapper finds the prefix relative to itself, so the move keeps it valid.
    rm -rf "$PREFIX.old"
    if ((SMOKE)) && ! smoke_test "$WRAPPER"; then
        fb_warn "CRIU dump/restore smoke test FAILED (criu check passed); checkpoint tests will likely fail"
    fi
    fb_log "installed criu $v into $PREFIX; versions:"
    cat "$PREFIX/VERSIONS"
}

# ------------------------------------------------------------------ from binary packages
install_binary() {
    apt_update deb
    local cands v
    cands=$(apt-cache "${FB_APT_OPTS[@]}" madison criu | awk -F'|' '{ gsub(/ /, "", $2); print $2 }' |
        sort -u | sort -rV)
    for v in $cands; do
        fb_vercmp "$v" ge "$MIN" || continue
        fb_log "trying criu $v from the private apt sources"
        if install_binary_version "$v"; then return 0; fi
        fb_warn "criu $v did not work"
    done
    fb_warn "no binary criu >= $MIN works (candidates: ${cands:-none})"
    return 1
}

install_binary_version() {
    local v=$1 stage=$PREFIX.new dl pkgs deb
    dl=$APTDIR/debs
    rm -rf "$stage" "$dl"
    mkdir -p "$stage" "$dl"
    # The whole Depends/Pre-Depends closure of this criu, glibc included, so that the prefix never
    # mixes its libraries with the system's (apt-cache depends follows the candidate versions).
    pkgs=$(apt-cache "${FB_APT_OPTS[@]}" depends --recurse --no-recommends --no-suggests \
        --no-conflicts --no-breaks --no-replaces --no-enhances "criu=$v" 2>/dev/null |
        grep -v '^ ' | grep -v '^<' | grep -vx criu | sort -u) ||
        pkgs=$(apt-cache "${FB_APT_OPTS[@]}" depends --recurse --no-recommends --no-suggests \
            --no-conflicts --no-breaks --no-replaces --no-enhances criu |
            grep -v '^ ' | grep -v '^<' | grep -vx criu | sort -u)
    # shellcheck disable=SC2086
    (cd "$dl" && apt-get -q "${FB_APT_OPTS[@]}" download "criu=$v" $pkgs) || return 1
    {
        echo "source: debian binary packages (private apt, suites: $SUITES)"
        grep -m1 '^URIs:' "$APTDIR/etc/sources.list.d/fastbox.sources" | sed 's/^URIs:/mirror:/'
        echo "packages:"
    } >"$stage/VERSIONS"
    for deb in "$dl"/*.deb; do
        dpkg-deb -x "$deb" "$stage"
        dpkg-deb -W --showformat='  ${Package} ${Version}\n' "$deb" >>"$stage/VERSIONS"
    done
    [[ -x "$stage/usr/sbin/criu" && -e "$stage/usr/lib/$MULTIARCH/$LDSO_NAME" ]] || {
        fb_warn "unpacked packages lack usr/sbin/criu or the dynamic loader"
        return 1
    }
    write_wrapper "$stage"
    check_libs "$stage" || return 1
    rm -rf "$dl"
    finish "$stage"
}

# ------------------------------------------------------------------ from the source package
install_source() {
    fb_log "building CRIU from the mirror's source package (suites: $SUITES)"
    apt_update "deb deb-src"
    local src=$APTDIR/src stage=$PREFIX.new dir
    rm -rf "$src" "$stage"
    mkdir -p "$src" "$stage/usr/sbin"
    # Build dependencies from the system's own release: CRIU builds against bookworm's libraries.
    fb_apt_install build-essential dpkg-dev xz-utils pkg-config python3 python3-protobuf \
        protobuf-c-compiler libprotobuf-c-dev libprotobuf-dev protobuf-compiler libnl-3-dev \
        libnet1-dev libcap-dev libbsd-dev libnftables-dev libgnutls28-dev libaio-dev uuid-dev \
        libdrm-dev
    # The Debian packaging tarball is optional: without it (seen: a mirror that serves the
    # .dsc and the upstream tarball but not the .debian.tar.xz), build the upstream sources.
    (cd "$src" && apt-get -q "${FB_APT_OPTS[@]}" source --download-only criu) ||
        fb_warn "apt-get source criu did not fetch every file; trying the upstream tarball"
    dir=$src/criu-src
    if ! (cd "$src" && dpkg-source -x ./*.dsc criu-src) >/dev/null 2>&1; then
        local origs=("$src"/criu_*.orig.tar.*) orig
        orig=${origs[0]}
        [[ -e "$orig" ]] || {
            fb_warn "no CRIU source tarball could be fetched"
            return 1
        }
        rm -rf "$dir"
        mkdir -p "$dir"
        tar -xf "$orig" -C "$dir" --strip-components=1
    fi
    fb_log "make criu (this takes a few minutes)"
    make -C "$dir" -j"$(nproc)" criu >"$src/build.log" 2>&1 || {
        tail -n 40 "$src/build.log" >&2
        fb_warn "CRIU build failed (log: $src/build.log)"
        return 1
    }
    install -m 0755 "$dir/criu/criu" "$stage/usr/sbin/criu"
    mkdir -p "$stage/bin"
    ln -s ../usr/sbin/criu "$stage/bin/criu"
    {
        echo "source: built from the debian source package (private apt, suites: $SUITES)"
        grep -m1 '^URIs:' "$APTDIR/etc/sources.list.d/fastbox.sources" | sed 's/^URIs:/mirror:/'
        echo "files: $(cd "$src" && find . -maxdepth 1 -name 'criu_*' -printf '%f ')"
    } >"$stage/VERSIONS"
    finish "$stage"
}

start=$(fb_now)
# CRIU executes `ip` (iproute2) to dump/restore network namespaces and iptables-restore for its
# default network locking (or use --network-lock nftables).
fb_apt_install iproute2 iptables
if ((FROM_SOURCE == 0)) && install_binary; then
    :
elif install_source; then
    :
else
    rm -rf "$PREFIX.new"
    fb_die "could not install a working CRIU >= $MIN"
fi
fb_log "done in $(fb_elapsed "$start")s"
