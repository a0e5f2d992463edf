#!/usr/bin/env bash
# Device script (session 22, nvidia-h200), from the repository root; no carry needed. The C++ composition node is
# built on the device by the first fastdora worker (cached in FASTDORA_CACHE_DIR for the later ones).
#
#   bash benchmarks/run_s22.sh harness   issue 5's whole harness in one go: model_bench.py --plan h200 (BENCH_S,
#                                        default 520 s of configs launched; every row of the issue incl. full depth);
#                                        SPAWN=fork (default: workers forked from a parent that imported
#                                        torch/transformers/PEFT once; not run on the device yet) or exec (a fresh
#                                        interpreter per worker, importing after "go"). Calls 1 and 3 ran ba32973's
#                                        exec design: the next worker imported while the current one was measured.
#   bash benchmarks/run_s22.sh suite     the whole GPU suite (-m gpu), then model_bench --plan final (FINAL_S, 0 = off)
set -uo pipefail
source benchmarks/_env.sh
export FASTDORA_CACHE_DIR=${FASTDORA_CACHE_DIR:-/tmp/fdcache}
t0=$(date +%s)
source benchmarks/_bench.sh  # bench PLAN BUDGET_S [model_bench arguments]
case "${1:-harness}" in
  harness)
    bench h200 ${BENCH_S:-520} --spawn ${SPAWN:-fork}
    ;;
  suite)
    timeout ${TESTS_S:-420} python -m pytest tests -m gpu -q -p no:cacheprovider -rf 2>&1 > $OUT/gpu_tests_full.log
    tail -12 $OUT/gpu_tests_full.log
    echo "tests $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    [ "${FINAL_S:-0}" -gt 0 ] && bench final ${FINAL_S}
    ;;
esac
echo "total $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
