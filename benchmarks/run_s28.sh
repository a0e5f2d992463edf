#!/usr/bin/env bash
# Device script (session 28, nvidia-h200), from the repository root: option dm_from_output (default on: the
# whole-layer node saves its output y, not inner, for the magnitude's gradient) against variant fastdora_inner
# (dm_from_output=False) and PEFT LoRA.
#
#   bash benchmarks/run_s28.sh ab      the C++ node built; its GPU tests and the GPU layer tests; then model_bench in
#                                      exec workers, pure bf16, r=384: Mistral-Small-24B shapes (3 layers; the peak
#                                      memory target) --sequence MSEQ (M_S seconds, default 150), then Qwen3-8B shapes
#                                      (8 layers) --sequence SEQ in the time left (until END_S, default 560)
#   bash benchmarks/run_s28.sh harness issue 5's whole harness: model_bench.py --plan h200 (BENCH_S, default 500)
#   bash benchmarks/run_s28.sh suite   the whole GPU test suite (TESTS_S, default 360), then model_bench Mistral AMP
#                                      (LoRA, fastdora, fastdora_inner) in the time left
set -uo pipefail
source benchmarks/_env.sh
export FASTDORA_CACHE_DIR=${FASTDORA_CACHE_DIR:-/tmp/fdcache}
MSEQ=${MSEQ:-lora,fastdora,fastdora_inner,fastdora_inner,fastdora,lora}
SEQ=${SEQ:-lora,fastdora,fastdora_inner,fastdora_inner,fastdora,lora,lora,fastdora,fastdora_inner}
t0=$(date +%s)
source benchmarks/_bench.sh  # bench PLAN BUDGET_S [model_bench arguments]; node; smi_start; gpu_tests
case "${1:-ab}" in
  ab)
    node
    gpu_tests gpu_tests_node.log ${TESTS_S:-200} tests/test_native_node.py tests/test_gpu_layers.py
    TAG=m_bf16 FILES="json md" bench mistral_bf16 ${M_S:-150} --spawn exec --sequence $MSEQ
    left=$(( ${END_S:-560} - ($(date +%s) - t0) - 65 ))
    [ $left -gt 60 ] && TAG=seq_bf16 FILES="json md" bench bf16 $left --spawn exec --sequence $SEQ
    ;;
  harness)
    node
    bench h200 ${BENCH_S:-500} --spawn ${SPAWN:-exec}
    ;;
  suite)
    node
    gpu_tests gpu_tests.log ${TESTS_S:-360} tests
    left=$(( ${END_S:-560} - ($(date +%s) - t0) - 65 ))
    [ $left -gt 60 ] && TAG=m_amp FILES="json md" bench mistral_amp $left --spawn exec \
      --sequence lora,fastdora,fastdora_inner,fastdora_inner,fastdora,lora
    ;;
esac
echo "total $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
