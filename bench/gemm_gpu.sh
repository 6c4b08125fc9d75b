#!/usr/bin/env bash
# Issue 6 on one Hopper GPU, at most ~8 minutes: a smoke run of each Pallas FP8 GEMM variant,
# the TFLOP/s table (XLA bf16, cuBLASLt FP8, Pallas variants; the evidence first), then the
# gpu-marked tests.
#
#   OUT=/some/dir bash bench/gemm_gpu.sh      (OUT defaults to bench/results)
#
# Each stage has its own time limit and a failing stage does not stop the next.
source "$(dirname "$0")/gpu_env.sh"

echo "== 1. smoke: each variant once on 256^3 (default config)"
timeout 45 $PY bench/gemm_smoke.py 2>&1 | tee "$OUT/gemm_smoke_${CARD}_$DAY.txt"

echo "== 2. bench: check, autotune, TFLOP/s"
timeout 240 $PY bench/gemm.py --check --iters 10 --shapes "${GEMM_SHAPES:-all}" \
  --json "$OUT/gemm_${CARD}_$DAY.json" \
  2>&1 | tee "$OUT/gemm_bench_${CARD}_$DAY.txt"

echo "== 3. gpu tests (default config, no autotune; the new options by forced configs)"
timeout 180 $PY -m pytest -q -p no:cacheprovider -m gpu \
  --tb=short -rfE --maxfail=5 tests/test_pallas_fp8_matmul.py \
  2>&1 | tail -60 | tee "$OUT/gemm_tests_${CARD}_$DAY.txt"
