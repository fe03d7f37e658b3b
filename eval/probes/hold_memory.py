"""A process holding MIB MiB of private memory (random bytes in 64 MiB pieces, as a heap's
arenas), idle: what the probes of CRIU's dump dump.

    python3 eval/probes/hold_memory.py READY MIB &

Writes its PID into READY once the memory is there, then sleeps until killed.
"""
import os, sys, time

pieces = [bytearray(os.urandom(1 << 20)) * 64 for _ in range(int(sys.argv[2]) // 64)]
open(sys.argv[1], "w").write(str(os.getpid()))
while True:
    time.sleep(0.05)
