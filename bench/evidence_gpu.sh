#!/usr/bin/env bash
# Issue 9 on one host, at most ~9.5 minutes: end to end on Llama-2-7B (peak memory at batch 1,
# the largest batch verified by a run, tokens/s at both) for bf16+adamw, COAT and COAT with bf16
# gradients, and the fidelity runs (114M Llama, 2000 steps) with the bf16-gradient run added.
# Two GPUs: both at once (CUDA_VISIBLE_DEVICES 0 and 1); one GPU: one after the other, each
# with half the time.
#
#   OUT=/some/dir bash bench/evidence_gpu.sh      (OUT defaults to bench/results)
#   POLICIES=bf16+adamw,coat+fp8_adamw E2E_BUDGET=500 bash bench/evidence_gpu.sh
#                                                 (fewer e2e policies, more time for each)
#
# Every process sets train.py's allocator (coat_jax.training.allocator) unless XLA_PYTHON_CLIENT_*
# variables are exported.
source "$(dirname "$0")/gpu_env.sh"
GPUS=$(nvidia-smi -L | wc -l)
E2E=(bench/e2e.py --model llama2_7b --time_budget_s "${E2E_BUDGET:-420}"
     --policies "${POLICIES:-bf16+adamw,coat+fp8_adamw,coat+fp8_adamw+bf16_grads}"
     --json "$OUT/e2e_llama2_7b_${CARD}_$DAY.json")
FID=(bench/fidelity.py --chunk_steps 2000 --time_budget_s 480
     --baseline bf16+adamw
     --runs "bf16+adamw;coat+fp8_adamw;coat+fp8_adamw, no expansion;coat+fp8_adamw, bf16 gradients"
     --json "$OUT/fidelity_llama_114m_${CARD}_$DAY.json"
     --png "$OUT/fidelity_llama_114m_${CARD}_$DAY.png")
if [ "$GPUS" -ge 2 ]; then
  (CUDA_VISIBLE_DEVICES=0 timeout 560 $PY "${E2E[@]}" > "$OUT/e2e_${CARD}_$DAY.log" 2>&1) &
  (CUDA_VISIBLE_DEVICES=1 timeout 560 $PY "${FID[@]}" > "$OUT/fidelity_${CARD}_$DAY.log" 2>&1) &
  wait
else
  E2E[4]=240; FID[4]=240  # the two --time_budget_s values: half each
  timeout 280 $PY "${E2E[@]}" > "$OUT/e2e_${CARD}_$DAY.log" 2>&1
  timeout 280 $PY "${FID[@]}" > "$OUT/fidelity_${CARD}_$DAY.log" 2>&1
fi
tail -12 "$OUT/e2e_${CARD}_$DAY.log"; tail -12 "$OUT/fidelity_${CARD}_$DAY.log"
