"""What a GPU job's host memory is made of: the pages CRIU writes at every checkpoint.

    python3 eval/hostmem.py --out DIR [--job mlp] [--possum] [-- JOB FLAGS...]

Runs workloads/gpu/jobs.py JOB (under `possum run` with --possum), waits for its steps, then
reads /proc/PID/smaps: the private dirty and anonymous kB of each mapping, summed by what backs
it (a library's file, the heap, anonymous memory, a device), the largest listed. At step
--trim-step the job calls glibc's malloc_trim(0) and logs what that gave back and took. Writes
DIR/hostmem-TAG.json and prints a summary.
"""
import argparse, json, os, re, subprocess, sys, time

HERE = os.path.dirname(os.path.abspath(__file__))
JOBS = os.path.join(HERE, "..", "workloads", "gpu", "jobs.py")


def census(pid):
    """Per mapping (start, end, name): Private_Dirty, Anonymous and Rss in kB."""
    maps, cur = [], None
    for line in open(f"/proc/{pid}/smaps"):
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \d+\s*(.*)$", line)
        if head:
            cur = {"start": head.group(1), "perms": head.group(3), "name": head.group(4) or "[anon]",
                   "size_kb": (int(head.group(2), 16) - int(head.group(1), 16)) >> 10,
                   "private_dirty": 0, "anonymous": 0, "rss": 0}
            maps.append(cur)
            continue
        k, _, v = line.partition(":")
        if cur is not None and k in ("Private_Dirty", "Anonymous", "Rss"):
            cur[k.lower()] = int(v.split()[0])
    return maps


def block_hashes(pid, maps, block=1 << 16):
    """The hash of every BLOCK bytes of the private writable mappings with dirty pages, read
    through /proc/PID/mem (unreadable ranges skipped): {(start, i): hash}."""
    import hashlib
    out = {}
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for m in maps:
            if "w" not in m["perms"] or m["private_dirty"] == 0 or m["name"].startswith("/dev/"):
                continue
            start = int(m["start"], 16)
            size = m["size_kb"] * 1024
            for i in range(0, size, block):
                try:
                    mem.seek(start + i)
                    out[(start, i)] = hashlib.blake2b(mem.read(min(block, size - i)), digest_size=16).digest()
                except OSError:
                    pass
    return out


def changed_between(pid, maps, secs):
    """Bytes of 64 KiB blocks of the job's private memory whose content changed in SECS seconds."""
    t = time.time()
    a = block_hashes(pid, maps)
    read_s = time.time() - t
    time.sleep(secs)
    b = block_hashes(pid, maps)
    changed = sum(1 for k, h in b.items() if a.get(k) != h)
    return {"blocks": len(b), "changed_blocks": changed, "changed_bytes": changed << 16,
            "seconds": secs, "read_s": read_s}


def kind_of(name):
    if name.startswith("/dev/"):
        return "device " + name
    if name.startswith("/"):
        return "file " + os.path.basename(name)
    return name


def summary(maps, top=25):
    by = {}
    for m in maps:
        k = kind_of(m["name"])
        s = by.setdefault(k, {"private_dirty": 0, "anonymous": 0, "rss": 0, "mappings": 0})
        for f in ("private_dirty", "anonymous", "rss"):
            s[f] += m[f]
        s["mappings"] += 1
    ranked = sorted(by.items(), key=lambda kv: -(kv[1]["private_dirty"] + kv[1]["anonymous"]))
    sizes = sorted((m["private_dirty"] for m in maps if m["name"] == "[anon]"), reverse=True)
    return {
        "private_dirty_kb": sum(m["private_dirty"] for m in maps),
        "anonymous_kb": sum(m["anonymous"] for m in maps),
        "file_private_dirty_kb": sum(m["private_dirty"] for m in maps if m["name"].startswith("/")
                                     and not m["name"].startswith("/dev/")),
        "top": ranked[:top],
        "largest_anon_kb": sizes[:15],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--job", default="mlp")
    ap.add_argument("--possum", action="store_true", help="run the job under `possum run` ($POSSUM)")
    ap.add_argument("--steps-before", type=int, default=40)
    ap.add_argument("--trim-step", type=int, default=60)
    ap.add_argument("--tag", default=None)
    ap.add_argument("rest", nargs="*", help="more of jobs.py's flags (after --)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    tag = a.tag or (a.job + ("-possum" if a.possum else "-bare"))
    log = os.path.join(a.out, f"hostmem-{tag}.steps")
    if os.path.exists(log):
        os.remove(log)
    cmd = ["python3", JOBS, a.job, "--steps", "1000000", "--log", log, "--trim-at-step", str(a.trim_step)] + a.rest
    if a.possum:
        cmd = [os.environ.get("POSSUM", "possum"), "run", "-v"] + cmd
    err = open(os.path.join(a.out, f"hostmem-{tag}.err"), "w")
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    rec = {"tag": tag, "cmd": cmd}
    try:
        pid = p.pid
        deadline = time.time() + 180
        if a.possum:
            pid = None
            while time.time() < deadline and pid is None:
                m = re.search(r"job pid (\d+)", open(err.name).read())
                pid = int(m.group(1)) if m else None
                time.sleep(0.2)
        lines = lambda: [json.loads(x) for x in open(log)] if os.path.exists(log) else []
        while time.time() < deadline and sum(1 for x in lines() if "step" in x) < a.steps_before:
            time.sleep(0.5)
        maps = census(pid)
        rec["census"] = summary(maps)
        try:
            rec["changed"] = changed_between(pid, maps, 2.0)
        except OSError as e:
            rec["changed"] = repr(e)
        while time.time() < deadline and not any("trim" in x for x in lines()):
            time.sleep(0.5)
        rec["trim"] = next((x["trim"] for x in lines() if "trim" in x), None)
        rec["census_after_trim"] = {k: v for k, v in summary(census(pid)).items() if k != "top"}
    except Exception as e:  # a census that failed says why in its record
        rec["error"] = repr(e) + " " + open(err.name).read()[-800:]
    finally:
        os.killpg(p.pid, 9)
        p.wait()
    with open(os.path.join(a.out, f"hostmem-{tag}.json"), "w") as f:
        json.dump(rec, f, indent=1)
    c = rec.get("census") or {}
    print(f"{tag}: private dirty {c.get('private_dirty_kb')} kB (of files {c.get('file_private_dirty_kb')}), "
          f"anonymous {c.get('anonymous_kb')} kB; trim {rec.get('trim')}; changed in 2 s {rec.get('changed')}")
    for k, v in (c.get("top") or [])[:12]:
        print(f"  {k}: dirty {v['private_dirty']} anon {v['anonymous']} kB in {v['mappings']}")


if __name__ == "__main__":
    sys.exit(main())
