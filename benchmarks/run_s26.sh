#!/usr/bin/env bash
# Device script (session 26, nvidia-h200), from the repository root. The A/B modes compare this checkout (the C++
# node's direct launches) with session 25's package (the same node launching through Triton's Python launcher),
# prepared here before the call and carried:
#   mkdir -p .carry/prevpkg /tmp/s26old && git archive 83433e2 core | tar -x -C /tmp/s26old \
#     && mv /tmp/s26old/core .carry/prevpkg/fastdora
# Run with carry [".carry/prevpkg"].
#
#   bash benchmarks/run_s26.sh ab      the C++ node built (both packages); its GPU tests and the GPU layer tests
#                                      (bitwise vs the Python node; direct launches counted; a CUDA graph captured over
#                                      the node); then model_bench --plan bf16 in exec workers, Qwen3-8B shapes, 8
#                                      layers, r=384: --sequence SEQ_BF16 (LoRA, fastdora, fastdora_old interleaved;
#                                      SEQ_S seconds, default 220), then the AMP plan's sequence in the time left (until
#                                      END_S, default 560)
#   bash benchmarks/run_s26.sh suite   gpu_host_probe.py (host us per DoRA layer call on the GPU at tiny shapes: LoRA,
#                                      fastdora with direct launches / Triton's launcher / the Python node, fastdora_old;
#                                      train, checkpointed, forward; cProfile of the forward), then the whole GPU test
#                                      suite (TESTS_S, default 380), then gap_probe.py pure bf16 (LoRA and fastdora in
#                                      one process: wall, GPU kernel time, idle) until END_S
#   bash benchmarks/run_s26.sh probe   gpu_host_probe.py again (the checkpointed mode as one checkpoint over the stack, a
#                                      variant saving inner under checkpointing, cProfile of the forward and the
#                                      checkpointed mode: Python 3.12's cProfile sees the autograd thread)
#   bash benchmarks/run_s26.sh final   after the placeholder moved into C++: the C++ node's and the layer GPU tests,
#                                      then gpu_host_probe.py (no cProfile)
#   bash benchmarks/run_s26.sh harness issue 5's whole harness: model_bench.py --plan h200 (BENCH_S, default 520)
set -uo pipefail
source benchmarks/_env.sh
export FASTDORA_CACHE_DIR=${FASTDORA_CACHE_DIR:-/tmp/fdcache}
OLD_PKG=${OLD_PKG:-.carry/prevpkg}
SEQ=${SEQ:-lora,fastdora,fastdora_old,lora,fastdora_old,fastdora,fastdora,lora,fastdora_old}
t0=$(date +%s)
source benchmarks/_bench.sh  # bench PLAN BUDGET_S [model_bench arguments]; node; smi_start; gpu_tests
gap() {  # gap SETUP ROUNDS
  timeout $(( ${END_S:-560} - ($(date +%s) - t0) )) python benchmarks/gap_probe.py --setup $1 --rounds $2 \
    --modes cuda --out $OUT/gap_$1.json > $OUT/gap_$1.log 2>&1
  grep "^==\|\[cuda\]" $OUT/gap_$1.log
  echo "gap $1 $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
}
case "${1:-ab}" in
  ab)
    node
    (cd $OLD_PKG && FASTDORA_CACHE_DIR=$FASTDORA_CACHE_DIR PYTHONPATH=$PWD python -c \
      "from fastdora.kernels import native; native.node(required=True); print('old node', native.status())")
    gpu_tests gpu_tests_node.log ${TESTS_S:-200} tests/test_native_node.py tests/test_gpu_layers.py
    TAG=seq_bf16 FILES="json md" bench bf16 ${SEQ_S:-220} --spawn exec --sequence $SEQ --old-pkg $OLD_PKG
    left=$(( ${END_S:-560} - ($(date +%s) - t0) - 65 ))
    [ $left -gt 100 ] && TAG=seq_amp FILES="json md" bench amp $left --spawn exec \
      --sequence lora,fastdora,fastdora_old,fastdora_old,fastdora,lora --old-pkg $OLD_PKG
    ;;
  suite)
    node
    timeout 150 python benchmarks/gpu_host_probe.py --old-pkg $OLD_PKG --cprofile 100 --out $OUT/gpu_host.json \
      > $OUT/gpu_host.log 2>&1
    grep -v "Warn\|warn" $OUT/gpu_host.log | cut -c1-900
    echo "host probe $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    gpu_tests gpu_tests.log ${TESTS_S:-380} tests
    gap bf16 2
    ;;
  probe)
    node
    timeout 300 python benchmarks/gpu_host_probe.py --old-pkg $OLD_PKG --rounds 9 --cprofile 50 \
      --out $OUT/gpu_host2.json > $OUT/gpu_host2.log 2>&1
    grep -v "Warn\|warn" $OUT/gpu_host2.log | grep -v cProfile
    ;;
  final)
    node
    gpu_tests gpu_tests_final.log ${TESTS_S:-120} tests/test_native_node.py tests/test_gpu_layers.py
    timeout ${PROBE_S:-110} python benchmarks/gpu_host_probe.py --old-pkg $OLD_PKG --rounds 9 \
      --out $OUT/gpu_host3.json > $OUT/gpu_host3.log 2>&1
    grep -v "Warn\|warn" $OUT/gpu_host3.log
    ;;
  harness)
    node
    bench h200 ${BENCH_S:-520} --spawn ${SPAWN:-fork}
    ;;
esac
echo "total $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
