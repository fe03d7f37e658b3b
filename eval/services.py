"""Jobs with sockets and NCCL under `possum run`, checkpointed, restored and migrated as a user
would: the model server (workloads/gpu/server.py) under a steady load, and one-rank torchrun
DDP and FSDP jobs (workloads/gpu/ddp.py). Run by scripts/gpu-services.sh on a GPU machine.

    python3 eval/services.py server --out DIR [--rate 20] [--settle-s 5]
    python3 eval/services.py ranks --out DIR [--modes ddp,fsdp] [--trials 5] [--steps 240]
    python3 eval/services.py nccl-init --out DIR          torchrun DDP under possum run, to its end

Environment: POSSUM (the possum binary), POSSUM_LIB, POSSUM_CRIU (as possum reads them).

server: the server under `possum run`, clients at --rate requests/s over persistent TCP
connections, new TCP and Unix connections and UDP pings (workloads/gpu/client.py), while the
server is (1) checkpointed left running with --tcp-established, (2) checkpointed and killed,
then restored, (3) migrated over loopback to a `possum receive` on this host. Every answer is
compared with a bare server's (server.py --reference, run without possum); for each operation
the longest latency of a request that was open during it. -> DIR/server.json, server-client.jsonl

ranks: per mode, a reference run without possum, then --trials runs under `possum run`, each
(1) checkpointed left running, (2) checkpointed, killed and restored, (3) migrated over loopback,
at random steps (--tcp-established: torchrun's agent and rank talk over TCPStore). Each run's
step log must equal the reference's (every field but the time). The gap each operation made in
the job's step log is its stall. -> DIR/ranks.json, ranks-logs/
"""
import argparse, json, os, random, re, signal, subprocess, sys, threading, time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GPU = os.path.join(ROOT, "workloads", "gpu")
POSSUM = os.environ.get("POSSUM", os.path.join(ROOT, ".gpu", "possum"))


def now():
    return time.time()


def memory_of(pid):
    """Process `pid`'s host memory as the kernel counts it (kB from smaps_rollup) and its
    mappings; empty if it cannot be read."""
    rec = {}
    try:
        for line in open(f"/proc/{pid}/smaps_rollup"):
            k, _, v = line.partition(":")
            if k in ("Rss", "Anonymous", "Private_Dirty", "Private_Clean", "Shared_Clean", "AnonHugePages"):
                rec[k.lower() + "_kb"] = int(v.split()[0])
        rec["mappings"] = sum(1 for _ in open(f"/proc/{pid}/maps"))
    except OSError:
        pass
    return rec


def run_json(args, timeout, log, env=None):
    """Runs possum ARGS (with --json), with ENV added to the environment, returns (rc, parsed
    stdout or None, seconds, stderr tail)."""
    t = now()
    try:
        p = subprocess.run([POSSUM] + args, capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, **(env or {})))
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = 124, e.stdout or "", (e.stderr or "") + f"\nTIMEOUT after {timeout} s"
        out = out.decode() if isinstance(out, bytes) else out
        err = err.decode() if isinstance(err, bytes) else err
    dt = now() - t
    with open(log, "a") as f:
        f.write(f"$ possum {' '.join(args)}\nrc {rc} in {dt:.2f} s\n{out}\n{err}\n")
    parsed = None
    for line in reversed(out.strip().splitlines()):
        try:
            parsed = json.loads(line)
            break
        except ValueError:
            continue
    return rc, parsed, dt, err.strip().splitlines()[-8:]


def wait_for(pred, timeout, step=0.05):
    end = now() + timeout
    while now() < end:
        v = pred()
        if v:
            return v
        time.sleep(step)
    return None


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return ") Z " not in f.read()
    except OSError:
        return False


def kill_tree(pid):
    try:
        kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    except OSError:
        kids = []
    for k in kids:
        kill_tree(int(k))
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


class Receiver:
    """`possum receive` of one migration on a free loopback port."""

    def __init__(self, work, key, log, env=None):
        self.err = open(os.path.join(work, "receive.err"), "w")
        self.p = subprocess.Popen([POSSUM, "receive", "--listen", "127.0.0.1:0", "--key-file", key,
                                   "-D", os.path.join(work, "received"), "--json"],
                                  stdout=subprocess.PIPE, stderr=self.err, text=True,
                                  env=dict(os.environ, **(env or {})))
        errf = os.path.join(work, "receive.err")

        def port():
            m = re.search(r"receiving on 127\.0\.0\.1:(\d+)", open(errf).read())
            return m and int(m.group(1))
        self.port = wait_for(port, 30)

    def result(self, timeout=120):
        try:
            out, _ = self.p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            out, _ = self.p.communicate()
        self.err.close()
        try:
            return json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return None


def release_digest(reply):
    """What the job's library said of its release in the hold (`possum checkpoint`'s
    `release_report`): its time, the final copy's, each device's copy, the bytes released and
    trimmed; None without one."""
    r = reply
    if not isinstance(r, dict):
        return None
    keep = ("ms", "final_copy_ms", "detach_ms", "released_bytes", "staging_freed_bytes",
            "context_trimmed_bytes", "imports_released", "buffers_released_ms",
            "staging_freed_ms", "context_trimmed_ms")
    out = {k: r.get(k) for k in keep if k in r}
    # (Each device's copy while held, which the job names `final`.)
    # (`pipeline`: where its time went, each stage summed over its threads.)
    # (`sync_ms`: the devices' fence before it; `commit_ms`: its image committed after.)
    out["finals"] = [{k: f.get(k) for k in ("buffers", "bytes", "ms", "image_bytes", "pipeline",
                                            "shadows_saved_by_keeper", "sync_ms", "commit_ms")}
                     for f in r.get("final") or []]
    return out


def new_key(work):
    key = os.path.join(work, "migrate.key")
    with open(key, "wb") as f:
        f.write(os.urandom(32))
    os.chmod(key, 0o600)
    return key


def operate(op, pid, work, tag, log, extra):
    """Does operation OP to the job PID: "running" (checkpoint left running), "restore"
    (checkpoint, killed, restored) or "migrate" (over loopback). Returns a record with its
    start and end times, what possum said, and the job's PID after it."""
    rec = {"op": op, "start": now()}
    img = os.path.join(work, f"img-{tag}")
    if op == "running":
        rc, j, dt, err = run_json(["checkpoint", str(pid), "-D", img, "--leave-running", "--json"] + extra, 240, log)
        rec.update(rc=rc, possum=j, seconds=dt, err=err if rc else None, pid=pid)
    elif op == "restore":
        rc, j, dt, err = run_json(["checkpoint", str(pid), "-D", img, "--json"] + extra, 240, log)
        rec.update(rc=rc, possum=j, seconds=dt, err=err if rc else None)
        if rc == 0:
            wait_for(lambda: not alive(pid), 30)
            rc2, j2, dt2, err2 = run_json(["restore", "-D", img, "--json"], 240, log)
            rec.update(restore_rc=rc2, restore=j2, restore_seconds=dt2, restore_err=err2 if rc2 else None)
        rec["pid"] = pid
    elif op == "migrate":
        key = new_key(work)
        r = Receiver(work, key, log)
        rc, j, dt, err = run_json(["migrate", str(pid), "--to", f"127.0.0.1:{r.port}", "--key-file", key,
                                   "-D", img, "--json"] + extra, 300, log)
        rec.update(rc=rc, possum=j, seconds=dt, err=err if rc else None, received=r.result())
        rec["pid"] = (j or {}).get("remote_pid") or pid
    rec["end"] = now()
    return rec


# ---- the model server ------------------------------------------------------------------------

def server(a):
    work = a.work
    os.makedirs(work, exist_ok=True)
    log = os.path.join(a.out, "server-possum.log")
    port_file = os.path.join(work, "port")
    srv_err = open(os.path.join(a.out, "server.err"), "w")
    runner = subprocess.Popen([POSSUM, "run", "-v", "python3", os.path.join(GPU, "server.py"), "--port-file", port_file],
                              stdout=srv_err, stderr=srv_err, start_new_session=True)
    res = {"rate": a.rate, "ops": []}
    port = wait_for(lambda: os.path.exists(port_file) and open(port_file).read().strip(), 180)
    if not port:
        res["error"] = "the server did not listen within 180 s"
        return finish_server(a, res, runner, None)
    pid = int(wait_for(lambda: re.search(r"job pid (\d+)", open(srv_err.name).read()), 10).group(1))
    res["pid"] = pid
    stop = os.path.join(work, "stop")
    client_out = os.path.join(a.out, "server-client.jsonl")
    no_unix = os.path.join(work, "no-unix")
    client = subprocess.Popen([sys.executable, os.path.join(GPU, "client.py"), "--port", port, "--unix",
                               port_file + ".sock", "--no-unix", no_unix, "--out", client_out, "--stop", stop,
                               "--rate", str(a.rate), "--max-s", "400"])
    time.sleep(a.settle_s)
    for op in a.ops.split(","):
        # CRIU dumps no half of a Unix stream connection to a process outside the job: the
        # client's Unix requests go over TCP while the job is checkpointed.
        open(no_unix, "w").close()
        time.sleep(0.5)
        rec = operate(op, pid, work, op, log, ["--tcp-established"])
        os.remove(no_unix)
        res["ops"].append(rec)
        print(f"server {op}: rc {rec['rc']} {rec.get('restore_rc', '')} in {rec['end'] - rec['start']:.2f} s", flush=True)
        if rec["rc"] != 0 or rec.get("restore_rc", 0) != 0:
            break
        pid = rec["pid"]
        res["pid_after"] = pid
        time.sleep(a.settle_s)
    open(stop, "w").close()
    try:
        client.wait(timeout=200)
    except subprocess.TimeoutExpired:
        client.kill()
    return finish_server(a, res, runner, client_out)


def end_job(pids, runner):
    """Kills what is left of a job: its trees `pids` (where it runs now) and `possum run`'s group."""
    for pid in set(pids) - {None}:
        kill_tree(pid)
    try:
        os.killpg(runner.pid, signal.SIGKILL)
    except OSError:
        pass
    runner.wait()


def finish_server(a, res, runner, client_out):
    end_job([res.get("pid"), res.get("pid_after")], runner)
    recs, summary = [], None
    if client_out and os.path.exists(client_out):
        for line in open(client_out):
            j = json.loads(line)
            if "summary" in j:
                summary = j["summary"]
            else:
                recs.append(j)
    res["client"] = summary
    reqs = [r for r in recs if r["kind"] != "udp"]
    if reqs:
        n = max(r["id"] for r in reqs) + 1
        ref = subprocess.run([sys.executable, os.path.join(GPU, "server.py"), "--reference", str(n)],
                             capture_output=True, text=True, timeout=300)
        want = dict(l.split(" ", 1) for l in ref.stdout.splitlines())
        got = {r["id"]: r["answer"] for r in reqs}
        res["requests"] = n
        res["answered"] = sum(1 for v in got.values() if v is not None)
        res["missing"] = [i for i in range(n) if got.get(i) is None][:20]
        res["wrong"] = [i for i in range(n) if got.get(i) is not None and got[i] != want.get(str(i))][:20]
        res["reference_answers"] = len(want)
        res["all_right"] = not res["missing"] and not res["wrong"] and len(want) == n
        res["pings_answered"] = sum(1 for r in recs if r["kind"] == "udp" and r["answer"] == "pong")
        res["pings"] = sum(1 for r in recs if r["kind"] == "udp")
        by_kind = {}
        for r in reqs:
            by_kind.setdefault(r["kind"], 0)
            by_kind[r["kind"]] += 1
        res["by_kind"] = by_kind
        lat = lambda r: r["done"] - r["due"]
        for op in res["ops"]:
            during = [lat(r) for r in reqs if r["answer"] is not None and r["due"] <= op["end"] and r["done"] >= op["start"]]
            op["max_latency_s"] = max(during) if during else None
            op["requests_during"] = len(during)
        quiet = [lat(r) for r in reqs if r["answer"] is not None
                 and not any(r["due"] <= o["end"] + 1 and r["done"] >= o["start"] - 1 for o in res["ops"])]
        quiet.sort()
        res["steady_latency_s"] = {"median": quiet[len(quiet) // 2] if quiet else None,
                                   "max": quiet[-1] if quiet else None}
    with open(os.path.join(a.out, "server.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: res.get(k) for k in ("requests", "answered", "all_right", "missing", "wrong", "pings",
                                              "pings_answered", "steady_latency_s")}))
    for op in res["ops"]:
        print(f"  {op['op']}: rc {op['rc']}, max latency {op.get('max_latency_s')}, "
              f"requests open during it {op.get('requests_during')}, possum says {brief(op)}")
    return 0 if res.get("all_right") and all(o["rc"] == 0 and o.get("restore_rc", 0) == 0 for o in res["ops"]) \
        and len(res["ops"]) == len(a.ops.split(",")) else 1


def brief(op):
    j = op.get("possum") or {}
    keys = ("stall_ms", "downtime_ms", "total_ms")
    out = {k: j.get(k) for k in keys if k in j}
    t = j.get("timings") or {}
    for k in ("downtime_ms", "total_ms"):
        if k in t:
            out[k] = t[k]
    if op.get("restore"):
        r = op["restore"]
        out["restore"] = {k: r.get(k) for k in ("total_ms", "restore_ms", "first_step_ms") if k in r} or "ok"
    if op.get("err"):
        out["err"] = op["err"][-3:]
    if op.get("restore_err"):
        out["restore_err"] = op["restore_err"][-3:]
    return out


# ---- one-rank torchrun jobs ------------------------------------------------------------------

def torchrun_cmd(mode, steps, log, port):
    return ["torchrun", "--nproc_per_node=1", "--master-port", str(port), os.path.join(GPU, "ddp.py"),
            "--mode", mode, "--steps", str(steps), "--sleep-ms", "25", "--step-log", log]


def rows(path):
    try:
        return [json.loads(l) for l in open(path)]
    except (OSError, ValueError):
        return []


def strip_t(rs):
    return [{k: v for k, v in r.items() if k != "t"} for r in rs]


def steps_done(path):
    return len([r for r in rows(path) if "step" in r])


def stall_of(rs, start, end):
    """The longest gap between consecutive step lines that overlaps [start, end]."""
    ts = [r["t"] for r in rs if "t" in r]
    gaps = [b - a for a, b in zip(ts, ts[1:]) if b >= start and a <= end]
    return max(gaps) if gaps else None


def ranks(a):
    os.makedirs(a.work, exist_ok=True)
    logs = os.path.join(a.out, "ranks-logs")
    os.makedirs(logs, exist_ok=True)
    rng = random.Random(a.seed)
    res = {"steps": a.steps, "trials": []}
    port = 29640
    for mode in a.modes.split(","):
        ref = os.path.join(logs, f"ref-{mode}.log")
        for p in (ref, ref + ".rank0"):
            if os.path.exists(p):
                os.remove(p)
        port += 1
        t = now()
        p = subprocess.run(torchrun_cmd(mode, a.steps, ref, port), capture_output=True, text=True, timeout=300)
        res[f"reference_{mode}"] = {"rc": p.returncode, "seconds": round(now() - t, 1), "lines": len(rows(ref + ".rank0"))}
        if p.returncode != 0:
            res[f"reference_{mode}"]["err"] = p.stderr[-2000:]
            print(f"reference {mode} failed: {p.stderr[-2000:]}", flush=True)
            continue
        want = strip_t(rows(ref + ".rank0"))
        for trial in range(a.trials):
            if now() > a.deadline - 45:
                res.setdefault("skipped", []).append(f"{mode} {trial}")
                continue
            port += 1
            res["trials"].append(one_rank_trial(a, mode, trial, want, logs, rng, port))
    with open(os.path.join(a.out, "ranks.json"), "w") as f:
        json.dump(res, f, indent=1)
    ok = [t for t in res["trials"] if t["bit_exact"] and t["all_ops_ok"]]
    print(f"ranks: {len(ok)}/{len(res['trials'])} trials bit-exact with every operation done; skipped {res.get('skipped')}")
    return 0 if res["trials"] and len(ok) == len(res["trials"]) else 1


def one_rank_trial(a, mode, trial, want, logs, rng, port):
    work = os.path.join(a.work, f"{mode}-{trial}")
    subprocess.run(["rm", "-rf", work])
    os.makedirs(work)
    log = os.path.join(logs, f"{mode}-{trial}.log")
    for p in (log, log + ".rank0"):
        if os.path.exists(p):
            os.remove(p)
    plog = os.path.join(logs, f"{mode}-{trial}-possum.log")
    err = open(os.path.join(logs, f"{mode}-{trial}.err"), "w")
    runner = subprocess.Popen([POSSUM, "run", "-v"] + torchrun_cmd(mode, a.steps, log, port), stdout=err, stderr=err,
                              start_new_session=True)
    rec = {"mode": mode, "trial": trial, "ops": []}
    pid_m = wait_for(lambda: re.search(r"job pid (\d+)", open(err.name).read()), 30)
    pid = int(pid_m.group(1)) if pid_m else None
    rank_log = log + ".rank0"
    # Three operations at random steps, spread over the run.
    marks = sorted(rng.sample(range(20, a.steps - 40), 3))
    ops = ["running", "restore", "migrate"]
    for op, at in zip(ops, marks):
        if pid is None or not wait_for(lambda: steps_done(rank_log) >= at, 180):
            rec["error"] = f"the job did not reach step {at} before {op}"
            break
        r = operate(op, pid, work, op, plog, ["--tcp-established"])
        r["at_step"] = at
        rec["ops"].append(r)
        print(f"{mode} {trial} {op} at {at}: rc {r['rc']} {r.get('restore_rc', '')} in {r['end'] - r['start']:.2f} s",
              flush=True)
        if r["rc"] != 0 or r.get("restore_rc", 0) != 0:
            break
        pid = r["pid"]
    done = wait_for(lambda: any("final" in x for x in rows(rank_log)), 240) if "error" not in rec else None
    got = rows(rank_log)
    rec["lines"] = len(got)
    rec["bit_exact"] = bool(done) and strip_t(got) == want
    if not rec["bit_exact"]:
        g = strip_t(got)
        first = next((i for i, (x, y) in enumerate(zip(g, want)) if x != y), min(len(g), len(want)))
        rec["first_difference"] = {"line": first, "got": g[first] if first < len(g) else None,
                                   "want": want[first] if first < len(want) else None}
    rec["all_ops_ok"] = len(rec["ops"]) == 3 and all(o["rc"] == 0 and o.get("restore_rc", 0) == 0 for o in rec["ops"])
    for o in rec["ops"]:
        o["stall_s"] = stall_of(got, o["start"], o["end"])
    end_job([pid], runner)
    err.close()
    print(f"{mode} {trial}: bit-exact {rec['bit_exact']}, ops ok {rec['all_ops_ok']}, stalls "
          f"{[round(o['stall_s'] or 0, 2) for o in rec['ops']]}", flush=True)
    return rec


def nccl_init(a):
    """torchrun DDP (one rank) under possum run to its end, with NCCL's warnings: the smoke test
    of NCCL under libpossum.so."""
    log = os.path.join(a.out, "nccl-init.log")
    env = dict(os.environ, NCCL_DEBUG="WARN")
    t = now()
    p = subprocess.run([POSSUM, "run"] + torchrun_cmd("ddp", 30, log, 29631), capture_output=True, text=True,
                       timeout=240, env=env)
    with open(os.path.join(a.out, "nccl-init.err"), "w") as f:
        f.write(p.stdout + p.stderr)
    lines = rows(log + ".rank0")
    print(f"nccl-init: rc {p.returncode} in {now() - t:.1f} s, {len(lines)} lines, final: {any('final' in r for r in lines)}")
    if p.returncode != 0:
        print(p.stderr[-3000:])
    return p.returncode


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["server", "ranks", "nccl-init"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/dev/shm/possum-services")
    ap.add_argument("--rate", type=float, default=20)
    ap.add_argument("--settle-s", type=float, default=5)
    ap.add_argument("--ops", default="running,restore,migrate")
    ap.add_argument("--modes", default="ddp,fsdp")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--budget-s", type=float, default=540)
    a = ap.parse_args()
    a.deadline = now() + a.budget_s
    os.makedirs(a.out, exist_ok=True)
    return {"server": server, "ranks": ranks, "nccl-init": nccl_init}[a.what](a)


if __name__ == "__main__":
    sys.exit(main())
