#!/usr/bin/env bash
# Services on one GPU: jobs with sockets and NCCL under `possum run`, checkpointed left running,
# checkpointed, killed and restored, and migrated over loopback (both ends on this host), every
# answer and every step checked (eval/services.py says how). Builds nothing: carry .gpu, staged
# here by `bash scripts/gpu-ckpt.sh --stage` (possum, libpossum.so, the CRIU plugin, CRIU's .debs).
#   bash scripts/gpu-services.sh smoke    (~4 min)
#       possum doctor; a one-rank torchrun DDP job under possum run to its end (NCCL's init under
#       libpossum.so); the model server through the three operations; one DDP and one FSDP trial.
#   bash scripts/gpu-services.sh all      (~9 min)
#       The model server at 20 requests/s through the three operations; then one-rank DDP and
#       FSDP, 5 trials each (every trial: the three operations at random steps), bit-exact.
#   bash scripts/gpu-services.sh ranks [MODES [TRIALS [SEED]]]
#       The one-rank trials alone (MODES ddp,fsdp, TRIALS 5 each, SEED 42 for the random steps).
#   bash scripts/gpu-services.sh server [OPS]   (~2 min for one operation)
#       The model server alone through OPS (default running,restore,migrate); SERVICES_FLAGS
#       passes more flags (`--work DIR`: its images and the received ones there).
# Results in $OUT (or .gpu/out): services-{smoke,all}.log (what each step said), server.json,
# ranks.json, services-doctor.txt, and services.tgz with every log, the client's record of each
# request and the step logs.
# Without a GPU it says SKIPPED and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-start.sh
gpu_libraries
export PATH="$PATH:/usr/local/cuda/bin"
source scripts/gpu-criu.sh
harness_run services SERVICES_BUDGET_S
{
    uname -r; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    "$POSSUM_CRIU" --version | head -1
    python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
} > "$res/services-env.txt" 2>&1
case "${1:-}" in
smoke)
    timeout 60 "$POSSUM" doctor > "$res/services-doctor.txt" 2>&1; echo "doctor rc $?" >> "$res/services-doctor.txt"
    timeout -k 5 200 python3 eval/services.py nccl-init --out "$res" 2>&1 | tee "$res/services-smoke.log"
    timeout -k 5 200 python3 eval/services.py server --out "$res" --settle-s 3 2>&1 | tee -a "$res/services-smoke.log"
    timeout -k 5 $(( $(left) - 10 )) python3 eval/services.py ranks --out "$res" --trials 1 \
        --steps 160 --budget-s $(( $(left) - 20 )) 2>&1 | tee -a "$res/services-smoke.log"
    ;;
all)
    timeout -k 5 200 python3 eval/services.py server --out "$res" --settle-s 3 2>&1 | tee "$res/services-all.log"
    timeout -k 5 $(( $(left) - 10 )) python3 eval/services.py ranks --out "$res" --trials "${SERVICES_TRIALS:-5}" --steps 200 \
        --budget-s $(( $(left) - 20 )) 2>&1 | tee -a "$res/services-all.log"
    ;;
ranks)
    timeout -k 5 $(( $(left) - 10 )) python3 eval/services.py ranks --out "$res" --modes "${2:-ddp,fsdp}" \
        --trials "${3:-5}" --steps 200 --seed "${4:-42}" --budget-s $(( $(left) - 20 )) 2>&1 | tee "$res/services-ranks.log"
    ;;
server)
    timeout -k 5 $(( $(left) - 10 )) python3 eval/services.py server --out "$res" --settle-s 3 \
        --ops "${2:-running,restore,migrate}" ${SERVICES_FLAGS:-} 2>&1 | tee "$res/services-server.log"
    ;;
*) echo "usage: gpu-services.sh smoke | all | ranks [MODES [TRIALS [SEED]]] | server [OPS]"; exit 2 ;;
esac
cat "$res/services-env.txt"
cp "$res"/services-*.log "$res"/server.json "$res"/ranks.json "$res"/services-doctor.txt "$out"/ 2>/dev/null
(cd /dev/shm && tar czf "$out/services.tgz" --exclude='img-*' --exclude='received' possum-services-out \
    possum-services 2>/dev/null)
exit 0
