#!/usr/bin/env bash
# shellcheck disable=SC2016 # single-quoted ${...} are dpkg formats
# Set up a machine (Debian bookworm, root) for building and testing fastbox. Idempotent: a
# second run checks and does nothing (a few hundred milliseconds). See docs/setup.md.
#
#   scripts/setup.sh            # everything
#   scripts/setup.sh --force    # reinstall the private parts (.deps/criu, .deps/registry, .deps/etcd, .deps/s3s-fs, .deps/cargo-fuzz, .deps/venv, tests/js/node_modules)
#
# Steps: Debian packages (apt-get only for missing ones) -> docker-registry binary unpacked into
# .deps/registry (no system service) -> CRIU >= 4.2 (scripts/install-criu.sh) -> etcd 3.4 and
# etcdctl unpacked into .deps/etcd (no service) -> the s3s-fs S3
# test server built into .deps/s3s-fs (cargo install; about two minutes) -> cargo-fuzz built into
# .deps/cargo-fuzz (cargo install; about two minutes; scripts/fuzz.sh) -> Python venv
# .deps/venv (opensandbox SDK, pytest, moto's S3 test server) -> the JavaScript SDK
# (`npm ci` in tests/js, when Node.js >= 20 is there) -> sysctls. At the end it prints the paths the tests use
# and writes them to .deps/env (`source .deps/env`); it exports nothing itself.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
FB_LOG_TAG=setup

FORCE=0
for a in "$@"; do
    case $a in
    --force) FORCE=1 ;;
    -h | --help)
        fb_usage "$0"
        exit 0
        ;;
    *) fb_die "unknown option $a" ;;
    esac
done

# Debian packages the project needs, and why (keep docs/setup.md in sync).
PACKAGES=(
    runc              # baseline runtime for the benchmarks
    debootstrap       # built-in template recipe for offline machines
    busybox-static    # tiny static rootfs for tests
    nftables          # egress enforcement (nft -j)
    conntrack         # egress: a policy change flushes the connections it newly denies
    iptables          # CRIU's default network locking (iptables-restore)
    iproute2          # ip: netns/veth tooling; CRIU executes it to dump/restore netns
    e2fsprogs         # mkfs.ext4 for disk-limited sandboxes
    erofs-utils       # mkfs.erofs for read-only template images
    python3-venv      # the SDK test venv
    protobuf-compiler # protoc for -sys/-build crates (etcd-client)
    libprotobuf-dev   # well-known .proto includes for protoc
    pkg-config
    g++               # libfuzzer-sys compiles libFuzzer (C++) for the fuzz targets (scripts/fuzz.sh)
    curl
    jq
    util-linux        # unshare, nsenter, flock, setsid
    ca-certificates
    s3fs              # object-storage (ossfs) volumes: the FUSE client of a bucket prefix
)
REGISTRY_PKG=docker-registry
# etcd 3.4 (Debian's; not the 3.5.0-3.5.2 builds, which can lose consistency after a crash) and
# etcdctl, unpacked into .deps/etcd for the tests, which start their own members on random
# loopback ports (never a service).
ETCD_PKGS=(etcd-server etcd-client)
# moto[server]: an in-memory S3 server for the fastbox-s3 tests (started by the tests, never a
# service).
VENV_REQUIREMENTS=("opensandbox==1.1.1" "opensandbox-code-interpreter==1.1.1" "opensandbox-cli==1.1.1" "pytest" "moto[server]==5.2.5")
# s3s-fs: an S3 server keeping objects as files, with SigV4 auth, for the fastbox-s3 tests. Pinned:
# newer releases need a newer rustc than the workspace's.
S3S_FS_VERSION=0.14.1
# cargo-fuzz: builds and runs the fuzz targets of fuzz/ (scripts/fuzz.sh). Pinned, like s3s-fs.
CARGO_FUZZ_VERSION=0.13.2

REGISTRY_DIR=$FASTBOX_DEPS/registry
REGISTRY_BIN=$REGISTRY_DIR/bin/docker-registry
VENV=$FASTBOX_DEPS/venv
MOTO_SERVER=$VENV/bin/moto_server
S3S_FS_DIR=$FASTBOX_DEPS/s3s-fs
S3S_FS_BIN=$S3S_FS_DIR/bin/s3s-fs
CARGO_FUZZ_DIR=$FASTBOX_DEPS/cargo-fuzz
CARGO_FUZZ_BIN=$CARGO_FUZZ_DIR/bin/cargo-fuzz
CRIU=$FASTBOX_DEPS/criu/bin/criu
ETCD_DIR=$FASTBOX_DEPS/etcd
ETCD_BIN=$ETCD_DIR/bin/etcd

fb_require_root
total_start=$(fb_now)
mkdir -p "$FASTBOX_DEPS"

step_packages() {
    local missing
    mapfile -t missing < <(fb_missing_pkgs "${PACKAGES[@]}")
    if ((${#missing[@]} == 0)); then
        fb_log "all ${#PACKAGES[@]} Debian packages present"
        return 0
    fi
    fb_apt_install "${PACKAGES[@]}"
}

# Debian packages unpacked, never installed: `apt-get download` + `dpkg-deb -x` of PKGS into DIR
# (replaced whole, through DIR.new), with DIR/bin/NAME linking to usr/bin/NAME for each NAME in
# BINS and the packages' versions in DIR/VERSIONS. No system service is registered or started.
#   unpack_debs DIR "PKG..." "BIN..."
unpack_debs() {
    local dir=$1 tmp deb name
    local -a pkgs bins
    read -ra pkgs <<<"$2"
    read -ra bins <<<"$3"
    tmp=$(mktemp -d "$FASTBOX_DEPS/.$(basename "$dir")-dl.XXXXXX")
    if ! (cd "$tmp" && apt-get -q -o APT::Sandbox::User=root download "${pkgs[@]}") >/dev/null 2>&1; then
        fb_apt_update
        (cd "$tmp" && apt-get -q -o APT::Sandbox::User=root download "${pkgs[@]}")
    fi
    rm -rf "$dir.new"
    mkdir -p "$dir.new/bin"
    : >"$dir.new/VERSIONS"
    for deb in "$tmp"/*.deb; do
        dpkg-deb -x "$deb" "$dir.new"
        dpkg-deb -W --showformat='${Package} ${Version}\n' "$deb" >>"$dir.new/VERSIONS"
    done
    for name in "${bins[@]}"; do
        ln -s "../usr/bin/$name" "$dir.new/bin/$name"
    done
    rm -rf "$tmp" "$dir"
    mv "$dir.new" "$dir"
}

# docker-registry, as a binary only. Tests start it themselves on random loopback ports.
step_registry() {
    if ((FORCE == 0)) && [[ -x "$REGISTRY_BIN" ]] && "$REGISTRY_BIN" --version >/dev/null 2>&1; then
        fb_log "docker-registry present: $("$REGISTRY_BIN" --version 2>&1 | head -n1)"
        return 0
    fi
    unpack_debs "$REGISTRY_DIR" "$REGISTRY_PKG" docker-registry
    "$REGISTRY_BIN" --version
}

step_etcd() {
    if ((FORCE == 0)) && [[ -x "$ETCD_BIN" ]] && "$ETCD_BIN" --version >/dev/null 2>&1; then
        fb_log "etcd present: $("$ETCD_BIN" --version 2>&1 | head -n1)"
        return 0
    fi
    unpack_debs "$ETCD_DIR" "${ETCD_PKGS[*]}" "etcd etcdctl"
    "$ETCD_BIN" --version | head -n1
}

step_criu() {
    local args=()
    if ((FORCE)); then args+=(--force); fi
    "$FASTBOX_ROOT/scripts/install-criu.sh" "${args[@]}"
}

# s3s-fs, built from the Rust registry into .deps/s3s-fs (a private target directory, then moved
# into place, so an interrupted build leaves nothing half-installed). Skipped when the pinned
# version is present.
step_s3s_fs() {
    local stamp=$S3S_FS_DIR/VERSION tmp
    if ((FORCE == 0)) && [[ -x "$S3S_FS_BIN" && -f "$stamp" && "$(cat "$stamp")" == "$S3S_FS_VERSION" ]]; then
        fb_log "s3s-fs present: $S3S_FS_BIN ($S3S_FS_VERSION)"
        return 0
    fi
    command -v cargo >/dev/null || fb_die "cargo is needed to build s3s-fs (install the Rust toolchain first)"
    tmp=$(mktemp -d "$FASTBOX_DEPS/.s3s-fs-build.XXXXXX")
    cargo install "s3s-fs@$S3S_FS_VERSION" --features binary --locked --quiet \
        --root "$tmp/root" --target-dir "$tmp/target"
    printf '%s\n' "$S3S_FS_VERSION" >"$tmp/root/VERSION"
    rm -rf "$S3S_FS_DIR"
    mv "$tmp/root" "$S3S_FS_DIR"
    rm -rf "$tmp"
    "$S3S_FS_BIN" --help >/dev/null
    fb_log "s3s-fs $S3S_FS_VERSION installed: $S3S_FS_BIN"
}

# cargo-fuzz, built from the Rust registry into .deps/cargo-fuzz the way s3s-fs is. Skipped when
# the pinned version is present.
step_cargo_fuzz() {
    local stamp=$CARGO_FUZZ_DIR/VERSION tmp
    if ((FORCE == 0)) && [[ -x "$CARGO_FUZZ_BIN" && -f "$stamp" && "$(cat "$stamp")" == "$CARGO_FUZZ_VERSION" ]]; then
        fb_log "cargo-fuzz present: $CARGO_FUZZ_BIN ($CARGO_FUZZ_VERSION)"
        return 0
    fi
    command -v cargo >/dev/null || fb_die "cargo is needed to build cargo-fuzz (install the Rust toolchain first)"
    tmp=$(mktemp -d "$FASTBOX_DEPS/.cargo-fuzz-build.XXXXXX")
    cargo install "cargo-fuzz@$CARGO_FUZZ_VERSION" --locked --quiet \
        --root "$tmp/root" --target-dir "$tmp/target"
    printf '%s\n' "$CARGO_FUZZ_VERSION" >"$tmp/root/VERSION"
    rm -rf "$CARGO_FUZZ_DIR"
    mv "$tmp/root" "$CARGO_FUZZ_DIR"
    rm -rf "$tmp"
    "$CARGO_FUZZ_BIN" --version >/dev/null
    fb_log "cargo-fuzz $CARGO_FUZZ_VERSION installed: $CARGO_FUZZ_BIN"
}

step_venv() {
    local stamp=$VENV/.fastbox-requirements want py
    want=$(printf '%s\n' "${VENV_REQUIREMENTS[@]}")
    if ((FORCE == 0)) && [[ -x "$VENV/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
        fb_log "venv present: $VENV ($(tr '\n' ' ' <"$stamp"))"
        return 0
    fi
    # Debian's python3 (python3-venv installed above) unless FASTBOX_PYTHON says otherwise; any
    # python3 on PATH as a last resort. pip uses the machine's own index configuration.
    py=${FASTBOX_PYTHON:-}
    if [[ -z "$py" ]]; then
        for py in /usr/bin/python3 python3; do
            if "$py" -c 'import venv, ensurepip' >/dev/null 2>&1; then break; fi
        done
    fi
    rm -rf "$VENV"
    "$py" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${VENV_REQUIREMENTS[@]}"
    "$VENV/bin/python" - <<'EOF'
import importlib.metadata as m, sys
print("venv python", sys.version.split()[0], "| opensandbox", m.version("opensandbox"), "| pytest", m.version("pytest"), "| moto", m.version("moto"))
EOF
    printf '%s\n' "$want" >"$stamp"
}

step_js() {
    # The official JavaScript SDK for tests/sdk/test_js_sdk.py, pinned by tests/js's lockfile;
    # npm uses the machine's own registry configuration. It needs Node.js >= 20: without it
    # that test is skipped and says why.
    local dir=$FASTBOX_ROOT/tests/js version major stamp want
    if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
        fb_warn "node/npm not installed: the JavaScript SDK test will be skipped (it needs Node.js >= 20)"
        return 0
    fi
    version=$(node --version)
    major=${version#v}
    major=${major%%.*}
    if [[ ! $major =~ ^[0-9]+$ ]] || ((major < 20)); then
        fb_warn "node $version is older than 20: the JavaScript SDK test will be skipped"
        return 0
    fi
    stamp=$dir/node_modules/.fastbox-lock
    want=$(sha256sum "$dir/package-lock.json" | cut -d' ' -f1)
    if ((FORCE == 0)) && [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
        fb_log "JavaScript SDK present in $dir/node_modules (node $version)"
        return 0
    fi
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error)
    printf '%s\n' "$want" >"$stamp"
    fb_log "JavaScript SDK installed in $dir/node_modules (node $version)"
}

step_sysctl() {
    # Sandboxes reach the outside through the host's forwarding + NAT.
    if [[ "$(cat /proc/sys/net/ipv4/ip_forward 2>/dev/null)" != 1 ]]; then
        sysctl -q -w net.ipv4.ip_forward=1 2>/dev/null || echo 1 >/proc/sys/net/ipv4/ip_forward ||
            fb_warn "could not enable net.ipv4.ip_forward"
    fi
    fb_log "net.ipv4.ip_forward=$(cat /proc/sys/net/ipv4/ip_forward 2>/dev/null || echo '?')"
}

fb_step packages step_packages
fb_step registry step_registry
fb_step criu step_criu
fb_step etcd step_etcd
fb_step s3s-fs step_s3s_fs
fb_step cargo-fuzz step_cargo_fuzz
fb_step venv step_venv
fb_step js step_js
fb_step sysctl step_sysctl

{
    echo "# generated by scripts/setup.sh; source it: . .deps/env"
    echo "export FASTBOX_REPO='$FASTBOX_ROOT'"
    echo "export FASTBOX_CRIU='$CRIU'"
    echo "export FASTBOX_REGISTRY_BIN='$REGISTRY_BIN'"
    echo "export FASTBOX_VENV='$VENV'"
    echo "export FASTBOX_PYTHON='$VENV/bin/python'"
    echo "export FASTBOX_S3S_FS_BIN='$S3S_FS_BIN'"
    echo "export FASTBOX_MOTO_SERVER='$MOTO_SERVER'"
    echo "export FASTBOX_ETCD_BIN='$ETCD_BIN'"
    echo "export FASTBOX_ETCDCTL_BIN='$ETCD_DIR/bin/etcdctl'"
} >"$FASTBOX_DEPS/env.new"
mv "$FASTBOX_DEPS/env.new" "$FASTBOX_DEPS/env"

fb_log "setup done in $(fb_elapsed "$total_start")s"
fb_print_step_times
echo "Paths for the tests (also in .deps/env):"
sed -n 's/^export //p' "$FASTBOX_DEPS/env"
