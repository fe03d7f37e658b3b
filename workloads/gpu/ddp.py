"""A deterministic multi-GPU training job over NCCL: one rank per GPU, started by torchrun or by
torch.multiprocessing.spawn.

    torchrun --nproc_per_node=2 ddp.py [--steps N] [--step-log FILE] [--sleep-ms MS] [--state-gib G]
                                       [--mode ddp|fsdp]
    python3 ddp.py --spawn 2 [same options]

Each rank trains a small MLP (64 -> 512 -> 512 -> 10, AdamW) wrapped in DistributedDataParallel
(--mode ddp) or FullyShardedDataParallel (--mode fsdp) over NCCL on GPU `rank`, with fixed seeds
and torch.use_deterministic_algorithms; the batch of step s for rank r is drawn on the CPU from a
generator seeded with (r, s), so a step's result depends on nothing but the step. --state-gib G
adds G GiB of float32 "state" per rank that every step rewrites from the step's all-reduced loss
(`state.mul_(0.5).add_(loss)`), as optimizer state is: all of it is written every step.

Rank r appends one JSON line per step to FILE.rank<r> (opened and closed each time, so a
checkpointed process holds no descriptor of it): the step, the all-reduced loss as `float.hex`
("loss"), a digest of the parameters after the step ("digest"), a digest of a sample of the
state ("state") and the wall time ("t", the only field that differs between runs). Rank 0 also
all-reduces a checksum of every rank's parameters each step, so ranks that diverged would show
in one another's lines. A final line has the digest of the parameters ("final"). Two runs can
be compared bit for bit from any step on.
"""
import argparse, os, sys, time

from steplog import digest, log_line

FEATURES, HIDDEN, BATCH = 64, 512, 64


def train(a, rank, world):
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                                torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 10)).to(dev)
    if a.mode == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        model = FSDP(model, device_id=rank, use_orig_params=True)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n_state = int(a.state_gib * (1 << 30)) // 4
    state = torch.zeros(n_state, device=dev) if n_state else None
    log = f"{a.log}.rank{rank}" if a.log else None
    torch.cuda.synchronize()
    dist.barrier()
    for step in range(a.steps):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(BATCH, FEATURES, generator=g).to(dev)
        y = torch.randint(0, 10, (BATCH,), generator=g).to(dev)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if state is not None:
            state.mul_(0.5).add_(total)
        params = [p for p in model.parameters()]
        check = torch.stack([p.detach().double().sum() for p in params]).sum().reshape(1)
        dist.all_reduce(check)
        row = {"step": step, "loss": float(total.item()).hex(), "digest": digest(params),
               "check": float(check.item()).hex(), "t": time.time()}
        if state is not None:
            row["state"] = digest([state[:: max(1, n_state // 4096)]])
        log_line(log, row)
        if a.sleep_ms:
            time.sleep(a.sleep_ms / 1000)
    log_line(log, {"final": digest(list(model.parameters()))})
    dist.barrier()
    dist.destroy_process_group()


def spawned(rank, a, world):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(a.port))
    train(a, rank, world)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-log", dest="log")
    p.add_argument("--sleep-ms", type=float, default=0)
    p.add_argument("--state-gib", type=float, default=0)
    p.add_argument("--mode", choices=["ddp", "fsdp"], default="ddp")
    p.add_argument("--spawn", type=int, default=0, help="start N ranks with torch.multiprocessing.spawn")
    p.add_argument("--port", type=int, default=29511)
    a = p.parse_args()
    if a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawned, args=(a, a.spawn), nprocs=a.spawn, join=True)
        return
    train(a, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


if __name__ == "__main__":
    sys.exit(main())
