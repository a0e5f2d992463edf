#!/usr/bin/env bash
# One device call (nvidia-h200, run from the repo root): model-level benchmark, then training equivalence.
# Writes at most 8 files to $OUT (the device tool's limit) and prints the final tables last.
#
#   bash benchmarks/run_h200.sh [BENCH_BUDGET_S=270] [PARTS=bench,equiv] [PLAN=h200]
#
# BENCH_BUDGET_S: model_bench stops launching configurations after this many seconds (priority order:
#   Qwen3-8B r=384 (targets; AMP ones profiled), Qwen3-8B r=16, Mistral-Small-24B r=384/16, other ranks, full depth).
# Training equivalence (2 seeds x 2 variants): after the bench it gets ~3.5 min (4 processes in parallel; on the
# H200 that reached only 450-500 of the 1000 steps: 4 processes sharing one GPU ran ~0.3 s/step each). For the full
# 1000 steps give it a call of its own: `bash benchmarks/run_h200.sh 0 equiv` (2 at a time, up to ~9.5 min).
set -u
BUDGET=${1:-270}
PARTS=${2:-bench,equiv}
PLAN=${3:-h200}
OUT=${OUT:-$PWD/benchmarks/results/h200_run}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/fastdora_bench.XXXX)
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# TINY=1: CPU smoke test of this runner (tiny shapes, --device cpu)
if [ "${TINY:-0}" = 1 ]; then SMOKE="--tiny --device cpu"; else SMOKE=""; fi
exec > >(tee -a "$OUT/log.txt") 2>&1
T0=$(date +%s)
echo "== $(date -u) host $(hostname); budget ${BUDGET}s; parts ${PARTS}; plan ${PLAN}"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv 2>/dev/null || true

# make `import fastdora` work (core/ -> fastdora): editable install, else a symlink on PYTHONPATH
if ! $PY -c "import fastdora" 2>/dev/null; then
  $PY -m pip install -q -e . --no-deps --no-build-isolation >/dev/null 2>&1 || true
fi
if ! $PY -c "import fastdora" 2>/dev/null; then
  mkdir -p "$WORK/path" && ln -sfn "$PWD/core" "$WORK/path/fastdora"
  export PYTHONPATH="$WORK/path${PYTHONPATH:+:$PYTHONPATH}"
fi
$PY - <<'EOF'
import torch, transformers, peft, fastdora
print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__,
      "fastdora", fastdora.__file__)
try:
    import triton; print("triton", triton.__version__)
except Exception as e: print("triton: not importable", e)
from fastdora.kernels import compose, norm
print("kernels: compose.AVAILABLE", compose.AVAILABLE, "norm.AVAILABLE", getattr(norm, "AVAILABLE", None))
EOF

if [[ $PARTS == *bench* ]]; then
  echo "== model_bench ($(($(date +%s) - T0))s)"
  $PY benchmarks/model_bench.py --out "$WORK/mb" --budget-s "$BUDGET" --plan "$PLAN" $SMOKE > "$WORK/mb.log" 2>&1
  grep -v "^|" "$WORK/mb.log" | grep -v "^$" | head -80
  for f in model_bench.json model_bench.md model_bench.png model_bench_profile.txt; do
    [ -f "$WORK/mb/$f" ] && cp "$WORK/mb/$f" "$OUT/"
  done
fi
if [[ $PARTS == *equiv* ]]; then
  echo "== train_equivalence ($(($(date +%s) - T0))s)"
  if [[ $PARTS == *bench* ]]; then TE="--parallel 4 --timeout-s 200 --max-train-s 140"   # after the bench: what is left
  else TE="--parallel ${TE_PARALLEL:-2} --timeout-s 560 --max-train-s 260"; fi            # a call of its own
  $PY benchmarks/train_equivalence.py --out "$WORK/te" $TE $SMOKE > "$WORK/te.log" 2>&1
  grep "^\[" "$WORK/te.log"
  grep -B2 -A30 "Traceback" "$WORK/te/te_workers/"*.log 2>/dev/null | head -60
  for f in train_equivalence.json train_equivalence.md train_equivalence.png; do
    [ -f "$WORK/te/$f" ] && cp "$WORK/te/$f" "$OUT/"
  done
fi
echo "== done in $(($(date +%s) - T0))s"
[ -f "$OUT/model_bench_profile.txt" ] && grep "^====" "$OUT/model_bench_profile.txt"
[ -f "$OUT/model_bench.md" ] && { echo; echo "#### MODEL BENCH"; cat "$OUT/model_bench.md"; }
[ -f "$OUT/train_equivalence.md" ] && { echo; echo "#### TRAIN EQUIVALENCE"; cat "$OUT/train_equivalence.md"; }
