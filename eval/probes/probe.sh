# What the GPU probes start with, sourced by each (`source "$(dirname "$0")/probe.sh"`): it
# moves to the repository root, where the probes run from.
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1

# gpu_probe [SUB]: says SKIPPED and exits 0 without a GPU; else sets `res`, the directory the
# probe writes into ($OUT, or .gpu/out; with SUB under it), made.
gpu_probe() {
  nvidia-smi -L >/dev/null 2>&1 || { echo "SKIPPED: no GPU (nvidia-smi -L failed)"; exit 0; }
  res="${OUT:-.gpu/out}${1:+/$1}"
  mkdir -p "$res"
}

# huge_tmpfs DIR SIZE: a tmpfs of SIZE whose pages are always huge mounted at DIR, unless one is
# there already; exits 1 when it cannot be mounted.
source scripts/huge-tmpfs.sh
huge_tmpfs() { mount_huge "$1" "$2" || exit 1; }

# wait_steps LOG: until the job logging to LOG has logged 100 steps (90 s at most).
wait_steps() {
  for _ in $(seq 900); do [ "$(wc -l < "$1" 2>/dev/null || echo 0)" -ge 100 ] && break; sleep 0.1; done
}

# keeper_in W: a keeper (.gpu/possum keeper) serving in W/keeper, its output in W/keeper.out and
# W/keeper.err, once it says it is ready (10 s at most); `keeper` its PID.
keeper_in() {
  .gpu/possum keeper --dir "$1/keeper" > "$1/keeper.out" 2> "$1/keeper.err" &
  keeper=$!
  for _ in $(seq 100); do grep -q ready "$1/keeper.out" 2>/dev/null && break; sleep 0.1; done
}

# mlp_with_keeper W GIB: the MLP holding GIB GiB under .gpu/libpossum.so in a session of its own,
# with the keeper of [keeper_in] W and its sockets in W/sockets, logging its steps to W/job.log,
# once it has logged 100 of them; `pid` its PID.
mlp_with_keeper() {
  POSSUM_KEEPER="$1/keeper" POSSUM_SOCKET_DIR="$1/sockets" LD_PRELOAD="$PWD/.gpu/libpossum.so" setsid \
    python3 workloads/gpu/jobs.py mlp --steps 1000000 --hold-gib "$2" --sleep-ms 1 \
    --log "$1/job.log" > /dev/null 2> "$1/job.err" &
  pid=$!
  wait_steps "$1/job.log"
}
