#!/usr/bin/env bash
# Where a restore's time goes (restore to the first step from a keeper-held image): an
# MLP holding 8 GiB under libpossum.so with a keeper, checkpointed and killed (its buffers held by
# the keeper), then restored with CRIU logging everything (POSSUM_CRIU_LOG_LEVEL=4); keeps CRIU's
# dump and restore logs (timestamped lines), possum's JSON, and the job's memory by kind before the
# checkpoint (smaps_rollup, the largest mappings), as one archive.
# From the build in .gpu/ (gpu-ckpt.sh --stage). Writes $OUT/diag-restore.tgz (or .gpu/out/).
# Without a GPU it says SKIPPED and exits 0.
set -uo pipefail
source "$(dirname "$0")/probe.sh"
gpu_probe diag-restore
source scripts/gpu-criu.sh
W=/dev/shm/possum-diag-restore; rm -rf "$W"; mkdir -p "$W/sockets"
keeper_in "$W"
mlp_with_keeper "$W" 8
cat "/proc/$pid/smaps_rollup" > "$res/smaps_rollup.txt" 2>&1
# The largest mappings by resident anonymous memory (KiB), with their names.
awk '/^[0-9a-f]+-[0-9a-f]+ /{name=$6; range=$1} /^Anonymous:/{if ($2 > 10240) print $2, range, name}' "/proc/$pid/smaps" \
    | sort -rn | head -40 > "$res/largest-anon.txt"
grep -c '^[0-9a-f]*-[0-9a-f]* ' "/proc/$pid/maps" > "$res/vma-count.txt"
.gpu/possum checkpoint "$pid" -D "$W/img" --json --socket-dir "$W/sockets" > "$res/checkpoint.json" 2> "$res/checkpoint.err"
wait "$pid" 2>/dev/null
du -sh "$W/img"/* > "$res/image-sizes.txt" 2>&1
ls -la "$W/img/criu" | sort -k5 -n | tail -15 >> "$res/image-sizes.txt"
cp "$W/job.log" "$W/job.log.1"; : > "$W/job.log"
t0=$(date +%s.%N)
POSSUM_CRIU_LOG_LEVEL=4 .gpu/possum restore -D "$W/img" --json > "$res/restore.json" 2> "$res/restore.err"
for _ in $(seq 300); do [ -s "$W/job.log" ] && break; sleep 0.01; done
t1=$(date +%s.%N)
python3 -c "import sys; print('restore to first step line: %.3f s' % (float(sys.argv[2]) - float(sys.argv[1])))" "$t0" "$t1" > "$res/first-step.txt"
cp "$W"/img/criu/*.log "$res/" 2>/dev/null
kill -9 "$pid" 2>/dev/null; kill "$keeper" 2>/dev/null
sleep 1
cat "$res/first-step.txt" "$res/vma-count.txt"; head -12 "$res/smaps_rollup.txt"; head -8 "$res/largest-anon.txt"
python3 -c "import json,sys; r=json.load(open('$res/restore.json')); print(r.get('figures'), r.get('gpu_from_keeper'))"
# One file back (the device tool brings back a few files per call).
(cd "$res/.." && tar czf diag-restore.tgz diag-restore && rm -rf diag-restore)
