#!/usr/bin/env bash
# Validated speculation by content on one GPU: fingerprints, read-only speculation on by default,
# only changed chunks moved. Builds nothing: carry .gpu, staged here by
# `bash scripts/gpu-ckpt.sh --stage` (possum, libpossum.so, the CRIU plugin, CRIU's .debs, the
# CUDA self-test).
#   bash scripts/gpu-speculation.sh frozen     (~7 min)
#       possum-cuda-selftest (the fingerprint kernel loaded from libpossum's PTX: bits against the
#       CPU's, time over 32 GiB); then eval/speculation.py frozen: a job with 8 GiB of fp16
#       weights read every step and a 64 MiB state written every step, strict (today's: no
#       read-only speculation, no fingerprints) against speculative (the defaults), in the same
#       run: a kept checkpoint, a second with --parent, a migration over loopback.
#       -> $OUT/speculation.jsonl, speculation-selftest.txt, speculation-frozen.tgz
#       SPEC_MODES picks the modes, SPEC_SELFTEST=0 skips the self-test, SPEC_FLAGS passes more
#       flags (--criu-log: CRIU's logs at level 4 and its statistics, in the .tgz).
#   bash scripts/gpu-speculation.sh bars       (~4 min)
#       The migrations the frozen run does not make, with the defaults, migration alone
#       (--migrate-only): 32 GiB of fp16 weights read every step and 64 MiB of state; a training
#       job writing 8 GiB of state every step (no weights). -> $OUT/speculation-bars.jsonl
#       SPEC_BARS picks the jobs ("GIB MIB TAG,..."), SPEC_MIGRATE_FLAGS more of `possum
#       migrate`'s flags (e.g. "--max-rate 10Gbit"); SPEC_HUGE=1 puts both ends' images on a
#       tmpfs mounted with huge=always (2 MiB pages: the first round's copy into it is not
#       held to the 4 KiB pages' rate). SPEC_SAMPLE=1 samples the host every second while each
#       job runs and migrates (free memory, tmpfs, compaction and reclaim counters, the busiest
#       threads) -> $OUT/sample-TAG.txt, and keeps possum's notes -> $OUT/notes-TAG.log
#   bash scripts/gpu-speculation.sh slices     (~5 min with the defaults below)
#       As bars, each job migrated SPEC_SLICE_RUNS (2) times with its first pre-copy round sent in
#       one part (POSSUM_MIGRATE_SLICE_MIB=0) and in parts (the default: the destination loads
#       the GPU images as they come), alternating. -> $OUT/speculation-bars.jsonl (TAG-whole-N,
#       TAG-sliced-N)
#   bash scripts/gpu-speculation.sh hold       (~6 min with SPEC_BARS="8 64 f8,0 8192 t8")
#       As bars, each job migrated SPEC_SLICE_RUNS (2) times with the GPU images sent after the
#       commit, the job killed after the send and CRIU probing the kernel at each run
#       (POSSUM_MIGRATE_SEND_WHILE_HELD=0 POSSUM_MIGRATE_KILL_WHILE_SENDING=0 POSSUM_CRIU_KDAT=0,
#       /run/criu.kdat removed), and with all three beside or cached (the default), alternating
#       (TAG-after-N, TAG-beside-N); then, with SPEC_CRIU_LOGS=1, the first job once more at
#       CRIU's log level 4: its dump and restore logs and the kdat cache's place
#       -> $OUT/criu-logs-TAG.tar.gz
#   bash scripts/gpu-speculation.sh criu-stream  (~5 min with SPEC_BARS="8 64 f8,0 8192 t8")
#       As bars, each job migrated SPEC_SLICE_RUNS (2) times with CRIU's pages file sent after
#       the dump (POSSUM_MIGRATE_STREAM_CRIU=0) and as CRIU writes it (the default), alternating
#       (TAG-after-N, TAG-streamed-N).
#   bash scripts/gpu-speculation.sh copy-stream  (~5 min with SPEC_BARS="0 8192 t8")
#       As bars, each job migrated SPEC_SLICE_RUNS (2) times with the chunks of the held job's
#       final copy sent once the copy is over (POSSUM_MIGRATE_SEND_WHILE_COPYING=0) and as the
#       copy completes them (the default), alternating (TAG-after-N, TAG-copying-N).
#   bash scripts/gpu-speculation.sh held-writers  (~5 min with SPEC_BARS="0 8192 t8")
#       As bars, each job migrated SPEC_SLICE_RUNS (2) times with the held job's final copy
#       written by as many threads as the pre-copy (POSSUM_HELD_WRITERS=0: the cores, 2 to 6)
#       and by the default (the cores, 2 to 16), alternating (TAG-six-N, TAG-all-N).
#   bash scripts/gpu-speculation.sh first-round  (~4 min with SPEC_BARS="32 64 f32")
#       As bars, each job migrated SPEC_SLICE_RUNS (2) times with its first pre-copy round sent
#       once copied (the default) and as the round completes its chunks
#       (POSSUM_MIGRATE_FIRST_ROUND_WHILE_COPYING=1), alternating (TAG-after-N, TAG-copying-N).
#   bash scripts/gpu-speculation.sh stage-ahead  (~5 min with SPEC_BARS="0 8192 t8")
#       As bars, each job migrated SPEC_SLICE_RUNS (2) times with its destination staging the
#       GPU images at the restore (POSSUM_MIGRATE_STAGE_AHEAD=0) and once the final set brought
#       them whole (the default), alternating (TAG-restore-N, TAG-ahead-N).
#   bash scripts/gpu-speculation.sh rewritten  (~5 min with SPEC_BARS="0 8192 t8")
#       As bars, each job migrated SPEC_SLICE_RUNS (2) times with its destination's keeper told
#       only how far the GPU images' data files came (the default: chunks sent again load once
#       the final set brought the images whole) and told which bytes each part sent ahead
#       brought again (POSSUM_MIGRATE_LOAD_REWRITTEN=1: those chunks load as they come),
#       alternating (TAG-lengths-N, TAG-rewritten-N). Each row's `prestaged` says how many
#       chunks were named (`rewritten`) and what the stage ahead took (`ahead.reused_bytes`).
#   bash scripts/gpu-speculation.sh partial  (~5 min with SPEC_BARS="0 8192 t8")
#       As bars, each job migrated SPEC_SLICE_RUNS (2) times with a keeper's stage built on
#       another taking only the buffers that one loaded whole (POSSUM_KEEPER_STAGE_PARTIAL=0)
#       and also the chunks it loaded of a buffer it was still loading (the default),
#       alternating (TAG-whole-N, TAG-partial-N). Each row's `staged` says what the restore's
#       stage took from the stage ahead (`reused_bytes`).
#   bash scripts/gpu-speculation.sh held-spare  (~5 min with SPEC_HUGE=1 SPEC_BARS="0 8192 t8")
#       As bars, each job migrated SPEC_SLICE_RUNS (2) times with the keeper keeping spare image
#       memory (POSSUM_KEEPER_SPARE_MIB, SPEC_SPARE_MIB or 9216, on the images' huge-page tmpfs:
#       SPEC_HUGE=1 is needed) and the held job's final copy going through the staging (the
#       default) and into that spare whole buffer by buffer (POSSUM_HELD_SPARE=1), alternating
#       (TAG-staged-N, TAG-spare-N). Each row's release (`pipeline`, `shadows_saved_by_keeper`)
#       says which way the copy went.
#   bash scripts/gpu-speculation.sh writers  (~4 min with SPEC_BARS="32 64 f32")
#       As bars, each job migrated SPEC_SLICE_RUNS (2) times with its pre-copy rounds written by
#       the default number of threads (the cores, 2 to 6) and by 16 (POSSUM_WRITERS=16, as many
#       as a final copy's on a 16-core host), alternating (TAG-six-N, TAG-sixteen-N). Each
#       row's `rounds`/`round_ms` say how long the rounds took to copy.
#   bash scripts/gpu-speculation.sh readers  (~5 min with SPEC_BARS="0 8192 t8")
#       As bars, each job migrated SPEC_SLICE_RUNS (2) times with the destination's keeper
#       reading a large buffer's chunks 4 at a time (the default) and 8 at a time
#       (POSSUM_KEEPER_STAGE_READERS=8), alternating (TAG-four-N, TAG-eight-N). Each row's
#       `waited_after_resume_ms` is the job's wait for the loads once it ran there.
#   bash scripts/gpu-speculation.sh baseline   (~4 min)
#       The frozen job (8 GiB of weights, 64 MiB of state) migrated alone by the build in
#       SPEC_BASELINE (default .gpu/baseline: possum, libpossum.so and its CRIU plugin, staged
#       by `bash scripts/gpu-ckpt.sh --stage-baseline REV`), with its defaults, then by this
#       build speculative and strict: today's build against an older one in one run (SPEC_HUGE=1
#       as for bars).
#       -> $OUT/speculation-baseline.jsonl (tags baseline, speculative, strict)
#   bash scripts/gpu-speculation.sh postcopy   (~6 min)
#       Migration alone, without and then with --post-copy, of each of SPEC_BARS (default: the
#       training job writing 8 GiB of state every step; 8 GiB of weights and 64 MiB of state).
#       -> $OUT/speculation-postcopy.jsonl
#   bash scripts/gpu-speculation.sh ahead      (~7 min)
#       The job's private memory sent ahead with the pre-copy rounds or not
#       (POSSUM_HOSTMEM_AHEAD), A/B in one run: the frozen job (8 GiB of weights) migrated alone,
#       on/off/on/off over loopback, then on/off at --max-rate 10Gbit (a 10 Gbit/s link);
#       then a training job (8 GiB of state written every step) with and without possum for
#       30 steps, and migrated (SPEC_TRAINING=0: not). SPEC_AHEAD_RUNS picks the runs
#       (TAG:AHEAD:RATE ...). -> $OUT/speculation-ahead.jsonl, speculation-training.txt
#   bash scripts/gpu-speculation.sh trials [N]  (~9 min)
#       N (50) random-step trials with the defaults (`eval/ckpt.py correctness`: kept checkpoints
#       left running then restored, and checkpoints with the job killed then restored) over the
#       workloads, few-byte writes at fixed offsets (fewbytes) and fp16 loss scaling (amp)
#       among them; every output bit-exact against a run without possum.
#       -> $OUT/speculation-trials.{jsonl,md}, speculation-trials.log
#   bash scripts/gpu-speculation.sh ab          (~5 min)
#       GPT-2 small's in-process A/B (eval/overhead.py --ab) with the defaults.
#       -> $OUT/overhead-ab-gpt2.json
# Without a GPU it says SKIPPED and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-start.sh
gpu_libraries
source scripts/gpu-criu.sh
harness_run speculation SPEC_BUDGET_S
# Every second until killed: the time, free memory and tmpfs, the kernel's compaction, huge page
# and reclaim counters, and the ten busiest threads (top's instant figures).
sample_host() {
    while :; do
        echo "== $(date +%s.%N)"
        grep -E "^(MemFree|Shmem|Cached|Dirty|Writeback):" /proc/meminfo | tr -s ' ' | tr '\n' ' '; echo
        grep -E "^(compact_stall|compact_fail|compact_success|thp_file_alloc|thp_file_fallback|pgscan_direct|pgsteal_direct|allocstall_normal|allocstall_movable) " /proc/vmstat | tr '\n' ' '; echo
        # (top's second frame: the first has no instant figures.)
        top -b -H -n 2 -d 0.5 -w 150 -o %CPU 2>/dev/null | awk '/^top -/ {n++} n == 2' | sed -n 8,17p
        sleep 0.5
    done
}
# SPEC_HUGE=1: both ends' images on a tmpfs mounted with huge=always (made here), through
# SPEC_FLAGS; $huge names it.
huge_images() {
    [ "${SPEC_HUGE:-0}" = 1 ] || return 0
    huge=/mnt/possum-huge; mount_huge "$huge" 100g || exit 1
    SPEC_FLAGS="${SPEC_FLAGS:-} --images $huge/images --work $huge/work"
}
case "${1:-}" in
frozen)
    if [ "${SPEC_SELFTEST:-1}" != 0 ]; then
        timeout -k 5 120 .gpu/possum-cuda-selftest > "$res/speculation-selftest.txt" 2>&1
        echo "selftest rc $?" >> "$res/speculation-selftest.txt"
        grep -i "fingerprint" "$res/speculation-selftest.txt"
    fi
    # SPEC_FLAGS: more of speculation.py's flags (--criu-log, --migrate-flags ...).
    # shellcheck disable=SC2086
    timeout -k 5 $(( $(left) - 15 )) python3 eval/speculation.py frozen --out "$res" \
        --gib "${SPEC_GIB:-8}" --state-mib "${SPEC_STATE_MIB:-64}" \
        --modes "${SPEC_MODES:-strict,speculative,speculative-2mib}" ${SPEC_FLAGS:-} 2>&1 | tee "$res/speculation-frozen.log"
    cp "$res/speculation.jsonl" "$res/speculation-selftest.txt" "$out"/ 2>/dev/null
    ;;
bars|slices|hold|criu-stream|copy-stream|held-writers|first-round|stage-ahead|held-spare|rewritten|partial|readers|writers)
    # SPEC_BARS: which of the bars' jobs, "GIB MIB TAG" each, separated by commas.
    IFS=, read -ra bars <<< "${SPEC_BARS:-32 64 frozen-32gib,0 8192 training-8gib}"
    huge_images
    if [ "$1" = held-spare ]; then
        # The keeper's spare on the images' filesystem, for both halves of the A/B.
        [ -n "${huge:-}" ] || { echo "held-spare needs SPEC_HUGE=1"; exit 1; }
        export POSSUM_KEEPER_SPARE_DIR="$huge/spares" POSSUM_KEEPER_SPARE_MIB="${SPEC_SPARE_MIB:-9216}"
        mkdir -p "$POSSUM_KEEPER_SPARE_DIR"
    fi
    bar() {  # $1 GIB, $2 MIB, $3 TAG: the job migrated alone, its row into speculation-bars.jsonl
        local gib=$1 mib=$2 tag=$3 sampler=
        if [ "${SPEC_SAMPLE:-0}" = 1 ]; then
            sample_host > "$out/sample-$tag.txt" 2>&1 &
            sampler=$!
        fi
        # shellcheck disable=SC2086
        timeout -k 5 "${SPEC_RUN_S:-150}" python3 eval/speculation.py frozen --out "$res/$tag" \
            --gib "$gib" --state-mib "$mib" --modes speculative --migrate-only ${SPEC_FLAGS:-} \
            --migrate-flags "${SPEC_MIGRATE_FLAGS:-}" > "$res/speculation-$tag.log" 2>&1
        if [ -n "$sampler" ]; then
            kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
            grep -h "possum: " "$res/$tag"/speculation-possum.log "$res/$tag"/*receive.err > "$out/notes-$tag.log" 2>/dev/null
        fi
        grep "migrate:" "$res/speculation-$tag.log" | cut -c1-600
        python3 -c 'import json,sys; [print(json.dumps(dict(json.loads(l), tag=sys.argv[1]))) for l in open(sys.argv[2])]' \
            "$tag" "$res/$tag/speculation.jsonl" >> "$out/speculation-bars.jsonl" 2>/dev/null
        cp "$res/speculation-$tag.log" "$out"/
    }
    for spec in "${bars[@]}"; do
        read -r gib mib tag <<< "$spec"
        if [ "$1" = bars ]; then
            bar "$gib" "$mib" "$tag"
            continue
        fi
        if [ "$1" = hold ]; then
            for i in $(seq "${SPEC_SLICE_RUNS:-2}"); do
                # (CRIU's cache of the kernel's features removed and not made: as before.)
                rm -f /run/criu.kdat /run/criu.kdat.possum
                POSSUM_MIGRATE_SEND_WHILE_HELD=0 POSSUM_MIGRATE_KILL_WHILE_SENDING=0 \
                    POSSUM_CRIU_KDAT=0 bar "$gib" "$mib" "$tag-after-$i"
                bar "$gib" "$mib" "$tag-beside-$i"
            done
            if [ "${SPEC_CRIU_LOGS:-0}" = 1 ] && [ -z "${criu_logged:-}" ]; then
                criu_logged=1
                POSSUM_CRIU_LOG_LEVEL=4 bar "$gib" "$mib" "$tag-criu-logs"
                { findmnt /run; ls -la /run/criu.kdat* /run/.criu.kdat* 2>&1; } > "$res/kdat.txt"
                # (The source's dump log goes with its image; the restore's is the destination's.)
                find "$res/$tag-criu-logs" ${huge:+$huge/work} -name 'dump.log' -o -name 'restore.log' \
                    2>/dev/null | tar czf "$out/criu-logs-$tag.tar.gz" -T - "$res/kdat.txt" 2>/dev/null
            fi
            continue
        fi
        # An A/B of one switch: each run first with the variable at 0, then with the default.
        case "$1" in
            copy-stream) ab=(POSSUM_MIGRATE_SEND_WHILE_COPYING after copying) ;;  # the final copy's chunks
            criu-stream) ab=(POSSUM_MIGRATE_STREAM_CRIU after streamed) ;;  # CRIU's pages file
            held-writers) ab=(POSSUM_HELD_WRITERS six all) ;;  # the final copy's writer threads
            first-round) ab=(POSSUM_MIGRATE_FIRST_ROUND_WHILE_COPYING after copying 1) ;;  # round 1 as copied
            stage-ahead) ab=(POSSUM_MIGRATE_STAGE_AHEAD restore ahead 1) ;;  # the destination's stage
            held-spare) ab=(POSSUM_HELD_SPARE staged spare 1) ;;  # the final copy into the keeper's spare
            rewritten) ab=(POSSUM_MIGRATE_LOAD_REWRITTEN lengths rewritten 1) ;;  # chunks sent again loaded as they come
            partial) ab=(POSSUM_KEEPER_STAGE_PARTIAL whole partial) ;;  # a stage takes its base's partly loaded buffers
            readers) ab=(POSSUM_KEEPER_STAGE_READERS four eight 8 4) ;;  # a large buffer read 4 or 8 chunks at a time
            writers) ab=(POSSUM_WRITERS six sixteen 16 6) ;;  # the pre-copy's writer threads
            *) ab=() ;;
        esac
        if [ ${#ab[@]} -gt 0 ]; then
            for i in $(seq "${SPEC_SLICE_RUNS:-2}"); do
                # (A fifth word: the variable's value in the first run, 0 if none.)
                (export "${ab[0]}=${ab[4]:-0}"; bar "$gib" "$mib" "$tag-${ab[1]}-$i")
                # (A fourth word: the variable's value in the second run, where its default is
                # the first run's.)
                (if [ -n "${ab[3]:-}" ]; then export "${ab[0]}=${ab[3]}"; fi
                 bar "$gib" "$mib" "$tag-${ab[2]}-$i")
            done
            continue
        fi
        # slices: the first round sent in one part, then in parts (the default), alternating.
        for i in $(seq "${SPEC_SLICE_RUNS:-2}"); do
            POSSUM_MIGRATE_SLICE_MIB=0 bar "$gib" "$mib" "$tag-whole-$i"
            bar "$gib" "$mib" "$tag-sliced-$i"
        done
    done
    ;;
baseline)
    base=${SPEC_BASELINE:-.gpu/baseline}
    [ -x "$base/possum" ] || { echo "no baseline build at $base"; exit 1; }
    base=$(cd "$base" && pwd)
    huge_images
    one() {  # $1 tag, $2 mode; POSSUM from the caller's environment
        # shellcheck disable=SC2086
        timeout -k 5 "${SPEC_RUN_S:-150}" python3 eval/speculation.py frozen --out "$res/$1" \
            --gib 8 --state-mib 64 --modes "$2" --migrate-only ${SPEC_FLAGS:-} \
            > "$res/speculation-$1.log" 2>&1
        grep "migrate:" "$res/speculation-$1.log" | cut -c1-400
        python3 -c 'import json,sys; [print(json.dumps(dict(json.loads(l), tag=sys.argv[1]))) for l in open(sys.argv[2])]' \
            "$1" "$res/$1/speculation.jsonl" >> "$out/speculation-baseline.jsonl" 2>/dev/null
        cp "$res/speculation-$1.log" "$out"/
    }
    POSSUM="$base/possum" POSSUM_LIB="$base/libpossum.so" one baseline speculative
    one speculative speculative
    one strict strict
    ;;
postcopy)
    # SPEC_BARS: which jobs ("GIB MIB TAG", separated by commas), each migrated alone without
    # and then with --post-copy.
    IFS=, read -ra bars <<< "${SPEC_BARS:-0 8192 training-8gib,8 64 frozen-8gib}"
    for spec in "${bars[@]}"; do
        read -r gib mib tag <<< "$spec"
        for how in default post-copy; do
            flags=(); [ "$how" = post-copy ] && flags=(--migrate-flags=--post-copy)
            # shellcheck disable=SC2086
            timeout -k 5 "${SPEC_RUN_S:-110}" python3 eval/speculation.py frozen \
                --out "$res/$tag-$how" --gib "$gib" --state-mib "$mib" --modes speculative \
                --migrate-only "${flags[@]}" ${SPEC_FLAGS:-} > "$res/speculation-$tag-$how.log" 2>&1
            grep "migrate:" "$res/speculation-$tag-$how.log" | cut -c1-400
            python3 -c 'import json,sys; [print(json.dumps(dict(json.loads(l), tag=sys.argv[1]))) for l in open(sys.argv[2])]' \
                "$tag-$how" "$res/$tag-$how/speculation.jsonl" >> "$out/speculation-postcopy.jsonl" 2>/dev/null
        done
    done
    ;;
ahead)
    one() {  # $1 tag, $2 POSSUM_HOSTMEM_AHEAD, $3 migrate flags
        POSSUM_HOSTMEM_AHEAD=$2 timeout -k 5 "${SPEC_RUN_S:-110}" python3 eval/speculation.py frozen \
            --out "$res/$1" --gib 8 --state-mib 64 --modes speculative --migrate-only \
            --migrate-timeout 90 --migrate-flags "$3" > "$res/speculation-$1.log" 2>&1
        grep -o "migrate: rc [0-9]* in [0-9.]* s: {'rc': [0-9]*, 'seconds': [0-9.]*, 'err': [^,]*, 'downtime_s': [0-9.]*" \
            "$res/speculation-$1.log"
        python3 -c 'import json,sys; [print(json.dumps(dict(json.loads(l), tag=sys.argv[1]))) for l in open(sys.argv[2])]' \
            "$1" "$res/$1/speculation.jsonl" >> "$out/speculation-ahead.jsonl" 2>/dev/null
    }
    for run in ${SPEC_AHEAD_RUNS:-on-1:1: off-1:0: on-2:1: off-2:0: on-10gbit:1:10Gbit off-10gbit:0:10Gbit}; do
        IFS=: read -r tag ahead rate <<< "$run"
        one "$tag" "$ahead" "${rate:+--max-rate $rate}"
    done
    if [ "${SPEC_TRAINING:-1}" != 0 ]; then
        {
            for how in bare possum; do
                pre=(); [ "$how" = possum ] && pre=("$POSSUM" run)
                t0=$(date +%s%N)
                timeout -k 5 60 "${pre[@]}" python3 workloads/gpu/jobs.py mlp --steps 30 --state-mib 8192 \
                    --sleep-ms 20 > "$res/training-$how.out" 2> "$res/training-$how.err"
                echo "$how: rc $? in $(( ($(date +%s%N) - t0) / 1000000 )) ms, $(grep -c step "$res/training-$how.out") steps"
                tail -3 "$res/training-$how.err"
            done
        } 2>&1 | tee "$out/speculation-training.txt"
        timeout -k 5 100 python3 eval/speculation.py frozen --out "$res/training" --gib 0 --state-mib 8192 \
            --modes speculative --migrate-only --warmup 10 --warmup-timeout 40 --migrate-timeout 60 \
            > "$res/speculation-training.log" 2>&1
        cut -c1-1500 "$res/speculation-training.log" | tee -a "$out/speculation-training.txt"
        cp "$res"/training/*.err "$res/training/speculation-possum.log" "$out"/ 2>/dev/null
    fi
    ;;
trials)
    CKPT_TIMEOUT=120 OUT="$res/c" timeout -k 5 $(( $(left) - 15 )) bash scripts/gpu-ckpt.sh correctness \
        --engines possum-keeper,possum-keeper-kill --trials "$(( ${2:-50} / 2 )),$(( ${2:-50} - ${2:-50} / 2 ))" \
        --parallel 3 --seed 43 --budget-s $(( $(left) - 40 )) \
        --jobs mlp,fewbytes,amp,gpt2,cnn,triton,graph,multistream,mlp+expandable,gpt2+async \
        > "$res/speculation-trials.log" 2>&1
    cp "$res/c/ckpt-correctness.jsonl" "$out/speculation-trials.jsonl" 2>/dev/null
    cp "$res/c/correctness.md" "$out/speculation-trials.md" 2>/dev/null
    grep -h "trials identical\|not started" "$res/speculation-trials.log"
    cp "$res/speculation-trials.log" "$out"/
    ;;
ab)
    timeout -k 5 $(( $(left) - 10 )) python3 eval/overhead.py --ab --job gpt2 --pairs 3 --steps 1800 \
        --ab-ms 400 --ab-skip 100 --budget-s $(( $(left) - 30 )) --out "$res" > "$res/ab.log" 2>&1
    cp "$res"/overhead-ab-gpt2*.json "$out"/ 2>/dev/null
    tail -5 "$res/ab.log"
    ;;
*) echo "usage: gpu-speculation.sh frozen | bars | slices | hold | criu-stream | copy-stream | held-writers | first-round | stage-ahead | held-spare | rewritten | partial | readers | baseline | postcopy | ahead | trials [N] | ab"; exit 2 ;;
esac
(cd /dev/shm && tar czf "$out/speculation-$1.tgz" --exclude='img-*' --exclude='received' \
    --exclude='possum-speculation' possum-speculation-out 2>/dev/null)
exit 0
