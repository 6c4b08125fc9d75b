#!/usr/bin/env bash
# The README's user path on one GPU, through train.py alone (no allocator variables set: train.py
# chooses them): per policy, `--dry_run` prints the largest batch; `--config.batch_size=-1`
# trains at it (a few steps: tokens/s, MFU, peak memory from metrics.jsonl; the same flags, so
# it reads the dry run's search instead of repeating it); one sequence more is then tried, to
# show the largest batch is the largest (expected: out of memory).
#
#   OUT=/some/dir bash bench/trainer_gpu.sh               # both policies, Llama-2-7B
#   POLICIES="coat" CONFIG=configs/llama2_7b.py STEPS=8 bash bench/trainer_gpu.sh
#   EXTRA="--config.memory_limit_gb=0.3" CONFIG=configs/llama_tiny.py ...   # (a CPU smoke run)
#   DRY_RUN=0 ...   # skip --dry_run (batch_size=-1 runs the same search and prints its result)
#   FRESH=0 ...     # keep $WORK (earlier policies and the compilation cache) from a previous call
#
# Writes $OUT/trainer_<model>_<policy>_<gpu>_<date>.log per policy and one JSON summary,
# $OUT/trainer_<model>_<gpu>_<date>.json.
source "$(dirname "$0")/gpu_env.sh"
CONFIG=${CONFIG:-configs/llama2_7b.py}
MODEL=$(basename "$CONFIG" .py)
STEPS=${STEPS:-8}
WORK=${WORK:-/tmp/trainer_gpu}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 \
      | awk '{print tolower($NF)}')
GPU=${GPU:-cpu}
[ "${FRESH:-1}" = 1 ] && rm -rf "$WORK"
mkdir -p "$WORK"
declare -A SETS=([bf16]="--config.precision=bf16 --config.optimizer.name=adamw"
                 [coat]="--config.precision=coat --config.optimizer.name=fp8_adamw")
for P in ${POLICIES:-bf16 coat}; do
  LOG="$OUT/trainer_${MODEL}_${P}_${GPU}_$DAY.log"
  COMMON=(train.py --config "$CONFIG" ${SETS[$P]} --config.compile_cache_dir="$WORK/xla_cache"
          ${EXTRA:-})
  RUN=(--config.steps="$STEPS" --config.log_interval=$((STEPS / 2)) --config.eval_batches=1
       --config.checkpoint_interval=0 --config.optimizer.warmup_steps=1)
  {
    if [ "${DRY_RUN:-1}" = 1 ]; then
      echo "== $P: dry run"
      time $PY "${COMMON[@]}" "${RUN[@]}" --config.workdir="$WORK/$P/plan" --dry_run
    fi
    echo "== $P: train at the largest batch (--config.batch_size=-1)"
    time $PY "${COMMON[@]}" "${RUN[@]}" --config.workdir="$WORK/$P/run" --config.batch_size=-1
    B=$($PY -c "import json; print(json.load(open('$WORK/$P/run/config.json'))['batch_size'])")
    echo "== $P: one sequence more, batch $((B + 1)) (expected: out of memory)"
    time $PY "${COMMON[@]}" "${RUN[@]}" --config.workdir="$WORK/$P/over" \
      --config.batch_size=$((B + 1)) --config.steps=2 --config.log_interval=1 2>&1 | tail -4
  } > "$LOG" 2>&1
  tail -25 "$LOG"
done
$PY - "$WORK" "$OUT/trainer_${MODEL}_${GPU}_$DAY.json" "$MODEL" <<'EOF'
import json, os, sys
import jax
work, out, model = sys.argv[1:]
summary = {"model": model, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "allocator": "train.py's defaults (PREALLOCATE=true, MEM_FRACTION=0.95)", "policies": {}}
for policy in sorted(os.listdir(work)):
    if policy == "xla_cache":
        continue
    plan_file = os.path.join(work, policy, "plan", "memory_plan.json")
    plan = json.load(open(plan_file)) if os.path.exists(plan_file) else {}
    path = os.path.join(work, policy, "run", "metrics.jsonl")
    records = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    last = records[-1] if records else {}
    over = os.path.join(work, policy, "over", "metrics.jsonl")
    config = os.path.join(work, policy, "run", "config.json")
    trained_batch = json.load(open(config))["batch_size"] if os.path.exists(config) else None
    summary["policies"][policy] = {
        "planned_largest_batch": plan.get("largest_batch"), "trained_batch": trained_batch,
        "plan_at_config_batch": plan,
        "trained": {k: last.get(k) for k in ("step", "train_loss", "tokens_per_s", "mfu",
                                             "peak_mem_gb", "step_ms")},
        "one_more_sequence_ran": os.path.exists(over)}
    print(policy, summary["policies"][policy]["planned_largest_batch"],
          summary["policies"][policy]["trained"])
json.dump(summary, open(out, "w"), indent=2)
print("wrote", out)
EOF
