#!/usr/bin/env bash
# Issue 14 item 7 on the H100: the drain of a kept checkpoint (its GPU state saved into a
# memory-backed directory after the job runs on) with smaller copy chunks and less staging, so
# that a chunk the copy engine wrote into pinned staging may still be in the CPU's cache when a
# writer checksums and writes it (fewer passes over host memory, which bounds the drain:
# eval/results/README.md, session 21). One device call (carry .gpu, staged by
# `bash scripts/gpu-ckpt.sh --stage`), about 4 minutes:
#   bash scripts/gpu-drain.sh
# For each CHUNK_MIB:STAGING_MIB of DRAIN_CONFIGS (default "8:1024 2:64 1:32"), the MLP holding
# DRAIN_GIB (32) GiB only read (possum-keeper-frozen) and written every step (possum-keeper),
# checkpointed --leave-running with a keeper, images on a huge-page tmpfs, 16 writers.
# -> $OUT/drain-C-S.{md,jsonl}, drain.txt (one line per run: save ms, GB/s)
# Without a GPU it says SKIPPED and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L >/dev/null 2>&1 || { echo "SKIPPED: no GPU (nvidia-smi -L failed)"; exit 0; }
res="${OUT:-.gpu/out}"; mkdir -p "$res"; res=$(cd "$res" && pwd)
for cfg in ${DRAIN_CONFIGS:-8:1024 2:64 1:32}; do
    c=${cfg%%:*}; s=${cfg##*:}
    POSSUM_CKPT_HUGE=1 CKPT_TIMEOUT=200 OUT="$res/d" \
        CKPT_JOB_ENV="POSSUM_WRITERS=16,POSSUM_STAGING_MIB=$s,POSSUM_CHUNK_MIB=$c" \
        timeout -k 5 "${DRAIN_STEP_S:-170}" bash scripts/gpu-ckpt.sh figures \
        --engines "${DRAIN_ENGINES:-possum-keeper-frozen,possum-keeper}" \
        --bench-plan "mlp:${DRAIN_GIB:-32}" --budget-s 150 > "$res/drain-$c-$s.log" 2>&1
    cp "$res/d/figures.md" "$res/drain-$c-$s.md" 2>/dev/null
    cp "$res/d/ckpt-figures.jsonl" "$res/drain-$c-$s.jsonl" 2>/dev/null
    rm -rf "$res/d"
    python3 - "$res/drain-$c-$s.jsonl" "$c" "$s" <<'PY' | tee -a "$res/drain.txt"
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    if not r.get("engine"):
        continue
    ck = r.get("checkpoint") or {}
    saved = ck.get("saved_ms")
    b = sum(x.get("bytes") or 0 for x in (r.get("kept") or {}).get("save") or []) or ck.get("gpu_image_bytes")
    gbs = f"{b / saved / 1e6:.1f}" if saved and b else "?"
    print(f"chunk {sys.argv[2]} MiB, staging {sys.argv[3]} MiB: {r['engine']} {r.get('gib')} GiB: "
          f"stall {r.get('stall_ms') or 0:.0f} ms, saved {saved} ms, {gbs} GB/s, ok {r.get('ok')}")
PY
done
