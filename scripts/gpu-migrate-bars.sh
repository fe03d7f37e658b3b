#!/usr/bin/env bash
# Migration's bars in one device call of under ten minutes (BARS_LIMIT_S, default 570 s), one GPU,
# both ends on it over loopback, images on a huge-page tmpfs. Builds nothing: carry .gpu, staged
# by `bash scripts/gpu-ckpt.sh --stage`; for step 4, also the transport's bench, staged as
# scripts/gpu-wire.sh says (skipped without it).
#   1. `possum migrate` with the defaults, each job migrated alone (`gpu-speculation.sh bars`):
#      8 GiB of frozen weights and 64 MiB of state (f8), 32 GiB (f32), and a training job
#      writing 8 GiB of state every step (t8). Each row: the downtime in the job's own step
#      log (`downtime_s`) and possum's figures.
#   2. The `--engine driver` route, in the same call, for f8 (BARS_DRIVER: more rows, as
#      "8 64 f8-driver,0 8192 t8-driver"): the jobs run `possum run --no-keeper` (the driver
#      cannot restore a process holding a keeper's memory), migrated with `--engine driver`.
#   3. GPT-2 generation alone (BARS_ALONE: the jobs, `gpt2gen`; empty for none), migrated without and
#      with `--post-copy` (BARS_ALONE_TRIALS, 1,1), one at a time: its bar's figures, apart
#      from the trials' load; once for each writer of the job's pages in CRIU's images named
#      in BARS_ALONE_PAGES (`POSSUM_DUMP_PAGES`; "default": possum's choice; "criu relay": an
#      A/B).
#   4. Random migrations, bit-exact against a run without possum: BARS_TRIALS (10,10) trials of
#      BARS_JOBS (the MLP and GPT-2 generation, `mlp,gpt2gen`, taking turns) without and with
#      `--post-copy`, BARS_PARALLEL (5) at once (BARS_JOBS=gpt2gen BARS_PARALLEL=1: GPT-2
#      generation's bar, alone; `gpt2` is GPT-2 training)
#      (`gpu-ckpt.sh correctness`), within what is left less 60 s (and the transport's 70 or 90 s).
#   5. If .gpu/wire-bench is there (the trials leave it 70 s): the authenticated transport,
#      4 GiB on the huge-page tmpfs over 8 and 16 streams unpaced, then paced at 2 GiB/s
#      (`gpu-wire.sh`); and another build's, staged as .gpu/wire-bench-0 (20 s more), over 8
#      streams, for an A/B in the same call.
# BARS_STEPS: the steps to run, of "defaults driver alone trials wire" (all by default; a
# shorter call, say "driver alone", leaves the others out: not the bars' one call then).
# -> $OUT/bars.jsonl (rows tagged f8, f32, t8, f8-driver), $OUT/bars-alone-WRITER.jsonl,
#    $OUT/bars-trials.{jsonl,md},
#    $OUT/wire-bench.txt, $OUT/bars-logs.tgz (the steps' logs)
# Without a GPU it says SKIPPED and exits 0.
set -u
cd "$(dirname "$0")/.."
source scripts/gpu-start.sh
harness_run migrate-bars BARS_LIMIT_S
steps=" ${BARS_STEPS:-defaults driver alone trials wire} "
step() { [[ "$steps" == *" $1 "* ]]; }
step defaults && spec_bars defaults 200 SPEC_BARS="8 64 f8,32 64 f32,0 8192 t8"
step driver && spec_bars driver 90 SPEC_BARS="${BARS_DRIVER:-8 64 f8-driver}" \
    SPEC_FLAGS="--run-flags=--no-keeper" SPEC_MIGRATE_FLAGS="--engine driver"

alone=${BARS_ALONE-gpt2gen}
step alone || alone=
# (The trials after it need 300 s; alone, the step takes what is left.)
alone_needs=300; step trials || alone_needs=100
for pages in ${BARS_ALONE_PAGES-default}; do
    [ -n "$alone" ] && [ "$(left)" -gt $alone_needs ] || break
    echo "== alone ($alone, pages by $pages), $(left) s left"
    secs=$(( $(left) - 10 )); [ "$secs" -le 150 ] || secs=150
    POSSUM_DUMP_PAGES=$pages migrations "alone-$pages" $secs "$alone" "${BARS_ALONE_TRIALS:-1,1}" 1 \
        "${BARS_SEED:-91}"
    cp "$res/alone-$pages/ckpt-correctness.jsonl" "$out/bars-alone-$pages.jsonl" 2>/dev/null
    grep "^correctness (" "$res/alone-$pages.log"
done

wire=0; [ -x .gpu/wire-bench ] && step wire && wire=70
[ -x .gpu/wire-bench-0 ] && step wire && wire=90
if step trials && [ "$(left)" -gt $(( 120 + wire )) ]; then
    echo "== trials, $(left) s left"
    migrations trials $(( $(left) - 60 - wire )) "${BARS_JOBS:-mlp,gpt2gen}" "${BARS_TRIALS:-10,10}" \
        "${BARS_PARALLEL:-5}" "${BARS_SEED:-91}"
    cp "$res/trials/ckpt-correctness.jsonl" "$out/bars-trials.jsonl" 2>/dev/null
    cp "$res/trials/correctness.md" "$out/bars-trials.md" 2>/dev/null
    tail -3 "$res/trials.log"
fi

if step wire && [ "$(left)" -gt 60 ] && [ -x .gpu/wire-bench ]; then
    echo "== transport, $(left) s left"
    huge=/tmp/possum-huge-tmpfs; mount_huge "$huge" 90g
    OUT="$res/wire" WIRE_DIR="$huge" DIR_MIB=4096 WIRE_STREAMS=8,16 \
        WIRE_FILTER='MiB, [0-9]+ streams$|max-rate' WIRE_TIMEOUT_S=$(( $(left) - 10 )) \
        bash scripts/gpu-wire.sh > "$res/wire.log" 2>&1
    cp "$res/wire/wire-bench.txt" "$out/" 2>/dev/null
    # Another build's bench beside it, if staged as .gpu/wire-bench-0: 8 streams, unpaced.
    if [ -x .gpu/wire-bench-0 ] && [ "$(left)" -gt 25 ]; then
        OUT="$res/wire-0" WIRE_DIR="$huge" DIR_MIB=4096 WIRE_STREAMS=8 \
            WIRE_FILTER='MiB, [0-9]+ streams$' WIRE_TIMEOUT_S=$(( $(left) - 10 )) \
            bash scripts/gpu-wire.sh .gpu/wire-bench-0 > "$res/wire-0.log" 2>&1
        cat "$res/wire-0/wire-bench.txt" >> "$out/wire-bench.txt" 2>/dev/null
    fi
    cat "$out/wire-bench.txt" 2>/dev/null
fi
(cd "$res" && find . -type f \( -name '*.log' -o -name '*.err' -o -name '*.md' \) -size -20M \
    | tar czf "$out/bars-logs.tgz" -T -)
echo "== done, $(left) s left"
