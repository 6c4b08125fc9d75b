# Sourced by the bench/*_gpu.sh scripts: strict-ish shell, $OUT (default bench/results), $DAY,
# $PY (default python3: the GPU machine has no `python`), the checkout on PYTHONPATH, the GPU.
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
DAY=$(date +%F)
PY=${PYTHON:-python3}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
