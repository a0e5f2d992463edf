#!/usr/bin/env bash
# The H200 benchmarks, one subcommand per headline figure; from the repository root, on one H200 (each fits a
# 10-minute run, the C++ node's first build included):
#
#   bash benchmarks/run_h200.sh harness   model-level harness: model_bench.py --plan h200 (all configs, targets table,
#                                         plot; ~460 s + ~20-50 s for the node)
#   bash benchmarks/run_h200.sh train     training equivalence: train_equivalence.py, seeds 0 and 1, 1000 steps, the
#                                         four runs at once on the GPU (~300 s)
#   bash benchmarks/run_h200.sh kernels   kernel microbenchmarks: kernels_bench.py, default sections (~80 s)
#   bash benchmarks/run_h200.sh compile   DoRA under torch.compile: compile_bench.py (r=384 / r=16, AMP / pure bf16,
#                                         LoRA / PEFT DoRA / fastdora compiled, reduce-overhead at r=384; ~300 s)
#   bash benchmarks/run_h200.sh suite     the whole GPU test suite: pytest tests -m gpu (~350 s)
#
# Results go to $OUT (default benchmarks/results/<name>_h200_<UTC date>/): JSON, markdown table, plot and log; the
# script prints each step's wall time (also in $OUT/times.log).
# Environment: PLAN (the harness's plan, default h200: every config; targets: the Qwen3-8B r=384 target block
#   alone, ~130 s), BENCH_S (the harness's --budget-s, default 548), TRAIN_S (training workers' time limit, default 350),
#   SUITE_S (the suite's time limit, default 560), PYTHON (default python3), FASTDORA_CACHE_DIR (where the C++ node
#   is built and cached: a cache carried from an earlier run saves the build).
# fastdora need not be installed: benchmarks/_env.sh maps this checkout's core/ to `fastdora` on PYTHONPATH.
set -uo pipefail
cmd=${1:-}
case "$cmd" in
  harness) name=model_bench ;;
  train) name=train_equivalence ;;
  kernels) name=kernels ;;
  compile) name=compile_bench ;;
  suite) name=gpu_tests ;;
  *) echo "usage: bash benchmarks/run_h200.sh harness|train|kernels|compile|suite" >&2; exit 2 ;;
esac
[ -n "${OUT:-}" ] && OUT=$(realpath -m "$OUT")
cd "$(dirname "$0")/.."
source benchmarks/_env.sh
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/benchmarks/results/${name}_h200_$(date -u +%F)}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/fastdora_bench.XXXX)
t0=$(date +%s)

step() {  # step NAME: the wall time since the start
  echo "$1 $(( $(date +%s) - t0 )) s" | tee -a "$OUT/times.log"
}

nvidia-smi --query-gpu=name,memory.total,power.limit,driver_version --format=csv,noheader 2>/dev/null || true
$PY -c "import torch, transformers, peft, triton, fastdora; print('torch', torch.__version__, '| transformers',
transformers.__version__, '| peft', peft.__version__, '| triton', triton.__version__, '| fastdora', fastdora.__file__)"
# the C++ composition node, built (or loaded from FASTDORA_CACHE_DIR) before anything is measured
$PY -c "from fastdora import dispatch; from fastdora.kernels import native; dispatch.native_node(required=True)
print('C++ node:', native.status(), '| kernel launch:', native.launch_status())" 2>&1 | grep -v Warn | tail -2
step node

case "$cmd" in
  harness)
    budget=${BENCH_S:-548}
    timeout $(( budget + 65 )) $PY benchmarks/model_bench.py --out "$WORK/mb" --plan "${PLAN:-h200}" --budget-s "$budget" \
      > "$OUT/model_bench.log" 2>&1
    for f in json md png; do cp "$WORK/mb/model_bench.$f" "$OUT/" 2>/dev/null; done
    grep "^\[\|MISS\|TARGETS\|WARNING" "$OUT/model_bench.log" | tail -60
    step harness
    ;;
  train)
    limit=${TRAIN_S:-350}
    timeout $(( limit + 70 )) $PY benchmarks/train_equivalence.py --out "$WORK/te" --seeds 0 1 --steps 1000 \
      --parallel 4 --max-train-s "$limit" --timeout-s $(( limit + 50 )) > "$OUT/train_equivalence.log" 2>&1
    for f in json md png; do cp "$WORK/te/train_equivalence.$f" "$OUT/" 2>/dev/null; done
    grep -v -i "warn" "$OUT/train_equivalence.log" | tail -20
    step train
    ;;
  kernels)
    $PY benchmarks/kernels_bench.py --out "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
    grep -v -i "warn" "$OUT/kernels.log" | tail -80
    step kernels
    ;;
  compile)
    timeout ${COMPILE_S:-420} $PY benchmarks/compile_bench.py --out "$WORK/cb" --budget-s $(( ${COMPILE_S:-420} - 120 )) \
      > "$OUT/compile_bench.log" 2>&1
    for f in json md; do cp "$WORK/cb/compile_bench.$f" "$OUT/" 2>/dev/null; done
    tail -n 30 "$WORK"/cb/cfg*.log > "$OUT/compile_bench_workers.log" 2>/dev/null
    grep "^\[\|MISS\|PASS" "$OUT/compile_bench.log" | tail -60
    step compile
    ;;
  suite)
    timeout "${SUITE_S:-560}" $PY -m pytest tests -m gpu -q -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
    tail -8 "$OUT/gpu_tests.log"
    step suite
    ;;
esac
rm -rf "$WORK"
