#!/usr/bin/env bash
# Issue 15 trials on the GPU machine: checkpoint/restore of a training job whose DataLoader has
# worker processes (workloads/gpu/loader.py, 2 workers forked from the CUDA process, persistent or
# not), with possum's CRIU plugin (libpossum_criu_plugin.so, criu-plugin/README.md) claiming the
# NVIDIA mappings and descriptors the workers inherited. Builds nothing: the build is staged in
# .gpu/ (possum, libpossum.so, criu-debs, libpossum_criu_plugin.so):
#
#   (here)  bash scripts/gpu-ckpt.sh --stage
#           cargo build --release -p possum-criu-plugin && cp target/release/libpossum_criu_plugin.so .gpu/
#   (there) bash scripts/gpu-tree.sh [--trials N] [--kinds K,K] [--steps N] [--sleep-ms MS]
#                                    [--budget-s S] [--seed N]
#
# Kinds (--kinds, default baseline,driver,possum,criu):
#   baseline  `possum checkpoint --engine driver --leave-running` without the plugin
#             (POSSUM_CRIU_PLUGIN_DIR=""): expected to fail in CRIU on the first worker; the error
#             is recorded. One trial.
#   driver    the same with the plugin (POSSUM_CRIU_PLUGIN_DIR): --leave-running, the job must end
#             bit-identical to a reference run; then `possum restore`, the restored job must
#             write the reference's lines from the checkpointed step on. N trials.
#   possum    the job under LD_PRELOAD=.gpu/libpossum.so, `possum checkpoint` with no engine flag,
#             with the plugin, checked as `driver`. N trials.
#   criu      plain `criu dump -t PID --libdir DIR --leave-running` / `criu restore --libdir DIR`
#             with nothing checkpointing the CUDA process first: the plugin must refuse it, naming
#             the pid and its devices (a live CUDA context). One trial. (Checkpointing a CUDA
#             process from the plugin itself, as a container engine would need, is not done.)
#   Trials alternate persistent and non-persistent workers and are checkpointed at a random
#   step. A trial that would end after --budget-s (default 420) is not started.
# Results: $OUT (or .gpu/out)/tree.jsonl (one row per trial), tree.md, tree-logs.tgz (the jobs'
# stderr and the plugin's lines of CRIU's logs). Without a GPU it says SKIPPED and exits 0.
# GPU_TREE_CPU=1 (CPU self-check of this script, PYTHON=a python with torch): no GPU needed, the
# job runs with --device cpu, kind criu only (there CRIU must dump and restore the tree).
set -uo pipefail
cd "$(dirname "$0")/.."
cpu=${GPU_TREE_CPU:-0}
if [ "$cpu" != 1 ] && ! nvidia-smi -L >/dev/null 2>&1; then
    echo "SKIPPED: no GPU (nvidia-smi -L failed)"
    exit 0
fi
work=${POSSUM_TREE_WORK:-/dev/shm/possum-tree}
rm -rf "$work" && mkdir -p "$work/plugins" "$work/sockets" || exit 1
plugin=${POSSUM_TREE_PLUGIN:-.gpu/libpossum_criu_plugin.so}
[ -f "$plugin" ] || { echo "no $plugin: build it and copy it into .gpu/ (see the top of $0)"; exit 1; }
cp "$plugin" "$work/plugins/libpossum_criu_plugin.so" || exit 1
if [ "$cpu" != 1 ]; then
    export LD_LIBRARY_PATH="/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export PATH="$PATH:/usr/local/cuda/bin"
    # The plugin dlopens libcuda in criu, which may run through another loader: name it.
    if [ -z "${POSSUM_LIBCUDA:-}" ]; then
        for d in ${LD_LIBRARY_PATH//:/ } /usr/lib/x86_64-linux-gnu /usr/lib64; do
            [ -e "$d/libcuda.so.1" ] && { export POSSUM_LIBCUDA="$d/libcuda.so.1"; break; }
        done
    fi
    prefix=/tmp/possum-criu
    [ -x "$prefix/bin/criu" ] || bash scripts/install-criu.sh --from-debs .gpu/criu-debs --prefix "$prefix" > /tmp/install-criu.log 2>&1 \
        || { cat /tmp/install-criu.log; exit 1; }
    export POSSUM_CRIU="$prefix/bin/criu"
fi
export POSSUM_CRIU="${POSSUM_CRIU:-/opt/possum-criu/bin/criu}"
"$POSSUM_CRIU" --version | head -1
res="${OUT:-.gpu/out}"; mkdir -p "$res"; res=$(cd "$res" && pwd)
export TREE_WORK="$work" TREE_OUT="$res" TREE_CPU="$cpu"
"${PYTHON:-python3}" - "$@" <<'PYEOF'
import argparse, glob, json, os, random, re, shutil, signal, subprocess, sys, time

ROOT = os.getcwd()
sys.path.insert(0, os.path.join(ROOT, "eval"))
import ckpt  # noqa: E402  (eval/ckpt.py: possum(), checkpoint(), restore(), keep_log(), read_log(), key(), ...)

WORK = os.environ["TREE_WORK"]
OUT = os.environ["TREE_OUT"]
CPU = os.environ["TREE_CPU"] == "1"
PLUGINS = os.path.join(WORK, "plugins")
CRIU = os.environ["POSSUM_CRIU"]
PY = sys.executable
ckpt.WORK, ckpt.SOCK, ckpt.OUT = WORK, os.path.join(WORK, "sockets"), OUT


def emit(row):
    print(json.dumps(row), flush=True)
    with open(os.path.join(OUT, "tree.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def start(name, steps, persistent, sleep_ms, possum_loaded):
    log = os.path.join(WORK, f"{name}.log")
    for p in (log, log + ".1"):
        if os.path.exists(p):
            os.remove(p)
    env = ckpt.job_env(possum_loaded)
    # A temporary directory of the job's own: multiprocessing keeps there (pymp-*/listener-*) the
    # unix sockets through which DataLoader workers pass shared-memory descriptors, and a restore
    # must find those directories again (see `trial`).
    env["TMPDIR"] = os.path.join(WORK, f"tmp-{name}")
    shutil.rmtree(env["TMPDIR"], ignore_errors=True)
    os.makedirs(env["TMPDIR"])
    cmd = [PY, os.path.join(ROOT, "workloads/gpu/loader.py"), "--steps", str(steps), "--log", log,
           "--sleep-ms", str(sleep_ms), "--device", "cpu" if CPU else "cuda"]
    if persistent:
        cmd.append("--persistent")
    err = open(os.path.join(WORK, f"{name}.err"), "a")
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env,
                         start_new_session=True, cwd=ROOT)
    ckpt.LIVE.add(p.pid)
    return p, log


def children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def device_use(pid):
    """NVIDIA mappings and descriptors of `pid`, and the plugin's placeholders."""
    out = {"pid": pid, "nvidia_maps": 0, "nvidia_fds": 0, "placeholder_maps": 0, "placeholder_fds": 0}
    try:
        for line in open(f"/proc/{pid}/maps"):
            if "/dev/nvidia" in line:
                out["nvidia_maps"] += 1
                if len(out.setdefault("nvidia_map_lines", [])) < 24:
                    f = line.split()
                    out["nvidia_map_lines"].append(f"{f[0]} {f[1]} {f[-1]}")
            if "possum-placeholder" in line:
                out["placeholder_maps"] += 1
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                t = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            out["nvidia_fds"] += t.startswith("/dev/nvidia")
            out["placeholder_fds"] += "possum-placeholder" in t
    except OSError as e:
        out["error"] = str(e)
    return out


def tree_use(pid):
    return [device_use(w) for w in children(pid)]


def plugin_lines(img, name):
    """The plugin's lines and CRIU's errors in the log `name` under `img`."""
    lines = []
    for path in glob.glob(os.path.join(img, "**", name), recursive=True):
        for line in open(path, errors="replace"):
            if "possum-criu-plugin" in line or "Error" in line or "Can't" in line:
                lines.append(line.rstrip()[:400])
    return lines


def save_log_lines(tag, lines):
    with open(os.path.join(WORK, f"{tag}.plugin.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


def criu(*args, timeout=300):
    r = subprocess.run([CRIU, *args], capture_output=True, text=True, timeout=timeout)
    return {"rc": r.returncode, "stderr": r.stderr.strip()[-1500:]}


REF = {}


def references(steps, sleep_ms, flags):
    procs = [(pf, *start(f"ref-{'p' if pf else 'np'}", steps, pf, 0, False)) for pf in flags]
    for pf, p, log in procs:
        p.wait()
        REF[pf] = ckpt.key(ckpt.read_log(log))


def trial(n, kind, persistent, k, steps, sleep_ms):
    name = f"trial-{n}-{kind}"
    img = os.path.join(WORK, f"img-{n}")
    shutil.rmtree(img, ignore_errors=True)
    ref = REF[persistent]
    t0 = time.time()
    with_possum = kind == "possum"
    p, log = start(name, steps, persistent, sleep_ms, with_possum)
    row = {"trial": n, "kind": kind, "persistent": persistent, "k": k, "steps": steps}
    if not ckpt.wait_lines(log, k, 300, p):
        p.kill(); p.wait()
        row.update(ok=False, why="job did not reach step k", err=open(os.path.join(WORK, f"{name}.err")).read()[-1500:])
        emit(row)
        return row
    row["workers_at_checkpoint"] = tree_use(p.pid)
    if kind in ("baseline", "driver", "possum"):
        # possum-criu passes POSSUM_CRIU_PLUGIN_DIR to CRIU as CRIU_LIBS_DIR; CRIU_LIBS_DIR itself
        # too, for a possum built before that (its swrk worker inherits the environment).
        if kind == "baseline":
            os.environ["POSSUM_CRIU_PLUGIN_DIR"] = ""
            os.environ.pop("CRIU_LIBS_DIR", None)
        else:
            os.environ["POSSUM_CRIU_PLUGIN_DIR"] = os.environ["CRIU_LIBS_DIR"] = PLUGINS
        ck = ckpt.checkpoint(p.pid, img, "possum" if with_possum else "driver", leave=True)
        ok_ck = ck["rc"] == 0
        row["checkpoint"] = {"rc": ck["rc"], "wall_ms": round(ck["wall_ms"]),
                             "figures": (ck["json"] or {}).get("figures"),
                             "stderr": ck["stderr"][-1500:] if ck["rc"] else None}
    else:
        os.makedirs(img, exist_ok=True)
        t = time.time()
        ck = criu("dump", "-t", str(p.pid), "-D", img, "--libdir", PLUGINS, "--leave-running",
                  "-o", "dump.log", "-v4")
        ok_ck = ck["rc"] == 0
        row["checkpoint"] = {"rc": ck["rc"], "wall_ms": round(1e3 * (time.time() - t)),
                             "stderr": ck["stderr"] if ck["rc"] else None}
    dump_lines = plugin_lines(img, "dump.log")
    save_log_lines(f"{name}.dump", dump_lines)
    row["dump_plugin_lines"] = [l for l in dump_lines if "possum-criu-plugin" in l][:12]
    if not ok_ck:
        row["dump_errors"] = [l for l in dump_lines if "Error" in l or "Can't" in l or "refusing" in l][:8]
    tmp = os.path.join(WORK, f"tmp-{name}")
    tmp_dirs = sorted(os.listdir(tmp)) if ok_ck else []
    try:
        p.wait(timeout=600)
    except subprocess.TimeoutExpired:
        p.kill(); p.wait()
    first = ckpt.key(ckpt.read_log(log))
    row["leave_running_identical"] = first == ref
    row["job_exit"] = p.returncode
    if not ok_ck:
        expected_fail = kind == "baseline" or (kind == "criu" and not CPU)
        row.update(ok=expected_fail and row["leave_running_identical"] and p.returncode == 0,
                   expected_failure=expected_fail, wall_s=round(time.time() - t0, 1))
        emit(row)
        shutil.rmtree(img, ignore_errors=True)
        return row
    ckpt.keep_log(log)
    # The job, left running, ended and removed its multiprocessing directories; CRIU binds the
    # workers' listening sockets at their paths again, so the directories must exist (as they
    # do after a checkpoint that kills the job: nothing removes them then).
    missing = [d for d in tmp_dirs if not os.path.exists(os.path.join(tmp, d))]
    for d in missing:
        os.makedirs(os.path.join(tmp, d))
    row["recreated_tmp_dirs"] = missing
    if kind == "criu":
        t = time.time()
        rs = criu("restore", "-D", img, "--libdir", PLUGINS, "-o", "restore.log", "-v4", "--restore-detached")
        rs["wall_ms"] = round(1e3 * (time.time() - t))
    else:
        rs = ckpt.restore(img)
        rs = {"rc": rs["rc"], "wall_ms": round(rs["wall_ms"]), "figures": (rs["json"] or {}).get("figures"),
              "stderr": rs["stderr"][-1500:] if rs["rc"] else None}
    for v in ("POSSUM_CRIU_PLUGIN_DIR", "CRIU_LIBS_DIR"):
        os.environ.pop(v, None)
    row["restore"] = rs
    if rs["rc"] == 0:
        row["workers_after_restore"] = tree_use(p.pid)
    restore_lines = plugin_lines(img, "restore*.log")
    save_log_lines(f"{name}.restore", restore_lines)
    row["restore_plugin_lines"] = [l for l in restore_lines if "possum-criu-plugin" in l][:6]
    gone = ckpt.wait_gone(p.pid, 600) if rs["rc"] == 0 else True
    if not gone:
        ckpt.kill_job(None, p.pid)
    second = ckpt.key(ckpt.read_log(log))
    s0 = second[0].get("step") if second and "step" in second[0] else None
    row["resumed_at_step"] = s0
    row["restored_identical"] = bool(second) and s0 is not None and second == ref[s0:]
    row["ok"] = row["leave_running_identical"] and row["restored_identical"] and rs["rc"] == 0
    if not row["ok"]:
        row["err"] = open(os.path.join(WORK, f"{name}.err")).read()[-1500:]
        if second and s0 is not None:
            row["first_diff"] = next(((i, a, b) for i, (a, b) in enumerate(zip(second, ref[s0:])) if a != b), None)
    row["wall_s"] = round(time.time() - t0, 1)
    emit(row)
    shutil.rmtree(img, ignore_errors=True)
    return row


def env_info():
    info = {"cpu_self_check": CPU, "python": sys.version.split()[0]}
    for what, cmd in (("criu", [CRIU, "--version"]), ("driver", ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]),
                      ("glibc", ["getconf", "GNU_LIBC_VERSION"]), ("kernel", ["uname", "-r"])):
        try:
            info[what] = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
        except Exception as e:  # noqa: BLE001
            info[what] = f"? ({e})"
    try:
        import torch
        info["torch"] = torch.__version__
    except Exception:  # noqa: BLE001
        pass
    info["POSSUM_LIBCUDA"] = os.environ.get("POSSUM_LIBCUDA")
    return info


def markdown(rows, info, wall_s, skipped):
    out = ["# Issue 15: checkpoint of a DataLoader job with worker processes (scripts/gpu-tree.sh)", "",
           f"Environment: {json.dumps(info)}", "",
           f"Wall time {wall_s:.0f} s; trials not started for the budget: {skipped}.", "",
           "| trial | kind | workers | k | checkpoint | restore | leave-running identical | restored identical | ok | note |",
           "| ---: | --- | --- | ---: | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ck = r.get("checkpoint") or {}
        rs = r.get("restore") or {}
        note = ""
        if r.get("expected_failure"):
            errs = [l for l in (r.get("dump_errors") or []) if "RLIMIT_NOFILE" not in l]
            errs = errs or [l for l in (ck.get("stderr") or "").splitlines() if "Error" in l]
            note = "expected failure: " + "; ".join(errs[:2])[:400]
        elif not r.get("ok"):
            note = (r.get("why") or (ck.get("stderr") or rs.get("stderr") or r.get("err") or ""))[-300:]
        note = note.replace("|", "/").replace("\n", " ")
        out.append(f"| {r['trial']} | {r['kind']} | {'persistent' if r['persistent'] else 'per epoch'} | {r['k']} "
                   f"| rc {ck.get('rc')} ({ck.get('wall_ms')} ms) | {('rc %s (%s ms)' % (rs.get('rc'), rs.get('wall_ms'))) if rs else '-'} "
                   f"| {r.get('leave_running_identical')} | {r.get('restored_identical', '-')} | {r.get('ok')} | {note} |")
    by = {}
    for r in rows:
        b = by.setdefault(r["kind"], [0, 0])
        b[0] += 1
        b[1] += bool(r.get("ok"))
    out += ["", "Per kind (ok / trials): " + ", ".join(f"{k} {v[1]}/{v[0]}" for k, v in by.items()), ""]
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=10, help="trials of each of the kinds driver and possum")
    ap.add_argument("--kinds", default="criu" if CPU else "baseline,driver,possum,criu")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--sleep-ms", type=float, default=40)
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument("--seed", type=int, default=15)
    a = ap.parse_args()
    ckpt.become_subreaper()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    import atexit
    atexit.register(ckpt.kill_live)
    t0 = time.time()
    info = env_info()
    print(json.dumps({"env": info}), flush=True)
    kinds = a.kinds.split(",")
    rng = random.Random(a.seed)
    plan = []
    for kind in kinds:
        n = 1 if kind in ("baseline",) or (kind == "criu" and not CPU) else a.trials
        plan += [(kind, i % 2 == 0) for i in range(n)]
    # The one-off kinds first, then the repeated ones round-robin, so that a budget cut leaves
    # some of each.
    once = [x for x in plan if x[0] == "baseline" or (x[0] == "criu" and not CPU)]
    queues = {k: [x for x in plan if x[0] == k and x not in once] for k in kinds}
    order = list(once)
    while any(queues.values()):
        for k in kinds:
            if queues[k]:
                order.append(queues[k].pop(0))
    references(a.steps, a.sleep_ms, sorted({pf for _, pf in order}))
    rows, skipped, cost = [], 0, None
    for n, (kind, persistent) in enumerate(order):
        elapsed = time.time() - t0
        if cost is not None and elapsed + cost > a.budget_s:
            skipped += 1
            continue
        k = rng.randint(8, a.steps - 12)
        t = time.time()
        rows.append(trial(n, kind, persistent, k, a.steps, a.sleep_ms))
        cost = max(cost or 0, time.time() - t)
        with open(os.path.join(OUT, "tree.md"), "w") as f:
            f.write(markdown(rows, info, time.time() - t0, skipped))
    with open(os.path.join(OUT, "tree.md"), "w") as f:
        f.write(markdown(rows, info, time.time() - t0, skipped))
    print(json.dumps({"summary": {k: [sum(1 for r in rows if r["kind"] == k and r.get("ok")), sum(1 for r in rows if r["kind"] == k)] for k in kinds},
                      "skipped": skipped, "wall_s": round(time.time() - t0)}), flush=True)
    return 0 if rows and all(r.get("ok") for r in rows) else 1


sys.exit(main())
PYEOF
rc=$?
(cd "$work" && ls *.err *.log *.log.1 *.plugin.txt 2>/dev/null | tar czf "$res/tree-logs.tgz" -T - 2>/dev/null) || true
exit $rc
