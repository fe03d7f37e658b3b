# Sourced by the GPU scripts, from the repository root: CRIU from the packages carried in
# .gpu/criu-debs (gpu-ckpt.sh --stage downloads them), unpacked once into /tmp/possum-criu, and
# POSSUM_CRIU pointing at it. Exits the sourcing script (with the install's log) if it fails.
possum_criu_prefix=/tmp/possum-criu
[ -x "$possum_criu_prefix/bin/criu" ] \
    || bash scripts/install-criu.sh --from-debs .gpu/criu-debs --prefix "$possum_criu_prefix" > /tmp/install-criu.log 2>&1 \
    || { cat /tmp/install-criu.log; exit 1; }
export POSSUM_CRIU="$possum_criu_prefix/bin/criu"
