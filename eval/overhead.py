"""Steady-state overhead of libpossum.so on one job, as a statistic.

    python3 eval/overhead.py [--job mlp] [--pairs 12] [--steps 800] [--cpus 2-5] [--out DIR]
                             [--modes plain,possum,possum-hooksoff,possum-cupti,possum-nodag]
    python3 eval/overhead.py --ab [--job mlp] [--pairs 4] [--steps 4000] [--ab-ms 250]
    python3 eval/overhead.py --pool FILE.json [FILE.json ...]

Process-to-process noise on the GPU machine is larger than the effect (+-15% between two runs of
the same job), so one run against one says little. Here: `--pairs` rounds, each running the job
once per mode (plain; possum = what `possum run` does: its hooks in the wrappers of the driver's
entry points; possum-hooksoff = POSSUM_HOOKS=off: allocations served, nothing hooked, the
wrappers only calling the driver; for a breakdown also CUPTI feeding the hooks instead
(possum-cupti) and possum without the DAG), in an order rotated every round so drift does not
favour a mode; every run pinned to the same CPUs; each run's median step time
(workloads/gpu/jobs.py, POSSUM_TIMING_FILE). The overhead of a mode is the median over rounds of
(mode / plain of the same round) - 1, with a 95% bootstrap interval over rounds. Results:
OUT/overhead-<job>.json, printed too.

--ab measures inside each process instead, free of that noise: libpossum's POSSUM_AB_MS switches
its hooks off and on every --ab-ms (logging each switch): off, the entry points' wrappers call the
driver and nothing else; on, possum's hooks run in them (with `--ab-env POSSUM_HOOKS=cupti`:
CUPTI detached and attached again). The job's own step times are laid over those intervals; each
on interval is compared with the mean of the off intervals on both sides of it (both sides so
that a drift of the step time over the run cancels). The overhead is the median of those ratios
- 1, with a bootstrap interval over the pairs of all processes. What it leaves out: possum serving
the job's allocations and the wrappers' own call, there in both (`possum-hooksoff` against
`plain` above measures those). Results: OUT/overhead-ab-<job>.json.

--pool reads several such files of one job and interval length (made with the same build, by
separate calls) and gives the median and interval over all their pairs; it refuses files that
differ in job, interval or GPU model (compare within one kind of machine).
Runs from the repo root with the build in .gpu/ (scripts/gpu-interposer.sh --stage).
"""
import argparse, json, os, random, shutil, statistics, subprocess, sys, tempfile, time, types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SO = os.path.join(ROOT, ".gpu", "libpossum.so")
# Each mode's environment on top of LD_PRELOAD=libpossum.so ("plain": no possum at all).
MODE_ENV = {
    "possum": {},                                  # what `possum run` does: the entry points' hooks
    "possum-hooksoff": {"POSSUM_HOOKS": "off"},    # allocations served, nothing hooked
    "possum-cupti": {"POSSUM_HOOKS": "cupti"},     # breakdown: CUPTI's callbacks feed the hooks
    "possum-nodag": {"POSSUM_DAG": "0"},           # breakdown: no DAG recorded
}
MODES = ["plain", "possum", "possum-hooksoff"]


def cpus(spec):
    out = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def job_env():
    """This process's environment without possum's variables (POSSUM_CUPTI kept: where CUPTI is,
    for POSSUM_HOOKS=cupti): POSSUM_HOOKS unset is possum's default, the entry points."""
    return {k: v for k, v in os.environ.items() if not k.startswith("POSSUM_") or k == "POSSUM_CUPTI"}


def run_job(job, steps, env, cpuset, *args):
    """workloads/gpu/jobs.py JOB for `steps` steps with `env`, pinned to `cpuset`, waited for:
    its returncode, stderr and pid."""
    p = subprocess.Popen(["python3", os.path.join(ROOT, "workloads/gpu/jobs.py"), job, "--steps", str(steps),
                          *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: os.sched_setaffinity(0, cpuset), cwd=ROOT)
    _, err = p.communicate()
    return types.SimpleNamespace(returncode=p.returncode, stderr=err, pid=p.pid)


def run_once(job, steps, mode, cpuset):
    env = job_env()
    if mode != "plain":
        env["LD_PRELOAD"] = SO
        env["POSSUM_SOCKET_DIR"] = tempfile.gettempdir()
        env.update(MODE_ENV[mode])
    fd, timing = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    env["POSSUM_TIMING_FILE"] = timing
    t = time.time()
    r = run_job(job, steps, env, cpuset)
    try:
        ms = json.load(open(timing))["step_ms_median"] if r.returncode == 0 else None
    except (OSError, ValueError):
        ms = None
    os.remove(timing)
    return {"mode": mode, "step_ms": ms, "rc": r.returncode, "wall_s": time.time() - t,
            "err": r.stderr[-500:] if r.returncode else None}


def ab_intervals(switches, t_start):
    """[(t0, t1, on)] from the A/B log's switches: on from the start until the first switch."""
    out, t, on = [], t_start, True
    for sw in switches:
        out.append((t, sw["t"], on))
        t, on = sw["t"], sw["on"]
    out.append((t, float("inf"), on))
    return out


def ab_pairs(step_ts, switches, skip_steps, guard_s=0.003, min_steps=3):
    """Median step time per interval (steps wholly inside it, `guard_s` after its switch), then
    each on interval against the mean of the off intervals on both sides of it: [(on_ms,
    off_ms)]. Both sides, so that a drift of the step time over the run (warm-up, clocks)
    cancels instead of favouring whichever state comes first."""
    ivs = ab_intervals(switches, step_ts[0] if step_ts else 0.0)
    per = []
    for t0, t1, on in ivs:
        gaps = [1e3 * (b - a) for a, b in zip(step_ts[skip_steps:], step_ts[skip_steps + 1:])
                if a >= t0 + guard_s and b <= t1]
        per.append((on, statistics.median(gaps) if len(gaps) >= min_steps else None))
    pairs = []
    for (on_a, ms_a), (on_b, ms_b), (on_c, ms_c) in zip(per, per[1:], per[2:]):
        if on_b and not on_a and not on_c and ms_a and ms_b and ms_c:
            pairs.append((ms_b, (ms_a + ms_c) / 2))
    return pairs


def run_ab(job, steps, period_ms, cpuset, skip_steps, extra_env=""):
    """One process of `job` under possum with the A/B test on (libpossum's POSSUM_AB_MS): its
    step times in on intervals (possum's hooks working) against the off intervals next to them
    (the entry points' wrappers only calling the driver; CUPTI detached under POSSUM_HOOKS=cupti)."""
    env = job_env()
    work = tempfile.mkdtemp(prefix="possum-ab-")
    log, ab = os.path.join(work, "steps.jsonl"), os.path.join(work, "ab.jsonl")
    env.update(LD_PRELOAD=SO, POSSUM_SOCKET_DIR=work, POSSUM_AB_MS=str(period_ms), POSSUM_AB_LOG=ab)
    env.update(kv.split("=", 1) for kv in extra_env.split(",") if kv)
    t = time.time()
    r = run_job(job, steps, env, cpuset, "--log", log)
    def lines(p):
        try:
            return [json.loads(x) for x in open(p)]
        except (OSError, ValueError):
            return []
    ts = [x["t"] for x in lines(log) if "t" in x]
    # The job's own switches: its children (torch.compile's compiler workers) inherit
    # POSSUM_AB_LOG and log theirs too (lines without a pid: a build from before it was logged).
    sw = [x for x in lines(ab) if x.get("pid", r.pid) == r.pid]
    pairs = ab_pairs(ts, sw, skip_steps)
    shutil.rmtree(work, ignore_errors=True)
    return {"rc": r.returncode, "wall_s": time.time() - t, "steps": len(ts), "switches": len(sw),
            "switch_errors": sorted({x["error"] for x in sw if x.get("error")}),
            "switch_ms_median": statistics.median([x["switch_ms"] for x in sw]) if sw else None,
            "pairs": pairs, "err": r.stderr[-500:] if r.returncode else None,
            # Without a pair, the raw times, to see why (steps and switches on one clock?).
            **({} if pairs else {"raw": {"step_t": ts, "switches": sw}})}


def ab_main(a, cpuset):
    """The A/B over up to `a.pairs` processes, saved after each (a run cut short by a timeout
    keeps what it measured)."""
    runs, t0 = [], time.time()
    rc = 1
    for i in range(a.pairs):
        if time.time() - t0 > a.budget_s:
            print(f"stopping after {i} processes: --budget-s", flush=True)
            break
        run = run_ab(a.job, a.steps, a.ab_ms, cpuset, a.ab_skip, a.ab_env)
        ratios = [100 * (on / off - 1) for on, off in run["pairs"]]
        run["overhead_pct_median"] = statistics.median(ratios) if ratios else None
        runs.append(run)
        print(json.dumps({"process": i, "steps": run["steps"], "switches": run["switches"],
                          "pairs": len(run["pairs"]), "overhead_pct_median": run["overhead_pct_median"],
                          "rc": run["rc"]}), flush=True)
        rc = ab_save(a, cpuset, runs, t0, quiet=True)
    if runs:
        rc = ab_save(a, cpuset, runs, t0)
    return rc


def ab_save(a, cpuset, runs, t0, quiet=False):
    """Writes OUT/overhead-ab-JOB.json over `runs` (and prints the summary unless `quiet`)."""
    ratios = [100 * (on / off - 1) for r in runs for on, off in r["pairs"]]
    doc = {"job": a.job, "steps": a.steps, "ab_ms": a.ab_ms, "cpus": sorted(cpuset),
           "date": time.strftime("%Y-%m-%d"), "method": "A/B inside each process (POSSUM_AB_MS)",
           "env": a.ab_env or None,
           "gpu": subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True).stdout.strip(),
           "runs": runs, "wall_s": time.time() - t0}
    if ratios:
        lo, hi = bootstrap(ratios)
        doc["overhead"] = {"overhead_pct_median": statistics.median(ratios), "ci95_pct": [lo, hi],
                           "pairs": len(ratios), "processes": len(runs),
                           "step_ms_on_median": statistics.median(on for r in runs for on, _ in r["pairs"]),
                           "step_ms_off_median": statistics.median(off for r in runs for _, off in r["pairs"])}
        o = doc["overhead"]
        if not quiet:
            print(f"{a.job} A/B: {o['overhead_pct_median']:+.2f}% (95% CI {lo:+.2f}% .. {hi:+.2f}%, "
                  f"{o['pairs']} interval pairs in {o['processes']} processes; step "
                  f"{o['step_ms_off_median']:.3f} -> {o['step_ms_on_median']:.3f} ms)", flush=True)
    tag = "-" + a.ab_env.replace("=", "-").replace(",", "-").lower() if a.ab_env else ""
    with open(os.path.join(a.out, f"overhead-ab-{a.job}{tag}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    return 0 if ratios and not any(r["rc"] for r in runs) else 1


def pool(docs):
    """The A/B over the pairs of several --ab results `docs` (one job, interval and GPU model):
    {"overhead_pct_median", "ci95_pct", "pairs", "processes"}. Raises ValueError for files that
    may not be pooled, or none with a pair."""
    keys = {(d.get("job"), d.get("ab_ms"), d.get("gpu")) for d in docs}
    if len(keys) != 1:
        raise ValueError("files differ in job, interval or GPU model: " + ", ".join(map(str, sorted(keys, key=str))))
    runs = [r for d in docs for r in d.get("runs", [])]
    ratios = [100 * (on / off - 1) for r in runs for on, off in r.get("pairs", [])]
    if not ratios:
        raise ValueError("no interval pair in these files")
    lo, hi = bootstrap(ratios)
    return {"overhead_pct_median": statistics.median(ratios), "ci95_pct": [lo, hi],
            "pairs": len(ratios), "processes": len(runs)}


def pool_main(paths):
    try:
        o = pool([json.load(open(p)) for p in paths])
    except (OSError, ValueError) as e:
        print(f"--pool: {e}", file=sys.stderr)
        return 2
    print(f"pooled A/B of {len(paths)} files: {o['overhead_pct_median']:+.2f}% (95% CI "
          f"{o['ci95_pct'][0]:+.2f}% .. {o['ci95_pct'][1]:+.2f}%, {o['pairs']} interval pairs in "
          f"{o['processes']} processes)")
    return 0


def bootstrap(xs, n=10000, seed=0):
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", default="mlp")
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--cpus", default="2-5")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="plain first, then any of " + ", ".join(MODE_ENV))
    ap.add_argument("--budget-s", type=float, default=480)
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, ".gpu", "out")))
    ap.add_argument("--ab", action="store_true",
                    help="A/B inside each process instead: --pairs processes, possum's hooks switched off and "
                         "on every --ab-ms (POSSUM_AB_MS), on intervals against the off ones next to them")
    ap.add_argument("--ab-ms", type=int, default=250)
    ap.add_argument("--ab-skip", type=int, default=50, help="--ab: steps left out at the start (warm-up)")
    ap.add_argument("--ab-env", default="", help="--ab: more VAR=VALUE,... for the job (e.g. POSSUM_HOOKS=cupti: "
                    "CUPTI's callbacks feeding the hooks, detached in the off intervals)")
    ap.add_argument("--pool", nargs="+", metavar="FILE",
                    help="pool the pairs of these --ab results (one job, interval and GPU model)")
    a = ap.parse_args()
    if a.pool:
        return pool_main(a.pool)
    if a.ab:
        os.makedirs(a.out, exist_ok=True)
        return ab_main(a, cpus(a.cpus) & os.sched_getaffinity(0) or os.sched_getaffinity(0))
    modes = a.modes.split(",")
    if modes[0] != "plain" or any(m not in MODE_ENV for m in modes[1:]):
        ap.error(f"--modes: plain first, then any of {', '.join(MODE_ENV)}")
    os.makedirs(a.out, exist_ok=True)
    cpuset = cpus(a.cpus) & os.sched_getaffinity(0) or os.sched_getaffinity(0)
    rounds = []
    t0 = time.time()
    for i in range(a.pairs):
        if time.time() - t0 > a.budget_s:
            print(f"stopping after {i} rounds: --budget-s", flush=True)
            break
        order = modes[i % len(modes):] + modes[:i % len(modes)]
        rnd = {m: run_once(a.job, a.steps, m, cpuset) for m in order}
        rounds.append(rnd)
        print(json.dumps({"round": i, **{m: rnd[m]["step_ms"] for m in modes}}), flush=True)
    summary = {}
    for m in modes[1:]:
        ratios = [100 * (r[m]["step_ms"] / r["plain"]["step_ms"] - 1) for r in rounds
                  if r[m]["step_ms"] and r["plain"]["step_ms"]]
        if ratios:
            lo, hi = bootstrap(ratios)
            summary[m] = {"overhead_pct_median": statistics.median(ratios), "ci95_pct": [lo, hi],
                          "rounds": len(ratios), "per_round_pct": ratios}
    steps = {m: [r[m]["step_ms"] for r in rounds if r[m]["step_ms"]] for m in modes}
    doc = {"job": a.job, "steps": a.steps, "cpus": sorted(cpuset), "date": time.strftime("%Y-%m-%d"),
           "gpu": subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True).stdout.strip(),
           "step_ms_median": {m: statistics.median(v) for m, v in steps.items() if v},
           "overhead": summary, "rounds": rounds, "wall_s": time.time() - t0}
    with open(os.path.join(a.out, f"overhead-{a.job}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    for m, s in summary.items():
        print(f"{a.job} {m}: {s['overhead_pct_median']:+.2f}% (95% CI {s['ci95_pct'][0]:+.2f}% .. "
              f"{s['ci95_pct'][1]:+.2f}%, {s['rounds']} rounds); step medians {doc['step_ms_median']}",
              flush=True)
    failed = [r[m] for r in rounds for m in modes if r[m]["rc"]]
    if failed:
        print("failed runs:", failed[:3])
    return 1 if failed or not rounds else 0


if __name__ == "__main__":
    sys.exit(main())
