#!/usr/bin/env bash
# On the H100: the drain of a kept checkpoint (its GPU state saved into a
# memory-backed directory after the job runs on) with smaller copy chunks and less staging, so
# that a chunk the copy engine wrote into pinned staging may still be in the CPU's cache when a
# writer checksums and writes it (fewer passes over host memory, which bounds the drain:
# eval/results/README.md, 2026-11-25). One device call (carry .gpu, staged by
# `bash scripts/gpu-ckpt.sh --stage`), about 4 minutes:
#   bash scripts/gpu-drain.sh
# For each CHUNK_MIB:STAGING_MIB[:WRITE_PIECE_KIB] of DRAIN_CONFIGS (default "8:256:1024
# 8:256:2048 8:256:4096": the write piece; 1 MiB before 2026-11-27), the MLP holding
# DRAIN_GIB (32) GiB only read (possum-keeper-frozen) and written every step (possum-keeper),
# checkpointed --leave-running with a keeper, images on a huge-page tmpfs, 16 writers.
# -> $OUT/drain-C-S.{md,jsonl}, drain.txt (one line per run: save ms, GB/s)
#   bash scripts/gpu-drain.sh disk      (about 4 minutes)
# The drain to the local disk (item 7's second half: at the disk's speed): the disk's own write
# speed first (dd of 4 GiB with O_DIRECT, and buffered then fsynced), then the same kept
# checkpoints with the images under DRAIN_DISK_DIR (/var/tmp) at DRAIN_DISK_GIB (8,16) GiB, the
# default chunks and staging; the save includes the fsync of the data files. DRAIN_DISK_COLD=1
# drops the page cache before each restore (the restore then reads the disk).
# -> $OUT/drain-disk.{md,jsonl}, drain.txt
#   bash scripts/gpu-drain.sh spare     (about 6 minutes)
# The drain into the keeper's spare image memory (the keeper makes a file on the
# images' huge-page tmpfs, faulted in and registered with CUDA ahead, and copies the snapshot's
# shadows into it at the copy engine's speed; `POSSUM_KEEPER_SPARE_DIR/_MIB`), the MLP holding
# DRAIN_GIB (32) GiB read only and written every step, 2 reps, against the same without a spare
# (`POSSUM_SPARE_DRAIN=0`), DRAIN_SPARE_MIB (36864) MiB of spare: DRAIN_SPARE_REPS (3) reps
# with it (each checkpoint waits for the keeper's next spare, as checkpoints minutes apart
# would find it), 1 without.
# -> $OUT/drain-spare-{on,off}.{md,jsonl}, drain.txt (the save's GB/s and the shadows the keeper saved)
#   bash scripts/gpu-drain.sh spare-trials   (about 9 minutes)
# Random-step bit-exact trials (`gpu-ckpt.sh correctness`) of every workload checkpointed
# --leave-running with a keeper whose spare (TRIALS_SPARE_MIB, 8192) takes the drain's shadows:
# TRIALS_N (24) trials, seed TRIALS_SEED (26), engines TRIALS_ENGINES (possum-keeper).
# -> $OUT/spare-trials.{md,jsonl}, drain.txt (how many were identical, and used the spare)
# Without a GPU it says SKIPPED and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-start.sh
res="${OUT:-.gpu/out}"; mkdir -p "$res"; res=$(cd "$res" && pwd)
summary() {
    python3 - "$1" "$2" <<'PY' | tee -a "$res/drain.txt"
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    if not r.get("engine"):
        continue
    ck = r.get("checkpoint") or {}
    saved = ck.get("saved_ms")
    b = sum(x.get("bytes") or 0 for x in (r.get("kept") or {}).get("save") or []) or ck.get("gpu_image_bytes")
    gbs = f"{b / saved / 1e6:.1f}" if saved and b else "?"
    by_keeper = sum(x.get("shadows_saved_by_keeper") or 0 for x in (r.get("kept") or {}).get("save") or [])
    print(f"{sys.argv[2]}: {r['engine']} {r.get('gib')} GiB: "
          f"stall {r.get('stall_ms') or 0:.0f} ms, saved {saved} ms, {gbs} GB/s, "
          f"shadows saved by the keeper {by_keeper}, ok {r.get('ok')}")
PY
}
if [ "${1:-}" = spare ]; then
    huge=/tmp/possum-huge-tmpfs; mount_huge "$huge" 90g || exit 1
    for mode in on off; do
        rm -rf "$huge/spares"; mkdir -p "$huge/spares"
        drain=1 reps=${DRAIN_SPARE_REPS:-3}; [ "$mode" = off ] && drain=0 reps=1
        POSSUM_CKPT_HUGE=1 CKPT_TIMEOUT=240 OUT="$res/d" POSSUM_KEEPER_SPARE_DIR="$huge/spares" \
            POSSUM_KEEPER_SPARE_MIB="${DRAIN_SPARE_MIB:-36864}" \
            CKPT_JOB_ENV="POSSUM_WRITERS=16,POSSUM_SPARE_DRAIN=$drain" \
            timeout -k 5 "${DRAIN_STEP_S:-280}" bash scripts/gpu-ckpt.sh figures \
            --engines "${DRAIN_ENGINES:-possum-keeper-frozen,possum-keeper}" \
            --bench-plan "mlp:${DRAIN_GIB:-32}" --reps "$reps" --budget-s 260 > "$res/drain-spare-$mode.log" 2>&1
        grep -h "spare" "$huge"/possum-ckpt/keeper.err 2>/dev/null | tail -8 | sed "s/^/$mode: /" >> "$res/drain.txt"
        cp "$res/d/figures.md" "$res/drain-spare-$mode.md" 2>/dev/null
        cp "$res/d/ckpt-figures.jsonl" "$res/drain-spare-$mode.jsonl" 2>/dev/null
        rm -rf "$res/d"
        summary "$res/drain-spare-$mode.jsonl" "spare $mode"
    done
    rm -rf "$huge/spares"
    exit 0
fi
if [ "${1:-}" = spare-trials ]; then
    huge=/tmp/possum-huge-tmpfs; mount_huge "$huge" 90g || exit 1
    rm -rf "$huge/spares"; mkdir -p "$huge/spares"
    POSSUM_CKPT_HUGE=1 OUT="$res/t" POSSUM_KEEPER_SPARE_DIR="$huge/spares" \
        POSSUM_KEEPER_SPARE_MIB="${TRIALS_SPARE_MIB:-8192}" \
        timeout -k 5 "${TRIALS_STEP_S:-560}" bash scripts/gpu-ckpt.sh correctness \
        --engines "${TRIALS_ENGINES:-possum-keeper}" --trials "${TRIALS_N:-24}" \
        --seed "${TRIALS_SEED:-26}" --budget-s "${TRIALS_BUDGET_S:-500}" > "$res/spare-trials.log" 2>&1
    cp "$res/t/ckpt-correctness.jsonl" "$res/spare-trials.jsonl" 2>/dev/null
    cp "$res/t/correctness.md" "$res/spare-trials.md" 2>/dev/null
    rm -rf "$res/t" "$huge/spares"
    python3 - "$res/spare-trials.jsonl" <<'PY' | tee -a "$res/drain.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if r.get("trial") is not None]
used = sum(1 for r in rows if ((r.get("checkpoint") or {}).get("shadows_saved_by_keeper") or 0) > 0)
ok = sum(1 for r in rows if r.get("ok"))
print(f"spare trials: {ok}/{len(rows)} bit-identical both ways; the spare saved shadows in {used}")
PY
    exit 0
fi
if [ "${1:-}" = disk ]; then
    d="${DRAIN_DISK_DIR:-/var/tmp}/possum-drain"; rm -rf "$d"; mkdir -p "$d"
    { df -h "$d"; findmnt -T "$d" -o SOURCE,FSTYPE,OPTIONS | tail -1
      dd if=/dev/zero of="$d/dd" bs=8M count=512 oflag=direct 2>&1 | tail -1 | sed 's/^/O_DIRECT 4 GiB: /'
      rm -f "$d/dd"; sync
      dd if=/dev/zero of="$d/dd" bs=8M count=512 conv=fsync 2>&1 | tail -1 | sed 's/^/buffered + fsync 4 GiB: /'
      rm -f "$d/dd"; sync; } 2>&1 | tee -a "$res/drain.txt"
    POSSUM_CKPT_WORK="$d/ckpt" CKPT_TIMEOUT=300 OUT="$res/d" CKPT_JOB_ENV="POSSUM_WRITERS=16" \
        CKPT_DROP_CACHES="${DRAIN_DISK_COLD:-0}" \
        timeout -k 5 "${DRAIN_STEP_S:-400}" bash scripts/gpu-ckpt.sh figures \
        --engines "${DRAIN_ENGINES:-possum-keeper}" --bench-plan "mlp:${DRAIN_DISK_GIB:-8,16}" \
        --budget-s 380 > "$res/drain-disk.log" 2>&1
    cp "$res/d/figures.md" "$res/drain-disk.md" 2>/dev/null
    cp "$res/d/ckpt-figures.jsonl" "$res/drain-disk.jsonl" 2>/dev/null
    rm -rf "$res/d" "$d"
    summary "$res/drain-disk.jsonl" "disk $(findmnt -T "${DRAIN_DISK_DIR:-/var/tmp}" -o FSTYPE -n)"
    exit 0
fi
for cfg in ${DRAIN_CONFIGS:-8:256:1024 8:256:2048 8:256:4096}; do
    IFS=: read -r c s p <<< "$cfg"; p=${p:-2048}
    POSSUM_CKPT_HUGE=1 CKPT_TIMEOUT=200 OUT="$res/d" \
        CKPT_JOB_ENV="POSSUM_WRITERS=16,POSSUM_STAGING_MIB=$s,POSSUM_CHUNK_MIB=$c,POSSUM_WRITE_PIECE_KIB=$p" \
        timeout -k 5 "${DRAIN_STEP_S:-170}" bash scripts/gpu-ckpt.sh figures \
        --engines "${DRAIN_ENGINES:-possum-keeper-frozen,possum-keeper}" \
        --bench-plan "mlp:${DRAIN_GIB:-32}" --budget-s 150 > "$res/drain-$c-$s-$p.log" 2>&1
    cp "$res/d/figures.md" "$res/drain-$c-$s-$p.md" 2>/dev/null
    cp "$res/d/ckpt-figures.jsonl" "$res/drain-$c-$s-$p.jsonl" 2>/dev/null
    rm -rf "$res/d"
    summary "$res/drain-$c-$s-$p.jsonl" "chunk $c MiB, staging $s MiB, write piece $p KiB"
done
