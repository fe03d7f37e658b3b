#!/usr/bin/env bash
# Process-tree trials on the GPU machine: checkpoint/restore of a training job whose DataLoader has
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
# Two CUDA processes ("a tree with two CUDA processes, one GPU, 10 bit-exact trials"):
#
#   (there) OUT=.gpu/out-tree2 bash scripts/gpu-tree.sh --kinds tree2
#
# runs 10 trials (--trials N) of workloads/gpu/tree2.py, alternating tree2-driver (b2) and
# tree2-possum (c2), 40 steps, 50 ms sleep, one reference run; about 20-30 s a trial.
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
#             (what a container engine runs), no possum command: the plugin takes NVIDIA's
#             driver checkpoint of the CUDA process itself at PAUSE_DEVICES and brings it back at
#             the end of the dump and at the restore (criu-plugin/src/live.rs). Checked as
#             `driver`. N trials.
#   criu-possum  the same, the job under LD_PRELOAD=.gpu/libpossum.so: the plugin runs possum's
#             pre-copy and release first (the GPU image in IMAGES/possum-gpu-PID). N trials.
#   tree2-driver  (b2) workloads/gpu/tree2.py: a parent and the one child it execs, both training on
#             GPU 0, logging to LOG and LOG.child. `possum checkpoint --engine driver --leave-running`
#             (with the plugin) once both logs have k steps: both logs must end bit-identical to a
#             reference run; then, the job over, `possum restore`: both restored processes must
#             write the reference's lines from the step each resumed at. N trials.
#   tree2-possum  (c2) the same, the job under LD_PRELOAD=.gpu/libpossum.so (the child inherits it),
#             `possum checkpoint` with no engine flag. N trials.
#   tree2-criu, tree2-criu-possum  tree2.py by plain criu (as `criu`, `criu-possum`): the plugin
#             checkpoints both CUDA processes, each with possum's sequence when possum is loaded.
#   tree2     both of the above, --trials N in all, alternating (tree2-driver first). Each row has
#             the checkpoint's --json `figures` and `cuda_children`, the image manifest's
#             `cuda_children`, and possum's stderr verbatim when it fails.
#   Trials of the loader kinds alternate persistent and non-persistent workers; every trial is
#   checkpointed at a random step. A trial that would end after --budget-s (default 420) is not started.
# Results: $OUT (or .gpu/out)/tree.jsonl (one row per trial), tree.md, tree-logs.tgz (the jobs'
# stderr and the plugin's lines of CRIU's logs). Without a GPU it says SKIPPED and exits 0.
# GPU_TREE_CPU=1 (CPU self-check of this script, PYTHON=a python with torch): no GPU needed, the
# job runs with --device cpu, kind criu only (there CRIU must dump and restore the tree). With
# --kinds tree2 there: tree2-det (tree2.py run again with no checkpoint: both logs identical to
# the reference run's) and N trials of tree2-criu (plain CRIU dump --leave-running / restore of the
# two-process CPU job, checked as tree2-driver). Nothing of CUDA is checkpointed on a CPU.
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
    source scripts/gpu-criu.sh
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


def start(name, steps, persistent, sleep_ms, possum_loaded, job="loader"):
    log = os.path.join(WORK, f"{name}.log")
    for p in (log, log + ".1", log + ".child", log + ".child.1"):
        if os.path.exists(p):
            os.remove(p)
    env = ckpt.job_env(possum_loaded)
    # A temporary directory of the job's own: multiprocessing keeps there (pymp-*/listener-*) the
    # unix sockets through which DataLoader workers pass shared-memory descriptors, and a restore
    # must find those directories again (see `trial`).
    env["TMPDIR"] = os.path.join(WORK, f"tmp-{name}")
    shutil.rmtree(env["TMPDIR"], ignore_errors=True)
    os.makedirs(env["TMPDIR"])
    cmd = [PY, os.path.join(ROOT, f"workloads/gpu/{job}.py"), "--steps", str(steps), "--log", log,
           "--sleep-ms", str(sleep_ms), "--device", "cpu" if CPU else "cuda"]
    if persistent and job == "loader":
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
    t = time.time()
    r = subprocess.run([CRIU, *args], capture_output=True, text=True, timeout=timeout)
    return {"rc": r.returncode, "wall_ms": round(1e3 * (time.time() - t)),
            "stderr": r.stderr.strip()[-1500:]}


def plain_dump(pid, img):
    """Plain `criu dump --leave-running` of the tree `pid` with the plugin (what a container
    engine runs): the row's `checkpoint` entry."""
    os.makedirs(img, exist_ok=True)
    ck = criu("dump", "-t", str(pid), "-D", img, "--libdir", PLUGINS, "--leave-running",
              "-o", "dump.log", "-v4")
    if ck["rc"] == 0:
        ck["stderr"] = None
    return ck


def plain_restore(img):
    """Plain `criu restore --libdir` (detached) of `img`."""
    return criu("restore", "-D", img, "--libdir", PLUGINS, "-o", "restore.log", "-v4",
                "--restore-detached")


REF = {}


def references(steps, sleep_ms, flags, tree2_steps=None):
    procs = [(pf, *start(f"ref-{'p' if pf else 'np'}", steps, pf, 0, False)) for pf in flags]
    if tree2_steps:
        procs.append(("tree2", *start("ref-tree2", tree2_steps, False, 0, False, job="tree2")))
    for pf, p, log in procs:
        p.wait()
        REF[pf] = ckpt.key(ckpt.read_log(log))
        if pf == "tree2":
            REF["tree2.child"] = ckpt.key(ckpt.read_log(log + ".child"))
            REF["tree2_exit"] = p.returncode


def trial(n, kind, persistent, k, steps, sleep_ms):
    name = f"trial-{n}-{kind}"
    img = os.path.join(WORK, f"img-{n}")
    shutil.rmtree(img, ignore_errors=True)
    ref = REF[persistent]
    t0 = time.time()
    with_possum = kind in ("possum", "criu-possum")
    plain = kind in ("criu", "criu-possum")
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
        row["checkpoint"] = plain_dump(p.pid, img)
        ok_ck = row["checkpoint"]["rc"] == 0
    row["lines_after_dump"] = len(ckpt.read_log(log))
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
        expected_fail = kind == "baseline"
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
    if plain:
        rs = plain_restore(img)
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
    row["resumed_at_step"], row["restored_identical"] = resumed_match(
        second, ref, row["lines_after_dump"] >= len(ref))
    s0 = row["resumed_at_step"]
    row["ok"] = row["leave_running_identical"] and row["restored_identical"] and rs["rc"] == 0
    if not row["ok"]:
        row["err"] = open(os.path.join(WORK, f"{name}.err")).read()[-1500:]
        if second and s0 is not None:
            row["first_diff"] = next(((i, a, b) for i, (a, b) in enumerate(zip(second, ref[s0:])) if a != b), None)
    row["wall_s"] = round(time.time() - t0, 1)
    emit(row)
    shutil.rmtree(img, ignore_errors=True)
    return row


def resumed_match(second, ref, complete_at_dump=False):
    """A restored process's log against the reference: its lines must be the reference's from the
    step it resumed at (its first step line); with no step line (it was past its last step when
    checkpointed) the reference's last lines; with none at all, it must have written its whole
    log before the dump ended (`complete_at_dump`: it was dumped while exiting). Returns
    (resumed step, identical)."""
    s0 = second[0].get("step") if second and "step" in second[0] else None
    if not second:
        return None, complete_at_dump
    if s0 is None:
        return None, second == ref[-len(second):]
    return s0, second == ref[s0:]


def manifest_children(img):
    try:
        with open(os.path.join(img, "possum.json")) as f:
            return json.load(f).get("cuda_children")
    except (OSError, ValueError) as e:
        return f"? ({e})"


def kill_pids(pids):
    """Kills and reaps what is left of a job (a restored process whose parent is gone is
    reparented here, the subreaper)."""
    for pid in pids:
        if ckpt.alive(pid):
            ckpt.kill_job(None, pid)
        else:
            ckpt.wait_gone(pid, 1)


JOB_END_S = 120  # a tree2 job checkpointed at step k ends in seconds; longer: hung, killed


def trial_tree2(n, kind, k, steps, sleep_ms):
    """A trial of workloads/gpu/tree2.py (two CUDA processes): tree2-driver, tree2-possum, or on
    a CPU tree2-criu (plain CRIU) and tree2-det (no checkpoint)."""
    name = f"trial-{n}-{kind}"
    img = os.path.join(WORK, f"img-{n}")
    shutil.rmtree(img, ignore_errors=True)
    refs = {"parent": REF["tree2"], "child": REF["tree2.child"]}
    t0 = time.time()
    with_possum = kind in ("tree2-possum", "tree2-criu-possum")
    plain = kind in ("tree2-criu", "tree2-criu-possum")
    p, log = start(name, steps, False, sleep_ms, with_possum, job="tree2")
    logs = {"parent": log, "child": log + ".child"}
    row = {"trial": n, "kind": kind, "job": "tree2", "persistent": None, "k": k, "steps": steps}
    errf = os.path.join(WORK, f"{name}.err")

    def fail(why):
        kill_pids([p.pid] + children(p.pid))
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        row.update(ok=False, why=why, err=open(errf).read()[-1500:], wall_s=round(time.time() - t0, 1))
        emit(row)
        shutil.rmtree(img, ignore_errors=True)
        return row

    if kind == "tree2-det":
        try:
            p.wait(timeout=300)
        except subprocess.TimeoutExpired:
            return fail("job did not end in 600 s")
        row["job_exit"] = p.returncode
        row["identical"] = {w: ckpt.key(ckpt.read_log(l)) == refs[w] for w, l in logs.items()}
        row["lines"] = {w: len(ckpt.read_log(l)) for w, l in logs.items()}
        row["leave_running_identical"] = all(row["identical"].values())
        row["ok"] = row["leave_running_identical"] and p.returncode == 0 and all(row["lines"].values())
        row["wall_s"] = round(time.time() - t0, 1)
        emit(row)
        return row
    # Both processes past step k (the child starts its steps with the parent's, see tree2.py).
    if not (ckpt.wait_lines(logs["parent"], k, 300, p) and ckpt.wait_lines(logs["child"], k, 300, p)):
        return fail("job did not reach step k in both processes")
    kids = children(p.pid)
    row["child_pids"] = kids
    row["lines_before_checkpoint"] = {w: len(ckpt.read_log(l)) for w, l in logs.items()}
    row["procs_at_checkpoint"] = [device_use(x) for x in [p.pid] + kids]
    os.environ["POSSUM_CRIU_PLUGIN_DIR"] = os.environ["CRIU_LIBS_DIR"] = PLUGINS
    if plain:
        row["checkpoint"] = plain_dump(p.pid, img)
        ok_ck = row["checkpoint"]["rc"] == 0
    else:
        ck = ckpt.checkpoint(p.pid, img, "possum" if with_possum else "driver", leave=True)
        ok_ck = ck["rc"] == 0
        js = ck["json"] or {}
        row["checkpoint"] = {"rc": ck["rc"], "wall_ms": round(ck["wall_ms"]), "figures": js.get("figures"),
                             "cuda_children": js.get("cuda_children"),
                             "possum_children": js.get("possum_children"), "json_error": js.get("error"),
                             "stderr": ck["stderr"] if ck["rc"] else None,
                             "stdout_tail": ck["stdout"][-1500:] if ck["rc"] and not js else None}
        if ok_ck:
            row["manifest_cuda_children"] = manifest_children(img)
    dump_lines = plugin_lines(img, "dump.log")
    save_log_lines(f"{name}.dump", dump_lines)
    row["dump_plugin_lines"] = [l for l in dump_lines if "possum-criu-plugin" in l][:12]
    if not ok_ck:
        row["dump_errors"] = [l for l in dump_lines if "Error" in l or "Can't" in l or "refusing" in l][:8]
    row["lines_after_dump"] = {w: len(ckpt.read_log(l)) for w, l in logs.items()}
    row["procs_after_checkpoint"] = [device_use(x) for x in [p.pid] + kids]
    try:
        p.wait(timeout=JOB_END_S)  # the job's last steps take seconds: a job left stopped is killed
    except subprocess.TimeoutExpired:
        row["left_running_hung"] = True
        p.kill(); p.wait()
    kill_pids(kids)
    row["job_exit"] = p.returncode
    first = {w: ckpt.key(ckpt.read_log(l)) for w, l in logs.items()}
    row["leave_running"] = {w: first[w] == refs[w] for w in logs}
    row["leave_running_identical"] = all(row["leave_running"].values()) and p.returncode == 0
    if not ok_ck:
        for v in ("POSSUM_CRIU_PLUGIN_DIR", "CRIU_LIBS_DIR"):
            os.environ.pop(v, None)
        row.update(ok=False, err=open(errf).read()[-1500:], wall_s=round(time.time() - t0, 1))
        emit(row)
        shutil.rmtree(img, ignore_errors=True)
        return row
    for l in logs.values():
        ckpt.keep_log(l)
    if plain:
        rs = plain_restore(img)
    else:
        rs = ckpt.restore(img)
        js = rs["json"] or {}
        rs = {"rc": rs["rc"], "wall_ms": round(rs["wall_ms"]), "figures": js.get("figures"),
              "json_error": js.get("error"), "stderr": rs["stderr"] if rs["rc"] else None}
    for v in ("POSSUM_CRIU_PLUGIN_DIR", "CRIU_LIBS_DIR"):
        os.environ.pop(v, None)
    row["restore"] = rs
    if rs["rc"] == 0:
        row["procs_after_restore"] = [device_use(x) for x in [p.pid] + kids]
    restore_lines = plugin_lines(img, "restore*.log")
    save_log_lines(f"{name}.restore", restore_lines)
    row["restore_plugin_lines"] = [l for l in restore_lines if "possum-criu-plugin" in l][:6]
    # The restored parent waits for the restored child, then exits (a zombie here, reaped).
    gone = ckpt.wait_gone(p.pid, JOB_END_S) if rs["rc"] == 0 else True
    if not gone:
        row["restored_hung"] = True
    kill_pids([p.pid] + kids)
    second = {w: ckpt.key(ckpt.read_log(l)) for w, l in logs.items()}
    row["resumed_at_step"], row["restored"] = {}, {}
    for w in logs:
        row["resumed_at_step"][w], row["restored"][w] = resumed_match(
            second[w], refs[w], row["lines_after_dump"][w] >= len(refs[w]))
    row["restored_identical"] = all(row["restored"].values())
    row["ok"] = row["leave_running_identical"] and row["restored_identical"] and rs["rc"] == 0 and gone
    if not row["ok"]:
        row["err"] = open(errf).read()[-1500:]
        row["first_diff"] = {}
        for w in logs:
            s0 = row["resumed_at_step"][w] or 0
            row["first_diff"][w] = next(((i, a, b) for i, (a, b) in enumerate(zip(second[w], refs[w][s0:])) if a != b), None)
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
    out = ["# Checkpoint of a DataLoader job with worker processes (scripts/gpu-tree.sh)", "",
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
        workers = "tree2 (2 CUDA procs)" if r.get("job") == "tree2" else ("persistent" if r["persistent"] else "per epoch")
        if r.get("job") == "tree2" and r.get("resumed_at_step"):
            note = (note + " resumed at " + json.dumps(r["resumed_at_step"])).strip()
        if r.get("job") == "tree2" and (r.get("checkpoint") or {}).get("cuda_children") is not None:
            note = (note + " cuda_children " + json.dumps(ck["cuda_children"])).strip()
        out.append(f"| {r['trial']} | {r['kind']} | {workers} | {r['k']} "
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
    ap.add_argument("--tree2-steps", type=int, default=None, help="steps of tree2.py (default 40; 24 on a CPU)")
    ap.add_argument("--tree2-sleep-ms", type=float, default=50)
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
    kinds, counts = [], {}
    for kind in a.kinds.split(","):
        if kind == "tree2":  # --trials in all, alternating
            two = ["tree2-driver", "tree2-possum"]
            if CPU:
                kinds.append("tree2-det"); counts["tree2-det"] = 1
                kinds.append("tree2-criu"); counts["tree2-criu"] = a.trials
                continue
            kinds += two
            counts[two[0]], counts[two[1]] = (a.trials + 1) // 2, a.trials // 2
        else:
            kinds.append(kind)
    TREE2 = ("tree2-driver", "tree2-possum", "tree2-criu", "tree2-criu-possum", "tree2-det")
    bad = [k for k in kinds if k == "tree2-det" and not CPU]
    if bad:
        ap.error(f"{bad}: CPU self-check kinds (GPU_TREE_CPU=1)")
    t2_steps = a.tree2_steps or (24 if CPU else 40)
    rng = random.Random(a.seed)
    plan = []
    for kind in kinds:
        n = counts.get(kind, 1 if kind in ("baseline", "tree2-det") else a.trials)
        plan += [(kind, None if kind in TREE2 else i % 2 == 0, i) for i in range(n)]
    # The one-off kinds first, then the repeated ones round-robin, so that a budget cut leaves
    # some of each.
    once = [x for x in plan if x[0] in ("baseline", "tree2-det")]
    queues = {k: [x for x in plan if x[0] == k and x not in once] for k in kinds}
    order = list(once)
    while any(queues.values()):
        for k in kinds:
            if queues[k]:
                order.append(queues[k].pop(0))
    references(a.steps, a.sleep_ms, sorted({pf for k, pf, _ in order if k not in TREE2}),
               t2_steps if any(k in TREE2 for k, _, _ in order) else None)
    if "tree2" in REF:
        print(json.dumps({"tree2_reference": {"lines": len(REF["tree2"]), "child_lines": len(REF["tree2.child"]),
                                              "exit": REF["tree2_exit"]}}), flush=True)
    rows, skipped, cost = [], 0, None
    for n, (kind, persistent, _) in enumerate(order):
        elapsed = time.time() - t0
        if cost is not None and elapsed + cost > a.budget_s:
            skipped += 1
            continue
        t = time.time()
        if kind in TREE2:
            k = rng.randint(8, t2_steps - 12)
            rows.append(trial_tree2(n, kind, k, t2_steps, a.tree2_sleep_ms))
        else:
            k = rng.randint(8, a.steps - 12)
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
