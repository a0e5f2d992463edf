#!/usr/bin/env bash
# Device script (session 27, nvidia-h200), from the repository root: the whole-layer C++ node (layer_node, default
# on) against the separate nodes (variant fastdora_sep: layer_node=False) and PEFT LoRA.
#
#   bash benchmarks/run_s27.sh ab      the C++ node built; its GPU tests and the GPU layer tests (bitwise: the
#                                      whole-layer node vs the Python node on a checkpointed Llama, AMP and pure bf16);
#                                      gpu_host_probe.py (host us per layer call: LoRA, fastdora, fastdora_sep, ...;
#                                      PROBE_S, default 100; 0: skipped); then model_bench --plan bf16 in exec workers, Qwen3-8B
#                                      shapes, 8 layers, r=384: --sequence SEQ (LoRA, fastdora, fastdora_sep
#                                      interleaved; SEQ_S seconds, default 200), then the AMP plan's sequence in the
#                                      time left (until END_S, default 560)
#   bash benchmarks/run_s27.sh suite   the whole GPU test suite (TESTS_S, default 360), then model_bench pure bf16
#                                      again (LoRA, fastdora) in the time left
#   bash benchmarks/run_s27.sh harness issue 5's whole harness: model_bench.py --plan h200 (BENCH_S, default 500)
set -uo pipefail
source benchmarks/_env.sh
export FASTDORA_CACHE_DIR=${FASTDORA_CACHE_DIR:-/tmp/fdcache}
SEQ=${SEQ:-lora,fastdora,fastdora_sep,lora,fastdora_sep,fastdora,fastdora,lora,fastdora_sep}
t0=$(date +%s)
source benchmarks/_bench.sh  # bench PLAN BUDGET_S [model_bench arguments]; node; smi_start; gpu_tests
case "${1:-ab}" in
  ab)
    node
    gpu_tests gpu_tests_node.log ${TESTS_S:-200} tests/test_native_node.py tests/test_gpu_layers.py
    if [ "${PROBE_S:-100}" -gt 0 ]; then
      timeout ${PROBE_S:-100} python benchmarks/gpu_host_probe.py --rounds 7 --out $OUT/gpu_host.json \
        > $OUT/gpu_host.log 2>&1
      grep -v "Warn\|warn" $OUT/gpu_host.log | cut -c1-600
      echo "host probe $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    fi
    TAG=seq_bf16 FILES="json md" bench bf16 ${SEQ_S:-200} --spawn exec --sequence $SEQ
    left=$(( ${END_S:-560} - ($(date +%s) - t0) - 65 ))
    [ $left -gt 100 ] && TAG=seq_amp FILES="json md" bench amp $left --spawn exec \
      --sequence lora,fastdora,fastdora_sep,fastdora_sep,fastdora,lora
    ;;
  suite)
    node
    gpu_tests gpu_tests.log ${TESTS_S:-360} tests
    left=$(( ${END_S:-560} - ($(date +%s) - t0) - 65 ))
    [ $left -gt 100 ] && TAG=seq_bf16b FILES="json md" bench bf16 $left --spawn exec \
      --sequence lora,fastdora,fastdora,lora,lora,fastdora
    ;;
  harness)
    node
    bench h200 ${BENCH_S:-500} --spawn ${SPAWN:-exec}
    ;;
esac
echo "total $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
