#!/usr/bin/env bash
# `possum run` (with its default keeper) end to end on the GPU machine, from the build in .gpu/ (see
# gpu-ckpt.sh --stage): an MLP holding 2 GiB started with `possum run` (which by default starts a
# keeper for it), checkpointed with `possum checkpoint --leave-running` (kept: nothing copied
# while held, saved after it runs on); the job must end with the lines of a run without possum,
# and `possum run` must end its keeper with it. Then a second run is checkpointed and killed, and
# restored: its keeper, started by `possum run`, stays after `possum run` ends because it holds
# the killed job's buffers (--keep-on-gpu); `possum restore` finds it (starts none) and the
# restored job maps its buffers from it (zero-copy), writes the reference's lines, and `possum
# status` shows its memory kept; once the restored job ends, the keeper ends too.
# Writes $OUT/keeper-run.json (or .gpu/out/).
# Without a GPU it says SKIPPED and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-start.sh
source scripts/gpu-criu.sh
res="${OUT:-.gpu/out}"; mkdir -p "$res"
W=/dev/shm/possum-keeper-run; rm -rf "$W"; mkdir -p "$W/sockets"
job=(python3 workloads/gpu/jobs.py mlp --steps 600 --hold-gib 2 --sleep-ms 10)
"${job[@]}" --log "$W/ref.log" 2> "$W/ref.err"
setsid .gpu/possum run --socket-dir "$W/sockets" -- "${job[@]}" --log "$W/job.log" 2> "$W/job.err" &
run=$!
for _ in $(seq 600); do [ "$(wc -l < "$W/job.log" 2>/dev/null || echo 0)" -ge 100 ] && break; sleep 0.1; done
pid=$(pgrep -f -n "jobs.py mlp --steps 600 --hold-gib 2 --sleep-ms 10 --log $W/job.log")
keeper=$(pgrep -f -n "possum keeper --dir $W/sockets/keeper-")
.gpu/possum checkpoint "$pid" -D "$W/img" --leave-running --json --socket-dir "$W/sockets" > "$W/ck.json" 2> "$W/ck.err"
ck=$?
wait "$run"; rc=$?
sleep 1
# Then: the same job checkpointed and killed at step 100, and restored: `possum restore` starts a
# keeper where the job looks for one, and the restored job's memory is that keeper's.
# Its stdout to a file: a pipe to this script would be restored by CRIU without its reader.
setsid .gpu/possum run --socket-dir "$W/sockets" -- "${job[@]}" --log "$W/job2.log" > "$W/job2.out" 2> "$W/job2.err" &
run2=$!
for _ in $(seq 600); do [ "$(wc -l < "$W/job2.log" 2>/dev/null || echo 0)" -ge 100 ] && break; sleep 0.1; done
pid2=$(pgrep -f -n "jobs.py mlp --steps 600 --hold-gib 2 --sleep-ms 10 --log $W/job2.log")
keeper2=$(pgrep -f -n "possum keeper --dir $W/sockets/keeper-")
.gpu/possum checkpoint "$pid2" -D "$W/img2" --json --socket-dir "$W/sockets" > "$W/ck2.json" 2> "$W/ck2.err"
ck2=$?
wait "$run2"
sleep 2
cp "$W/job2.log" "$W/job2.log.1"; : > "$W/job2.log"
.gpu/possum restore -D "$W/img2" --json > "$W/rs2.json" 2> "$W/rs2.err"
rs2=$?
sleep 3
.gpu/possum status "$pid2" --socket-dir "$W/sockets" > "$W/status2.txt" 2>&1
for _ in $(seq 600); do [ -e "/proc/$pid2" ] || break; sleep 0.1; done
# The keeper of the second run ends once the restored job is gone (an orphan sweep, then its check).
for _ in $(seq 100); do [ -n "$keeper2" ] && [ -e "/proc/$keeper2" ] || break; sleep 0.1; done
python3 - "$W" "$ck" "$rc" "$keeper" "$res/keeper-run.json" "$ck2" "$rs2" "$keeper2" <<'PY'
import json, os, sys
w, ck, rc, keeper, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
ck2, rs2, keeper2 = int(sys.argv[6]), int(sys.argv[7]), sys.argv[8]
rows = lambda p: [{k: v for k, v in json.loads(l).items() if k != "t"} for l in open(p) if l.strip()]
ref, got = rows(f"{w}/ref.log"), rows(f"{w}/job.log")
cj = json.load(open(f"{w}/ck.json")) if ck == 0 else {}
doc = {"checkpoint_rc": ck, "run_rc": rc, "identical": ref == got, "lines": [len(ref), len(got)],
       "kept": cj.get("kept"), "hold": cj.get("hold"), "figures": cj.get("figures"),
       "keeper_gone_after_job": bool(keeper) and not os.path.exists(f"/proc/{keeper}"),
       "keeper_pid": keeper, "ck_err": open(f"{w}/ck.err").read()[-800:],
       "job_err": open(f"{w}/job.err").read()[-800:]}
# The killed and restored job: its lines before the kill, then the restored run's, against the reference.
first = rows(f"{w}/job2.log.1")
second = rows(f"{w}/job2.log")
s0 = second[0].get("step") if second else None
rs = json.load(open(f"{w}/rs2.json")) if rs2 == 0 else {}
status2 = open(f"{w}/status2.txt").read()
doc["kill_restore"] = {
    "checkpoint_rc": ck2, "restore_rc": rs2, "keeper_started": rs.get("keeper_started"),
    "gpu_from_keeper": rs.get("gpu_from_keeper"),
    "held_for_restore": ((json.load(open(f"{w}/ck2.json")) if ck2 == 0 else {}).get("release_report") or {}).get("held_for_restore"),
    "keeper_gone_after_restored_job": bool(keeper2) and not os.path.exists(f"/proc/{keeper2}"),
    "before_identical": first == ref[:len(first)],
    "restored_identical": bool(second) and s0 is not None and second == ref[s0:],
    "lines": [len(first), len(second)], "restore_figures": rs.get("figures"),
    "status_keeper_line": [l.strip() for l in status2.splitlines() if "keeper" in l],
    "errors": open(f"{w}/ck2.err").read()[-600:] + open(f"{w}/rs2.err").read()[-600:],
    "job_err": open(f"{w}/job2.err").read()[-1200:]}
json.dump(doc, open(out, "w"), indent=1)
kr = doc["kill_restore"]
print(json.dumps({**{k: doc[k] for k in ("checkpoint_rc", "run_rc", "identical", "lines", "kept", "keeper_gone_after_job")}, "kill_restore": kr}))
ok2 = (ck2 == 0 and rs2 == 0 and kr["gpu_from_keeper"] and not kr["keeper_started"]
       and kr["keeper_gone_after_restored_job"] and kr["before_identical"] and kr["restored_identical"])
sys.exit(0 if ck == 0 and rc == 0 and doc["identical"] and doc["keeper_gone_after_job"] and ok2 else 1)
PY
