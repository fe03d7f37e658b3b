"""What the GPU probes (eval/probes/gpu-probe-*.sh) share: a line-by-line report and libc's memory calls.

Imported by the probes' Python from the repository root (`sys.path.insert(0, "eval/probes")`).
"""
import ctypes
import mmap

G, M = 1 << 30, 1 << 20
PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
MADV_POPULATE_WRITE = 23
MAP_HUGETLB = 0x40000

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
MAP_FAILED = ctypes.c_void_p(-1).value


def reporter(path, mode="w"):
    """A function that prints a line and appends it to `path` (opened with `mode`)."""
    out = open(path, mode)

    def say(s):
        print(s, flush=True)
        out.write(s + "\n")
        out.flush()
    return say
