# shellcheck shell=bash disable=SC2034 # variables here are used by the scripts that source this file
# Shared helpers for fastbox's set-up and CI scripts. Source it; do not run it.
#
#   source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
#
# Provides: FASTBOX_ROOT (the repo root, from this file's location), FASTBOX_DEPS (.deps),
# logging (fb_log / fb_warn / fb_die), timing (fb_now, fb_elapsed, fb_step), a lock helper,
# Debian package helpers, and a PRIVATE apt configuration (fb_private_apt_init) whose sources are
# derived from the machine's own configured Debian mirror (never hard-coded, never edits the
# system's sources).

if [[ -n "${_FASTBOX_LIB_SOURCED:-}" ]]; then
    return 0
fi
_FASTBOX_LIB_SOURCED=1

FASTBOX_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
FASTBOX_DEPS="${FASTBOX_DEPS:-$FASTBOX_ROOT/.deps}"
export DEBIAN_FRONTEND=noninteractive

# ---------------------------------------------------------------- logging and timing

fb_log() { printf '[%s] %s\n' "${FB_LOG_TAG:-fastbox}" "$*"; }
fb_warn() { printf '[%s] WARNING: %s\n' "${FB_LOG_TAG:-fastbox}" "$*" >&2; }
fb_die() {
    printf '[%s] ERROR: %s\n' "${FB_LOG_TAG:-fastbox}" "$*" >&2
    exit 1
}

# Seconds since the epoch with milliseconds, no subprocess (bash 5 EPOCHREALTIME).
fb_now() {
    local t=${EPOCHREALTIME:-}
    if [[ -z "$t" ]]; then t=$(date +%s.%N); fi
    t=${t/,/.}
    printf '%s' "${t:0:14}"
}

# fb_elapsed START -> "12.345"
fb_elapsed() { awk -v s="$1" -v e="$(fb_now)" 'BEGIN { printf "%.3f", e - s }'; }

# fb_step NAME CMD... : runs CMD, prints its duration, returns its status. Durations are also
# appended to FB_STEP_TIMES (a "name seconds status" list) for a final summary.
FB_STEP_TIMES=()
fb_step() {
    local name=$1
    shift
    local start rc=0 dur
    start=$(fb_now)
    fb_log "==> $name"
    "$@" || rc=$?
    dur=$(fb_elapsed "$start")
    if ((rc == 0)); then
        fb_log "<== $name: ok (${dur}s)"
    else
        fb_log "<== $name: FAILED with status $rc (${dur}s)"
    fi
    FB_STEP_TIMES+=("$name $dur $rc")
    return "$rc"
}

fb_print_step_times() {
    local line name dur rc
    printf '%-24s %10s  %s\n' "stage" "seconds" "result"
    for line in "${FB_STEP_TIMES[@]}"; do
        read -r name dur rc <<<"$line"
        printf '%-24s %10s  %s\n' "$name" "$dur" "$([[ $rc == 0 ]] && echo ok || echo "FAILED($rc)")"
    done
}

# fb_lock NAME : take an exclusive lock for the rest of this shell (flock on .deps/.NAME.lock),
# so that two set-up runs in parallel do not unpack into the same prefix at once. The lock's fd
# is FB_LOCK_FD: close it in processes that must not inherit it (`cmd {FB_LOCK_FD}>&-`), e.g.
# a process that CRIU is going to dump (CRIU refuses tasks holding file locks).
FB_LOCK_FD=
fb_lock() {
    local f="$FASTBOX_DEPS/.$1.lock"
    mkdir -p "$FASTBOX_DEPS"
    exec {FB_LOCK_FD}>"$f"
    if ! flock -n "$FB_LOCK_FD"; then
        fb_log "waiting for lock $f"
        flock "$FB_LOCK_FD"
    fi
}

# fb_usage FILE : prints FILE's leading comment block (its help text).
fb_usage() {
    awk 'NR == 1 { next } /^# shellcheck/ { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$1"
}

fb_require_root() {
    [[ $(id -u) == 0 ]] || fb_die "this script must run as root (it installs packages)"
}

# ---------------------------------------------------------------- Debian packages

# fb_pkg_installed PKG : true when dpkg has PKG fully installed.
fb_pkg_installed() {
    [[ "$(dpkg-query -W -f='${db:Status-Abbrev}' "$1" 2>/dev/null)" == "ii " ]]
}

# fb_missing_pkgs PKG... : prints the packages of the list that are not installed.
fb_missing_pkgs() {
    local installed p
    # One dpkg-query for the whole list (fast path of setup.sh).
    installed=$(dpkg-query -W -f='${Package} ${db:Status-Abbrev}\n' "$@" 2>/dev/null |
        awk '$2 == "ii" { print $1 }') || true
    for p in "$@"; do
        if ! grep -qx -- "${p%%:*}" <<<"$installed"; then printf '%s\n' "$p"; fi
    done
}

FB_APT_UPDATED=0
# fb_apt_update : system `apt-get update`, once per run.
fb_apt_update() {
    if ((FB_APT_UPDATED == 0)); then
        apt-get -q -o DPkg::Lock::Timeout=300 update
        FB_APT_UPDATED=1
    fi
}

# fb_apt_install PKG... : installs the missing ones (updating the lists first).
fb_apt_install() {
    local missing
    mapfile -t missing < <(fb_missing_pkgs "$@")
    if ((${#missing[@]} == 0)); then
        return 0
    fi
    fb_log "installing Debian packages: ${missing[*]}"
    fb_apt_update
    apt-get -q -y -o DPkg::Lock::Timeout=300 install --no-install-recommends "${missing[@]}"
}

# fb_vercmp A OP B : Debian version comparison (dpkg --compare-versions), e.g. fb_vercmp 4.2.1 ge 4.2
fb_vercmp() { dpkg --compare-versions "$1" "$2" "$3"; }

# ---------------------------------------------------------------- private apt configuration

# fb_mirror_stanza : prints a deb822 source stanza for the machine's configured Debian archive
# (the entry for the release itself, not -security/-updates/-backports), WITHOUT its Types,
# Suites, Components, Enabled and Targets fields, keeping everything else verbatim (URIs,
# Signed-By, whether a path or an inline key, and any other options). Reads
# /etc/apt/sources.list.d/*.sources first, then one-line sources in /etc/apt/sources.list and
# /etc/apt/sources.list.d/*.list. FASTBOX_DEBIAN_MIRROR=<uri> overrides the URI (keyring then
# taken from the configured entry, or apt's trusted keys).
fb_mirror_stanza() {
    local f out="" etc=${FB_APT_ETC:-/etc/apt}
    for f in "$etc"/sources.list.d/*.sources; do
        [[ -r "$f" ]] || continue
        out=$(awk '
            function flush() {
                if (n > 0 && !done && isdeb && enabled && uri != "" && rel) {
                    for (i = 1; i <= n; i++) print keep[i]
                    done = 1
                }
                n = 0; isdeb = 0; enabled = 1; uri = ""; rel = 0; skip = 0
            }
            BEGIN { n = 0; enabled = 1 }
            /^[[:space:]]*#/ { next }
            /^[[:space:]]*$/ { flush(); next }
            /^[[:space:]]/ { if (!skip) keep[++n] = $0; next }   # continuation line
            {
                field = tolower($1); sub(/:$/, "", field)
                val = $0; sub(/^[^:]*:[[:space:]]*/, "", val)
                skip = 0
                if (field == "types") { if (val ~ /(^|[[:space:]])deb([[:space:]]|$)/) isdeb = 1; skip = 1 }
                else if (field == "enabled") { if (tolower(val) ~ /^(no|false|0)/) enabled = 0; skip = 1 }
                else if (field == "suites") {
                    m = split(val, s, /[[:space:]]+/)
                    for (j = 1; j <= m; j++)
                        if (s[j] != "" && s[j] !~ /-(security|updates|backports|proposed-updates)$/ && s[j] !~ /\//) rel = 1
                    skip = 1
                }
                else if (field == "components" || field == "targets") { skip = 1 }
                else if (field == "uris") {
                    if (val !~ /security/) uri = val
                }
                if (!skip) keep[++n] = $0
            }
            END { flush() }
        ' "$f")
        if [[ -n "$out" ]]; then break; fi
    done
    if [[ -z "$out" ]]; then
        for f in "$etc"/sources.list "$etc"/sources.list.d/*.list; do
            [[ -r "$f" ]] || continue
            out=$(awk '
                $1 != "deb" { next }
                {
                    opts = ""; i = 2
                    if ($2 ~ /^\[/) {
                        while (i <= NF) { opts = opts " " $i; if ($i ~ /\]$/) { i++; break }; i++ }
                    }
                    uri = $i; suite = $(i + 1)
                    if (uri ~ /security/ || suite ~ /-(security|updates|backports|proposed-updates)$/) next
                    print "URIs: " uri
                    gsub(/[][]/, "", opts)
                    k = split(opts, o, /[[:space:]]+/)
                    for (j = 1; j <= k; j++) {
                        if (o[j] ~ /^signed-by=/) { sub(/^signed-by=/, "", o[j]); print "Signed-By: " o[j] }
                        if (o[j] ~ /^trusted=/) { sub(/^trusted=/, "", o[j]); print "Trusted: " o[j] }
                    }
                    exit
                }' "$f")
            if [[ -n "$out" ]]; then break; fi
        done
    fi
    if [[ -n "${FASTBOX_DEBIAN_MIRROR:-}" ]]; then
        out=$(printf '%s\n' "$out" | grep -v '^URIs:' || true)
        out=$(printf 'URIs: %s\n%s' "$FASTBOX_DEBIAN_MIRROR" "$out")
    fi
    [[ -n "$out" ]] || return 1
    printf '%s\n' "$out"
}

# fb_private_apt_init DIR SUITES [deb|deb-src types]
# Creates a private apt tree under DIR (own state, cache, sources, no preferences) whose single
# source is the machine's Debian mirror with the given suites (component main). Sets the array
# FB_APT_OPTS for use as: apt-get "${FB_APT_OPTS[@]}" ...
FB_APT_OPTS=()
fb_private_apt_init() {
    local dir=$1 suites=$2 types=${3:-deb} stanza
    stanza=$(fb_mirror_stanza) ||
        fb_die "could not find a Debian mirror in /etc/apt/sources.list.d/*.sources or /etc/apt/sources.list (set FASTBOX_DEBIAN_MIRROR=<uri>)"
    mkdir -p "$dir/etc/sources.list.d" "$dir/etc/preferences.d" "$dir/state/lists/partial" \
        "$dir/cache/archives/partial"
    touch "$dir/state/status"
    local targets="Packages"
    if [[ "$types" == *deb-src* ]]; then targets="Packages Sources"; fi
    {
        printf '# generated by fastbox scripts/lib.sh from the machine apt configuration\n'
        printf 'Types: %s\n' "$types"
        printf '%s\n' "$stanza"
        printf 'Suites: %s\nComponents: main\nTargets: %s\n' "$suites" "$targets"
    } >"$dir/etc/sources.list.d/fastbox.sources.new"
    mv "$dir/etc/sources.list.d/fastbox.sources.new" "$dir/etc/sources.list.d/fastbox.sources"
    FB_APT_OPTS=(
        -o "Dir::State=$dir/state"
        -o "Dir::State::status=$dir/state/status"
        -o "Dir::Cache=$dir/cache"
        -o "Dir::Cache::pkgcache=$dir/cache/pkgcache.bin"
        -o "Dir::Cache::srcpkgcache=$dir/cache/srcpkgcache.bin"
        -o "Dir::Etc::sourcelist=/dev/null"
        -o "Dir::Etc::sourceparts=$dir/etc/sources.list.d"
        -o "Dir::Etc::preferences=/dev/null"
        -o "Dir::Etc::preferencesparts=$dir/etc/preferences.d"
        -o "APT::Sandbox::User=root"
        -o "Acquire::Languages=none"
        -o "APT::Get::List-Cleanup=true"
    )
}
