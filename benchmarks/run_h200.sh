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
#   bash benchmarks/run_h200.sh poetx-layer  one POET-X layer fwd+bwd at Llama-8B shapes: poetx_bench.py (fastdora fast /
#                                         mem, kernels and PyTorch path, plain PyTorch POET-X, nn.Linear; < 1 min)
#   bash benchmarks/run_h200.sh poetx-model  POET-X at model level: poetx_model_bench.py --plan h200 (Llama-8B shapes,
#                                         AdamW / LoRA r=160 / POET-X fast, mem, int8 at b=256 and 512, full depth and 8
#                                         layers; peak memory and tokens/s, the paper's targets; ~4-6 min)
#   bash benchmarks/run_h200.sh poetx-train  POET-X convergence: poetx_convergence.py (46M Llama from scratch, 2000
#                                         steps, AdamW / fastdora POET-X / plain POET-X at once on the GPU; ~6 min)
#
# Results go to $OUT (default benchmarks/results/<name>_h200_<UTC date>/): JSON, markdown table, plot and log; the
# script prints each step's wall time (also in $OUT/times.log).
# Environment: PLAN (the harness's and poetx-model's plan, default h200: every config; targets: the target block
#   alone), BENCH_S (the harness's --budget-s, default 548; poetx-model's, default 460), TRAIN_S (training workers'
#   time limit, default 350; poetx-train's, default 440), STEPS (poetx-train's steps, default 2000),
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
  poetx-layer) name=poetx_layer ;;
  poetx-model) name=poetx_model_bench ;;
  poetx-train) name=poetx_convergence ;;
  *) echo "usage: bash benchmarks/run_h200.sh harness|train|kernels|compile|suite|poetx-layer|poetx-model|poetx-train" >&2
     exit 2 ;;
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
# the C++ composition node (DoRA), built (or loaded from FASTDORA_CACHE_DIR) before anything is measured; the POET-X
# subcommands build the extension in their first process (its launch programs and layer node)
case "$cmd" in
  poetx-*) ;;
  *)
    $PY -c "from fastdora import dispatch; from fastdora.kernels import native; dispatch.native_node(required=True)
print('C++ node:', native.status(), '| kernel launch:', native.launch_status())" 2>&1 | grep -v Warn | tail -2
    step node
    ;;
esac

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
  poetx-layer)
    timeout "${LAYER_S:-540}" $PY benchmarks/poetx_bench.py --out "$OUT/poetx_bench.json" > "$OUT/poetx_bench.log" 2>&1
    grep -v -i "warn" "$OUT/poetx_bench.log" | tail -70
    step poetx-layer
    ;;
  poetx-model)
    budget=${BENCH_S:-460}
    timeout $(( budget + 60 )) $PY benchmarks/poetx_model_bench.py --out "$WORK/pxm" --plan "${PLAN:-h200}" \
      --budget-s "$budget" > "$OUT/poetx_model_bench.log" 2>&1
    # stopped from outside: the JSON holds every config that finished; draw the plot from it
    [ -f "$WORK/pxm/poetx_model_bench.png" ] || $PY benchmarks/poetx_model_bench.py \
      --report "$WORK/pxm/poetx_model_bench.json" > /dev/null 2>&1
    for f in json md png; do cp "$WORK/pxm/poetx_model_bench.$f" "$OUT/" 2>/dev/null; done
    tail -n 25 "$WORK"/pxm/workers/cfg*.log > "$OUT/poetx_model_bench_workers.log" 2>/dev/null
    grep "^\[\|MISS\|TARGETS\|WARNING" "$OUT/poetx_model_bench.log" | tail -50
    step poetx-model
    ;;
  poetx-train)
    limit=${TRAIN_S:-440}
    timeout $(( limit + 90 )) $PY benchmarks/poetx_convergence.py --out "$WORK/pxc" --steps "${STEPS:-2000}" \
      --max-train-s "$limit" --timeout-s $(( limit + 60 )) > "$OUT/poetx_convergence.log" 2>&1
    [ -f "$WORK/pxc/poetx_convergence.png" ] || $PY benchmarks/poetx_convergence.py \
      --report "$WORK/pxc/poetx_convergence.json" > /dev/null 2>&1
    for f in json md png; do cp "$WORK/pxc/poetx_convergence.$f" "$OUT/" 2>/dev/null; done
    tail -n 25 "$WORK"/pxc/workers/*.log > "$OUT/poetx_convergence_workers.log" 2>/dev/null
    grep -v -i "warn" "$OUT/poetx_convergence.log" | tail -40
    step poetx-train
    ;;
esac
rm -rf "$WORK"
