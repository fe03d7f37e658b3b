#!/usr/bin/env bash
# Install CRIU 4.2 or later from Debian's testing suite (forky) into a private prefix, without
# touching the system's package sources or its installed packages.
#
# Why 4.2: CRIU 4.1 cannot dump a TCP socket on Linux 6.16 or later ("Can't get 1:16 opt": the
# kernel no longer answers SO_PASSCRED on a TCP socket), so every server, every torchrun job (its
# TCPStore) and every job with a socket is refused there; 4.2 dumps and restores them. 4.2 runs on
# older kernels too, so it is what this script installs everywhere. (Debian 12's criu 3.17 fails
# on kernel 6.18 altogether: "vdso: Unexpected rt vDSO area bounds".) Debian's binaries need a
# newer glibc than many hosts have (Debian 12 has 2.36), so on such a host the wrapper runs criu
# through the suite's own dynamic loader with its libc unpacked beside it; on a host whose glibc
# is new enough it only puts the prefix's libraries on LD_LIBRARY_PATH.
#
# Layout of the prefix (default /opt/possum-criu; relocatable, the wrapper finds it from its path):
#   bin/criu      the wrapper: `exec`s criu with the arguments passed through unchanged
#   root/         every package but libc6, unpacked with `dpkg -x` (criu is root/usr/sbin/criu)
#   glibc/        the suite's libc6, used only when the host's glibc is too old
#   .possum-criu-installed   the suite, packages and versions installed (the idempotency stamp;
#                 an installed criu older than 4.2 is replaced without --force)
#
# Usage:
#   install-criu.sh [--prefix DIR] [--strict] [--force] [--allow-expired-lists]
#                                                         download and install
#   install-criu.sh --download-only DIR [--allow-expired-lists]
#                                                         only download the .debs into DIR
#   install-criu.sh --from-debs DIR [--prefix DIR]        install from .debs in DIR, no network
#
# --allow-expired-lists: accept package lists past their Valid-Until date, as a mirror that is
#   not kept current serves them (apt's Acquire::Check-Valid-Until=false). Their signatures are
#   still checked against the keyring; only the freshness check is off. Without it such a mirror
#   is refused with a message saying so. Also POSSUM_CRIU_ALLOW_EXPIRED=1.
# --strict: fail when `criu check` fails or cannot run (not root), or when the criu installed
#   cannot dump TCP sockets on the running kernel.
#
# Environment: POSSUM_CRIU_PREFIX (default prefix), POSSUM_CRIU_MIRROR, POSSUM_CRIU_SECURITY_MIRROR,
# POSSUM_CRIU_SUITE (default forky), POSSUM_CRIU_KEYRING (override the Debian source),
# POSSUM_CRIU_ALLOW_EXPIRED.
#
# Trust: the package lists are verified against debian-trixie-archive-keyring.gpg beside this
# script: Debian 13's archive keys as shipped by Debian 12's debian-archive-keyring
# 2023.3+deb12u2, which also sign the testing (forky) and unstable (sid) suites, so hosts without
# Debian's keyring (Ubuntu) need nothing more:
#   04B5 4C3C DCA7 9751 B16B  C6B5 2256 29DF 75B1 88BD  Archive Automatic Signing Key (13/trixie)
#   5E04 A1E3 223A 19A2 0706  E20F 9904 613D 4CCE 68C6  Security Archive Automatic Signing Key (13/trixie)
#   4158 7F7D B8C7 74BC CF13  1416 762F 67A0 B2C3 9DE4  Stable Release Key (13/trixie)
# Without that file (the script copied alone), /usr/share/keyrings/debian-archive-keyring.gpg.
set -euo pipefail

prefix=${POSSUM_CRIU_PREFIX:-/opt/possum-criu}
suite=${POSSUM_CRIU_SUITE:-forky}
mirror=${POSSUM_CRIU_MIRROR:-http://deb.debian.org/debian}
security_mirror=${POSSUM_CRIU_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
shipped_keyring=$(dirname "$(readlink -f -- "$0")")/debian-trixie-archive-keyring.gpg
if [ -n "${POSSUM_CRIU_KEYRING:-}" ]; then
    keyring=$POSSUM_CRIU_KEYRING
elif [ -r "$shipped_keyring" ]; then
    keyring=$shipped_keyring
else
    keyring=/usr/share/keyrings/debian-archive-keyring.gpg
fi
download_only=""
from_debs=""
strict=0
force=0
allow_expired=${POSSUM_CRIU_ALLOW_EXPIRED:-0}
# The oldest CRIU that dumps TCP sockets on Linux 6.16 and later.
min_major=4
min_minor=2
stamp_name=.possum-criu-installed

SCRIPT=install-criu
# shellcheck source=scripts/install-lib.sh
source "$(dirname "$(readlink -f -- "$0")")/install-lib.sh"

while [ $# -gt 0 ]; do
    case $1 in
    --download-only | --download-only=*)
        option_value --download-only "a directory" "$@"
        download_only=$VALUE
        shift "$TAKEN"
        ;;
    --from-debs | --from-debs=*)
        option_value --from-debs "a directory" "$@"
        from_debs=$VALUE
        shift "$TAKEN"
        ;;
    --strict)
        strict=1
        shift
        ;;
    --force)
        force=1
        shift
        ;;
    --allow-expired-lists)
        allow_expired=1
        shift
        ;;
    *)
        common_option "$@"
        shift "$TAKEN"
        ;;
    esac
done
[ -z "$download_only" ] || [ -z "$from_debs" ] || die "--download-only and --from-debs exclude each other"
prefix=$(absolute "$prefix")

work=""
debs_tmp=""
cleanup() { rm -rf ${work:+"$work"} ${debs_tmp:+"$debs_tmp"}; }
trap cleanup EXIT

# Downloads criu and every package it depends on (recursively) from $suite into $1, through a
# private apt configuration: its own source list, lists, cache and status, none of the host's.
download_debs() {
    local dest=$1
    command -v apt-get >/dev/null || die "apt-get not found: downloading needs a Debian-like host (or use --from-debs)"
    [ -r "$keyring" ] || die "keyring $keyring not found (set POSSUM_CRIU_KEYRING to one holding Debian's $suite keys)"
    mkdir -p "$dest"
    dest=$(cd "$dest" && pwd)
    work=$(mktemp -d /tmp/possum-criu-apt.XXXXXX)
    mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/etc/apt.conf.d" "$work/etc/preferences.d" "$work/etc/sources.list.d"
    : >"$work/status"
    # A copy, so that a path with spaces cannot break the source lines below.
    cp "$keyring" "$work/keyring.gpg"
    cat >"$work/etc/sources.list" <<EOF
deb [signed-by=$work/keyring.gpg] $mirror $suite main
deb [signed-by=$work/keyring.gpg] $mirror $suite-updates main
deb [signed-by=$work/keyring.gpg] $security_mirror $suite-security main
EOF
    # Only this file configures apt: the host's apt.conf.d is not read (Dir::Etc::Parts), so its
    # hooks (e.g. an appstream refresh after update) do not run. Proxy settings are carried over.
    {
        echo "Dir::Etc::SourceList \"$work/etc/sources.list\";"
        echo "Dir::Etc::SourceParts \"$work/etc/sources.list.d\";"
        echo "Dir::Etc::Parts \"$work/etc/apt.conf.d\";"
        echo "Dir::Etc::Preferences \"$work/etc/preferences\";"
        echo "Dir::Etc::PreferencesParts \"$work/etc/preferences.d\";"
        echo "Dir::State \"$work\";"
        echo "Dir::State::Lists \"$work/lists\";"
        echo "Dir::State::status \"$work/status\";"
        echo "Dir::Cache \"$work/cache\";"
        echo "Acquire::Languages \"none\";"
        echo "APT::Architecture \"amd64\";"
        echo "APT::Architectures { \"amd64\"; };"
        if [ "$(id -u)" -eq 0 ]; then echo "APT::Sandbox::User \"root\";"; fi
        if [ "$allow_expired" = 1 ]; then echo "Acquire::Check-Valid-Until \"false\";"; fi
        apt-config dump 2>/dev/null | grep -E '^Acquire::(https?|ftp)::Proxy' || true
    } >"$work/apt.conf"
    export APT_CONFIG=$work/apt.conf

    say "fetching the $suite package lists from $mirror (private apt state in $work)"
    apt-get -q update >"$work/update.log" 2>&1 || {
        cat "$work/update.log" >&2
        if grep -q NO_PUBKEY "$work/update.log"; then
            die "$keyring lacks the keys that sign Debian's $suite lists (set POSSUM_CRIU_KEYRING to a keyring holding them)"
        fi
        if grep -q 'is expired' "$work/update.log"; then
            die "$mirror serves $suite package lists past their Valid-Until date (a mirror not kept current): rerun with --allow-expired-lists to accept them (their signatures are still checked)"
        fi
        die "apt-get update of the private $suite source failed"
    }
    local pkgs
    pkgs=$(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
        --no-replaces --no-enhances criu | grep -v '^[ <]' | sort -u)
    local n
    n=$(printf '%s\n' "$pkgs" | wc -l)
    printf '%s\n' "$pkgs" | grep -qx criu || die "criu is not in $suite's package lists"
    printf '%s\n' "$pkgs" | grep -qx libc6 || die "resolving criu's dependencies did not reach libc6: $pkgs"
    # A runaway resolution (into perl, python, systemd...) means the package changed: look first.
    [ "$n" -le 60 ] || die "criu now pulls in $n packages; check the list before trusting it: $pkgs"
    say "downloading $n packages: $(echo $pkgs)"
    # shellcheck disable=SC2086 # word splitting of the package list is intended
    (cd "$dest" && apt-get -q download $pkgs >"$work/download.log" 2>&1) || {
        cat "$work/download.log" >&2
        die "apt-get download failed"
    }
    unset APT_CONFIG
}

# "package version" lines for the .debs in $1, sorted: what the stamp records.
manifest_of() {
    local deb
    for deb in "$1"/*.deb; do
        printf '%s %s\n' "$(dpkg-deb -f "$deb" Package)" "$(dpkg-deb -f "$deb" Version)"
    done | sort
}

# The criu version in "package version" lines on stdin, as MAJOR.MINOR (empty if none).
criu_version_of_manifest() {
    awk '$1 == "criu" { v = $2; sub(/^[0-9]*:/, "", v); split(v, p, /[.-]/); print p[1] "." p[2] }'
}

# True when version $1 (MAJOR.MINOR) is at least $min_major.$min_minor.
new_enough() {
    local major=${1%%.*} minor=${1#*.}
    case $major.$minor in [0-9]*.[0-9]*) ;; *) return 1 ;; esac
    [ "$major" -gt "$min_major" ] || { [ "$major" -eq "$min_major" ] && [ "$minor" -ge "$min_minor" ]; }
}

# True when the running kernel is Linux 6.16 or later (where CRIU older than 4.2 fails on TCP).
kernel_needs_new_criu() {
    local r major minor
    r=$(uname -r)
    major=${r%%.*}
    minor=${r#*.}
    minor=${minor%%[!0-9]*}
    [ "$major" -gt 6 ] || { [ "$major" -eq 6 ] && [ "${minor:-0}" -ge 16 ]; }
}

# Writes the wrapper $1/bin/criu. $2 is the newest glibc symbol version the binaries need.
write_wrapper() {
    local dir=$1 need=$2
    mkdir -p "$dir/bin"
    cat >"$dir/bin/criu" <<EOF
#!/bin/sh
# Written by possum's scripts/install-criu.sh: runs Debian $suite's criu from this prefix.
# Arguments pass through unchanged and criu replaces this shell (exec), so the PID and the
# inherited file descriptors are criu's ("criu swrk FD" works through it).
# loader: the host's glibc is too old; $suite's ld.so runs criu with --library-path, so nothing
#   leaks into what criu executes (it runs sh -c "iptables -n -w -L" while dumping).
# host: the host's glibc is new enough; the prefix's libraries go on LD_LIBRARY_PATH, which the
#   programs criu executes inherit too. Restored processes do not: their environment is the
#   dumped one. POSSUM_CRIU_LOADER=host|loader overrides the choice.
need_major=${need%%.*}
need_minor=${need#*.}
EOF
    cat >>"$dir/bin/criu" <<'EOF'
self=$(readlink -f -- "$0") || exit 127
prefix=${self%/bin/*}
criu=$prefix/root/usr/sbin/criu
libs=$prefix/root/usr/lib/x86_64-linux-gnu:$prefix/root/lib/x86_64-linux-gnu
glibc=$prefix/glibc/usr/lib/x86_64-linux-gnu
mode=${POSSUM_CRIU_LOADER:-auto}
if [ "$mode" = auto ]; then
    mode=loader
    host=$(getconf GNU_LIBC_VERSION 2>/dev/null) || host=""
    host=${host#glibc }
    case $host in
    [0-9]*.[0-9]*)
        major=${host%%.*}
        minor=${host#*.}
        minor=${minor%%[!0-9]*}
        if [ "$major" -gt "$need_major" ] || { [ "$major" -eq "$need_major" ] && [ "$minor" -ge "$need_minor" ]; }; then
            mode=host
        fi
        ;;
    esac
fi
case $mode in
host)
    LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export LD_LIBRARY_PATH
    exec "$criu" "$@"
    ;;
loader)
    exec "$glibc/ld-linux-x86-64.so.2" --library-path "$glibc:$libs" "$criu" "$@"
    ;;
*)
    echo "criu wrapper: POSSUM_CRIU_LOADER must be host or loader, not '$mode'" >&2
    exit 2
    ;;
esac
EOF
    chmod 0755 "$dir/bin/criu"
}

# Unpacks the .debs of $1 into a fresh copy of the prefix and swaps it in.
install_from() {
    local src=$1 deb pkg need
    ls "$src"/*.deb >/dev/null 2>&1 || die "no .deb files in $src"
    command -v dpkg-deb >/dev/null || die "dpkg-deb not found"
    mkdir -p "$(dirname "$prefix")"
    local staging
    staging=$(mktemp -d "$prefix.staging.XXXXXX")
    for deb in "$src"/*.deb; do
        pkg=$(dpkg-deb -f "$deb" Package)
        case $pkg in
        libc6) dpkg-deb -x "$deb" "$staging/glibc" ;;
        *) dpkg-deb -x "$deb" "$staging/root" ;;
        esac
    done
    [ -x "$staging/root/usr/sbin/criu" ] || {
        rm -rf "$staging"
        die "no usr/sbin/criu in the .debs of $src (is criu_*.deb there?)"
    }
    [ -e "$staging/glibc/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" ] ||
        warn "no libc6 .deb in $src: criu will only run where the host's glibc is new enough"
    # The newest GLIBC_2.N symbol version criu or any of its libraries asks for.
    need=$(find "$staging/root" -type f \( -name '*.so*' -o -path '*/sbin/criu' \) -print0 |
        xargs -0 grep -aoh 'GLIBC_2\.[0-9][0-9]*' | sort -u -t. -k2,2n | tail -n 1)
    need=${need#GLIBC_}
    [ -n "$need" ] || need=2.99
    write_wrapper "$staging" "$need"
    {
        echo "# installed by possum scripts/install-criu.sh from $src ($suite) on $(date -u +%Y-%m-%dT%H:%M:%SZ); needs glibc $need"
        manifest_of "$src"
    } >"$staging/$stamp_name"
    chmod 0755 "$staging"
    if [ -e "$prefix" ]; then
        local old="$prefix.old.$$"
        mv "$prefix" "$old"
        mv "$staging" "$prefix"
        rm -rf "$old"
    else
        mv "$staging" "$prefix"
    fi
    say "installed criu into $prefix (its binaries need glibc >= $need)"
}

# True when the prefix is installed and, given a .deb directory $1, holds exactly its packages;
# without one, when its criu is new enough (an older install is replaced).
installed_matches() {
    [ -x "$prefix/bin/criu" ] && [ -f "$prefix/$stamp_name" ] || return 1
    if [ -z "${1:-}" ]; then
        new_enough "$(grep -v '^#' "$prefix/$stamp_name" | criu_version_of_manifest)"
        return
    fi
    diff -q <(grep -v '^#' "$prefix/$stamp_name") <(manifest_of "$1") >/dev/null
}

verify() {
    local version out v
    version=$("$prefix/bin/criu" --version 2>&1) || die "$prefix/bin/criu --version failed: $version"
    say "$prefix/bin/criu: $(echo $version)"
    v=$(printf '%s\n' "$version" | sed -n 's/^Version: *\([0-9]*\.[0-9]*\).*/\1/p' | head -n 1)
    if ! new_enough "$v"; then
        if kernel_needs_new_criu; then
            [ "$strict" -eq 0 ] || die "criu $v cannot dump TCP sockets on Linux $(uname -r) (6.16 or later needs CRIU $min_major.$min_minor): install from a suite that has it (POSSUM_CRIU_SUITE=forky or sid)"
            warn "criu $v cannot dump TCP sockets on Linux $(uname -r) (6.16 or later needs CRIU $min_major.$min_minor): jobs with sockets will be refused"
        else
            warn "criu $v is older than $min_major.$min_minor: it works on this kernel, but not on Linux 6.16 or later"
        fi
    fi
    if [ "$(id -u)" -ne 0 ]; then
        warn "not root: skipped 'criu check' (it needs root, as do dump and restore)"
        [ "$strict" -eq 0 ] || die "--strict: 'criu check' needs root"
        return 0
    fi
    if out=$("$prefix/bin/criu" check 2>&1); then
        say "criu check: $(echo $out)"
    else
        printf '%s\n' "$out" >&2
        [ "$strict" -eq 0 ] || die "'criu check' failed (--strict)"
        warn "'criu check' failed: dump/restore may not work on this kernel"
    fi
}

if [ -n "$download_only" ]; then
    download_debs "$download_only"
    say "downloaded $(ls "$download_only"/*.deb | wc -l) .debs into $download_only;" \
        "install them elsewhere with: $0 --from-debs DIR"
    exit 0
fi

if [ -n "$from_debs" ]; then
    from_debs=$(cd "$from_debs" && pwd)
    if [ "$force" -eq 0 ] && installed_matches "$from_debs"; then
        say "criu from $from_debs already installed in $prefix (--force reinstalls)"
    else
        install_from "$from_debs"
    fi
elif [ "$force" -eq 0 ] && installed_matches ""; then
    say "criu already installed in $prefix (--force reinstalls)"
else
    debs_tmp=$(mktemp -d /tmp/possum-criu-debs.XXXXXX)
    download_debs "$debs_tmp"
    install_from "$debs_tmp"
fi
verify
