#!/usr/bin/env bash
# Axolotl on one H200: `axolotl train` three ways with one config (a Llama of 4 decoder layers, hidden 2048, random
# weights, built locally; DoRA r=64 on all linear layers, bf16, sdpa, gradient checkpointing, 60 steps):
#   fastdora         plugins: [fastdora.plugins.axolotl.FastDoraPlugin]
#   axolotl_kernels  no fastdora, Axolotl's fused LoRA/DoRA kernels on (its default)
#   peft             no fastdora, the four lora_*_kernel: false (stock PEFT DoRA, the reference)
# Per run: median step time, peak allocated memory, the loss curve; for fastdora its report and which DoRA layers ran
# the Triton path; the loss-curve differences against the reference. From the repository root:
#
#   bash benchmarks/axolotl_h200.sh fetch     where an index is reachable: the wheels (axolotl_h200_wheels.txt) into
#                                             .whl-axolotl/all (git-ignored, 45 MiB)
#   bash benchmarks/axolotl_h200.sh install   install .whl-axolotl/all into $AXO_SITE (default /tmp/axo_site)
#   bash benchmarks/axolotl_h200.sh run       import check, the C++ node, model + configs, the three runs (~5 min)
#
# Results: $OUT (default benchmarks/results/axolotl_h200_<UTC date>/): axolotl_h200.json, axolotl_h200.md, the log of
# this script and each run's log (the last 3000 lines). Environment: AXO_SITE, RUN_S (each run's time limit, default
# 150), RUNS (default "fastdora axolotl_kernels peft"), TINY=1 (a CPU dry run: tiny model, 2 steps, fp32), PYTHON.
# The GPU machine has torch 2.11 (Axolotl 0.21 asks for >= 2.13 and only warns) and no index: see benchmarks/README.md
# ("Axolotl on one H200").
set -uo pipefail
cmd=${1:-}
[ -n "${OUT:-}" ] && OUT=$(realpath -m "$OUT")
cd "$(dirname "$0")/.."
SITE=${AXO_SITE:-/tmp/axo_site}
PY=${PYTHON:-python3}

case "$cmd" in
  fetch)  # where an index is reachable: the wheels of benchmarks/axolotl_h200_wheels.txt into .whl-axolotl/all
    set -e
    d=.whl-axolotl/all
    rm -rf "$d" && mkdir -p "$d"
    pkgs=$(grep -v '^#' benchmarks/axolotl_h200_wheels.txt | grep -v '^axolotl-contribs-')
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$d" $pkgs
    sdists=$(grep '^axolotl-contribs-' benchmarks/axolotl_h200_wheels.txt || true)
    [ -z "$sdists" ] || "$PY" -m pip wheel -q --no-deps -w "$d" $sdists  # sdists only; pure Python
    # bitsandbytes ships one library per CUDA / ROCm / XPU version (42 MiB); the image's torch is built for CUDA 13.0
    "$PY" benchmarks/axolotl_h200.py slim-bnb "$d" "${BNB_CUDA:-130}"
    echo "$(ls "$d" | wc -l) wheels, $(du -sm "$d" | cut -f1) MiB in $d"
    exit 0 ;;
  install)
    shopt -s nullglob
    whl=(.whl-axolotl/all/*.whl)
    [ ${#whl[@]} -gt 0 ] || { echo "no wheels in .whl-axolotl/all (bash benchmarks/axolotl_h200.sh fetch)" >&2; exit 1; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "${whl[@]}"
    rc=$?
    echo "${#whl[@]} wheels -> $SITE (rc $rc)"
    exit "$rc" ;;
  run) ;;
  *) echo "usage: bash benchmarks/axolotl_h200.sh fetch | install | run" >&2; exit 2 ;;
esac

export PYTHONPATH="$SITE:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
source benchmarks/_env.sh  # fastdora from this checkout (/tmp/fdp first on PYTHONPATH)
PATH="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')"):$PATH"  # accelerate's launcher
export PATH AXOLOTL_DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled \
  TOKENIZERS_PARALLELISM=false TRANSFORMERS_NO_ADVISORY_WARNINGS=1 DO_NOT_TRACK=1
OUT=${OUT:-$PWD/benchmarks/results/axolotl_h200_$(date -u +%F)}
WORK=${AXO_WORK:-$(mktemp -d /tmp/axolotl_bench.XXXX)}
export HF_HOME="$WORK/hf"
mkdir -p "$OUT" "$WORK"
exec > >(tee "$OUT/axolotl_h200.log") 2>&1
t0=$(date +%s)
step() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
step "imports"
"$PY" - "$WORK/versions.json" <<'EOF' || { echo "import check failed: a wheel is missing?" >&2; exit 1; }
import importlib, json, sys
mods = ["torch", "triton", "transformers", "peft", "accelerate", "datasets", "trl", "tokenizers", "pydantic",
        "axolotl", "axolotl.cli.main", "axolotl.train", "axolotl.integrations.base", "fastdora",
        "fastdora.plugins.axolotl"]
v = {}
for m in mods:
    mod = importlib.import_module(m)
    if "." not in m:
        v[m] = getattr(mod, "__version__", "?")
        print(f"{m:13s} {v[m]:16s} {mod.__file__}")
from fastdora.plugins.axolotl import FastDoraPlugin  # noqa: F401  (builds the plugin class: needs axolotl)
json.dump(v, open(sys.argv[1], "w"))
EOF
if [ "${TINY:-0}" != 1 ]; then
  step "the C++ composition node (built or loaded before anything is measured)"
  "$PY" -c "from fastdora import dispatch; from fastdora.kernels import native; dispatch.native_node(required=True)
print('C++ node:', native.status(), '| kernel launch:', native.launch_status())" 2>&1 | grep -v Warn | tail -2
fi
step "model, data, configs in $WORK"
"$PY" benchmarks/axolotl_h200.py prepare "$WORK" $([ "${TINY:-0}" = 1 ] && echo --tiny) || exit 1

echo "{" > "$WORK/status.json"
sep=""
for run in ${RUNS:-fastdora axolotl_kernels peft}; do
  step "axolotl train: $run"
  s=$(date +%s)
  timeout "${RUN_S:-150}" "$PY" -m axolotl.cli.main train "$WORK/$run.yaml" > "$WORK/$run.log" 2>&1
  rc=$?
  w=$(( $(date +%s) - s ))
  grep -E "fastdora|LoRA kernels|Auto-enabling|bench_probe|Error|error:" "$WORK/$run.log" | grep -v "^\s*$" | tail -8
  [ "$rc" = 0 ] || { echo "--- $run failed (rc $rc), the log's tail:"; tail -40 "$WORK/$run.log"; }
  tail -3000 "$WORK/$run.log" > "$OUT/$run.log"
  printf '%s "%s": {"rc": %s, "wall_s": %s}\n' "$sep" "$run" "$rc" "$w" >> "$WORK/status.json"
  sep=","
  step "$run: rc $rc in $w s"
done
echo "}" >> "$WORK/status.json"
step "results -> $OUT"
"$PY" benchmarks/axolotl_h200.py collect "$WORK" "$OUT"
step "done"
