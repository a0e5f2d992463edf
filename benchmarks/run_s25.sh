#!/usr/bin/env bash
# Device script (session 25, nvidia-h200), from the repository root; no carry needed (the image's PEFT).
#
#   bash benchmarks/run_s25.sh gap       the C++ node built; its GPU tests (tests/test_native_node.py -m gpu: the
#                                        template re-registration fix c51ef37 on a GPU); then gap_probe.py: LoRA and
#                                        fastdora in one process, interleaved, Qwen3-8B shapes, 8 layers, r=384: where
#                                        the GPU is idle in a whole iteration (by phase, gap size, cause, op), pure bf16
#                                        (GAP_ROUNDS, default 3) then AMP (2 rounds)
#   bash benchmarks/run_s25.sh spy       (carry .whl: py-spy's wheel) gap_probe.py pure bf16, 2 rounds, CUDA-only traces,
#                                        then each variant's iterations sampled by py-spy (native + Python stacks of
#                                        every thread: where the host's time goes; SPY_S seconds each, default 12),
#                                        then the whole GPU test suite in the time left (until END_S, default 560)
#   bash benchmarks/run_s25.sh host      gap_probe.py pure bf16, 3 rounds, CUDA-only and CPU-op traces (the host's time by
#                                        thread, phase and op: host_top_level_ms / host_self_ms); then model_bench
#                                        --plan bf16 --sequence lora,fastdora,lora,fastdora,fastdora,lora in exec workers
#                                        (SEQ_S seconds, default 200; GPU sampled per row); then the AMP gap probe in the
#                                        time left (until END_S, default 540)
#   bash benchmarks/run_s25.sh nodes     gap_probe.py with CPU-op traces only (2 rounds), pure bf16 then AMP: the host's
#                                        self time of the composition node's backwards apart from the one per layer
#                                        that runs the checkpoint recomputation (host_self_small_ms)
#   bash benchmarks/run_s25.sh suite     the whole GPU test suite (pytest tests -m gpu; TESTS_S, default 420)
#   bash benchmarks/run_s25.sh harness   issue 5's whole harness: model_bench.py --plan h200 (BENCH_S, default 520)
set -uo pipefail
source benchmarks/_env.sh
export FASTDORA_CACHE_DIR=${FASTDORA_CACHE_DIR:-/tmp/fdcache}
t0=$(date +%s)
source benchmarks/_bench.sh  # bench PLAN BUDGET_S [model_bench arguments]; node; smi_start; gpu_tests
case "${1:-gap}" in
  gap)
    node
    gpu_tests gpu_tests_native.log ${TESTS_S:-150} tests/test_native_node.py
    smi_start
    timeout ${GAP_S:-260} python benchmarks/gap_probe.py --setup bf16 --rounds ${GAP_ROUNDS:-3} \
      --out $OUT/gap_bf16.json > $OUT/gap_bf16.log 2>&1
    grep -v "^{" $OUT/gap_bf16.log | grep -v "Warn\|USDT\|profiler_st" | tail -30
    echo "gap bf16 $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    timeout $(( ${END_S:-540} - ($(date +%s) - t0) )) python benchmarks/gap_probe.py --setup amp --rounds 2 \
      --out $OUT/gap_amp.json > $OUT/gap_amp.log 2>&1
    grep -v "^{" $OUT/gap_amp.log | grep -v "Warn\|USDT\|profiler_st" | tail -30
    kill $smi
    ;;
  spy)
    python -m pip install -q --no-index --no-deps --target /tmp/spy .whl/py_spy-*.whl && export PATH=/tmp/spy/bin:$PATH
    node
    timeout ${GAP_S:-200} python benchmarks/gap_probe.py --setup ${SETUP:-bf16} --rounds 2 --modes cuda \
      --pyspy $OUT --pyspy-native --pyspy-s ${SPY_S:-12} --out $OUT/gap_spy_${SETUP:-bf16}.json > $OUT/gap_spy.log 2>&1
    grep -v "^{" $OUT/gap_spy.log | grep -v "Warn\|USDT\|profiler_st\|_warn_once" | tail -30
    echo "spy $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    gpu_tests gpu_tests.log $(( ${END_S:-560} - ($(date +%s) - t0) )) tests
    ;;
  host)
    node
    timeout ${GAP_S:-150} python benchmarks/gap_probe.py --setup bf16 --rounds 3 --out $OUT/gap_host_bf16.json \
      > $OUT/gap_host_bf16.log 2>&1
    grep -v "^{" $OUT/gap_host_bf16.log | grep -v "Warn\|USDT\|profiler_st\|_warn_once" | tail -30
    echo "gap bf16 $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    TAG=seq_bf16 FILES="json md" bench bf16 ${SEQ_S:-200} --spawn exec --sequence lora,fastdora,lora,fastdora,fastdora,lora
    timeout $(( ${END_S:-540} - ($(date +%s) - t0) )) python benchmarks/gap_probe.py --setup amp --rounds 2 \
      --out $OUT/gap_host_amp.json > $OUT/gap_host_amp.log 2>&1
    grep -v "^{" $OUT/gap_host_amp.log | grep -v "Warn\|USDT\|profiler_st\|_warn_once" | tail -30
    ;;
  nodes)
    node
    for st in bf16 amp; do
      timeout $(( ${END_S:-300} - ($(date +%s) - t0) )) python benchmarks/gap_probe.py --setup $st --rounds 2 \
        --modes ops --out $OUT/gap_nodes_$st.json > $OUT/gap_nodes_$st.log 2>&1
      grep "^==\|host in" $OUT/gap_nodes_$st.log
      echo "gap $st $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    done
    ;;
  suite)
    node
    gpu_tests gpu_tests.log ${TESTS_S:-420} tests
    ;;
  harness)
    node
    bench h200 ${BENCH_S:-520} --spawn ${SPAWN:-fork}
    ;;
esac
echo "total $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
