"""Tables and plots from a `python3 eval/ckpt.py bench` run.

    python3 eval/report.py BENCH_JSON [--results eval/results] [--readme FILE] [--suffix -bench]

Writes, next to each other in --results, named <date>-<gpu>:
  .json            the run itself (copied)
  .md              the table: per size and engine, median and spread of each metric, and the
                   ratios against the baseline (`driver`), which are the headline
  -stall-<G>g.png  step time around the checkpoint, one line per engine (needs matplotlib)
  -bars.png        one panel per metric, engines side by side per size (needs matplotlib)
and with --readme replaces the part of FILE between `<!-- results:begin -->` and
`<!-- results:end -->` with the table (a results section generated, never typed).
"""
import argparse, json, os, re, shutil, statistics, sys

PCIE_GBPS = 55.0  # host<->device ceiling measured on the H100 machine (pinned, 4 GiB copies)

METRICS = [
    # key, label, unit, lower is better
    ("stall_ms", "stall seen by the job", "ms", True),
    ("stall_engine_ms", "  of which possum's engine", "ms", True),
    ("stall_driver_ms", "  of which NVIDIA's driver", "ms", True),
    ("stall_criu_ms", "  of which CRIU", "ms", True),
    ("checkpoint_total_ms", "checkpoint total", "ms", True),
    ("image_gb", "image size", "GB", True),
    ("restore_first_step_ms", "restore to first step", "ms", True),
    ("restore_gbps", "restore throughput", "GB/s", False),
    ("overhead_pct", "steady-state overhead", "%", True),
    ("cold_start_ms", "fresh start to first step", "ms", True),
]


def metrics_of(run, plain_step_ms, gpu_bytes=None):
    """The metrics of one run (None where they do not apply). `gpu_bytes`: the job's GPU state
    (possum's GPU image of the same case), else the extra state alone is counted."""
    ck = run.get("checkpoint") or {}
    m = {k: None for k, *_ in METRICS}
    m["stall_ms"] = run.get("stall_ms")
    m["checkpoint_total_ms"] = run.get("checkpoint_total_ms")
    # The parts of the hold, as `possum checkpoint` timed them (the job's own stall is measured
    # from its step times and includes scheduling around them).
    bd = ck.get("stall_breakdown_ms") or {}
    for part in ("engine", "driver", "criu"):
        if bd.get(part):
            m[f"stall_{part}_ms"] = bd[part]
    if ck.get("image_bytes") is not None:
        m["image_gb"] = ck["image_bytes"] / 1e9
    m["restore_first_step_ms"] = run.get("restore_to_first_step_ms")
    gib_bytes = gpu_bytes or run["gib"] * (1 << 30)
    rs = run.get("restore") or {}
    er = run.get("engine_restore") or {}
    if run["engine"] == "driver" and rs.get("driver_restore_ms"):
        # The driver restores the GPU memory (all of it) from host memory.
        m["restore_gbps"] = gib_bytes / 1e9 / (rs["driver_restore_ms"] / 1e3)
    elif run["engine"] == "possum" and rs.get("resume_ms") and ck.get("gpu_image_bytes"):
        # possum restores its buffers (the GPU data) in the resume after CRIU and the driver.
        m["restore_gbps"] = ck["gpu_image_bytes"] / 1e9 / (rs["resume_ms"] / 1e3)
    elif er.get("bytes") and er.get("ms"):
        m["restore_gbps"] = er["bytes"] / 1e9 / (er["ms"] / 1e3)
    if run["engine"] not in ("driver", "none") and plain_step_ms and run.get("normal_step_ms"):
        m["overhead_pct"] = 100 * (run["normal_step_ms"] / plain_step_ms - 1)
    m["cold_start_ms"] = run.get("start_to_first_step_ms")
    return m


def case(run):
    """What a run measures: (workload, GiB of extra state). Runs of old documents are the MLP's."""
    return (run.get("job", "mlp"), run["gib"])


def label(c, cases):
    """A case for the table and plots: the size alone when all runs are of one workload."""
    one_job = len({j for j, _ in cases}) == 1
    return f"{c[1]:g}" if one_job else f"{c[0]} {c[1]:g}"


def summarise(doc):
    """{((job, gib), engine): {metric: (median, min, max, n)}}"""
    runs = [r for r in doc["runs"] if r and r.get("engine")]
    # The plain step time, for the same size and the same job (state written every step, or
    # frozen): from runs without any checkpoint (`none`) when there are some, else from the
    # baseline's job (which runs without possum) before its checkpoint.
    plain = {}
    src = "none" if any(r["engine"] == "none" for r in runs) else "driver"
    for r in runs:
        if r["engine"] == src and r.get("normal_step_ms"):
            plain.setdefault((case(r), r.get("state")), []).append(r["normal_step_ms"])
    plain = {k: statistics.median(v) for k, v in plain.items()}
    # The GPU state of each case, as possum's image of it measured it: what the driver restores.
    gpu = {}
    for r in runs:
        b = (r.get("checkpoint") or {}).get("gpu_image_bytes")
        if r["engine"] == "possum" and b:
            gpu.setdefault(case(r), []).append(b)
    gpu = {k: statistics.median(v) for k, v in gpu.items()}
    out = {}
    for r in runs:
        m = metrics_of(r, plain.get((case(r), r.get("state"))), gpu.get(case(r)))
        cell = out.setdefault((case(r), r["engine"]), {})
        for k, v in m.items():
            if v is not None:
                cell.setdefault(k, []).append(v)
    return {key: {k: (statistics.median(v), min(v), max(v), len(v)) for k, v in cell.items()}
            for key, cell in out.items()}


def fmt(v, unit):
    if v is None:
        return "–"
    if unit == "ms":
        return f"{v / 1e3:.2f} s" if v >= 1000 else f"{v:.0f} ms"
    if unit == "%":
        return f"{v:+.1f}%"
    return f"{v:.1f} {unit}"


def table(doc, summary):
    engines = doc.get("engines") or sorted({e for _, e in summary})
    sizes = sorted({g for g, _ in summary})
    one_job = len({j for j, _ in sizes}) == 1
    lines = [f"Run of {doc.get('date')} on {doc.get('gpu')}: median (min-max, n) per size and engine; "
             f"`x` = ratio to `driver` (the baseline: CRIU + NVIDIA's driver checkpoint)."]
    if doc.get("source"):
        lines.append(f"Source: {doc['source']}.")
    lines.append("")
    head = "| metric | " + ("GiB" if one_job else "job, GiB") + " | " + " | ".join(engines) + " |"
    lines += [head, "|" + "---|" * (2 + len(engines))]
    for key, name, unit, lower in METRICS:
        for g in sizes:
            cells = []
            base = summary.get((g, "driver"), {}).get(key)
            for e in engines:
                s = summary.get((g, e), {}).get(key)
                if not s:
                    cells.append("–")
                    continue
                med, lo, hi, n = s
                c = fmt(med, unit)
                if n > 1:
                    c += f" ({fmt(lo, unit)}-{fmt(hi, unit)}, {n})"
                if base and e != "driver" and base[0] and unit != "%":
                    c += f" **{med / base[0]:.2f}x**"
                cells.append(c)
            if any(c != "–" for c in cells):
                lines.append(f"| {name} | {label(g, sizes)} | " + " | ".join(cells) + " |")
    lines.append("")
    if doc.get("invocations"):
        lines.append("Pooled from " + ", ".join(
            f"one invocation of {i['wall_s']:.0f} s ({i['runs']} runs)" for i in doc["invocations"])
            + " of `scripts/gpu-ckpt.sh bench`, each within the 10-minute limit.")
    elif doc.get("wall_s"):
        lines.append(f"The whole run took {doc['wall_s']:.0f} s of GPU machine time.")
    for r in doc["runs"]:
        if r and r.get("restore_err"):
            why = r["restore_err"].splitlines()[0][:160]
            lines.append(f"Restore failed: {r.get('job', 'mlp')} {r['engine']} at {r['gib']:g} GiB (rep {r.get('rep')}"
                         f"{', invocation ' + str(r['invocation']) if 'invocation' in r else ''}): {why}")
    for sk in doc.get("skipped") or []:
        rep = f" (rep {sk['rep']})" if "rep" in sk else ""
        lines.append(f"Not run: {sk.get('job', 'mlp')} {sk['engine']} at {sk['gib']:g} GiB{rep}: {sk['why']}.")
    if any(r and r.get("chained") for r in doc["runs"]):
        lines.append("A cell's repetitions are one job lineage: the first checkpoints the freshly "
                     "started job, the next ones the job the previous repetition restored (fresh "
                     "start to first step: first repetitions only).")
    if not any(r and r.get("engine") == "none" for r in doc["runs"]):
        lines.append("Steady-state overhead: the step time with possum loaded against the `driver` "
                     "job's before its first checkpoint (a job without possum, not yet checkpointed).")
    lines.append("The stall's parts are `possum checkpoint`'s own timings of each step taken while "
                 "the job is held; the stall itself is the job's largest gap between steps minus a "
                 "normal step.")
    lines.append(f"Restore throughput is against a PCIe ceiling of {PCIE_GBPS:.0f} GB/s: the job's GPU "
                 "state (the size of possum's GPU image of the same case) over the time the driver, or "
                 "possum's resume, took to put it back. "
                 "`possum`: the full checkpoint (CRIU + driver residue + possum's buffers); until "
                 "2026-11-23 of a job held by parking its threads (CUPTI off), from 2026-11-24 of a "
                 "job seen through the driver's entry points and held at possum's op gate "
                 "(eval/results/README.md); `possum-hold`: the thread-parking hold "
                 "(`POSSUM_HOOKS=off`); "
                 "`possum-none`: possum loaded with CUPTI, no checkpoint (the steady-state "
                 "overhead of its launch hooks); `gpu-only`: possum's GPU side alone on a CUPTI "
                 "job (pre-copy, release, on-demand restore; no process image); `none`: the job "
                 "alone.")
    return "\n".join(lines) + "\n"


def plots(doc, summary, stem):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("report: matplotlib not installed: no PNG plots (pip install matplotlib)", file=sys.stderr)
        return []
    made = []
    runs = [r for r in doc["runs"] if r and r.get("timeline")]
    cases = sorted({case(r) for r in runs})
    for g in cases:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        # The first repetition of each engine (of the first invocation that has one).
        shown = set()
        for r in runs:
            if case(r) == g and r.get("rep", 0) == 0 and r["engine"] not in shown:
                shown.add(r["engine"])
                t = [p[0] for p in r["timeline"]]
                v = [p[1] for p in r["timeline"]]
                ax.plot(t, v, label=r["engine"], drawstyle="steps-pre")
        ax.set_yscale("log")
        ax.set_xlabel("seconds since the checkpoint began")
        ax.set_ylabel("time between steps (ms)")
        one_job = len({j for j, _ in cases}) == 1
        ax.set_title(f"Step times around a checkpoint, {'' if one_job else g[0] + ', '}"
                     f"{g[1]:g} GiB of extra state")
        ax.legend()
        fig.tight_layout()
        path = f"{stem}-stall-{g[1]:g}g.png" if one_job else f"{stem}-stall-{g[0]}-{g[1]:g}g.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    engines = doc.get("engines") or sorted({e for _, e in summary})
    sizes = sorted({g for g, _ in summary})
    keys = [m for m in METRICS if any(m[0] in c for c in summary.values())]
    if keys:
        fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.2))
        axes = axes if len(keys) > 1 else [axes]
        w = 0.8 / max(1, len(engines))
        for ax, (key, name, unit, _) in zip(axes, keys):
            for i, e in enumerate(engines):
                ys = [summary.get((g, e), {}).get(key, (0,))[0] for g in sizes]
                ax.bar([j + i * w for j in range(len(sizes))], ys, w, label=e)
            ax.set_xticks([j + w * (len(engines) - 1) / 2 for j in range(len(sizes))])
            ax.set_xticklabels([f"{label(g, sizes)} GiB" for g in sizes], fontsize=7)
            ax.set_title(f"{name} ({unit})", fontsize=9)
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        path = f"{stem}-bars.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made


def update_readme(readme, md, stem):
    text = open(readme).read()
    begin, end = "<!-- results:begin -->", "<!-- results:end -->"
    if begin not in text or end not in text:
        raise SystemExit(f"{readme}: no {begin} ... {end} markers")
    block = (f"{begin}\n<!-- generated by eval/report.py from {os.path.basename(stem)}.json; "
             f"do not edit by hand -->\n\n{md}\n{end}")
    text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    open(readme, "w").write(text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bench", nargs="+", help="one bench.json, or several runs of the same matrix "
                    "to pool (their runs are merged; each run's wall time is listed)")
    ap.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--readme")
    ap.add_argument("--suffix", default="", help="appended to the files' name (<date>-<gpu><suffix>), "
                    "so that a second run of one day keeps the first's files")
    a = ap.parse_args()
    docs = [json.load(open(b)) for b in a.bench]
    doc = docs[0]
    if len(docs) > 1:
        # Pooled runs of one matrix: repetitions numbered across them, provenance kept.
        doc = dict(docs[0])
        doc["runs"] = []
        for i, d in enumerate(docs):
            for r in d["runs"]:
                if r:
                    doc["runs"].append({**r, "invocation": i})
        doc["skipped"] = [s for d in docs for s in d.get("skipped") or []]
        doc["wall_s"] = sum(d.get("wall_s") or 0 for d in docs)
        doc["invocations"] = [{"wall_s": d.get("wall_s"), "runs": len(d["runs"])} for d in docs]
    gpu = re.sub(r"[^a-z0-9]+", "-", (doc.get("gpu") or "gpu").split(",")[0].lower()).strip("-")
    stem = os.path.join(a.results, f"{doc.get('date', 'undated')}-{gpu}{a.suffix}")
    if len(docs) > 1:
        with open(stem + ".json", "w") as f:
            json.dump(doc, f)
    elif os.path.abspath(a.bench[0]) != os.path.abspath(stem + ".json"):
        shutil.copyfile(a.bench[0], stem + ".json")
    summary = summarise(doc)
    md = table(doc, summary)
    open(stem + ".md", "w").write(md)
    made = plots(doc, summary, stem)
    if a.readme:
        update_readme(a.readme, md, stem)
    print(md)
    print("wrote", stem + ".json", stem + ".md", *made)


if __name__ == "__main__":
    main()
