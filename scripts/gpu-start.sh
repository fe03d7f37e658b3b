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
