#!/usr/bin/env bash
# Device script (session 21, nvidia-h200), from the repository root. OLD_PKG (default .carry/prevpkg) holds session
# 20's core/ (the Python composition node) as OLD_PKG/fastdora (variant fastdora_old), made with:
#   mkdir -p .carry/prevpkg /tmp/s21old && git archive c7951bf core | tar -x -C /tmp/s21old \
#     && mv /tmp/s21old/core .carry/prevpkg/fastdora
# Run with carry [".carry/prevpkg"]. The C++ composition node is built on the device (FASTDORA_CACHE_DIR below).
#
#   bash benchmarks/run_s21.sh first   the C++ node's GPU tests (tests/test_native_node.py) and the GPU layer tests;
#                                      LoRA, fastdora_old (Python node) and fastdora (C++ node) in ONE process per
#                                      setup, interleaved iteration by iteration (stall_probe.py, ROUNDS, default 5)
#   bash benchmarks/run_s21.sh bench   model_bench.py plan final (BENCH_S, default 300), then plan r16 (R16_S, 60)
#   bash benchmarks/run_s21.sh final   the whole GPU suite (-m gpu)
set -uo pipefail
source benchmarks/_env.sh
export FASTDORA_CACHE_DIR=${FASTDORA_CACHE_DIR:-/tmp/fdcache}
t0=$(date +%s)
OLD_PKG=${OLD_PKG:-.carry/prevpkg}
case "${1:-first}" in
  first)
    python -c "import time, fastdora.kernels.native as n; t = time.time(); n.node(required=True); \
print('C++ node', n.status(), 'built/imported in %.1f s' % (time.time() - t))" 2>&1 | tail -3
    timeout ${TESTS_S:-200} python -m pytest tests/test_native_node.py tests/test_gpu_layers.py -m gpu -q \
      -p no:cacheprovider -rf 2>&1 > $OUT/gpu_tests.log
    tail -6 $OUT/gpu_tests.log
    echo "tests $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    for setup in bf16 amp; do
      timeout 170 python benchmarks/stall_probe.py --setup $setup --rounds ${ROUNDS:-5} --conditions default \
        --variants lora,fastdora_old,fastdora --old-pkg $OLD_PKG --out $OUT/stall_${setup}.json 2>&1 \
        | grep -v -e '^{' -e Warn -e _warn_once > $OUT/stall_${setup}.log
      tail -4 $OUT/stall_${setup}.log
      echo "stall $setup $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    done
    ;;
  bench)
    timeout $(( ${BENCH_S:-300} + 60 )) python benchmarks/model_bench.py --out /tmp/mb --plan final \
      --budget-s ${BENCH_S:-300} > $OUT/mb.log 2>&1
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
  final)
    timeout ${TESTS_S:-420} python -m pytest tests -m gpu -q -p no:cacheprovider -rf 2>&1 > $OUT/gpu_tests_full.log
    tail -12 $OUT/gpu_tests_full.log
    echo "tests $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    ;;
esac
echo "total $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
