#!/usr/bin/env bash
# Who writes a migrated job's private memory into CRIU's images, A/B in one device call (under
# DUMP_PAGES_LIMIT_S, default 540 s), one GPU, both ends on it over loopback, images on a
# huge-page tmpfs, each way of `POSSUM_DUMP_PAGES` in DUMP_PAGES_WAYS ("criu relay": CRIU from
# its one thread, against CRIU into pipes that possum's threads copy into the files; "possum":
# possum after CRIU's lazy dump) taking turns:
#   1. The probe: CRIU's dump of a process holding 1.3 GB of private memory, left running, each
#      way three times (`.gpu/dump-pages`, criu-adapter's example), images on the huge-page
#      tmpfs, then on /dev/shm: how long CRIU holds the process.
#   2. DUMP_PAGES_JOBS (gpt2gen,gpt2: GPT-2 generation, GPT-2 training) migrated at random steps
#      (DUMP_PAGES_TRIALS each, bit-exact against a run without possum; `gpu-ckpt.sh
#      correctness`), one at a time, once per way.
#   3. The job with 8 GiB of frozen weights and 64 MiB of state (`gpu-speculation.sh bars`),
#      DUMP_PAGES_ROUNDS (1) rounds of the ways.
# Builds nothing: carry .gpu, staged by `bash scripts/gpu-ckpt.sh --stage`.
# -> $OUT/dump-pages-probe.txt, $OUT/dump-pages-jobs-WAY.jsonl (each row's migrate.source has
#    criu_dump_ms, criu_dump_stats, criu_pages_relayed_ms), $OUT/dump-pages-f8.jsonl (rows
#    tagged f8-WAY), $OUT/dump-pages-logs.tgz. Without a GPU it says SKIPPED and exits 0.
set -u
cd "$(dirname "$0")/.."
source scripts/gpu-start.sh
harness_run dump-pages DUMP_PAGES_LIMIT_S
ways=${DUMP_PAGES_WAYS:-criu relay}
bars_out=dump-pages-f8.jsonl

if [ -x .gpu/dump-pages ]; then
    echo "== probe, $(left) s left"
    source scripts/gpu-criu.sh
    probe="$out/dump-pages-probe.txt"
    python3 eval/probes/hold_memory.py "$res/ready" 1300 &
    job=$!
    for _ in $(seq 600); do [ -s "$res/ready" ] && break; sleep 0.1; done
    huge=/tmp/possum-probe-huge; mount_huge "$huge" 16g
    for dir in "$huge" /dev/shm/possum-probe; do
        echo "images on $dir, $(nproc) cores" >> "$probe"
        timeout 60 .gpu/dump-pages "$job" "$dir" 3 $ways >> "$probe" 2>&1
    done
    kill "$job"; umount "$huge" 2>/dev/null; rm -rf /dev/shm/possum-probe
    cat "$probe"
fi

for way in $ways; do
    [ "$(left)" -gt 150 ] || break
    echo "== jobs, pages by $way, $(left) s left"
    POSSUM_DUMP_PAGES=$way migrations "jobs-$way" "${DUMP_PAGES_JOBS_S:-165}" \
        "${DUMP_PAGES_JOBS:-gpt2gen,gpt2}" "${DUMP_PAGES_TRIALS:-3}" 1 "${DUMP_PAGES_SEED:-301}" \
        possum-keeper-migrate
    cp "$res/jobs-$way/ckpt-correctness.jsonl" "$out/dump-pages-jobs-$way.jsonl" 2>/dev/null
    grep "^correctness (" "$res/jobs-$way.log"
done

for round in $(seq "${DUMP_PAGES_ROUNDS:-1}"); do
    for way in $ways; do
        POSSUM_DUMP_PAGES=$way spec_bars "f8-$round-$way" 55 SPEC_BARS="8 64 f8-$way"
    done
done
(cd "$res" && find . -type f \( -name '*.log' -o -name '*.err' -o -name '*.md' \) -size -20M \
    | tar czf "$out/dump-pages-logs.tgz" -T -)
echo "== done, $(left) s left"
