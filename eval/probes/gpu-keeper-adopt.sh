#!/usr/bin/env bash
# Does memory survive its keeper through fds a third process holds, on the real driver?
# A keeper A; client C1 allocates 64 MiB there (a pattern written), and retains it with
# a hold; client C2 takes an fd of it (`dup`); A is SIGKILLed; a keeper B starts; C2 hands B the
# memory (`adopt`: B imports the fd); C1 takes it back from B (`check`: reclaim, import, map,
# read the pattern). Each step bounded (20 s); every answer logged with its time.
# Needs .gpu/possum and .gpu/possum-keeper-test-client (cargo build --release -p possum-keeper).
# Writes $OUT/keeper-adopt.log (or .gpu/out/). Without a GPU it says SKIPPED and exits 0.
set -uo pipefail
source "$(dirname "$0")/probe.sh"
gpu_probe
log="$res/keeper-adopt.log"; : > "$log"
say() { echo "$(date +%T.%N | cut -c1-12) $*" | tee -a "$log"; }
W=/dev/shm/possum-adopt; rm -rf "$W"; mkdir -p "$W"
.gpu/possum keeper --socket "$W/a.sock" 2> "$W/a.err" & A=$!
for _ in $(seq 100); do [ -S "$W/a.sock" ] && break; sleep 0.1; done; sleep 0.5
coproc C1 { .gpu/possum-keeper-test-client "$W/a.sock" 2>&1; }
ask1() { echo "$1" >&"${C1[1]}"; local l; read -t 20 -r l <&"${C1[0]}" || l="(no answer in 20 s)"; say "C1 $1 -> $l"; REPLY1=$l; }
read -t 20 -r hello <&"${C1[0]}"; say "C1 $hello"; c1pid=${hello#connected }
ask1 "alloc 67108864"; id=$(echo "$REPLY1" | awk '{print $2}')
ask1 "hold $id 600"
coproc C2 { .gpu/possum-keeper-test-client "$W/a.sock" 2>&1; }
ask2() { echo "$1" >&"${C2[1]}"; local l; read -t 20 -r l <&"${C2[0]}" || l="(no answer in 20 s)"; say "C2 $1 -> $l"; }
read -t 20 -r hello2 <&"${C2[0]}"; say "C2 $hello2"
ask2 "dup $id"
kill -9 "$A"; wait "$A" 2>/dev/null; say "keeper A killed"
.gpu/possum keeper --socket "$W/b.sock" 2> "$W/b.err" & B=$!
for _ in $(seq 100); do [ -S "$W/b.sock" ] && break; sleep 0.1; done; sleep 0.5; say "keeper B listening"
ask2 "connect $W/b.sock"
ask2 "adopt $id 67108864 $c1pid 7 600"
ask1 "connect $W/b.sock"
ask1 "check $id 7"
ask1 "stats"
say "nvidia-smi: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ';')"
kill "$B" 2>/dev/null; kill "${C1_PID:-0}" "${C2_PID:-0}" 2>/dev/null
cat "$W/b.err" >> "$log"
