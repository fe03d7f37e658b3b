#!/usr/bin/env bash
# The migration source's wait for its destination's loads before the cut, A/B in one device
# call of under ten minutes (LOADWAIT_LIMIT_S, default 560 s), one GPU, both ends on it over
# loopback, images on a huge-page tmpfs. Builds nothing: carry .gpu, staged by
# `bash scripts/gpu-ckpt.sh --stage`.
# The jobs with 8 GiB of frozen weights and 64 MiB of state (f8) and a training job writing
# 8 GiB every step (t8), migrated with the default wait (tags f8-wait, t8-wait) and with
# POSSUM_MIGRATE_LOAD_WAIT_MS=0 (f8-nowait, t8-nowait), taking turns, LOADWAIT_REPS (2) times
# (`gpu-speculation.sh bars`: each row the downtime in the job's own step log and possum's
# figures, `migrate.loaded_ahead` among them).
# -> $OUT/load-wait.jsonl, $OUT/load-wait-logs.tgz (the steps' logs)
# Without a GPU it says SKIPPED and exits 0.
set -u
cd "$(dirname "$0")/.."
source scripts/gpu-start.sh
harness_run load-wait LOADWAIT_LIMIT_S
bars_out=load-wait.jsonl
for rep in $(seq "${LOADWAIT_REPS:-2}"); do
    spec_bars "wait-$rep" 130 SPEC_BARS="8 64 f8-wait,0 8192 t8-wait"
    spec_bars "nowait-$rep" 130 SPEC_BARS="8 64 f8-nowait,0 8192 t8-nowait" \
        POSSUM_MIGRATE_LOAD_WAIT_MS=0
done
(cd "$res" && find . -type f \( -name '*.log' -o -name '*.err' \) -size -20M \
    | tar czf "$out/load-wait-logs.tgz" -T -)
echo "== done, $(left) s left"
