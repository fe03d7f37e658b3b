#!/usr/bin/env bash
# Build possum and install it with the two libraries it uses at run time, where it looks for them:
#   PREFIX/bin/possum                                   the command
#   PREFIX/lib/libpossum.so                             preloaded into jobs by `possum run`
#                                                       (looked for beside possum, then in ../lib)
#   PREFIX/bin/criu-plugins/libpossum_criu_plugin.so    the CRIU plugin that `possum checkpoint`
#                                                       and `possum restore` give CRIU (looked for
#                                                       in criu-plugins/ beside possum)
#
# Usage: bash scripts/install.sh [--prefix DIR] [--debug]
#   --prefix DIR   where to install (default /usr/local, or $POSSUM_PREFIX)
#   --debug        install the debug build instead of the release build (quicker to build)
# It builds as the user who runs it (cargo must be on PATH) and copies with sudo when PREFIX is
# not writable. CRIU itself comes from scripts/install-criu.sh.
set -euo pipefail

prefix=${POSSUM_PREFIX:-/usr/local}
profile=release

SCRIPT=install
# shellcheck source=scripts/install-lib.sh
source "$(dirname "$(readlink -f -- "$0")")/install-lib.sh"

while [ $# -gt 0 ]; do
    case $1 in
    --debug)
        profile=debug
        shift
        ;;
    *)
        common_option "$@"
        shift "$TAKEN"
        ;;
    esac
done
prefix=$(absolute "$prefix")

cd "$(dirname "$0")/.."
command -v cargo >/dev/null || die "cargo not found on PATH (install Rust: https://rustup.rs)"

flags=()
[ "$profile" = release ] && flags=(--release)
say "building possum, libpossum.so and the CRIU plugin ($profile)"
cargo build "${flags[@]}" -p possum -p possum-interposer -p possum-criu-plugin

target=${CARGO_TARGET_DIR:-target}/$profile
for f in possum libpossum.so libpossum_criu_plugin.so; do
    [ -f "$target/$f" ] || die "$target/$f was not built"
done

# The prefix's nearest existing directory decides whether copying needs root.
probe=$prefix
while [ ! -e "$probe" ]; do probe=$(dirname "$probe"); done
as=()
if [ ! -w "$probe" ] || { [ -e "$prefix/bin" ] && [ ! -w "$prefix/bin" ]; }; then
    command -v sudo >/dev/null || die "$prefix is not writable and sudo is not available"
    say "$prefix is not writable; copying with sudo"
    as=(sudo)
fi

"${as[@]}" install -D -m 0755 "$target/possum" "$prefix/bin/possum"
"${as[@]}" install -D -m 0644 "$target/libpossum.so" "$prefix/lib/libpossum.so"
# CRIU loads every .so in its plugin directory: this one holds only the plugin.
"${as[@]}" install -D -m 0644 "$target/libpossum_criu_plugin.so" \
    "$prefix/bin/criu-plugins/libpossum_criu_plugin.so"

say "installed $prefix/bin/possum, $prefix/lib/libpossum.so and" \
    "$prefix/bin/criu-plugins/libpossum_criu_plugin.so"
case ":$PATH:" in
*":$prefix/bin:"*) ;;
*) say "note: $prefix/bin is not on PATH" ;;
esac
