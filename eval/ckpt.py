"""Checkpoint/restore of live GPU jobs on the GPU machine: correctness and figures.

    python3 eval/ckpt.py smoke|correctness|figures|errors|bench|probe|migrate [--out DIR] [options]

Runs from the repo root with the build in .gpu/ (possum, libpossum.so) and CRIU on $POSSUM_CRIU
(scripts/gpu-ckpt.sh sets everything up). Every job is a workloads/gpu job writing one line per
step to a log (step, loss bits, wall time); a reference run without possum gives the expected
lines.

Jobs: the workloads of workloads/gpu/jobs.py, `ptrtable` and `lcuda` (CUDA C, built by
gpu-ckpt.sh), and a torch workload with an allocator setting: `JOB+expandable`
(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) or `JOB+async` (backend:cudaMallocAsync), or
`JOB+vmm` / `JOB+pools` (expandable segments / cudaMallocAsync served by possum, its default, said
explicitly), or `JOB+expandable-driver` / `JOB+async-driver` (that memory left to the driver).

Engines (variants; `ENGINE_HELP`): `possum` (the job under libpossum.so with its default hooks,
the driver's entry points, and `possum checkpoint` with no engine flag), `possum-hold` (the job
with POSSUM_HOOKS=off: the checkpoint parks its threads and copies every buffer while held),
`driver` (no possum in the job, `--engine driver`), `gpu-only` (`--gpu-only`); a `-cupti` suffix
runs the job with POSSUM_HOOKS=cupti (CUPTI from CKPT_JOB_CUPTI or the torch venv's; NVIDIA's
driver refuses such a job), a `-frozen` suffix makes the extra state only read
(`--ballast-frozen`). `none`/`possum-none`: no checkpoint (steady state, cold start).

- correctness: per trial, a job runs under possum; at step k it is checkpointed with
  --leave-running and must end with the reference's lines; then the image is restored (the job
  resumes at the checkpointed step) and must write the reference's lines from there on.
  `--budget-s` stops starting trials when the next would not fit; the engines' trials take
  turns, so that each keeps about as many. OUT/ckpt-correctness.jsonl and OUT/correctness.md.
- figures: the stall (parts: engine, driver, CRIU), restore to the first step and time until
  every buffer is back, per engine and size: the bench below with FIGURES_PLAN x
  FIGURES_ENGINES by default; OUT/figures.json and OUT/figures.md, saved after every run.
- errors: the error cases of `possum checkpoint`/`restore`: each must fail with a clear message,
  leave the job running and leave no image.
- repeat: `--repeat N` (50) checkpoints with --leave-running of one MLP holding --gib (first value)
  under the first of --engines (default possum-keeper): the GPU memory of the job and of the
  keeper after each (nvidia-smi), to see that nothing grows. OUT/ckpt-repeat.jsonl.
- probe: which variants of a possum'd job NVIDIA's driver checkpoint accepts (hooks entry/off,
  CUPTI subscribed with none/one/all callbacks, unsubscribed or finalized before the lock).
- bench: the figures over a plan of (workload, GiB) cells x engines x reps as one document,
  OUT/bench.json (`--engines driver,possum --reps 2`, plan DEFAULT_PLAN; `--bench-plan
  full --shard K/3` for a third of the whole matrix; `none`/`possum-none` are runs without any
  checkpoint, without/with possum loaded). A cell's reps are one job lineage: checkpoint with
  --leave-running, kill, restore, go on with the restored process (`chain`), so a rep costs no
  fresh start. With the step-time timeline around each checkpoint, the steady-state step time,
  the time from a fresh start to the first step, and possum's restore figures; eval/report.py
  turns it into the table, the plots and the results files (eval/results/).
Results: one JSON line per trial or figure in OUT/ckpt-<mode>.jsonl, printed as it goes.
"""
import argparse, atexit, concurrent.futures, glob, json, os, random, shutil, signal, socket, statistics, subprocess, sys, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from services import Receiver, memory_of, new_key, release_digest  # noqa: E402  (a migration trial's receiving end)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = os.path.join(ROOT, ".gpu")
# POSSUM: another build of the possum executable (as services.py's; an A/B of two builds).
POSSUM = os.environ.get("POSSUM") or os.path.join(GPU, "possum")
# CKPT_LIBPOSSUM: another build of libpossum.so for the jobs (an A/B of two builds in one run).
# CKPT_CRIU_LOGS=DIR: a migration trial's CRIU logs (the source's dump, the destination's
# restore) kept in DIR/<trial's name>/ before its directory goes (with POSSUM_CRIU_LOG_LEVEL=4,
# CRIU's own timeline of its steps).
SO = os.environ.get("CKPT_LIBPOSSUM") or os.path.join(GPU, "libpossum.so")
WORK = os.environ.get("POSSUM_CKPT_WORK", "/dev/shm/possum-ckpt")
SOCK = os.path.join(WORK, "sockets")
OUT = None


EMIT_LOCK = threading.Lock()


def emit(kind, row):
    row = {"kind": kind, **row}
    with EMIT_LOCK:
        print(json.dumps(row), flush=True)
        with open(os.path.join(OUT, f"ckpt-{kind}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pid, timeout):
    t = time.time()
    while alive(pid) and time.time() - t < timeout:
        time.sleep(0.02)
    gone = not alive(pid)
    if gone:
        # Reaped here if it is a child (a restored job, this process being a subreaper).
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
    return gone


# PYTORCH_CUDA_ALLOC_CONF of a job spec's allocator suffix (`mlp+expandable`).
ALLOC_CONF = {"expandable": "expandable_segments:True", "async": "backend:cudaMallocAsync"}
# Suffixes with more than an allocator setting. libpossum serves both allocators by default
# (interposer/src/memory/vmm.rs, pools.rs), so `+expandable` and `+async` are served; `JOB+vmm` and
# `JOB+pools` say so explicitly (POSSUM_SERVE_VMM=1 / POSSUM_SERVE_POOLS=1), and
# `JOB+expandable-driver` / `JOB+async-driver` leave that memory to the driver (=0), whose
# checkpoint then copies it: the comparison.
ALLOC_ENV = {"vmm": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "POSSUM_SERVE_VMM": "1"},
             "pools": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync", "POSSUM_SERVE_POOLS": "1"},
             "expandable-driver": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "POSSUM_SERVE_VMM": "0"},
             "async-driver": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync", "POSSUM_SERVE_POOLS": "0"}}
# Jobs that are programs built by scripts/gpu-ckpt.sh into WORK (argv: steps, log, sleep ms).
C_JOBS = ("ptrtable", "lcuda")
CUPTI = "/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcupti.so.13"


def job_spec(spec):
    """`JOB` or `JOB+ALLOC` -> (job, environment additions): ALLOC is a key of ALLOC_CONF or a
    PYTORCH_CUDA_ALLOC_CONF value itself."""
    job, _, alloc = spec.partition("+")
    if not alloc:
        return job, {}
    if job in C_JOBS:
        raise ValueError(f"{spec}: an allocator setting is for torch jobs")
    if alloc in ALLOC_ENV:
        return job, dict(ALLOC_ENV[alloc])
    return job, {"PYTORCH_CUDA_ALLOC_CONF": ALLOC_CONF.get(alloc, alloc)}


ENGINE_BASES = ("possum", "possum-keeper", "possum-hold", "driver", "gpu-only", "none", "possum-none")
ENGINE_HELP = ("possum (default hooks, `possum checkpoint` without an engine flag), possum-keeper "
               "(the same, the job's buffer memory kept by a keeper: `possum run`'s default), possum-hold "
               "(POSSUM_HOOKS=off), driver, gpu-only; suffix -cupti (job with POSSUM_HOOKS=cupti), "
               "-kill (checkpoint and kill, not --leave-running; -kill-disk: --keep-on-gpu 0, so the "
               "restore reads the image even with a keeper, which loads it while CRIU restores the job; "
               "-kill-disk-nostage: POSSUM_RESTORE_STAGE=0, the restored job copies it), -frozen "
               "(extra state only read), -spec (read-only speculation on: POSSUM_VALIDATE=readonly_after=2), "
               "-noshadow (--shadow-budget 0: a kept save copies every buffer on write, none first), "
               "-migrate (`possum migrate` to a `possum receive` on this host, over loopback, instead "
               "of a checkpoint and a restore: the job's whole log must be the reference's; "
               "-migrate-postcopy: with --post-copy); none, "
               "possum-none (no checkpoint)")


def variant(name):
    """What an engine name means: {name, base, ckpt: the `possum checkpoint` engine (possum,
    driver, gpu-only, or None for no checkpoint), possum: libpossum.so in the job, env: the job's
    possum variables, frozen}."""
    # The suffixes, taken off the end in this order (`possum-cupti-kill-frozen-noshadow`).
    rest, flags = name, {}
    for suffix in ("postcopy", "noshadow", "spec", "nostage", "frozen", "disk", "kill", "migrate", "cupti"):
        flags[suffix] = rest.endswith("-" + suffix)
        if flags[suffix]:
            rest = rest[: -len(suffix) - 1]
    noshadow, spec, nostage = flags["noshadow"], flags["spec"], flags["nostage"]
    frozen, disk, kill, cupti = flags["frozen"], flags["disk"], flags["kill"], flags["cupti"]
    migrate, postcopy = flags["migrate"], flags["postcopy"]
    if postcopy and not migrate:
        raise ValueError(f"engine {name!r}: -postcopy goes with -migrate (possum migrate --post-copy)")
    if rest not in ENGINE_BASES:
        raise ValueError(f"engine {name!r}: not one of {ENGINE_HELP}")
    if cupti and rest in ("driver", "none", "possum-hold"):
        raise ValueError(f"engine {name!r}: -cupti needs possum in the job with its hooks on")
    env = {}
    if rest == "possum-hold":
        env["POSSUM_HOOKS"] = "off"
    if rest == "possum-keeper":
        env["POSSUM_KEEPER"] = KEEPER_DIR
    if spec:
        # Read-only speculation on: a kernel's slot seen unwritten twice is taken as read-only,
        # each such verdict proven by comparing whole buffers.
        env["POSSUM_VALIDATE"] = "readonly_after=2"
    if cupti:
        env["POSSUM_HOOKS"] = "cupti"
        env["POSSUM_CUPTI"] = os.environ.get("CKPT_JOB_CUPTI") or CUPTI
    ckpt = {"possum": "possum", "possum-keeper": "possum", "possum-hold": "possum", "driver": "driver", "gpu-only": "gpu-only"}.get(rest)
    if disk and not kill:
        raise ValueError(f"engine {name!r}: -disk goes with -kill (what a killed job's keeper keeps)")
    if nostage and not disk:
        raise ValueError(f"engine {name!r}: -nostage goes with -kill-disk (a restore from the image)")
    if (noshadow or spec) and ckpt != "possum":
        raise ValueError(f"engine {name!r}: -spec and -noshadow are for possum's own engine")
    if migrate and (ckpt != "possum" or kill):
        raise ValueError(f"engine {name!r}: -migrate is possum's own engine, not with -kill")
    return {"name": name, "base": rest, "ckpt": ckpt, "possum": rest not in ("driver", "none"),
            "env": env, "frozen": frozen, "kill": kill, "disk": disk, "nostage": nostage,
            "noshadow": noshadow, "migrate": migrate, "postcopy": postcopy}


KEEPER_DIR = os.path.join(WORK, "keeper")
KEEPER = []


def keeper_stats(sock):
    """The `stats` of the keeper socket `sock` (its protocol: a greeting line, then one JSON line
    per request); None if it does not answer."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(sock)
            f = s.makefile("rwb")
            f.readline()
            f.write(b'{"cmd":"stats"}\n')
            f.flush()
            return json.loads(f.readline())
    except (OSError, ValueError):
        return None


def stage_ended(pid):
    """The run's keeper's last ended stage of process `pid` (any device's socket), with its load's
    GB/s: how long the keeper took to load (or copy GPU to GPU) a restore's buffers."""
    for sock in sorted(glob.glob(os.path.join(KEEPER_DIR, "keeper-*.sock"))):
        st = keeper_stats(sock) or {}
        for s in reversed(st.get("stages_ended") or []):
            if s.get("pid") == pid:
                done = s.get("done_ms")
                return {**s, "socket": os.path.basename(sock),
                        "gb_per_s": s["loaded_bytes"] / done / 1e6 if done else None}
    return None


def ensure_keeper():
    """One keeper for the whole run (`possum keeper --dir`, what `possum run` starts per
    job), serving every job of a possum-keeper variant; ended at exit."""
    if KEEPER and KEEPER[0].poll() is None:
        return
    shutil.rmtree(KEEPER_DIR, ignore_errors=True)
    err_path = os.path.join(WORK, "keeper.err")
    KEEPER_ERR_AT[0] = os.path.getsize(err_path) if os.path.exists(err_path) else 0
    SPARES_TAKEN[0] = 0
    k = subprocess.Popen([POSSUM, "keeper", "--dir", KEEPER_DIR], stdout=subprocess.PIPE,
                         stderr=open(os.path.join(WORK, "keeper.err"), "a"), text=True,
                         start_new_session=True)
    line = k.stdout.readline().strip()
    if line != "ready":
        raise RuntimeError(f"the keeper did not start: {open(os.path.join(WORK, 'keeper.err')).read()[-800:]}")
    KEEPER[:] = [k]
    atexit.register(lambda: (k.kill(), k.wait()))
    # A keeper with spare image memory (POSSUM_KEEPER_SPARE_DIR/_MIB) makes it
    # in the background: the first checkpoint waits for it (up to 180 s).
    if os.environ.get("POSSUM_KEEPER_SPARE_DIR"):
        t = time.time()
        while time.time() - t < 180 and "spare image memory" not in keeper_said():
            time.sleep(0.2)
        print(f"keeper: {[l for l in keeper_said().splitlines() if 'spare' in l][-1:]}", flush=True)


def job_env(possum_loaded, extra=None):
    """The job's environment: this process's, without the variables that choose possum's hooks
    or the allocator (a variant sets them), plus `extra`; libpossum.so preloaded if asked."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("POSSUM_HOOKS", "POSSUM_CUPTI", "PYTORCH_CUDA_ALLOC_CONF", "POSSUM_SERVE_VMM",
                        "POSSUM_SERVE_POOLS", "LD_PRELOAD")}
    if possum_loaded:
        env["LD_PRELOAD"] = SO
        env["POSSUM_SOCKET_DIR"] = SOCK
    env.update(extra or {})
    if possum_loaded and os.environ.get("CKPT_JOB_ENV"):
        # Extra possum variables for every job under possum ("K=V,K=V"), for tuning runs.
        env.update(kv.split("=", 1) for kv in os.environ["CKPT_JOB_ENV"].split(",") if "=" in kv)
    return env


def job_cmd(job, steps, log, hold=0.0, sleep_ms=0.0):
    if job in C_JOBS:
        return [os.path.join(WORK, job), str(steps), log, str(int(sleep_ms))]
    return ["python3", os.path.join(ROOT, "workloads/gpu/jobs.py"), job, "--steps", str(steps),
            "--log", log, "--hold-gib", str(hold), "--sleep-ms", str(sleep_ms)]


def start(name, spec, steps, possum, hold=0.0, sleep_ms=0.0, frozen=False, env=None):
    """Starts job `spec` (`JOB` or `JOB+ALLOC`) logging to WORK/NAME.log, under libpossum.so if
    `possum` with the variant's variables `env` (none: the default hooks, what `possum run`
    gives a job)."""
    log = os.path.join(WORK, f"{name}.log")
    for p in (log, log + ".1"):
        if os.path.exists(p):
            os.remove(p)
    job, alloc = job_spec(spec)
    e = job_env(possum, {**alloc, **((env or {}) if possum else {})})
    if "POSSUM_KEEPER" in e:
        ensure_keeper()
    err = open(os.path.join(WORK, f"{name}.err"), "a")
    cmd = job_cmd(job, steps, log, hold, sleep_ms) + (["--ballast-frozen"] if frozen else [])
    if job not in C_JOBS and os.environ.get("CKPT_BALLAST_READ_ALL") == "1":
        # Every step reads all the extra state, as inference reads its weights: a restored job's
        # first step needs every byte (the serverless cold start).
        cmd += ["--ballast-read-all"]
    if job not in C_JOBS and os.environ.get("CKPT_HOST_BATCH_MIB"):
        # Every step copies a batch from pinned host memory (`jobs.py --host-batch-mib`).
        cmd += ["--host-batch-mib", os.environ["CKPT_HOST_BATCH_MIB"]]
    if job not in C_JOBS and os.environ.get("CKPT_STATE_MIB"):
        # A state of this many MiB written whole every step (`jobs.py --state-mib`): a training
        # job whose every round and cut copies it again.
        cmd += ["--state-mib", os.environ["CKPT_STATE_MIB"]]
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=err, env=e, start_new_session=True,
                         cwd=ROOT)
    LIVE.add(p.pid)
    return p, log


def read_log(log):
    rows = []
    if os.path.exists(log):
        with open(log) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    rows.append({"garbage": line})
    return rows


def key(rows):
    """What must match bit for bit: steps and loss bits, and the final digests."""
    return [{k: v for k, v in r.items() if k != "t"} for r in rows]


def wait_lines(log, n, timeout, proc=None, pid=None):
    """Waits for `n` step lines in `log`; False early if the job is over: `proc` (a Popen) has
    exited, or, for a restored job (no longer our child), `pid` is gone."""
    t = time.time()
    while time.time() - t < timeout:
        if sum(1 for r in read_log(log) if "step" in r) >= n:
            return True
        if proc is not None and proc.poll() is not None:
            return False
        if proc is None and pid is not None and not alive(pid):
            return False
        time.sleep(0.01)
    return False


def possum(*args, timeout=int(os.environ.get("CKPT_TIMEOUT", "900")), env=None):
    t = time.time()
    r = subprocess.run([POSSUM, *args], capture_output=True, text=True, timeout=timeout,
                       env=None if env is None else {**os.environ, **env})
    out = None
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            try:
                out = json.loads(line)
            except ValueError:
                pass
    # stdout whole: `possum status --json` is one large (pretty-printed) document.
    return {"rc": r.returncode, "json": out, "stderr": r.stderr.strip()[-2000:],
            "stdout": r.stdout, "wall_ms": 1e3 * (time.time() - t)}


def ckpt_flags(engine):
    """`possum checkpoint`'s engine flags: none for possum (its default: what a user types),
    --engine driver, or --gpu-only (possum's GPU side alone on a live job: saved, released, back
    on demand)."""
    return {"possum": [], "driver": ["--engine", "driver"], "gpu-only": ["--gpu-only"]}[engine]


SPARES_TAKEN = [0]
# Where this run's keeper began writing its stderr (keeper.err is appended to).
KEEPER_ERR_AT = [0]


def keeper_said():
    """What this run's keeper wrote on its stderr so far."""
    with open(os.path.join(WORK, "keeper.err")) as f:
        f.seek(KEEPER_ERR_AT[0])
        return f.read()


def saved_reports(cj):
    """Each device's save report in a kept checkpoint's `possum checkpoint --json` (`cj`)."""
    return [((x.get("report") or {}).get("saved") or [{}])[0] for x in (cj or {}).get("saved_report") or []]


def wait_spare():
    """With a keeper making spare image memory: waits (up to 120 s) until it has made one more
    than the drains took, so that each kept checkpoint of a run finds one, as checkpoints minutes
    apart would. The seconds waited."""
    if not (KEEPER and os.environ.get("POSSUM_KEEPER_SPARE_DIR")):
        return 0.0
    t = time.time()
    while time.time() - t < 120 and keeper_said().count("spare image memory ready") <= SPARES_TAKEN[0]:
        time.sleep(0.1)
    return time.time() - t


def checkpoint(pid, img, engine, leave=True, extra=()):
    """`possum checkpoint` of `pid` into `img`; `engine`: possum, driver or gpu-only."""
    args = ["checkpoint", str(pid), "-D", img, "--json", "--socket-dir", SOCK]
    args += ckpt_flags(engine)
    if leave:
        args.append("--leave-running")
    wait_spare()
    r = possum(*args, *extra)
    if any(x.get("shadows_saved_by_keeper") for x in saved_reports(r.get("json"))):
        SPARES_TAKEN[0] += 1
    return r


def keep_log(log):
    """Before a restore: the first run's lines to LOG.1, LOG emptied for the restored run's. The
    file stays in place (CRIU restores the job's descriptor of it if the job had it open; O_APPEND,
    so it writes at the end), which a rename would break."""
    shutil.copy(log, log + ".1")
    open(log, "w").close()


def restore(img, extra=(), v=None):
    """`possum restore` of IMG (the job's log kept in place first: `keep_log`); for variant `v`
    -nostage, without the keeper's staging. CKPT_RESTORE_DEVICE=N: onto GPU N (`--device`), for
    figures of a move to another GPU. CKPT_DROP_CACHES=1: the page cache dropped first (a
    restore from an image on disk reads the disk, not what the checkpoint left cached)."""
    env = {"POSSUM_RESTORE_STAGE": "0"} if v and v.get("nostage") else None
    dev = os.environ.get("CKPT_RESTORE_DEVICE")
    if dev and "--device" not in extra:
        extra = (*extra, "--device", dev)
    if os.environ.get("CKPT_DROP_CACHES") == "1":
        subprocess.run(["sync"], check=False)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    if "--socket-dir" not in extra:
        # The jobs' sockets are in SOCK (job_env): possum's socket directory for this restore.
        extra = (*extra, "--socket-dir", SOCK)
    return possum("restore", "-D", img, "--json", *extra, env=env)


REF = {}


def references(specs):
    """Reference runs (no possum) of every (spec, steps) not yet known, all at once: they are
    independent processes, and a fresh start costs 5-15 s each."""
    todo = [(spec, steps) for spec, steps in dict.fromkeys(specs) if (spec, steps) not in REF]
    procs = [(k, *start(f"ref-{k[0]}", k[0], k[1], possum=False)) for k in todo]
    for k, p, log in procs:
        p.wait()
        REF[k] = key(read_log(log))


def reference(spec, steps):
    references([(spec, steps)])
    return REF[(spec, steps)]


def status_summary(st):
    """What a checkpoint row keeps of the job's `possum status`: how possum sees it and what it
    does not manage."""
    if not st:
        return None
    p = st.get("possum") or {}
    c = p.get("counters") or {}
    ss = p.get("session") or {}
    return {"hooks": st.get("hooks"), "hooks_live": ss.get("hooks_live"), "cupti_attached": ss.get("cupti_attached"),
            "total_launches": st.get("total_launches"), "launches": c.get("launches"),
            "managed_allocs": c.get("managed_allocs"), "launches_opaque": c.get("launches_opaque"),
            "opaque_ops": c.get("opaque_ops"),
            "unmanaged": (p.get("unmanaged") or {}).get("by_kind"),
            "entry_unmatched": len((st.get("entry") or {}).get("unmatched") or [])}


def trial(spec, engine, k, steps, sleep_ms, n):
    """One checkpoint at step k (--leave-running), the run to its end, then a restore. `engine`:
    a variant name (see `variant`)."""
    v = variant(engine)
    ref = reference(spec, steps)
    name = f"trial-{n}"
    img = os.path.join(WORK, f"img-{n}")
    shutil.rmtree(img, ignore_errors=True)
    t_trial = time.time()
    p, log = start(name, spec, steps, possum=v["possum"], sleep_ms=sleep_ms, env=v["env"])
    row = {"trial": n, "job": spec, "engine": engine, "k": k, "steps": steps}
    if not wait_lines(log, k, 300, p):
        p.kill()
        p.wait()
        row.update(ok=False, why="job did not reach step k",
                   err=open(os.path.join(WORK, f"{name}.err")).read()[-1500:])
        emit("correctness", row)
        return False
    if v["possum"]:
        row["status"] = status_summary(job_status(p.pid))
    if v["migrate"]:
        return migrate_trial(p, log, ref, row, name, t_trial, v)
    shadow = ["--shadow-budget", "0"] if v["noshadow"] else []
    if v["kill"]:
        # Checkpoint and kill: nothing runs on; only the restored run is compared.
        ck = checkpoint(p.pid, img, v["ckpt"], leave=False,
                        extra=(["--keep-on-gpu", "0"] if v["disk"] else []) + shadow)
    else:
        ck = checkpoint(p.pid, img, v["ckpt"], leave=True, extra=shadow)
    at = sum(1 for r in read_log(log) if "step" in r)
    cj = ck["json"] or {}
    row["checkpoint"] = {"rc": ck["rc"], "hooks": cj.get("hooks"), "hold": cj.get("hold"),
                         "kept": cj.get("kept"), "figures": cj.get("figures"),
                         "mismatch_retries": cj.get("mismatch_retries"),
                         "held_for_restore": (cj.get("release_report") or {}).get("held_for_restore"),
                         "shadows_saved_by_keeper": sum(x.get("shadows_saved_by_keeper") or 0
                                                        for x in saved_reports(cj)),
                         "stderr": ck["stderr"] if ck["rc"] else None}
    try:
        # A failed checkpoint may leave the job paused (its buffers released and not back): 30 s
        # to go on, not the run's 600.
        p.wait(timeout=600 if ck["rc"] == 0 else 30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    first = key(read_log(log))
    # A killed job's log is a prefix of the reference's (its steps up to the checkpoint).
    row["leave_running_identical"] = first == ref[:len(first)] if v["kill"] else first == ref
    row["job_exit"] = p.returncode
    if ck["rc"] != 0:
        row.update(ok=False, why="checkpoint failed", wall_s=time.time() - t_trial)
        emit("correctness", row)
        return False
    if v["ckpt"] == "gpu-only":
        # No process image: the check is that the job, its buffers released and brought back
        # on demand mid-run, ends exactly as the reference.
        row["ok"] = row["leave_running_identical"] and p.returncode == 0
        if not row["ok"]:
            row["err"] = open(os.path.join(WORK, f"{name}.err")).read()[-1500:]
        row["wall_s"] = time.time() - t_trial
        emit("correctness", row)
        shutil.rmtree(img, ignore_errors=True)
        return row["ok"]
    keep_log(log)
    rs = restore(img, v=v)
    row["restore"] = {"rc": rs["rc"], "figures": (rs["json"] or {}).get("figures"),
                      "gpu_from_keeper": (rs["json"] or {}).get("gpu_from_keeper"),
                      "staged_buffers_mapped": (rs["json"] or {}).get("staged_buffers_mapped"),
                      "peer_buffers": (rs["json"] or {}).get("peer_buffers"),
                      # Why buffers to be copied from the old GPU were read from the image.
                      "peer_misses": [w for st in (rs["json"] or {}).get("staged") or []
                                      for w in st.get("peer_misses") or []],
                      "stderr": rs["stderr"] if rs["rc"] else None}
    pid = p.pid
    if rs["rc"] == 0 and os.environ.get("CKPT_RESTORE_DEVICE"):
        row["gpu_after"] = gpu_of(pid)
    gone = wait_gone(pid, 600) if rs["rc"] == 0 else True
    if not gone:
        kill_job(None, pid)
    second = key(read_log(log))
    s0 = second[0].get("step") if second and "step" in second[0] else None
    row["resumed_at_step"] = s0
    row["steps_logged_at_checkpoint"] = at
    row["restored_identical"] = bool(second) and s0 is not None and second == ref[s0:]
    row["restored_exited"] = gone
    row["ok"] = row["leave_running_identical"] and row["restored_identical"] and rs["rc"] == 0
    if not row["ok"]:
        row["first_diff"] = next(((i, a, b) for i, (a, b) in enumerate(zip(second, ref[s0 or 0:])) if a != b), None)
        row["err"] = open(os.path.join(WORK, f"{name}.err")).read()[-1500:]
        for lf in ("criu/dump.log",):
            pth = os.path.join(img, lf)
            if os.path.exists(pth):
                row["criu_log_tail"] = open(pth).read()[-1500:]
    row["wall_s"] = time.time() - t_trial
    emit("correctness", row)
    shutil.rmtree(img, ignore_errors=True)
    return row["ok"]


def longest_gap(log):
    """The longest gap between two steps in the job's log (`t` of each line): its seconds, the
    step it followed and the steps after it, and the gaps of up to 3 steps before it and 5 after
    (`before_s`, `after_s`: a job slowed around the hold, by other work on its GPU say). No
    steps after it: the job had ended its steps before the gap (a migration held it after its
    last step), so the gap is not a downtime the job saw; one that followed a step before the
    migration's k is not the migration's."""
    times = []
    try:
        with open(log) as f:
            for line in f:
                r = json.loads(line)
                if "step" in r and "t" in r:
                    times.append(r["t"])
    except (OSError, ValueError):
        return None
    gaps = [(b - a, len(times) - 1 - i) for i, (a, b) in enumerate(zip(times, times[1:]))]
    if not gaps:
        return None
    s, after = max(gaps)
    i = len(times) - 1 - after  # the gap's index in gaps: the step it followed
    near = lambda g: [round(d, 3) for d, _ in g]
    return {"s": round(s, 3), "after_step": i, "steps_after": after,
            "before_s": near(gaps[max(0, i - 3):i]), "after_s": near(gaps[i + 1:i + 6])}


def migrate_trial(p, log, ref, row, name, t_trial, v):
    """A trial of a `-migrate` engine: the job `p` (logging to `log`) migrated at its step k to
    a `possum receive` on this host; its process here ends, the restored one (the same PID, not
    this process's child) runs to the end, writing the same log. Bit-exact when the whole log is
    the reference's: every step once, each line equal."""
    work = os.path.join(WORK, f"{name}-migrate")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    key_file = new_key(work)
    r = Receiver(work, key_file, os.path.join(work, "receive.log"))
    # The job is this process's child: reaped as soon as the migration kills it, since its PID
    # must be free for the restore on this host (a parent that does not reap holds it).
    reaper = threading.Thread(target=p.wait, daemon=True)
    reaper.start()
    extra = ["--post-copy"] if v["postcopy"] else []
    # What CRIU will dump of the job: its host memory as the kernel counts it, just before.
    row["memory_before"] = memory_of(p.pid)
    mg = possum("migrate", str(p.pid), "--to", f"127.0.0.1:{r.port}", "--key-file", key_file,
                "-D", os.path.join(work, "local"), "--json", "--socket-dir", SOCK, *extra)
    received = r.result(timeout=300)
    row["migrate"] = migrate_row(mg, received)
    # Killed by the migration (or, failed, run on to its end here).
    reaper.join(timeout=600)
    pid = p.pid
    gone = wait_gone(pid, 600) if mg["rc"] == 0 else True
    if not gone:
        kill_job(None, pid)
    whole = key(read_log(log))
    row["migrated_identical"] = whole == ref
    row["ok"] = mg["rc"] == 0 and row["migrated_identical"] and gone
    row["log_gap"] = longest_gap(log)
    gap, k, steps = row["log_gap"], row["k"], row["steps"]
    if gap and not k <= gap["after_step"] < steps - 1:
        print(f"{name}: the job's longest gap followed its step {gap['after_step']} of {steps}, not "
              f"one from k={k} on: the migration's gap is not what it saw", flush=True)
    if not row["ok"]:
        row["first_diff"] = next(((i, a, b) for i, (a, b) in enumerate(zip(whole, ref)) if a != b), None)
        row["lines"], row["reference_lines"] = len(whole), len(ref)
        row["err"] = open(os.path.join(WORK, f"{name}.err")).read()[-1500:]
    row["wall_s"] = time.time() - t_trial
    emit("correctness", row)
    keep_criu_logs(work, name)
    shutil.rmtree(work, ignore_errors=True)
    return row["ok"]


def keep_criu_logs(work, tag):
    """CRIU's logs under `work` (each `*.log` in a `criu` directory) copied into
    $CKPT_CRIU_LOGS/`tag`/, named by their path under `work`; nothing without it."""
    into = os.environ.get("CKPT_CRIU_LOGS")
    if not into:
        return
    for root, _, files in os.walk(work):
        if os.path.basename(root) != "criu":
            continue
        for f in files:
            if f.endswith(".log"):
                rel = os.path.relpath(os.path.join(root, f), work).replace(os.sep, "_")
                os.makedirs(os.path.join(into, tag), exist_ok=True)
                shutil.copyfile(os.path.join(root, f), os.path.join(into, tag, rel))


JOB_STEPS = {"mlp": 300, "cnn": 120, "gpt2": 30, "gpt2gen": 120, "triton": 200, "graph": 200, "multistream": 300,
             "ptrtable": 60, "lcuda": 200, "fewbytes": 80, "amp": 120, "twodev": 80}
JOB_SLEEP = {"mlp": 10, "cnn": 10, "gpt2": 20, "gpt2gen": 20, "triton": 10, "graph": 10, "multistream": 10,
             "ptrtable": 20, "lcuda": 10, "fewbytes": 20, "amp": 10, "twodev": 20}


def job_steps(spec, engine=None):
    """The steps of a trial's job. A job migrated (a `-migrate` engine), and a torch job given a
    large state (`CKPT_STATE_MIB`, 1 GiB or more), run five times as many: a migration's
    pre-copy takes seconds (10-20 s with a large state) after step k, and its hold must come
    while the job still steps, or the gap the job sees is not in its log (GPT-2's 30 steps ended
    before it) and a job past its last step copies its whole state to host memory for its
    digest, which CRIU would then dump."""
    job = job_spec(spec)[0]
    big = job not in C_JOBS and float(os.environ.get("CKPT_STATE_MIB") or 0) >= 1024
    migrated = engine is not None and variant(engine)["migrate"]
    return JOB_STEPS[job] * (5 if big or migrated else 1)


# Every workload, then torch's other allocators.
CORRECTNESS_JOBS = "mlp,cnn,gpt2,triton,graph,multistream,ptrtable,lcuda,mlp+expandable,mlp+async," \
                   "gpt2+expandable,gpt2+async"
# Rough seconds of one trial on the H100 (a fresh start, the steps twice, checkpoint, restore).
TRIAL_S = {"gpt2": 32, "gpt2gen": 32, "cnn": 22, "ptrtable": 12, "lcuda": 12}
TRIAL_S_DEFAULT = 20


def trial_cost(spec):
    return TRIAL_S.get(job_spec(spec)[0], TRIAL_S_DEFAULT)


def migrate_row(mg, received):
    """A migration trial's row: `possum migrate --json`'s figures (`mg`: rc, json, stderr) and
    the receiver's (`received`)."""
    j = mg["json"] or {}
    cj = j.get("checkpoint") or {}
    received = received or {}
    return {"rc": mg["rc"], "timings": j.get("timings"), "bytes": j.get("bytes"),
            "bytes_while_held": j.get("bytes_while_held"), "remote_pid": j.get("remote_pid"),
            "bytes_before_hold": j.get("bytes_before_hold"), "rounds": j.get("rounds"),
            "post_copy": j.get("post_copy"),
            "source": cj.get("figures"),
            # The release in the hold: each device's final copy, where its time went, and the
            # buffers the keeper's spare took.
            "release": release_digest(cj.get("release_report")),
            "received": received.get("timings"),
            # Where the restore there went: CRIU's, the plugin's fill of the job's memory, the
            # driver's restore and unlock, possum's resume (its figures, each a number).
            "restore": {k: v for k, v in (received.get("restore") or {}).items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)} or None,
            # The GPU images loaded ahead at the destination (the chunks its keeper was told
            # were written again, the stage ahead), and what the restore took of them.
            "prestaged": [{k: p.get(k) for k in ("bytes", "arriving", "pending", "error",
                                                 "rewritten", "ahead")}
                          for p in received.get("prestaged") or []],
            "staged_reused_bytes": [s.get("reused_bytes") for s in received.get("staged") or []],
            "stderr": mg["stderr"] if mg["rc"] else None}


def trial_plan(jobs, n_trials, seed, engine=None):
    """[(spec, k)]: the jobs in turn (every one covered before any repeats), each checkpointed
    (by `engine`) at a random step k in [2, 2/3 of its steps]."""
    rng = random.Random(seed)
    out = []
    for n in range(n_trials):
        spec = jobs[n % len(jobs)]
        steps = job_steps(spec, engine)
        # (A job of five times the steps is stopped in its first third: at least 1000 steps,
        # 25-35 s, after it.)
        last = steps // 3 if steps > JOB_STEPS[job_spec(spec)[0]] else steps * 2 // 3
        out.append((spec, rng.randint(2, last)))
    return out


def interleaved(plans):
    """[(e, n, spec, k)]: the n-th trial of each engine's plan (`plans[e]`, from trial_plan) in
    turn, the engines taking turns: 0's first, 1's first, 0's second, ..."""
    longest = max((len(p) for p in plans), default=0)
    return [(e, n, *plan[n]) for n in range(longest) for e, plan in enumerate(plans) if n < len(plan)]


def correctness(a):
    jobs = (a.jobs or CORRECTNESS_JOBS).split(",")
    for spec in jobs:
        job_spec(spec)  # a bad spec fails here, before anything runs
    # A CUDA C job whose program was not built (nvcc failed: gpu-ckpt.sh said so) is left out.
    missing = [s for s in jobs if job_spec(s)[0] in C_JOBS and not os.access(os.path.join(WORK, job_spec(s)[0]), os.X_OK)]
    if missing:
        print(f"correctness: left out, not built: {','.join(missing)}", flush=True)
        jobs = [s for s in jobs if s not in missing]
    engines = (a.engines or a.engine).split(",")
    for e in engines:
        variant(e)
    t0 = time.time()
    # Every reference first, all at once.
    references(sorted({(spec, job_steps(spec, e)) for spec in jobs for e in engines}))
    print(f"correctness: {len(jobs)} references in {time.time() - t0:.0f} s", flush=True)
    trials = [int(t) for t in str(a.trials).split(",")]
    plans = [trial_plan(jobs, trials[min(e, len(trials) - 1)], a.seed + e, engine)
             for e, engine in enumerate(engines)]
    if any(variant(engine)["base"] == "possum-keeper" for engine in engines):
        ensure_keeper()  # before any trial thread starts a job
    # --parallel N: N trials at a time (independent jobs, images and checkpoints); a trial is
    # not started when it would end after --budget-s at the pace so far. The engines take turns,
    # so that a budget cut short leaves each about as many trials.
    par = max(1, a.parallel)

    def one(e, n, spec, k):
        if time.time() - t0 + trial_cost(spec) * (1 if par == 1 else 1.5) > a.budget_s:
            return None
        engine = engines[e]
        steps = job_steps(spec, engine)
        return trial(spec, engine, k, steps, JOB_SLEEP[job_spec(spec)[0]], 100 * e + n)

    order = interleaved(plans)
    with concurrent.futures.ThreadPoolExecutor(max_workers=par) as pool:
        results = dict(zip([(e, n) for e, n, _, _ in order], pool.map(lambda t: one(*t), order)))
    all_ok = True
    summary = []
    for e, engine in enumerate(engines):
        plan = plans[e]
        ok = ran = 0
        skipped = []
        for n, (spec, _) in enumerate(plan):
            r = results[(e, n)]
            if r is None:
                skipped.append(spec)
            else:
                ok += r
                ran += 1
        if skipped:
            print(f"correctness ({engine}): {len(skipped)} trials not started (--budget-s {a.budget_s:.0f}): "
                  f"{','.join(skipped)}", flush=True)
        retries = sum(((r.get("checkpoint") or {}).get("mismatch_retries") or 0) for r in rows_of(100 * e, len(plan)))
        print(f"correctness ({engine}): {ok}/{ran} trials identical; checkpoints taken again after a "
              f"fingerprint mismatch: {retries}", flush=True)
        summary.append({"engine": engine, "ok": ok, "ran": ran, "asked": len(plan), "skipped": skipped,
                        "not_built": missing})
        all_ok &= ok == ran and not skipped and not missing
    write_correctness_md(summary, time.time() - t0)
    return all_ok


def rows_of(first, n):
    """This run's trials numbered first .. first + n - 1, as written to OUT/ckpt-correctness.jsonl."""
    try:
        with open(os.path.join(OUT, "ckpt-correctness.jsonl")) as f:
            rows = [json.loads(l) for l in f if l.strip()]
    except (OSError, ValueError):
        return []
    return [r for r in rows if first <= r.get("trial", -1) < first + n][-n:]


def write_correctness_md(summary, wall_s):
    rows = []
    try:
        with open(os.path.join(OUT, "ckpt-correctness.jsonl")) as f:
            rows = [json.loads(l) for l in f if l.strip()]
    except (OSError, ValueError):
        pass
    with open(os.path.join(OUT, "correctness.md"), "w") as f:
        f.write(correctness_md(rows, summary, wall_s))


def correctness_md(rows, summary, wall_s):
    """The trials as a table (every trial of OUT/ckpt-correctness.jsonl, earlier runs' too)."""
    out = ["# Checkpoint correctness", "",
           "; ".join(f"{s['engine']}: {s['ok']}/{s['ran']} bit-identical both ways"
                     + (f" ({len(s['skipped'])} of {s['asked']} not started: time budget)" if s["skipped"] else "")
                     + (f" (left out, not built: {', '.join(s['not_built'])})" if s.get("not_built") else "")
                     for s in summary) + f" (this run: {wall_s:.0f} s).", "",
           "| trial | job | engine | hooks | k | left running identical | restored identical | resumed at | "
           "stall (engine/driver/CRIU) ms | restore ms | wall s | why |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ck = (r.get("checkpoint") or {})
        f = ck.get("figures") or {}
        bd = f.get("stall_breakdown_ms") or {}
        rf = (r.get("restore") or {}).get("figures") or {}
        hooks = ck.get("hooks") or (r.get("status") or {}).get("hooks") or ("-" if r.get("engine") == "driver" else "?")
        stall = (f"{f.get('stall_ms', 0):.0f} ({bd.get('engine', 0):.0f}/{bd.get('driver', 0):.0f}/{bd.get('criu', 0):.0f})"
                 if f else "")
        mt = (r.get("migrate") or {}).get("timings") or {}
        if mt:
            # A migration: its downtime, not a stall and a restore.
            stall = f"{mt.get('downtime_ms', 0):.0f} (migrated)"
        yn = lambda x: "yes" if x else ("**NO**" if x is not None else "")
        rs = r.get("restore") or {}
        staged, peer, misses = rs.get("staged_buffers_mapped"), rs.get("peer_buffers"), rs.get("peer_misses")
        rms = (f"{rf.get('total_ms', '')}" + (f" ({staged} staged" + (f", {peer} GPU to GPU" if peer else "")
                                              + ")" if staged else "")
               + (f"; not copied: {misses[0]}" + (f" (+{len(misses) - 1})" if len(misses) > 1 else "")
                  if misses else ""))
        out.append(f"| {r.get('trial')} | {r.get('job')} | {r.get('engine')} | {hooks} | {r.get('k')} | "
                   f"{yn(r.get('leave_running_identical'))} | "
                   f"{yn(r.get('restored_identical', r.get('migrated_identical')))} | "
                   f"{r.get('resumed_at_step', '')} | {stall} | {rms} | "
                   f"{r.get('wall_s', 0):.0f} | {'' if r.get('ok') else r.get('why') or 'differs'} |")
    return "\n".join(out) + "\n"


def stall_of(rows, t0, t1):
    """Largest gap between steps that overlaps [t0, t1], minus the median gap before t0."""
    ts = [r["t"] for r in rows if "t" in r]
    gaps = [(ts[i], ts[i + 1] - ts[i]) for i in range(len(ts) - 1)]
    before = [g for (t, g) in gaps if t < t0][-200:]
    normal = statistics.median(before) if before else 0.0
    during = [g for (t, g) in gaps if t + g >= t0 and t <= t1]
    worst = max(during) if during else 0.0
    return 1e3 * (worst - normal), 1e3 * normal


def steps_during_save(rows, t0, t1, saved_ms, normal_ms):
    """The job's steps while a kept checkpoint's save ran after it resumed (from the end of the
    largest gap in [t0, t1], the hold, for `saved_ms`): their median time (ms), how many, and the
    time the job lost from t0 to the save's end (every step's time beyond a normal step, the
    hold's gap included)."""
    ts = [r["t"] for r in rows if "t" in r]
    gaps = [(ts[i + 1], ts[i + 1] - ts[i]) for i in range(len(ts) - 1) if t0 <= ts[i + 1] <= t1 + 60]
    if not gaps or not saved_ms:
        return {"median": None, "steps": 0, "lost_ms": None}
    resumed = max(gaps, key=lambda g: g[1])[0]
    end = resumed + saved_ms / 1e3
    during = [1e3 * g for (t, g) in gaps if resumed < t <= end]
    lost = sum(max(0.0, 1e3 * g - normal_ms) for (t, g) in gaps if t <= end)
    med = statistics.median(during) if during else None
    return {"median": med, "steps": len(during), "lost_ms": lost,
            "ratio": med / normal_ms if med and normal_ms else None}


def timeline(rows, t0, t1, before=1.0, after=3.0):
    """Step gaps around a checkpoint: [[seconds since t0, gap ms], ...] from t0-before to t1+after."""
    ts = [r["t"] for r in rows if "t" in r]
    return [[round(ts[i + 1] - t0, 4), round(1e3 * (ts[i + 1] - ts[i]), 3)]
            for i in range(len(ts) - 1) if t0 - before <= ts[i + 1] <= t1 + after]


def job_status(pid):
    r = possum("status", str(pid), "--json", "--socket-dir", SOCK, timeout=30)
    try:
        return json.loads(r["stdout"]) if r["rc"] == 0 else None
    except ValueError:
        return None


# The bench's default: every workload at 1 GiB, the MLP's sizes 8 and 32 GiB too (what fits in 10
# minutes of GPU time, see eval/results/README.md).
DEFAULT_PLAN = "mlp:1,8,32 cnn:1 gpt2:1 triton:1 graph:1 multistream:1"
# The whole matrix (`--bench-plan full --shard K/3`: three invocations).
FULL_PLAN = "mlp:1,8,32 cnn:1,8,32 gpt2:1,8,32 triton:1,8,32 graph:1,8,32 multistream:1,8,32"

# Steps a figure waits for before and after a checkpoint, per job (slow jobs fewer).
FIG_LINES = {"mlp": 300, "multistream": 300, "graph": 200, "triton": 200, "cnn": 100, "gpt2": 20}


def steady(engine, gib, n, kind, job="mlp"):
    """No checkpoint at all: the job's normal step and its time from a fresh start to the first
    step, with possum loaded (`possum-none`) or not (`none`)."""
    spawned = time.time()
    lines = FIG_LINES.get(job, 100) * 4 // 3
    v = variant(engine)
    p, log = start(f"steady-{job}-{engine}-{gib}", job, 10 ** 6, possum=v["possum"], env=v["env"],
                   hold=gib, sleep_ms=1, frozen=v["frozen"])
    row = {"job": job, "engine": engine, "gib": gib, "rep": n,
           "state": "frozen" if v["frozen"] else "written every step"}
    if not wait_lines(log, lines, 600, p):
        row.update(ok=False, why="job did not start")
    else:
        rows = read_log(log)
        ts = [r["t"] for r in rows if "t" in r]
        gaps = [ts[i + 1] - ts[i] for i in range(lines // 4, len(ts) - 1)]
        row.update(ok=True, normal_step_ms=1e3 * statistics.median(gaps),
                   start_to_first_step_ms=1e3 * (ts[0] - spawned))
    p.kill()
    p.wait()
    emit(kind, row)
    return row


def figure(engine, gib, n, kind="figures", job="mlp"):
    """engine: a variant (`variant`): e.g. possum, possum-hold, driver, gpu-only (the extra state
    written every step), possum-frozen (only read, like frozen weights); none / possum-none: no
    checkpoint (steady state, cold start)."""
    if variant(engine)["ckpt"] is None:
        return steady(engine, gib, n, kind, job)
    rows = chain(engine, gib, [n], kind, job)
    return rows[0] if rows else None


def kill_job(proc, pid):
    """Kills the job and reaps it: its pid must be free for the next restore, which a zombie
    (dead, not yet waited for) still holds."""
    if proc is not None:
        proc.kill()
        proc.wait()
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    try:
        # A restored job is ours to reap: this process is a child subreaper (`main`).
        os.waitpid(pid, 0)
    except ChildProcessError:
        wait_gone(pid, 30)


def become_subreaper():
    """Orphans in this process's subtree (a job restored by `possum restore`, whose parent
    exits) are reparented here rather than to init, which may never reap them; `kill_job` then
    reaps them, so their pid is free for the next restore."""
    import ctypes
    pr_set_child_subreaper = 36
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0) != 0:
        print(f"ckpt: PR_SET_CHILD_SUBREAPER failed (errno {ctypes.get_errno()})", flush=True)


def restore_back(pid, timeout=120.0, poll_s=0.05):
    """Polls the job's `possum status` until its session's last restore has finished (its
    `possum.session.last.restore` has "ms" or "error"): (that object, seconds waited) or
    (None, seconds) if it did not within `timeout` (or the job is gone)."""
    t = time.time()
    while time.time() - t < timeout:
        st = job_status(pid) or {}
        last = (((st.get("possum") or {}).get("session") or {}).get("last") or {})
        r = last.get("restore")
        if isinstance(r, dict) and ("ms" in r or "error" in r):
            return r, time.time() - t
        if not alive(pid):
            break
        time.sleep(poll_s)
    return None, time.time() - t


def buffers_back_ms(ckpt_engine, restore_figures, engine_restore):
    """When every GPU buffer of the restored job was back, in ms from the start of `possum
    restore`: the driver's restore (the baseline) brings them all back before the job runs; a
    possum image's resume starts the engine's restore after CRIU and the driver, and the job's
    session reports when it finished (`ms`, from the resume), so: the restore's total less the
    resume's answer, plus the engine's restore. None when unknown."""
    rf = restore_figures or {}
    if rf.get("total_ms") is None:
        return None
    if ckpt_engine == "driver":
        return rf["total_ms"]
    if not engine_restore or engine_restore.get("ms") is None:
        return None
    return rf["total_ms"] - rf.get("resume_ms", 0.0) + engine_restore["ms"]


def chain(engine, gib, reps, kind="figures", job="mlp", in_budget=lambda: True, skipped=None):
    """One job lineage, one checkpoint per rep: the job starts once; each rep checkpoints it with
    --leave-running (the stall, from the job's own step times, and its parts as `possum
    checkpoint` timed them), kills it, restores the image (restore to first step; time until
    every buffer is back) and goes on with the restored process, so a rep costs a checkpoint
    and a restore but no fresh start. `engine`: a variant (`variant`). Returns one row per rep
    that ran; `in_budget()` is asked before each rep after the first (a rep not run is appended
    to `skipped`)."""
    v = variant(engine)
    lines = FIG_LINES.get(job_spec(job)[0], 100)
    frozen = v["frozen"]
    name = f"fig-{job}-{engine}-{gib}"
    img = os.path.join(WORK, f"img-{name}")
    shutil.rmtree(img, ignore_errors=True)
    # Long enough to outlast any checkpoint: it is killed once the figures are in.
    spawned = time.time()
    proc, log = start(name, job, 10 ** 6, possum=v["possum"], hold=gib, sleep_ms=1, frozen=frozen, env=v["env"])
    pid = proc.pid
    out = []
    for i, n in enumerate(reps):
        if i > 0 and not in_budget():
            if skipped is not None:
                skipped.append({"job": job, "engine": engine, "gib": gib, "rep": n, "why": "time budget"})
            print(f"bench: skipped {job} {engine} {gib} GiB rep {n}: over --budget-s", flush=True)
            continue
        row = {"job": job, "engine": engine, "ckpt_engine": v["ckpt"], "gib": gib, "rep": n,
               "state": "frozen" if frozen else "written every step"}
        if i > 0:
            # The process restored by the previous rep, which has written `lines` steps since.
            row["chained"] = True
        if not wait_lines(log, lines, 600, proc, pid):
            row.update(ok=False, why="job did not start" if i == 0 else "restored job stopped",
                       err=open(os.path.join(WORK, f"{name}.err")).read()[-1500:])
            emit(kind, row)
            out.append(row)
            break
        if i == 0:
            first_line = next((r for r in read_log(log) if "t" in r), None)
            if first_line:
                row["start_to_first_step_ms"] = 1e3 * (first_line["t"] - spawned)
        if v["possum"]:
            # How possum sees the job, and what it thinks the job does: opaque operations mark
            # every buffer written, which decides what the pause has to copy.
            full = job_status(pid) or {}
            st = full.get("possum") or {}
            c = st.get("counters") or {}
            row["possum_before"] = {
                **(status_summary(full) or {}),
                "kernels_made_opaque": c.get("kernels_made_opaque"),
                "opaque_kernels": [k.get("name") for k in st.get("opaque_kernels") or []][:10],
                "engines": [e.get("engine") for e in st.get("engines") or []],
            }
        shutil.rmtree(img, ignore_errors=True)
        t0 = time.time()
        if v["kill"]:
            # Checkpoint and kill: the job does not run on; its keeper (if any) keeps its buffers
            # for the restore unless -disk.
            ck = checkpoint(pid, img, v["ckpt"], leave=False,
                            extra=(["--keep-on-gpu", "0"] if v["disk"] else []))
        else:
            ck = checkpoint(pid, img, v["ckpt"], leave=True)
        t1 = time.time()
        # Steps after the checkpoint: on-demand restore in the background.
        n_at = sum(1 for r in read_log(log) if "step" in r)
        if not v["kill"]:
            wait_lines(log, n_at + lines, 120, proc, pid)
        rows = read_log(log)
        stall, normal = stall_of(rows, t0, t1)
        row["timeline"] = timeline(rows, t0, t1)
        kept_ck = bool((ck["json"] or {}).get("kept"))
        if v["ckpt"] in ("gpu-only", "possum") and ck["rc"] == 0 and not kept_ck and not v["kill"]:
            # The on-demand restore's own figures (bytes, time) after the left-running
            # checkpoint, once it has finished.
            row["engine_restore"], _ = restore_back(pid, timeout=120, poll_s=0.2)
        kill_job(proc, pid)
        proc = None
        cj = ck["json"] or {}
        rel = cj.get("release_report") or {}
        if rel.get("held"):
            # Attempts of the held release that the watchdog ended (the job ran between them).
            row["hold_attempts_ended"] = len(rel.get("attempts") or [])
            row["parked_threads"] = (rel.get("parked") or {}).get("threads")
        figs = cj.get("figures") or {}
        if cj.get("kept"):
            # The keeper's path: nothing copied while held; the save ran after the resume.
            saved = saved_reports(cj)
            row["kept"] = {"kept_bytes": rel.get("kept_bytes"), "detach_ms": rel.get("detach_ms"),
                           "attach_ms": (cj.get("resume_report") or {}).get("attach_ms"),
                           "saved_ms": (cj.get("figures") or {}).get("saved_ms"), "save": saved}
            row["step_ms_during_save"] = steps_during_save(rows, t0, t1, row["kept"]["saved_ms"], normal)
        row.update(ok=ck["rc"] == 0, checkpoint_total_ms=1e3 * (t1 - t0), stall_ms=stall, normal_step_ms=normal,
                   possum_stall_ms=figs.get("stall_ms"), stall_parts_ms=figs.get("stall_breakdown_ms"),
                   hooks=cj.get("hooks"), hold=cj.get("hold"),
                   release={k: rel.get(k) for k in ("final_copy_ms", "released_bytes", "ms", "held",
                                                    "context_trimmed_bytes", "staging_freed_bytes")} if rel else None,
                   checkpoint=figs or None, checkpoint_err=ck["stderr"] if ck["rc"] else None)
        restored = False
        if ck["rc"] == 0 and v["ckpt"] != "gpu-only":
            keep_log(log)
            t2 = time.time()
            rs = restore(img, v=v)
            rf = (rs["json"] or {}).get("figures")
            from_keeper = bool((rs["json"] or {}).get("gpu_from_keeper"))
            row["gpu_from_keeper"] = from_keeper
            row["staged"] = {k: (rs["json"] or {}).get(k)
                             for k in ("staged", "stage_skipped", "staged_buffers_mapped", "peer_buffers")}
            if v["kill"]:
                row["held_for_restore"] = rel.get("held_for_restore")
            if rs["rc"] == 0 and wait_lines(log, 1, 300):
                first = next(r for r in read_log(log) if "t" in r)
                row["restore_to_first_step_ms"] = 1e3 * (first["t"] - t2)
                if os.environ.get("CKPT_RESTORE_DEVICE"):
                    row["gpu_after"] = gpu_of(pid)
                if from_keeper:
                    # Mapped again from the keeper: every buffer was back before the job ran.
                    row["buffers_back_seen_ms"] = (rf or {}).get("total_ms")
                elif v["possum"]:
                    # The restored job's own restore of its buffers (in the background when its
                    # hooks are live): when did the last one come back?
                    back, waited = restore_back(pid)
                    row["restore_buffers"] = back
                    if back is not None:
                        row["buffers_back_seen_ms"] = 1e3 * (time.time() - t2)
                    if v["base"] == "possum-keeper":
                        # What the keeper's stage took to load (or copy GPU to GPU) the buffers
                        # (ended by the job as its restore finishes: asked again for a moment).
                        for _ in range(10):
                            row["stage_ended"] = stage_ended(pid)
                            if row["stage_ended"]:
                                break
                            time.sleep(0.2)
                restored = wait_lines(log, lines, 120, pid=pid)
                rows2 = read_log(log)
                ts = [r["t"] for r in rows2 if "t" in r]
                row["restored_steps_seen"] = len(ts)
                row["restored_first_steps_ms"] = 1e3 * (ts[-1] - ts[0]) if len(ts) > 1 else None
            row["restore"] = rf
            row["buffers_back_ms"] = ((rf or {}).get("total_ms") if row.get("gpu_from_keeper")
                                      else buffers_back_ms(v["ckpt"], rf, row.get("restore_buffers")))
            row["restore_err"] = rs["stderr"] if rs["rc"] else None
            row["ok"] = row["ok"] and rs["rc"] == 0 and restored
        emit(kind, row)
        out.append(row)
        if not restored:
            break
    kill_job(proc, pid)
    shutil.rmtree(img, ignore_errors=True)
    return out


# Rough seconds, on the H100, of a job's fresh start (to its first steps) in a bench cell.
FRESH_START_S = 12.0
# Rough seconds per GiB of extra state of one rep (checkpoint + restore), per engine: the
# baseline's driver copies everything twice (2.3 s/GiB measured at 32 GiB); the hold path copies
# everything while held and back before the job runs on; possum pre-copies everything (while the
# job runs) and restores in the background; a frozen job's state is copied once and never again.
PER_GIB_S = {"driver": 2.3, "possum-hold": 0.8, "possum": 0.4, "gpu-only": 0.3}


def cell_cost(engine, gib, reps):
    """Rough seconds a bench chain takes on the H100: a fresh start (its extra state allocated
    at about 0.1 s/GiB), then per rep the waits, the checkpoint and the restore."""
    v = variant(engine)
    if v["ckpt"] is None:
        return FRESH_START_S + 0.1 * gib
    per_gib = PER_GIB_S.get(v["base"], 0.4)
    return FRESH_START_S + 0.1 * gib + reps * (6 + per_gib * gib)


def cell_reps(a, engine, gib):
    # The baseline's large sizes cost over a minute a rep: one rep there.
    return a.reps if gib < 16 or variant(engine)["base"] != "driver" else 1


def plan_cells(a):
    """The bench's (workload, GiB) cells, smallest sizes first (so a budget cut drops the most
    expensive): `--bench-plan "mlp:1,8,32 cnn:1 ..."` (default DEFAULT_PLAN; `full`: every
    workload at 1, 8 and 32 GiB), or, given --bench-jobs, each of them at every --gib. With
    `--shard K/N`, the K-th of N shards of those cells, balanced by estimated cost, so the full
    matrix runs as N invocations of under 10 minutes each (eval/report.py pools them)."""
    if not a.bench_jobs:
        plan = FULL_PLAN if a.bench_plan == "full" else (a.bench_plan or DEFAULT_PLAN)
        cells = []
        for item in plan.split():
            job, _, sizes = item.partition(":")
            cells += [(job, float(g)) for g in (sizes or a.gib).split(",")]
    else:
        cells = [(j, float(g)) for j in a.bench_jobs.split(",") for g in a.gib.split(",")]
    if a.shard:
        k, n = (int(x) for x in a.shard.split("/"))
        engines = a.engines.split(",")
        cost = {c: sum(cell_cost(e, c[1], cell_reps(a, e, c[1])) for e in engines) for c in cells}
        load = [0.0] * n
        mine = []
        # Largest first onto the least loaded shard.
        for c in sorted(cells, key=lambda c: -cost[c]):
            i = load.index(min(load))
            load[i] += cost[c]
            if i == k - 1:
                mine.append(c)
        cells = mine
    return sorted(cells, key=lambda c: c[1])


def bench(a, name="bench"):
    """The bench's matrix in one go: sizes x engines x reps, each run giving the stall timeline and
    its parts, checkpoint total, image size, restore to the first step, time until every buffer
    is back, restore throughput; the step time before the checkpoint with and without possum
    loaded (steady-state overhead); the time from a fresh start to the first step (cold start).
    One JSON document, OUT/NAME.json, and its table, OUT/NAME.md, both saved after every run.
    Cells whose estimated cost (`cell_cost`) no longer fits --budget-s are skipped (listed)."""
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    runs = []
    skipped = []
    t_start = time.time()
    engines = a.engines.split(",")
    for e in engines:
        variant(e)  # a bad name fails here, before anything runs
    cells = plan_cells(a)

    def save():
        # After every run, so that a run cut short by the machine's time limit still reports.
        doc = {"date": time.strftime("%Y-%m-%d"), "gpu": gpu, "engines": engines,
               "jobs": sorted({j for j, _ in cells}),
               "cells": [list(c) for c in cells], "reps": a.reps, "shard": a.shard or None,
               "sizes_gib": sorted({g for _, g in cells}), "runs": runs, "skipped": skipped,
               "budget_s": a.budget_s, "wall_s": time.time() - t_start}
        with open(os.path.join(OUT, f"{name}.json"), "w") as f:
            json.dump(doc, f)
        with open(os.path.join(OUT, f"{name}.md"), "w") as f:
            f.write(figures_md(doc))
        return doc

    def in_budget(cost_s=0.0):
        return time.time() - t_start + cost_s <= a.budget_s

    print(f"{name}: plan {' '.join(f'{j}:{g:g}' for j, g in cells)} x {','.join(engines)}, reps {a.reps}; "
          f"estimated {plan_cost(a, cells, engines):.0f} s, budget {a.budget_s:.0f} s", flush=True)
    try:
        for job, gib in cells:
            for engine in engines:
                reps = cell_reps(a, engine, gib)
                if not in_budget(cell_cost(engine, gib, 1)):
                    skipped.append({"job": job, "engine": engine, "gib": gib, "why": "time budget"})
                    print(f"{name}: skipped {job} {engine} {gib:g} GiB: over --budget-s", flush=True)
                    continue
                if variant(engine)["ckpt"] is None:
                    # No checkpoint: one run (its step times are the repetitions).
                    runs.append(steady(engine, gib, 0, name, job) or {})
                else:
                    def rep_fits(engine=engine, gib=gib):
                        # A later rep of the chain: no fresh start.
                        return in_budget(cell_cost(engine, gib, 1) - FRESH_START_S)
                    runs.extend(chain(engine, gib, list(range(reps)), name, job, rep_fits, skipped))
                save()
    finally:
        doc = save()
    print(figures_md(doc), flush=True)
    print(f"{name}: {len(runs)} runs in {doc['wall_s']:.0f} s -> {OUT}/{name}.json, {name}.md", flush=True)
    return all(r.get("ok") for r in runs) and not skipped


def plan_cost(a, cells, engines):
    """Estimated seconds of a whole plan (`cell_cost` of every cell and engine)."""
    return sum(cell_cost(e, g, cell_reps(a, e, g)) for _, g in cells for e in engines)


# The figures: the MLP at 1, 8 and 32 GiB of extra state, written every step or only read
# (frozen), checkpointed by possum (entry hooks), by today's hold path (POSSUM_HOOKS=off) and by
# the driver baseline: about 7 minutes on the H100 (`plan_cost`).
FIGURES_PLAN = "mlp:1,8,32"
FIGURES_ENGINES = "possum,possum-frozen,driver,possum-hold"


def figures(a):
    return bench(a, name="figures")


def figures_md(doc):
    """One line per run: the stall seen by the job and its parts as `possum checkpoint` timed
    them, restore to the first step and until every buffer is back, and a line per engine of
    how the stall grows with the size."""
    f0 = lambda x: "" if x is None else f"{x:.0f}"
    out = [f"# Checkpoint figures ({doc.get('date')}, {doc.get('gpu')})", "",
           f"{len(doc.get('runs') or [])} runs in {doc.get('wall_s', 0):.0f} s (budget {doc.get('budget_s')}); "
           "ms. Stall: the largest gap between the job's steps around the checkpoint, less a normal "
           "step; its parts as `possum checkpoint` timed them (engine = release + resume, driver = "
           "lock + checkpoint + restore + unlock, CRIU = dump). Restore: from `possum restore`'s "
           "start; every buffer back: the restored job's own restore finished (`possum.session.last."
           "restore`).", "",
           "Drain: a kept checkpoint's save of the GPU state after the job resumed (`saved_ms`), "
           "and the GPU image's bytes over it. Lost: every step's time beyond a normal step from the "
           "checkpoint to the drain's end (the stall included); steps: their median time during the "
           "drain over a normal step's.", "",
           "| job | engine | GiB | state | hooks | stall | `stall_ms` | engine | driver | CRIU | ckpt total | drain (GB/s) "
           "| lost | steps | restore to 1st step | every buffer back | restore: CRIU / driver / resume | image GB | ok |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc.get("runs") or []:
        if not r.get("engine"):
            continue
        bd = r.get("stall_parts_ms") or {}
        rf = r.get("restore") or {}
        ck = r.get("checkpoint") or {}
        img = ck.get("image_bytes")
        saved = ck.get("saved_ms")
        gpu_bytes = sum(x.get("bytes") or 0 for x in (r.get("kept") or {}).get("save") or []) or ck.get("gpu_image_bytes")
        drain = (f"{saved:.0f} ({gpu_bytes / saved / 1e6:.1f})" if saved and gpu_bytes else "")
        during = r.get("step_ms_during_save") or {}
        ratio = during.get("ratio")
        out.append(f"| {r.get('job')} | {r['engine']} | {r.get('gib', 0):g} | {r.get('state', '')[:6]} | "
                   f"{r.get('hooks') or (r.get('possum_before') or {}).get('hooks') or '-'} | "
                   f"{f0(r.get('stall_ms'))} | {f0(r.get('possum_stall_ms'))} | {f0(bd.get('engine'))} | "
                   f"{f0(bd.get('driver'))} | {f0(bd.get('criu'))} | "
                   f"{f0(r.get('checkpoint_total_ms'))} | {drain} | {f0(during.get('lost_ms'))} | "
                   f"{'' if ratio is None else f'{ratio:.2f}x'} | {f0(r.get('restore_to_first_step_ms'))} | "
                   f"{f0(r.get('buffers_back_ms'))} | {f0(rf.get('criu_restore_ms'))} / "
                   f"{f0((rf.get('driver_restore_ms') or 0) + (rf.get('driver_unlock_ms') or 0)) if rf else ''} / "
                   f"{f0(rf.get('resume_ms'))} | {'' if img is None else f'{img / 1e9:.1f}'} | "
                   f"{'yes' if r.get('ok') else '**NO** ' + str(r.get('why') or r.get('checkpoint_err') or r.get('restore_err') or '')[:120]} |")
    by = {}
    for r in doc.get("runs") or []:
        if r.get("engine") and r.get("stall_ms") is not None:
            by.setdefault((r.get("job"), r["engine"]), []).append((r["gib"], r["stall_ms"], r.get("restore_to_first_step_ms")))
    if by:
        out += ["", "Stall and restore to the first step by size (ms):", ""]
        for (job, e), xs in sorted(by.items()):
            out.append(f"- {job} {e}: " + ", ".join(f"{g:g} GiB {s:.0f} / {f0(t)}" for g, s, t in sorted(xs)))
    for sk in doc.get("skipped") or []:
        out.append(f"\nNot run: {sk.get('job')} {sk.get('engine')} {sk.get('gib', 0):g} GiB"
                   f"{' rep ' + str(sk['rep']) if 'rep' in sk else ''}: {sk.get('why')}.")
    return "\n".join(out) + "\n"


def errors(a):
    """Each error case: a clear message, exit code != 0, the job running, no image left.

    The process-image cases run against a job without possum (--engine driver); the job under
    possum runs with CUPTI (POSSUM_HOOKS=cupti), which NVIDIA's driver checkpoint refuses."""
    ok = True
    p, log = start("err-possum", "mlp", 10 ** 6, possum=True, sleep_ms=5, env=variant("possum-cupti")["env"])
    q, qlog = start("err-plain", "mlp", 10 ** 6, possum=False, sleep_ms=5)
    wait_lines(log, 20, 300, p)
    wait_lines(qlog, 20, 300, q)
    img = os.path.join(WORK, "img-err")
    shutil.rmtree(img, ignore_errors=True)

    def running(proc, lg):
        n0 = len(read_log(lg))
        t = time.time()
        while time.time() - t < 30:
            if len(read_log(lg)) > n0 + 3:
                return alive(proc.pid)
            time.sleep(0.05)
        return False

    def case(name, res, want, proc=q, lg=qlog, check_img=True, extra=None):
        nonlocal ok
        run_ok = running(proc, lg)
        left = os.path.exists(img) and check_img
        good = res["rc"] != 0 and want.lower() in res["stderr"].lower() and run_ok and not left
        ok &= good
        emit("errors", {"case": name, "ok": good, "rc": res["rc"], "message": res["stderr"][-700:],
                        "job_running": run_ok, "image_left": left, **(extra or {})})

    case("no possum loaded (engine possum)", checkpoint(q.pid, img, "possum"), "--engine driver")
    r = checkpoint(p.pid, img, "possum")
    # Refused before anything was done: the job was never paused, copied or released.
    st = job_status(p.pid) or {}
    untouched = bool(st) and not ((st.get("possum") or {}).get("session") or {}).get("last")
    ok &= untouched
    case("full possum checkpoint of a CUPTI job (driver refuses)", r, "CUPTI", proc=p, lg=log,
         extra={"job_untouched": untouched})
    dead = subprocess.Popen(["true"]); dead.wait()
    case("dead pid", checkpoint(dead.pid, img, "driver"), "no process")
    os.makedirs(img); open(os.path.join(img, "x"), "w").write("old")
    r = checkpoint(q.pid, img, "driver")
    case("existing non-empty dir", r, "--force", check_img=False,
         extra={"old_image_intact": open(os.path.join(img, "x")).read() == "old"})
    ok &= open(os.path.join(img, "x")).read() == "old"
    shutil.rmtree(img)
    r = subprocess.run([POSSUM, "checkpoint", str(q.pid), "-D", img, "--engine", "driver", "--leave-running"],
                       capture_output=True, text=True, env=dict(os.environ, POSSUM_CRIU="/nonexistent/criu"))
    case("CRIU missing", {"rc": r.returncode, "stderr": r.stderr}, "CRIU")
    # Two at once: the second is refused, the first completes.
    first = subprocess.Popen([POSSUM, "checkpoint", str(q.pid), "-D", img, "--engine", "driver", "--socket-dir", SOCK,
                              "--leave-running", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.2)
    second = checkpoint(q.pid, img + "-2", "driver")
    fo, fe = first.communicate()
    good = second["rc"] != 0 and "already" in second["stderr"] and first.returncode == 0 \
        and not os.path.exists(img + "-2") and running(q, qlog)
    ok &= good
    emit("errors", {"case": "checkpoint already running", "ok": good, "message": second["stderr"][-400:],
                    "first_rc": first.returncode, "first_err": fe[-400:]})
    # Restore while the original still runs (its PID is taken).
    r = restore(img)
    good = r["rc"] != 0 and "running" in r["stderr"] and running(q, qlog)
    ok &= good
    emit("errors", {"case": "restore while the pid is taken", "ok": good, "message": r["stderr"][-400:]})
    # A corrupt image (possum.json damaged) and a partial one (CRIU's inventory missing).
    bad = img + "-bad"
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(img, bad)
    mf = os.path.join(bad, "possum.json")
    b = bytearray(open(mf, "rb").read()); b[len(b) // 3] ^= 0x55; open(mf, "wb").write(bytes(b))
    r = restore(bad)
    good = r["rc"] != 0 and "corrupt" in r["stderr"]
    ok &= good
    emit("errors", {"case": "corrupt image", "ok": good, "message": r["stderr"][-400:]})
    shutil.rmtree(bad); shutil.copytree(img, bad)
    os.remove(os.path.join(bad, "criu", "inventory.img"))
    r = restore(bad)
    good = r["rc"] != 0 and "partial" in r["stderr"]
    ok &= good
    emit("errors", {"case": "partial image", "ok": good, "message": r["stderr"][-400:]})
    shutil.rmtree(bad)
    # possum checkpoint killed at several moments: the job runs on, no image under DIR's name.
    for delay in (0.05, 0.3, 0.6, 1.0, 1.6):
        img2 = img + f"-kill{delay}"
        shutil.rmtree(img2, ignore_errors=True)
        c = subprocess.Popen([POSSUM, "checkpoint", str(q.pid), "-D", img2, "--engine", "driver"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        c.kill()
        c.wait()
        time.sleep(0.5)
        t = time.time()
        while time.time() - t < 60 and not running(q, qlog):
            time.sleep(0.2)
        run_ok = running(q, qlog)
        complete = os.path.exists(os.path.join(img2, "possum.json"))
        leftovers = [e for e in os.listdir(WORK) if f"kill{delay}" in e and e != os.path.basename(img2)]
        # Killed before the commit: no image under DIR's name and the job runs on; after it (the
        # job is killed next, without --leave-running): a complete image. The hidden temporary
        # sibling may outlive this check while CRIU's worker finishes: the guard removes it then.
        good = (run_ok or complete) and (complete or not os.path.exists(img2))
        ok &= good
        emit("errors", {"case": f"possum checkpoint killed after {delay} s", "ok": good, "job_running": run_ok,
                        "image": "complete" if complete else ("none" if not os.path.exists(img2) else "PARTIAL"),
                        "leftovers": leftovers})
        shutil.rmtree(img2, ignore_errors=True)
        if not alive(q.pid):
            q.wait()
            q, qlog = start("err-plain2", "mlp", 10 ** 6, possum=False, sleep_ms=5)
            wait_lines(qlog, 20, 300, q)
    for x in (p, q):
        x.kill(); x.wait()
    shutil.rmtree(img, ignore_errors=True)
    print(f"errors: {'all ok' if ok else 'FAILURES'}", flush=True)
    return ok


def probe(a):
    """Which jobs NVIDIA's driver checkpoint accepts: the same MLP without possum, under
    libpossum.so with its default hooks (the driver's entry points), with hooks off, with CUPTI
    subscribed with no callback, one, all; and CUPTI detached (unsubscribe, finalize) before the
    lock. Each: `possum checkpoint --engine driver --leave-running` (lock, checkpoint, CRIU dump,
    restore, unlock), then whether the job still runs."""
    cupti = variant("possum-cupti")["env"]
    variants = [
        ("no possum", None),
        ("possum, entry hooks (default)", {}),
        ("possum, hooks off", {"POSSUM_HOOKS": "off"}),
        ("possum, CUPTI subscribed, no callback", {**cupti, "POSSUM_CALLBACKS": "none", "POSSUM_MANAGE": "0"}),
        ("possum, CUPTI, cuLaunchKernel only", {**cupti, "POSSUM_CALLBACKS": "cuLaunchKernel"}),
        ("possum, CUPTI, all callbacks", cupti),
        ("possum, CUPTI, unsubscribed before", {**cupti, "detach": "unsubscribe"}),
        ("possum, CUPTI, cuptiFinalize before", {**cupti, "detach": "finalize"}),
    ]
    ok = True
    for name, env in variants:
        env = dict(env or {})
        detach = env.pop("detach", None)
        if detach:
            env["POSSUM_DETACH"] = detach
        p, log = start("probe", "mlp", 10 ** 6, possum=name != "no possum", sleep_ms=20, env=env)
        wait_lines(log, 5, 300, p)
        if detach:
            possum("cupti", str(p.pid), "--socket-dir", SOCK, timeout=30)
        img = os.path.join(WORK, "img-probe")
        shutil.rmtree(img, ignore_errors=True)
        ck = checkpoint(p.pid, img, "driver", leave=True)
        n0 = len(read_log(log))
        time.sleep(1.0)
        running = alive(p.pid) and len(read_log(log)) > n0
        emit("probe", {"variant": name, "accepted": ck["rc"] == 0, "job_runs_on": running,
                       "message": ck["stderr"][-300:] if ck["rc"] else None})
        ok &= running
        p.kill()
        p.wait()
        shutil.rmtree(img, ignore_errors=True)
    return ok


def gpu_of(pid):
    """(index, uuid) of the GPU process `pid` runs on, from nvidia-smi; None if not seen."""
    gpus = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout
    idx = {u.strip(): int(i) for i, u in (l.split(",") for l in gpus.strip().splitlines())}
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout
    for line in apps.strip().splitlines():
        p, u = [x.strip() for x in line.split(",")]
        if p == str(pid):
            return idx.get(u), u
    return None


def migrate(a):
    """`possum restore --device`: a job on GPU 0 checkpointed (killed), restored on GPU 1;
    it must run there and write the reference's lines from the checkpointed step on. Needs two
    GPUs (kind nvidia-h200-x2)."""
    ok = True
    steps = 400
    ref = reference("mlp", steps)
    for n, engine in enumerate(a.engines.split(",")):
        v = variant(engine)
        name = f"mig-{engine}"
        img = os.path.join(WORK, f"img-{name}")
        shutil.rmtree(img, ignore_errors=True)
        p, log = start(name, "mlp", steps, possum=v["possum"], sleep_ms=10, env=v["env"])
        row = {"engine": engine, "steps": steps}
        if not wait_lines(log, 40, 300, p):
            p.kill()
            row.update(ok=False, why="job did not start")
            emit("migrate", row)
            ok = False
            continue
        row["gpu_before"] = gpu_of(p.pid)
        ck = checkpoint(p.pid, img, v["ckpt"], leave=False,
                        extra=(["--keep-on-gpu", "0"] if v["disk"] else []))
        # possum killed the job; reap it (a zombie child keeps its PID, which CRIU needs).
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        row["checkpoint"] = {"rc": ck["rc"], "figures": (ck["json"] or {}).get("figures"),
                             "stderr": ck["stderr"] if ck["rc"] else None}
        if ck["rc"] != 0:
            row.update(ok=False, why="checkpoint failed")
            emit("migrate", row)
            ok = False
            continue
        keep_log(log)
        rs = restore(img, extra=("--device", "1"), v=v)
        rj = rs["json"] or {}
        row["restore"] = {"rc": rs["rc"], "figures": rj.get("figures"),
                          "stderr": rs["stderr"] if rs["rc"] else None,
                          **{k: rj.get(k) for k in ("peer_buffers", "staged_buffers_mapped",
                                                    "stage_skipped", "staged", "gpu_from_keeper")},
                          "moved": (rj.get("resume_report") or {}).get("moved")}
        if rs["rc"] == 0:
            wait_lines(log, 5, 120)
            row["gpu_after"] = gpu_of(p.pid)
            wait_gone(p.pid, 300)
        second = key(read_log(log))
        s0 = second[0].get("step") if second and "step" in second[0] else None
        row["resumed_at_step"] = s0
        row["restored_identical"] = bool(second) and s0 is not None and second == ref[s0:]
        row["ok"] = (rs["rc"] == 0 and row["restored_identical"]
                     and (row.get("gpu_after") or [None])[0] == 1
                     and (row.get("gpu_before") or [None])[0] == 0)
        if not row["ok"]:
            row["err"] = open(os.path.join(WORK, f"{name}.err")).read()[-1500:]
        emit("migrate", row)
        ok &= row["ok"]
        shutil.rmtree(img, ignore_errors=True)
    return ok


def gpu_memory_mib():
    """{pid: MiB of GPU memory} of every compute process, from nvidia-smi."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    mem = {}
    for line in out.strip().splitlines():
        p, m = [x.strip() for x in line.split(",")]
        mem[int(p)] = int(m)
    return mem


def repeat(a):
    """`--repeat N` checkpoints (--leave-running) of one MLP holding --gib (first value) under the
    first of --engines (default possum-keeper): after each, the GPU memory of the job and of the
    keeper (nvidia-smi), the stall and the save. Growth is the last minus the first."""
    engine = (a.engines or "possum-keeper").split(",")[0]
    v = variant(engine)
    gib = float(a.gib.split(",")[0])
    name = f"repeat-{engine}"
    img = os.path.join(WORK, f"img-{name}")
    proc, log = start(name, "mlp", 10 ** 6, possum=v["possum"], hold=gib, sleep_ms=1, frozen=v["frozen"], env=v["env"])
    pid = proc.pid
    ok = wait_lines(log, 50, 300, proc, pid)
    keeper = KEEPER[0].pid if KEEPER else None
    base = gpu_memory_mib()
    emit("repeat", {"i": 0, "engine": engine, "gib": gib, "job_mib": base.get(pid), "keeper_mib": base.get(keeper)})
    n_ok = 0
    for i in range(1, a.repeat + 1):
        if not ok:
            break
        shutil.rmtree(img, ignore_errors=True)
        t0 = time.time()
        ck = checkpoint(pid, img, v["ckpt"], leave=True)
        t1 = time.time()
        at = sum(1 for r in read_log(log) if "step" in r)
        ok = ck["rc"] == 0 and wait_lines(log, at + 20, 60, proc, pid)
        mem = gpu_memory_mib()
        cj = ck["json"] or {}
        figs = cj.get("figures") or {}
        n_ok += bool(ok)
        emit("repeat", {"i": i, "ok": ok, "job_mib": mem.get(pid), "keeper_mib": mem.get(keeper),
                        "stall_ms": figs.get("stall_ms"), "saved_ms": figs.get("saved_ms"),
                        "total_ms": 1e3 * (t1 - t0), "kept": cj.get("kept"),
                        "err": ck["stderr"][-600:] if ck["rc"] else None})
    kill_job(proc, pid)
    shutil.rmtree(img, ignore_errors=True)
    print(f"repeat ({engine}, {gib:g} GiB): {n_ok}/{a.repeat} checkpoints ok", flush=True)
    return n_ok == a.repeat


def smoke(a):
    """One MLP trial per engine of --engines (checkpoint at step 20 with --leave-running, then the
    killed image restored)."""
    ok = True
    for n, engine in enumerate(a.engines.split(",")):
        ok &= trial("mlp", engine, 20, 120, 10, n)
    return ok


def mode_defaults(a):
    """Fills what a mode's defaults depend on: the engines (figures: FIGURES_ENGINES; bench,
    smoke, migrate: driver,possum; correctness: --engine unless --engines), the plan (figures: FIGURES_PLAN; bench: DEFAULT_PLAN) and the
    correctness jobs (CORRECTNESS_JOBS)."""
    if a.engines is None and a.mode == "repeat":
        a.engines = "possum-keeper"
    if a.engines is None and a.mode != "correctness":
        a.engines = FIGURES_ENGINES if a.mode == "figures" else "driver,possum"
    if a.bench_plan is None and not a.bench_jobs:
        a.bench_plan = FIGURES_PLAN if a.mode == "figures" else DEFAULT_PLAN
    if a.jobs is None:
        a.jobs = CORRECTNESS_JOBS
    return a


def parser():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["smoke", "correctness", "figures", "errors", "bench", "probe", "migrate", "repeat"])
    ap.add_argument("--repeat", type=int, default=50, help="repeat: checkpoints of one job")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(GPU, "out"))
    ap.add_argument("--trials", default="20", help="correctness: trials per engine, comma-separated")
    ap.add_argument("--jobs", default=None,
                    help=f"correctness: job specs (JOB or JOB+expandable / JOB+async), default {CORRECTNESS_JOBS}")
    ap.add_argument("--engine", default="possum", help="correctness (unless --engines): " + ENGINE_HELP)
    ap.add_argument("--seed", type=int, default=4)
    ap.add_argument("--parallel", type=int, default=1, help="correctness: trials run at a time")
    ap.add_argument("--gib", default="8,32")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=float(os.environ.get("POSSUM_BENCH_BUDGET_S", 560)),
                    help="correctness, bench, figures: start no trial or run that would end after this "
                         "many seconds (estimated; the machine allows 600 per command)")
    ap.add_argument("--engines", default=None,
                    help=f"comma-separated variants ({ENGINE_HELP}); figures: {FIGURES_ENGINES}; "
                         "bench, smoke, migrate: driver,possum")
    ap.add_argument("--bench-jobs", default=None,
                    help="bench: the workloads (workloads/gpu/jobs.py), each holding --gib extra")
    ap.add_argument("--bench-plan", default=None,
                    help="bench, figures: JOB:GIB,GIB ... cells instead of --bench-jobs x --gib, e.g. "
                         f"'{DEFAULT_PLAN}' (bench's default), '{FIGURES_PLAN}' (figures'), or 'full'")
    ap.add_argument("--shard", default="",
                    help="bench: K/N, the K-th of N cost-balanced shards of the plan's cells")
    return ap


# Jobs started and not yet known to be gone: killed if this process is ended early.
LIVE = set()


def kill_live():
    for pid in list(LIVE):
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def main():
    global OUT
    a = mode_defaults(parser().parse_args())
    OUT = a.out
    become_subreaper()
    os.makedirs(OUT, exist_ok=True)
    os.makedirs(SOCK, exist_ok=True)
    # A `timeout` around this (the machine's limit per command) ends it with SIGTERM: results
    # saved so far stay (bench and figures save after every run), and no job is left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    atexit.register(kill_live)
    ok = {"smoke": smoke, "correctness": correctness, "figures": figures, "errors": errors,
          "bench": bench, "probe": probe, "migrate": migrate, "repeat": repeat}[a.mode](a)
    return 0 if ok in (None, True) else 1


if __name__ == "__main__":
    sys.exit(main())
