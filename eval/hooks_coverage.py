"""Coverage of possum's hooks on the GPU machine: every launch the job makes, seen without CUPTI.

    python3 eval/hooks_coverage.py [--out DIR] [--jobs mlp,cnn,...] [--allocs default,expandable,async]
                             [--par 6] [--lcuda BINARY] [--cupti-job mlp] [--budget-s 300]

For each workload of workloads/gpu/jobs.py and each allocator setting (PYTORCH_CUDA_ALLOC_CONF
unset, `expandable_segments:True`, `backend:cudaMallocAsync`), three runs of the same steps:
under libpossum.so with its default hooks (the driver's entry points; POSSUM_STATS at exit),
without possum (its output must be byte-identical), and with torch.profiler (`--profile`: the
kernels it saw, an independent count). possum's count is the launches it saw run (its
`launches` counter: captured launches do not run) plus the kernel nodes of the graphs it saw
launched, each counted per launch (`graph_nodes_expanded`, complete with POSSUM_RESOLVE=always,
which this sets); it must equal the profiler's kernels.

Also: workloads/gpu/lcuda.cu (--lcuda BINARY: linked with -lcuda, calls cuLaunchKernel,
cuLaunchKernelEx, cuMemcpyHtoD_v2, cuMemsetD32_v2 ... itself and prints its own counts), plain
and with its parameters in `extra`; and one workload under POSSUM_HOOKS=cupti (CUPTI feeds the
hooks, the entry wrappers count what they see beside it: `entry.seen_beside_cupti` must equal
CUPTI's counts name by name).

The runs are independent processes and run --par at a time (counts do not depend on timing).
Results: OUT/coverage.json (every row, with the stats' essentials) and OUT/coverage.md (the
table); the runs' outputs and stats in WORK (default /tmp/possum-coverage), which
scripts/gpu-interposer.sh packs into OUT/coverage-logs.tgz.
"""
import argparse, concurrent.futures, json, os, subprocess, sys, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SO = os.path.join(ROOT, ".gpu", "libpossum.so")
JOBS_PY = os.path.join(ROOT, "workloads/gpu/jobs.py")
CUPTI = "/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcupti.so.13"

# PYTORCH_CUDA_ALLOC_CONF per allocator setting (None: unset, torch's default).
ALLOCS = {"default": None, "expandable": "expandable_segments:True", "async": "backend:cudaMallocAsync"}
# Steps per job: short (counts, not times), as in FINDINGS' first count.
STEPS = {"mlp": 20, "cnn": 20, "gpt2": 5, "triton": 20, "graph": 20, "multistream": 20}
LCUDA_STEPS = 20
# Rough seconds of one run (a fresh python + torch start dominates), for the order of the queue.
RUN_S = {"gpt2": 25, "cnn": 10}


def alloc_env(alloc):
    """The job's environment additions for an allocator setting (`default`, `expandable`,
    `async`, or a PYTORCH_CUDA_ALLOC_CONF value itself)."""
    conf = ALLOCS[alloc] if alloc in ALLOCS else alloc
    return {"PYTORCH_CUDA_ALLOC_CONF": conf} if conf else {}


def base_env(extra=None):
    """This process's environment without possum's or the allocator's variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("POSSUM_") and k not in ("LD_PRELOAD", "PYTORCH_CUDA_ALLOC_CONF")}
    env.update(extra or {})
    return env


def possum_env(stats, hooks=None, extra=None):
    """Under libpossum.so: POSSUM_HOOKS unset (the default, the entry points) unless `hooks`."""
    env = base_env(extra)
    env.update(LD_PRELOAD=SO, POSSUM_STATS=stats, POSSUM_RESOLVE=os.environ.get("RESOLVE", "always"),
               POSSUM_SOCKET_DIR=os.path.dirname(stats))
    if hooks:
        env["POSSUM_HOOKS"] = hooks
    if hooks == "cupti":
        env["POSSUM_CUPTI"] = os.environ.get("POSSUM_CUPTI") or CUPTI
    return env


def last_json(path):
    """The last JSON line of a file (the jobs' final line), or {}."""
    try:
        lines = [l for l in open(path) if l.startswith("{")]
        return json.loads(lines[-1]) if lines else {}
    except (OSError, ValueError):
        return {}


def load(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError) as e:
        return {"error": f"{path}: {e}"}


def nonzero(d):
    return {k: v for k, v in (d or {}).items() if v}


def possum_kernels(stats):
    """Kernels possum saw run: launches run now (not captured into a graph) plus the kernel
    nodes of every graph launch. (count, parts)."""
    c = (stats.get("possum") or {}).get("counters") or {}
    total = stats.get("total_launches") or 0
    if "launches" in c:
        run = c["launches"]
    else:
        # No possum state (nothing managed): every launch call, captured ones included.
        run = total - c.get("captured_launches", 0)
    nodes = c.get("graph_nodes_expanded", 0)
    return run + nodes, {"launch_calls": total, "captured": c.get("captured_launches", 0),
                         "launches_run": run, "graph_launches": c.get("graph_launches", stats.get("graph_launches")),
                         "graph_launches_opaque": c.get("graph_launches_opaque"), "graph_nodes": nodes}


def coverage_row(job, alloc, stats, profile, plain_out, possum_out):
    """One workload x allocator: possum's kernels against the profiler's, outputs compared."""
    seen, parts = possum_kernels(stats)
    prof = (profile or {}).get("profiler") or {}
    p = stats.get("possum") or {}
    row = {"job": job, "alloc": alloc, "hooks": stats.get("hooks"),
           "possum_kernels": seen, "profiler_kernels": prof.get("kernels"),
           "match": prof.get("kernels") is not None and seen == prof.get("kernels"),
           "identical": bool(plain_out) and plain_out == possum_out,
           **parts,
           "launches": nonzero(stats.get("launches")), "graphs": nonzero(stats.get("graphs")),
           "copies": sum((stats.get("copies") or {}).values()), "memsets": sum((stats.get("memsets") or {}).values()),
           "profiler_copies": prof.get("copies"), "profiler_memsets": prof.get("memsets"),
           "entry": {k: v for k, v in (stats.get("entry") or {}).items() if k != "seen_beside_cupti"},
           "managed_allocs": (p.get("counters") or {}).get("managed_allocs"),
           "allocs": nonzero(stats.get("allocs")),
           "unmanaged": (p.get("unmanaged") or {}).get("by_kind"),
           "allocator": (profile or {}).get("allocator")}
    if stats.get("error"):
        row["error"] = stats["error"]
    return row


KINDS = ("launches", "graphs", "copies", "memsets")


def cupti_cross(stats):
    """POSSUM_HOOKS=cupti: the entry wrappers' counts (`entry.seen_beside_cupti`) against CUPTI's
    (the stats' launches, graphs, copies, memsets), name by name."""
    seen = (stats.get("entry") or {}).get("seen_beside_cupti") or {}
    cupti = {}
    for k in KINDS:
        cupti.update(nonzero(stats.get(k)))
    names = sorted(set(cupti) | {n for n in seen if any(n in (stats.get(k) or {}) for k in KINDS)})
    diff = {n: {"cupti": cupti.get(n, 0), "entry": seen.get(n, 0)} for n in names
            if cupti.get(n, 0) != seen.get(n, 0)}
    return {"hooks": stats.get("hooks"), "cupti": stats.get("cupti"), "names": len(names),
            "cupti_counts": cupti, "entry_counts": {n: seen.get(n, 0) for n in names},
            "differ": diff, "match": bool(names) and not diff,
            "unmatched": (stats.get("entry") or {}).get("unmatched")}


def lcuda_row(variant, stats, own, plain_out, possum_out):
    """The -lcuda program: possum's per-name counts against the program's own."""
    calls = own.get("calls") or {}
    c = (stats.get("possum") or {}).get("counters") or {}
    got = {"cuLaunchKernel": (stats.get("launches") or {}).get("cuLaunchKernel"),
           "cuLaunchKernelEx": (stats.get("launches") or {}).get("cuLaunchKernelEx"),
           "launches": c.get("launches", stats.get("total_launches")),
           "cuMemcpyHtoD_v2": (stats.get("copies") or {}).get("cuMemcpyHtoD_v2"),
           "cuMemcpyDtoH_v2": (stats.get("copies") or {}).get("cuMemcpyDtoH_v2"),
           "cuMemsetD32_v2": (stats.get("memsets") or {}).get("cuMemsetD32_v2"),
           "cuMemAlloc_v2": (stats.get("allocs") or {}).get("cuMemAlloc_v2")}
    differ = {k: {"own": calls.get(k), "possum": got.get(k)} for k in calls if calls.get(k) != got.get(k)}
    return {"job": f"lcuda{'-' + variant if variant else ''}", "alloc": "-", "hooks": stats.get("hooks"),
            "possum_kernels": got["launches"], "profiler_kernels": calls.get("launches"),
            "own_counts": calls, "possum_counts": got, "differ": differ,
            "match": bool(calls) and not differ,
            "identical": bool(plain_out) and plain_out == possum_out,
            "entry": {k: v for k, v in (stats.get("entry") or {}).items() if k != "seen_beside_cupti"},
            "managed_allocs": c.get("managed_allocs"),
            "unmanaged": ((stats.get("possum") or {}).get("unmanaged") or {}).get("by_kind"),
            **({"error": stats["error"]} if stats.get("error") else {})}


def markdown(doc):
    rows = doc["rows"]
    ok = sum(1 for r in rows if r.get("match") and r.get("identical"))
    out = [f"# Coverage of possum's hooks ({doc.get('date')}, {doc.get('gpu')})", "",
           f"{ok}/{len(rows)} rows: possum's count = the independent count, outputs byte-identical with "
           f"and without possum. possum: launches run + graph kernel nodes per graph launch "
           f"(POSSUM_RESOLVE={doc.get('resolve')}); reference: torch.profiler's kernels (separate run), "
           f"or the -lcuda program's own count. Wall {doc.get('wall_s', 0):.0f} s.", "",
           "| job | alloc | hooks | possum | reference | match | identical | launch calls (by name) | graph launches x nodes | unmatched entries | unmanaged |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        names = ", ".join(f"{k.replace('cuLaunchKernel', 'LK')} {v}" for k, v in (r.get("launches") or {}).items())
        g = f"{r.get('graph_launches') or 0} / {r.get('graph_nodes') or 0}" if r.get("graph_launches") else ""
        um = len((r.get("entry") or {}).get("unmatched") or [])
        unm = ", ".join(f"{k} {v.get('allocations')}" for k, v in (r.get("unmanaged") or {}).items())
        out.append(f"| {r['job']} | {r.get('alloc')} | {r.get('hooks')} | {r.get('possum_kernels')} | "
                   f"{r.get('profiler_kernels')} | {'yes' if r.get('match') else '**NO**'} | "
                   f"{'yes' if r.get('identical') else '**NO**'} | {names} | {g} | {um} | {unm} |")
    for r in rows:
        if r.get("error") or r.get("differ"):
            out.append(f"\n{r['job']} {r.get('alloc')}: {r.get('error') or ''} {json.dumps(r.get('differ') or '')}")
    x = doc.get("cupti_cross")
    if x:
        out += ["", f"CUPTI cross-check ({x.get('job')}, POSSUM_HOOKS=cupti): {x.get('names')} names, "
                f"{'entry wrappers = CUPTI for every one' if x.get('match') else 'DIFFER: ' + json.dumps(x.get('differ'))}"
                f"; CUPTI loaded: {x.get('cupti')}; identical output: {x.get('identical')}"]
    if doc.get("skipped"):
        out += ["", f"Not run (--budget-s): {', '.join(doc['skipped'])}"]
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, ".gpu", "out"))
    ap.add_argument("--work", default="/tmp/possum-coverage")
    ap.add_argument("--jobs", default=",".join(STEPS))
    ap.add_argument("--allocs", default=",".join(ALLOCS))
    ap.add_argument("--par", type=int, default=int(os.environ.get("PAR", 6)))
    ap.add_argument("--lcuda", default="", help="the -lcuda program, built (workloads/gpu/lcuda.cu)")
    ap.add_argument("--cupti-job", default="mlp", help="'' for no CUPTI cross-check")
    ap.add_argument("--budget-s", type=float, default=300, help="start no run after this many seconds")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    t0 = time.time()
    W = a.work
    jobs, allocs = a.jobs.split(","), a.allocs.split(",")
    # Every run: (tag, argv, env, stdout file). The slow ones first (the queue's tail is short).
    runs = []

    def add(tag, argv, env):
        runs.append((tag, argv, env, os.path.join(W, f"{tag}.out")))

    specs = sorted(((j, al) for j in jobs for al in allocs), key=lambda s: -RUN_S.get(s[0], 8))
    for job, alloc in specs:
        tag, cmd, ae = f"{job}-{alloc}", ["python3", JOBS_PY, job, "--steps", str(STEPS[job])], alloc_env(alloc)
        add(f"{tag}.possum", cmd, possum_env(os.path.join(W, f"{tag}.stats.json"), extra=ae))
        add(f"{tag}.plain", cmd, base_env(ae))
        add(f"{tag}.profile", cmd + ["--profile"], base_env(ae))
    if a.cupti_job:
        j = a.cupti_job
        add(f"{j}-cupti.possum", ["python3", JOBS_PY, j, "--steps", str(STEPS[j])],
            possum_env(os.path.join(W, f"{j}-cupti.stats.json"), hooks="cupti"))
    variants = {"": {}, "extra": {"LCUDA_EXTRA": "1"}}
    if a.lcuda:
        for v, ve in variants.items():
            tag = f"lcuda{'-' + v if v else ''}"
            add(f"{tag}.possum", [a.lcuda, str(LCUDA_STEPS)], possum_env(os.path.join(W, f"{tag}.stats.json"), extra=ve))
            add(f"{tag}.plain", [a.lcuda, str(LCUDA_STEPS)], base_env(ve))
    skipped = []

    def run(r):
        tag, argv, env, out = r
        if time.time() - t0 > a.budget_s:
            skipped.append(tag)
            return tag, None
        ts = time.time()
        with open(out, "w") as f, open(out[:-4] + ".err", "w") as e:
            try:
                rc = subprocess.run(argv, env=env, stdout=f, stderr=e, stdin=subprocess.DEVNULL, cwd=ROOT,
                                    timeout=max(30, a.budget_s + 60 - (time.time() - t0))).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        print(f"coverage: {tag} rc {rc} in {time.time() - ts:.1f} s", flush=True)
        return tag, rc

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, a.par)) as ex:
        rcs = dict(ex.map(run, runs))

    def text(tag):
        try:
            return open(os.path.join(W, f"{tag}.out")).read()
        except OSError:
            return ""

    rows = []
    for job, alloc in sorted(specs, key=lambda s: (jobs.index(s[0]), allocs.index(s[1]))):
        tag = f"{job}-{alloc}"
        row = coverage_row(job, alloc, load(os.path.join(W, f"{tag}.stats.json")),
                           last_json(os.path.join(W, f"{tag}.profile.out")), text(f"{tag}.plain"), text(f"{tag}.possum"))
        row["rc"] = {k: rcs.get(f"{tag}.{k}") for k in ("possum", "plain", "profile")}
        if row["rc"]["possum"] not in (0, None):
            row["err_tail"] = open(os.path.join(W, f"{tag}.possum.err")).read()[-1200:]
        rows.append(row)
    if a.lcuda:
        for v in variants:
            tag = f"lcuda{'-' + v if v else ''}"
            row = lcuda_row(v, load(os.path.join(W, f"{tag}.stats.json")), last_json(os.path.join(W, f"{tag}.plain.out")),
                            text(f"{tag}.plain"), text(f"{tag}.possum"))
            row["rc"] = {k: rcs.get(f"{tag}.{k}") for k in ("possum", "plain")}
            if row["rc"]["possum"] not in (0, None):
                row["err_tail"] = open(os.path.join(W, f"{tag}.possum.err")).read()[-1200:]
            rows.append(row)
    cross = None
    if a.cupti_job:
        tag = f"{a.cupti_job}-cupti"
        cross = {"job": a.cupti_job, **cupti_cross(load(os.path.join(W, f"{tag}.stats.json"))),
                 "identical": text(f"{tag}.possum") == text(f"{a.cupti_job}-default.plain") and bool(text(f"{tag}.possum")),
                 "rc": rcs.get(f"{tag}.possum")}
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    doc = {"date": time.strftime("%Y-%m-%d"), "gpu": gpu, "resolve": os.environ.get("RESOLVE", "always"),
           "steps": STEPS, "allocs": {k: ALLOCS.get(k, k) for k in allocs}, "rows": rows,
           "cupti_cross": cross, "skipped": skipped, "wall_s": time.time() - t0}
    with open(os.path.join(a.out, "coverage.json"), "w") as f:
        json.dump(doc, f, indent=1)
    md = markdown(doc)
    with open(os.path.join(a.out, "coverage.md"), "w") as f:
        f.write(md)
    print(md, flush=True)
    good = all(r.get("match") and r.get("identical") for r in rows) and not skipped \
        and (cross is None or cross.get("match"))
    print(f"coverage: {'all match' if good else 'MISMATCHES (see coverage.md)'}; {len(rows)} rows in "
          f"{doc['wall_s']:.0f} s -> {a.out}/coverage.{{json,md}}", flush=True)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
