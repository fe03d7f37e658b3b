#!/usr/bin/env bash
# Faults around NVIDIA's driver lock on the GPU: an MLP holding 2 GiB under
# libpossum.so whose memory a keeper holds; `possum checkpoint` SIGKILLed at delays spread over a
# whole checkpoint (before the hold, while the buffers are detached, inside the driver's lock and
# checkpoint, during CRIU's dump, during the save), both with --leave-running (kept) and without
# (the killed job's buffers held for a restore). After each kill the guard must undo what was
# done: the job runs again (not paused, RUNNING in the driver) and DIR is absent or a complete
# image; a checkpoint that completed before the kill landed (a killed job is restored from it).
# Then the keeper itself is SIGKILLed while a kept checkpoint holds the job (3 times): the
# checkpoint must complete, a new keeper having taken the memory over from `possum checkpoint`'s
# fds. At the end the job must have written exactly the lines of a run without possum.
# From the build in .gpu/ (gpu-ckpt.sh --stage). Writes $OUT/faults.json (or .gpu/out/).
# Without a GPU it says SKIPPED and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L >/dev/null 2>&1 || { echo "SKIPPED: no GPU (nvidia-smi -L failed)"; exit 0; }
source scripts/gpu-criu.sh
res="${OUT:-.gpu/out}"; mkdir -p "$res"
W=/dev/shm/possum-faults; rm -rf "$W"; mkdir -p "$W/sockets"
P=.gpu/possum
# FAULT_MODES (default "leave kill") and FAULT_DELAYS choose the kills of `possum checkpoint`;
# FAULT_KEEPER (default 3) how many times the keeper is killed in a hold; FAULT_STEPS the job's.
modes=${FAULT_MODES-leave kill}
delays=${FAULT_DELAYS:-0.05 0.3 0.6 0.9 1.2 1.5 1.8 2.2 2.8}
keeper_kills=${FAULT_KEEPER:-3}
job=(python3 workloads/gpu/jobs.py mlp --steps "${FAULT_STEPS:-8000}" --hold-gib 2 --sleep-ms 10)
log="$res/faults.log"; : > "$log"
say() { echo "$(date +%T.%N | cut -c1-12) $*" | tee -a "$log"; }
"${job[@]}" --log "$W/ref.log" > /dev/null 2> "$W/ref.err" &
ref=$!
$P keeper --dir "$W/keeper" > "$W/keeper.out" 2> "$W/keeper.err" &
keeper=$!
for _ in $(seq 100); do grep -q ready "$W/keeper.out" 2>/dev/null && break; sleep 0.1; done
POSSUM_KEEPER="$W/keeper" POSSUM_SOCKET_DIR="$W/sockets" LD_PRELOAD="$PWD/.gpu/libpossum.so" setsid \
    "${job[@]}" --log "$W/job.log" > /dev/null 2> "$W/job.err" &
pid=$!
for _ in $(seq 900); do [ "$(wc -l < "$W/job.log" 2>/dev/null || echo 0)" -ge 50 ] && break; sleep 0.1; done
: > "$W/trials.jsonl"
n=0
say "job $pid started"
for mode in $modes; do
    for d in $delays; do
        say "trial $((n + 1)): $mode, possum checkpoint killed after $d s"
        n=$((n + 1)); img="$W/img-$n"
        flags=(--json --socket-dir "$W/sockets"); [ "$mode" = leave ] && flags+=(--leave-running)
        $P checkpoint "$pid" -D "$img" "${flags[@]}" > "$W/ck-$n.json" 2> "$W/ck-$n.err" &
        ck=$!
        sleep "$d"; kill -9 "$ck" 2>/dev/null; wait "$ck" 2>/dev/null; rc=$?
        # The guard undoes in the background: wait until the job runs again (or is gone).
        state=unknown
        for _ in $(seq 300); do
            [ -e "/proc/$pid" ] || { state=gone; break; }
            s=$(timeout 3 $P status "$pid" --json --socket-dir "$W/sockets" 2>/dev/null)
            if [ -n "$s" ] && python3 -c "import json,sys; s=json.loads(sys.argv[1]); p=s.get('possum') or {}; sys.exit(0 if (p.get('session') or {}).get('paused') is False and (p.get('session') or {}).get('busy') is None else 1)" "$s"; then
                state=running; break
            fi
            sleep 0.1
        done
        lines=$(wc -l < "$W/job.log")
        sleep 0.5
        grows=$([ "$(wc -l < "$W/job.log")" -gt "$lines" ] && echo true || echo false)
        complete=false; [ -f "$img/possum.json" ] && complete=true
        exists=false; [ -e "$img" ] && exists=true
        restored=null
        if [ "$state" = gone ]; then
            # Killed by a checkpoint that completed: restore it and go on.
            wait "$pid" 2>/dev/null
            cp "$W/job.log" "$W/job.log.$n"
            $P restore -D "$img" --json > "$W/rs-$n.json" 2> "$W/rs-$n.err" && restored=true || restored=false
            for _ in $(seq 100); do [ "$(wc -l < "$W/job.log")" -gt "$lines" ] && break; sleep 0.1; done
            state=$([ -e "/proc/$pid" ] && echo restored || echo lost)
            grows=$([ "$(wc -l < "$W/job.log")" -gt "$lines" ] && echo true || echo false)
        fi
        echo "{\"n\": $n, \"mode\": \"$mode\", \"kill_after_s\": $d, \"cli_rc\": $rc, \"job\": \"$state\", \"job_runs_on\": $grows, \"image_exists\": $exists, \"image_complete\": $complete, \"restored\": $restored}" | tee -a "$W/trials.jsonl"
        [ "$complete" = true ] || [ "$exists" = false ] || echo "  DIR $img exists and is not complete"
        rm -rf "$img"
    done
done
# The keeper SIGKILLed while a kept checkpoint holds the job (its buffers detached: only the
# keeper had a handle to them): `possum checkpoint` holds fds of that memory, starts a new keeper
# in the same directory and hands it the memory; the job must go on, its steps exact.
for i in $(seq "$keeper_kills"); do
    n=$((n + 1)); img="$W/img-$n"
    say "trial $n: the keeper killed in a kept hold"
    timeout 120 $P checkpoint "$pid" -D "$img" --leave-running --json --socket-dir "$W/sockets" > "$W/ck-$n.json" 2> "$W/ck-$n.err" &
    ck=$!
    for _ in $(seq 400); do
        s=$(timeout 3 $P status "$pid" --json --socket-dir "$W/sockets" 2>/dev/null)
        [ -n "$s" ] && python3 -c "import json,sys; sys.exit(0 if ((json.loads(sys.argv[1]).get('possum') or {}).get('session') or {}).get('paused') else 1)" "$s" && break
        sleep 0.005
    done
    sleep 0.05
    kp=$(pgrep -f -o "possum keeper --dir $W/keeper")
    say "  held; killing keeper $kp"
    kill -9 $kp 2>/dev/null
    # A checkpoint still running after 30 s: what each process waits in, for the log.
    for _ in $(seq 300); do [ -e "/proc/$ck" ] || break; sleep 0.1; done
    if [ -e "/proc/$ck" ]; then
        say "  still running after 30 s:"
        ps -eo pid,ppid,stat,wchan:32,etimes,args | grep -E "possum|jobs.py|criu" | grep -v grep | cut -c1-200 | tee -a "$log"
        for p in $(pgrep -f "possum (checkpoint|keeper)") "$pid"; do
            say "  $p: $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-80)"; cat /proc/$p/task/*/wchan 2>/dev/null | sort | uniq -c | tr '\n' ' ' | tee -a "$log"; echo | tee -a "$log"
        done
    fi
    wait "$ck"; rc=$?
    say "  possum checkpoint: rc $rc; $(tail -c 300 "$W/ck-$n.err" | tr '\n' ' ')"
    lines=$(wc -l < "$W/job.log"); sleep 0.5
    grows=$([ "$(wc -l < "$W/job.log")" -gt "$lines" ] && echo true || echo false)
    revived=$(python3 -c "import json,sys; print(json.dumps((json.load(open(sys.argv[1])).get('keeper_handles')) if sys.argv[2] == '0' else None))" "$W/ck-$n.json" "$rc" 2>/dev/null || echo null)
    complete=false; [ -f "$img/possum.json" ] && complete=true
    echo "{\"n\": $n, \"mode\": \"keeper killed in the hold\", \"killed_keeper\": \"$kp\", \"cli_rc\": $rc, \"job\": \"$([ -e /proc/$pid ] && echo running || echo gone)\", \"job_runs_on\": $grows, \"image_exists\": $([ -e "$img" ] && echo true || echo false), \"image_complete\": $complete, \"keeper_handles\": $revived, \"err\": $(tail -c 400 "$W/ck-$n.err" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read()))')}" | tee -a "$W/trials.jsonl"
    rm -rf "$img"
done
say "waiting for the reference"
wait "$ref"
sleep 3
# Temporary directories of checkpoints that did not complete: the guards remove them.
ls -a "$W" | grep "^\.img-" > "$W/leftovers.txt"
say "waiting for the job's end"
for _ in $(seq 1200); do [ -e "/proc/$pid" ] || break; sleep 0.1; done
say "done"
pkill -f "possum keeper --dir $W/keeper" 2>/dev/null
python3 - "$W" "$res/faults.json" <<'PY'
import json, sys
w, out = sys.argv[1], sys.argv[2]
rows = lambda p: [{k: v for k, v in json.loads(l).items() if k != "t"} for l in open(p) if l.strip()]
ref = rows(f"{w}/ref.log")
trials = [json.loads(l) for l in open(f"{w}/trials.jsonl") if l.strip()]
# The job's steps: its log, after a restore the restored run's lines continue it (steps from the
# image's step on, so a step may appear twice: the later line is the restored run's).
got = {}
import glob, os
for p in sorted(glob.glob(f"{w}/job.log.*"), key=lambda p: int(p.rsplit(".", 1)[1])) + [f"{w}/job.log"]:
    for r in rows(p):
        if "step" in r:
            got[r["step"]] = r
final = [r for r in ref if "step" not in r]
steps_ok = all(got.get(r["step"]) == r for r in ref if "step" in r)
ok = all(t["job"] in ("running", "restored") and t["job_runs_on"] and (t["image_complete"] or not t["image_exists"])
         for t in trials)
# A keeper killed in the hold: the checkpoint completes, a new keeper having taken the memory over.
revived = [t for t in trials if t["mode"] == "keeper killed in the hold"]
ok = ok and all(t["cli_rc"] == 0 and t["image_complete"] and (t.get("keeper_handles") or {}).get("keeper_restarted")
                for t in revived)
leftovers = [l.strip() for l in open(f"{w}/leftovers.txt") if l.strip()]
ok = ok and not leftovers
doc = {"trials": trials, "all_trials_ok": ok, "temp_leftovers": leftovers, "job_steps_identical_to_reference": steps_ok,
       "steps": [len(got), sum(1 for r in ref if "step" in r)],
       "job_err": open(f"{w}/job.err").read()[-1500:]}
json.dump(doc, open(out, "w"), indent=1)
print(json.dumps({k: doc[k] for k in ("all_trials_ok", "job_steps_identical_to_reference", "steps")}))
sys.exit(0 if ok and steps_ok else 1)
PY
