#!/usr/bin/env bash
# The GPU part of the benchmarks, alone, for a machine lent for minutes (one H200 here):
# counts and interleaved timings on the 10M model (float32) and a 1.3B model (bf16).
# Uses the machine's own torch; lossbeat from this checkout. Results land in $OUT
# (or ./gpu-results): merge them here with
#   python benchmarks/run.py --merge-gpu <dir>/results-gpu.json --update-committed
# About 5 minutes on an H200; GPU_MODELS overrides the plan (MODEL:ROUNDS,...).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONPATH="$PWD/exporter:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c 'import prometheus_client, yaml, numpy, torch; assert torch.cuda.is_available(), "no CUDA device"'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 benchmarks/run.py --gpu-only --threads 4 ${GPU_MODELS:+--gpu-models "$GPU_MODELS"} \
    --json "$out/results-gpu.json" --out "$out/RESULTS-gpu.md" 2>&1 | tee "$out/log.txt"
# The checks that need CUDA (torchtitan's MetricsProcessor), if torchtitan is installed there.
if python3 -c 'import torchtitan' 2>/dev/null; then
    python3 -m pytest -q -p no:cacheprovider benchmarks/gpu_checks.py 2>&1 | tee "$out/gpu-checks.txt"
fi
