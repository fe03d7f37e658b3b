#!/usr/bin/env bash
# How long CRIU's dump of a process holding PROBE_MIB (1300) MiB of private memory takes with its
# pages written (the way possum dumps) and with `--lazy-pages` (the pages left in the frozen
# process, served by CRIU's page server); and how fast another process reads that memory from
# /proc/PID/mem while CRIU holds it frozen, on PROBE_THREADS (1 4 16) threads: what a dump that
# leaves the pages to possum would cost. The lazy dump's page server is closed by this probe
# (PS_IOV_CLOSE) once the read is over. No GPU needed: it runs wherever CRIU does.
#   (there) OUT=... [PROBE_HUGE=1] bash eval/probes/criu-lazy-dump.sh       (~1 min)
#   (here)  POSSUM_CRIU=/opt/possum-criu/bin/criu bash eval/probes/criu-lazy-dump.sh
# PROBE_HUGE=1 puts the images on a huge-page tmpfs (as the migration bars do), else /dev/shm.
# Result: $OUT (or .gpu/out)/criu-lazy-dump.txt; CRIU's logs in criu-lazy-dump-logs.tgz.
set -u
source "$(dirname "$0")/probe.sh"
res="${OUT:-.gpu/out}"; mkdir -p "$res"
if [ -z "${POSSUM_CRIU:-}" ] && [ -d .gpu/criu-debs ]; then
    source scripts/gpu-criu.sh
fi
criu="${POSSUM_CRIU:-criu}"
top=/dev/shm/possum-lazy-probe
if [ "${PROBE_HUGE:-0}" = 1 ]; then
    top=/tmp/possum-lazy-probe; huge_tmpfs "$top" 8g
fi
rm -rf "${top:?}"/*; mkdir -p "$top"
out="$res/criu-lazy-dump.txt"
{ echo "criu: $("$criu" --version | head -1); cores: $(nproc); images: $top"; } > "$out"

# The process: PROBE_MIB of random bytes in 64 MiB pieces (as a heap's arenas), then idle.
python3 "$(dirname "$0")/hold_memory.py" "$top/ready" "${PROBE_MIB:-1300}" &
job=$!
for _ in $(seq 600); do [ -s "$top/ready" ] && break; sleep 0.1; done
echo "process $job: $(grep VmRSS /proc/$job/status)" >> "$out"

# The log's last timestamp at a line matching $2 (seconds since CRIU started).
at() { grep -E "$2" "$1" | tail -1 | sed -E 's/^\(([0-9.]+)\).*/\1/'; }

# Reads the frozen process's writable private anonymous mappings from /proc/PID/mem on $1
# threads, then closes the lazy page server at 127.0.0.1:$2 (if given).
read_and_close() {
    python3 - "$job" "$1" "${2:-}" <<'EOF'
import os, socket, struct, sys, time, concurrent.futures as cf
pid, threads, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ranges = []
for line in open(f"/proc/{pid}/maps"):
    f = line.split()
    if f[1].startswith("rw-p") and len(f) < 6:
        a, b = (int(x, 16) for x in f[0].split("-"))
        ranges += [(o, min(b, o + (8 << 20))) for o in range(a, b, 8 << 20)]
fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
t = time.time()
def one(r):
    try:
        return len(os.pread(fd, r[1] - r[0], r[0]))
    except OSError:
        return 0
with cf.ThreadPoolExecutor(threads) as pool:
    got = sum(pool.map(one, ranges))
dt = time.time() - t
print(f"  read {got / 1e9:.2f} GB of /proc/{pid}/mem on {threads} threads: {dt * 1000:.0f} ms ({got / dt / 1e9:.1f} GB/s)")
if port:
    # PS_IOV_CLOSE, then this end's writes shut: CRIU's page server corks its socket, so its
    # 4-byte answer would wait up to 200 ms; it goes at once when the server closes, which it
    # does on reading this end's EOF.
    t = time.time()
    s = socket.create_connection(("127.0.0.1", int(port)))
    s.sendall(struct.pack("@IQQQ", 0x1023, 0, 0, 0))
    s.shutdown(socket.SHUT_WR)
    status = s.recv(4)
    s.close()
    print(f"  page server closed in {(time.time() - t) * 1000:.1f} ms: status "
          f"{struct.unpack('@i', status)[0] if len(status) == 4 else status}")
EOF
}

port=27100
for round in 1 2; do
    for threads in ${PROBE_THREADS:-1 4 16}; do
        for mode in full lazy; do
            d="$top/$mode-$round-$threads"; mkdir -p "$d"
            echo "== $mode, round $round, $threads threads" >> "$out"
            if [ "$mode" = full ]; then
                t0=$(date +%s.%N)
                timeout 120 "$criu" dump -t "$job" -D "$d" --shell-job --leave-running -v4 \
                    --log-file dump.log > /dev/null 2>&1
                echo "  rc $?, $(awk "BEGIN { print $(date +%s.%N) - $t0 }") s in all; pages from" \
                    "$(at "$d/dump.log" "Dumping pages"), done at $(at "$d/dump.log" "Dumping finished");" \
                    "pages $(du -sm "$d" | cut -f1) MiB" >> "$out"
            else
                port=$((port + 1))
                t0=$(date +%s.%N)
                timeout 120 "$criu" dump -t "$job" -D "$d" --shell-job --leave-running -v4 \
                    --log-file dump.log --lazy-pages --address 127.0.0.1 --port "$port" \
                    > /dev/null 2>&1 &
                dumper=$!
                for _ in $(seq 1200); do grep -q "Starting page server" "$d/dump.log" 2>/dev/null && break; sleep 0.01; done
                echo "  serving after $(awk "BEGIN { print $(date +%s.%N) - $t0 }") s; pages from" \
                    "$(at "$d/dump.log" "Dumping pages"), serving at $(at "$d/dump.log" "Starting page server");" \
                    "images $(du -sm "$d" | cut -f1) MiB" >> "$out"
                read_and_close "$threads" "$port" >> "$out" 2>&1
                wait "$dumper"
                echo "  rc $?, done at $(at "$d/dump.log" "Dumping finished")" >> "$out"
            fi
        done
    done
done
{ kill -9 "$job"; wait "$job"; } 2>/dev/null
(cd "$top" && find . -name dump.log | tar czf "$res/criu-lazy-dump-logs.tgz" -T -)
rm -rf "${top:?}"/*
[ "${PROBE_HUGE:-0}" = 1 ] && umount "$top"
rmdir "$top" 2>/dev/null
cat "$out"
