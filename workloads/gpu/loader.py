"""A deterministic training job whose DataLoader has worker processes.

    python3 loader.py [--steps N] [--log FILE] [--sleep-ms MS] [--persistent] [--workers W]
                      [--device cuda|cpu] [--batch B] [--items N]

A small MLP (64 -> 256 -> 256 -> 10, Adam) trains on synthetic data: item i of the Dataset is a
deterministic function of i alone (64 floats from a generator seeded with i, label i % 10), so
any worker computes the same batch. The DataLoader shuffles with its own seeded generator, has W
worker processes (default 2) forked (`multiprocessing_context="fork"`) from the process after CUDA
is initialised, as PyTorch does by default on Linux, so they inherit its NVIDIA device mappings
and descriptors without ever using CUDA; with --persistent they live for the whole run, without it
they are forked again every epoch (--items / --batch batches, default 16).

Prints, and with --log FILE appends (opening and closing the file each time, so a checkpointed
process holds no descriptor of it), one JSON line per step: the step, the loss as `float.hex`
("loss"), a digest of the batch ("batch": which items, in which order) and of every parameter
after the step ("digest"), and the wall time ("t", the only field that differs between runs).
A final line has the digest of the parameters ("final") and the number of epochs. Two runs can
be compared bit for bit from any step. --sleep-ms paces the steps. --device cpu runs the same job
without a GPU (to check this file and its callers on a CPU machine).
"""
import argparse, hashlib, json, os, sys, time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch  # noqa: E402

FEATURES = 64


class Items(torch.utils.data.Dataset):
    """Item i: 64 floats drawn from a generator seeded with i, and the label i % 10."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 + int(i))
        return torch.randn(FEATURES, generator=g), int(i) % 10, int(i)


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--log")
    p.add_argument("--sleep-ms", type=float, default=0)
    p.add_argument("--persistent", action="store_true", help="persistent_workers=True")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--items", type=int, default=512)
    a = p.parse_args()

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device(a.device)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if dev.type == "cuda":
        torch.cuda.synchronize()  # CUDA is initialised before the workers are forked
    loader = torch.utils.data.DataLoader(
        Items(a.items), batch_size=a.batch, shuffle=True, generator=torch.Generator().manual_seed(7),
        num_workers=a.workers, persistent_workers=a.persistent and a.workers > 0,
        multiprocessing_context="fork" if a.workers > 0 else None, drop_last=True)

    step, epochs = 0, 0
    while step < a.steps:
        epochs += 1
        for x, y, idx in loader:
            x, y = x.to(dev), y.to(dev)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            row = {"step": step, "loss": loss.item().hex(), "batch": digest([idx]),
                   "digest": digest(model.parameters())}
            print(json.dumps(row), flush=True)
            if a.log:
                with open(a.log, "a") as f:
                    f.write(json.dumps({**row, "t": time.time()}) + "\n")
            step += 1
            if a.sleep_ms:
                time.sleep(a.sleep_ms / 1e3)
            if step >= a.steps:
                break
    out = {"final": digest(model.parameters()), "epochs": epochs}
    if a.log:
        with open(a.log, "a") as f:
            f.write(json.dumps(out) + "\n")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
