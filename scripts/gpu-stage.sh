#!/usr/bin/env bash
# Staged restore on the H100: the keeper loads a job's image into GPU memory while CRIU restores
# the process (`possum restore`'s staging), and the restored job maps that memory and waits only
# for buffers still loading. Two device calls of at most 10 minutes (carry .gpu, staged by
# `bash scripts/gpu-ckpt.sh --stage`):
#   bash scripts/gpu-stage.sh figures       (~9 min)
#       The MLP holding 1, 8 and 32 GiB of extra state written every step, checkpointed and
#       killed with --keep-on-gpu 0 (the keeper keeps nothing: the restore reads the image), then
#       restored: with the keeper's staging (possum-keeper-kill-disk, the default) and without it
#       (-nostage: POSSUM_RESTORE_STAGE=0, the restored job copies from the image itself); images
#       on a huge-page tmpfs. Restore to the first step, every buffer back, restore parts.
#       -> $OUT/stage-figures.{json,md}, stage-figures.jsonl
#       (STAGE_ENGINES, STAGE_PLAN, STAGE_REPS change the engines, cells and reps.)
#   bash scripts/gpu-stage.sh correctness   (~6 min)
#       Checkpointed-and-killed trials restored through the staging, at random steps, over
#       mlp, gpt2, cnn, triton, graph, multistream and the two served allocators: bit-exact from
#       the restore on.
#       -> $OUT/stage-correctness.{jsonl,md}
#   bash scripts/gpu-stage.sh run           (~2 min)
#       `possum run` of an MLP holding 8 GiB, `possum checkpoint --keep-on-gpu 0` (killed, its
#       keeper gone with it), `possum restore` (a keeper started before CRIU, loading the image):
#       the restored job's lines equal a run without possum's, and no keeper is left after it.
#       -> $OUT/stage-run.json
#   bash scripts/gpu-stage.sh threads       (~6 min)
#       The keeper's loader threads (8, 16, 24: STAGE_THREADS) against the staging's GB/s and the
#       restore to the first step, MLP at 32 GiB. -> $OUT/stage-threads.txt
#   bash scripts/gpu-stage.sh ab-gpt2       (~9 min)
#       GPT-2 small's in-process A/B (the served allocators' overhead), up to 12 processes in the budget.
#       -> $OUT/overhead-ab-gpt2.json, ab-gpt2.log
# Without a GPU it says SKIPPED and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L >/dev/null 2>&1 || { echo "SKIPPED: no GPU (nvidia-smi -L failed)"; exit 0; }
res="${OUT:-.gpu/out}"; mkdir -p "$res"; res=$(cd "$res" && pwd)
case "${1:-}" in
figures)
    POSSUM_CKPT_HUGE=1 POSSUM_WRITERS=16 POSSUM_STAGING_MIB=1024 CKPT_TIMEOUT=200 OUT="$res/f" \
        timeout -k 5 570 bash scripts/gpu-ckpt.sh figures \
        --engines "${STAGE_ENGINES:-possum-keeper-kill-disk,possum-keeper-kill-disk-nostage}" \
        --bench-plan "${STAGE_PLAN:-mlp:1,8,32}" --reps "${STAGE_REPS:-1}" --budget-s 520 \
        > "$res/stage-figures.log" 2>&1
    cp "$res/f/figures.json" "$res/stage-figures.json" 2>/dev/null
    cp "$res/f/figures.md" "$res/stage-figures.md" 2>/dev/null
    cp "$res/f/ckpt-figures.jsonl" "$res/stage-figures.jsonl" 2>/dev/null
    rm -rf "$res/f"
    cat "$res/stage-figures.md" 2>/dev/null || tail -20 "$res/stage-figures.log"
    ;;
correctness)
    CKPT_TIMEOUT=120 OUT="$res/c" timeout -k 5 ${STAGE_TIMEOUT_S:-400} bash scripts/gpu-ckpt.sh correctness \
        --engines possum-keeper-kill-disk --trials 9 --seed 23 --budget-s ${STAGE_BUDGET_S:-340} \
        --jobs mlp,gpt2+async,cnn,triton,gpt2,graph,multistream,mlp+expandable,gpt2+expandable \
        > "$res/stage-correctness.log" 2>&1
    cp "$res/c/ckpt-correctness.jsonl" "$res/stage-correctness.jsonl" 2>/dev/null
    cp "$res/c/correctness.md" "$res/stage-correctness.md" 2>/dev/null
    rm -rf "$res/c"
    grep -h "trials identical" "$res/stage-correctness.log"
    cat "$res/stage-correctness.md" 2>/dev/null
    ;;
threads)
    # The keeper's loader threads (POSSUM_KEEPER_STAGE_THREADS, default 8) against the staging's
    # speed: the MLP holding 32 GiB, killed with --keep-on-gpu 0, restored through the staging,
    # for each count in STAGE_THREADS ("8 16 24"); the keeper's ended stage gives the load's GB/s.
    for t in ${STAGE_THREADS:-8 16 24}; do
        POSSUM_KEEPER_STAGE_THREADS=$t POSSUM_CKPT_HUGE=1 CKPT_TIMEOUT=200 OUT="$res/t$t" \
            timeout -k 5 170 bash scripts/gpu-ckpt.sh figures --engines possum-keeper-kill-disk \
            --bench-plan "${STAGE_PLAN:-mlp:32}" --reps 1 --budget-s 150 > "$res/stage-threads-$t.log" 2>&1
        python3 - "$res/t$t/ckpt-figures.jsonl" "$t" <<'PY' | tee -a "$res/stage-threads.txt"
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l); s = r.get("stage_ended") or {}
    print(f"{sys.argv[2]} loader threads, {r.get('gib')} GiB: first step {r.get('restore_to_first_step_ms') or 0:.0f} ms, "
          f"every buffer back {r.get('buffers_back_ms') or 0:.0f} ms, stage {s.get('loaded_bytes')} B in "
          f"{s.get('done_ms')} ms ({s.get('gb_per_s') or 0:.1f} GB/s), failed {s.get('failed')}")
PY
        rm -rf "$res/t$t"
    done
    ;;
run)
    # The user's path: `possum run` (its own keeper), `possum checkpoint --keep-on-gpu 0` (the
    # job killed, its keeper ending with it: nothing held), then `possum restore`, which starts a
    # keeper before CRIU and has it load the image; the restored job maps that memory and must
    # write the reference's lines; its keeper ends with it.
    source scripts/gpu-criu.sh
    W=/dev/shm/possum-stage-run; rm -rf "$W"; mkdir -p "$W/sockets"
    job=(python3 workloads/gpu/jobs.py mlp --steps 500 --hold-gib "${STAGE_RUN_GIB:-8}" --sleep-ms 10)
    timeout 120 "${job[@]}" --log "$W/ref.log" 2> "$W/ref.err"
    setsid .gpu/possum run --socket-dir "$W/sockets" -- "${job[@]}" --log "$W/job.log" > "$W/job.out" 2> "$W/job.err" &
    run=$!
    for _ in $(seq 900); do [ "$(cat "$W/job.log" 2>/dev/null | wc -l)" -ge 100 ] && break; sleep 0.1; done
    pid=$(pgrep -f -n "jobs.py mlp --steps 500 .* --log $W/job.log")
    timeout 200 .gpu/possum checkpoint "$pid" -D "$W/img" --keep-on-gpu 0 --json --socket-dir "$W/sockets" > "$W/ck.json" 2> "$W/ck.err"
    ck=$?
    wait "$run"
    sleep 3
    kept_before=$(pgrep -f "possum keeper --dir $W/sockets/keeper-" | wc -l)
    cp "$W/job.log" "$W/job.log.1"; : > "$W/job.log"
    timeout 200 .gpu/possum restore -D "$W/img" --json > "$W/rs.json" 2> "$W/rs.err"
    rs=$?
    for _ in $(seq 1200); do [ -e "/proc/$pid" ] || break; sleep 0.1; done
    sleep 4
    kept_after=$(pgrep -f "possum keeper --dir $W/sockets/keeper-" | wc -l)
    python3 - "$W" "$ck" "$rs" "$kept_before" "$kept_after" "$res/stage-run.json" <<'PY'
import json, sys
w, ck, rs, before, after, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
rows = lambda p: [{k: v for k, v in json.loads(l).items() if k != "t"} for l in open(p) if l.strip()]
ref, first, second = rows(f"{w}/ref.log"), rows(f"{w}/job.log.1"), rows(f"{w}/job.log")
s0 = second[0].get("step") if second else None
r = json.load(open(f"{w}/rs.json")) if rs == 0 else {}
doc = {"checkpoint_rc": ck, "restore_rc": rs, "keepers_before_restore": before,
       "keepers_after_the_restored_job": after, "keeper_started": r.get("keeper_started"),
       "staged": r.get("staged"), "stage_skipped": r.get("stage_skipped"),
       "staged_buffers_mapped": r.get("staged_buffers_mapped"), "figures": r.get("figures"),
       "before_identical": first == ref[:len(first)],
       "restored_identical": bool(second) and s0 is not None and second == ref[s0:],
       "lines": [len(ref), len(first), len(second)],
       "errors": open(f"{w}/ck.err").read()[-600:] + open(f"{w}/rs.err").read()[-600:],
       "job_err": open(f"{w}/job.err").read()[-1500:]}
json.dump(doc, open(out, "w"), indent=1)
print(json.dumps(doc)[:3000])
ok = (ck == 0 and rs == 0 and before == 0 and after == 0 and doc["keeper_started"]
      and (doc["staged_buffers_mapped"] or 0) > 0 and doc["before_identical"] and doc["restored_identical"])
sys.exit(0 if ok else 1)
PY
    ;;
ab-gpt2)
    # The overhead figure for GPT-2 small again, more processes (the A/B inside each
    # process, hooks on and off in 1 s intervals; saved after every process).
    export LD_LIBRARY_PATH="/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    timeout -k 5 "${AB_TIMEOUT_S:-560}" python3 eval/overhead.py --ab --job gpt2 --pairs 12 \
        --steps 500 --ab-ms 1000 --ab-skip 100 --budget-s "${AB_BUDGET_S:-470}" --out "$res" \
        > "$res/ab-gpt2.log" 2>&1
    tail -3 "$res/ab-gpt2.log"
    ;;
*)
    echo "usage: gpu-stage.sh figures | correctness | threads | run | ab-gpt2" >&2
    exit 2
    ;;
esac
