# Shared by scripts/install.sh and scripts/install-criu.sh (sourced, not run): messages, the
# usage text (the sourcing script's header comment) and option values. The sourcing script sets
# SCRIPT (its name in messages) first.

say() { printf '%s: %s\n' "$SCRIPT" "$*"; }
warn() { printf '%s: WARNING: %s\n' "$SCRIPT" "$*" >&2; }
die() {
    printf '%s: error: %s\n' "$SCRIPT" "$*" >&2
    exit 1
}
usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; }

# option_value OPTION WHAT ARGS...: the value of OPTION, given as `OPTION VALUE` or
# `OPTION=VALUE` at the front of ARGS, in VALUE; in TAKEN how many arguments that was (to shift).
option_value() {
    local option=$1 what=$2
    shift 2
    case $1 in
    "$option"=*)
        VALUE=${1#*=}
        TAKEN=1
        ;;
    *)
        [ $# -ge 2 ] || die "$option needs $what"
        VALUE=$2
        TAKEN=2
        ;;
    esac
}

# common_option ARGS...: the option at the front of ARGS if every installer takes it: --prefix DIR
# (in prefix), -h/--help (the usage, then exit 0); anything else is refused. In TAKEN how many
# arguments it took (to shift).
common_option() {
    case $1 in
    --prefix | --prefix=*)
        option_value --prefix "a directory" "$@"
        prefix=$VALUE
        ;;
    -h | --help)
        usage
        exit 0
        ;;
    *) die "unknown argument '$1' (see --help)" ;;
    esac
}

# absolute DIR: DIR made absolute (relative to the current directory), without a trailing slash.
absolute() {
    case $1 in
    /*) printf '%s\n' "${1%/}" ;;
    *) printf '%s\n' "$PWD/${1%/}" ;;
    esac
}
