#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (2 GPUs): GPU test suite (GPU 1) while the host-time probe runs (GPU 0: LoRA vs
# fastdora vs, if given, another fastdora package such as the previous commit's); then the model-level benchmark
# with one parent per GPU (plans gpu0 / gpu1 of model_bench.py; every ratio compares variants run on the same GPU).
#   bash benchmarks/run_session.sh [BENCH_BUDGET_S=260] [OLD_PKG]
# OLD_PKG: a folder holding a `fastdora` package (e.g. `git archive HEAD core`, renamed), for a before/after probe.
set -u
OUT=${OUT:-$PWD/benchmarks/results/session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
mkdir -p /tmp/fd && ln -sfn "$PWD/core" /tmp/fd/fastdora && export PYTHONPATH=/tmp/fd
BUDGET=${1:-260}
OLD=${2:-}
variants=lora,fastdora
[ -n "$OLD" ] && variants=lora,fastdora,fastdora_old
(CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py tests/test_gpu_layers.py \
   -p no:cacheprovider 2>&1 | tail -30 > "$OUT/gpu_tests.log") &
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/host_probe.py --out /tmp/hp --variants $variants --repeats 3 \
   ${OLD:+--old-pkg "$OLD"} > "$OUT/host_probe.log" 2>&1
cp /tmp/hp/host_probe.json "$OUT/" 2>/dev/null
wait
(CUDA_VISIBLE_DEVICES=1 python3 benchmarks/model_bench.py --out /tmp/mb1 --plan gpu1 --budget-s "$BUDGET" --repeats 5 \
   > /tmp/mb1.log 2>&1) &
CUDA_VISIBLE_DEVICES=0 python3 benchmarks/model_bench.py --out /tmp/mb0 --plan gpu0 --budget-s "$BUDGET" --repeats 5 \
   > /tmp/mb0.log 2>&1
wait
cat /tmp/mb0.log /tmp/mb1.log > "$OUT/mb.log"
python3 benchmarks/model_bench.py --report /tmp/mb0/model_bench.json,/tmp/mb1/model_bench.json --report-out "$OUT" \
   > /dev/null 2>&1
grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3
grep -E "^####|iter wall" "$OUT/host_probe.log" | cut -c1-220
grep -E "done|FAIL|SKIP" "$OUT/mb.log" | cut -c1-160
grep -A30 "### Targets" "$OUT/model_bench.md"
