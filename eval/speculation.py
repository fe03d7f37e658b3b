"""Validated speculation by content, measured on a job that reads most of its memory: weights only
read every step (fp16, --gib) and a state written whole every step (--state-mib), under
`possum run`, in these modes in the same run:

    strict       POSSUM_VALIDATE=strict POSSUM_FINGERPRINTS=0: no read-only speculation, no
                 fingerprints (every buffer a kernel names counts as written; a kept save
                 snapshots every buffer into a shadow while the job is held)
    speculative  the defaults: read-only speculation earned by validated launches, every image
                 proven by fingerprints, only changed chunks copied
    speculative-2mib  the same with 2 MiB chunks (POSSUM_CHUNK_MIB=2)
    speculative-16loaders  the defaults, the keeper staging a restore with 16 loader threads

For each mode, one job: (1) a kept checkpoint (--leave-running), (2) a second one with
--parent (1), (3) `possum migrate` over loopback to a `possum receive` on this host. Recorded:
what was copied while the job was held, the stall in the job's own step log, the images' data
bytes, the pre-copy rounds' bytes against what the job writes each step (it reports its
allocator's peak beyond the weights), the migration's downtime (the gap in the step log).
Run by scripts/gpu-speculation.sh on a GPU machine.

    python3 eval/speculation.py frozen --out DIR [--gib 8] [--state-mib 64] [--modes strict,speculative]

Environment: POSSUM (the possum binary), POSSUM_LIB, POSSUM_CRIU (as possum reads them).
-> DIR/speculation.jsonl (a line per mode), DIR/speculation-possum.log
"""
import argparse, json, os, re, shutil, subprocess, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from services import POSSUM, GPU, Receiver, alive, kill_tree, memory_of, new_key, release_digest, run_json, wait_for  # noqa: E402

MODES = {
    "strict": {"POSSUM_VALIDATE": "strict", "POSSUM_FINGERPRINTS": "0"},
    "speculative": {},
    # The same with 2 MiB chunks (copies, images and fingerprints): finer rounds.
    "speculative-2mib": {"POSSUM_CHUNK_MIB": "2"},
    # The defaults, the keeper loading a restore's image with 16 threads (8 by default).
    "speculative-16loaders": {"POSSUM_KEEPER_STAGE_THREADS": "16"},
}


def steps_of(log):
    out = []
    try:
        for line in open(log):
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if "step" in r and "t" in r:
                out.append((r["step"], r["t"]))
    except OSError:
        pass
    return out


def stall(log, t0, t1, step_s):
    """The time the job lost around [t0, t1]: its longest gap between two step lines, less one
    ordinary step, and what each step right after it took beyond one while they took more than
    two (a job that runs again and then waits for buffers not back yet shows that wait as a
    slow step of its own)."""
    ts = [t for _, t in steps_of(log) if t0 - 2 <= t <= t1 + 5]
    return lost_time([b - a for a, b in zip(ts, ts[1:])], step_s)


def lost_time(gaps, step_s):
    """[`stall`] over the gaps between step lines."""
    if not gaps:
        return 0.0
    i = max(range(len(gaps)), key=lambda k: gaps[k])
    lost = gaps[i] - step_s
    for g in gaps[i + 1:]:
        if g <= 2 * step_s:
            break
        lost += g - step_s
    return max(0.0, lost)


def writes_of(log):
    """What the job reported writing each step (its allocator's peak beyond the weights)."""
    try:
        for line in open(log):
            if line.startswith('{"writes"'):
                return json.loads(line)["writes"]
    except (OSError, ValueError, KeyError):
        pass
    return None


def step_time(log):
    ts = [t for _, t in steps_of(log)][-20:]
    gaps = sorted(b - a for a, b in zip(ts, ts[1:]))
    return gaps[len(gaps) // 2] if gaps else 0.0


def saved_copies(j):
    """From a kept checkpoint's JSON: (bytes copied while held, snapshot shadows, buffers saved
    by copy-on-write after the job resumed, image bytes,
    bytes proven, bytes reused, fingerprint ms, mismatch retries)."""
    held = shadows = cow = image = proven = reused = 0
    fp_ms = waited_ms = 0.0
    rel = (j or {}).get("release_report") or {}
    for f in rel.get("finals") or []:
        held += f.get("bytes") or 0
    for s in (j or {}).get("saved_report") or []:
        for d in (s.get("report") or {}).get("saved") or []:
            if d.get("snapshot_shadows"):
                shadows += d["snapshot_shadows"]
                held += d.get("shadow_peak") or 0
            cow += (d.get("cow_shadow") or 0) - (d.get("snapshot_shadows") or 0) + (d.get("cow_priority") or 0)
            image += d.get("image_bytes") or 0
            proven += d.get("proven_bytes") or 0
            reused += d.get("reused_bytes") or 0
            fp_ms += d.get("fingerprint_ms") or 0.0
            waited_ms += d.get("job_waited_ms") or 0.0
    return {"held_copy_bytes": held, "snapshot_shadows": shadows, "copy_on_write": cow, "image_bytes": image,
            "proven_bytes": proven, "reused_bytes": reused, "fingerprint_ms": fp_ms,
            "job_waited_ms": waited_ms,
            "mismatch_retries": (j or {}).get("mismatch_retries")}


def keep_criu_logs(src, out, tag):
    """Copies CRIU's logs and statistics under SRC (an image directory) to OUT, named by TAG."""
    for root, _, files in os.walk(src):
        for f in files:
            if f.endswith(".log") or f.startswith("stats-"):
                shutil.copy(os.path.join(root, f), os.path.join(out, f"criu-{tag}-{f}"))


def one_mode(a, mode, work, log):
    env = dict(os.environ, **MODES[mode])
    jlog = os.path.join(work, f"{mode}-steps.jsonl")
    if os.path.exists(jlog):
        os.remove(jlog)  # an earlier run's steps are not this job's
    err = open(os.path.join(a.out, f"speculation-{mode}.err"), "w")
    cmd = [POSSUM, "run", "-v"] + a.run_flags.split() + [
        "python3", os.path.join(GPU, "jobs.py"), "mlp", "--steps", "1000000",
        "--hold-gib", str(a.gib), "--ballast-read-all", "--ballast-half", "--state-mib", str(a.state_mib),
        "--sleep-ms", str(a.sleep_ms), "--log", jlog, "--report-writes"]
    runner = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
    rec = {"mode": mode, "gib": a.gib, "state_mib": a.state_mib, "env": MODES[mode]}
    m = wait_for(lambda: re.search(r"job pid (\d+)", open(err.name).read()), 60)
    pid = int(m.group(1)) if m else None
    pids = [pid] if pid else []
    try:
        if not pid or not wait_for(lambda: len(steps_of(jlog)) >= a.warmup, a.warmup_timeout):
            rec["error"] = (f"the job did not make {a.warmup} steps in {a.warmup_timeout} s "
                            f"({len(steps_of(jlog))} made): " + open(err.name).read()[-1500:])
            print(f"{mode}: {rec['error']}", flush=True)
            if os.path.exists(jlog):
                shutil.copy(jlog, os.path.join(a.out, f"speculation-{mode}-steps.jsonl"))
            return rec
        rec["step_ms"] = 1e3 * step_time(jlog)
        rec["memory"] = memory_of(pid)
        criu_env = {"POSSUM_CRIU_LOG_LEVEL": "4"} if a.criu_log else {}
        rec["writes_per_step"] = writes_of(jlog)
        step_s = rec["step_ms"] / 1e3
        imgs = [os.path.join(a.images, f"{mode}-{n}") for n in (1, 2, 3)]
        for d in imgs:
            shutil.rmtree(d, ignore_errors=True)
        # (1) and (2): kept checkpoints, the second beside the first.
        for n, extra in () if a.migrate_only else ((1, []), (2, ["--parent", imgs[0]])):
            t0 = time.time()
            rc, j, dt, e = run_json(["checkpoint", str(pid), "-D", imgs[n - 1], "--leave-running", "--json"]
                                    + extra, 300, log, criu_env)
            if a.criu_log:
                keep_criu_logs(imgs[n - 1], a.out, f"{mode}-ckpt{n}")
            t1 = time.time()
            time.sleep(3)
            rec[f"ckpt{n}"] = dict(rc=rc, seconds=dt, err=e if rc else None,
                                   stall_s=stall(jlog, t0, t1, step_s), **saved_copies(j))
            print(f"{mode} checkpoint {n}: rc {rc} in {dt:.2f} s: {rec[f'ckpt{n}']}", flush=True)
            if rc:
                return rec
        for d in imgs[:2]:
            shutil.rmtree(d, ignore_errors=True)
        # (3): migrate over loopback.
        key = new_key(work)
        r = Receiver(work, key, log, criu_env)
        t0 = time.time()
        rc, j, dt, e = run_json(["migrate", str(pid), "--to", f"127.0.0.1:{r.port}", "--key-file", key,
                                 "-D", imgs[2], "--json"] + a.migrate_flags.split(), a.migrate_timeout, log)
        t1 = time.time()
        received = r.result()
        remote = (j or {}).get("remote_pid")
        if remote:
            pids.append(remote)
        before = len(steps_of(jlog))
        wait_for(lambda: len(steps_of(jlog)) >= before + 5, 60)
        rounds = ((j or {}).get("checkpoint") or {}).get("figures", {}).get("precopy_rounds") or []
        rec["migrate"] = dict(rc=rc, seconds=dt, err=e if rc else None, downtime_s=stall(jlog, t0, t1, step_s),
                              rounds=[r.get("bytes") for r in rounds], round_ms=[r.get("ms") for r in rounds],
                              bytes=(j or {}).get("bytes"), bytes_before_hold=(j or {}).get("bytes_before_hold"),
                              bytes_while_held=(j or {}).get("bytes_while_held"),
                              bytes_while_dumping=(j or {}).get("bytes_while_dumping"),
                              criu_bytes_while_dumping=(j or {}).get("criu_bytes_while_dumping"),
                              bytes_while_copying=(j or {}).get("bytes_while_copying"),
                              rounds_while_copying=(j or {}).get("rounds_while_copying"),
                              bytes_while_first_round=(j or {}).get("bytes_while_first_round"),
                              rounds_while_first_round=(j or {}).get("rounds_while_first_round"),
                              post_copy=(j or {}).get("post_copy"),
                              loaded_ahead=(j or {}).get("loaded_ahead"),
                              timings=(j or {}).get("timings"), received_ok=bool(received),
                              received=(received or {}).get("timings"),
                              remote_restore=(received or {}).get("restore"),
                              prestaged=(received or {}).get("prestaged"),
                              staged=(received or {}).get("staged"),
                              stage_skipped=(received or {}).get("stage_skipped"),
                              source=((j or {}).get("checkpoint") or {}).get("figures"),
                              release=release_digest(((j or {}).get("checkpoint") or {}).get("release_report")))
        # The job's step lines around the migration, in seconds from its start: where the gap
        # falls, and the steps on either side of it.
        rec["migrate"]["steps_around"] = [[k, round(t - t0, 4)] for k, t in steps_of(jlog)
                                          if t0 - 2 <= t <= t1 + 5]
        w = rec.get("writes_per_step")
        sent = rec["migrate"]["rounds"]
        if w and len(sent) > 1 and sent[1] is not None:
            # Round 2 sends what changed during round 1: the job's writes, at least once over.
            rec["migrate"]["round2_over_writes"] = sent[1] / w
        print(f"{mode} migrate: rc {rc} in {dt:.2f} s: {rec['migrate']}", flush=True)
        shutil.copy(os.path.join(work, "receive.err"), os.path.join(a.out, f"speculation-{mode}-receive.err"))
        if a.criu_log:
            keep_criu_logs(os.path.join(work, "received"), a.out, f"{mode}-received")
        shutil.rmtree(imgs[2], ignore_errors=True)
        shutil.rmtree(os.path.join(work, "received"), ignore_errors=True)
        return rec
    finally:
        for p in pids:
            if p and alive(p):
                kill_tree(p)
        try:
            os.killpg(runner.pid, 9)
        except OSError:
            pass
        runner.wait()
        err.close()


def frozen(a):
    os.makedirs(a.out, exist_ok=True)
    work = os.path.join(a.work, "speculation")
    os.makedirs(work, exist_ok=True)
    os.makedirs(a.images, exist_ok=True)
    log = os.path.join(a.out, "speculation-possum.log")
    out = os.path.join(a.out, "speculation.jsonl")
    for mode in a.modes.split(","):
        rec = one_mode(a, mode, work, log)
        with open(out, "a") as f:
            f.write(json.dumps(rec) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["frozen"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/possum-eval")
    ap.add_argument("--images", default="/dev/shm/possum-speculation")
    ap.add_argument("--gib", type=float, default=8)
    ap.add_argument("--state-mib", type=float, default=64)
    ap.add_argument("--sleep-ms", type=float, default=20)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--modes", default="strict,speculative,speculative-2mib")
    ap.add_argument("--migrate-flags", default="")
    ap.add_argument("--run-flags", default="", help="more of `possum run`'s flags (--no-keeper)")
    ap.add_argument("--migrate-timeout", type=float, default=400)
    ap.add_argument("--warmup-timeout", type=float, default=240)
    ap.add_argument("--migrate-only", action="store_true",
                    help="only the migration (3), without the kept checkpoints (1) and (2)")
    ap.add_argument("--criu-log", action="store_true",
                    help="CRIU's log at level 4 for the checkpoints and the destination's restore, "
                         "copied with its statistics to --out (slows CRIU a little)")
    a = ap.parse_args()
    frozen(a)


if __name__ == "__main__":
    main()
