#!/usr/bin/env bash
# Issue 5 on one Hopper GPU, at most ~8 minutes by the limits below: the kernel bandwidth table
# and the optimizer-step table (the evidence first), compiled kernel tests, the tuning sweep;
# tables to stdout, JSON under $OUT.
#
#   OUT=/some/dir bash bench/kernels_gpu.sh      (OUT defaults to bench/results)
#
# Each stage has its own time limit so that one slow stage cannot eat the others.
source "$(dirname "$0")/gpu_env.sh"
$PY -c "import jax; print('jax', jax.__version__, jax.devices())"

echo "== kernels vs XLA (8192 x 8192)"
timeout 90 $PY bench/quantize_kernels.py --iters 10 --inner 10 --json "$OUT/kernels_${CARD}_$DAY.json"

echo "== optimizer step, 1.01B params"
timeout 90 $PY bench/optimizer.py --steps 10 --json "$OUT/optimizer_${CARD}_$DAY.json"

echo "== compiled kernels vs references (pytest -k compiled)"
timeout 200 $PY -m pytest -q -p no:cacheprovider -rfE --tb=short -k compiled \
  tests/test_pallas_adam_step.py tests/test_pallas_adam_update.py tests/test_pallas_quantize.py \
  tests/test_pallas_quantize_mgpu.py \
  2>&1 | tail -25 | tee "$OUT/kernel_tests_${CARD}_$DAY.txt"

echo "== tuning sweep (4096 x 11008 fp32)"
timeout 100 $PY bench/kernel_sweep.py --iters 5 --inner 10 --json "$OUT/kernel_sweep_${CARD}_$DAY.json"
