#!/usr/bin/env bash
# Where a migration's downtime goes: GPT-2 generation (TIMELINE_JOB, default gpt2gen) migrated
# alone TIMELINE_TRIALS times (default 3,2: without and with `--post-copy`; TIMELINE_ENGINES
# names ckpt.py's engines, say possum-keeper-migrate alone), one at a time, both
# ends on this host over loopback, images on a huge-page tmpfs as in `gpu-migrate-bars.sh`,
# within TIMELINE_LIMIT_S (default 300 s). TIMELINE_BUILDS: the possum executables to run it
# with, in turn, for an A/B of builds in one call (default .gpu/possum; another build staged as,
# say, .gpu/possum-0). TIMELINE_CRIU_LEVEL: CRIU's log level (4: each of its steps timed), its
# dump and restore logs then kept. Builds nothing: carry .gpu, staged by
# `bash scripts/gpu-ckpt.sh --stage`.
# -> $OUT/timeline-<build>.jsonl (each migration's row: possum's figures, the job's longest
#    gap), $OUT/criu-logs/<build>/<engine>-<trial>/ (with TIMELINE_CRIU_LEVEL: the source's dump
#    log, the destination's restore log), $OUT/timeline-logs.tgz (the job's and the steps' logs)
# Without a GPU it says SKIPPED and exits 0.
set -u
cd "$(dirname "$0")/.."
source scripts/gpu-start.sh
harness_run migrate-timeline TIMELINE_LIMIT_S
builds=(${TIMELINE_BUILDS:-.gpu/possum})
level=${TIMELINE_CRIU_LEVEL:-}
share=$(( ($(left) - 15) / ${#builds[@]} ))
for b in "${builds[@]}"; do
    name=$(basename "$b")
    echo "== timeline (${TIMELINE_JOB:-gpt2gen}, $name), $(left) s left"
    [ -x "$b" ] || { echo "no $b"; continue; }
    if [ -n "$level" ]; then
        export CKPT_CRIU_LOGS="$out/criu-logs/$name" POSSUM_CRIU_LOG_LEVEL=$level
    fi
    POSSUM="$PWD/$b" migrations "timeline-$name" "$share" "${TIMELINE_JOB:-gpt2gen}" \
        "${TIMELINE_TRIALS:-3,2}" 1 "${TIMELINE_SEED:-93}" \
        "${TIMELINE_ENGINES:-possum-keeper-migrate,possum-keeper-migrate-postcopy}"
    cp "$res/timeline-$name/ckpt-correctness.jsonl" "$out/timeline-$name.jsonl" 2>/dev/null
    grep "^correctness (" "$res/timeline-$name.log"
done
(cd "$res" && find . -type f \( -name '*.log' -o -name '*.err' -o -name '*.md' \) -size -20M \
    | tar czf "$out/timeline-logs.tgz" -T -)
echo "== done, $(left) s left"
