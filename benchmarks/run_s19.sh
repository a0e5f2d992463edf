#!/usr/bin/env bash
# Device script (session 19, nvidia-h200), from the repository root:
#   bash benchmarks/run_s19.sh first   the GPU suite (-m gpu), then LoRA, fastdora with lean_forward=False (the PEFT
#                                      forward -> variant chain) and fastdora (lean module forward, the default) in
#                                      ONE process per setup, interleaved iteration by iteration (stall_probe.py)
#   bash benchmarks/run_s19.sh ab      only the in-process A/B (ROUNDS, default 7; VARIANTS, default
#                                      lora,fastdora_chain,fastdora), after the GPU tests in $TESTS if set
#   bash benchmarks/run_s19.sh final   the GPU layer / lean / norm-graph / norm kernel tests, model_bench.py plan final
#                                      (BENCH_S, default 200), the in-process A/B (ROUNDS), plan r16 (R16_S, default 60)
#   bash benchmarks/run_s19.sh bench   model_bench.py plan final (r=384 targets, BENCH_S budget), then plan r16 (R16_S)
#   bash benchmarks/run_s19.sh host    host_probe.py (AMP): LoRA, fastdora_chain, fastdora in separate processes
set -uo pipefail
source benchmarks/_env.sh
t0=$(date +%s)
ab() {
  for setup in amp bf16; do
    timeout 240 python benchmarks/stall_probe.py --setup $setup --rounds ${ROUNDS:-7} --conditions default \
      --variants ${VARIANTS:-lora,fastdora_chain,fastdora} --out $OUT/stall_${setup}.json 2>&1 \
      | grep -v -e '^{' -e Warn -e _warn_once > $OUT/stall_${setup}.log
    tail -4 $OUT/stall_${setup}.log
    echo "stall $setup $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
  done
}
case "${1:-first}" in
  first)
    timeout 420 python -m pytest tests -m gpu -q -p no:cacheprovider -rf 2>&1 > $OUT/gpu_tests_full.log
    tail -12 $OUT/gpu_tests_full.log | tee $OUT/gpu_tests.log
    echo "tests $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    ab
    ;;
  ab)
    if [ -n "${TESTS:-}" ]; then
      timeout 300 python -m pytest $TESTS -m gpu -q -p no:cacheprovider -rf 2>&1 > $OUT/gpu_tests_full.log
      tail -12 $OUT/gpu_tests_full.log | tee $OUT/gpu_tests.log
      echo "tests $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    fi
    ab ;;
  final)
    timeout 170 python -m pytest tests/test_gpu_layers.py tests/test_kernels_gpu.py -m gpu -q -p no:cacheprovider -rf \
      -k "Layer or layer or lean or graph or norm or dispatch or compile or gradcheck" 2>&1 > $OUT/gpu_tests_full.log
    tail -6 $OUT/gpu_tests_full.log | tee $OUT/gpu_tests.log
    echo "tests $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    timeout 250 python benchmarks/model_bench.py --out /tmp/mb --plan final --budget-s ${BENCH_S:-200} > $OUT/mb.log 2>&1
    cp /tmp/mb/model_bench.json /tmp/mb/model_bench.md /tmp/mb/model_bench.png $OUT/ 2>/dev/null
    grep "^| qwen\|MISS\|PASS" $OUT/mb.log | tail -16
    echo "bench $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    ab
    timeout 100 python benchmarks/model_bench.py --out /tmp/mb16 --plan r16 --budget-s ${R16_S:-60} > $OUT/mb_r16.log 2>&1
    cp /tmp/mb16/model_bench.json $OUT/model_bench_r16.json 2>/dev/null
    grep "^| qwen" $OUT/mb_r16.log | tail -4
    ;;
  bench)
    python benchmarks/model_bench.py --out /tmp/mb --plan final --budget-s ${BENCH_S:-200} > $OUT/mb.log 2>&1
    cp /tmp/mb/model_bench.json /tmp/mb/model_bench.md /tmp/mb/model_bench.png $OUT/ 2>/dev/null
    grep "^| qwen\|MISS\|PASS" $OUT/mb.log | tail -24
    if [ "${R16_S:-0}" -gt 0 ]; then
      python benchmarks/model_bench.py --out /tmp/mb16 --plan r16 --budget-s $R16_S > $OUT/mb_r16.log 2>&1
      cp /tmp/mb16/model_bench.json $OUT/model_bench_r16.json 2>/dev/null
      grep "^| qwen" $OUT/mb_r16.log | tail -6
    fi
    ;;
  host)
    timeout 300 python benchmarks/host_probe.py --setup ${SETUP:-amp} --variants lora,fastdora_chain,fastdora \
      --out $OUT/host 2>&1 | grep -v -e Warn -e _warn_once > $OUT/host_probe.log
    grep "####\|one iteration\|host under" $OUT/host_probe.log
    ;;
esac
echo "total $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
