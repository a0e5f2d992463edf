#!/usr/bin/env bash
# One short device call (nvidia-h200): GPU correctness tests of the integration and the norm kernel, then the
# model-level r=384 targets (Qwen3-8B shapes, 8 layers; LoRA / fastdora / PEFT DoRA, AMP and pure bf16).
#   bash benchmarks/run_final.sh [BENCH_BUDGET_S=150]
set -u
OUT=${OUT:-$PWD/benchmarks/results/final}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
mkdir -p /tmp/fd && ln -sfn "$PWD/core" /tmp/fd/fastdora && export PYTHONPATH=/tmp/fd
timeout 100 python3 -m pytest -q -m gpu tests/test_gpu_layers.py "tests/test_kernels_gpu.py" -k "norm or model or training" \
  -p no:cacheprovider -x 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
python3 benchmarks/model_bench.py --out "$OUT/mb" --plan final --budget-s "${1:-150}" > "$OUT/mb.log" 2>&1
cp "$OUT/mb/model_bench.json" "$OUT/mb/model_bench.md" "$OUT/" 2>/dev/null
grep -v "^$" "$OUT/mb.log" | tail -40
