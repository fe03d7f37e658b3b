#!/usr/bin/env bash
# Checks on the GPU machine: checkpoint/restore of live GPU jobs, with the build and CRIU's
# packages carried in .gpu/ (eval/ckpt.py does the work; its docstring says what each mode does).
#
# A full check of the default hooks fits three device calls of at most 10 minutes each
# (about 23 minutes of device time; each writes at most 7 files under $OUT):
#   A (~8.5 min): bash scripts/gpu-interposer.sh coverage; AB=1 bash scripts/gpu-overhead.sh
#       -> coverage.{json,md}, coverage-logs.tgz, overhead-check.json, overhead-ab-{mlp,gpt2}.json, overhead-logs.tgz
#   B (~8 min):   timeout -k 5 590 bash scripts/gpu-ckpt.sh correctness --trials 20 --budget-s 540
#       -> ckpt-correctness.jsonl, correctness.md, ckpt-logs.tgz
#   C (~6.5 min): timeout -k 5 590 bash scripts/gpu-ckpt.sh figures --budget-s 540
#       -> figures.{json,md}, ckpt-figures.jsonl, ckpt-logs.tgz
#
#   (here)  bash scripts/gpu-ckpt.sh --stage        build possum + libpossum.so, download CRIU .debs
#           (POSSUM_CRIU_ALLOW_EXPIRED=1 where the package mirror serves lists past Valid-Until)
#   (here)  bash scripts/gpu-ckpt.sh --stage-baseline REV   an older build into .gpu/baseline (A/B)
#   (there) bash scripts/gpu-ckpt.sh MODE [ARGS]    MODE: smoke | correctness | figures | errors | bench | probe | migrate
#           (ARGS go to eval/ckpt.py: --trials N --jobs a,b --engines a,b --gib 8,32 --reps N --budget-s S ...)
#
# The modes, on the H100 (carry .gpu; each line one device call of at most 10 minutes):
#   bash scripts/gpu-ckpt.sh correctness --trials 20 --budget-s 540                    (~8 min)
#       `possum checkpoint` with no engine flag of jobs under libpossum.so with its default hooks
#       (the driver's entry points), each checkpointed at a random step with --leave-running (the
#       job must end bit-identical) and its image restored (bit-identical from there on). Jobs
#       (--jobs): every workload of jobs.py, ptrtable and lcuda (CUDA C), MLP and GPT-2 with
#       PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (+expandable) and
#       backend:cudaMallocAsync (+async); 12 jobs, 20 trials take each in turn. A trial that would
#       end after --budget-s is not started (the summary says how many). References of every job
#       run first, all at once (~40 s); a trial takes 12-32 s.
#       -> $OUT/ckpt-correctness.jsonl (one row per trial), $OUT/correctness.md, $OUT/ckpt-logs.tgz
#   bash scripts/gpu-ckpt.sh figures --budget-s 540                                   (~7 min)
#       The MLP at 1, 8 and 32 GiB of extra state x engines possum (entry hooks), possum-frozen
#       (state only read: --ballast-frozen), driver (--engine driver), possum-hold (POSSUM_HOOKS=off:
#       the parking hold), one rep each (estimated 390 s; cells that no longer fit the budget
#       are skipped and listed): stall seen by the job and its parts (engine/driver/CRIU), checkpoint
#       total, restore to the first step, time until every buffer is back (the restored job's
#       possum.session.last.restore), image size. Saved after every run.
#       -> $OUT/figures.json, $OUT/figures.md, $OUT/ckpt-figures.jsonl, $OUT/ckpt-logs.tgz
#   Expandable segments and cudaMallocAsync are served by possum by default (`+expandable`,
#   `+async`; `+vmm` / `+pools` say so explicitly); `+expandable-driver` / `+async-driver` leave
#   that memory to the driver (POSSUM_SERVE_VMM=0 / POSSUM_SERVE_POOLS=0), for comparison.
#   Engines (--engines): possum, possum-hold, driver, gpu-only; suffixes -frozen, -cupti (job with
#   POSSUM_HOOKS=cupti, CUPTI at $CKPT_JOB_CUPTI or the torch venv's: only for --gpu-only/driver).
#
#   bench: bash scripts/gpu-ckpt.sh bench --engines driver,possum --reps 2   (the default plan:
#           every workload at 1 GiB, the MLP at 8 and 32 too; --bench-plan "JOB:GIB,.. ..." for others;
#           the whole matrix as three invocations: --bench-plan full --shard 1/3 (2/3, 3/3))
#   --device (kind nvidia-h200-x2): bash scripts/gpu-ckpt.sh migrate --engines driver,possum
#   (here)  python3 eval/report.py FILES_AT/bench.json   (after `bench`: the table and plots into
#           eval/results/; --readme FILE also fills FILE's results markers)
# POSSUM_CKPT_HUGE=1 puts the images on a huge-page tmpfs (below); POSSUM_CKPT_WORK names another
# directory for them. The jobs: CKPT_HOST_BATCH_MIB=N copies an N MiB batch from pinned memory
# every step (figures then report the steps' time during a kept checkpoint's save against a
# normal step); CKPT_STATE_MIB=N gives each torch job a state of N MiB written whole every step
# (a training job's; from 1 GiB, trials run five times the steps and stop the job in their first
# third, as migrated jobs' trials always do, so that a migration's hold comes while it steps);
# CKPT_BALLAST_READ_ALL=1 makes every step read all the extra state, as an
# inference job reads its weights (the serverless cold start: `figures --engines
# possum-keeper-frozen --bench-plan mlp:16` gives the fresh start to the first step and the
# restore from the image to the first step); CKPT_LIBPOSSUM=PATH runs them under another build
# of libpossum.so (an A/B of two builds in one run).
# Results: $OUT (or .gpu/out)/ckpt-MODE.jsonl and the files above; the jobs' logs (stderr, step
# logs) as ckpt-logs.tgz. Without a GPU it says SKIPPED and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--stage-baseline" ]; then
    # An older build (REV) beside this one, for an A/B in one run (gpu-speculation.sh baseline):
    # built in a worktree of its own into .gpu/baseline.
    rev=${2:?usage: gpu-ckpt.sh --stage-baseline REV}
    wt="${TMPDIR:-/tmp}/possum-baseline-$rev"
    [ -d "$wt" ] || git worktree add -f "$wt" "$rev" >/dev/null || exit 1
    (cd "$wt" && CARGO_TARGET_DIR="${BASELINE_TARGET:-$wt/target}" cargo build --release \
        -p possum-interposer -p possum -p possum-criu-plugin) || exit 1
    t="${BASELINE_TARGET:-$wt/target}/release"
    mkdir -p .gpu/baseline
    cp "$t/libpossum.so" "$t/possum" "$t/libpossum_criu_plugin.so" .gpu/baseline/
    strip .gpu/baseline/possum && strip --strip-debug .gpu/baseline/*.so
    du -sh .gpu/baseline
    exit 0
fi
if [ "${1:-}" = "--stage" ]; then
    cargo build --release -p possum-interposer -p possum -p possum-criu-plugin || exit 1
    # (And the probe of CRIU's dump: who writes the pages, `gpu-dump-pages.sh`.)
    cargo build --release -p possum-criu --example dump-pages || exit 1
    mkdir -p .gpu
    cp target/release/libpossum.so target/release/possum target/release/libpossum_criu_plugin.so .gpu/
    cp target/release/examples/dump-pages .gpu/
    strip .gpu/possum .gpu/dump-pages && strip --strip-debug .gpu/libpossum.so .gpu/libpossum_criu_plugin.so
    [ -d .gpu/criu-debs ] || bash scripts/install-criu.sh --download-only .gpu/criu-debs || exit 1
    du -sh .gpu/*
    exit 0
fi
if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "SKIPPED: no GPU (nvidia-smi -L failed)"
    exit 0
fi
mode=${1:?usage: gpu-ckpt.sh --stage | smoke | correctness | figures | errors | bench | probe | migrate | repeat}
shift
export LD_LIBRARY_PATH="/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$PATH:/usr/local/cuda/bin"
# Jobs run with possum's default hooks (the driver's entry points): no POSSUM_HOOKS/POSSUM_CUPTI
# from here (eval/ckpt.py sets them per engine variant and drops inherited ones).
source scripts/gpu-criu.sh
# POSSUM_CKPT_HUGE=1: the images go to a tmpfs mounted with huge=always (2 MiB pages; writes to it
# run at up to 42 GB/s from 16 threads against 31 for /dev/shm, eval/results/README.md), made here.
if [ "${POSSUM_CKPT_HUGE:-0}" = 1 ]; then
    source scripts/huge-tmpfs.sh
    huge=/tmp/possum-huge-tmpfs; mount_huge "$huge" 90g || exit 1
    export POSSUM_CKPT_WORK="$huge/possum-ckpt"
fi
export POSSUM_CKPT_WORK="${POSSUM_CKPT_WORK:-/dev/shm/possum-ckpt}"
mkdir -p "$POSSUM_CKPT_WORK"
if [ "$mode" = correctness ] || [ "$mode" = smoke ]; then
    # The CUDA C jobs: ptrtable (libcudart shared: possum serves its cudaMalloc) and lcuda (linked
    # with -lcuda, launching through cuLaunchKernel itself).
    [ -x "$POSSUM_CKPT_WORK/ptrtable" ] || nvcc -O2 -arch=sm_90 -cudart shared -o "$POSSUM_CKPT_WORK/ptrtable" workloads/gpu/ptrtable.cu \
        || echo "nvcc ptrtable failed"
    [ -x "$POSSUM_CKPT_WORK/lcuda" ] || nvcc -O2 -arch=sm_90 -o "$POSSUM_CKPT_WORK/lcuda" workloads/gpu/lcuda.cu -lcuda \
        || nvcc -O2 -arch=sm_90 -o "$POSSUM_CKPT_WORK/lcuda" workloads/gpu/lcuda.cu -L/usr/local/cuda/lib64/stubs -lcuda \
        || echo "nvcc lcuda failed"
fi
"$POSSUM_CRIU" --version | head -1
res="${OUT:-.gpu/out}"; mkdir -p "$res"; res=$(cd "$res" && pwd)
python3 eval/ckpt.py "$mode" --out "$res" "$@"
rc=$?
# The jobs' stderr and step logs (small), the images left out.
(cd "$POSSUM_CKPT_WORK" && ls *.err *.log *.log.1 2>/dev/null | tar czf "$res/ckpt-logs.tgz" -T - 2>/dev/null) || true
exit $rc
