#!/usr/bin/env bash
# How much of a torch job's CUDA context the driver's checkpoint copies to the host, and what
# shrinks it (after possum releases its buffers the MLP's process still used 614 MiB of
# GPU memory; the driver's checkpoint turned it into a 655 MB anonymous mapping that CRIU dumps
# and restores, about half of the 1.35 GB CRIU image). A torch MLP (cuBLAS) runs 30 steps, then
# for each variant: the context's limits (cuCtxGetLimit), its GPU memory (nvidia-smi), and a driver
# checkpoint from a helper process (lock, checkpoint, the job's VmRSS, restore, unlock, each timed);
# variants: as it is, then the stack size limit lowered (cuCtxSetLimit(CU_LIMIT_STACK_SIZE)),
# then back to its value; the job's loss after each, to see it runs on.
# Writes $OUT/probe-context.txt (or .gpu/out/). Without a GPU it says SKIPPED and exits 0.
set -uo pipefail
source "$(dirname "$0")/probe.sh"
gpu_probe
python3 - "$res/probe-context.txt" <<'PY'
import ctypes, os, subprocess, sys, time
import torch
out = open(sys.argv[1], "w")
def say(s):
    print(s, flush=True); out.write(s + "\n"); out.flush()
cu = ctypes.CDLL("libcuda.so.1")
def limits():
    r = {}
    for i, n in enumerate(["stack", "printf_fifo", "malloc_heap", "rt_sync_depth", "rt_pending_launch"]):
        v = ctypes.c_size_t(0)
        rc = cu.cuCtxGetLimit(ctypes.byref(v), i)
        r[n] = v.value if rc == 0 else f"rc{rc}"
    return r
def gpu_mib():
    q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True).stdout
    for l in q.splitlines():
        p, m = [x.strip() for x in l.split(",")]
        if int(p) == os.getpid():
            return int(m)
    return None
HELPER = r'''
import ctypes, sys, time
pid = int(sys.argv[1]); cu = ctypes.CDLL("libcuda.so.1"); cu.cuInit(0)
def rss():
    for l in open(f"/proc/{pid}/status"):
        if l.startswith("VmRSS"): return int(l.split()[1]) // 1024
def t(name):
    t0 = time.perf_counter(); rc = getattr(cu, name)(pid, None); return rc, (time.perf_counter() - t0) * 1e3
r0 = rss()
a = t("cuCheckpointProcessLock"); b = t("cuCheckpointProcessCheckpoint"); r1 = rss()
c = t("cuCheckpointProcessRestore"); d = t("cuCheckpointProcessUnlock"); r2 = rss()
print(f"lock rc{a[0]} {a[1]:.0f} ms, checkpoint rc{b[0]} {b[1]:.0f} ms, restore rc{c[0]} {c[1]:.0f} ms, unlock rc{d[0]} {d[1]:.0f} ms; job RSS MiB {r0} -> {r1} (checkpointed) -> {r2}")
'''
torch.manual_seed(0)
dev = "cuda"
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU()) for _ in range(6)]).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(512, 2048, device=dev)
def steps(n):
    for _ in range(n):
        opt.zero_grad(); loss = model(x).square().mean(); loss.backward(); opt.step()
    torch.cuda.synchronize()
    return loss.item()
loss = steps(30)
torch.cuda.empty_cache()
say(f"torch {torch.__version__}; allocated by torch {torch.cuda.memory_reserved() >> 20} MiB; loss {loss:.6f}")
def probe(label):
    say(f"[{label}] limits {limits()}; GPU MiB {gpu_mib()}")
    r = subprocess.run([sys.executable, "-c", HELPER, str(os.getpid())], capture_output=True, text=True, timeout=120)
    say(f"[{label}] {r.stdout.strip()} {r.stderr.strip()[-300:]}")
    say(f"[{label}] loss after 5 steps {steps(5):.6f}; GPU MiB {gpu_mib()}")
probe("as is")
orig = limits()["stack"]
for v in (0, 256):
    rc = cu.cuCtxSetLimit(0, ctypes.c_size_t(v))
    say(f"cuCtxSetLimit(STACK_SIZE, {v}) rc{rc}")
    probe(f"stack {v}")
for i, n in ((1, "printf_fifo"), (2, "malloc_heap")):
    rc = cu.cuCtxSetLimit(i, ctypes.c_size_t(0)); say(f"cuCtxSetLimit({n}, 0) rc{rc}")
probe("stack 256, printf/heap 0")
rc = cu.cuCtxSetLimit(0, ctypes.c_size_t(orig)); say(f"cuCtxSetLimit(STACK_SIZE, {orig}) rc{rc}")
probe("stack back")
PY
