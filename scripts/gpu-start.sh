# Sourced first by the GPU scripts, from the repository root: without a GPU it says SKIPPED and
# ends the sourcing script with 0. Defines what several of them set up alike.
nvidia-smi -L >/dev/null 2>&1 || { echo "SKIPPED: no GPU (nvidia-smi -L failed)"; exit 0; }

# NVIDIA's libraries, where the GPU machines have them, first on LD_LIBRARY_PATH.
gpu_libraries() {
    export LD_LIBRARY_PATH="/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

# A harness run from the build in .gpu/ (gpu-ckpt.sh --stage): $out, the results directory
# ($OUT or .gpu/out, absolute); $res, /dev/shm/possum-$1-out, made empty; POSSUM and POSSUM_LIB;
# and `left`, the seconds left of the budget in the variable named $2 (570 when unset), counted
# from now.
harness_run() {
    out="${OUT:-.gpu/out}"; mkdir -p "$out"; out=$(cd "$out" && pwd)
    res="/dev/shm/possum-$1-out"; rm -rf "$res"; mkdir -p "$res"
    export PYTHONUNBUFFERED=1
    export POSSUM="$PWD/.gpu/possum" POSSUM_LIB="$PWD/.gpu/libpossum.so"
    start=$(date +%s)
    budget_var=$2
}
left() { echo $(( ${!budget_var:-570} - ($(date +%s) - start) )); }

# mount_huge DIR SIZE: a huge-page tmpfs.
source scripts/huge-tmpfs.sh

# The huge-page tmpfs gpu-speculation.sh mounts for its images (SPEC_HUGE=1), unmounted, and its
# results directory removed: their memory back before the next step of a call.
free_huge_images() { umount /mnt/possum-huge 2>/dev/null; rm -rf /dev/shm/possum-speculation-out; }

# spec_bars STEP SECS [VAR=VALUE...]: `gpu-speculation.sh bars` as step STEP of a harness run
# (its images on the huge-page tmpfs, the variables for it given: SPEC_BARS names each row's
# tag), within SECS and the call's time left; its log $res/STEP.log, its rows appended to
# $out/$bars_out (bars.jsonl unless the caller sets bars_out).
spec_bars() {
    local step=$1 secs=$2; shift 2
    [ "$secs" -le $(( $(left) - 10 )) ] || secs=$(( $(left) - 10 ))
    [ "$secs" -gt 20 ] || { echo "== $step: no time left"; return; }
    echo "== $step, $(left) s left"
    env OUT="$res/$step" SPEC_HUGE=1 "$@" timeout -k 5 "$secs" \
        bash scripts/gpu-speculation.sh bars > "$res/$step.log" 2>&1
    grep -h "migrate:" "$res/$step.log" | cut -c1-200
    cat "$res/$step/speculation-bars.jsonl" >> "$out/${bars_out:-bars.jsonl}" 2>/dev/null
    free_huge_images
}

# migrations STEP SECS JOBS TRIALS PARALLEL SEED [ENGINES]: random migrations of JOBS at
# random steps, bit-exact against a run without possum (`gpu-ckpt.sh correctness`, images on
# a huge-page tmpfs), TRIALS of each of ENGINES (default without and with `--post-copy`),
# PARALLEL at once, within SECS (the trials' budget 30 s less, for the last one to end), into
# $res/STEP; its log $res/STEP.log.
migrations() {
    POSSUM_CKPT_HUGE=1 OUT="$res/$1" timeout -k 5 "$2" \
        bash scripts/gpu-ckpt.sh correctness \
        --engines "${7:-possum-keeper-migrate,possum-keeper-migrate-postcopy}" \
        --jobs "$3" --trials "$4" --parallel "$5" --seed "$6" --budget-s $(( $2 - 30 )) \
        > "$res/$1.log" 2>&1
}
