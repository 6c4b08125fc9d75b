#!/usr/bin/env bash
# The optimizer on one Hopper GPU: its tests (compiled Pallas kernels against the references,
# non-finite gradients included; CPU-side tests of the same files run too), then
# bench/optimizer.py on this checkout and, when given, on an earlier checkout of the project
# (one after another on the same GPU).
#
#   OUT=/tmp/out bash bench/optimizer_gpu.sh [EARLIER_CHECKOUT]
source "$(dirname "$0")/gpu_env.sh"
EARLIER=${1:-}
$PY -m pytest -q -p no:cacheprovider tests/test_pallas_adam_step.py tests/test_pallas_adam_update.py \
  tests/test_optim_nonfinite.py tests/test_optim.py tests/test_fp8_state.py \
  "tests/test_train_faults.py::test_a_nonfinite_step_leaves_params_and_state_unchanged" \
  2>&1 | tee "$OUT/gpu_tests_optimizer_${CARD}_$DAY.txt" | tail -3
if [ -n "$EARLIER" ]; then
  (cd "$EARLIER" && PYTHONPATH=. $PY bench/optimizer.py --json "$OUT/optimizer_earlier_${CARD}_$DAY.json") \
    | tail -9
fi
$PY bench/optimizer.py --json "$OUT/optimizer_${CARD}_$DAY.json" | tail -9
