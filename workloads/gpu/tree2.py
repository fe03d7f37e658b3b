"""A deterministic job of two CUDA processes on one GPU (a process tree to checkpoint).

    python3 tree2.py [--steps N] [--log FILE] [--sleep-ms MS] [--device cuda|cpu]

The parent starts ONE child, `python3 tree2.py --child ...` (subprocess.Popen: fork + exec, a
fresh process, as CUDA cannot be used in a forked child), before it imports torch. Each of the
two then trains its own small MLP (64 -> 256 -> 256 -> 10, Adam) on the same device (GPU 0 with
--device cuda): fixed seeds (parent 0, child 1), torch.use_deterministic_algorithms, the batch of
step s drawn on the CPU from a generator seeded with (seed, s), so a step's result depends on
nothing but the step. The child signals through a pipe when its model is on the device and the
parent waits for that before step 0 (the pipe is closed after, nothing shared remains), so the
two step in near lockstep.

Each process appends (opening and closing the file each time, so a checkpointed process holds no
descriptor of it and a restored one appends where the file ends) one JSON line per step: the
step, the loss as `float.hex` ("loss"), a digest of every parameter after the step ("digest") and
the wall time ("t", the only field that differs between runs); the parent to FILE, the child to
FILE.child. A final line has the digest of the parameters ("final"); the parent writes its own
after the child has exited, with the child's exit status ("child_rc"), and exits with that status
if it is nonzero. Two runs can be compared bit for bit from any step on, as loader.py's and
jobs.py's logs are. --sleep-ms paces the steps. --device cpu runs the same job without a GPU.
"""
import argparse, os, subprocess, sys, time

from steplog import digest, log_line

FEATURES, BATCH = 64, 64


def train(a, seed, log, ready_fd=None, wait_fd=None):
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device(a.device)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    if ready_fd is not None:  # the child: its CUDA context and model are up
        os.write(ready_fd, b"r")
        os.close(ready_fd)
    if wait_fd is not None:  # the parent: wait for the child's (EOF if it died: go on, reap it later)
        os.read(wait_fd, 1)
        os.close(wait_fd)
    for step in range(a.steps):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        x = torch.randn(BATCH, FEATURES, generator=g).to(dev)
        y = torch.randint(0, 10, (BATCH,), generator=g).to(dev)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        row = {"step": step, "loss": loss.item().hex(), "digest": digest(model.parameters())}
        log_line(log, {**row, "t": time.time()})
        if a.sleep_ms:
            time.sleep(a.sleep_ms / 1e3)
    return digest(model.parameters())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--log")
    p.add_argument("--sleep-ms", type=float, default=0)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--child", action="store_true", help="(internal) the child process")
    p.add_argument("--ready-fd", type=int, help="(internal) the child's end of the start pipe")
    a = p.parse_args()

    if a.child:
        final = train(a, 1, a.log, ready_fd=a.ready_fd)
        log_line(a.log, {"final": final})
        return 0

    r, w = os.pipe()
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--steps", str(a.steps),
           "--sleep-ms", str(a.sleep_ms), "--device", a.device, "--ready-fd", str(w)]
    if a.log:
        cmd += ["--log", a.log + ".child"]
    child = subprocess.Popen(cmd, pass_fds=(w,), stdin=subprocess.DEVNULL)
    os.close(w)
    final = train(a, 0, a.log, wait_fd=r)
    rc = child.wait()
    log_line(a.log, {"final": final, "child_rc": rc})
    return rc if rc else 0


if __name__ == "__main__":
    sys.exit(main())
