#!/usr/bin/env bash
# Device script (session 18, nvidia-h200), from the repository root:
#   bash benchmarks/run_s18.sh tests   the GPU suite (-m gpu) and launch_cost.py (host cost of the kernel path's pieces)
#   bash benchmarks/run_s18.sh ab      GPU layer tests, then LoRA, this checkout and an earlier package (OLD_PKG, default
#                                      .carry/s17 holding ca1e155's core/ as fastdora/) in ONE process per setup,
#                                      interleaved iteration by iteration (stall_probe.py, AMP then pure bf16 with
#                                      PEFT DoRA), then the model bench's r=384 targets (plan final, one process per
#                                      variant)
#   bash benchmarks/run_s18.sh final   the GPU suite, then what "ab" runs
#   bash benchmarks/run_s18.sh bench   model_bench.py plan final (r=384 targets, BENCH_S budget), then plan r16 (R16_S)
#   bash benchmarks/run_s18.sh fused   benchmarks/fused_reduce_probe.py: the backward's fused second stage vs two kernels
set -uo pipefail
source benchmarks/_env.sh
t0=$(date +%s)
OLD=${OLD_PKG:-.carry/s17}
case "${1:-tests}" in
  tests)
    timeout 420 python -m pytest tests -m gpu -q -p no:cacheprovider -rf 2>&1 > $OUT/gpu_tests_full.log
    tail -25 $OUT/gpu_tests_full.log | tee $OUT/gpu_tests.log
    echo "tests $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    timeout 90 python benchmarks/launch_cost.py --out $OUT/launch_cost.json 2>&1 | grep -v Warn > $OUT/launch_cost.log
    tail -30 $OUT/launch_cost.log
    ;;
  final|ab)
    if [ "$1" = final ]; then
      timeout 330 python -m pytest tests -m gpu -q -p no:cacheprovider -rf 2>&1 > $OUT/gpu_tests_full.log
      tail -8 $OUT/gpu_tests_full.log | tee $OUT/gpu_tests.log
    fi
    timeout 100 python -m pytest tests/test_gpu_layers.py tests/test_kernels_gpu.py -k "layer or fused or Layer" -m gpu -q \
      -p no:cacheprovider -rf 2>&1 | tail -5 \
      | tee $OUT/gpu_layer_tests.log
    echo "tests $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    for setup in amp bf16; do
      v=lora,fastdora,fastdora_old; [ $setup = bf16 ] && v=$v,peft_dora
      timeout 200 python benchmarks/stall_probe.py --setup $setup --rounds ${ROUNDS:-7} --conditions default \
        --variants $v --old-pkg $OLD --out $OUT/stall_${setup}.json 2>&1 \
        | grep -v -e '^{' -e Warn -e _warn_once > $OUT/stall_${setup}.log
      tail -6 $OUT/stall_${setup}.log
      echo "stall $setup $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    done
    if [ "${BENCH_S:-0}" -gt 0 ]; then
      python benchmarks/model_bench.py --out /tmp/mb --plan final --budget-s $BENCH_S > $OUT/mb.log 2>&1
      cp /tmp/mb/model_bench.json /tmp/mb/model_bench.md /tmp/mb/model_bench.png $OUT/ 2>/dev/null
      grep -v "^$" $OUT/mb.log | tail -30
    fi
    ;;
  bench)
    python benchmarks/model_bench.py --out /tmp/mb --plan final --budget-s ${BENCH_S:-130} > $OUT/mb.log 2>&1
    cp /tmp/mb/model_bench.json /tmp/mb/model_bench.md /tmp/mb/model_bench.png $OUT/ 2>/dev/null
    grep "^| qwen\|MISS\|PASS" $OUT/mb.log | tail -24
    python benchmarks/model_bench.py --out /tmp/mb16 --plan r16 --budget-s ${R16_S:-70} > $OUT/mb_r16.log 2>&1
    cp /tmp/mb16/model_bench.json $OUT/model_bench_r16.json 2>/dev/null
    grep "^| qwen" $OUT/mb_r16.log | tail -6
    ;;
  fused)
    timeout 200 python benchmarks/fused_reduce_probe.py --out $OUT/fused_reduce.json 2>&1 | grep -v Warn \
      | tee $OUT/fused_reduce.log
    ;;
esac
echo "total $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
