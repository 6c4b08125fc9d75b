# Sourced by the bench/*_gpu.sh scripts: strict-ish shell, $OUT (default bench/results), $DAY,
# $PY (default python3: the GPU machine has no `python`), the checkout on PYTHONPATH, the GPU.
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
DAY=$(date +%F)
PY=${PYTHON:-python3}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
# the card in result names ("NVIDIA H100 80GB HBM3" -> h100), so a call that got an H100 where
# an H200 was asked for says so in every file it writes
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 \
  | awk '{print tolower($2)}')
CARD=${CARD:-gpu}
