"""Steady-state overhead of libpossum.so on one job, as a statistic (issue 3).

    python3 eval/overhead.py [--job mlp] [--pairs 12] [--steps 800] [--cpus 2-5] [--out DIR]
                             [--modes plain,possum,possum-nocupti,possum-nodag,possum-hooksoff]

Process-to-process noise on the GPU machine is larger than the effect (+-15% between two runs of
the same job), so one run against one says little. Here: `--pairs` rounds, each running the job
once per mode (plain, possum with CUPTI = what `possum run` does, possum without CUPTI = `possum
run --no-cupti`; for a breakdown also possum without the DAG, and CUPTI's dispatch alone with
possum's callbacks returning at once), in an order rotated every round so drift does not favour a mode; every run
pinned to the same CPUs; each run's median step time (workloads/gpu/jobs.py, POSSUM_TIMING_FILE).
The overhead of a mode is the median over rounds of (mode / plain of the same round) - 1, with a
95% bootstrap interval over rounds. Results: OUT/overhead-<job>.json, printed too.
Runs from the repo root with the build in .gpu/ (scripts/gpu-interposer.sh --stage).
"""
import argparse, json, os, random, statistics, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SO = os.path.join(ROOT, ".gpu", "libpossum.so")
# Each mode's environment on top of LD_PRELOAD=libpossum.so ("plain": no possum at all).
MODE_ENV = {
    "possum": {},                                  # what `possum run` does
    "possum-nocupti": {"POSSUM_CUPTI": "off"},     # `possum run --no-cupti`
    "possum-nodag": {"POSSUM_DAG": "0"},           # breakdown: no DAG recorded
    "possum-hooksoff": {"POSSUM_HOOKS": "off"},    # breakdown: CUPTI's dispatch alone
}
MODES = ["plain", "possum", "possum-nocupti"]


def cpus(spec):
    out = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def run_once(job, steps, mode, cpuset):
    env = dict(os.environ)
    for k in list(env):
        if k.startswith("POSSUM_") and k != "POSSUM_CUPTI":
            del env[k]
    if mode != "plain":
        env["LD_PRELOAD"] = SO
        env["POSSUM_SOCKET_DIR"] = tempfile.gettempdir()
        env.update(MODE_ENV[mode])
    fd, timing = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    env["POSSUM_TIMING_FILE"] = timing
    t = time.time()
    r = subprocess.run(["python3", os.path.join(ROOT, "workloads/gpu/jobs.py"), job, "--steps", str(steps)],
                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       preexec_fn=lambda: os.sched_setaffinity(0, cpuset), cwd=ROOT)
    try:
        ms = json.load(open(timing))["step_ms_median"] if r.returncode == 0 else None
    except (OSError, ValueError):
        ms = None
    os.remove(timing)
    return {"mode": mode, "step_ms": ms, "rc": r.returncode, "wall_s": time.time() - t,
            "err": r.stderr[-500:] if r.returncode else None}


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
    a = ap.parse_args()
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
