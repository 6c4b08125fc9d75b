#!/usr/bin/env bash
# OLMo-1B through train.py on one GPU (COAT + fp8_adamw at the planner's largest batch, a short
# run), then generation from that run; logs and the run's metrics under $OUT.
#
#   OUT=/tmp/out bash bench/olmo_gpu.sh [STEPS]
source "$(dirname "$0")/gpu_env.sh"
STEPS=${1:-30}
RUN=$(mktemp -d)/olmo_1b
$PY train.py --config configs/olmo_1b.py --config.batch_size=-1 --config.steps="$STEPS" \
  --config.optimizer.warmup_steps=5 --config.log_interval=10 --config.eval_interval="$STEPS" \
  --config.checkpoint_interval="$STEPS" --config.progress=False --config.workdir="$RUN" \
  2>&1 | tee "$OUT/olmo_1b_train_${CARD}_$DAY.txt" | grep -v "^W\|Warning" | tail -12
cp "$RUN/metrics.jsonl" "$OUT/olmo_1b_metrics_${CARD}_$DAY.jsonl" 2>/dev/null
$PY -m coat_jax.generate --from "$RUN" --prompt "def " --max_new_tokens 48 \
  2>&1 | tee "$OUT/olmo_1b_generate_${CARD}_$DAY.txt" | tail -4
