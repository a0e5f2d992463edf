#!/usr/bin/env bash
# Device script (session 20, nvidia-h200), from the repository root. OLD_PKG (default .carry/prevpkg) holds the
# previous release's core/ as OLD_PKG/fastdora (variant fastdora_old), made with:
#   mkdir -p .carry/prevpkg && git archive c10df6b core | tar -x -C /tmp && mv /tmp/core .carry/prevpkg/fastdora
#
#   bash benchmarks/run_s20.sh first   the GPU suite (-m gpu); LoRA, fastdora_old and fastdora in ONE process per
#                                      setup, interleaved iteration by iteration (stall_probe.py, ROUNDS, default 5);
#                                      where the GPU idles in 4 back-to-back micro-batches, pure bf16, LoRA vs fastdora
#                                      (enqueue_probe.py --gaps)
#   bash benchmarks/run_s20.sh check   graph_gc_probe.py (which objects' destruction fails a stream capture), then the
#                                      GPU layer tests (tests/test_gpu_layers.py: norm graphs, lean forward, checkpoint)
#   bash benchmarks/run_s20.sh bench   model_bench.py plan final (BENCH_S budget, default 330: LoRA and fastdora in
#                                      two alternating processes each per setup, then PEFT DoRA), then plan r16 (R16_S,
#                                      default 60)
#   bash benchmarks/run_s20.sh check_bench   both, in one call (session 20 call 3: BENCH_S=300 R16_S=0)
#   bash benchmarks/run_s20.sh final   graph_gc_probe.py, then the whole GPU suite (-m gpu)
set -uo pipefail
source benchmarks/_env.sh
t0=$(date +%s)
OLD_PKG=${OLD_PKG:-.carry/prevpkg}
case "${1:-first}" in
  first)
    timeout ${TESTS_S:-330} python -m pytest tests -m gpu -q -p no:cacheprovider -rf 2>&1 > $OUT/gpu_tests_full.log
    tail -12 $OUT/gpu_tests_full.log
    echo "tests $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    for setup in bf16 amp; do
      timeout 150 python benchmarks/stall_probe.py --setup $setup --rounds ${ROUNDS:-5} --conditions default \
        --variants lora,fastdora_old,fastdora --old-pkg $OLD_PKG --out $OUT/stall_${setup}.json 2>&1 \
        | grep -v -e '^{' -e Warn -e _warn_once > $OUT/stall_${setup}.log
      tail -4 $OUT/stall_${setup}.log
      echo "stall $setup $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    done
    timeout 120 python benchmarks/enqueue_probe.py --setup bf16 --layers 8 --rounds 2 --gaps 4 \
      --variants lora,fastdora --out $OUT/gaps_bf16.json 2>&1 | grep -v -e Warn -e _warn_once > $OUT/gaps_bf16.log
    grep -A14 "idle gaps" $OUT/gaps_bf16.log
    ;;
  final)
    timeout 60 python benchmarks/graph_gc_probe.py --out $OUT/graph_gc_probe.json 2>&1 | grep -v Warn
    timeout ${TESTS_S:-400} python -m pytest tests -m gpu -q -p no:cacheprovider -rf 2>&1 > $OUT/gpu_tests_full.log
    tail -12 $OUT/gpu_tests_full.log
    echo "tests $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    ;;
  check|check_bench)
    timeout 60 python benchmarks/graph_gc_probe.py --out $OUT/graph_gc_probe.json 2>&1 | grep -v Warn
    timeout 120 python -m pytest tests/test_gpu_layers.py -m gpu -q -p no:cacheprovider -rf 2>&1 > $OUT/gpu_layer_tests.log
    tail -4 $OUT/gpu_layer_tests.log
    echo "check $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    ;;&
  bench|check_bench)
    timeout $(( ${BENCH_S:-330} + 60 )) python benchmarks/model_bench.py --out /tmp/mb --plan final \
      --budget-s ${BENCH_S:-330} > $OUT/mb.log 2>&1
    cp /tmp/mb/model_bench.json /tmp/mb/model_bench.md /tmp/mb/model_bench.png $OUT/ 2>/dev/null
    grep "^| qwen\|MISS\|PASS\|^- qwen" $OUT/mb.log | tail -30
    echo "bench $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    if [ "${R16_S:-60}" -gt 0 ]; then
      timeout $(( ${R16_S:-60} + 60 )) python benchmarks/model_bench.py --out /tmp/mb16 --plan r16 \
        --budget-s ${R16_S:-60} > $OUT/mb_r16.log 2>&1
      cp /tmp/mb16/model_bench.json $OUT/model_bench_r16.json 2>/dev/null
      grep "^| qwen" $OUT/mb_r16.log | tail -6
    fi
    ;;
esac
echo "total $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
