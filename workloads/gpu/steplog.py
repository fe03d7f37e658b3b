"""What the multi-process GPU jobs (tree2.py, ddp.py) share: their step logs and digests.

Each step's line is appended by opening and closing the file, so that a checkpointed process
holds no descriptor of it and a restored one appends where the file ends; a digest is the first
16 hex digits of the SHA-256 of the tensors' float32 bytes, so that two runs compare bit for bit.
"""
import hashlib, json


def log_line(path, row):
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]
