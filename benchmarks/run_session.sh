#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (2 GPUs, < 10 min):
#   1. GPU 1: the GPU test suite;  GPU 0 meanwhile: the HF Trainer example in bf16 (nothing timing-sensitive runs
#      next to them: fastdora's training step is close to host-bound, so CPU-heavy neighbours such as the tests'
#      Triton compilations distort its timings)
#   2. alone on GPU 0: the host-time probe (LoRA vs fastdora vs, if OLD_PKG is given, another fastdora package such
#      as an earlier commit's core/), incl. a torch.profiler kernel-time breakdown of one iteration per variant
#   3. the model-level benchmark, one parent per GPU (model_bench.py plans gpu0 / gpu1: every ratio compares
#      variants run one after another on the same GPU)
#   4. only with MULTIGPU=1: the multi-GPU runs on both GPUs (benchmarks/multigpu/run_h200x2.sh)
#   bash benchmarks/run_session.sh [BENCH_BUDGET_S=180] [OLD_PKG]
#   NORM_BENCH=1: phase 1 runs the norm kernel table (kernels_bench.py --sections norm) instead of the HF example;
#   HOST_SEQ512=1: phase 2 adds the host probe at seq 512 (host-bound: per-micro-batch host cost, LoRA vs fastdora)
# Needs carried wheels (device tool `carry`): .carry/whl (datasets, dill, multiprocess for the HF example) and, for
# MULTIGPU=1, .whl (deepspeed + deps, see benchmarks/multigpu/README.md); OLD_PKG: a folder holding a `fastdora`
# package. Writes to $OUT: session.log (all logs), host_probe.json, model_bench.{json,md,png}, multigpu_h200x2.json.
set -u
OUT=${OUT:-$PWD/benchmarks/results/session}
mkdir -p "$OUT"
LOG="$OUT/session.log"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# `import fastdora` (core/) and `fastdora.plugins` (plugins/) without installing
mkdir -p /tmp/fdp/fastdora && for f in "$PWD"/core/*; do ln -sfn "$f" /tmp/fdp/fastdora/; done
ln -sfn "$PWD/plugins" /tmp/fdp/fastdora/plugins
export PYTHONPATH=/tmp/fdp
[ -d .carry/whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_ex .carry/whl/*.whl \
  > /dev/null 2>&1
BUDGET=${1:-180}
OLD=${2:-}
variants=lora,fastdora
[ -n "$OLD" ] && variants=lora,fastdora,fastdora_old
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=1 timeout 150 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py tests/test_gpu_layers.py \
  -p no:cacheprovider > /tmp/gpu_tests.log 2>&1 &
if [ "${NORM_BENCH:-0}" = 1 ]; then  # instead of the example: the norm kernel table (time, working set, error)
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/kernels_bench.py --sections norm --out "$OUT/kernels_norm.json" \
    > /tmp/hf_example.log 2>&1
else
( CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/fdp:/tmp/site_ex timeout 120 python3 examples/hf_trainer/train.py --bf16 \
    --steps 50 --hidden 512 --layers 4 --rank 16 --batch 8 --seq-len 256 --out /tmp/exh > /tmp/hf_example.log 2>&1
  echo "rc=$?" >> /tmp/hf_example.log ) &
fi
wait
{ echo "== GPU tests"; tail -15 /tmp/gpu_tests.log; echo "== HF Trainer example (bf16, H200)"; grep -v "it/s\]" /tmp/hf_example.log | tail -25
} > "$LOG"
echo "phase 1 done at +$(( $(date +%s) - t0 ))s" >> "$LOG"
CUDA_VISIBLE_DEVICES=0 timeout 170 python3 benchmarks/host_probe.py --out /tmp/hp --variants $variants --repeats 3 \
  ${OLD:+--old-pkg "$OLD"} > /tmp/host_probe.log 2>&1
cp /tmp/hp/host_probe.json "$OUT/" 2>/dev/null
{ echo "== host probe"; cat /tmp/host_probe.log; } >> "$LOG"
if [ "${HOST_SEQ512:-0}" = 1 ]; then  # host-bound regime (GPU work ~1/6 of the host's): host cost per micro-batch
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/host_probe.py --out /tmp/hps --variants lora,fastdora \
    --seq 512 --loss-tokens 256 --repeats 3 > /tmp/host_probe512.log 2>&1
  cp /tmp/hps/host_probe.json "$OUT/host_probe_seq512.json" 2>/dev/null
  { echo "== host probe, seq 512"; cat /tmp/host_probe512.log; } >> "$LOG"
  grep -E "^####|one iteration on the GPU|host under" /tmp/host_probe512.log | cut -c1-400
fi
echo "phase 2 done at +$(( $(date +%s) - t0 ))s" >> "$LOG"
(CUDA_VISIBLE_DEVICES=1 python3 benchmarks/model_bench.py --out /tmp/mb1 --plan gpu1 --budget-s "$BUDGET" --repeats 5 \
  > /tmp/mb1.log 2>&1) &
CUDA_VISIBLE_DEVICES=0 python3 benchmarks/model_bench.py --out /tmp/mb0 --plan gpu0 --budget-s "$BUDGET" --repeats 5 \
  > /tmp/mb0.log 2>&1
wait
{ echo "== model bench (GPU 0)"; cat /tmp/mb0.log; echo "== model bench (GPU 1)"; cat /tmp/mb1.log; } >> "$LOG"
python3 benchmarks/model_bench.py --report /tmp/mb0/model_bench.json,/tmp/mb1/model_bench.json --report-out "$OUT" \
  > /dev/null 2>&1
echo "phase 3 done at +$(( $(date +%s) - t0 ))s" >> "$LOG"
[ "${MULTIGPU:-0}" = 1 ] && OUT=/tmp/mg timeout "${MG_TIMEOUT:-200}" bash benchmarks/multigpu/run_h200x2.sh > /tmp/mg_stdout.log 2>&1
cp /tmp/mg/multigpu_h200x2.json "$OUT/" 2>/dev/null
[ "${MULTIGPU:-0}" = 1 ] && { echo "== multi-GPU"; grep -v -i "warn" /tmp/mg_stdout.log | tail -80; } >> "$LOG"
[ "${MULTIGPU:-0}" = 1 ] && echo "phase 4 done at +$(( $(date +%s) - t0 ))s" >> "$LOG"
grep -E "passed|failed|error" /tmp/gpu_tests.log | tail -2
grep -E "stock PEFT :|fastdora   :|loss curves|outputs    |rc=" /tmp/hf_example.log
grep -E "^####|one iteration on the GPU|host under" /tmp/host_probe.log | cut -c1-400
grep -E "done|FAIL|SKIP" /tmp/mb0.log /tmp/mb1.log | cut -c1-170
grep -B2 -A26 "### Targets" "$OUT/model_bench.md" | grep -E "^\|" | head -24
grep -E "phase" "$LOG"
