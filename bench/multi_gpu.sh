#!/usr/bin/env bash
# Issue 10 (and issue 7's 2-GPU numbers): COAT's Table 3 on N GPUs of one host, FSDP over all
# of them: Llama-2-7B, context 2048, global batch N (one sequence per GPU), bf16+adamw against
# coat+fp8_adamw (peak memory per GPU, largest batch, tokens/s total and per GPU, MFU).
#
#   OUT=/some/dir bash bench/multi_gpu.sh       (N = nvidia-smi's GPU count; OUT: bench/results)
#   PROFILE=1 BUDGET=360 bash bench/multi_gpu.sh   (then a step profile of each policy)
#
# On 8 H200s that runs (BUDGET: the whole run's time budget in seconds, default 540):
#
#   python3 bench/e2e.py --model llama2_7b --fsdp 8 \
#     --batch 8 --policies bf16+adamw,coat+fp8_adamw --time_budget_s 540 \
#     --json bench/results/e2e_llama2_7b_8xh200_$(date +%F).json
#
# Both policies run with bf16 gradients (GRAD_DTYPE, default bfloat16): the FP8 weight-gradient
# GEMMs then emit bf16 and the reduce-scatters run on bf16 (issue 23); GRAD_DTYPE=float32 gives
# the 2026-11-30 setting. GPUS=2 uses the first two GPUs only. Each policy runs in its own child processes (see e2e.py),
# under train.py's allocator unless XLA_PYTHON_CLIENT_* variables are exported.
source "$(dirname "$0")/gpu_env.sh"

N=${GPUS:-$(nvidia-smi -L | wc -l)}
GRAD=${GRAD_DTYPE:-bfloat16}
echo "== e2e: llama2_7b, FSDP over $N GPUs, global batch $N, grad_dtype=$GRAD"
$PY bench/e2e.py --model llama2_7b --fsdp "$N" --batch "$N" --set grad_dtype="$GRAD" \
  --policies bf16+adamw,coat+fp8_adamw --time_budget_s "${BUDGET:-540}" \
  --json "$OUT/e2e_llama2_7b_${N}x${CARD}_$DAY.json" \
  2>&1 | tee "$OUT/e2e_llama2_7b_${N}x${CARD}_$DAY.txt"

# PROFILE=1: also where each policy's sharded step spends its time (communication vs GEMMs vs
# the rest; bench/profile_step.py, about 90 s per policy on 2 H200s).
if [ "${PROFILE:-0}" = 1 ]; then
  for P in "precision=bf16 optimizer.name=adamw" "precision=coat optimizer.name=fp8_adamw"; do
    set -- $P
    NAME=$(echo "$1" | cut -d= -f2)
    echo "== profile: $P, FSDP $N"
    timeout 240 $PY bench/profile_step.py --config configs/llama2_7b.py --set "$1" --set "$2" \
      --set mesh.data=1 --set mesh.fsdp="$N" --set batch_size="$N" --set grad_dtype="$GRAD" --trace_dir "/tmp/profile_$NAME" \
      --json "$OUT/profile_llama2_7b_${NAME}_fsdp${N}_${N}x${CARD}_$DAY.json" 2>&1 | tail -25
  done
fi
