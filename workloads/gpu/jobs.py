"""Deterministic GPU jobs for possum's interposer and checkpoint checks.

    python3 jobs.py JOB [--steps N] [--profile] [--log FILE] [--hold-gib G] [--sleep-ms MS]

JOB: mlp (MLP + Adam), cnn (cuDNN convolutions), gpt2 (GPT-2 small from a transformers config,
random weights, AMP, trained with AdamW), gpt2gen (the same model generating, greedy with a KV
cache, its weights only read), triton (a Triton kernel), graph (CUDA graph capture and replay),
multistream (work on several streams), fewbytes (single elements written at fixed offsets of
large buffers), amp (fp16 with a GradScaler and overflow steps), twodev (one process, two GPUs).
Prints one JSON line per step with the loss's exact bits, then one with a SHA-256 of every parameter and, with --profile, the number of kernels, copies and
memsets torch.profiler saw (an independent count to compare with possum's). Nothing is downloaded.

For checkpoint tests: --log FILE appends one line per step (step, loss bits, wall time),
opening and closing the file each time, so a checkpointed and restored process holds no descriptor
of it; --hold-gib G keeps G GiB of extra state on the GPU (1 GiB tensors, one of them updated per
step, all of them in the final digest); --sleep-ms paces the steps.

The allocator follows PYTORCH_CUDA_ALLOC_CONF (e.g. `expandable_segments:True`,
`backend:cudaMallocAsync`); when it is set, the final line names the backend in use and the
setting ("allocator"), so a run shows that the setting took effect.
"""
import argparse, hashlib, json, os, struct, sys, time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch  # noqa: E402

def bits(x: torch.Tensor) -> str:
    return struct.pack("<f", float(x)).hex()

def digest(tensors) -> str:
    """SHA-256 of the tensors' values as float32, in order. Taken 64 MiB at a time: a job's
    8 GiB state hashed whole would first be copied to 16 GiB of host memory."""
    h = hashlib.sha256()
    for t in tensors:
        for part in t.detach().reshape(-1).split(1 << 24):
            h.update(part.float().cpu().numpy().tobytes())
    return h.hexdigest()

def host_memory():
    """This process's host memory in kB as smaps_rollup counts it."""
    out = {}
    for line in open("/proc/self/smaps_rollup"):
        k, _, v = line.partition(":")
        if k in ("Rss", "Anonymous", "Private_Dirty"):
            out[k.lower() + "_kb"] = int(v.split()[0])
    return out

def trim_host_memory():
    """glibc's malloc_trim(0): the heap's free memory given back; what it freed and took."""
    import ctypes
    before = host_memory()
    t = time.perf_counter()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    ms = 1e3 * (time.perf_counter() - t)
    return {"before": before, "after": host_memory(), "ms": ms}

def setup(seed=0):
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

def mlp(steps):
    m = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                            torch.nn.ReLU(), torch.nn.Linear(1024, 10)).cuda()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    x, y = torch.randn(256, 512, device="cuda"), torch.randint(0, 10, (256,), device="cuda")
    for s in range(steps):
        loss = torch.nn.functional.cross_entropy(m(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        yield s, loss, m.parameters

def cnn(steps):
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3, padding=1),
                            torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10)).cuda()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9)
    x, y = torch.randn(32, 3, 64, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
    for s in range(steps):
        loss = torch.nn.functional.cross_entropy(m(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        yield s, loss, m.parameters

def gpt2(steps):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=256)
    m = GPT2LMHeadModel(cfg).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (4, 128), device="cuda")
    for s in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(ids, labels=ids).loss
        opt.zero_grad(); loss.backward(); opt.step()
        yield s, loss, m.parameters

def gpt2gen(steps):
    """GPT-2 small (the same random weights) generating, as a model server does: each step
    decodes one token for a batch of 4 greedily, with its KV cache; every 64 tokens it starts
    again from new prompts. The weights are only read; the step's output is the logits' maximum,
    the final digest the last tokens and the embeddings."""
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=256)
    m = GPT2LMHeadModel(cfg).cuda().eval()
    g = torch.Generator(device="cuda").manual_seed(1)
    past = tok = None
    with torch.no_grad():
        for s in range(steps):
            if s % 64 == 0:
                tok = torch.randint(0, cfg.vocab_size, (4, 16), device="cuda", generator=g)
                past = None
            out = m(tok, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1]
            tok = logits.argmax(-1, keepdim=True)
            yield s, logits.float().max(), lambda: [tok.float(), m.transformer.wte.weight]

def triton_job(steps):
    import triton, triton.language as tl

    @triton.jit
    def axpy(x_ptr, y_ptr, out_ptr, a, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        tl.store(out_ptr + i, a * tl.load(x_ptr + i, mask=mask) + tl.load(y_ptr + i, mask=mask), mask=mask)

    n = 1 << 20
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    out = torch.empty_like(x)
    for s in range(steps):
        axpy[(triton.cdiv(n, 1024),)](x, y, out, 0.5, n, BLOCK=1024)
        y = out.clone()
        yield s, out.sum(), lambda: [out]

def graph(steps):
    m = torch.nn.Linear(256, 256).cuda()
    x = torch.randn(64, 256, device="cuda")
    s0 = torch.cuda.Stream()
    s0.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s0):
        for _ in range(2):
            m(x)
    torch.cuda.current_stream().wait_stream(s0)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        out = torch.tanh(m(x))
    for s in range(steps):
        g.replay()
        with torch.no_grad():
            x.copy_(out)
        yield s, out.sum(), lambda: [out, m.weight]

def compiled(steps):
    """An MLP trained with its forward and backward under torch.compile(mode="reduce-overhead"):
    inductor's kernels replayed as CUDA graphs (cudagraph trees), short steps, the optimizer
    eager."""
    m = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                            torch.nn.ReLU(), torch.nn.Linear(1024, 10)).cuda()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    x, y = torch.randn(256, 512, device="cuda"), torch.randint(0, 10, (256,), device="cuda")
    fwd = torch.compile(lambda x, y: torch.nn.functional.cross_entropy(m(x), y), mode="reduce-overhead")
    for s in range(steps):
        torch.compiler.cudagraph_mark_step_begin()
        loss = fwd(x, y)
        opt.zero_grad(); loss.backward(); opt.step()
        yield s, loss.detach().clone(), m.parameters

def multistream(steps):
    streams = [torch.cuda.Stream() for _ in range(3)]
    a = [torch.randn(512, 512, device="cuda") for _ in range(3)]
    for s in range(steps):
        # Each stream reads only the last step's tensors (made before the streams waited on
        # the current stream), never one another stream is writing: a result that depends on
        # the streams' timing would make the job's output differ from run to run (it did:
        # stream 2 read the new a[0] while stream 0 wrote it).
        old = list(a)
        new = []
        for i, st in enumerate(streams):
            st.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(st):
                new.append(torch.tanh(old[i] @ old[(i + 1) % 3] * 0.01))
        for st in streams:
            torch.cuda.current_stream().wait_stream(st)
        # Rebound only once every stream is waited for: the old tensors are freed after their
        # last reads are ordered before anything that may reuse their memory.
        a = new
        yield s, sum(t.sum() for t in a), lambda: a

def fewbytes(steps):
    """Writes of a few bytes at fixed offsets of large buffers: four 64 MiB buffers, each given
    one element (4 bytes) at a fixed offset every step, two more on some steps only, and a flag
    written only on every fifth step (like AMP's found_inf); a small model gives the loss, which
    reads every one of those elements, so a stale byte in an image shows in the next step."""
    n = 16 << 20
    bufs = [torch.zeros(n, device="cuda") for _ in range(4)]
    offs = [0, 12345, n // 2 + 7, n - 1]
    flag = torch.zeros(1, device="cuda")
    lin = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.SGD(lin.parameters(), lr=1e-3)
    x = torch.randn(32, 64, device="cuda")
    for s in range(steps):
        for i, (b, o) in enumerate(zip(bufs, offs)):
            b[o:o + 1].add_(s + 1)
            if s % (i + 2) == 0:
                q = (o + 4096) % (n - 2)
                b[q:q + 2].mul_(0.5).add_(1.0)
        if s % 5 == 3:
            flag.fill_(float(s))
        probe = sum(b[o] + b[(o + 4096) % (n - 2)] for b, o in zip(bufs, offs))
        loss = (lin(x) ** 2).mean() + 1e-3 * probe + 1e-3 * flag[0]
        opt.zero_grad(); loss.backward(); opt.step()
        yield s, loss, lambda: bufs + [flag] + list(lin.parameters())

def amp(steps):
    """Mixed precision with a GradScaler and overflow steps: every seventh step's input is scaled
    so that fp16 gradients overflow (the scaler writes found_inf, skips the step and lowers its
    scale); a short growth interval makes the scale grow back, and overflow again, often."""
    m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 16, growth_interval=3)
    x, y = torch.randn(64, 256, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
    for s in range(steps):
        xs = x * (1e4 if s % 7 == 5 else 1.0)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(m(xs), y)
        opt.zero_grad(); scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
        yield s, loss, lambda: list(m.parameters()) + [scaler._scale, scaler._growth_tracker]

def twodev(steps):
    """One process, two GPUs: each step computes on both, copies activations between them both
    ways (peer copies when the GPUs can reach each other), and writes single elements at fixed
    offsets of a 64 MiB buffer on each GPU, one of them from the other GPU's data."""
    if torch.cuda.device_count() < 2:
        raise SystemExit("twodev needs two GPUs")
    d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")
    a = torch.randn(512, 512, device=d0)
    b = torch.zeros(512, 512, device=d1)
    n = 16 << 20
    big0, big1 = torch.zeros(n, device=d0), torch.zeros(n, device=d1)
    for s in range(steps):
        a2 = torch.tanh(a @ a * 0.01)
        b.copy_(a2)
        b2 = torch.tanh(b @ b * 0.01)
        a.copy_(b2)
        big0[12345:12346].copy_(b2[0, :1])
        big0[n - 1:n].add_(s + 1)
        big1[777:778].add_(b2[1, 1])
        loss = a.sum() + big0[12345] + big0[n - 1] + big1[777].to(d0)
        yield s, loss, lambda: [a, b, big0, big1]

JOBS = {"mlp": mlp, "cnn": cnn, "gpt2": gpt2, "gpt2gen": gpt2gen, "triton": triton_job, "graph": graph, "compiled": compiled,
        "multistream": multistream,
        "fewbytes": fewbytes, "amp": amp, "twodev": twodev}

def main():
    p = argparse.ArgumentParser()
    p.add_argument("job", choices=sorted(JOBS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--log")
    p.add_argument("--hold-gib", type=float, default=0)
    p.add_argument("--sleep-ms", type=float, default=0)
    p.add_argument("--ballast-frozen", action="store_true",
                   help="the extra state is only read each step (like frozen weights), never written")
    p.add_argument("--ballast-read-all", action="store_true",
                   help="every step reads all of the extra state (like an inference job's weights): "
                        "its first step needs every byte of it")
    p.add_argument("--ballast-half", action="store_true",
                   help="the extra state in fp16 (half the bytes per element: weights as served)")
    p.add_argument("--state-mib", type=float, default=0,
                   help="a state of this many MiB written whole every step (an optimizer's, a KV cache's)")
    p.add_argument("--host-batch-mib", type=float, default=0,
                   help="copy a batch of this many MiB from pinned host memory to the GPU every step "
                        "(as a data loader does), into a buffer of its own")
    p.add_argument("--trim-at-step", type=int, default=-1,
                   help="at this step, call glibc's malloc_trim(0) and append to --log the job's host "
                        "memory before and after it ({\"trim\": ...}, kB from smaps_rollup) and its time")
    p.add_argument("--report-writes", action="store_true",
                   help="after step 3, append to --log the bytes the job writes each step ({\"writes\": N})")
    a = p.parse_args()
    setup()
    inbox = host_batch = None
    if a.host_batch_mib > 0:
        n = max(1, int(a.host_batch_mib * (1 << 20)) // 4)
        host_batch = torch.arange(n, dtype=torch.float32).pin_memory()
        inbox = torch.empty(n, device="cuda")
    ballast = []
    if a.hold_gib > 0:
        g = torch.Generator(device="cuda").manual_seed(1)
        size = 2 if a.ballast_half else 4
        n = int(a.hold_gib * (1 << 30)) // size
        while n > 0:
            k = min(n, (1 << 30) // size)
            t = torch.rand(k, device="cuda", generator=g)
            ballast.append(t.half() if a.ballast_half else t)
            del t
            n -= k
        torch.cuda.synchronize()
    state = None
    if a.state_mib > 0:
        state = torch.zeros(int(a.state_mib * (1 << 20)) // 4, device="cuda")
    prof = None
    if a.profile:
        from torch.profiler import profile, ProfilerActivity
        prof = profile(activities=[ProfilerActivity.CUDA])
        prof.__enter__()
    params = None
    times = []
    # What the job writes each step, for comparison with what a pre-copy round sends: every byte
    # allocated beyond the weights (the model, its gradients, the optimizer's state, activations,
    # the state), measured over the first steps as the allocator's peak.
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    frozen_bytes = torch.cuda.memory_allocated() - (state.numel() * 4 if state is not None else 0)
    t = time.perf_counter()
    for s, loss, params in JOBS[a.job](a.steps):
        if s == 3 and a.log and a.report_writes:
            with open(a.log, "a") as f:
                f.write(json.dumps({"writes": torch.cuda.max_memory_allocated() - frozen_bytes}) + "\n")
        if s == a.trim_at_step and a.log:
            with open(a.log, "a") as f:
                f.write(json.dumps({"trim": trim_host_memory()}) + "\n")
        if inbox is not None:
            inbox.copy_(host_batch, non_blocking=True)
        if ballast and a.ballast_read_all:
            loss = loss + sum(b.sum(dtype=torch.float32) for b in ballast) * 0
        elif ballast and a.ballast_frozen:
            ballast[s % len(ballast)][:: 1 << 12].sum()
        elif ballast:
            ballast[s % len(ballast)].mul_(0.5).add_(loss.detach().float())
        if state is not None:
            state.mul_(0.5).add_(loss.detach().float())
            loss = loss + state[:: 1 << 16].sum() * 1e-6
        print(json.dumps({"step": s, "loss": bits(loss)}), flush=True)  # .item(): waits for the step
        if a.log:
            with open(a.log, "a") as f:
                f.write(json.dumps({"step": s, "loss": bits(loss), "t": time.time()}) + "\n")
        if a.sleep_ms:
            time.sleep(a.sleep_ms / 1e3)
        now = time.perf_counter()
        times.append(now - t)
        t = now
    # Step times go to a side file, so the compared output stays deterministic.
    if os.environ.get("POSSUM_TIMING_FILE"):
        steady = sorted(times[2:]) or times
        with open(os.environ["POSSUM_TIMING_FILE"], "w") as f:
            json.dump({"step_ms_median": 1e3 * steady[len(steady) // 2], "steps": len(times)}, f)
    torch.cuda.synchronize()
    out = {"digest": digest(params() if callable(params) else params)}
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        out["allocator"] = f"{torch.cuda.get_allocator_backend()} ({os.environ['PYTORCH_CUDA_ALLOC_CONF']})"
    if ballast:
        out["ballast"] = digest(b[:: 1 << 16] for b in ballast)
    if state is not None:
        out["state"] = digest([state])
    if a.log:
        with open(a.log, "a") as f:
            f.write(json.dumps(out) + "\n")
    if prof is not None:
        prof.__exit__(None, None, None)
        kinds = {"kernels": 0, "copies": 0, "memsets": 0}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                n = e.name.lower()
                k = "copies" if n.startswith("memcpy") else "memsets" if n.startswith("memset") else "kernels"
                kinds[k] += 1
        out["profiler"] = kinds
    print(json.dumps(out), flush=True)

if __name__ == "__main__":
    sys.exit(main())
